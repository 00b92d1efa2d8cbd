"""The suite's own census of SGLang's live memory state, inside SGLang's scheduler process.

SGLang's idle check is a ledger of sums (`available + evictable + protected == total`): a slot
the free list and the tree both own, a page freed on two paths, a lock that outlives its
request all leave it balanced. The engine's census (engine_stub/census.py) reads owners instead:
one owner for every full and SWA slot, the mapping a bijection between live full slots and
SWA slots, locks held only by the requests, the ledgers' terms equal to what is there, a
cached prefix's row equal to the tree's values. `SchedulerMemory` shows SGLang's scheduler in
the shape that census reads, so the same five `census.*` rules run over SGLang's own objects:

    census reads                  SGLang (0.5.22, 0.5.23)
    allocator, its free lists     scheduler.token_to_kv_pool_allocator (`SWATokenToKVPoolAllocator`:
                                  its sub-allocators' `get_all_free_pages`, the mapping)
    requests holding a row        every `Req` with `kv.holds_kv` in the running batch, the last
                                  and current batches, the overlap loop's result queue, the
                                  chunked request and the waiting queue
    a request's row, lengths      `kv.req_pool_idx`, `kv.kv_allocated_len` (what it owns),
                                  `kv.cache_protected_len`, its SWA evicted length
    its tree lock                 `req.lock` (`TreeLock`: node, `swa_released`)
    the tree                      `SGLangTreeReader` over `scheduler.tree_cache` (the tree core's
                                  walk: which slots it holds, which are SWA-live, which locked)
    the request rows              `req_to_token_pool.free_slots`

and `idle.radix_sanity` reads the tree as on `memory: sglang` (SGLang's own `sanity_check`, which
its scheduler runs only in its CI, locks at idle, the walk against the mapping).

When: at every fully idle pass of the scheduler once a batch ran since the last one (after
SGLang's own idle checks: a leak they name is theirs to report first), at the idle level
(`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`: strict stops the scheduler on the first broken
rule, as SGLang's strict leak check does and as our engine's idle census does); with
`SGLANG_INVARIANT_CHECK=2` also after each batch's result whose processing moved slots between
the requests, the tree and the free list, count-only. A firing is an `invariant_firing` event
stamped with SGLang's step, as our engine's.

A release whose objects lack what the census reads is refused when the scheduler is built
(`unreadable`): a `census` event (`armed: false`, `unreadable: true`) names the attribute, and a
verdict that would rest on the census is INCONCLUSIVE with that reason, never judged blind
(canaries/sglang/runtime.py). `CANARY_SERVER_CENSUS=off` leaves it out on purpose (the
benchmark's baseline).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine_stub.census import CENSUS_RULES, CensusReport, MemoryCensus
from engine_stub.detectors import detector

__all__ = ["CENSUS_ENV", "CensusViolation", "SchedulerMemory", "ServerCensus", "unreadable"]

# `off` leaves the census out of the server (the benchmark's baseline, SGLang's own detectors
# alone); anything else, or unset: on.
CENSUS_ENV = "CANARY_SERVER_CENSUS"
RADIX_SANITY = "idle.radix_sanity"
_STRICT_IDLE_ENV = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"
_LEVEL_ENV = "SGLANG_INVARIANT_CHECK"


class CensusViolation(RuntimeError):
    """A census rule broken at a strict idle pass: the scheduler stops, as on SGLang's own strict
    idle check. The message is SGLang's strict line (`invariant-check FAILED [name]: msg`), so the
    event log reads it as every other strict firing (canaries/sglang/server/log_events.py)."""


@dataclass(frozen=True)
class _Lock:
    """SGLang's `TreeLock` as the census reads a lock (no SWA token count: SGLang's SWA lock
    covers whole nodes back to a window)."""

    node: int
    swa_released: bool
    released: bool = False
    swa_locked_tokens: None = None


@dataclass(frozen=True)
class _Holder:
    """An SGLang `Req` that holds a request row, as the census reads a request."""

    rid: str
    row: int
    kv_len: int
    cache_protected_len: int
    swa_evicted_seqlen: int
    lock: _Lock | None


def _batches(scheduler: Any) -> Iterator[Any]:
    yield getattr(scheduler, "running_batch", None)
    yield getattr(scheduler, "last_batch", None)
    yield getattr(scheduler, "cur_batch_for_debug", None)
    for entry in getattr(scheduler, "result_queue", None) or ():
        yield entry[0] if isinstance(entry, tuple) else None


def _reqs(scheduler: Any) -> Iterator[Any]:
    for batch in _batches(scheduler):
        yield from getattr(batch, "reqs", None) or ()
    if getattr(scheduler, "chunked_req", None) is not None:
        yield scheduler.chunked_req
    yield from getattr(scheduler, "waiting_queue", None) or ()


def unreadable(scheduler: Any) -> str | None:
    """What of `scheduler` the census cannot read (the attribute named), or None."""
    alloc = getattr(scheduler, "token_to_kv_pool_allocator", None)
    for owner, name in ((scheduler, "token_to_kv_pool_allocator"), (scheduler, "req_to_token_pool"),
                        (alloc, "full_to_swa_index_mapping"), (alloc, "full_attn_allocator"),
                        (alloc, "swa_attn_allocator"), (getattr(scheduler, "req_to_token_pool", None), "free_slots")):
        if owner is None or not hasattr(owner, name):
            return f"{type(owner).__name__}.{name}: not there (not a hybrid SWA allocator this census reads)"
    for side in ("full_attn_allocator", "swa_attn_allocator"):
        if not hasattr(getattr(alloc, side), "get_all_free_pages"):
            return f"{side}.get_all_free_pages: not there"
    tree = getattr(scheduler, "tree_cache", None)
    if _has_radix(scheduler) and not hasattr(getattr(tree, "tree_core", None), "walk_for_kv_canary"):
        return f"{type(tree).__name__}.tree_core.walk_for_kv_canary: not there"
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if getattr(runner, "prefill_aware_swa", False):
        # Its eviction floor leaves a live SWA range below a request's evicted length.
        return "model_runner.prefill_aware_swa: on (a request's SWA-live positions are not one range)"
    return None


def _has_radix(scheduler: Any) -> bool:
    args = getattr(scheduler, "server_args", None)
    return not getattr(args, "disable_radix_cache", False) and hasattr(getattr(scheduler, "tree_cache", None), "tree_core")


class SchedulerMemory:
    """SGLang's scheduler in the shape `engine_stub.census.MemoryCensus` reads a scheduler."""

    chunked_req = None  # the chunked request, if any, is among `running`

    def __init__(self, scheduler: Any, window: int) -> None:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        from engine_stub.mem.sglang_tree import SGLangTreeReader

        self._scheduler = scheduler
        self._swa = ComponentType.SWA
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.req_to_token_pool = scheduler.req_to_token_pool
        self.page_size = int(self.allocator.page_size)
        self.device = self.allocator.device
        self.window = window
        self.tree_cache = (SGLangTreeReader(scheduler.tree_cache, self.allocator, self.page_size)
                           if _has_radix(scheduler) else None)

    @property
    def running(self) -> list[_Holder]:
        """Every request that holds a row, once each."""
        seen: set[int] = set()
        holders = []
        for req in _reqs(self._scheduler):
            kv = getattr(req, "kv", None)
            if id(req) in seen or kv is None or not kv.holds_kv:
                continue
            seen.add(id(req))
            holders.append(_Holder(
                str(req.rid), int(kv.req_pool_idx), int(kv.kv_allocated_len), int(kv.cache_protected_len),
                int(kv.get_evicted_seqlen(self._swa)), self._lock(getattr(req, "lock", None))))
        return holders

    def _lock(self, lock: Any) -> _Lock | None:
        """A `TreeLock` as the census reads it: its SWA part is not held once released early, or
        if the acquire skipped it (`skipped_lock_components` in its receipt)."""
        if lock is None:
            return None
        skipped = getattr(lock.receipt, "skipped_lock_components", ()) or ()
        return _Lock(lock.node, bool(lock.swa_released) or self._swa in skipped)

    def ownership(self) -> tuple[frozenset[str], tuple[int, ...]]:
        """(the requests holding a row, the tree's sizes): slots moved between the requests, the
        tree and the free list when a holder is gone (finished, aborted, retracted) or the tree
        changed (an insert at a finish or a chunk boundary, a lock taken by a cache hit or moved);
        the moves our engine's mid-run census follows. An admission without a hit and a decode
        only move slots between the free list and the rows."""
        tree = self.tree_cache
        sizes = () if tree is None else (tree.total_size(), tree.full_protected_size(), tree.swa_protected_size())
        return frozenset(h.rid for h in self.running), sizes

    def ledgers(self) -> dict:
        """SGLang's idle ledgers as numbers, in our engine's `idle_check` shape."""
        alloc, tree, rows = self.allocator, self.tree_cache, self.req_to_token_pool
        full = {"available": int(alloc.full_available_size()),
                "evictable": tree.full_evictable_size() if tree else 0,
                "protected": tree.full_protected_size() if tree else 0, "total": int(alloc.size_full)}
        swa = {"available": int(alloc.swa_available_size()),
               "evictable": tree.swa_evictable_size() if tree else 0,
               "protected": tree.swa_protected_size() if tree else 0, "total": int(alloc.size_swa)}
        req_rows = {"available": len(rows.free_slots), "evictable": 0, "protected": 0, "total": int(rows.size)}
        for ledger in (full, swa, req_rows):
            ledger["delta"] = ledger["available"] + ledger["evictable"] + ledger["protected"] - ledger["total"]
        return {"full": full, "swa": swa, "req_rows": req_rows}


def _failures(report: CensusReport) -> Iterator[tuple[str, int, str, list[int]]]:
    """(rule, failing elements, message, first failing slots) per broken check, in rule order."""
    for inv in CENSUS_RULES:
        for checked, ok, msg, slots in report.checks:
            if checked is not inv:
                continue
            fails = ~ok.reshape(-1)
            count = int(torch.count_nonzero(fails))
            if count == 0:
                continue
            named: list[int] = []
            if slots is not None:
                flat = slots.reshape(-1)
                named = (flat[fails] if flat.numel() == fails.numel() else flat)[:16].tolist()
            yield inv.name, count, msg, [int(s) for s in named]


class ServerCensus:
    """The census and the radix sanity check of one SGLang scheduler, writing firings through
    `write` (the plugin's event log) stamped with `step()`."""

    def __init__(self, scheduler: Any, window: int, write: Callable[[dict], None],
                 step: Callable[[], int]) -> None:
        self.memory = SchedulerMemory(scheduler, window)
        self._census = MemoryCensus(self.memory)
        self._write = write
        self._step = step
        self._totals: dict[str, int] = {}
        self._last_idle_step: int | None = None
        self._last_ownership: tuple[frozenset[str], tuple[int, ...]] | None = None
        # What the census cost this scheduler (seconds), reported with each idle pass.
        self._batch_seconds = 0.0
        self._batches = 0
        self._batch_runs = 0
        self.strict_idle = os.environ.get(_STRICT_IDLE_ENV, "0") not in ("0", "", "false", "False")
        self.strict_steps = os.environ.get(_LEVEL_ENV, "0") == "2"

    def at_idle(self) -> None:
        """Once per idle period (a batch ran since the last): ledgers, radix sanity and the
        census as an `idle_check` event, then their firings at the idle level (strict: the first
        one stops the scheduler)."""
        step = self._step()
        if step == self._last_idle_step:
            return
        self._last_idle_step = step
        started = time.perf_counter()
        report = self._census.check()
        tree = self.memory.tree_cache
        problems = tree.sanity_problems() if tree is not None else []
        ledgers = self.memory.ledgers()
        summary = report.summary()
        cost = {"idle_ms": round((time.perf_counter() - started) * 1e3, 3),
                "after_batch_ms": round(self._batch_seconds * 1e3, 3), "after_batch_runs": self._batch_runs,
                "batches": self._batches}
        self._write({"kind": "idle_check", "step": step, "after_step": step, "ledgers": ledgers,
                     "radix_problems": problems[:20], "census": summary, "runtime": "sglang-server",
                     "census_cost": cost,
                     "balanced": all(v["delta"] == 0 for v in ledgers.values()) and not problems})
        level = "STRICT" if self.strict_idle else "WARN"
        found = ([(RADIX_SANITY, len(problems), "; ".join(problems[:3]), [])] if problems else [])
        for name, count, msg, slots in [*found, *_failures(report)]:
            if self.strict_idle:
                raise CensusViolation(f"invariant-check FAILED [{name}]: {msg}")
            self._fire(name, count, msg, slots, level, step)

    def after_batch(self) -> bool:
        """In STRICT mode, after a batch's result moved slots between owners: the census,
        count-only (the detector of the damage's own site, or the idle check, decides first).
        Whether it ran."""
        if not self.strict_steps:
            return False
        started = time.perf_counter()
        self._batches += 1
        holders, sizes = self.memory.ownership()
        before = self._last_ownership
        self._last_ownership = (holders, sizes)
        ran = before is not None and bool(before[0] - holders or before[1] != sizes)
        if ran:
            self._batch_runs += 1
            step = self._step()
            for name, count, msg, slots in _failures(self._census.check()):
                self._fire(name, count, msg, slots, "WARN", step)
        self._batch_seconds += time.perf_counter() - started
        return ran

    def _fire(self, name: str, count: int, msg: str, slots: list[int], level: str, step: int) -> None:
        total = self._totals[name] = self._totals.get(name, 0) + count
        self._write({"kind": "invariant_firing", "invariant": name, "bucket": detector(name).bucket,
                     "level": level, "site": "census" if name != RADIX_SANITY else "idle_tick", "msg": msg,
                     "new_hits": count, "total_hits": total, "crashed": False, "slots": slots, "step": step})
