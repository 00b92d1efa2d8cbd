"""Sub-allocators over one pool of KV slots: token-granular (page_size 1) and paged.

Slot (or page) 0 is the padding sink and is never handed out. A per-page `page_allocated`
bitmap makes bad frees harmless: a double free, an id past the end of the pool or an id inside
the padding page is routed to page 0 and dropped instead of recycled, and counted on the device
(`drop_counts()` is the host read). The drop decision is a fixed-shape `where`, so `free` on
page_size 1 never synchronizes the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_stub.invariants import Bucket, Invariant, IsTrue, expect

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
    description="a freed slot/page was not allocated (dropped, not recycled)",
)
_OUT_OF_POOL = Invariant(
    "alloc.out_of_pool",
    Bucket.GUARD,
    IsTrue(),
    site="free",
    description="a freed id lies outside the pool (dropped)",
)
_RESERVED_SLOT = Invariant(
    "alloc.reserved_slot",
    Bucket.GUARD,
    IsTrue(),
    site="free",
    description="a freed id lies in the padding page 0 (dropped; recycling it aliases the sink)",
)

DROP_KINDS = ("double_free", "out_of_pool", "reserved")


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot for `backup_state`/`restore_state` (free lists and the allocated bitmap)."""

    free_pages: torch.Tensor
    release_pages: tuple[torch.Tensor, ...]
    page_allocated: torch.Tensor


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
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        # Freed entries by outcome: [0] recycled, [1 + i] dropped as DROP_KINDS[i].
        self._outcomes = torch.zeros(1 + len(DROP_KINDS), dtype=torch.int64, device=self.device)
        # Scratch row for spotting a page named twice in one free (see `_release_pages`).
        self._claims = torch.zeros(self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.clear()

    # ---- state ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free, nothing allocated, drop counters kept."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages: list[torch.Tensor] = []
        self._released = 0  # host-side count of entries staged in release_pages
        self.page_allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)

    def available_size(self) -> int:
        """Free slots, counting frees staged since the last merge (host-side, no sync)."""
        return (int(self.free_pages.numel()) + self._released) * self.page_size

    def merge_and_sort_free(self) -> None:
        """Fold staged frees into the sorted free list, dropping the entries routed to page 0."""
        if not self.release_pages:
            return
        merged = torch.cat([self.free_pages, *self.release_pages])
        # Data-dependent shape: a sync, paid only when an alloc runs short or at idle.
        merged = merged[merged > 0]
        self.free_pages = torch.sort(merged).values
        self.release_pages = []
        self._released = 0

    def backup_state(self) -> AllocatorState:
        return AllocatorState(
            self.free_pages.clone(),
            tuple(t.clone() for t in self.release_pages),
            self.page_allocated.clone(),
        )

    def restore_state(self, state: AllocatorState) -> None:
        self.free_pages = state.free_pages.clone()
        self.release_pages = [t.clone() for t in state.release_pages]
        self._released = sum(int(t.numel()) for t in self.release_pages)
        self.page_allocated = state.page_allocated.clone()

    def drop_counts(self) -> dict[str, int]:
        """Bad frees dropped so far, by kind (a host read: idle ticks and tests)."""
        return dict(zip(DROP_KINDS, self._outcomes[1:].tolist(), strict=True))

    # ---- pages ----------------------------------------------------------------------------

    def _take_pages(self, count: int) -> torch.Tensor | None:
        if count > self.free_pages.numel():
            self.merge_and_sort_free()
            if count > self.free_pages.numel():
                return None
        pages = self.free_pages[:count]
        self.free_pages = self.free_pages[count:]
        self.page_allocated.index_fill_(0, pages, True)
        return pages

    def _release_pages(
        self, pages: torch.Tensor, slots: torch.Tensor, *, distinct: bool = False
    ) -> None:
        """Return `pages` to the free list, routing every bad one to page 0 (sync-free).

        `distinct` says the caller already deduplicated `pages`. Otherwise a page named twice in
        one call (a slot freed twice inside one free group) goes back once and its repeats count
        as double frees: each entry writes its position into a scratch row, and exactly one of a
        repeated page's entries reads its own position back. Fixed shapes, so still no sync.
        """
        in_pool = (pages >= 0) & (pages <= self.num_pages)
        safe = torch.where(in_pool, pages, 0)
        # Page 0 never reads as allocated (routed entries only ever clear it), so an id past the
        # pool or inside the padding page fails this test as well.
        allocated = self.page_allocated[safe]
        if not distinct:
            order = torch.arange(pages.numel(), dtype=torch.int64, device=self.device)
            self._claims.index_copy_(0, safe, order)
            allocated &= self._claims[safe] == order
        # One outcome per entry, indexing `_outcomes`: 0 recycled, else 1 + its DROP_KINDS index.
        outcome = torch.where(in_pool, torch.where(safe == 0, 3, 1), 2).masked_fill_(allocated, 0)
        expect(_OUT_OF_POOL, outcome != 2, "id past the pool end", slots=slots)
        expect(_RESERVED_SLOT, outcome != 3, "padding page", slots=slots)
        expect(_DOUBLE_FREE, outcome != 1, "not allocated", slots=slots)
        self._outcomes.index_add_(0, outcome, torch.ones_like(outcome))
        routed = torch.where(allocated, safe, 0)
        self.page_allocated.index_fill_(0, routed, False)
        self.release_pages.append(routed)
        self._released += int(routed.numel())

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
    """page_size 1: a page is a slot. `free` is sync-free."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        super().__init__(size, 1, device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._take_pages(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64)
        self._release_pages(free_index, free_index)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """page_size > 1: whole pages are handed out; extends fill a request's partial page first."""

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
        # Paged frees dedup to pages: a data-dependent shape (SGLang's unique does the same).
        pages = torch.unique(torch.div(free_index, self.page_size, rounding_mode="floor"))
        self._release_pages(pages, pages * self.page_size, distinct=True)


def create_sub_allocator(
    size: int, page_size: int, device: torch.device | str = "cpu"
) -> BaseTokenToKVPoolAllocator:
    """The token allocator for page_size 1, the paged one otherwise."""
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device)
    return PagedTokenToKVPoolAllocator(size, page_size, device)
