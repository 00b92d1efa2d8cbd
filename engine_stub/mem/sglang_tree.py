"""The `memory: sglang` radix cache: SGLang's own tree, from an installed `sglang`, behind the
interface of ours (`engine_stub.mem.radix.SWARadixCache`), driven by our scheduler.

Which tree. Every release we run (0.5.18, 0.5.19, 0.5.20, 0.5.23) builds
`unified_radix_cache.UnifiedRadixCache` with the components `(FULL, SWA)` for a hybrid SWA model
with a full pool (`mem_cache/registry.py: default_radix_cache_factory` ->
`_create_unified_radix_cache` / `create_unified_radix_cache`). 0.5.18 to 0.5.20 still ship
`swa_radix_cache.SWARadixCache`, but nothing constructs it any more (only the KV canary's
`kv_canary/radix_cache_walker.py` names it), so it is not the system under test; 0.5.23 no
longer has it. The tree core is the release's default (`SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`,
`unified_cache/tree_core_registry.py`): the Python `UnifiedTreeCore` up to 0.5.20, the bundled
Rust `RustUnifiedTreeCore` in 0.5.23 (its own fallback rules pick the Python one where the
Rust one cannot run). The tree gets SGLang's `CacheInitParams`, SGLang's own allocator (our
`SGLangSWAAllocator.impl`, seen through `_EngineRoutedAllocator`) and SGLang's `ReqToTokenPool`
(our `SGLangReqToTokenPool.impl`).

How it is driven. SGLang's scheduler caches a request through request-level entry points
(`cache_finished_req` / `cache_unfinished_req` up to 0.5.20, `checkpoint_into_tree` in 0.5.23)
that also do the request's own bookkeeping: write its row, free the row's unaligned tail, move
its window frontier. Our scheduler does that bookkeeping itself, so the adapter calls what those
entry points call on the tree, in their order: `insert(InsertParams)`, `match_prefix(
MatchPrefixParams)`, `inc_lock_ref` / `dec_lock_ref` with the lock's receipt, the early SWA
release, `evict_for_alloc(EvictParams)`. Per release, where the API differs:

- `InsertParams`: the SWA frontier is the field `swa_evicted_seqlen` up to 0.5.20,
  `set_evicted_seqlen(SWA, ...)` in 0.5.23; `chunked=True` marks a chunk's insert up to 0.5.20
  (0.5.23 has `inserted_len` instead, left 0: hit counts only feed the T-LRU/priority policies,
  not the default LRU). Keys are `RadixKey(array("q"))` (the Rust core accepts nothing else).
- SWA branching (0.5.20 and 0.5.23, not 0.5.18/0.5.19): a match whose full-KV hit reaches past
  its last live window reports `swa_branching_seqlen`; the request's next insert stops there
  (`SWAComponent.prepare_for_caching_req`) and, at the finish, the positions past it are freed
  (`cache_finished_req` / `release_kv_cache`). The adapter keeps the branching point with the
  lock taken on that match (`SGLangLock.branching_seqlen`) and, where an insert is not handed
  the lock (our scheduler's finish), finds it by the match key and the locked prefix.
- Match slots: `MatchResult.device_indices` up to 0.5.20; 0.5.23 reports `device_prefix_len`,
  the slots are the path's (`tree_core.collect_full_device_indices`).
- Caching a chunked prompt's processed part (`cache_unfinished`): up to 0.5.20
  (`cache_unfinished_req`) the insert is followed by a new match, whose last node takes the
  request's lock; 0.5.23 (`checkpoint_into_tree`) locks the node the insert ended on and takes
  the path's slots. Either way the old lock is released first.
- Early SWA release (our `dec_swa_lock_only`, SGLang's `maybe_evict_swa` once a request has
  decoded a window): SGLang's is opt-in and off by default (`SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_
  AFTER_WINDOW` up to 0.5.20, `SGLANG_OPT_RELEASE_PREFILL_SWA` in 0.5.23), so by default it
  does nothing and the prefix's SWA stays locked to the finish (our engine releases it: a
  deliberate difference, see docs/architecture.md). With the variable set it calls the
  release's own: `dec_swa_lock_only(node, swa_uuid, skip_lock_node_ids)` (0.5.18, 0.5.19),
  `dec_swa_lock_only(node, receipt)` (0.5.20), `release_swa(TreeLock)` (0.5.23), and only when
  the lock has an SWA boundary uuid, as SGLang checks.
- Eviction: our scheduler passes the shortfalls of both pools, which is what SGLang's
  `evict_from_tree_cache` hands `evict_for_alloc` (0.5.19+) or `evict` (0.5.18).

Not taken from those entry points: at a finish, 0.5.23's `checkpoint_into_tree` locks the
node its insert ended on and `release_kv_cache` unlocks it at once (only the SWA boundary uuid
it stamps survives); the positions past an SWA branching point are freed with our allocator's
`free_full` / `free` rather than SGLang's `free_kv_row` segment frees; the request-side SWA
frees of `free_out_of_window_slots` are our scheduler's window eviction. That last one matters
on 0.5.20: our scheduler moves a chunked prompt's frontier to `kv_len - window` before
`cache_unfinished`, where SGLang measures it from the key it inserts, which SWA branching cuts
back to the branch point. A branch point inside a cached tombstone then gets no live copy, the
re-match stops short of it and 0.5.20's own assert (`new_prefix_len <= len(new_indices)`)
fails; 0.5.23 locks the insert's node instead of re-matching and does not reach it.

The other deliberate differences of docs/architecture.md are ours, not this tree's: SGLang's
SWA lock takes whole nodes back to the window (tombstones included), SGLang's insert caps a new
leaf at one window, a leaf may be an SWA tombstone (released early, or SWA-evicted first), and
SGLang frees a tree value's pages with its segment frees.

What our idle check, the canary sweep and reachability read is read through the tree core's
backend-neutral interface (`walk_for_kv_canary`, `collect_full_device_indices`, the size
counters, `sanity_check`), so it works on the Rust core as on the Python one; a path's token ids
are not readable there and `CachedPath.token_ids` stays empty (no caller reads them).

The tree's frees and mapping edits go through our scheduler's allocator (so reachability and
`alloc.pool_bound` see them) where it has the method: `free`, `free_swa`, `free_full` and the
mapping calls (`translate_swa_indices_for_transfer` as the `translate_loc_from_full_to_swa` it
is on this allocator). The segment frees (`free_segment`, `free_full_segment`, `free_swa_segment`,
`free_segments`, and the full side's `full_attn_allocator.free_segment`) are not in our
allocator interface and go straight to SGLang's allocator: reachability does not see them.

Only this module (and `sglang_req_to_token`, `sglang_backend`) imports `sglang`, and only when
the backend is chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_stub.mem.radix import CachedPath, MatchResult, UnfinishedResult

__all__ = ["SGLangLock", "SGLangRadixCache", "SGLangTreeReader", "TreeRelease", "tree_release"]

# Allocator calls of the tree that go through our scheduler's allocator where it has them.
_ROUTED_CALLS = frozenset({
    "free", "free_swa", "free_full", "set_full_to_swa_mapping", "clear_full_to_swa_mapping",
    "translate_loc_from_full_to_swa", "free_segment", "free_full_segment", "free_swa_segment",
    "free_segments",
})
# SGLang's static SWA allocator answers this one with `translate_loc_from_full_to_swa` (0.5.20+,
# `allocator/swa.py`): routed as that call, so reachability sees the tree read the mapping.
_ROUTED_ALIASES = {"translate_swa_indices_for_transfer": "translate_loc_from_full_to_swa"}


@dataclass(frozen=True)
class TreeRelease:
    """How the installed release's `UnifiedRadixCache` is driven, read off its API."""

    version: str
    evicted_seqlen_per_component: bool  # InsertParams.set_evicted_seqlen (0.5.23)
    insert_marks_chunked: bool  # InsertParams.chunked (up to 0.5.20)
    swa_branching: bool  # InsertParams.swa_branching_seqlen (0.5.20+)
    match_has_indices: bool  # MatchResult.device_indices (up to 0.5.20)
    relock_on_insert_node: bool  # checkpoint_into_tree (0.5.23) vs re-match (up to 0.5.20)
    swa_release: str  # "release_swa" (0.5.23) | "receipt" (0.5.20) | "uuid" (0.5.18, 0.5.19)
    evict_for_alloc: bool  # evict_for_alloc (0.5.19+) vs evict (0.5.18)
    early_swa_release_env: str  # SGLang's opt-in for the early SWA release


def tree_release() -> TreeRelease:
    """The installed sglang's tree API (imports sglang)."""
    import sglang
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult as SGLangMatch
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    insert_fields = {f.name for f in dataclasses.fields(InsertParams)}
    if hasattr(UnifiedRadixCache, "release_swa"):
        swa_release = "release_swa"
    elif "params" in inspect.signature(UnifiedRadixCache.dec_swa_lock_only).parameters:
        swa_release = "receipt"
    else:
        swa_release = "uuid"
    env = ("SGLANG_OPT_RELEASE_PREFILL_SWA" if hasattr(envs, "SGLANG_OPT_RELEASE_PREFILL_SWA")
           else "SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW")
    return TreeRelease(
        version=str(getattr(sglang, "__version__", "unknown")),
        evicted_seqlen_per_component=hasattr(InsertParams, "set_evicted_seqlen"),
        insert_marks_chunked="chunked" in insert_fields,
        swa_branching="swa_branching_seqlen" in insert_fields,
        match_has_indices="device_indices" in SGLangMatch._fields,
        relock_on_insert_node=hasattr(UnifiedRadixCache, "checkpoint_into_tree"),
        swa_release=swa_release,
        evict_for_alloc=hasattr(UnifiedRadixCache, "evict_for_alloc"),
        early_swa_release_env=env,
    )


def _engine_routed_allocator(engine_allocator: Any) -> Any:
    """SGLang's allocator as the tree must see it (an instance of its class: SGLang's SWA
    component checks), whose routed calls go through `engine_allocator` where it has them and
    everything else, state included, is SGLang's own (`engine_allocator.impl`)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    class _EngineRoutedAllocator(SWATokenToKVPoolAllocator):
        def __init__(self, engine: Any, impl: Any) -> None:  # no super(): the state is impl's
            object.__setattr__(self, "_engine", engine)
            object.__setattr__(self, "_impl", impl)

        def __getattribute__(self, name: str) -> Any:
            if name.startswith("__") or name in ("_engine", "_impl"):
                return object.__getattribute__(self, name)
            if name in _ROUTED_CALLS or name in _ROUTED_ALIASES:
                routed = getattr(object.__getattribute__(self, "_engine"), _ROUTED_ALIASES.get(name, name), None)
                if routed is not None:
                    return routed
            return getattr(object.__getattribute__(self, "_impl"), name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(object.__getattribute__(self, "_impl"), name, value)

    return _EngineRoutedAllocator(engine_allocator, engine_allocator.impl)


@dataclass
class SGLangLock:
    """A request's lock on SGLang's tree: the node and the receipt `inc_lock_ref` returned (the
    release replays it), and the SWA branching point of the match it was taken on."""

    node: int
    receipt: Any
    branching_seqlen: int | None = None  # SGLang's req.swa_branching_seqlen
    match_key: tuple[int, ...] = ()
    released: bool = False
    swa_released: bool = False  # the SWA part went back early (SGLang's opt-in)


@dataclass
class _LastMatch:
    node: int
    key: tuple[int, ...]
    branching_seqlen: int | None


@dataclass
class _Walk:
    """The tree's FULL slots as the KV-canary walk lists them, and which are SWA-live."""

    slots: list[int]
    prev: list[int]
    positions: list[int]
    live: set[int] = field(default_factory=set)


class SGLangTreeReader:
    """What a running SGLang `UnifiedRadixCache` holds, read through its tree core's
    backend-neutral interface (`walk_for_kv_canary`, `collect_full_device_indices`, the size
    counters): the Rust core (0.5.23's default) has no Python nodes to walk.

    Read-only. `memory: sglang`'s tree reads its own cache through it, and the suite's census
    reads the cache of SGLang's real server (canaries/sglang/server/census.py).

    Args:
        impl: the `UnifiedRadixCache`.
        allocator: the hybrid allocator whose `full_to_swa_index_mapping` the tree's slots are
            read through (read at each call), with its `device`.
        page_size: the allocator's page size.
    """

    def __init__(self, impl: Any, allocator: Any, page_size: int) -> None:
        self.impl = impl
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device

    def full_evictable_size(self) -> int:
        return int(self.impl.full_evictable_size())

    def full_protected_size(self) -> int:
        return int(self.impl.full_protected_size())

    def swa_evictable_size(self) -> int:
        return int(self.impl.swa_evictable_size())

    def swa_protected_size(self) -> int:
        return int(self.impl.swa_protected_size())

    def total_size(self) -> int:
        """Tokens cached (full side), tombstones included."""
        return int(self.impl.total_size()[0])

    def held_slots(self) -> torch.Tensor:
        """Every FULL slot the tree holds, int64."""
        return self._ints(self.walk().slots)

    def path_slots(self, node: int) -> torch.Tensor:
        """The FULL slots of the prefix root..`node`, int64."""
        core = self.impl.tree_core
        return core.collect_full_device_indices(node, core.root_node_handle()).to(torch.int64)

    def locked_slots(self, lock: Any) -> torch.Tensor:
        """The FULL slots of the prefix `lock` (anything with the `node` it locks) holds."""
        return self.path_slots(lock.node)

    def held_swa_slots(self) -> torch.Tensor:
        """The SWA peers of the slots of every SWA-live node, int64 (unmapped ones read 0)."""
        walk = self.walk(live=True)
        live = self._ints([s for s in walk.slots if s in walk.live])
        return self.allocator.full_to_swa_index_mapping[live].to(torch.int64)

    def locked_node_slots(self) -> torch.Tensor:
        """The FULL slots of every node some lock holds (its lock count above 0), int64: the
        walk of every node less the walk of the unlocked ones (no lock count is readable on the
        Rust core, only whether a node is locked)."""
        core = self.impl.tree_core
        unlocked = set(core.walk_for_kv_canary(unlocked_only=True, swa_resident_only=False).slot_indices.tolist())
        return self._ints([s for s in self.walk().slots if s not in unlocked])

    def cached_paths(self) -> list[CachedPath]:
        """One `CachedPath` per leaf of the walk, in its (depth-first) order."""
        walk = self.walk(live=True)
        return [CachedPath(slots=self._ints(path), token_ids=[],
                           swa_live=torch.tensor([s in walk.live for s in path], dtype=torch.bool))
                for path in _leaf_paths(walk.slots, walk.prev, walk.positions)]

    def sanity_problems(self) -> list[str]:
        """Problems found (empty when sane), at idle: SGLang's own `sanity_check` (it asserts,
        among others, that nothing is locked), the size counters' locks, and what the walk
        shows against the allocator's mapping."""
        problems = []
        try:
            self.impl.sanity_check()
        except AssertionError as exc:  # SGLang's check asserts (both tree cores)
            problems.append(f"SGLang's sanity_check: {str(exc)[:500]}")
        locked = (self.full_protected_size(), self.swa_protected_size())
        if any(locked):
            problems.append(f"protected at idle: full={locked[0]}, swa={locked[1]} (a lock leaked)")
        walk = self.walk(live=True)
        held = self._ints(walk.slots)
        if bool((held < self.page_size).any()):
            problems.append("the tree holds the padding page's slots")
        unique, counts = torch.unique(held, return_counts=True)
        if bool((counts > 1).any()):
            problems.append(f"slots held twice: {unique[counts > 1].tolist()[:20]}")
        if held.numel():
            peers = self.allocator.full_to_swa_index_mapping[held.clamp(min=0)]
            live = torch.tensor([s in walk.live for s in walk.slots], dtype=torch.bool)
            if bool((peers[live] <= 0).any()):
                problems.append(f"SWA-live slots without a peer: {held[live & (peers <= 0)].tolist()[:20]}")
            if bool((peers[~live] != 0).any()):
                problems.append(f"tombstoned slots still mapped: {held[~live & (peers != 0)].tolist()[:20]}")
        return problems

    def walk(self, *, live: bool = False) -> _Walk:
        """The walk's rows; with `live`, which of their slots are SWA-live."""
        core = self.impl.tree_core
        rows = core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
        walk = _Walk(rows.slot_indices.tolist(), rows.prev_slot_indices.tolist(), rows.positions.tolist())
        if live:
            walk.live = set(core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=True).slot_indices.tolist())
        return walk

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class SGLangRadixCache:
    """SGLang's `UnifiedRadixCache` (FULL + SWA) with `SWARadixCache`'s interface; see the
    module docstring for what differs per release.

    Args:
        allocator: the scheduler's allocator (an `SGLangSWAAllocator`, possibly wrapped for
            reachability); the tree uses its `impl`, SGLang's own.
        req_to_token_pool: an `SGLangReqToTokenPool` (the tree holds its `impl`).
        page_size, window: as for our tree; `window` is SGLang's `sliding_window_size`.
        chunked_prefill_size: the engine's chunk (None: off), as SGLang's scheduler passes it.
    """

    backend = "sglang"

    def __init__(self, allocator: Any, req_to_token_pool: Any, page_size: int, window: int,
                 *, chunked_prefill_size: int | None = None) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if page_size < 1 or window < 1:
            raise ValueError(f"page_size and window must be >= 1, got {page_size}, {window}")
        if getattr(req_to_token_pool, "backend", None) != "sglang":
            raise TypeError("SGLang's tree needs SGLang's ReqToTokenPool (SGLangReqToTokenPool)")
        self.allocator = allocator
        self.page_size = page_size
        self.window = window
        self.release = tree_release()
        self._swa = ComponentType.SWA
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token_pool.impl,
            token_to_kv_pool_allocator=_engine_routed_allocator(allocator),
            page_size=page_size,
            chunked_prefill_size=chunked_prefill_size,
            sliding_window_size=window,
            tree_components=(ComponentType.FULL, ComponentType.SWA),
        )
        self.impl = UnifiedRadixCache(params)
        self.reader = SGLangTreeReader(self.impl, allocator, page_size)
        self.tree_core_name = type(self.impl.tree_core).__name__
        self._last_match: _LastMatch | None = None
        self._branching_locks: list[SGLangLock] = []

    # ---- match and locks -----------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """SGLang's `match_prefix`: the longest prefix its validators accept (the SWA one needs
        a live window at the end), as our `MatchResult` (`last_node` is SGLang's NodeId)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        result = self.impl.match_prefix(MatchPrefixParams(key=self._key(token_ids)))
        if self.release.match_has_indices:
            slots = result.device_indices
            matched = len(slots)
        else:
            matched = result.device_prefix_len
            slots = self._path_slots(result.last_device_node)[:matched]
        branching = getattr(result, "swa_branching_seqlen", None) if self.release.swa_branching else None
        self._last_match = _LastMatch(result.last_device_node, tuple(token_ids), branching)
        return MatchResult(slots.to(torch.int64), result.last_device_node, matched)

    def inc_lock_ref(self, node: int) -> SGLangLock:
        """SGLang's `inc_lock_ref(node)`: full KV to the root, SWA over whole nodes back to a
        window. The lock carries the branching point of the match that found `node`."""
        lock = SGLangLock(node, self.impl.inc_lock_ref(node).to_dec_params())
        last = self._last_match
        if last is not None and last.node == node and last.branching_seqlen is not None:
            lock.branching_seqlen, lock.match_key = last.branching_seqlen, last.key
            self._branching_locks.append(lock)
        self._last_match = None
        return lock

    def dec_lock_ref(self, lock: SGLangLock) -> None:
        """Release what `inc_lock_ref` took (its SWA part only if not released early)."""
        if lock.released:
            raise RuntimeError(f"lock on node {lock.node} released twice")
        lock.released = True
        self._forget_branching(lock)
        self.impl.dec_lock_ref(lock.node, lock.receipt, skip_swa=lock.swa_released)

    def dec_swa_lock_only(self, lock: SGLangLock) -> None:
        """What SGLang's scheduler does once a request has decoded a window past its prefix:
        nothing unless its opt-in variable is set (the SWA part stays locked to the finish),
        else the release's own early release of the lock's SWA part."""
        if lock.released or lock.swa_released:
            raise RuntimeError(f"SWA lock on node {lock.node} released twice")
        if not self._early_swa_release_on() or self._swa_uuid(lock.receipt) is None:
            return
        how = self.release.swa_release
        if how == "release_swa":
            from sglang.srt.mem_cache.base_prefix_cache import TreeLock

            self.impl.release_swa(TreeLock(lock.node, lock.receipt))
        elif how == "receipt":
            self.impl.dec_swa_lock_only(lock.node, lock.receipt)
        else:
            self.impl.dec_swa_lock_only(lock.node, lock.receipt.swa_uuid_for_lock,
                                        skip_lock_node_ids=lock.receipt.skip_lock_node_ids)
        lock.swa_released = True

    # ---- insert --------------------------------------------------------------------------------

    def insert(self, token_ids: list[int], slots: torch.Tensor, *, prev_prefix_len: int,
               swa_evicted_seqlen: int) -> int:
        """Cache a finished request's tokens through SGLang's `insert`; the tree takes
        ownership of `slots` (duplicates of what it holds are freed by SGLang).

        Where the request's match reported an SWA branching point (0.5.20+), only the tokens
        before it are inserted and the rest are freed, as SGLang's finish does.

        Returns:
            The length that was already cached (SGLang's `InsertResult.prefix_len`).
        """
        self._check_aligned(len(token_ids), len(slots), prev_prefix_len, swa_evicted_seqlen)
        lock = self._branching_lock_for(token_ids, slots, prev_prefix_len)
        end = len(token_ids)
        if lock is not None and lock.branching_seqlen <= end:
            end = lock.branching_seqlen
        result = self._insert(token_ids[:end], slots[:end], prev_prefix_len, swa_evicted_seqlen,
                              chunked=False, branching=lock.branching_seqlen if lock else None)
        if lock is not None and getattr(result, "swa_branch_inserted", False):
            self._forget_branching(lock)
            lock.branching_seqlen = None
        if end < len(token_ids):
            self._free_tail(slots, max(end, prev_prefix_len), swa_evicted_seqlen)
        return int(result.prefix_len)

    def cache_unfinished(self, token_ids: list[int], slots: torch.Tensor, *, prev_prefix_len: int,
                         swa_evicted_seqlen: int, lock: SGLangLock | None) -> UnfinishedResult:
        """Cache a chunked prompt's processed part and move the request's lock (SGLang's
        `cache_unfinished_req` up to 0.5.20, `checkpoint_into_tree` in 0.5.23)."""
        self._check_aligned(len(token_ids), len(slots), prev_prefix_len, swa_evicted_seqlen)
        branching = lock.branching_seqlen if lock is not None else None
        end = len(token_ids)
        if branching is not None and prev_prefix_len < branching <= end:
            end = branching
        else:
            branching = None
        key_ids = token_ids[:end]
        result = self._insert(key_ids, slots[:end], prev_prefix_len, swa_evicted_seqlen,
                              chunked=True, branching=branching)
        if self.release.relock_on_insert_node:
            node = result.last_device_node
            new_slots = self._path_slots(node)
            assert len(new_slots) == end, (len(new_slots), end)  # SGLang's assert
        else:
            node, new_slots = self._rematch(key_ids)
        # SGLang's asserts: the new prefix covers what the request held and what was cached.
        assert prev_prefix_len <= len(new_slots) + self.page_size - 1, (prev_prefix_len, len(new_slots))
        assert int(result.prefix_len) <= len(new_slots), (int(result.prefix_len), len(new_slots))
        carried = None if getattr(result, "swa_branch_inserted", False) else (lock.branching_seqlen if lock else None)
        if lock is not None:
            self.dec_lock_ref(lock)
        new_lock = SGLangLock(node, self.impl.inc_lock_ref(node).to_dec_params())
        if carried is not None:
            new_lock.branching_seqlen, new_lock.match_key = carried, lock.match_key
            self._branching_locks.append(new_lock)
        return UnfinishedResult(new_slots.to(torch.int64), new_lock, len(new_slots))

    # ---- evict ---------------------------------------------------------------------------------

    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """SGLang's eviction for an allocation short of `full_tokens` full and `swa_tokens` SWA
        slots (`evict_for_alloc`; `evict` in 0.5.18). Returns (full, SWA) tokens evicted, as
        SGLang counts them."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        params = EvictParams(num_tokens=full_tokens, swa_num_tokens=swa_tokens)
        with self._outside_free_group():
            result = self.impl.evict_for_alloc(params) if self.release.evict_for_alloc else self.impl.evict(params)
        return int(result.num_tokens_evicted), int(result.swa_num_tokens_evicted)

    @contextlib.contextmanager
    def _outside_free_group(self) -> Iterator[None]:
        """Run a block with no free group open, as SGLang's scheduler evicts
        (`evict_from_tree_cache` is called from the allocation path, outside any group): our
        scheduler opens one around `evict`, in which the frees would wait for its end, and 0.5.19+
        evicts until the allocator *has* the room (`evict_for_alloc`'s availability targets), so
        it would empty the tree. An open group is ended first (releasing what it holds, as SGLang
        releases before it allocates) and opened again after, so the caller's end still pairs."""
        impl = self.allocator.impl
        legacy_flag = getattr(impl, "is_not_in_free_group", None)  # 0.5.18's spelling
        is_open = (not legacy_flag) if legacy_flag is not None else impl.free_group is not None
        if is_open:
            self.allocator.free_group_end()
        try:
            yield
        finally:
            if is_open:
                self.allocator.free_group_begin()

    def reset(self) -> None:
        """Free every cached slot and empty the tree. Refuses while any node is locked."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if self.full_protected_size() or self.swa_protected_size():
            raise RuntimeError("reset with locked nodes")
        full, swa = self.impl.total_size()
        self.impl.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        if self.total_size():
            raise RuntimeError(f"SGLang's evict left {self.total_size()} tokens in the tree")

    # ---- sizes and views (SGLangTreeReader's) ------------------------------------------------

    def full_evictable_size(self) -> int:
        return self.reader.full_evictable_size()

    def full_protected_size(self) -> int:
        return self.reader.full_protected_size()

    def swa_evictable_size(self) -> int:
        return self.reader.swa_evictable_size()

    def swa_protected_size(self) -> int:
        return self.reader.swa_protected_size()

    def total_size(self) -> int:
        """Tokens cached (full side), tombstones included."""
        return self.reader.total_size()

    def held_slots(self) -> torch.Tensor:
        """Every FULL slot the tree holds, int64."""
        return self.reader.held_slots()

    def locked_slots(self, lock: SGLangLock) -> torch.Tensor:
        """The FULL slots of the prefix `lock` locks (root to its node), int64."""
        return self.reader.locked_slots(lock)

    def held_swa_slots(self) -> torch.Tensor:
        """The SWA peers of the slots of every SWA-live node, int64 (unmapped ones read 0)."""
        return self.reader.held_swa_slots()

    def locked_node_slots(self) -> torch.Tensor:
        """The FULL slots of every locked node, int64 (`SGLangTreeReader.locked_node_slots`)."""
        return self.reader.locked_node_slots()

    def cached_paths(self) -> list[CachedPath]:
        """One `CachedPath` per leaf of the walk, in its (depth-first) order."""
        return self.reader.cached_paths()

    def sanity_check(self) -> list[str]:
        """Problems found (empty when sane), at idle (`SGLangTreeReader.sanity_problems`)."""
        return self.reader.sanity_problems()

    # ---- internals ---------------------------------------------------------------------------

    def _key(self, token_ids: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", token_ids))

    def _insert(self, token_ids: list[int], slots: torch.Tensor, prev_prefix_len: int,
                swa_evicted_seqlen: int, *, chunked: bool, branching: int | None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        kwargs: dict[str, Any] = {"key": self._key(token_ids), "value": slots.to(torch.int64).clone(),
                                  "prev_prefix_len": prev_prefix_len}
        if self.release.insert_marks_chunked:
            kwargs["chunked"] = chunked
        if branching is not None:
            kwargs["swa_branching_seqlen"] = branching
        if not self.release.evicted_seqlen_per_component:
            kwargs["swa_evicted_seqlen"] = swa_evicted_seqlen
        params = InsertParams(**kwargs)
        if self.release.evicted_seqlen_per_component:
            params.set_evicted_seqlen(self._swa, swa_evicted_seqlen)
        return self.impl.insert(params)

    def _rematch(self, token_ids: list[int]) -> tuple[int, torch.Tensor]:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        result = self.impl.match_prefix(MatchPrefixParams(key=self._key(token_ids)))
        return result.last_device_node, result.device_indices.to(torch.int64)

    def _path_slots(self, node: int) -> torch.Tensor:
        return self.reader.path_slots(node)

    def _branching_lock_for(self, token_ids: list[int], slots: torch.Tensor, prev_prefix_len: int) -> SGLangLock | None:
        """The live lock of the request whose finish this insert is: a lock with a pending
        branching point, taken on a match of a prefix of `token_ids`, whose locked prefix is
        the `prev_prefix_len` slots the request's row starts with."""
        for lock in self._branching_locks:
            if (lock.released or lock.branching_seqlen <= prev_prefix_len
                    or tuple(token_ids[:len(lock.match_key)]) != lock.match_key):
                continue
            held = self._path_slots(lock.node)
            if len(held) == prev_prefix_len and torch.equal(held, slots[:prev_prefix_len].to(torch.int64)):
                return lock
        return None

    def _forget_branching(self, lock: SGLangLock) -> None:
        if lock in self._branching_locks:
            self._branching_locks.remove(lock)

    def _free_tail(self, slots: torch.Tensor, start: int, swa_evicted_seqlen: int) -> None:
        """Free `slots[start:]`, which SGLang's finish does not cache: below the frontier their
        SWA peers are gone already (full side only)."""
        cut = max(start, min(swa_evicted_seqlen, len(slots)))
        self.allocator.free_full(slots[start:cut].to(torch.int64))
        self.allocator.free(slots[cut:].to(torch.int64))

    def _early_swa_release_on(self) -> bool:
        from sglang.srt.environ import envs

        return bool(getattr(envs, self.release.early_swa_release_env).get())

    def _swa_uuid(self, receipt: Any) -> int | None:
        if hasattr(receipt, "component_lock_uuids"):
            return receipt.component_lock_uuids.get(self._swa)
        return receipt.swa_uuid_for_lock

    def _check_aligned(self, n: int, n_slots: int, prev_prefix_len: int, evicted: int) -> None:
        page = self.page_size
        if n_slots != n or n % page or prev_prefix_len % page or evicted % page:
            raise ValueError(f"insert needs page-aligned lengths (page_size={page}): tokens={n}, "
                             f"slots={n_slots}, prev_prefix_len={prev_prefix_len}, swa_evicted={evicted}")


def _leaf_paths(slots: list[int], prev: list[int], positions: list[int]) -> list[list[int]]:
    """Root-to-leaf slot paths from the walk's (slot, previous slot, position) rows, in row order.

    A row at position 0 starts at the root (its previous slot reads -1); any other row's parent
    is the row holding its previous slot at the nearest position below it (an evicted node holds
    no slots but spans its key, so positions may jump). The previous slot alone cannot tell the
    root's -1 from a stored slot value -1 (a corrupted row inserted into the tree): read that
    way, every path through it was cut there and the slots past it never checked. A leaf row is
    one no row has as its parent. A corrupted tree may hold a slot twice: the walk up stops at a
    repeat rather than loop.
    """
    rows_of: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        rows_of.setdefault(slot, []).append(i)

    def parent(i: int) -> int | None:
        if positions[i] == 0:
            return None
        below = [j for j in rows_of.get(prev[i], ()) if positions[j] < positions[i]]
        return max(below, key=lambda j: positions[j]) if below else None

    parents = [parent(i) for i in range(len(slots))]
    has_child = {j for j in parents if j is not None}
    paths = []
    for i in range(len(slots)):
        if i in has_child:
            continue
        path, seen, j = [], set(), i
        while j is not None and j not in seen:
            seen.add(j)
            path.append(slots[j])
            j = parents[j]
        paths.append(path[::-1])
    return paths
