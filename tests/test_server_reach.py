"""Reachability inside SGLang's scheduler (canaries/sglang/server/reach.py and the readers the site
hooks and the plugin report), over stand-ins of SGLang's objects: each reader consumes the damage it
reads and no other, and what nothing read dies only once the workload is over. The server-side
cases (a flip nothing reads is NOT_REACHED on SGLang's real server, the same flip in the window
DETECTED) are at the end; they need SGLang 0.5.23's server venv."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from canaries.sglang.server import lockstep, scheduler_plugin, site_hooks
from canaries.sglang.server import reach as server_reach
from engine_stub.perturb.contract import Damage

WINDOW = 4
ROW = 1


class _Mode:
    def __init__(self, decode: bool) -> None:
        self._decode = decode

    def is_decode(self) -> bool:
        return self._decode

    def is_extend(self) -> bool:
        return not self._decode


class _Kv:
    def __init__(self, committed: int) -> None:
        self.req_pool_idx = ROW
        self.kv_committed_len = committed
        self.kv_allocated_len = committed
        self.cache_protected_len = 0
        self.max_evicted_seqlen = 0
        self.holds_kv = True

    def get_evicted_seqlen(self, component: Any) -> int:
        return 0

    def set_evicted_seqlen(self, component: Any, length: int) -> None:
        self.max_evicted_seqlen = length


class _Allocator:
    """SGLang's hybrid allocator in miniature: its frees record themselves; `free` goes through
    the instance's own `free_swa` and `free_full`, as SGLang's does."""

    page_size = 1

    def __init__(self) -> None:
        # full slot s <-> SWA row s + 1000 (0: the padding slot)
        self.full_to_swa_index_mapping = torch.tensor([0] + [s + 1000 for s in range(1, 128)], dtype=torch.int64)
        self.calls: list[tuple[str, list[int]]] = []

    def free(self, index: torch.Tensor) -> None:
        self.free_swa(index)
        self.free_full(index)

    def free_swa(self, index: torch.Tensor) -> None:
        self.calls.append(("free_swa", index.tolist()))

    def free_full(self, index: torch.Tensor) -> None:
        self.calls.append(("free_full", index.tolist()))

    def free_segment(self, index: torch.Tensor, *, start_pos: int) -> None:
        self.calls.append(("free_segment", index.tolist()))


def _scheduler(reqs: list, tree_slots: list[int] | None = None) -> SimpleNamespace:
    table = torch.zeros(4, 64, dtype=torch.int32)
    table[ROW] = torch.arange(64, dtype=torch.int32) + 1  # position p -> full slot p + 1
    walk = SimpleNamespace(slot_indices=torch.tensor(tree_slots or [], dtype=torch.int64))
    core = SimpleNamespace(walk_for_kv_canary=lambda **_: walk)
    return SimpleNamespace(token_to_kv_pool_allocator=_Allocator(),
                           req_to_token_pool=SimpleNamespace(req_to_token=table),
                           running_batch=SimpleNamespace(reqs=reqs), chunked_req=None,
                           tree_cache=SimpleNamespace(tree_core=core),
                           server_args=SimpleNamespace(disable_radix_cache=False))


def _req(rid: str = "r0", committed: int = 11, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, kv=_Kv(committed), finished=lambda: finished)


def _armed(monkeypatch: pytest.MonkeyPatch, scheduler: Any, damage: list[Damage], *,
           census: bool = True) -> tuple[server_reach.ServerReach, list[tuple[str, dict]]]:
    """The scheduler's reachability armed with `damage` landed (landing i: damage[i])."""
    events: list[tuple[str, dict]] = []
    perturber = SimpleNamespace(reach=None, sites=set())
    monkeypatch.setattr(server_reach, "_reach", None)
    reach = server_reach.arm(scheduler, perturber, lambda kind, **f: events.append((kind, f)),
                             window=WINDOW, canary=True, census=census)
    monkeypatch.setattr(site_hooks, "_armed", (perturber, None))
    for i, d in enumerate(damage):
        reach.tracker.track(0, i + 1, [d])
    return reach, events


def _fate(events: list[tuple[str, dict]]) -> dict[int, tuple[str, str]]:
    """{landing: (consumed|died, by)}."""
    return {f["landing"]: (kind.removeprefix("perturbation_"), f["by"]) for kind, f in events}


def _swa_row(position: int) -> int:
    return position + 1 + 1000


def _decode_batch(req: Any) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=_Mode(decode=True), reqs=[req],
                           out_cache_loc=torch.tensor([req.kv.kv_committed_len], dtype=torch.int64))


def test_forward_reads_the_row_and_the_one_key_wider_window_of_sglangs_sliding_layers(monkeypatch) -> None:
    # Decode of position 10 (written 0..9): torch_native's sliding layers attend 10 - 4 .. 10.
    req = _req(committed=11)
    damage = [Damage("kv_bytes", pool="swa", pool_row=_swa_row(6)),   # q - window: read by SGLang only
              Damage("kv_bytes", pool="swa", pool_row=_swa_row(5)),   # out of SGLang's window too
              Damage("kv_bytes", pool="full", pool_row=1),            # position 0, full layers read all
              Damage("req_to_token", row=ROW, position=3),
              Damage("kv_bytes", pool="full", pool_row=11)]           # the slot this forward writes
    reach, events = _armed(monkeypatch, _scheduler([req]), damage)
    site_hooks.set_forward(_decode_batch(req))
    try:
        reach.batch(_decode_batch(req))
    finally:
        site_hooks.set_forward(None)
    fate = _fate(events)
    assert fate[1] == ("consumed", "a forward") and fate[3] == ("consumed", "a forward")
    assert 2 not in fate
    assert fate[4][0] == "consumed"
    assert fate[5] == ("died", "overwritten by a forward's KV write")


def test_radix_sweep_reads_the_tree_slots_only_when_a_pass_ran(monkeypatch) -> None:
    reach, events = _armed(monkeypatch, _scheduler([], tree_slots=[7]), [Damage("kv_bytes", pool="full", pool_row=7)])

    class Orchestrator:
        def __init__(self) -> None:
            self.sweep_passes = 0
            self.due = False

        def maybe_run_sweep(self) -> None:
            self.sweep_passes += int(self.due)

    scheduler_plugin._hook_sweep(SimpleNamespace(SweepOrchestrator=Orchestrator))
    orchestrator = Orchestrator()
    orchestrator.maybe_run_sweep()
    assert events == []
    orchestrator.due = True
    orchestrator.maybe_run_sweep()
    assert _fate(events) == {1: ("consumed", "the KV canary (SWEEP)")}


def test_allocator_is_wrapped_in_place_so_the_trees_frees_report_too(monkeypatch) -> None:
    scheduler = _scheduler([])
    allocator = scheduler.token_to_kv_pool_allocator
    tree = SimpleNamespace(token_to_kv_pool_allocator=allocator)  # holds the same object
    reach, events = _armed(monkeypatch, scheduler, [
        Damage("free_list", pool="full", slot=9, detail="freed_twice"),
        Damage("mapping", slot=12),
        Damage("kv_bytes", pool="swa", pool_row=1020)])
    server_reach.track_allocator(allocator, reach.tracker)  # a second arm wraps nothing twice
    tree.token_to_kv_pool_allocator.free_segment(torch.tensor([9, 12]), start_pos=0)
    tree.token_to_kv_pool_allocator.free(torch.tensor([20]))
    assert allocator.calls == [("free_segment", [9, 12]), ("free_swa", [20]), ("free_full", [20])]
    fate = _fate(events)
    assert fate[1] == ("consumed", "free_segment (its full side)")
    assert fate[2] == ("consumed", "free_segment (its SWA side)")
    assert fate[3] == ("died", "its SWA row was freed")


def test_census_pass_reads_mapping_free_lists_and_the_holders_rows(monkeypatch) -> None:
    holder = _req(committed=8)
    damage = [Damage("free_list", pool="full", slot=9, detail="freed_twice"),
              Damage("req_to_token", row=ROW, position=7),
              Damage("kv_bytes", pool="full", pool_row=3)]  # bytes: no census reads them
    reach, events = _armed(monkeypatch, _scheduler([holder]), damage)
    reach.census_pass("the census (after a batch)")
    fate = _fate(events)
    assert fate[1] == fate[2] == ("consumed", "the census (after a batch)")
    assert 3 not in fate


def test_idle_without_the_census_reads_only_what_sglangs_idle_check_reads(monkeypatch) -> None:
    damage = [Damage("free_list", pool="full", slot=9, detail="freed_twice"),
              Damage("free_list", pool="swa", slot=0, detail="kept"),
              Damage("mapping", slot=7)]
    reach, events = _armed(monkeypatch, _scheduler([], tree_slots=[7]), damage, census=False)
    reach.idle()
    fate = _fate(events)
    assert fate[2] == ("consumed", "the idle check") and fate[3] == ("consumed", "the idle check")
    assert 1 not in fate
    reach.census = True
    reach.idle()
    assert _fate(events)[1] == ("consumed", "the census (idle)")


def test_what_nothing_read_dies_once_the_workload_is_over_and_only_then(monkeypatch) -> None:
    reach, events = _armed(monkeypatch, _scheduler([]), [Damage("kv_bytes", pool="full", pool_row=3)])
    reach.close_if_over(lambda: False)
    assert events == [] and reach.tracker.open
    reach.close_if_over(lambda: True)
    reach.close_if_over(lambda: True)
    (fate,) = _fate(events).values()
    assert fate[0] == "died" and "workload over" in fate[1]


def test_site_hooks_report_eviction_release_and_a_chunks_insert_with_no_kind_at_their_site(monkeypatch) -> None:
    req = _req(committed=12, finished=True)
    scheduler = _scheduler([req])
    damage = [Damage("req_to_token", row=ROW, position=2), Damage("frontier", request="r0"),
              Damage("req_to_token", row=ROW, position=11), Damage("sampled_token", request="r0", position=12),
              Damage("req_to_token", row=ROW, position=10)]
    reach, events = _armed(monkeypatch, scheduler, damage)
    table = scheduler.req_to_token_pool.req_to_token

    def eviction(req, pre_len, *, req_to_token_pool, token_to_kv_pool_allocator, free_segment=None, **_: Any):
        if pre_len - WINDOW >= 4:  # SGLang read the frontier either way
            (free_segment or token_to_kv_pool_allocator.free_swa_segment)(req_to_token_pool.req_to_token[ROW, 0:4],
                                                                          start_pos=0)

    freed: list = []
    allocator = SimpleNamespace(free_swa_segment=lambda s, *, start_pos: freed.append(s.tolist()))
    tables = SimpleNamespace(req_to_token=table)
    site_hooks.window_eviction(eviction)(req, 6, req_to_token_pool=tables, token_to_kv_pool_allocator=allocator)
    assert freed == [] and _fate(events) == {2: ("consumed", "window eviction")}
    site_hooks.window_eviction(eviction)(req, 12, req_to_token_pool=tables, token_to_kv_pool_allocator=allocator)
    assert freed == [[1, 2, 3, 4]]
    assert _fate(events)[1] == ("consumed", "window eviction")
    site_hooks.stash_chunked_request(lambda self, r: None)(None, _req(committed=11))
    assert _fate(events)[5] == ("consumed", "the cache of a chunked request's processed part")
    reach.tracker.track(0, 6, [Damage("req_to_token", row=ROW, position=9)])
    site_hooks.checkpoint_into_tree(lambda self, r, *, up_to: None)(None, _req(committed=11), up_to=10)
    assert _fate(events)[6] == ("consumed", "the tree's insert of a request (checkpoint)")
    site_hooks.release_kv_cache(lambda r, t, *, checkpoint: None)(req, None, checkpoint=True)
    fate = _fate(events)
    assert fate[3] == ("consumed", "the release of a request")
    assert fate[4][0] == "consumed" and "answer" in fate[4][1]


def test_workload_is_over_once_every_planned_request_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "gate"
    notes = lockstep.GateNotes(path)
    gate = lockstep.LockstepGate(path)
    assert not gate.workload_over()  # no plan yet
    notes.planned([SimpleNamespace(rid=r, hang_up_after=None) for r in "ab"], concurrency=2)
    gate.finished.add("a")
    assert not gate.workload_over()
    notes.done("b")
    assert gate.workload_over()


# ---- on SGLang's real server ------------------------------------------------------------------

def _vacuous(positions: str) -> dict:
    """An SWA byte of a retained, unread position flipped (or one in the window): no radix cache,
    so nothing keeps the slot after the eviction frees it (the canary's sweep walks the tree)."""
    return {
        "name": f"flip-{positions}", "seed": 11,
        "description": "an SWA byte flipped; read by the next forward in the window, by nothing outside it",
        "engine": {"profile": "cpu-tiny", "page_size": 1, "invariant_check": "strict", "kv_canary": "log",
                   "radix_cache": False},
        "workload": {"requests": 4, "concurrency": 2, "prompt_tokens": [24, 40], "max_new_tokens": 40},
        "perturbations": [{"kind": "flip_kv_byte", "trigger": {"event": "first_swa_eviction", "times": 1},
                           "target": {"request": 1, "positions": positions, "group": "swa"}}],
        "expect": {"fires": ["kv_canary.verify_real_kv_hash"]},
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_on_sglangs_server_a_flip_nothing_reads_is_not_reached_and_one_in_the_window_is_detected(tmp_path) -> None:
    import json

    import yaml

    from canaries.runner import run_scenario
    from canaries.scenario import load_scenario
    from canaries.sglang.releases.venvs import find_python

    if find_python("0.5.23", server=True) is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    fates = {}
    for positions in ("retained_unread", "in_window"):
        path = tmp_path / f"{positions}.yaml"
        path.write_text(yaml.safe_dump(_vacuous(positions), sort_keys=False))
        record = run_scenario(load_scenario(path), tmp_path / positions, runtime="sglang-server")
        events = [json.loads(line) for line in (tmp_path / positions / "events.jsonl").read_text().splitlines()]
        fates[positions] = (record.verdict, record.reason,
                            [(e["kind"], e["by"]) for e in events if e["kind"].startswith("perturbation_") and "by" in e])
    verdict, reason, fate = fates["retained_unread"]
    assert verdict == "NOT_REACHED", reason
    assert fate == [("perturbation_died", "its SWA row was freed")]
    verdict, reason, fate = fates["in_window"]
    assert verdict == "DETECTED", reason
    assert fate == [("perturbation_consumed", "a forward")]
