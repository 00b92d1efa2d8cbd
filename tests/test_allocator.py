"""Sub-allocators (token and paged) and ReqToTokenPool."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from engine_stub.invariants import (
    InvariantCheckLevel,
    counter_snapshot,
    drain_firings,
    hit_counts,
    override_level,
    reset_counters,
)
from engine_stub.mem import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_sub_allocator,
)
from engine_stub.mem.allocator import num_new_pages
from engine_stub.synccheck import count_syncs

PAGE_SIZES = [1, 4]
POOL_PAGES = 8


def _make_allocator(page_size: int, pages: int = POOL_PAGES) -> BaseTokenToKVPoolAllocator:
    return create_sub_allocator(pages * page_size, page_size)


def _assert_unique(ids: torch.Tensor) -> None:
    assert ids.unique().numel() == ids.numel(), f"a slot was handed out twice: {ids.tolist()}"


def _drain_pool(allocator: BaseTokenToKVPoolAllocator) -> torch.Tensor:
    """Every slot the allocator can still hand out, one page at a time (so merges happen)."""
    taken = []
    while (ids := allocator.alloc(allocator.page_size)) is not None:
        taken.append(ids)
    return torch.cat(taken) if taken else torch.zeros(0, dtype=torch.int64)


class TestAlloc:
    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_create_sub_allocator_picks_kind_by_page_size(self, page_size: int) -> None:
        expected = TokenToKVPoolAllocator if page_size == 1 else PagedTokenToKVPoolAllocator
        assert type(_make_allocator(page_size)) is expected

    @pytest.mark.parametrize(("size", "page_size"), [(6, 4), (0, 1), (2, 4)])
    def test_construct_size_not_multiple_of_page_raises_value_error(
        self, size: int, page_size: int
    ) -> None:
        with pytest.raises(ValueError, match="positive multiple of page_size"):
            PagedTokenToKVPoolAllocator(size, page_size)

    def test_construct_page_size_zero_raises_value_error(self) -> None:
        with pytest.raises(ValueError, match="page_size must be >= 1"):
            PagedTokenToKVPoolAllocator(8, 0)

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_alloc_whole_pool_returns_unique_ids_outside_padding_page(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        ids = allocator.alloc(allocator.size)
        assert ids is not None and ids.dtype == torch.int64
        assert ids.numel() == allocator.size
        _assert_unique(ids)
        assert int(ids.min()) >= page_size  # never 0, never inside page 0
        assert int(ids.max()) < (POOL_PAGES + 1) * page_size
        assert allocator.available_size() == 0

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_alloc_more_than_available_returns_none_and_takes_nothing(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 * page_size)
        assert allocator.alloc(allocator.size) is None
        assert allocator.available_size() == allocator.size - 2 * page_size
        rest = allocator.alloc(allocator.size - 2 * page_size)
        assert rest is not None
        _assert_unique(torch.cat([held, rest]))

    def test_paged_alloc_partial_page_raises_value_error(self) -> None:
        with pytest.raises(ValueError, match="multiple of 4"):
            _make_allocator(4).alloc(3)

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_free_then_alloc_reuses_freed_ids(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        ids = allocator.alloc(allocator.size)
        allocator.free(ids[:page_size])
        assert allocator.available_size() == page_size
        again = allocator.alloc(page_size)
        assert again is not None
        assert sorted(again.tolist()) == sorted(ids[:page_size].tolist())

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_free_empty_index_is_a_no_op(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        allocator.free(torch.zeros(0, dtype=torch.int64))
        assert allocator.available_size() == allocator.size


def _bad_ids(kind: str, page_size: int, held: torch.Tensor) -> torch.Tensor:
    """Ids of a bad free of `kind`, given slots `held` that were allocated then freed once."""
    if kind == "double_free":
        return held
    if kind == "out_of_pool":
        end = (POOL_PAGES + 1) * page_size
        return torch.tensor([end, end + page_size, -page_size], dtype=torch.int64)
    return torch.tensor([0] if page_size == 1 else [0, page_size - 1], dtype=torch.int64)


# (drop kind, the invariant that signals it, drops counted per bad free for page sizes 1 and 4)
BAD_FREES = [
    ("double_free", "alloc.double_free", {1: 2, 4: 1}),
    ("out_of_pool", "alloc.out_of_pool", {1: 3, 4: 3}),
    ("reserved", "alloc.reserved_slot", {1: 1, 4: 1}),
]


class TestBadFrees:
    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    @pytest.mark.parametrize(("kind", "inv_name", "drops"), BAD_FREES)
    def test_bad_free_is_dropped_counted_and_never_handed_out_twice(
        self, page_size: int, kind: str, inv_name: str, drops: dict[int, int]
    ) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        allocator.free(_bad_ids(kind, page_size, held))
        assert allocator.drop_counts() == {
            k: drops[page_size] if k == kind else 0 for k in allocator.drop_counts()
        }
        # Handing out the whole pool must not hand a slot out twice, and must not hand out more
        # than the pool holds.
        everything = _drain_pool(allocator)
        assert everything.numel() == allocator.size
        _assert_unique(everything)
        assert int(everything.min()) >= page_size

    def test_duplicate_ids_in_one_free_are_recycled_once(self) -> None:
        allocator = _make_allocator(1)
        held = allocator.alloc(3)
        allocator.free(torch.cat([held, held[:1]]))
        assert allocator.drop_counts()["double_free"] == 1
        everything = _drain_pool(allocator)
        assert everything.numel() == allocator.size
        _assert_unique(everything)

    def test_paged_free_of_two_slots_in_one_page_frees_the_page_once(self) -> None:
        allocator = _make_allocator(4)
        held = allocator.alloc(8)
        allocator.free(held[[0, 1, 5]])
        assert allocator.drop_counts()["double_free"] == 0
        assert allocator.available_size() == allocator.size
        _assert_unique(_drain_pool(allocator))

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    @pytest.mark.parametrize(("kind", "inv_name", "drops"), BAD_FREES)
    def test_bad_free_at_warn_counts_invariant(
        self, page_size: int, kind: str, inv_name: str, drops: dict[int, int]
    ) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        with override_level(InvariantCheckLevel.WARN):
            allocator.free(_bad_ids(kind, page_size, held))
        counts = hit_counts()
        assert counts[inv_name] == drops[page_size]
        others = {name for _, name, _ in BAD_FREES} - {inv_name}
        assert all(counts[name] == 0 for name in others)

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    @pytest.mark.parametrize(("kind", "inv_name", "drops"), BAD_FREES)
    def test_bad_free_at_strict_counts_the_drop_without_a_crash_point(
        self, page_size: int, kind: str, inv_name: str, drops: dict[int, int]
    ) -> None:
        """SGLang drops and counts a bad free (its drop counters); it asserts nothing there. The
        count rides the step's read-back and becomes a firing; the free itself never raises."""
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        with (
            override_level(InvariantCheckLevel.STRICT),
            mock.patch.object(torch, "_assert_async") as assert_async,
        ):
            allocator.free(_bad_ids(kind, page_size, held))
        assert assert_async.call_count == 0
        assert hit_counts()[inv_name] == drops[page_size]

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    @pytest.mark.parametrize(("kind", "inv_name", "drops"), BAD_FREES)
    def test_bad_free_at_off_counts_the_drop_but_signals_nothing(
        self, page_size: int, kind: str, inv_name: str, drops: dict[int, int]
    ) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        with override_level(InvariantCheckLevel.OFF):
            allocator.free(_bad_ids(kind, page_size, held))
        assert hit_counts()[inv_name] == 0
        assert allocator.drop_counts()[kind] == drops[page_size]

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_good_free_at_strict_fires_nothing(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        with override_level(InvariantCheckLevel.STRICT):
            allocator.free(allocator.alloc(allocator.size))
        assert all(hit_counts()[name] == 0 for _, name, _ in BAD_FREES)
        assert allocator.drop_counts() == {"double_free": 0, "out_of_pool": 0, "reserved": 0}


DROP_INVARIANTS = [name for _, name, _ in BAD_FREES]


class TestDropReport:
    """The drop invariants' counts are folded with the drop counters, not counted at the free:
    every reader still sees exactly the drops of the frees made (with checks on) before it."""

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_a_reader_sees_the_drops_before_any_fold(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        with override_level(InvariantCheckLevel.WARN):
            allocator.free(_bad_ids("double_free", page_size, held))
            names, values = counter_snapshot()  # the step's read-back: no drop_counter() yet
        totals = dict(zip(names, values.tolist(), strict=True))
        assert totals["alloc.double_free"] == BAD_FREES[0][2][page_size]

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_only_frees_made_with_checks_on_count_for_the_invariants(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 if page_size == 1 else page_size)
        allocator.free(held)
        bad = _bad_ids("out_of_pool", page_size, held)
        for level in (InvariantCheckLevel.WARN, InvariantCheckLevel.OFF, InvariantCheckLevel.STRICT):
            with override_level(level):
                allocator.free(bad)
        assert hit_counts()["alloc.out_of_pool"] == 2 * 3
        assert allocator.drop_counts()["out_of_pool"] == 3 * 3

    def test_reset_counters_forgets_the_invariant_counts_not_the_drops(self) -> None:
        allocator = _make_allocator(1)
        with override_level(InvariantCheckLevel.WARN):
            allocator.free(torch.tensor([0], dtype=torch.int64))
        reset_counters()
        assert hit_counts()["alloc.reserved_slot"] == 0
        assert allocator.drop_counts()["reserved"] == 1
        assert hit_counts()["alloc.reserved_slot"] == 0  # folding again owes nothing

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_each_drop_invariant_fires_with_its_own_slots_in_order(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 * page_size)
        allocator.free(held[:page_size])
        end = (POOL_PAGES + 1) * page_size
        # A double free, an id past the end, the padding page, a good free, -1.
        ids = torch.cat([held[:1], torch.tensor([end, 0]), held[page_size:], torch.tensor([-1])])
        with override_level(InvariantCheckLevel.WARN):
            allocator.free(ids)
            firings = {f.name: f for f in drain_firings()}
        assert set(firings) == set(DROP_INVARIANTS)
        assert firings["alloc.double_free"].slots == (int(held[0]),)
        assert firings["alloc.out_of_pool"].slots == (end, -1)
        assert firings["alloc.reserved_slot"].slots == (0,)
        assert [firings[name].msg for name in DROP_INVARIANTS] == [
            "not allocated", "id past the pool end", "padding page"]
        assert all(not f.crashed and f.level == "WARN" for f in firings.values())

    def test_a_page_1_bad_free_with_checks_on_and_its_read_back_do_not_sync(self) -> None:
        # (The paged free syncs anyway, for its dedup.)
        allocator = _make_allocator(1)
        held = allocator.alloc(2)
        allocator.free(held)
        with override_level(InvariantCheckLevel.STRICT):
            check = count_syncs(allocator.free, torch.cat([held, torch.tensor([0, -1])]))
            assert check.total == 0, check.summary()
            check = count_syncs(counter_snapshot)  # folds the free's drops into the counters
            assert check.total == 0, check.summary()
        assert hit_counts()["alloc.double_free"] == 2


def _page_slots(page: int, page_size: int = 4) -> list[int]:
    return list(range(page * page_size, (page + 1) * page_size))


# (prefix_lens, seq_lens, slots alloc_extend returns) on a fresh 4-slot-page pool whose free
# list starts at page 1. Prefixes are allocated first, request by request, from page 1 on.
EXTEND_CASES = [
    pytest.param([0], [3], [4, 5, 6], id="partial-first-page"),
    pytest.param([0], [8], _page_slots(1) + _page_slots(2), id="whole-pages"),
    pytest.param([0], [10], _page_slots(1) + _page_slots(2) + [12, 13], id="whole-then-tail"),
    pytest.param([3], [6], [7, 8, 9], id="continue-then-tail"),
    pytest.param([4], [6], [8, 9], id="prefix-ends-on-boundary"),
    pytest.param([5], [7], [9, 10], id="continuation-only"),
    pytest.param([2], [13], [6, 7, *_page_slots(2), *_page_slots(3), 16], id="all-three-segments"),
    pytest.param([3, 0], [6, 5], [7, 8, 9, *_page_slots(3), 16], id="two-requests"),
    pytest.param([0, 2], [4, 4], [*_page_slots(2), 6, 7], id="second-request-continues"),
]


def _alloc_prefixes(allocator: PagedTokenToKVPoolAllocator, prefix_lens: list[int]) -> torch.Tensor:
    """The slot of each request's last prefix position (-1 for no prefix)."""
    last_locs = []
    for prefix in prefix_lens:
        if prefix == 0:
            last_locs.append(-1)
            continue
        slots = allocator.alloc_extend([0], [prefix], torch.tensor([-1]), prefix)
        assert slots is not None
        last_locs.append(int(slots[-1]))
    return torch.tensor(last_locs, dtype=torch.int64)


class TestPagedExtendAndDecode:
    @pytest.mark.parametrize(("prefix_lens", "seq_lens", "expected"), EXTEND_CASES)
    def test_alloc_extend_fills_continuation_whole_and_tail_pages(
        self, prefix_lens: list[int], seq_lens: list[int], expected: list[int]
    ) -> None:
        allocator = PagedTokenToKVPoolAllocator(64, 4)
        last_loc = _alloc_prefixes(allocator, prefix_lens)
        before = allocator.available_size()
        extend = sum(seq_lens) - sum(prefix_lens)
        slots = allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend)
        assert slots is not None and slots.tolist() == expected
        assert before - allocator.available_size() == 4 * num_new_pages(prefix_lens, seq_lens, 4)

    @pytest.mark.parametrize(
        ("prefix_lens", "seq_lens", "pages"),
        [
            ([0], [1], 1),
            ([0], [4], 1),
            ([0], [5], 2),
            ([3], [4], 0),
            ([3], [5], 1),
            ([4, 0], [9, 0], 2),
        ],
    )
    def test_num_new_pages_counts_pages_beyond_prefix(
        self, prefix_lens: list[int], seq_lens: list[int], pages: int
    ) -> None:
        assert num_new_pages(prefix_lens, seq_lens, 4) == pages

    def test_alloc_extend_short_pool_returns_none_and_takes_nothing(self) -> None:
        allocator = PagedTokenToKVPoolAllocator(16, 4)
        last_loc = _alloc_prefixes(allocator, [2])
        assert allocator.alloc_extend([2], [19], last_loc, 17) is None
        assert allocator.available_size() == 12

    # (tokens already held, slot the next decode token gets, pages that takes)
    @pytest.mark.parametrize(
        ("held", "slot", "pages"), [(0, 4, 1), (1, 5, 0), (3, 7, 0), (4, 8, 1), (5, 9, 0)]
    )
    def test_alloc_decode_takes_new_page_only_at_boundary(
        self, held: int, slot: int, pages: int
    ) -> None:
        allocator = PagedTokenToKVPoolAllocator(64, 4)
        last_loc = _alloc_prefixes(allocator, [held])
        before = allocator.available_size()
        out = allocator.alloc_decode([held + 1], last_loc)
        assert out is not None and out.tolist() == [slot]
        assert before - allocator.available_size() == 4 * pages

    def test_alloc_decode_batch_mixes_continuation_and_new_pages(self) -> None:
        allocator = PagedTokenToKVPoolAllocator(64, 4)
        last_loc = _alloc_prefixes(allocator, [4, 2, 0])  # pages 1 and 2
        out = allocator.alloc_decode([5, 3, 1], last_loc)
        assert out is not None and out.tolist() == [12, 10, 16]

    def test_alloc_decode_short_pool_returns_none(self) -> None:
        allocator = PagedTokenToKVPoolAllocator(4, 4)
        last_loc = _alloc_prefixes(allocator, [4])
        assert allocator.alloc_decode([5], last_loc) is None


class TestBackupRestore:
    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_restore_state_rewinds_allocs_and_frees(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(2 * page_size)
        allocator.free(held[:page_size])  # a staged free is part of the snapshot
        state = allocator.backup_state()
        first = allocator.alloc(3 * page_size)
        allocator.free(held[page_size:])
        allocator.restore_state(state)
        assert allocator.available_size() == allocator.size - page_size
        assert allocator.alloc(3 * page_size).tolist() == first.tolist()

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_restore_state_rewinds_allocated_bitmap(self, page_size: int) -> None:
        allocator = _make_allocator(page_size)
        state = allocator.backup_state()
        taken = allocator.alloc(page_size)
        allocator.restore_state(state)
        # After the rewind `taken` was never handed out, so freeing it is a double free.
        allocator.free(taken)
        assert allocator.drop_counts()["double_free"] == 1
        everything = _drain_pool(allocator)
        assert everything.numel() == allocator.size
        _assert_unique(everything)

    def test_snapshot_is_not_aliased_by_later_frees(self) -> None:
        allocator = _make_allocator(1)
        held = allocator.alloc(4)
        state = allocator.backup_state()
        allocator.free(held)
        allocator.restore_state(state)
        allocator.free(held)
        assert allocator.drop_counts()["double_free"] == 0


class TestReqToTokenPool:
    def test_construct_gives_padded_int32_table(self) -> None:
        pool = ReqToTokenPool(4, 16)
        assert pool.req_to_token.shape == (5, 16)
        assert pool.req_to_token.dtype == torch.int32
        assert int(pool.req_to_token.abs().sum()) == 0
        assert pool.available_size() == 4

    @pytest.mark.parametrize(
        ("size", "length", "match"), [(0, 8, "size must be >= 1"), (2, 0, "max_context_len")]
    )
    def test_construct_bad_shape_raises_value_error(
        self, size: int, length: int, match: str
    ) -> None:
        with pytest.raises(ValueError, match=match):
            ReqToTokenPool(size, length)

    def test_alloc_all_rows_never_hands_out_row_zero(self) -> None:
        pool = ReqToTokenPool(4, 8)
        reqs = _reqs(4)
        assert pool.alloc(reqs) == [1, 2, 3, 4]
        assert [r.row for r in reqs] == [1, 2, 3, 4]
        assert pool.alloc(_reqs(1)) is None
        assert pool.available_size() == 0

    def test_alloc_more_than_available_returns_none_and_takes_nothing(self) -> None:
        pool = ReqToTokenPool(3, 8)
        reqs = _reqs(4)
        assert pool.alloc(reqs) is None
        assert [r.row for r in reqs] == [0] * 4
        assert pool.available_size() == 3

    def test_alloc_reqs_keeps_the_row_of_a_request_with_committed_kv(self) -> None:
        pool = ReqToTokenPool(3, 8)
        (held,) = _reqs(1)
        pool.alloc([held])
        held.kv_len = 4  # a continuation: its KV is already in its row
        fresh = _reqs(1)[0]
        assert pool.alloc([held, fresh]) == [1, 2]
        assert pool.available_size() == 1

    def test_alloc_reqs_of_a_row_holder_without_kv_raises(self) -> None:
        pool = ReqToTokenPool(3, 8)
        (req,) = _reqs(1)
        pool.alloc([req])
        with pytest.raises(AssertionError, match="no KV"):
            pool.alloc([req])

    def test_free_req_returns_its_row_and_clears_it(self) -> None:
        pool = ReqToTokenPool(3, 8)
        reqs = _reqs(3)
        pool.alloc(reqs)
        pool.free(reqs[1])
        assert reqs[1].row == 0
        assert pool.alloc(_reqs(1)) == [2]

    @pytest.mark.parametrize("row", [0, 4, -1])
    def test_free_non_request_row_raises_value_error(self, row: int) -> None:
        pool = ReqToTokenPool(3, 8)
        with pytest.raises(ValueError, match="not a request row"):
            pool.free(SimpleNamespace(row=row, kv_len=0))

    def test_write_stores_int32_slots_at_positions(self) -> None:
        pool = ReqToTokenPool(2, 8)
        (row,) = pool.alloc(_reqs(1))
        pool.write(row, 2, torch.tensor([11, 12, 13], dtype=torch.int64))
        assert pool.req_to_token[row].tolist() == [0, 0, 11, 12, 13, 0, 0, 0]
        assert pool.req_to_token.dtype == torch.int32
        assert int(pool.req_to_token[0].abs().sum()) == 0

    def test_clear_frees_rows_and_zeroes_table(self) -> None:
        pool = ReqToTokenPool(2, 4)
        (row,) = pool.alloc(_reqs(1))
        pool.write(row, 0, torch.tensor([5, 6]))
        pool.clear()
        assert pool.available_size() == 2
        assert int(pool.req_to_token.abs().sum()) == 0


def _reqs(n: int) -> list[SimpleNamespace]:
    """Stand-ins for Req: what ReqToTokenPool reads and writes (`row`, `kv_len`)."""
    return [SimpleNamespace(rid=f"r{i}", row=0, kv_len=0) for i in range(n)]


class TestNeedSort:
    """SGLang's two free-list policies (`need_sort`): back at once, or staged and sorted in."""

    @pytest.mark.parametrize(("page_size", "reused"), [(1, "tail"), (4, "head")])
    def test_free_without_need_sort_goes_back_on_the_free_list_at_once(
        self, page_size: int, reused: str
    ) -> None:
        allocator = _make_allocator(page_size)
        held = allocator.alloc(4 * page_size)
        freed = held[page_size : 2 * page_size]
        allocator.free(freed)
        assert allocator.release_pages == []
        pages = allocator.free_pages.tolist()
        page = int(freed[0]) // page_size
        # page_size 1 appends the freed slot to the tail; paged frees prepend (reused next).
        assert pages[-1 if reused == "tail" else 0] == page
        if reused == "head":
            assert allocator.alloc(page_size).tolist() == freed.tolist()
        else:
            rest = allocator.alloc(allocator.available_size() - page_size)
            assert page not in rest.tolist()
            assert allocator.alloc(page_size).tolist() == freed.tolist()

    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_free_with_need_sort_is_staged_until_an_alloc_runs_short(self, page_size: int) -> None:
        allocator = create_sub_allocator(POOL_PAGES * page_size, page_size, need_sort=True)
        held = allocator.alloc(allocator.size)
        allocator.free(held[: 2 * page_size].flip(0))
        assert allocator.free_pages.numel() == 0 and allocator.available_size() == 2 * page_size
        again = allocator.alloc(page_size)  # short: merge the staged pages, sorted
        assert again.tolist() == held[:page_size].tolist()
        assert allocator.release_pages == []

    def test_page_1_free_and_alloc_after_a_clean_read_back_do_not_sync(self) -> None:
        allocator = _make_allocator(1)
        held = allocator.alloc(allocator.size)
        check = count_syncs(allocator.free, held[:4])
        assert check.total == 0, check.summary()
        # Until the step's read-back says no drop happened, taking the freed slots must first
        # drop possible holes (a sync); after it, the alloc is sync-free.
        allocator.note_drop_totals(0)
        check = count_syncs(allocator.alloc, 4)
        assert check.total == 0, check.summary()

    def test_a_hole_from_a_bad_free_is_dropped_once_the_read_back_reports_it(self) -> None:
        allocator = _make_allocator(1)
        held = allocator.alloc(4)
        allocator.free(held)
        allocator.free(held[:1])  # a double free: a hole in the free list's tail
        assert allocator.available_size() == allocator.size + 1  # the hole, not yet known
        allocator.note_drop_totals(int(allocator.drop_counter()))
        assert allocator.available_size() == allocator.size
        everything = _drain_pool(allocator)
        assert everything.numel() == allocator.size
        _assert_unique(everything)


def _reference_extend(pages: list[int], prefix_lens, seq_lens, last_loc: list[int], page: int) -> list[int]:
    """Slot of every extended position, one token at a time (the per-token definition)."""
    out, cursor = [], 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc, strict=True):
        first_new_page = -(-prefix // page)
        for pos in range(prefix, seq):
            if pos // page < first_new_page:
                out.append((last // page) * page + pos % page)  # last_loc's page, as is
            else:
                out.append(pages[cursor + pos // page - first_new_page] * page + pos % page)
        cursor += -(-seq // page) - first_new_page
    return out


class TestVectorisedPagedPlacement:
    """alloc_extend/alloc_decode place tokens with a few tensor ops; they must agree with the
    per-token definition on every shape, including a last_loc that is not where it should be."""

    @pytest.mark.parametrize("page_size", [3, 4])
    def test_alloc_extend_matches_the_per_token_definition(self, page_size: int) -> None:
        rng = __import__("random").Random(page_size)
        for _ in range(200):
            allocator = create_sub_allocator(64 * page_size, page_size)
            allocator.alloc(rng.randrange(0, 8) * page_size)  # the free list no longer starts at 1
            reqs = rng.randint(1, 4)
            prefix_lens = [rng.choice([0, rng.randint(0, 3 * page_size)]) for _ in range(reqs)]
            seq_lens = [p + rng.randint(0, 3 * page_size) for p in prefix_lens]
            last_loc = [-1 if p == 0 else rng.randint(-2, 70 * page_size) for p in prefix_lens]
            expected_pages = allocator.free_pages[: num_new_pages(prefix_lens, seq_lens, page_size)].tolist()
            out = allocator.alloc_extend(prefix_lens, seq_lens, torch.tensor(last_loc),
                                         sum(seq_lens) - sum(prefix_lens))
            assert out.tolist() == _reference_extend(expected_pages, prefix_lens, seq_lens, last_loc, page_size)

    @pytest.mark.parametrize("page_size", [3, 4])
    def test_alloc_decode_matches_sglangs_definition(self, page_size: int) -> None:
        # SGLang's alloc_decode_naive: a new page's first slot at a page boundary, else last_loc + 1
        # (whatever last_loc holds: a damaged -1 gives the padding slot 0, never a negative index).
        rng = __import__("random").Random(page_size)
        for _ in range(200):
            allocator = create_sub_allocator(64 * page_size, page_size)
            seq_lens = [rng.randint(1, 4 * page_size) for _ in range(rng.randint(1, 5))]
            last_loc = [rng.randint(-2, 70 * page_size) for _ in seq_lens]
            expected_pages = iter(allocator.free_pages.tolist())
            expected = [
                next(expected_pages) * page_size if (seq - 1) % page_size == 0 else last + 1
                for seq, last in zip(seq_lens, last_loc, strict=True)
            ]
            assert allocator.alloc_decode(seq_lens, torch.tensor(last_loc)).tolist() == expected


class TestFreeDecision:
    def test_page_1_free_decides_alike_after_its_offers_start_over(self) -> None:
        """The values a page_size 1 free offers only decrease; when they would run out they
        start over, and every decision stays the same (a double free still drops)."""
        allocator = _make_allocator(1)
        held = allocator.alloc(4)
        allocator.free(held[:2])
        allocator._offer = -(2**61) + 2  # the next free (3 entries) runs out of offers
        allocator.free(torch.cat([held[2:], held[:1]]))  # two live slots, one double free
        assert allocator._offer > 0  # they started over
        assert allocator.drop_counts() == {"double_free": 1, "out_of_pool": 0, "reserved": 0}
        assert allocator.page_allocated.nonzero().flatten().tolist() == []
        again = allocator.alloc(allocator.size)
        _assert_unique(again)
        allocator.free(again[:1])
        allocator.free(again[:1])
        assert allocator.drop_counts()["double_free"] == 2

    def test_a_clean_verification_reads_the_kept_masks_not_the_list(self) -> None:
        """An alloc that reaches freed-but-unverified slots reads the frees' kept masks (one
        sync); where all were kept it hands them out with no filter over the list."""
        allocator = _make_allocator(1)
        held = allocator.alloc(allocator.size)
        allocator.free(held)
        check = count_syncs(allocator.alloc, 4)
        assert check.total == 1 and {r.op for r in check.records} == {"aten::_local_scalar_dense"}
        assert allocator.free_pages.numel() == allocator.size - 4
