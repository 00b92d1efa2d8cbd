"""Reachability: damage followed until read or dead; NOT_REACHED for a vacuous landing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from engine_stub.perturb.contract import Damage
from engine_stub.perturb.reach import ReachTracker, locations_of

VACUOUS = {
    "name": "vacuous", "seed": 11,
    "description": "an SWA byte flipped where nothing reads it before it is freed",
    "engine": {"profile": "cpu-tiny", "page_size": 1, "invariant_check": "strict", "kv_canary": "log"},
    "workload": {"requests": 4, "concurrency": 2, "prompt_tokens": [24, 40], "max_new_tokens": 40},
    "perturbations": [{"kind": "flip_kv_byte", "trigger": {"event": "first_swa_eviction", "times": 1},
                       "target": {"request": 1, "positions": "retained_unread", "group": "swa"}}],
    "expect": {"fires": ["kv_canary.verify_real_kv_hash"]},
}


def _tracker() -> tuple[ReachTracker, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    return ReachTracker(lambda kind, **fields: events.append((kind, fields))), events


def test_first_read_consumes_damage_and_names_the_reader() -> None:
    tracker, events = _tracker()
    tracker.track(0, 1, [Damage("kv_bytes", pool="swa", slot=5, pool_row=9)])
    tracker.read([("kv", "full", 9)], "not this one")
    assert events == []
    tracker.read([("kv", "swa", 9)], "a forward")
    assert events == [("perturbation_consumed", {"index": 0, "landing": 1, "damage": 0,
                                                 "damage_kind": "kv_bytes", "by": "a forward"})]
    assert not tracker.open


def test_damage_dies_once_every_location_is_killed_before_a_read() -> None:
    tracker, events = _tracker()
    kept = Damage("free_list", pool="swa", slot=7, detail="kept")
    assert set(locations_of(kept)) == {("count", "swa"), ("mapping", 7)}
    tracker.track(2, 1, [kept])
    tracker.kill([("mapping", 7)], "re-paired")
    assert events == [] and tracker.open  # the pool accounting still carries it
    tracker.close()
    assert events[0][0] == "perturbation_died" and "engine stopped" in events[0][1]["by"]


def test_damage_resolved_together_is_one_event_a_kind_with_its_count() -> None:
    tracker, events = _tracker()
    kept = [Damage("free_list", pool="swa", slot=s, detail="kept") for s in (16, 17, 18)]
    tracker.track(0, 1, [Damage("frontier", request="r0"), *kept])
    tracker.track(0, 2, [Damage("free_list", pool="swa", slot=19, detail="kept")])
    tracker.read([("count", "swa"), ("frontier", "r0")], "the census")
    assert events == [
        ("perturbation_consumed", {"index": 0, "landing": 1, "damage": 1, "damage_kind": "free_list",
                                   "by": "the census", "count": 3}),
        ("perturbation_consumed", {"index": 0, "landing": 2, "damage": 0, "damage_kind": "free_list",
                                   "by": "the census"}),
        ("perturbation_consumed", {"index": 0, "landing": 1, "damage": 0, "damage_kind": "frontier",
                                   "by": "the census"})]
    assert not tracker.open
    tracker.track(1, 1, [Damage("kv_bytes", pool="full", slot=s, pool_row=s) for s in (3, 4)])
    tracker.close()
    assert events[-1] == ("perturbation_died", {"index": 1, "landing": 1, "damage": 0, "damage_kind": "kv_bytes",
                                                "by": "the engine stopped before anything read it", "count": 2})


def test_a_switch_is_consumed_at_its_landing() -> None:
    tracker, events = _tracker()
    tracker.track(0, 1, [Damage("switch", before=False, after=True, detail="revert")])
    assert events[0][0] == "perturbation_consumed" and not tracker.open


def _run(tmp_path: Path, doc: dict) -> dict:
    from canaries.cli import main as canary

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    canary(["run", str(path), "--report-dir", str(tmp_path / "report")])
    return json.loads((tmp_path / "report" / doc["name"] / "verdict.json").read_text())


@pytest.mark.slow
def test_a_flip_nothing_reads_is_not_reached_and_the_same_flip_in_window_is_detected(tmp_path) -> None:
    # The case that once said MISSED: a retained-but-unread SWA position; the next forward does
    # not read it, the canary's TAIL window starts past it, and the next eviction frees it.
    unread = _run(tmp_path / "a", VACUOUS)
    assert unread["verdict"] == "NOT_REACHED", unread["reason"]
    assert "died unread" in unread["reason"] and "freed" in unread["reason"]
    read = dict(VACUOUS, name="in-window")
    read["perturbations"] = [{**VACUOUS["perturbations"][0],
                              "target": {"request": 1, "positions": "in_window", "group": "swa"}}]
    assert _run(tmp_path / "b", read)["verdict"] == "DETECTED"


@pytest.mark.slow
def test_every_library_landing_reaches_a_reader(tmp_path) -> None:
    from canaries.cli import main as canary
    from canaries.report.jsonl import read_verdicts

    report = tmp_path / "library"
    canary(["run", "--jobs", "2", "--report-dir", str(report)])
    verdicts = {r["scenario"]: r["verdict"] for r in read_verdicts(report / "verdicts.jsonl")}
    assert "NOT_REACHED" not in verdicts.values(), verdicts
    for events_path in report.glob("*/events.jsonl"):
        kinds = [json.loads(line)["kind"] for line in events_path.read_text().splitlines()]
        if "perturbation_landed" in kinds:
            assert "perturbation_consumed" in kinds, f"{events_path.parent.name}: nothing consumed"


def _walked_reads(tracker: ReachTracker, phase: str, row: int, rid: str, lo_new: int, seq: int,
                  table: torch.Tensor, mapping: torch.Tensor) -> list[tuple]:
    """Every location a batch's reader meets, walking its row position by position (the
    definition `ReachTracker.batch` must agree with)."""
    window = tracker.window
    upto = lo_new if phase == "head" else seq
    if phase == "forward":
        full_lo, swa_lo = 0, max(0, lo_new - window + 1)
    else:
        full_lo, swa_lo = 0, max(0, upto - window)
    reads = [("table", row, p) for p in range(min(full_lo, swa_lo), upto)]
    if phase == "forward":
        reads.append(("token", rid, lo_new))
    full_slots = table[row, full_lo:upto].tolist()
    swa_slots = table[row, swa_lo:upto].tolist()
    if phase != "head":
        reads += [("kv", "full", s) for s in full_slots]
        reads += [("kv", "swa", int(mapping[s])) for s in swa_slots]
    reads += [loc for s in swa_slots for loc in (("mapping", s), ("swa_read", s))]
    return reads


def test_batch_reads_exactly_what_a_walk_of_its_rows_reads_in_the_same_order() -> None:
    import random

    rng = random.Random(7)
    for case in range(200):
        table = torch.tensor([rng.sample(range(1, 300), 64) for _ in range(3)], dtype=torch.int32)
        table[1, rng.randrange(64)] = table[1, rng.randrange(64)]  # a slot named twice
        mapping = torch.tensor([0] + rng.sample(range(1, 1000), 299), dtype=torch.int64)
        seq = rng.randrange(2, 64)
        lo_new = seq - rng.choice([1, 1, rng.randrange(1, seq + 1)])
        phase = rng.choice(["head", "forward", "tail"])
        damage = []
        for _ in range(rng.choice([1, 3, 12])):
            pick = rng.randrange(5)
            if pick == 0:
                damage.append(Damage("req_to_token", row=1, position=rng.randrange(64)))
            elif pick == 1:
                damage.append(Damage("kv_bytes", pool="full", pool_row=int(table[1, rng.randrange(64)])))
            elif pick == 2:
                damage.append(Damage("kv_bytes", pool="swa", pool_row=int(mapping[int(table[1, rng.randrange(64)])])))
            elif pick == 3:
                damage.append(Damage("mapping", slot=int(table[1, rng.randrange(64)])))
            else:
                damage.append(Damage("sampled_token", request="r1", position=rng.randrange(64)))
        tracker, events = _tracker()
        tracker.configure(window=rng.choice([4, 16]), page_size=1, layer_pattern="SF", canary=True)
        reference, ref_events = _tracker()
        reference.configure(window=tracker.window, page_size=1, layer_pattern="SF", canary=True)
        for i, d in enumerate(damage):
            tracker.track(0, i, [d])
            reference.track(0, i, [d])
        tracker.batch(phase, [1], [lo_new], [seq], table, mapping, ["r1"])
        reference.read(_walked_reads(reference, phase, 1, "r1", lo_new, seq, table, mapping), "walk")
        assert [f["landing"] for _, f in events] == [f["landing"] for _, f in ref_events], case
