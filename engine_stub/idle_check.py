"""Idle-tick checks: the conservation ledgers and the radix cache's sanity, as invariants.

Runs only when nothing is running or waiting. For the full pool, the SWA pool and the request
rows: `available + evictable + protected == total`. Their own switch,
`strict_mem_check_during_idle`, decides whether a failed ledger crashes (STRICT) or is counted
and logged (WARN), whatever the general invariant level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_stub.invariants import (
    Bucket,
    Invariant,
    InvariantCheckLevel,
    IsTrue,
    expect,
    override_level,
)

if TYPE_CHECKING:
    from engine_stub.scheduler import Scheduler

__all__ = ["IdleChecker"]

FULL_LEDGER = Invariant("idle.full_ledger", Bucket.GUARD, IsTrue(), site="idle_tick",
                        description="full pool: available + evictable + protected == total")
SWA_LEDGER = Invariant("idle.swa_ledger", Bucket.GUARD, IsTrue(), site="idle_tick",
                       description="SWA pool: available + evictable + protected == total")
REQ_ROWS_LEDGER = Invariant("idle.req_rows_ledger", Bucket.GUARD, IsTrue(), site="idle_tick",
                            description="request rows: free rows == max_running_requests")
RADIX_SANITY = Invariant("idle.radix_sanity", Bucket.GUARD, IsTrue(), site="idle_tick",
                         description="radix cache: nothing locked, no tombstone leaf, no padding slot, mapping agrees")


class IdleChecker:
    def __init__(self, scheduler: Scheduler, *, strict: bool) -> None:
        self.scheduler = scheduler
        self.strict = strict
        self.max_mapping_nonidentity = 0

    def ledgers(self) -> dict:
        """The three ledgers as numbers (merging staged frees first, so counts are exact)."""
        sched = self.scheduler
        alloc = sched.allocator
        alloc.merge_and_sort_free()
        tree = sched.tree_cache
        full = {"available": alloc.full_available_size(),
                "evictable": tree.full_evictable_size() if tree else 0,
                "protected": tree.full_protected_size() if tree else 0,
                "total": alloc.size_full}
        swa = {"available": alloc.swa_available_size(),
               "evictable": tree.swa_evictable_size() if tree else 0,
               "protected": tree.swa_protected_size() if tree else 0,
               "total": alloc.size_swa}
        rows = {"available": sched.req_to_token_pool.available_size(), "evictable": 0, "protected": 0,
                "total": sched.req_to_token_pool.size}
        for ledger in (full, swa, rows):
            ledger["delta"] = ledger["available"] + ledger["evictable"] + ledger["protected"] - ledger["total"]
        return {"full": full, "swa": swa, "req_rows": rows}

    def census(self) -> dict | None:
        """Slots of each pool held by more than one owner at idle: the free list (pages
        expanded to slots) and the radix cache (its FULL slots; its live nodes' SWA peers) are
        the only owners an idle engine has, so each slot must appear at most once among them.
        None where the allocator has no sub-allocators to read.
        Data for the fuzzer's oracle, not an invariant: the ledgers and radix sanity judge."""
        alloc = self.scheduler.allocator
        sides = (getattr(alloc, "full_attn_allocator", None), getattr(alloc, "swa_attn_allocator", None))
        if None in sides:
            return None
        tree = self.scheduler.tree_cache
        empty = torch.zeros(0, dtype=torch.int64)
        counts = {}
        for name, side, held in (
            ("full", sides[0], tree.held_slots() if tree else empty),
            ("swa", sides[1], tree.held_swa_slots() if tree else empty),
        ):
            # SGLang's allocators (the sglang backend) keep the same two lists, the staged one
            # None when unused or one tensor; page ids on pages, slot ids on page_size 1, as ours.
            staged = getattr(side, "release_pages", None)
            staged = [] if staged is None else [staged] if isinstance(staged, torch.Tensor) else staged
            pages = torch.cat([side.free_pages, *staged]).to(torch.int64).cpu()
            page = side.page_size
            free = (pages[:, None] * page + torch.arange(page)).reshape(-1)
            slots = torch.cat([free, held.to(torch.int64).cpu()])
            slots = slots[slots > 0]
            counts[f"{name}_held_twice"] = int(slots.numel() - torch.unique(slots).numel())
        return counts

    def check(self) -> dict:
        """Evaluate the ledgers and radix sanity; log the result; crash if strict and broken."""
        sched = self.scheduler
        ledgers = self.ledgers()
        problems = sched.tree_cache.sanity_check() if sched.tree_cache else []
        drops = sched.allocator.drop_counts()
        exercise = sched.exercise_stats()
        self.max_mapping_nonidentity = max(self.max_mapping_nonidentity, exercise["mapping_nonidentity"])
        result = {"ledgers": ledgers, "radix_problems": problems[:20], "drops": drops,
                  "census": self.census(),
                  "balanced": all(v["delta"] == 0 for v in ledgers.values()) and not problems}
        sched.events.write("idle_check", durable=True, **result)
        level = InvariantCheckLevel.STRICT if self.strict else InvariantCheckLevel.WARN
        with override_level(level):
            for inv, ok, msg in (
                (FULL_LEDGER, ledgers["full"]["delta"] == 0, f"full ledger off by {ledgers['full']['delta']}"),
                (SWA_LEDGER, ledgers["swa"]["delta"] == 0, f"SWA ledger off by {ledgers['swa']['delta']}"),
                (REQ_ROWS_LEDGER, ledgers["req_rows"]["delta"] == 0,
                 f"request rows off by {ledgers['req_rows']['delta']}"),
                (RADIX_SANITY, not problems, "; ".join(problems[:3])),
            ):
                expect(inv, torch.tensor(ok), msg)
        return result
