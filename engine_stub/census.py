"""The memory census: who owns every slot, page, lock and row, each rule an invariant.

The idle ledgers compare totals; the census compares owners. It builds, from the allocator's
free lists, the rows of the requests that hold memory (running ones and the one being prefilled
in chunks), the radix cache and the padding page, the owner count of every full and SWA slot,
and checks five rules (GUARD, site `census`):

- `census.slot_owner`: every full and every SWA slot has exactly one owner. Full: the free list,
  a request's row (its own part, `[cache_protected_len, kv_len)`, whole pages), the radix cache,
  the padding page. SWA: the free list, the peer of one SWA-live full slot (a request's positions
  at or past its window frontier, a live radix node), the padding page.
- `census.peer_live`: a full slot has an SWA peer exactly when it is SWA-live: a request's own
  positions at or past its frontier, a live radix node's slots; a slot on the free list, a
  tombstone's and a window-evicted one have none. With `slot_owner` on the SWA side, the mapping
  is a bijection between the live full slots and the SWA slots not free.
- `census.lock_count`: every radix node's full and SWA lock counts are those the requests' lock
  handles hold on it (nothing else locks a node), and the prefix a request's next window reads
  is SWA-locked by its handle (its SWA part not released early; on our tree, covering it).
- `census.ledger`: the ledgers' terms equal the census: each pool's `available_size` is its free
  list's pages, the tree's evictable + protected sizes are the slots it holds (full) and holds
  live (SWA), and the request rows are the free rows plus one per holding request, each once.
- `census.row_matches`: what a request's row names below `cache_protected_len` is the prefix its
  tree lock holds, and the positions of it the next forward's window reads have a live SWA peer.

Where it runs: at every idle tick, after the ledgers and radix sanity, at the idle switch's
level (as the ledgers); in STRICT mode also at the end of each step in which slots changed hands
between the requests, the tree and the free list (a request finished or was aborted, a chunk
boundary cached a prompt's processed part, a cache hit was admitted): these are the points where
the bugs it reads live (insert, lock moves, row rewrites), and a decode step between them only
moves slots between the free list and the rows. The mid-run census counts and never crashes:
the detector of the damage's own site (or the idle ledger that names the leak) gets to fire
first, and the engine decides at idle as it always did.

Cost: the checks are device ops and `expect`s, with no host read of device data (no sync) on
our memory path; the idle summary (`summary`) reads its counts back, at idle only. On
`memory: sglang` the tree's walk reads its slots back (a sync, SGLang's interface) and two
rules read less (see `lock_count` and `ledger`): what is skipped is listed in `skipped`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_stub.invariants import Bucket, Invariant, IsTrue, expect
from engine_stub.mem.radix import SWARadixCache

if TYPE_CHECKING:
    from engine_stub.req import Req
    from engine_stub.scheduler import Scheduler

__all__ = ["CENSUS_RULES", "CensusReport", "MemoryCensus"]

SLOT_OWNER = Invariant("census.slot_owner", Bucket.GUARD, IsTrue(), site="census",
                       description="every full and SWA slot has exactly one owner (free list, a "
                                   "request's row, the radix cache, the padding page)")
PEER_LIVE = Invariant("census.peer_live", Bucket.GUARD, IsTrue(), site="census",
                      description="a full slot has an SWA peer exactly when it is SWA-live (in a "
                                  "request's window part, in a live radix node; never a free one)")
LOCK_COUNT = Invariant("census.lock_count", Bucket.GUARD, IsTrue(), site="census",
                       description="every radix node's lock counts equal the locks the requests "
                                   "hold on it, and what a window reads of its prefix is SWA-locked")
LEDGER = Invariant("census.ledger", Bucket.GUARD, IsTrue(), site="census",
                   description="the ledgers' terms equal the census (free lists, tree sizes, "
                               "request rows)")
ROW_MATCHES = Invariant("census.row_matches", Bucket.GUARD, IsTrue(), site="census",
                        description="a request's row below cache_protected_len names its locked "
                                    "prefix, and the part its window reads is SWA-live")
CENSUS_RULES = (SLOT_OWNER, PEER_LIVE, LOCK_COUNT, LEDGER, ROW_MATCHES)


@dataclass
class CensusReport:
    """One census, evaluated, not yet expected: per rule its checks `(ok, msg, slots)`, the slots
    held by more than one owner per pool (for the fuzz oracle), and what was skipped."""

    checks: list[tuple[Invariant, torch.Tensor, str, torch.Tensor | None]] = field(default_factory=list)
    held_twice: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def add(self, inv: Invariant, ok: torch.Tensor, msg: str, slots: torch.Tensor | None = None) -> None:
        """Keep one check of `inv`: `ok` holds where the rule does (bool, element-wise)."""
        self.checks.append((inv, ok, msg, slots))

    def expect_all(self) -> None:
        """Hand every check to `expect`, in rule order, at the level in force (no host read)."""
        for inv in CENSUS_RULES:
            for checked, ok, msg, slots in self.checks:
                if checked is inv:
                    expect(inv, ok, msg, slots=slots)

    def summary(self) -> dict:
        """Host counts (a read back: idle only): failing elements per rule, slots held twice per
        pool, what was skipped."""
        failures = dict.fromkeys((inv.name for inv in CENSUS_RULES), 0)
        for inv, ok, _msg, _slots in self.checks:
            failures[inv.name] += int(torch.count_nonzero(~ok))
        return {"failures": failures, **{f"{pool}_held_twice": int(t) for pool, t in self.held_twice.items()},
                "skipped": list(self.skipped)}


def _expand(pages: torch.Tensor, page: int, offsets: torch.Tensor) -> torch.Tensor:
    """Every slot of `pages` (a page's slots are `page * id + [0, page)`)."""
    if page == 1:
        return pages
    return (pages[:, None] * page + offsets).reshape(-1)


def _free_pages(side: Any) -> torch.Tensor:
    """A sub-allocator's free list with its staged frees, int64 page ids (holes read 0).

    SGLang's sub-allocators keep the same lists (page ids on pages, slot ids on page_size 1, as
    ours) and say which with `get_all_free_pages` (0.5.23's paged one stages its frees in a
    list of its own); elsewhere the staged one is None when unused, or one tensor."""
    every = getattr(side, "get_all_free_pages", None)
    if every is not None:
        pages = every()
        return (side.free_pages if pages is None else pages).to(torch.int64)
    staged = getattr(side, "release_pages", None)
    staged = [] if staged is None else [staged] if isinstance(staged, torch.Tensor) else list(staged)
    return torch.cat([side.free_pages, *staged]).to(torch.int64)


def _free_rows(pool: Any) -> list[int] | None:
    """The free request rows of ours or SGLang's pool (its `impl`), None where unreadable."""
    rows = getattr(pool, "free_slots", None)
    if rows is None:
        rows = getattr(getattr(pool, "impl", None), "free_slots", None)
    if rows is None:
        return None
    return [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]


class MemoryCensus:
    """The census of one scheduler's memory (see the module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        alloc = scheduler.allocator
        self.page = scheduler.page_size
        self.device = scheduler.device
        self._offsets = torch.arange(self.page, dtype=torch.int64, device=self.device)
        # Slot ids of each pool, the padding page included; one more row takes every id outside.
        self.full_slots = alloc.size_full + self.page
        self.swa_slots = alloc.size_swa + self.page

    # ---- who holds memory ----------------------------------------------------------------------

    def holders(self) -> list[Req]:
        """The requests that hold a row: the running ones and the one prefilled in chunks."""
        sched = self.scheduler
        reqs = [r for r in sched.running if r.row]
        if sched.chunked_req is not None and sched.chunked_req.row:
            reqs.append(sched.chunked_req)
        return reqs

    def _row(self, req: Req, lo: int, hi: int, step: int = 1) -> torch.Tensor:
        table = self.scheduler.req_to_token_pool.req_to_token
        return table[req.row, lo:hi:step].to(torch.int64)

    # ---- the census ----------------------------------------------------------------------------

    def check(self) -> CensusReport:
        """Evaluate every rule (device ops; no host read on our memory path); the caller hands
        the report to `expect` (`CensusReport.expect_all`) at the level it picks."""
        sched = self.scheduler
        alloc, tree = sched.allocator, sched.tree_cache
        holders = self.holders()
        report = CensusReport()
        full_free = _free_pages(alloc.full_attn_allocator)
        swa_free = _free_pages(alloc.swa_attn_allocator)
        mapping = alloc.full_to_swa_index_mapping
        tree_slots = tree.held_slots().to(torch.int64) if tree is not None else self._empty()
        tree_peers = tree.held_swa_slots().to(torch.int64) if tree is not None else self._empty()
        self._slot_owner(report, holders, full_free, swa_free, tree_slots, tree_peers, mapping)
        self._peer_live(report, holders, full_free, mapping)
        self._lock_count(report, holders)
        self._ledger(report, holders, full_free, swa_free, tree_slots, tree_peers)
        self._row_matches(report, holders, mapping)
        return report

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64, device=self.device)

    def _owners(self, size: int, parts: list[torch.Tensor]) -> torch.Tensor:
        """Owner count of each slot id in `[0, size)` (ids outside land on a sink row)."""
        counts = torch.zeros(size + 1, dtype=torch.int64, device=self.device)
        ids = torch.cat(parts) if parts else self._empty()
        ids = torch.where((ids >= 0) & (ids < size), ids, size)
        counts.index_add_(0, ids, torch.ones_like(ids))
        return counts[:size]

    def _pages_of(self, free: torch.Tensor) -> torch.Tensor:
        """A free list's slots, a hole (page 0, a dropped bad free not yet cleared) named by no
        slot (-1: outside every pool)."""
        return _expand(torch.where(free > 0, free, -1), self.page, self._offsets)

    def _own_pages(self, req: Req) -> torch.Tensor:
        """The full slots a request owns: the pages of `[cache_protected_len, kv_len)` (page
        aligned at the start; the last page whole, though positions past kv_len are unwritten)."""
        first = self._row(req, req.cache_protected_len, req.kv_len, self.page)
        return _expand(torch.div(first, self.page, rounding_mode="floor"), self.page, self._offsets)

    def _live_peers(self, req: Req, mapping: torch.Tensor) -> torch.Tensor:
        """The SWA slots a request owns: the peers of its pages at or past its frontier (-1 for a
        page with no peer: `peer_live` reports it)."""
        lo = max(req.swa_evicted_seqlen, req.cache_protected_len)
        peers = torch.take(mapping, self._row(req, lo, req.kv_len, self.page))
        pages = torch.where(peers > 0, torch.div(peers, self.page, rounding_mode="floor"), -1)
        return _expand(pages, self.page, self._offsets)

    def _slot_owner(self, report: CensusReport, holders: list[Req], full_free: torch.Tensor,
                    swa_free: torch.Tensor, tree_slots: torch.Tensor, tree_peers: torch.Tensor,
                    mapping: torch.Tensor) -> None:
        padding = self._offsets
        full = self._owners(self.full_slots, [self._pages_of(full_free), padding, tree_slots,
                                              *(self._own_pages(r) for r in holders)])
        swa = self._owners(self.swa_slots, [self._pages_of(swa_free), padding,
                                            torch.where(tree_peers > 0, tree_peers, -1),
                                            *(self._live_peers(r, mapping) for r in holders)])
        for pool, counts in (("full", full), ("swa", swa)):
            report.held_twice[pool] = torch.count_nonzero(counts > 1)
            ids = torch.arange(counts.numel(), dtype=torch.int64, device=self.device)
            report.add(SLOT_OWNER, counts == 1, f"{pool} pool: a slot with no owner or two", slots=ids)

    def _peer_live(self, report: CensusReport, holders: list[Req], full_free: torch.Tensor,
                   mapping: torch.Tensor) -> None:
        tree = self.scheduler.tree_cache
        # A hole names page 0, whose slots are never mapped.
        free = _expand(full_free.clamp(min=0), self.page, self._offsets)
        report.add(PEER_LIVE, torch.take(mapping, free) == 0, "a free full slot has an SWA peer", slots=free)
        for req in holders:
            lo, hi = req.cache_protected_len, req.kv_len
            slots = self._row(req, lo, hi)
            live = torch.arange(lo, hi, device=self.device) >= req.swa_evicted_seqlen
            report.add(PEER_LIVE, (torch.take(mapping, slots) > 0) == live,
                       f"request {req.rid}: a peer where the window evicted, or none inside it", slots=slots)
        for path in tree.cached_paths() if tree is not None else ():
            slots = path.slots.to(self.device)
            report.add(PEER_LIVE, (torch.take(mapping, slots) > 0) == path.swa_live.to(self.device),
                       "radix cache: a tombstone's slot has a peer, or a live node's has none", slots=slots)

    def _lock_count(self, report: CensusReport, holders: list[Req]) -> None:
        tree = self.scheduler.tree_cache
        if tree is None:
            return
        locks = [r.lock for r in holders if r.lock is not None and not r.lock.released]
        for req in holders:
            # What a request matched or inserted is the tree's; only its lock keeps the tree
            # from evicting it under the request.
            if req.cache_protected_len > 0 and (req.lock is None or req.lock.released):
                report.add(LOCK_COUNT, torch.tensor(False),
                           f"request {req.rid}: its cached prefix of {req.cache_protected_len} tokens "
                           "is held by no lock")
        if not isinstance(tree, SWARadixCache):
            # SGLang's tree: its node lock counts (full, and SWA by uuid over whole nodes) are not
            # in the tree core's backend-neutral interface; its protected size is the union of
            # the locked paths (each lock covers root to its node).
            report.skipped.append("census.lock_count: per-node and SWA lock counts (SGLang's tree)")
            held = [tree.locked_slots(lock).to(torch.int64) for lock in locks]
            union = torch.unique(torch.cat(held)) if held else self._empty()
            report.add(LOCK_COUNT, torch.tensor(tree.full_protected_size() == union.numel()),
                       f"full protected size {tree.full_protected_size()} != {union.numel()} locked slots")
            # Which nodes are locked is readable where their counts are not: every locked node
            # lies on a request's locked path, and every node on such a path is locked.
            locked = tree.locked_node_slots().to(torch.int64)
            stray = locked[~torch.isin(locked, union)]
            bare = union[~torch.isin(union, locked)]
            report.add(LOCK_COUNT, torch.tensor(stray.numel() == 0),
                       f"{stray.numel()} slots of locked nodes no request's lock holds (a lock outlived "
                       "its request)", slots=stray)
            report.add(LOCK_COUNT, torch.tensor(bare.numel() == 0),
                       f"{bare.numel()} slots of a request's locked prefix on unlocked nodes (a lock "
                       "released under its request)", slots=bare)
            swa_held = any(not lock.swa_released for lock in locks)
            report.add(LOCK_COUNT, torch.tensor(swa_held or tree.swa_protected_size() == 0),
                       f"SWA protected size {tree.swa_protected_size()} with no request's lock holding "
                       "an SWA part")
            self._window_locked(report, holders)
            return
        expected: dict[int, list[int]] = {}
        for lock in locks:
            node, swa_left = lock.node, 0 if lock.swa_released else lock.swa_locked_tokens
            while node is not tree.root and node is not None:
                counts = expected.setdefault(node.id, [0, 0])
                counts[0] += 1
                if swa_left > 0:
                    counts[1] += 1
                    swa_left -= len(node.key)
                node = node.parent
        wrong = []
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            want = expected.pop(node.id, [0, 0])
            if [node.full_lock_ref, node.swa_lock_ref] != want:
                wrong.append(f"node {node.id} locks full={node.full_lock_ref}, swa={node.swa_lock_ref}, "
                             f"held {want[0]}, {want[1]}")
        wrong += [f"locked node {node_id} is not in the tree" for node_id in expected]
        report.add(LOCK_COUNT, torch.tensor(not wrong), "; ".join(wrong[:3]))
        self._window_locked(report, holders)

    def _window_locked(self, report: CensusReport, holders: list[Req]) -> None:
        """The prefix a request's next window reads stays SWA-locked (else the tree may tombstone
        it under the request): the lock's SWA part is not released and, on our tree, covers it
        (SGLang's lock records no token count)."""
        for req in holders:
            lock, protected = req.lock, req.cache_protected_len
            reads = protected - max(req.kv_len - self.scheduler.window + 1, 0)
            if lock is None or reads <= 0:
                continue
            locked = getattr(lock, "swa_locked_tokens", None)
            covered = not lock.swa_released and (locked is None or locked >= reads)
            report.add(LOCK_COUNT, torch.tensor(covered),
                       f"request {req.rid}: its window reads {reads} prefix tokens its lock does not "
                       "hold SWA-locked")

    def _ledger(self, report: CensusReport, holders: list[Req], full_free: torch.Tensor,
                swa_free: torch.Tensor, tree_slots: torch.Tensor, tree_peers: torch.Tensor) -> None:
        sched = self.scheduler
        alloc, tree, pool = sched.allocator, sched.tree_cache, sched.req_to_token_pool
        for name, free, available in (("full", full_free, alloc.full_available_size()),
                                      ("SWA", swa_free, alloc.swa_available_size())):
            listed = torch.count_nonzero(free > 0) * self.page
            report.add(LEDGER, listed == available,
                       f"{name} pool: available_size {available} is not its free list's slots")
        if tree is not None:
            for name, sizes, held in (
                ("full", tree.full_evictable_size() + tree.full_protected_size(), tree_slots.numel()),
                ("SWA", tree.swa_evictable_size() + tree.swa_protected_size(), tree_peers.numel()),
            ):
                report.add(LEDGER, torch.tensor(sizes == held),
                           f"radix cache: {name} evictable + protected = {sizes}, holds {held}")
        free_rows = _free_rows(pool)
        held_rows = [r.row for r in holders]
        if free_rows is None:
            report.skipped.append("census.ledger: the free request rows (unreadable)")
            rows_ok = pool.available_size() + len(held_rows) == pool.size
        else:
            every = free_rows + held_rows
            rows_ok = len(every) == pool.size and set(every) == set(range(1, pool.size + 1))
        report.add(LEDGER, torch.tensor(rows_ok),
                   f"request rows: {pool.available_size()} free + {len(held_rows)} held is not each "
                   f"of {pool.size} once")

    def _row_matches(self, report: CensusReport, holders: list[Req], mapping: torch.Tensor) -> None:
        tree = self.scheduler.tree_cache
        if tree is None:
            return
        window = self.scheduler.window
        for req in holders:
            protected = req.cache_protected_len
            if req.lock is None or protected == 0:
                continue
            held = tree.locked_slots(req.lock).to(torch.int64)
            row = self._row(req, 0, protected)
            if held.numel() < protected:
                report.add(ROW_MATCHES, torch.tensor(False),
                           f"request {req.rid}: its lock holds {held.numel()} < {protected} slots")
                continue
            report.add(ROW_MATCHES, row == held[:protected],
                       f"request {req.rid}: its row disagrees with its locked prefix", slots=row)
            read_from = max(req.kv_len - window + 1, 0)
            if read_from < protected:
                read = row[read_from:]
                report.add(ROW_MATCHES, torch.take(mapping, read) > 0,
                           f"request {req.rid}: its window reads a prefix slot with no SWA peer", slots=read)
