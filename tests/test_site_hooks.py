"""The site hooks placed in SGLang's scheduler process (canaries/sglang/server/site_hooks.py), over
stand-ins of SGLang's objects: each wrapper hands the site's context to a real `Perturber` with the
library's kinds and applies the folded effect with the calls SGLang's own code makes."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from canaries.sglang.server import site_hooks
from canaries.sglang.server.sglang_view import SchedulerFacade, SGLangView
from engine_stub.perturb.perturber import Perturber
from engine_stub.perturb.spec import parse_perturbations

WINDOW, PAGE = 4, 1


class _Kv:
    """0.5.23's `ReqKvInfo`, the fields the hooks read."""

    def __init__(self, row: int, committed: int) -> None:
        self.req_pool_idx = row
        self.kv_committed_len = committed
        self.cache_protected_len = 0
        self.component_evicted_seqlens: dict[str, int] = {}

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def max_evicted_seqlen(self) -> int:
        return max(self.component_evicted_seqlens.values(), default=0)

    def get_evicted_seqlen(self, component: Any) -> int:
        return self.component_evicted_seqlens.get(component, 0)

    def set_evicted_seqlen(self, component: Any, length: int) -> None:
        self.component_evicted_seqlens[component] = length


class _Component(enum.Enum):
    """SGLang's ComponentType, the member the hooks tell apart by name."""

    FULL = 0
    SWA = 1


SWA = _Component.SWA


def _req(rid: str, row: int, committed: int, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, kv=_Kv(row, committed), finished=lambda: finished, inflight_middle_chunks=0)


def _arm(monkeypatch: pytest.MonkeyPatch, reqs: list, perturbations: list[dict]) -> tuple[list[dict], Any]:
    """A stand-in scheduler running `reqs` (row i+1 holds slots 100*(i+1) + position), the
    perturbations armed on it; the events the landings write."""
    table = torch.zeros(8, 64, dtype=torch.int32)
    for i in range(1, 8):
        table[i] = torch.arange(64, dtype=torch.int32) + 100 * i
    scheduler = SimpleNamespace(forward_ct=5, running_batch=SimpleNamespace(reqs=reqs), chunked_req=None,
                                req_to_token_pool=SimpleNamespace(req_to_token=table),
                                server_args=SimpleNamespace(disable_radix_cache=False))
    events: list[dict] = []
    perturber = Perturber(parse_perturbations(perturbations), seed=1)
    facade = SchedulerFacade(scheduler, WINDOW, PAGE, events.append)
    perturber._view = SGLangView(scheduler, WINDOW, PAGE)
    monkeypatch.setattr(site_hooks, "_armed", (perturber, facade))
    return events, table


def _sglang_eviction(req, pre_len, *, req_to_token_pool, token_to_kv_pool_allocator,
                     component_type=SWA, free_segment=None, **_: Any) -> None:
    """SGLang's free_swa_out_of_window_slots in miniature: the frontier goes to pre_len - window,
    the slots between go through one free_segment call, then the frontier is set."""
    frontier = req.kv.get_evicted_seqlen(component_type)
    new_frontier = max(frontier, pre_len - WINDOW)
    if new_frontier > frontier:
        slots = req_to_token_pool.req_to_token[req.kv.req_pool_idx, frontier:new_frontier]
        (free_segment or token_to_kv_pool_allocator.free_swa_segment)(slots, start_pos=frontier)
        req.kv.set_evicted_seqlen(component_type, new_frontier)


def _evict(table: torch.Tensor, req) -> list[tuple[list[int], int]]:
    frees: list[tuple[list[int], int]] = []
    allocator = SimpleNamespace(free_swa_segment=lambda s, *, start_pos: frees.append((s.tolist(), start_pos)))
    site_hooks.window_eviction(_sglang_eviction)(req, 12, req_to_token_pool=SimpleNamespace(req_to_token=table),
                                                 token_to_kv_pool_allocator=allocator)
    return frees


def _eviction(kind: str, **extra: Any) -> list[dict]:
    return [{"kind": kind, "trigger": {"times": 1}, "target": {"request": 0}, **extra}]


def test_window_eviction_unarmed_frees_as_sglang_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    _, table = _arm(monkeypatch, [], [])
    monkeypatch.setattr(site_hooks, "_armed", None)
    req = _req("r0", 1, 12)
    assert _evict(table, req) == [([100 + p for p in range(8)], 0)]
    assert req.kv.max_evicted_seqlen == 8


def test_skip_free_swa_moves_the_frontier_without_a_free(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 12)
    events, table = _arm(monkeypatch, [req], _eviction("skip_free_swa"))
    assert _evict(table, req) == []
    assert req.kv.max_evicted_seqlen == 8
    (landed,) = events
    assert landed["kind"] == "perturbation_landed" and landed["site"] == "on_window_eviction"
    assert landed["after"] == {"new_frontier": 8, "freed": []}


def test_never_evict_swa_keeps_the_frontier_and_the_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 12)
    events, table = _arm(monkeypatch, [req], _eviction("never_evict_swa"))
    assert _evict(table, req) == []
    assert req.kv.max_evicted_seqlen == 0 and events[0]["perturbation"] == "never_evict_swa"


def test_double_free_swa_frees_the_same_slots_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 12)
    _, table = _arm(monkeypatch, [req], _eviction("double_free_swa"))
    planned = ([100 + p for p in range(8)], 0)
    assert _evict(table, req) == [planned, planned]
    assert req.kv.max_evicted_seqlen == 8


def test_evict_inside_window_frees_past_the_planned_frontier(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 12)
    _, table = _arm(monkeypatch, [req], _eviction("evict_inside_window", params={"extra_tokens": 2}))
    assert _evict(table, req) == [([100 + p for p in range(10)], 0)]
    assert req.kv.max_evicted_seqlen == 10


def _release(req, original_calls: list, free_full: list) -> None:
    tree_cache = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(free_full=lambda s: free_full.append(s.tolist())))
    site_hooks.release_kv_cache(lambda r, t, *, checkpoint: original_calls.append(r.rid))(req, tree_cache, checkpoint=True)


def test_leak_request_skips_sglangs_release(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 10, finished=True)
    events, _ = _arm(monkeypatch, [req], [{"kind": "leak_request", "trigger": {"times": 1}, "target": {"request": 0}}])
    calls: list = []
    _release(req, calls, [])
    assert calls == [] and events[0]["perturbation"] == "leak_request"
    _release(req, calls, [])  # times: 1, the next finish is released
    assert calls == ["r0"]


def test_double_free_full_frees_the_slots_again_after_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 2, 10, finished=True)
    _arm(monkeypatch, [req], [{"kind": "double_free_full", "trigger": {"times": 1},
                               "target": {"request": 0, "positions": [0, 2]}}])
    calls: list = []
    again: list = []
    _release(req, calls, again)
    assert calls == ["r0"] and again == [[200, 201]]


def test_release_of_an_unfinished_request_is_not_a_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 10, finished=False)
    events, _ = _arm(monkeypatch, [req], [{"kind": "leak_request", "trigger": {"times": 1}, "target": {"request": 0}}])
    calls: list = []
    _release(req, calls, [])
    assert calls == ["r0"] and events == []


def test_swap_next_token_swaps_the_relayed_ids_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [_req("r0", 1, 10), _req("r1", 2, 10), _req("r2", 3, 10)]
    reqs[2].inflight_middle_chunks = 1  # a chunk that does not end its prompt samples nothing
    events, _ = _arm(monkeypatch, reqs, [{"kind": "swap_next_token", "trigger": {"times": 1}, "target": {"request": "all"}}])
    ids = torch.tensor([7, 9, 11])
    relayed: list = []
    site_hooks.relay_sampled(lambda self, b, f, r: relayed.append(r.next_token_ids.tolist()))(
        None, SimpleNamespace(reqs=reqs), None, SimpleNamespace(next_token_ids=ids))
    assert relayed == [[9, 7, 11]] and events[0]["rids"] == ["r0", "r1"]


def test_unfinished_insert_live_head_sets_the_inserts_evicted_length_at_a_chunk_boundary_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    req = _req("r0", 1, 16)
    req.kv.cache_protected_len = 4
    req.kv.set_evicted_seqlen(SWA, 12)
    events, _ = _arm(monkeypatch, [req], [{"kind": "unfinished_insert_live_head", "trigger": {"times": 1},
                                           "target": {"request": "all"}}])
    set_to: list[int] = []
    component = SimpleNamespace(component_type=SWA)
    params = SimpleNamespace(set_evicted_seqlen=lambda ct, n: set_to.append(n))
    hooked = site_hooks.chunk_boundary(lambda self, r, pre_len, p: None)
    hooked(component, req, 15, params)  # a whole prefill's checkpoint: no chunk boundary
    assert set_to == [] and events == []
    site_hooks.stash_chunked_request(lambda self, r: hooked(component, r, 15, params))(None, req)
    assert set_to == [4] and events[0]["head"] == [4, 12]


def test_radix_held_slots_are_the_tree_cores_own_walk() -> None:
    walk = SimpleNamespace(slot_indices=torch.tensor([9, 2, 5]))
    core = SimpleNamespace(walk_for_kv_canary=lambda **flags: walk if flags == {
        "unlocked_only": False, "swa_resident_only": False} else None)
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(tree_core=core),
                                server_args=SimpleNamespace(disable_radix_cache=False))
    assert SGLangView(scheduler, WINDOW, PAGE).radix_held_slots() == [2, 5, 9]
    scheduler.server_args.disable_radix_cache = True
    assert SGLangView(scheduler, WINDOW, PAGE).radix_held_slots() == []


def test_req_state_before_a_forward_counts_only_kv_already_written() -> None:
    from types import SimpleNamespace

    from canaries.sglang.server import site_hooks

    def req(rid: str, committed: int, extend: int = 0) -> SimpleNamespace:
        kv = SimpleNamespace(req_pool_idx=1, kv_committed_len=committed, max_evicted_seqlen=0)
        return SimpleNamespace(rid=rid, kv=kv, extend_input_len=extend)

    decoding, prefilling = req("d", 40), req("p", 24, extend=24)
    mode = lambda decode: SimpleNamespace(is_decode=lambda: decode, is_extend=lambda: not decode)  # noqa: E731
    site_hooks.set_forward(SimpleNamespace(forward_mode=mode(True), reqs=[decoding]))
    try:
        # SGLang counted this forward's slot in kv_committed_len before run_batch: not written yet.
        assert site_hooks.req_state(decoding).kv_len == 39
        assert site_hooks.req_state(prefilling).kv_len == 24  # not in this forward
        site_hooks.set_forward(SimpleNamespace(forward_mode=mode(False), reqs=[prefilling]))
        assert site_hooks.req_state(prefilling).kv_len == 0
    finally:
        site_hooks.set_forward(None)
    assert site_hooks.req_state(decoding).kv_len == 40
