"""Idle-tick checks: the conservation ledgers, the radix cache's sanity and the memory census,
as invariants.

Runs only when nothing is running or waiting. For the full pool, the SWA pool and the request
rows: `available + evictable + protected == total`; then the census (engine_stub/census.py: one
owner per slot, the mapping, the locks, the ledgers' terms). Their own switch,
`strict_mem_check_during_idle`, decides whether a failure crashes (STRICT) or is counted and
logged (WARN), whatever the general invariant level.
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
    from engine_stub.census import MemoryCensus
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
    def __init__(self, scheduler: Scheduler, census: MemoryCensus, *, strict: bool) -> None:
        self.scheduler = scheduler
        self.census = census
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

    def check(self) -> dict:
        """Evaluate the ledgers and radix sanity; log the result; crash if strict and broken."""
        sched = self.scheduler
        ledgers = self.ledgers()
        problems = sched.tree_cache.sanity_check() if sched.tree_cache else []
        drops = sched.allocator.drop_counts()
        exercise = sched.exercise_stats()
        self.max_mapping_nonidentity = max(self.max_mapping_nonidentity, exercise["mapping_nonidentity"])
        census = self.census.check()
        result = {"ledgers": ledgers, "radix_problems": problems[:20], "drops": drops,
                  "census": census.summary(),
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
            # After the ledgers: a leak they name is theirs to report first.
            census.expect_all()
        return result
