"""Reachability: damage followed until read or dead; NOT_REACHED for a vacuous landing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
