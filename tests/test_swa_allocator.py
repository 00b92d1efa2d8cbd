"""SWATokenToKVPoolAllocator: scripted behaviour tables and the PR #36723 contract."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from engine_stub.invariants import (
    InvariantCheckLevel,
    InvariantViolation,
    drain_firings,
    hit_counts,
    override_level,
    reset_counters,
)
from engine_stub.mem import PureSWATokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.synccheck import count_syncs

OFF, WARN, STRICT = InvariantCheckLevel.OFF, InvariantCheckLevel.WARN, InvariantCheckLevel.STRICT
# Pool sizes per page size: (full slots, SWA slots).
POOLS = {1: (16, 8), 4: (32, 16)}


def _make_allocator(page_size: int = 1) -> SWATokenToKVPoolAllocator:
    size, size_swa = POOLS[page_size]
    return SWATokenToKVPoolAllocator(size, size_swa, page_size)


def _ids(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def _sizes(allocator: SWATokenToKVPoolAllocator) -> tuple[int, int]:
    return allocator.full_available_size(), allocator.swa_available_size()


def _alloc(allocator: SWATokenToKVPoolAllocator, n: int) -> torch.Tensor:
    slots = allocator.alloc(n)
    assert slots is not None
    return slots


def _peer_mapped_predicate(allocator: SWATokenToKVPoolAllocator, slots: torch.Tensor) -> bool:
    """The predicate `free_swa` hands the async assert for `swa.peer_mapped`, as a bool."""
    with override_level(STRICT), mock.patch.object(torch, "_assert_async") as assert_async:
        allocator.free_swa(slots)
    (call,) = [c for c in assert_async.call_args_list if "[swa.peer_mapped]" in c.args[1]]
    return bool(call.args[0])


# A script step: (op, argument, what alloc returns, (full avail, SWA avail) after the step,
# {full slot: mapping entry} for the slots the step touched).
Step = tuple[str, object, object, tuple[int, int], dict[int, int]]

# need_sort=False (SGLang outside PD disaggregation, the engine's setting): a page_size 1 free
# joins the free list's tail at once, a paged free its head (the next page handed out).
SCRIPT_PAGE_1: list[Step] = [
    ("alloc", 4, [1, 2, 3, 4], (12, 4), {1: 1, 2: 2, 3: 3, 4: 4}),
    ("free_swa", [1, 2], None, (12, 6), {1: 0, 2: 0, 3: 3, 4: 4}),
    ("free_full", [1, 2], None, (14, 6), {1: 0, 2: 0}),
    # The freed SWA slots come back from the list's tail: the pairing stops being identity.
    ("alloc", 6, [5, 6, 7, 8, 9, 10], (8, 0), {5: 5, 6: 6, 7: 7, 8: 8, 9: 1, 10: 2}),
    ("alloc", 1, None, (8, 0), {}),
    ("free", [3, 4], None, (10, 2), {3: 0, 4: 0}),
    ("begin", None, None, (10, 2), {}),
    ("free_swa", [5, 6], None, (10, 2), {5: 0, 6: 0}),
    ("free", [7, 8], None, (10, 2), {7: 0, 8: 0}),
    ("free_full", [5, 6], None, (10, 2), {5: 0, 6: 0}),
    ("end", None, None, (14, 6), {9: 1, 10: 2}),
    ("clear", [9, 10], None, (14, 6), {9: 0, 10: 0}),
    # The cleared peers (SWA 1 and 2) are stranded: only the full side comes back.
    ("free_full", [9, 10], None, (16, 6), {9: 0, 10: 0}),
]

SCRIPT_PAGE_4: list[Step] = [
    ("alloc", 8, list(range(4, 12)), (24, 8), {4: 4, 7: 7, 8: 8, 11: 11}),
    # One slot stands for its whole page.
    ("free_swa", [5], None, (24, 12), {4: 0, 5: 0, 6: 0, 7: 0, 8: 8}),
    ("free_full", [4, 5, 6, 7], None, (28, 12), {4: 0, 7: 0}),
    # The freed page is the first one handed out again, on both sides.
    ("alloc", 12, [*range(4, 8), *range(12, 20)], (16, 0), {4: 4, 7: 7, 12: 12, 19: 19}),
    ("alloc", 4, None, (16, 0), {}),
    ("free", [8, 9, 10, 11], None, (20, 4), {8: 0, 11: 0}),
    ("begin", None, None, (20, 4), {}),
    ("free_swa", [12], None, (20, 4), {12: 0, 13: 0, 14: 0, 15: 0, 16: 16}),
    ("free", [16, 17, 18, 19], None, (20, 4), {16: 0, 19: 0}),
    ("free_full", [12, 13, 14, 15], None, (20, 4), {12: 0}),
    ("end", None, None, (28, 12), {4: 4, 7: 7}),
    ("clear", [4, 5, 6, 7], None, (28, 12), {4: 0, 7: 0}),
    ("free_full", [4, 5, 6, 7], None, (32, 12), {4: 0}),
]

# need_sort=True (SGLang under PD disaggregation): frees are staged and sorted in when short.
SORTED_SCRIPT_PAGE_1: list[Step] = [
    ("alloc", 4, [1, 2, 3, 4], (12, 4), {1: 1, 2: 2, 3: 3, 4: 4}),
    ("free_swa", [1, 2], None, (12, 6), {1: 0, 2: 0, 3: 3, 4: 4}),
    ("free_full", [1, 2], None, (14, 6), {1: 0, 2: 0}),
    # The SWA side runs short of unstaged slots and merges: the pairing stops being identity.
    ("alloc", 6, [5, 6, 7, 8, 9, 10], (8, 0), {5: 1, 6: 2, 7: 5, 8: 6, 9: 7, 10: 8}),
    ("alloc", 1, None, (8, 0), {}),
    ("free", [3, 4], None, (10, 2), {3: 0, 4: 0}),
    ("begin", None, None, (10, 2), {}),
    ("free_swa", [5, 6], None, (10, 2), {5: 0, 6: 0}),
    ("free", [7, 8], None, (10, 2), {7: 0, 8: 0}),
    ("free_full", [5, 6], None, (10, 2), {5: 0, 6: 0}),
    ("end", None, None, (14, 6), {9: 7, 10: 8}),
    ("clear", [9, 10], None, (14, 6), {9: 0, 10: 0}),
    # The cleared peers (SWA 7 and 8) are stranded: only the full side comes back.
    ("free_full", [9, 10], None, (16, 6), {9: 0, 10: 0}),
]

SORTED_SCRIPT_PAGE_4: list[Step] = [
    ("alloc", 8, list(range(4, 12)), (24, 8), {4: 4, 7: 7, 8: 8, 11: 11}),
    # One slot stands for its whole page.
    ("free_swa", [5], None, (24, 12), {4: 0, 5: 0, 6: 0, 7: 0, 8: 8}),
    ("free_full", [4, 5, 6, 7], None, (28, 12), {4: 0, 7: 0}),
    ("alloc", 12, list(range(12, 24)), (16, 0), {12: 4, 15: 7, 16: 12, 19: 15, 20: 16, 23: 19}),
    ("alloc", 4, None, (16, 0), {}),
    ("free", [8, 9, 10, 11], None, (20, 4), {8: 0, 11: 0}),
    ("begin", None, None, (20, 4), {}),
    ("free_swa", [12], None, (20, 4), {12: 0, 13: 0, 14: 0, 15: 0, 16: 12}),
    ("free", [16, 17, 18, 19], None, (20, 4), {16: 0, 19: 0}),
    ("free_full", [12, 13, 14, 15], None, (20, 4), {12: 0}),
    ("end", None, None, (28, 12), {20: 16, 23: 19}),
    ("clear", [20, 21, 22, 23], None, (28, 12), {20: 0, 23: 0}),
    ("free_full", [20, 21, 22, 23], None, (32, 12), {20: 0}),
]


def _run_step(allocator: SWATokenToKVPoolAllocator, op: str, arg: object) -> torch.Tensor | None:
    if op == "alloc":
        return allocator.alloc(arg)
    if op == "begin":
        allocator.free_group_begin()
    elif op == "end":
        allocator.free_group_end()
    elif op == "clear":
        allocator.clear_full_to_swa_mapping(_ids(*arg))
    else:
        getattr(allocator, op)(_ids(*arg))
    return None


class TestScript:
    @pytest.mark.parametrize(
        ("page_size", "need_sort", "script"),
        [
            (1, False, SCRIPT_PAGE_1),
            (4, False, SCRIPT_PAGE_4),
            (1, True, SORTED_SCRIPT_PAGE_1),
            (4, True, SORTED_SCRIPT_PAGE_4),
        ],
        ids=["page1", "page4", "page1-need-sort", "page4-need-sort"],
    )
    def test_script_step_leaves_expected_sizes_and_mapping(
        self, page_size: int, need_sort: bool, script: list[Step]
    ) -> None:
        size, size_swa = POOLS[page_size]
        allocator = SWATokenToKVPoolAllocator(size, size_swa, page_size, need_sort=need_sort)
        mapping = allocator.full_to_swa_index_mapping
        for number, (op, arg, returns, sizes, touched) in enumerate(script):
            where = f"step {number}: {op}({arg})"
            out = _run_step(allocator, op, arg)
            if op == "alloc":
                assert (None if out is None else out.tolist()) == returns, where
            assert _sizes(allocator) == sizes, where
            assert {slot: int(mapping[slot]) for slot in touched} == touched, where
            assert int(mapping[-1]) == -1, where
            assert allocator.available_size() == min(sizes), where
        assert allocator.drop_counts() == {
            side: {"double_free": 0, "out_of_pool": 0, "reserved": 0} for side in ("full", "swa")
        }


class TestMapping:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_construct_mapping_has_padding_and_minus_one_tail(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        mapping = allocator.full_to_swa_index_mapping
        size, size_swa = POOLS[page_size]
        assert mapping.shape == (size + page_size + 1,)
        assert mapping.dtype == torch.int64
        assert int(mapping[-1]) == -1
        assert int(mapping[:-1].abs().sum()) == 0
        assert allocator.size == size_swa

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_translate_keeps_minus_one_and_reads_unmapped_as_zero(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        live = _alloc(allocator, page_size)
        out = allocator.translate_loc_from_full_to_swa(
            torch.cat([_ids(-1), live, live + page_size])
        )
        assert out.tolist() == [
            -1,
            *allocator.full_to_swa_index_mapping[live].tolist(),
            *[0] * page_size,
        ]

    def test_mapping_is_mutated_in_place_never_reassigned(self) -> None:
        allocator = _make_allocator(1)
        mapping = allocator.full_to_swa_index_mapping
        live = _alloc(allocator, 4)
        allocator.free(live[:2])
        allocator.clear_full_to_swa_mapping(live[2:])
        allocator.restore_state(allocator.backup_state())
        assert allocator.full_to_swa_index_mapping is mapping

    def test_construct_swa_larger_than_full_raises_value_error(self) -> None:
        with pytest.raises(ValueError, match="must not exceed the full size"):
            SWATokenToKVPoolAllocator(8, 16)


class TestAlloc:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_alloc_beyond_swa_side_returns_none_and_takes_nothing(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        size, size_swa = POOLS[page_size]
        assert allocator.alloc(size_swa + page_size) is None
        assert _sizes(allocator) == (size, size_swa)

    def test_alloc_extend_on_page_1_raises_type_error(self) -> None:
        allocator = _make_allocator(1)
        with pytest.raises(TypeError, match="page_size > 1"):
            allocator.alloc_extend([0], [2], _ids(-1), 2)

    def test_alloc_extend_and_decode_pair_both_sides(self) -> None:
        allocator = _make_allocator(4)
        first = allocator.alloc_extend([0], [6], _ids(-1), 6)
        assert first is not None and first.tolist() == [4, 5, 6, 7, 8, 9]
        nxt = allocator.alloc_decode([7], first[-1:])
        assert nxt is not None and nxt.tolist() == [10]
        peers = allocator.translate_loc_from_full_to_swa(torch.cat([first, nxt]))
        assert peers.tolist() == [4, 5, 6, 7, 8, 9, 10]

    @pytest.mark.parametrize("via", ["extend", "decode"])
    def test_refused_paged_alloc_after_bad_free_keeps_prefix_pages(self, via: str) -> None:
        # Full side 6 pages, SWA side 5. A staged double free makes the full side promise 4
        # free pages while it holds 2; the SWA side really has the 3 pages the call needs.
        allocator = SWATokenToKVPoolAllocator(24, 20, 4)
        prefix = allocator.alloc_extend([0], [6], _ids(-1), 6)  # pages 1-2, the second partial
        assert allocator.full_attn_allocator.alloc(8) is not None  # full-only holders: pages 3-4
        other = _alloc(allocator, 8)
        allocator.free(other)
        allocator.free_full(other)  # the double free: staged now, dropped at the merge
        peers = allocator.translate_loc_from_full_to_swa(prefix).clone()
        if via == "extend":
            refused = allocator.alloc_extend([6], [18], prefix[-1:], 12)
        else:
            refused = allocator.alloc_decode(
                [7, 1, 1, 1], torch.cat([prefix[-1:], _ids(-1, -1, -1)])
            )
        assert refused is None
        # Nothing was taken or given back: the prefix keeps its partial page on both sides.
        assert torch.equal(allocator.translate_loc_from_full_to_swa(prefix), peers)
        allocator.merge_and_sort_free()
        assert _sizes(allocator) == (8, 12)
        swa_rest = allocator.swa_attn_allocator.alloc(12)
        assert swa_rest is not None and set(swa_rest.tolist()).isdisjoint(peers.tolist())


class TestPeerMappedContract:
    """PR #36723 (a): page_size 1 frees every mapped peer unfiltered and expects it > 0."""

    def test_async_assert_predicate_is_true_for_live_and_false_for_stale_slots(self) -> None:
        allocator = _make_allocator(1)
        live = _alloc(allocator, 4)
        stale = _alloc(allocator, 4)
        # Whoever released the peer left the mapping reading as the padding slot.
        allocator.clear_full_to_swa_mapping(stale)
        assert _peer_mapped_predicate(allocator, live) is True
        assert _peer_mapped_predicate(allocator, stale) is False

    @pytest.mark.parametrize("level", [WARN, STRICT])
    def test_free_swa_of_stale_slot_raises_invariant_violation(
        self, level: InvariantCheckLevel
    ) -> None:
        allocator = _make_allocator(1)
        stale = _alloc(allocator, 2)
        allocator.clear_full_to_swa_mapping(stale)
        with (
            override_level(level),
            pytest.raises(InvariantViolation, match=r"\[swa\.peer_mapped\]") as excinfo,
        ):
            allocator.free_swa(stale)
        assert excinfo.value.firing.slots == tuple(stale.tolist())

    @pytest.mark.parametrize("level", [WARN, STRICT])
    def test_free_swa_then_free_in_group_raises_peer_mapped(
        self, level: InvariantCheckLevel
    ) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 3)
        allocator.free_group_begin()
        allocator.free_swa(slots)
        with (
            override_level(level),
            pytest.raises(InvariantViolation, match=r"\[swa\.peer_mapped\]"),
        ):
            allocator.free(slots)

    def test_free_swa_then_free_in_group_at_off_drops_padding_peers(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 3)
        allocator.free_group_begin()
        allocator.free_swa(slots)
        allocator.free(slots)
        allocator.free_group_end()
        allocator.merge_and_sort_free()
        # Each SWA peer came back once; the second pass's padding peers were dropped, not recycled.
        assert _sizes(allocator) == POOLS[1]
        assert allocator.drop_counts()["swa"]["reserved"] == 3
        assert hit_counts()["swa.peer_mapped"] == 0
        assert 0 not in _alloc(allocator, POOLS[1][1]).tolist()

    def test_free_swa_page_4_expands_to_page_and_skips_unmapped_once(self) -> None:
        allocator = _make_allocator(4)
        slots = _alloc(allocator, 8)
        swa_before = allocator.swa_available_size()
        with override_level(STRICT):
            allocator.free_group_begin()
            # Slots 0 and 1 share page 1: the second call reads the page already cleared.
            enqueue = count_syncs(
                lambda: (
                    allocator.free_swa(slots[0:1]),
                    allocator.free_swa(slots[1:2]),
                    allocator.free_swa(slots[5:6]),
                )
            )
            assert allocator.swa_available_size() == swa_before
            release = count_syncs(allocator.free_group_end)
        assert enqueue.total == 0, enqueue.summary()
        # SGLang filters the unmapped slots with a boolean mask (a sync of its own); ours skips
        # them inside the paged free, so the release syncs only for the free's page dedup.
        assert {r.op for r in release.records} == {"aten::_unique2"}, release.summary()
        assert release.total == 1, release.summary()
        assert allocator.swa_available_size() == swa_before + 8
        assert allocator.translate_loc_from_full_to_swa(slots).tolist() == [0] * 8
        assert allocator.drop_counts()["swa"] == {"double_free": 0, "out_of_pool": 0, "reserved": 0}
        assert hit_counts()["swa.peer_mapped"] == 0


class TestPeerReleasedContract:
    """PR #36723 (b), (e): free_full expects the peer gone, checked once, at enqueue."""

    def test_free_full_touches_only_full_pool_and_keeps_mapping(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 4)
        before = allocator.full_to_swa_index_mapping[slots].clone()
        allocator.free_full(slots)
        assert _sizes(allocator) == (16, 4)
        assert torch.equal(allocator.full_to_swa_index_mapping[slots], before)
        assert hit_counts()["swa.peer_released"] == 0

    def test_free_full_of_mapped_slots_at_warn_counts_peer_released(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 4)
        with override_level(WARN):
            allocator.free_full(slots)
        assert hit_counts()["swa.peer_released"] == 4
        assert _sizes(allocator) == (16, 4)

    def test_free_full_of_mapped_slots_at_strict_raises_and_frees_nothing(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 4)
        with (
            override_level(STRICT),
            pytest.raises(InvariantViolation, match=r"\[swa\.peer_released\]"),
        ):
            allocator.free_full(slots)
        assert _sizes(allocator) == (12, 4)

    def test_free_group_end_does_not_evaluate_guard_again(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 4)
        with override_level(WARN):
            allocator.free_group_begin()
            allocator.free_full(slots)
            assert hit_counts()["swa.peer_released"] == 4
            assert allocator.full_available_size() == 12  # deferred
            allocator.free_group_end()
        assert hit_counts()["swa.peer_released"] == 4
        assert allocator.full_available_size() == 16

    def test_free_group_keeps_its_own_copy_of_full_indices(self) -> None:
        allocator = _make_allocator(1)
        slots = _alloc(allocator, 4)
        allocator.free_swa(slots)
        allocator.free_group_begin()
        allocator.free_full(slots)
        slots.fill_(0)  # the caller reuses its buffer before the group ends
        allocator.free_group_end()
        assert _sizes(allocator) == (16, 8)
        assert allocator.drop_counts()["full"]["reserved"] == 0


class TestFreeGroupOwnership:
    """PR #36723 (d): SWA ownership is resolved when free_swa enqueues, not at the group end."""

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_repaired_slot_keeps_new_peer_and_old_peer_is_released(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        slots = _alloc(allocator, page_size)
        old_peers = allocator.translate_loc_from_full_to_swa(slots).clone()
        new_peers = allocator.swa_attn_allocator.alloc(page_size)
        swa_before = allocator.swa_available_size()
        allocator.free_group_begin()
        allocator.free_swa(slots)
        allocator.set_full_to_swa_mapping(slots, new_peers)  # e.g. a load-back re-pairs the slot
        allocator.free_group_end()
        assert torch.equal(allocator.translate_loc_from_full_to_swa(slots), new_peers)
        assert allocator.swa_available_size() == swa_before + page_size
        rest = _alloc(allocator, allocator.swa_available_size())
        handed_out = allocator.translate_loc_from_full_to_swa(rest).tolist()
        assert set(old_peers.tolist()) <= set(handed_out)
        assert set(new_peers.tolist()).isdisjoint(handed_out)

    def test_nested_free_group_begin_raises_assertion_error(self) -> None:
        allocator = _make_allocator(1)
        allocator.free_group_begin()
        with pytest.raises(AssertionError, match="do not nest"):
            allocator.free_group_begin()

    def test_free_group_end_without_begin_raises_assertion_error(self) -> None:
        with pytest.raises(AssertionError, match="without free_group_begin"):
            _make_allocator(1).free_group_end()


class TestSnapshots:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_restore_state_rewinds_both_sides_and_mapping(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        kept = _alloc(allocator, page_size)
        state = allocator.backup_state()
        sizes = _sizes(allocator)
        mapping = allocator.full_to_swa_index_mapping.clone()
        first = _alloc(allocator, 2 * page_size)  # what the snapshot's allocator hands out
        allocator.free(kept)
        allocator.free(first)
        _alloc(allocator, 2 * page_size)
        allocator.restore_state(state)
        assert _sizes(allocator) == sizes
        assert torch.equal(allocator.full_to_swa_index_mapping, mapping)
        assert torch.equal(_alloc(allocator, 2 * page_size), first)


class TestSyncFreedom:
    """The page_size 1 hot path never synchronizes, gated on the detector seeing the old forms."""

    @pytest.mark.parametrize("level", [OFF, WARN, STRICT])
    def test_free_swa_page_1_does_not_sync(self, level: InvariantCheckLevel) -> None:
        allocator = _make_allocator(1)
        live = _alloc(allocator, 4)
        peers = allocator.full_to_swa_index_mapping[live]
        gate = count_syncs(lambda: peers[peers > 0])
        assert gate.total > 0, "synccheck missed the pre-fix boolean filter"
        with override_level(level):
            check = count_syncs(allocator.free_swa, live)
        assert check.total == 0, check.summary()
        assert allocator.swa_available_size() == POOLS[1][1]

    def test_clear_full_to_swa_mapping_does_not_sync(self) -> None:
        allocator = _make_allocator(1)
        live = _alloc(allocator, 4)
        mapping = allocator.full_to_swa_index_mapping
        gate = count_syncs(lambda: mapping.__setitem__(live, 0))
        assert gate.total > 0, "synccheck missed the host-scalar assignment"
        check = count_syncs(allocator.clear_full_to_swa_mapping, live)
        assert check.total == 0, check.summary()

    def test_count_path_of_peer_released_does_not_sync(self) -> None:
        allocator = _make_allocator(1)
        live = _alloc(allocator, 4)
        mapping = allocator.full_to_swa_index_mapping
        gate = count_syncs(lambda: int((mapping[live] != 0).sum()))
        assert gate.total > 0, "synccheck missed a host read of a hit count"
        with override_level(WARN):
            check = count_syncs(allocator.free_full, live)
        assert check.total == 0, check.summary()
        assert hit_counts()["swa.peer_released"] == 4

    @pytest.mark.parametrize("level", [OFF, STRICT])
    def test_free_and_free_group_page_1_do_not_sync(self, level: InvariantCheckLevel) -> None:
        allocator = _make_allocator(1)
        first, second, third = _alloc(allocator, 2), _alloc(allocator, 2), _alloc(allocator, 2)
        allocator.free_swa(third)

        def free_everything() -> None:
            allocator.free(first)
            allocator.free_group_begin()
            allocator.free(second)
            allocator.free_full(third)
            allocator.free_group_end()

        with override_level(level):
            check = count_syncs(free_everything)
        assert check.total == 0, check.summary()
        assert _sizes(allocator) == POOLS[1]


class TestOneCrashPoint:
    """At STRICT, free_swa asserts what SGLang's asserts (`swa.peer_mapped`) and nothing more."""

    @pytest.mark.parametrize("bad", [False, True], ids=["good-free", "double-free-of-a-peer"])
    def test_free_swa_at_strict_makes_one_async_assert(self, bad: bool) -> None:
        allocator = _make_allocator(1)
        _alloc(allocator, 4)  # held elsewhere: the pool is not near empty, so no bound breaks
        live = _alloc(allocator, 2)
        if bad:
            # The SWA peer of live[0] is freed behind the allocator's back: the SWA side drops it.
            allocator.swa_attn_allocator.free(allocator.translate_loc_from_full_to_swa(live[:1]))
        with override_level(STRICT), mock.patch.object(torch, "_assert_async") as assert_async:
            allocator.free_swa(live)
        names = [c.args[1].split("]")[0] for c in assert_async.call_args_list]
        assert names == ["invariant-check FAILED [swa.peer_mapped"]
        assert hit_counts()["alloc.double_free"] == int(bad)

    def test_drop_counter_rides_back_and_a_clean_read_marks_the_free_lists_verified(self) -> None:
        allocator = _make_allocator(1)
        live = _alloc(allocator, 4)
        allocator.free(live)
        assert allocator.drop_counter().tolist() == [0, 0]
        allocator.note_drop_totals([0, 0])
        check = count_syncs(_alloc, allocator, 8)
        assert check.total == 0, check.summary()


class TestDropReports:
    """Both sides' bad-free drops of one free reach the drop invariants as one report."""

    @pytest.mark.parametrize("page_size", [1, 4])
    @pytest.mark.parametrize("level", [WARN, STRICT])
    def test_fused_free_fires_what_free_swa_then_free_full_fire(
        self, page_size: int, level: InvariantCheckLevel
    ) -> None:
        seen = []
        for how in ("fused", "free_swa+free_full", "group"):
            reset_counters()
            allocator = _make_allocator(page_size)
            _alloc(allocator, 2 * page_size)  # held elsewhere: no pool bound breaks
            live = _alloc(allocator, 2 * page_size)
            peer = allocator.translate_loc_from_full_to_swa(live[:1])
            # Both sides free a slot behind the allocator's back: the free below drops each.
            allocator.swa_attn_allocator.free(peer)
            allocator.full_attn_allocator.free(live[-1:])
            with override_level(level):
                if how == "fused":
                    allocator.free(live)
                elif how == "group":
                    allocator.free_group_begin()
                    allocator.free_swa(live)
                    allocator.free_full(live)
                    allocator.free_group_end()
                else:
                    allocator.free_swa(live)
                    allocator.free_full(live)
                seen.append([(f.name, f.level, f.msg, f.new_hits, f.slots, f.crashed) for f in drain_firings()])
            if page_size == 1:
                assert seen[-1] == [("alloc.double_free", level.name, "not allocated", 2,
                                     (int(peer), int(live[-1])), False)]
        assert seen[0] == seen[1] == seen[2]


class TestSGLangArguments:
    def test_construct_with_kvcache_registers_the_mapping_with_it(self) -> None:
        pool = HybridKVPool(layer_pattern="SF", full_size=16, swa_size=8, page_size=1, num_heads=1,
                            head_dim=2)
        allocator = SWATokenToKVPoolAllocator(16, 8, kvcache=pool, dtype=pool.dtype)
        assert pool.full_to_swa_index_mapping is allocator.full_to_swa_index_mapping
        assert allocator.get_kvcache() is pool and allocator.dtype == torch.float64

    @pytest.mark.parametrize("need_sort", [False, True])
    def test_need_sort_reaches_both_sub_allocators(self, need_sort: bool) -> None:
        allocator = SWATokenToKVPoolAllocator(16, 8, need_sort=need_sort)
        assert allocator.full_attn_allocator.need_sort is need_sort
        assert allocator.swa_attn_allocator.need_sort is need_sort


class TestPureSWA:
    def test_pure_swa_allocator_hands_out_one_pool_through_an_identity_mapping(self) -> None:
        allocator = PureSWATokenToKVPoolAllocator(8)
        assert allocator.full_attn_allocator is allocator.swa_attn_allocator
        slots = _alloc(allocator, 3)
        assert torch.equal(allocator.translate_loc_from_full_to_swa(slots), slots)
        assert _sizes(allocator) == (5, 5) and allocator.available_size() == 5
        allocator.free(slots)
        assert _sizes(allocator) == (8, 8)

    def test_pure_swa_free_full_releases_nothing_and_free_swa_releases_the_slots(self) -> None:
        allocator = PureSWATokenToKVPoolAllocator(8)
        slots = _alloc(allocator, 4)
        allocator.free_full(slots)
        assert _sizes(allocator) == (4, 4)
        allocator.free_group_begin()
        allocator.free_swa(slots)
        assert _sizes(allocator) == (4, 4)
        allocator.free_group_end()
        assert _sizes(allocator) == (8, 8)

    def test_pure_swa_rejects_mapping_edits_and_pages(self) -> None:
        allocator = PureSWATokenToKVPoolAllocator(8)
        slots = _alloc(allocator, 2)
        with pytest.raises(NotImplementedError):
            allocator.set_full_to_swa_mapping(slots, slots)
        with pytest.raises(NotImplementedError):
            allocator.clear_full_to_swa_mapping(slots)
        with pytest.raises(ValueError, match="page_size 1"):
            PureSWATokenToKVPoolAllocator(8, page_size=4)
