"""The detector catalogue: every detector of the engine, declared once (torch-free).

A detector is an engine invariant (`swa.peer_mapped`, bucket SOFTEN / GUARD / FATAL_CONTAINABLE /
FATAL_UNCONTAINABLE) or a KV canary reason (`kv_canary.verify_position`, bucket KV_CANARY). The
engine modules construct their `Invariant` objects where they check them, and
`Invariant.__init__` refuses a name this catalogue does not declare with the same bucket; the
canary suite (scenario validation, `canary list invariants`, the kill matrix) reads only this
module, so it never imports torch or the engine to learn what the detectors are.

This module imports nothing from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BUCKETS",
    "CANARY_PREFIX",
    "CATALOGUE",
    "INVARIANT_BUCKETS",
    "SCRATCH_PREFIX",
    "Detector",
    "canary_reasons",
    "detector",
    "detector_names",
    "invariant_entries",
]

INVARIANT_BUCKETS = ("SOFTEN", "GUARD", "FATAL_CONTAINABLE", "FATAL_UNCONTAINABLE")
BUCKETS = (*INVARIANT_BUCKETS, "KV_CANARY")
CANARY_PREFIX = "kv_canary."
# Invariants named `test.<anything>` are unit tests' scratch checks: outside the catalogue.
SCRATCH_PREFIX = "test."


@dataclass(frozen=True)
class Detector:
    """One detector: its name as events and scenarios spell it, bucket, site and one line."""

    name: str
    bucket: str
    site: str
    description: str

    def __post_init__(self) -> None:
        if self.bucket not in BUCKETS:
            raise ValueError(f"detector {self.name!r}: bucket {self.bucket!r} is not one of "
                             f"{', '.join(BUCKETS)}")
        if (self.bucket == "KV_CANARY") != self.name.startswith(CANARY_PREFIX):
            raise ValueError(f"detector {self.name!r}: only kv_canary.<reason> has bucket "
                             "KV_CANARY, and it has no other")

    @property
    def is_canary(self) -> bool:
        return self.bucket == "KV_CANARY"


CATALOGUE: tuple[Detector, ...] = (
    # ---- the allocators (engine_stub/mem/allocator.py, engine_stub/mem/swa.py)
    Detector("alloc.double_free", "GUARD", "free",
             "a freed slot/page was not allocated (dropped, not recycled; counted, never crashes)"),
    Detector("alloc.out_of_pool", "GUARD", "free",
             "a freed id lies outside the pool (dropped; counted, never crashes)"),
    Detector("alloc.pool_bound", "FATAL_CONTAINABLE", "SWATokenToKVPoolAllocator.free_group_end",
             "a sub-allocator reports more free slots than it has (an over-free)"),
    Detector("alloc.reserved_slot", "GUARD", "free",
             "a freed id lies in the padding page 0 (dropped, recycling it aliases the sink; "
             "counted)"),
    Detector("swa.peer_mapped", "FATAL_UNCONTAINABLE", "SWATokenToKVPoolAllocator.free_swa",
             "free_swa (page_size 1) met a slot whose SWA peer is already released"),
    Detector("swa.peer_released", "GUARD", "SWATokenToKVPoolAllocator.free_full",
             "free_full met a slot whose SWA peer is still mapped (the peer would leak)"),
    # ---- the memory census (engine_stub/census.py): at idle, and mid-run in STRICT mode
    Detector("census.ledger", "GUARD", "census",
             "the ledgers' terms equal the census (free lists, tree sizes, request rows)"),
    Detector("census.lock_count", "GUARD", "census",
             "every radix node's lock counts equal the locks the requests hold on it, and what a "
             "window reads of its prefix is SWA-locked"),
    Detector("census.peer_live", "GUARD", "census",
             "a full slot has an SWA peer exactly when it is SWA-live (in a request's window part, "
             "in a live radix node; never a free one)"),
    Detector("census.row_matches", "GUARD", "census",
             "a request's row below cache_protected_len names its locked prefix, and the part its "
             "window reads is SWA-live"),
    Detector("census.slot_owner", "GUARD", "census",
             "every full and SWA slot has exactly one owner (free list, a request's row, the radix "
             "cache, the padding page)"),
    # ---- the idle-tick ledgers (engine_stub/idle_check.py)
    Detector("idle.answer_ledger", "GUARD", "idle_tick",
             "an idle engine owes no answer: every request it took was answered"),
    Detector("idle.full_ledger", "GUARD", "idle_tick",
             "full pool: available + evictable + protected == total"),
    Detector("idle.radix_sanity", "GUARD", "idle_tick",
             "radix cache: nothing locked, no tombstone leaf, no padding slot, mapping agrees"),
    Detector("idle.req_rows_ledger", "GUARD", "idle_tick",
             "request rows: free rows == max_running_requests"),
    Detector("idle.swa_ledger", "GUARD", "idle_tick",
             "SWA pool: available + evictable + protected == total"),
    # ---- the scheduler (engine_stub/scheduler.py)
    Detector("sched.prefix_row", "GUARD", "Scheduler._cache_unfinished, Scheduler._release_kv",
             "below cache_protected_len a request's row holds the radix cache's slots of the "
             "prefix it locked"),
    Detector("sched.decode_stall", "GUARD", "Scheduler._schedule_decode",
             "decode could not allocate one slot per running request (a pool ran dry)"),
    Detector("sched.admission_stall", "GUARD", "Scheduler.step",
             "nothing runs and neither the next waiting request nor the next prefill chunk can "
             "be allocated (something leaked)"),
    # ---- the KV canary's reasons (engine_stub/kv_canary.py REASONS), in its order
    Detector("kv_canary.verify_chain_hash", "KV_CANARY", "KVCanary.verify, KVCanary.sweep",
             "a slot's chain link (token and position of the position before) does not match"),
    Detector("kv_canary.verify_position", "KV_CANARY", "KVCanary.verify, KVCanary.sweep",
             "a slot read for a position holds the record of another position"),
    Detector("kv_canary.verify_real_kv_hash", "KV_CANARY", "KVCanary.verify, KVCanary.sweep",
             "a slot's real K/V bytes differ from what was written there"),
    Detector("kv_canary.write_token", "KV_CANARY", "KVCanary.write",
             "a forward's input token differs from the token the sampler produced"),
)

_BY_NAME = {d.name: d for d in CATALOGUE}
if len(_BY_NAME) != len(CATALOGUE):  # pragma: no cover - a typo in the table above
    raise KeyError("a detector is declared twice in the catalogue")


def detector(name: str) -> Detector:
    """The catalogue entry `name`; an unknown name lists the declared ones (KeyError)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown detector {name!r}; the catalogue (engine_stub/detectors.py) "
                       f"declares: {', '.join(detector_names())}") from None


def detector_names() -> tuple[str, ...]:
    """Every detector: the invariants sorted by name, then the canary reasons in their order."""
    return tuple(d.name for d in invariant_entries()) + tuple(
        CANARY_PREFIX + r for r in canary_reasons())


def invariant_entries() -> tuple[Detector, ...]:
    """The engine invariants' entries, sorted by name."""
    return tuple(sorted((d for d in CATALOGUE if not d.is_canary), key=lambda d: d.name))


def canary_reasons() -> tuple[str, ...]:
    """The KV canary's reasons (without the `kv_canary.` prefix), in the catalogue's order."""
    return tuple(d.name.removeprefix(CANARY_PREFIX) for d in CATALOGUE if d.is_canary)
