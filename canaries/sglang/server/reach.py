"""Reachability inside SGLang's scheduler: each landing's damage followed until SGLang reads it or
it dies unread, so that MISSED and NOT_REACHED mean on SGLang's server what they mean on our
engine (the tracker, its locations and its rule: engine_stub/perturb/reach.py).

A read that is not reported turns MISSED into a false NOT_REACHED, so every reader is reported
where SGLang reads, and wherever SGLang's reader is wider than ours the report is widened to it,
never narrowed:

    reader                          reported at                                  reads
    a forward, and its KV canary    before `Scheduler.run_batch` (SGLang counts  every row position below the
      (HEAD and TAIL)               the batch's slots before it runs)            new length; the SWA layers'
                                                                                 window: torch_native attends
                                                                                 `q - window <= k <= q`, one
                                                                                 key more than ours
    the canary's radix sweep        after `SweepOrchestrator.maybe_run_sweep`    every slot the tree holds
                                    ran a pass
    window eviction                 its `free_segment` (site_hooks)              the row's evicted span, the
                                                                                 frontier
    a release (finish, abort,       `release_kv_cache` (site_hooks)              the row below its KV length,
      retraction)                                                                a finished answer's last token
    a chunked request's insert      `Scheduler.stash_chunked_request`            the row below its KV length
    the allocator's frees and       SGLang's allocator object, its methods       the mapping and the free list
      translations                  wrapped in place                             of the slots it frees
    SGLang's idle check             a fully idle pass, before its checks         the pools' counts, the tree's
                                                                                 slots' mapping
    the suite's census              before each of its passes (idle; STRICT      the whole mapping, every free
                                    after a batch that moved slots)              list, the counts, the rows and
                                                                                 frontiers of the requests

Killers are reported where they are cheap (a forward's KV writes, the wrapped frees and
allocations); one not reported keeps its damage open until the close, never consumed.

The close: at a fully idle pass once the lockstep gate has seen every planned request gone,
nothing reads the server's state again (the harness stops it at its next idle pass), so what is
still open died unread. Without the gate, or before the workload is over, nothing is closed: the
damage stays unresolved and the verdict stays MISSED.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from canaries.sglang.server.site_hooks import req_state
from engine_stub.perturb.reach import ReachTracker, TrackingAllocator

__all__ = ["ServerReach", "arm", "current", "track_allocator"]

# The wrapped allocator methods: SGLang's hybrid allocator's frees, allocations and mapping calls.
_TRACKED_METHODS = ("free", "free_swa", "free_full", "free_segment", "free_swa_segment", "free_full_segment",
                    "alloc", "alloc_extend", "alloc_decode", "translate_loc_from_full_to_swa",
                    "set_full_to_swa_mapping", "clear_full_to_swa_mapping")
# What the census reads whole (engine_stub/census.py over canaries/sglang/server/census.py).
_CENSUS_TAGS = ("count", "mapping", "free", "swa_read")


class _Originals:
    """An object's own methods, before they were wrapped in place: what a `TrackingAllocator`
    calls through to (anything else is the object's)."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_methods", {n: getattr(obj, n) for n in names if hasattr(obj, n)})

    def __getattr__(self, name: str) -> Any:
        methods = object.__getattribute__(self, "_methods")
        return methods[name] if name in methods else getattr(object.__getattribute__(self, "_obj"), name)


def track_allocator(allocator: Any, tracker: ReachTracker) -> None:
    """Wrap SGLang's allocator in place (every holder of it, the tree included, sees the
    wrappers): each method a `TrackingAllocator` knows reports its reads, frees and re-pairings
    first. Methods the release lacks are left alone."""
    if getattr(allocator, "__canary_tracked__", False):
        return
    tracking = TrackingAllocator(_Originals(allocator, _TRACKED_METHODS), tracker)
    for name in _TRACKED_METHODS:
        if hasattr(allocator, name):
            setattr(allocator, name, getattr(tracking, name))
    allocator.__canary_tracked__ = True


class _Path(NamedTuple):
    slots: torch.Tensor
    swa_live: torch.Tensor


class ServerReach:
    """The readers of one SGLang scheduler, reported to its `ReachTracker`."""

    def __init__(self, scheduler: Any, tracker: ReachTracker, *, census: bool) -> None:
        self.scheduler = scheduler
        self.tracker = tracker
        self.census = census
        self.closed = False

    @property
    def _mapping(self) -> torch.Tensor:
        return self.scheduler.token_to_kv_pool_allocator.full_to_swa_index_mapping

    @property
    def _table(self) -> torch.Tensor:
        return self.scheduler.req_to_token_pool.req_to_token

    def _tree_slots(self) -> torch.Tensor:
        core = getattr(getattr(self.scheduler, "tree_cache", None), "tree_core", None)
        if core is None or getattr(self.scheduler.server_args, "disable_radix_cache", False):
            return torch.empty(0, dtype=torch.int64)
        walk = core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
        return walk.slot_indices.to(torch.int64)

    def batch(self, batch: Any) -> None:
        """The batch about to run: the canary's HEAD, the forward (its KV writes first), the
        canary's TAIL. Called while `site_hooks.set_forward(batch)` holds (written lengths)."""
        tracker = self.tracker
        mode = getattr(batch, "forward_mode", None)
        if not tracker.open or mode is None or not (mode.is_decode() or mode.is_extend()):
            return
        reqs = [r for r in batch.reqs if r.kv.holds_kv]
        if not reqs:
            return
        rows = [int(r.kv.req_pool_idx) for r in reqs]
        written = [req_state(r).kv_len for r in reqs]
        seq = [int(r.kv.kv_committed_len) for r in reqs]
        rids = [str(r.rid) for r in reqs]
        table, mapping = self._table, self._mapping
        tracker.batch("head", rows, written, seq, table, mapping, rids)
        tracker.batch("forward", rows, written, seq, table, mapping, rids, out_slots=batch.out_cache_loc)
        tracker.batch("tail", rows, written, seq, table, mapping, rids)

    def swept(self) -> None:
        """The canary's radix sweep ran a pass: every slot the tree holds, both pools."""
        if not self.tracker.open:
            return
        slots = self._tree_slots()
        if slots.numel():
            self.tracker.sweep([_Path(slots, self._mapping[slots] > 0)], self._mapping)

    def idle(self) -> None:
        """A fully idle pass, before SGLang's checks and the census run."""
        tracker = self.tracker
        if not tracker.open:
            return
        tracker.idle([int(s) for s in self._tree_slots().tolist()])
        if self.census:
            self.census_pass("the census (idle)")

    def census_pass(self, by: str) -> None:
        """The census reads the whole mapping, the free lists and counts, and each row holder's
        row and frontier."""
        tracker = self.tracker
        if not tracker.open:
            return
        tracker.read_tagged(_CENSUS_TAGS, by)
        for req in _row_holders(self.scheduler):
            tracker.table_read(int(req.kv.req_pool_idx), str(req.rid), 0, int(req.kv.kv_allocated_len), by)

    def close_if_over(self, workload_over: Callable[[], bool]) -> None:
        """At a fully idle pass: once the workload is over, what is still open died unread."""
        if not self.closed and workload_over():
            self.closed = True
            self.tracker.close("the server went idle with the workload over before anything read it")


def _row_holders(scheduler: Any) -> list[Any]:
    batch = getattr(scheduler, "running_batch", None)
    reqs = list(getattr(batch, "reqs", None) or [])
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None and all(chunked is not r for r in reqs):
        reqs.append(chunked)
    return [r for r in reqs if getattr(r, "kv", None) is not None and r.kv.holds_kv]


_reach: ServerReach | None = None


def arm(scheduler: Any, perturber: Any, write: Callable[..., None], *, window: int, canary: bool,
        census: bool) -> ServerReach:
    """Follow `perturber`'s damage in this scheduler process (`write(kind, **fields)`: the event
    log, stamped with SGLang's step; `window`: the model's sliding window); its allocator is
    wrapped in place. The site hooks' readers (window eviction, release, a chunk's insert) reach
    the tracker through the perturber (`perturber.reach`)."""
    global _reach
    tracker = ReachTracker(write)
    # SGLang's sliding layers attend one key more than ours (module docstring).
    tracker.configure(window=window + 1, page_size=int(scheduler.token_to_kv_pool_allocator.page_size),
                      layer_pattern="SF", canary=canary)
    perturber.reach = tracker
    track_allocator(scheduler.token_to_kv_pool_allocator, tracker)
    _reach = ServerReach(scheduler, tracker, census=census)
    return _reach


def current() -> ServerReach | None:
    """This process's armed reachability, or None (no scenario, or another process)."""
    return _reach
