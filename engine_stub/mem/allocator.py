"""Sub-allocators over one pool of KV slots: token-granular (page_size 1) and paged.

Slot (or page) 0 is the padding sink and is never handed out. Free lists follow SGLang's
`need_sort` switch:

- `need_sort=False` (SGLang's value outside PD disaggregation, and our default): a free goes
  straight back on the free list, at its tail on page_size 1 and at its head on larger pages (so
  a freed page is the next one handed out);
- `need_sort=True`: frees are staged in `release_pages` and folded into a sorted free list only
  when an alloc runs short (`merge_and_sort_free`).

A per-page `page_allocated` bitmap makes bad frees harmless: a double free, an id past the end
of the pool or an id inside the padding page is dropped instead of recycled, and counted on the
device. Counting never crashes (SGLang's drop counters do not either): with checks on, each
drop also adds to the count path of its invariant (`alloc.double_free`, `alloc.out_of_pool`,
`alloc.reserved_slot`), whose counters ride the step's one device-to-host read.

page_size 1 frees are sync-free: the drop decision is a fixed-shape `where`, so a dropped entry
stays in the list as a *hole* (page 0). The host learns whether holes exist from the drop
counters the scheduler reads back with each step (`note_drop_totals`); until then the entries
freed since the last read are unverified, and an alloc that would reach them drops the holes
first (a sync, paid only when the pool is that short). Paged frees sync anyway (their dedup has a
data-dependent shape), and the same dedup drops the holes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine_stub.invariants import (
    Bucket,
    Invariant,
    InvariantCheckLevel,
    IsTrue,
    checks_enabled,
    expect,
    override_level,
)

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "create_sub_allocator",
    "num_new_pages",
]

_DOUBLE_FREE = Invariant(
    "alloc.double_free",
    Bucket.GUARD,
    IsTrue(),
    site="free",
    description="a freed slot/page was not allocated (dropped, not recycled; counted, never crashes)",
)
_OUT_OF_POOL = Invariant(
    "alloc.out_of_pool",
    Bucket.GUARD,
    IsTrue(),
    site="free",
    description="a freed id lies outside the pool (dropped; counted, never crashes)",
)
_RESERVED_SLOT = Invariant(
    "alloc.reserved_slot",
    Bucket.GUARD,
    IsTrue(),
    site="free",
    description="a freed id lies in the padding page 0 (dropped, recycling it aliases the sink; counted)",
)

DROP_KINDS = ("double_free", "out_of_pool", "reserved")
# Outcome codes of one freed entry: an index into `_outcomes`.
_RECYCLED, _DOUBLE, _OUTSIDE, _RESERVED = range(4)


# Each drop kind's invariant, in the order of `_REPORT_CODES`.
_REPORTS = (
    (_OUT_OF_POOL, "id past the pool end"),
    (_RESERVED_SLOT, "padding page"),
    (_DOUBLE_FREE, "not allocated"),
)
_REPORT_CODES = (_OUTSIDE, _RESERVED, _DOUBLE)


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot for `backup_state`/`restore_state` (free lists and the allocated bitmap)."""

    free_pages: torch.Tensor
    release_pages: tuple[torch.Tensor, ...]
    page_allocated: torch.Tensor
    unverified: int


def num_new_pages(prefix_lens: list[int], seq_lens: list[int], page_size: int) -> int:
    """Pages an extend needs beyond the ones its prefixes already hold (host-side, no sync)."""
    return sum(
        -(-seq // page_size) - -(-prefix // page_size)
        for prefix, seq in zip(prefix_lens, seq_lens, strict=True)
    )


class BaseTokenToKVPoolAllocator:
    """Free-list allocator of `num_pages` pages of `page_size` slots; page 0 is padding.

    `size` counts slots (tokens), excluding the padding page. Ids handed out are token ids in
    `[page_size, (num_pages + 1) * page_size)`.

    Args:
        size: slots in the pool.
        page_size: slots per page.
        device: where the free lists and the bitmap live.
        dtype: the KV dtype of the pool this allocator indexes (kept for SGLang's signature).
        kvcache: the KV pool it indexes, if any (`get_kvcache`).
        need_sort: stage frees and sort them in when short (True), or take them back at once.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float64,
        kvcache: Any = None,
        need_sort: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.need_sort = need_sort
        self._kvcache = kvcache
        # Freed entries by outcome: [_RECYCLED] recycled, else dropped as DROP_KINDS[code - 1].
        self._outcomes = torch.zeros(1 + len(DROP_KINDS), dtype=torch.int64, device=self.device)
        # Drops the host has learned of (`note_drop_totals`, `drop_counts`).
        self._drops_known = 0
        # Scratch row for spotting a page named twice in one free (see `_route`); its last entry
        # takes the claims of ids outside the pool.
        self._claims = torch.zeros(self.num_pages + 2, dtype=torch.int64, device=self.device)
        self._zero_page = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._report_codes = torch.tensor(_REPORT_CODES, dtype=torch.int64, device=self.device)[:, None]
        self.clear()

    # ---- state ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free, nothing allocated, drop counters kept."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages: list[torch.Tensor] = []
        self._staged = 0  # host-side count of entries in release_pages
        # Entries that may be holes (page 0): the tail of free_pages (need_sort=False) or the
        # staged ones (need_sort=True). Host-side.
        self._unverified = 0
        self.page_allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        """Free slots (host-side, no sync). Counts staged frees, and holes not yet dropped."""
        return (int(self.free_pages.numel()) + self._staged) * self.page_size

    def merge_and_sort_free(self) -> None:
        """Fold staged frees into the sorted free list and drop every hole.

        With `need_sort=False` nothing is staged and the list keeps its order; only the holes of
        bad frees go (so the idle ledgers count exactly). Dropping holes syncs, and only runs when
        some entry is unverified.
        """
        self._drop_holes()
        if self.release_pages:
            self.free_pages = torch.sort(torch.cat([self.free_pages, *self.release_pages])).values
            self.release_pages = []
            self._staged = 0

    def backup_state(self) -> AllocatorState:
        return AllocatorState(
            self.free_pages.clone(),
            tuple(t.clone() for t in self.release_pages),
            self.page_allocated.clone(),
            self._unverified,
        )

    def restore_state(self, state: AllocatorState) -> None:
        self.free_pages = state.free_pages.clone()
        self.release_pages = [t.clone() for t in state.release_pages]
        self._staged = sum(int(t.numel()) for t in self.release_pages)
        self.page_allocated = state.page_allocated.clone()
        self._unverified = state.unverified

    # ---- bad-free counters ----------------------------------------------------------------

    def drop_counter(self) -> torch.Tensor:
        """Every drop so far, as a 0-dim device tensor (for the step's read-back; no sync)."""
        return self._outcomes[_DOUBLE:].sum()

    def note_drop_totals(self, total: int) -> None:
        """What `drop_counter()` read back. No new drop: every entry freed so far is a real page.

        A new drop means holes: they are dropped now (a sync, on the error path only).
        """
        if total != self._drops_known:
            self._drops_known = total
            self._drop_holes()
        self._unverified = 0

    def _drop_holes(self) -> None:
        """Filter page 0 out of the free list and the staged frees, keeping their order (a sync)."""
        if self._unverified:
            self.free_pages = self.free_pages[self.free_pages > 0]
            self.release_pages = [t[t > 0] for t in self.release_pages]
            self._staged = sum(int(t.numel()) for t in self.release_pages)
        self._unverified = 0

    def drop_counts(self) -> dict[str, int]:
        """Bad frees dropped so far, by kind (a host read: idle ticks and tests)."""
        counts = dict(zip(DROP_KINDS, self._outcomes[_DOUBLE:].tolist(), strict=True))
        self.note_drop_totals(sum(counts.values()))
        return counts

    # ---- pages ----------------------------------------------------------------------------

    def _ready(self, count: int) -> bool:
        """Whether `count` pages can be taken from the head of the free list, hole-free.

        With `need_sort` a short list first folds the staged frees in (SGLang's merge, which
        also drops holes); without, a take that would reach the unverified tail drops them first.
        """
        if self.need_sort:
            if count > self.free_pages.numel():
                self.merge_and_sort_free()
        elif count > self.free_pages.numel() - self._unverified:
            if count > self.free_pages.numel():  # dropping holes only shortens the list
                return False
            self._drop_holes()
        return count <= self.free_pages.numel()

    def _take_pages(self, count: int) -> torch.Tensor | None:
        if not self._ready(count):
            return None
        pages = self.free_pages[:count]
        self.free_pages = self.free_pages[count:]
        self.page_allocated.index_fill_(0, pages, True)
        return pages

    def _route(self, pages: torch.Tensor, slots: torch.Tensor, *, repeats_are_bad: bool) -> torch.Tensor:
        """`pages` with every bad entry routed to page 0, counted and reported (fixed shapes).

        A page named twice in one call (a slot freed twice inside one free group on page_size 1)
        goes back once: each entry writes its position into a scratch row, and exactly one of a
        repeated page's entries reads its own position back. With `repeats_are_bad` the other
        entries count as double frees; paged frees name a page once per slot, so there they only
        make the page count once.
        """
        in_pool = (pages >= 0) & (pages <= self.num_pages)
        safe = torch.where(in_pool, pages, 0)
        # Ids outside the pool claim a scratch entry of their own, apart from page 0's.
        claim = safe if repeats_are_bad else torch.where(in_pool, pages, self.num_pages + 1)
        order = torch.arange(pages.numel(), dtype=torch.int64, device=self.device)
        self._claims.index_copy_(0, claim, order)
        first = self._claims[claim] == order
        # Page 0 never reads as allocated (routed entries only ever clear it).
        allocated = self.page_allocated[safe]
        outcome = torch.where(in_pool, torch.where(safe == 0, _RESERVED, _DOUBLE), _OUTSIDE)
        if repeats_are_bad:
            allocated &= first
            outcome.masked_fill_(allocated, _RECYCLED)
            self._outcomes.index_add_(0, outcome, torch.ones_like(outcome))
            counted = None
        else:
            # A page counts once however many of its slots are named; ids outside the pool
            # count per id, as SGLang's out-of-pool location drops do.
            outcome.masked_fill_(allocated, _RECYCLED)
            counted = first | ~in_pool
            self._outcomes.index_add_(0, outcome, counted.to(torch.int64))
        if checks_enabled():
            self._report(outcome, counted, slots)
        routed = torch.where(allocated, safe, 0)
        self.page_allocated.index_fill_(0, routed, False)
        return routed

    def _report(self, outcome: torch.Tensor, counted: torch.Tensor | None, slots: torch.Tensor) -> None:
        """Add each drop kind's entries to its invariant's count path: never a crash point.

        The drop itself is the containment (the data layer); this is only the signal, and like
        SGLang's drop counters it is read back with the step, not asserted at the free.
        """
        ok = outcome != self._report_codes  # one row per drop kind
        if counted is not None:
            ok |= ~counted
        with override_level(InvariantCheckLevel.WARN):
            for row, (inv, msg) in enumerate(_REPORTS):
                expect(inv, ok[row], msg, slots=slots)

    def _give_back(self, pages: torch.Tensor, *, at_head: bool, may_hold_holes: bool) -> None:
        """Return `pages` to the free list (or stage them, with `need_sort`)."""
        n = int(pages.numel())
        if self.need_sort:
            self.release_pages.append(pages)
            self._staged += n
        elif at_head:
            self.free_pages = torch.cat([pages, self.free_pages])
        else:
            self.free_pages = torch.cat([self.free_pages, pages])
        if may_hold_holes:
            self._unverified += n

    # ---- interface --------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` slots (a multiple of page_size), or None and take nothing.

        Returns:
            int64 token ids, shape `[need_size]`.
        """
        raise NotImplementedError

    def free(self, free_index: torch.Tensor) -> None:
        """Give slots back. Bad ids are dropped and counted, never recycled."""
        raise NotImplementedError


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """page_size 1: a page is a slot. `free` is sync-free; freed slots join the list's tail."""

    def __init__(
        self,
        size: int,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float64,
        kvcache: Any = None,
        need_sort: bool = False,
    ) -> None:
        super().__init__(size, 1, device, dtype=dtype, kvcache=kvcache, need_sort=need_sort)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._take_pages(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64)
        routed = self._route(free_index, free_index, repeats_are_bad=True)
        self._give_back(routed, at_head=False, may_hold_holes=True)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """page_size > 1: whole pages are handed out; extends fill a request's partial page first.

    A freed page goes back at the head of the free list (`need_sort=False`): the next page handed
    out.
    """

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise ValueError(f"paged alloc needs a multiple of {self.page_size}, got {need_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._expand_pages(pages)

    def _expand_pages(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions `[prefix_len, seq_len)` of each request, in request order.

        Three segments per request: the rest of the partial page after `last_loc`, whole new
        pages, then a partial tail page. Page counts come from the host-side lengths.

        Args:
            prefix_lens, seq_lens: host ints per request.
            last_loc: device int64 `[num_reqs]`, the slot of position `prefix_len - 1` (-1 if
                the request has no prefix).
            extend_num_tokens: `sum(seq_lens) - sum(prefix_lens)`.
        Returns:
            int64 `[extend_num_tokens]` or None (nothing taken).
        """
        page = self.page_size
        need_pages = num_new_pages(prefix_lens, seq_lens, page)
        pages = self._take_pages(need_pages)
        if pages is None:
            return None
        # Per output token: (request, position) on the host, then one gather on the device.
        req_of_token: list[int] = []
        new_page_of_token: list[int] = []  # -1: continues last_loc's page
        offset_in_page: list[int] = []
        page_cursor = 0
        for req, (prefix, seq) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
            first_new_page = -(-prefix // page)
            for pos in range(prefix, seq):
                req_of_token.append(req)
                offset_in_page.append(pos % page)
                page_no = pos // page
                new_page_of_token.append(-1 if page_no < first_new_page else page_cursor + page_no - first_new_page)
            page_cursor += -(-seq // page) - first_new_page
        assert len(req_of_token) == extend_num_tokens, "extend_num_tokens disagrees with lengths"
        return self._place(pages, last_loc, req_of_token, new_page_of_token, offset_in_page)

    def alloc_decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position `seq_len - 1` (a new page only at a boundary)."""
        page = self.page_size
        needs_page = [(seq - 1) % page == 0 for seq in seq_lens]
        pages = self._take_pages(sum(needs_page))
        if pages is None:
            return None
        new_page_of_token, cursor = [], 0
        for needs in needs_page:
            new_page_of_token.append(cursor if needs else -1)
            cursor += int(needs)
        offsets = [(seq - 1) % page for seq in seq_lens]
        return self._place(pages, last_loc, list(range(len(seq_lens))), new_page_of_token, offsets)

    def _place(
        self,
        pages: torch.Tensor,
        last_loc: torch.Tensor,
        req_of_token: list[int],
        new_page_of_token: list[int],
        offset_in_page: list[int],
    ) -> torch.Tensor:
        device = self.device
        req_idx = torch.tensor(req_of_token, dtype=torch.int64, device=device)
        new_page = torch.tensor(new_page_of_token, dtype=torch.int64, device=device)
        offset = torch.tensor(offset_in_page, dtype=torch.int64, device=device)
        # Continuation tokens sit in last_loc's page; new-page tokens in the page they drew.
        continued_page = torch.div(last_loc.to(torch.int64)[req_idx], self.page_size, rounding_mode="floor")
        drawn_page = pages[new_page.clamp(min=0)] if pages.numel() else torch.zeros_like(new_page)
        page_of_token = torch.where(new_page >= 0, drawn_page, continued_page)
        return page_of_token * self.page_size + offset

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64)
        pages = torch.div(free_index, self.page_size, rounding_mode="floor")
        routed = self._route(pages, free_index, repeats_are_bad=False)
        # The dedup SGLang's paged free pays a sync for anyway; the appended 0 sorts first, so
        # a fixed `[1:]` drops it together with every hole.
        kept = torch.unique(torch.cat([routed, self._zero_page]))[1:]
        self._give_back(kept, at_head=True, may_hold_holes=False)


def create_sub_allocator(
    size: int,
    page_size: int,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float64,
    kvcache: Any = None,
    need_sort: bool = False,
) -> BaseTokenToKVPoolAllocator:
    """The token allocator for page_size 1, the paged one otherwise."""
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device, dtype=dtype, kvcache=kvcache, need_sort=need_sort)
    return PagedTokenToKVPoolAllocator(
        size, page_size, device, dtype=dtype, kvcache=kvcache, need_sort=need_sort
    )
