"""engine_stub.mem.radix: prefix matching, tombstones, duplicate frees, two-budget eviction, locks.

Every test runs at invariant level STRICT, so an illegal free by the tree (a released SWA peer
freed again, a full slot freed with its peer still mapped, a double free) raises at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch

from engine_stub.invariants import hit_counts, override_level
from engine_stub.mem.radix import LockHandle, SWARadixCache, TreeNode
from engine_stub.mem.swa import SWATokenToKVPoolAllocator

WINDOW = 8
FULL_SIZE = 256
SWA_SIZE = 128


@pytest.fixture(autouse=True)
def _strict_invariants() -> Iterator[None]:
    """Crash on any invariant firing, whatever the environment says."""
    with override_level("strict"):
        yield


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def page_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def alloc(page_size: int) -> SWATokenToKVPoolAllocator:
    return SWATokenToKVPoolAllocator(FULL_SIZE, SWA_SIZE, page_size)


@pytest.fixture
def tree(alloc: SWATokenToKVPoolAllocator, page_size: int) -> SWARadixCache:
    return SWARadixCache(alloc, page_size, WINDOW)


def _tokens(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def _assert_ledgers_balance(
    alloc: SWATokenToKVPoolAllocator,
    tree: SWARadixCache,
    *,
    held_full: int = 0,
    held_swa: int = 0,
) -> None:
    """available + evictable + protected (+ what live requests hold) == size, on both sides."""
    alloc.merge_and_sort_free()
    full = alloc.full_available_size() + tree.full_evictable_size() + tree.full_protected_size()
    swa = alloc.swa_available_size() + tree.swa_evictable_size() + tree.swa_protected_size()
    assert full + held_full == alloc.size_full
    assert swa + held_swa == alloc.size_swa
    assert tree.total_size() == tree.full_evictable_size() + tree.full_protected_size()


def _cache(
    alloc: SWATokenToKVPoolAllocator,
    tree: SWARadixCache,
    token_ids: list[int],
    *,
    swa_evicted: int = 0,
) -> torch.Tensor:
    """A fresh request for `token_ids`: alloc, window-evict `[0, swa_evicted)`, insert."""
    slots = alloc.alloc(len(token_ids))
    assert slots is not None
    alloc.free_swa(slots[:swa_evicted])
    tree.insert(token_ids, slots, prev_prefix_len=0, swa_evicted_seqlen=swa_evicted)
    return slots


def _available(alloc: SWATokenToKVPoolAllocator) -> tuple[int, int]:
    alloc.merge_and_sort_free()
    return alloc.full_available_size(), alloc.swa_available_size()


def _node_at(tree: SWARadixCache, token_ids: list[int]) -> TreeNode:
    """The node whose key ends exactly at the end of `token_ids` (splitting if needed)."""
    node, pos = tree.root, 0
    while pos < len(token_ids):
        node = node.children[tuple(token_ids[pos : pos + tree.page_size])]
        pos += len(node.key)
    assert pos == len(token_ids), "no node boundary there"
    return node


# ---- match -------------------------------------------------------------------------------------


def test_match_after_insert_returns_inserted_slots(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    slots = _cache(alloc, tree, toks)

    full = tree.match_prefix(toks + [999, 998, 997])
    assert full.matched_len == 16
    assert torch.equal(full.slots, slots)

    partial = tree.match_prefix(toks[:8] + [999] * 4)
    assert partial.matched_len == 8
    assert partial.last_node.key == toks[:8]  # split at the match end
    assert torch.equal(partial.slots, slots[:8])
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_match_with_no_cached_prefix_returns_root(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    _cache(alloc, tree, _tokens(16))

    miss = tree.match_prefix(_tokens(16, base=500))
    assert (miss.matched_len, miss.last_node, miss.slots.numel()) == (0, tree.root, 0)


@pytest.mark.parametrize(
    ("swa_evicted", "query_len", "expected"),
    [
        pytest.param(12, 16, 0, id="4-live-after-tombstone"),
        pytest.param(8, 16, 16, id="window-live-after-tombstone"),
        pytest.param(4, 8, 0, id="prefix-ends-too-soon"),
        pytest.param(4, 12, 12, id="prefix-ends-after-window"),
        pytest.param(0, 4, 4, id="no-tombstone"),
    ],
)
def test_match_through_tombstone_needs_a_live_window_after_it(
    alloc: SWATokenToKVPoolAllocator,
    tree: SWARadixCache,
    swa_evicted: int,
    query_len: int,
    expected: int,
) -> None:
    toks = _tokens(16)
    slots = _cache(alloc, tree, toks, swa_evicted=swa_evicted)

    result = tree.match_prefix(toks[:query_len])
    assert result.matched_len == expected
    assert torch.equal(result.slots, slots[:expected])
    if expected == 0:
        assert result.last_node is tree.root
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


# ---- insert ------------------------------------------------------------------------------------


@pytest.mark.parametrize("swa_evicted", [0, 8, 16], ids=["live", "half-evicted", "all-evicted"])
def test_insert_duplicate_frees_incoming_slots(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache, swa_evicted: int
) -> None:
    toks = _tokens(16)
    original = _cache(alloc, tree, toks)
    before = _available(alloc)

    dup = alloc.alloc(16)
    assert dup is not None
    alloc.free_swa(dup[:swa_evicted])
    cached = tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=swa_evicted)

    assert cached == 16
    assert _available(alloc) == before
    assert torch.equal(tree.match_prefix(toks).slots, original)
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_live_copy_over_unlocked_tombstone_adopts_it_and_frees_the_tree_full_slots(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    original = _cache(alloc, tree, toks, swa_evicted=8)
    dup = alloc.alloc(16)
    assert dup is not None

    assert tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=0) == 16

    # The tombstone took the incoming head (its SWA KV is live again); the tree's own head and
    # the incoming duplicate of the live tail went back.
    (path,) = tree.cached_paths()
    assert torch.equal(path.slots, torch.cat([dup[:8], original[8:]]))
    assert path.swa_live.tolist() == [True] * 16
    assert _available(alloc) == (FULL_SIZE - 16, SWA_SIZE - 16)
    assert tree.match_prefix(toks).matched_len == 16
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_live_copy_over_locked_tombstone_repairs_the_locked_full_slots(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    original = _cache(alloc, tree, toks, swa_evicted=8)
    handle = tree.inc_lock_ref(_node_at(tree, toks))  # a running request holds both nodes in full
    dup = alloc.alloc(16)
    assert dup is not None
    dup_peers = alloc.translate_loc_from_full_to_swa(dup[:8]).clone()

    tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=0)

    # The locked full slots stay where the running request reads them, paired with the incoming
    # SWA peers; only the incoming full slots went back.
    (path,) = tree.cached_paths()
    assert torch.equal(path.slots, original)
    assert path.swa_live.tolist() == [True] * 16
    assert torch.equal(alloc.translate_loc_from_full_to_swa(original[:8]), dup_peers)
    assert alloc.translate_loc_from_full_to_swa(dup).tolist() == [0] * 16
    tree.dec_lock_ref(handle)
    assert _available(alloc) == (FULL_SIZE - 16, SWA_SIZE - 16)
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


@pytest.mark.parametrize("locked", [False, True], ids=["unlocked", "locked"])
def test_insert_partly_live_copy_over_tombstone_splits_and_adopts_the_live_tail(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache, page_size: int, locked: bool
) -> None:
    toks = _tokens(16)
    original = _cache(alloc, tree, toks, swa_evicted=8)
    handle = tree.inc_lock_ref(_node_at(tree, toks)) if locked else None
    dup = alloc.alloc(16)
    assert dup is not None
    alloc.free_swa(dup[:4])  # the incoming copy slid its first 4 tokens out of the window

    tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=4)

    (path,) = tree.cached_paths()
    assert path.swa_live.tolist() == [False] * 4 + [True] * 12
    head = original[:4]
    assert torch.equal(path.slots, original if locked else torch.cat([head, dup[4:8], original[8:]]))
    if handle is not None:
        tree.dec_lock_ref(handle)
    assert _available(alloc) == (FULL_SIZE - 16, SWA_SIZE - 12)
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_evicted_copy_over_tombstone_frees_the_incoming_full_slots(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    original = _cache(alloc, tree, toks, swa_evicted=8)
    before = _available(alloc)
    dup = alloc.alloc(16)
    assert dup is not None
    alloc.free_swa(dup[:8])

    assert tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=8) == 16

    assert _available(alloc) == before
    (path,) = tree.cached_paths()
    assert torch.equal(path.slots, original)
    assert path.swa_live.tolist() == [False] * 8 + [True] * 8
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


@pytest.mark.parametrize("locked", [False, True], ids=["unlocked", "locked"])
def test_recover_tombstone_inside_a_free_group_keeps_the_guard_quiet_and_ledgers_balanced(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache, locked: bool
) -> None:
    """The finish path runs inside one free group (SGLang's process_batch_result): the re-paired
    slots must not trip `swa.peer_released`, whose check runs at enqueue, and the group end must
    release exactly the incoming full slots and the tree's old ones, never the adopted SWA peers."""
    toks = _tokens(16)
    original = _cache(alloc, tree, toks, swa_evicted=8)
    handle = tree.inc_lock_ref(_node_at(tree, toks)) if locked else None
    other = alloc.alloc(8)  # a second finishing request, freed in the same group
    dup = alloc.alloc(16)
    assert other is not None and dup is not None
    adopted = alloc.translate_loc_from_full_to_swa(dup[:8]).clone()

    alloc.free_group_begin()
    alloc.free(other)
    tree.insert(toks, dup, prev_prefix_len=0, swa_evicted_seqlen=0)
    alloc.free_group_end()

    assert hit_counts()["swa.peer_released"] == 0 and hit_counts()["swa.peer_mapped"] == 0
    live_head = original[:8] if locked else dup[:8]
    assert torch.equal(alloc.translate_loc_from_full_to_swa(live_head), adopted)
    if handle is not None:
        tree.dec_lock_ref(handle)
    assert _available(alloc) == (FULL_SIZE - 16, SWA_SIZE - 16)
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_below_prev_prefix_len_touches_nothing(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    first = _cache(alloc, tree, shared + _tokens(8, base=100))
    match = tree.match_prefix(shared)
    handle = tree.inc_lock_ref(match.last_node)
    own = alloc.alloc(8)
    assert own is not None
    _assert_ledgers_balance(alloc, tree, held_full=8, held_swa=8)

    cached = tree.insert(
        shared + _tokens(8, base=200),
        torch.cat([match.slots, own]),
        prev_prefix_len=8,
        swa_evicted_seqlen=0,
    )
    tree.dec_lock_ref(handle)

    assert cached == 8
    slots_by_leaf = {tuple(p.token_ids[8:]): p.slots for p in tree.cached_paths()}
    assert torch.equal(slots_by_leaf[tuple(_tokens(8, base=100))], first)
    assert torch.equal(slots_by_leaf[tuple(_tokens(8, base=200))], torch.cat([first[:8], own]))
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_with_evicted_prefix_creates_tombstone_and_live_leaf(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    slots = _cache(alloc, tree, toks, swa_evicted=8)

    (tombstone,) = tree.root.children.values()
    (leaf,) = tombstone.children.values()
    assert (tombstone.key, tombstone.swa_tombstone) == (toks[:8], True)
    assert (leaf.key, leaf.swa_tombstone, leaf.children) == (toks[8:], False, {})
    assert torch.equal(torch.cat([tombstone.value, leaf.value]), slots)
    assert (tree.full_evictable_size(), tree.swa_evictable_size()) == (16, 8)
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


@pytest.mark.parametrize("cached_prefix", [0, 8])
def test_insert_with_whole_tail_evicted_frees_full_and_adds_no_node(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache, cached_prefix: int
) -> None:
    toks = _tokens(16)
    if cached_prefix:
        _cache(alloc, tree, toks[:cached_prefix])
    before = _available(alloc)

    slots = alloc.alloc(16)
    assert slots is not None
    alloc.free_swa(slots)
    cached = tree.insert(toks, slots, prev_prefix_len=0, swa_evicted_seqlen=16)

    assert cached == cached_prefix
    assert _available(alloc) == before
    assert tree.total_size() == cached_prefix
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_insert_copies_slots_out_of_a_reused_row(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(16)
    row = alloc.alloc(16)
    assert row is not None
    slots = row.clone()
    tree.insert(toks, row[:16], prev_prefix_len=0, swa_evicted_seqlen=0)

    row.fill_(0)  # the request's row is handed to the next request
    assert torch.equal(tree.match_prefix(toks).slots, slots)
    assert tree.sanity_check() == []


def test_insert_unaligned_lengths_raise(alloc: SWATokenToKVPoolAllocator) -> None:
    tree = SWARadixCache(alloc, 4, WINDOW)
    slots = torch.arange(4, 10)
    with pytest.raises(ValueError, match="page-aligned"):
        tree.insert(_tokens(6), slots, prev_prefix_len=0, swa_evicted_seqlen=0)


# ---- evict -------------------------------------------------------------------------------------


def test_evict_full_frees_lru_leaves_and_cascades_tombstone_parents(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    a, b = shared + _tokens(8, base=100), shared + _tokens(8, base=200)
    _cache(alloc, tree, a, swa_evicted=8)
    _cache(alloc, tree, b, swa_evicted=8)  # the shared tombstone now has two leaves
    tree.match_prefix(a)  # b is the least recently used

    assert tree.evict(1, 0) == (8, 8)
    assert [p.token_ids for p in tree.cached_paths()] == [a]
    _assert_ledgers_balance(alloc, tree)

    assert tree.evict(1, 0) == (16, 8)  # a, then its tombstone parent (full side only)
    assert tree.total_size() == 0
    assert _available(alloc) == (FULL_SIZE, SWA_SIZE)


def test_evict_swa_tombstones_internal_nodes_and_frees_leaves(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    a, b = shared + _tokens(8, base=100), shared + _tokens(8, base=200)
    _cache(alloc, tree, a)
    _cache(alloc, tree, b)
    handle = tree.inc_lock_ref(_node_at(tree, b))  # b's leaf covers the window by itself

    assert tree.evict(0, 1000) == (8, 16)  # a freed and deleted, the shared node tombstoned
    shared_node = _node_at(tree, shared)
    assert shared_node.swa_tombstone and not _node_at(tree, b).swa_tombstone
    assert [p.token_ids for p in tree.cached_paths()] == [b]
    _assert_ledgers_balance(alloc, tree)

    tree.dec_lock_ref(handle)
    # b freed, then its tombstone parent; like SGLang the SWA phase counts only the leaf.
    assert tree.evict(0, 1) == (8, 8)
    assert _available(alloc) == (FULL_SIZE, SWA_SIZE)


def test_evict_never_touches_locked_nodes(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(24)
    slots = _cache(alloc, tree, toks)
    tree.match_prefix(toks[:8])
    tree.match_prefix(toks[:16])  # three nodes of 8
    handle = tree.inc_lock_ref(tree.match_prefix(toks).last_node)
    assert (tree.full_protected_size(), tree.swa_protected_size()) == (24, WINDOW)

    assert tree.evict(1000, 1000) == (0, 16)  # only the two SWA-unlocked ancestors, tombstoned
    assert tree.total_size() == 24
    assert [p.swa_live.tolist() for p in tree.cached_paths()] == [[False] * 16 + [True] * 8]
    assert torch.equal(tree.match_prefix(toks).slots, slots)  # a full window after the tombstones
    _assert_ledgers_balance(alloc, tree)

    tree.dec_lock_ref(handle)
    assert tree.sanity_check() == []
    assert tree.evict(1000, 0) == (24, 8)
    assert _available(alloc) == (FULL_SIZE, SWA_SIZE)


def test_swa_evict_under_pressure_tombstones_the_shared_prefix_and_keeps_the_leaves(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    a, b = shared + _tokens(8, base=100), shared + _tokens(8, base=200)
    _cache(alloc, tree, a)
    _cache(alloc, tree, b)  # splits a's node: the shared head is now older than both leaves

    assert tree.evict(0, 8) == (0, 8)

    assert _node_at(tree, shared).swa_tombstone
    paths = {tuple(p.token_ids): p.swa_live.tolist() for p in tree.cached_paths()}
    assert paths == {tuple(a): [False] * 8 + [True] * 8, tuple(b): [False] * 8 + [True] * 8}
    assert tree.total_size() == 24
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_match_then_swa_evict_takes_other_leaves_then_the_matched_prefix_not_its_leaf(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    a, b = shared + _tokens(8, base=100), shared + _tokens(8, base=200)
    _cache(alloc, tree, a)
    _cache(alloc, tree, b)
    tree.match_prefix(a)  # a's path is now the most recent, its leaf more recent than the prefix

    assert tree.evict(0, 8) == (8, 8)  # b's leaf, the least recently used, goes whole
    assert [p.token_ids for p in tree.cached_paths()] == [a]
    assert tree.evict(0, 8) == (0, 8)  # then the shared prefix is tombstoned; a's leaf stays
    (path,) = tree.cached_paths()
    assert path.swa_live.tolist() == [False] * 8 + [True] * 8
    _assert_ledgers_balance(alloc, tree)
    assert tree.sanity_check() == []


def test_lru_lists_order_a_touched_path_child_after_parent(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(24)
    _cache(alloc, tree, toks, swa_evicted=8)  # a tombstone of 8, a live leaf of 16
    tree.match_prefix(toks[:16])  # splits the leaf: nodes of 8 (tombstone), 8, 8

    first, middle, last = (_node_at(tree, toks[:n]) for n in (8, 16, 24))
    assert tree.full_lru_list.nodes() == [last, first, middle]
    assert tree.swa_lru_list.nodes() == [last, middle]  # no tombstone on the SWA list
    assert tree.sanity_check() == []


def test_evict_with_nothing_cached_frees_nothing(tree: SWARadixCache) -> None:
    assert tree.evict(100, 100) == (0, 0)


# ---- locks -------------------------------------------------------------------------------------


def test_lock_swa_covers_exactly_one_window_and_survives_splits(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(20)
    _cache(alloc, tree, toks)
    tree.match_prefix(toks[:8])
    tree.match_prefix(toks[:16])  # nodes of 8, 8, 4
    handle = tree.inc_lock_ref(tree.match_prefix(toks).last_node)
    # 4 + the last 4 of the middle node, which the lock splits: SGLang would lock all 8 of it
    # (12 in all), a node more of live SWA than the window reads.
    assert handle.swa_locked_tokens == 8
    assert (tree.full_protected_size(), tree.swa_protected_size()) == (20, 8)

    tree.match_prefix(toks[:14])  # split a node inside the SWA-locked range
    _assert_ledgers_balance(alloc, tree)
    tree.dec_lock_ref(handle)

    assert (tree.full_protected_size(), tree.swa_protected_size()) == (0, 0)
    assert tree.sanity_check() == []


def test_lock_stops_swa_at_a_tombstone(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(12)
    _cache(alloc, tree, toks, swa_evicted=8)
    handle = tree.inc_lock_ref(_node_at(tree, toks))
    assert handle.swa_locked_tokens == 4
    assert (tree.full_protected_size(), tree.swa_protected_size()) == (12, 4)
    tree.dec_lock_ref(handle)
    assert tree.sanity_check() == []


def test_dec_lock_ref_twice_raises(alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache) -> None:
    toks = _tokens(8)
    _cache(alloc, tree, toks)
    handle = tree.inc_lock_ref(tree.match_prefix(toks).last_node)
    tree.dec_lock_ref(handle)
    with pytest.raises(RuntimeError, match="released twice"):
        tree.dec_lock_ref(handle)


# ---- views, reset, sanity ------------------------------------------------------------------------


def test_cached_paths_list_each_leaf_with_swa_liveness(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    shared = _tokens(8)
    a, b = shared + _tokens(8, base=100), shared + _tokens(12, base=200)
    slots_a = _cache(alloc, tree, a, swa_evicted=8)
    slots_b = _cache(alloc, tree, b, swa_evicted=8)

    paths = {tuple(p.token_ids): p for p in tree.cached_paths()}
    assert set(paths) == {tuple(a), tuple(b)}
    assert torch.equal(paths[tuple(a)].slots, slots_a)
    assert torch.equal(paths[tuple(b)].slots, torch.cat([slots_a[:8], slots_b[8:]]))
    assert paths[tuple(b)].swa_live.tolist() == [False] * 8 + [True] * 12


def test_held_slots_and_reset_free_everything(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    slots_a = _cache(alloc, tree, _tokens(16), swa_evicted=8)
    slots_b = _cache(alloc, tree, _tokens(8, base=100))
    assert sorted(tree.held_slots().tolist()) == sorted(torch.cat([slots_a, slots_b]).tolist())

    tree.reset()
    assert tree.held_slots().numel() == 0
    assert _available(alloc) == (FULL_SIZE, SWA_SIZE)


def test_reset_with_a_lock_held_raises(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache
) -> None:
    toks = _tokens(8)
    _cache(alloc, tree, toks)
    tree.inc_lock_ref(tree.match_prefix(toks).last_node)
    with pytest.raises(RuntimeError, match="locked"):
        tree.reset()


def _plant_lock(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    tree.inc_lock_ref(_node_at(tree, _tokens(16)))


def _plant_mapped_tombstone(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    tombstone = _node_at(tree, _tokens(8))
    alloc.set_full_to_swa_mapping(tombstone.value[:1], torch.tensor([5]))


def _plant_unmapped_live(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    alloc.clear_full_to_swa_mapping(_node_at(tree, _tokens(16)).value[-1:])


def _plant_tombstone_leaf(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    _node_at(tree, _tokens(16)).swa_tombstone = True


def _plant_slot_twice(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    leaf = _node_at(tree, _tokens(16))
    leaf.value = leaf.value.clone()
    leaf.value[0] = _node_at(tree, _tokens(8)).value[0]


def _plant_swa_lock_above_full(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    _node_at(tree, _tokens(16)).swa_lock_ref = 1


def _plant_short_value(tree: SWARadixCache, alloc: SWATokenToKVPoolAllocator) -> None:
    leaf = _node_at(tree, _tokens(16))
    leaf.value = leaf.value[:-1]


@pytest.mark.parametrize(
    ("plant", "reported"),
    [
        pytest.param(_plant_lock, "locked at idle", id="lock-left-held"),
        pytest.param(_plant_mapped_tombstone, "still mapped", id="mapped-tombstone"),
        pytest.param(_plant_unmapped_live, "no SWA peer", id="unmapped-live"),
        pytest.param(_plant_tombstone_leaf, "tombstone leaf", id="tombstone-leaf"),
        pytest.param(_plant_slot_twice, "held twice", id="slot-twice"),
        pytest.param(_plant_swa_lock_above_full, "full_lock_ref < swa_lock_ref", id="lock-order"),
        pytest.param(_plant_short_value, "key/value lengths", id="length-mismatch"),
    ],
)
def test_sanity_check_reports_a_planted_problem(
    alloc: SWATokenToKVPoolAllocator,
    tree: SWARadixCache,
    plant: Callable[[SWARadixCache, SWATokenToKVPoolAllocator], None],
    reported: str,
) -> None:
    _cache(alloc, tree, _tokens(16), swa_evicted=8)
    assert tree.sanity_check() == []

    plant(tree, alloc)

    problems = tree.sanity_check()
    assert any(reported in p for p in problems), problems


# ---- a seeded workload -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_ledgers_balanced_and_drains_to_full(
    alloc: SWATokenToKVPoolAllocator, tree: SWARadixCache, page_size: int, seed: int
) -> None:
    rng = random.Random(seed)
    prefixes = [_tokens(rng.randrange(1, 5) * 8, base=1000 * i) for i in range(3)]
    for step in range(60):
        n = rng.randrange(1, 9) * 4
        toks = (rng.choice(prefixes) + _tokens(n, base=10_000 * (step % 7)))[: 8 + n]
        toks = toks[: len(toks) // page_size * page_size]
        match = tree.match_prefix(toks)
        handle: LockHandle = tree.inc_lock_ref(match.last_node)
        prev = match.matched_len
        need = len(toks) - prev
        new = alloc.alloc(need)
        if new is None:
            tree.evict(need, need)
            new = alloc.alloc(need)
        assert new is not None
        _assert_ledgers_balance(alloc, tree, held_full=need, held_swa=need)
        # Window eviction frees only the request's own slots: the frontier starts at prev.
        evicted = prev + rng.randrange(0, need // page_size + 1) * page_size
        alloc.free_swa(new[: evicted - prev])
        _assert_ledgers_balance(alloc, tree, held_full=need, held_swa=len(toks) - evicted)

        slots = torch.cat([match.slots, new])
        tree.insert(toks, slots, prev_prefix_len=prev, swa_evicted_seqlen=evicted)
        tree.dec_lock_ref(handle)
        _assert_ledgers_balance(alloc, tree)
        assert tree.sanity_check() == []
        if rng.random() < 0.3:
            tree.evict(rng.randrange(0, 40), rng.randrange(0, 40))
            _assert_ledgers_balance(alloc, tree)
            assert tree.sanity_check() == []

    tree.evict(FULL_SIZE, SWA_SIZE)
    assert tree.total_size() == 0
    assert _available(alloc) == (FULL_SIZE, SWA_SIZE)
