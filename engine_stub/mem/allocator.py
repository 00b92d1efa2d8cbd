"""Sub-allocators over one pool of KV slots: token-granular (page_size 1) and paged.

Slot (or page) 0 is the padding sink and is never handed out. Free lists follow SGLang's
`need_sort` switch:

- `need_sort=False` (SGLang's value outside PD disaggregation, and our default): a free goes
  straight back on the free list, at its tail on page_size 1 and at its head on larger pages (so
  a freed page is the next one handed out);
- `need_sort=True`: frees are staged in `release_pages` and folded into a sorted free list only
  when an alloc runs short (`merge_and_sort_free`).

A per-page state row (`page_allocated` reads it as a bitmap) makes bad frees harmless: a double
free, an id past the end of the pool or an id inside the padding page is dropped instead of
recycled, and counted on the device. Counting never crashes (SGLang's drop counters do not
either): with checks on, each drop also adds to the count path of its invariant
(`alloc.double_free`, `alloc.out_of_pool`, `alloc.reserved_slot`, one `CountGroup`), whose
counters ride the step's one device-to-host read. Those counts are folded together with the drop
counters (below): a free with checks on costs no count op of its own, only its report's context,
and the allocator is a count source, so every reader of the invariant counters folds first and
sees exactly the drops of the frees made before it.

page_size 1 frees are sync-free: the drop decision is fixed-shape, so a dropped entry stays in
the list as a *hole* (page 0). The host learns whether holes exist from the drop counters the
scheduler reads back with each step (`note_drop_totals`); until then the entries freed since the
last read are unverified, and an alloc that would reach them drops the holes first (a sync, paid
only when the pool is that short). Paged frees sync anyway (their dedup has a data-dependent
shape), and the same dedup drops the holes.

How a free is decided, in few device ops (the hot path of every step):

- The state row holds `_ALLOCATED` for a page that is handed out, anything larger for one that
  is not. Ids are clamped into the row first: ids below 0 land on page 0, ids past the pool on a
  sink entry after the last page; neither ever reads as allocated.
- page_size 1: every entry offers a value, unique over the allocator's life and decreasing from
  one free to the next, with a scatter-max into the row. An allocated page takes the largest
  value offered (the entry named last, as a scatter with last-write-wins would pick) and only
  that entry reads its own value back: it is the one recycled. A page that was not allocated
  keeps a value older, hence larger, than any offered now, so none of its entries reads its own
  value back: all are dropped. The winners' values stay in the row and read as free.
- Larger pages: a page named by several slots goes back once (the dedup does that), a scratch
  claim row picks one entry per page to carry its count, and the row is reset to free for every
  page named.
- The drop counts themselves are kept as the classified entries and folded into the counters
  only when someone reads them (`drop_counter`, `drop_counts`, any reader of the invariant
  counters), or every `_FOLD_EVERY` frees: at the step's read-back that is one fold for all of
  the step's frees (each entry's outcome code, one `index_add_`), adding the checked frees'
  drops to their invariants too (one more).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from engine_stub.invariants import (
    Bucket,
    CountGroup,
    Invariant,
    IsTrue,
    checks_enabled,
    note_failures,
    register_count_source,
)

__all__ = [
    "DROP_REPORT",
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
# Outcome codes of one freed entry: an index into `_outcomes`. `_IGNORED`: an entry the caller
# asked to skip (the unmapped slots of an SWA page free), neither freed nor a drop.
_RECYCLED, _DOUBLE, _OUTSIDE, _RESERVED, _IGNORED = range(5)


# The drop kinds' invariants, reported together (count-only: never a crash point). Entry order
# is the order their contexts are kept in (see `note_failures`).
DROP_REPORT = CountGroup(
    (_OUT_OF_POOL, "id past the pool end"),
    (_RESERVED_SLOT, "padding page"),
    (_DOUBLE_FREE, "not allocated"),
)
# The report entry of each outcome code (`len(DROP_REPORT)`: none).
_NO_DROP = len(DROP_REPORT)
_ENTRY_OF_CODE = {_RECYCLED: _NO_DROP, _DOUBLE: 2, _OUTSIDE: 0, _RESERVED: 1, _IGNORED: _NO_DROP}
# What a free hands its caller's report: (resolve, data, slots), see `note_failures`.
Report = tuple[Any, Any, torch.Tensor]

# State row values: an allocated page holds `_ALLOCATED`; a free one anything larger. A page
# never freed since `clear` holds `_NEVER_FREED`, larger than every value a free offers.
_ALLOCATED = -(2**62)
_NEVER_FREED = 2**62
_OFFER_TOP = 2**61
_OFFER_FLOOR = -(2**61)
# Frees kept unfolded at most (their classified entries; see the module docstring).
_FOLD_EVERY = 64
_I64 = torch.int64


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


def _host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host ints, built without a per-element Python conversion."""
    if not values:
        return torch.zeros(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array("q", values), dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)


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
        device = self.device
        # Dropped entries by outcome code, DROP_KINDS[code - 1] (the recycled and ignored entries'
        # codes index it too, but what they count is never read).
        self._outcomes = torch.zeros(2 + len(DROP_KINDS), dtype=torch.int64, device=device)
        self._drops = self._outcomes[_DOUBLE:_IGNORED]  # by DROP_KINDS
        # Drops the host has learned of (`note_drop_totals`, `drop_counts`).
        self._drops_known = 0
        # Classified frees not yet folded into `_outcomes`: (ids clamped or owned, kept, counted,
        # checked); `checked`: the free ran with checks on, so its drops count for DROP_REPORT.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = []
        self._pending_checked = 0  # how many of `_pending` are checked
        # Per-page rows, indexed by page + 1 (the paged free's `_shifted_pages`): [0] takes pages
        # below 0, [1] page 0, then the pool, [num_pages + 2] pages past it, [num_pages + 3] the
        # entries a free is told to ignore. `_state` and `_kind` view the same rows indexed by
        # the page itself: [0] page 0 ... [num_pages + 1] past the pool, which is also where
        # advanced indexing sends -1 (the page_size 1 free clamps ids below 0 to -1).
        self._sink = self.num_pages + 1  # the page ids past the pool clamp onto (unshifted)
        self._ignore_row = self.num_pages + 3
        rows = self.num_pages + 4
        kind_rows = torch.full((rows,), _DOUBLE, dtype=torch.int64, device=device)
        kind_rows[0] = _OUTSIDE
        kind_rows[1] = _RESERVED
        kind_rows[self.num_pages + 2] = _OUTSIDE
        kind_rows[self._ignore_row] = _IGNORED
        self._kind_rows = kind_rows
        # Unshifted: [0] page 0, the pool, [num_pages + 1] past it; -1 wraps onto past-pool too.
        self._kind = kind_rows[1 : self.num_pages + 3]
        # Each row's DROP_REPORT entry (`_NO_DROP` for the ignored row), and the unshifted view.
        entry_of_code = torch.tensor([_ENTRY_OF_CODE[c] for c in range(len(_ENTRY_OF_CODE))],
                                     dtype=torch.int64, device=device)
        self._entry_rows = entry_of_code[kind_rows]
        self._entry = self._entry_rows[1 : self.num_pages + 3]
        # `DROP_REPORT.add` index of the outcome codes, in code order.
        self._code_index = DROP_REPORT.index(
            device, [None if _ENTRY_OF_CODE[c] == _NO_DROP else _ENTRY_OF_CODE[c] for c in range(_IGNORED + 1)]
        )
        # The next (exclusive) top of the values a page_size 1 free offers; only ever decreases.
        self._offer = _OFFER_TOP
        self._rows = torch.full((rows,), _NEVER_FREED, dtype=torch.int64, device=device)
        self._state = self._rows[1 : self.num_pages + 3]
        self.clear()
        register_count_source(self)

    # ---- state ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free, nothing allocated, drop counters kept."""
        # The free list, as chunks in order (a free appends one; `free_pages` joins them).
        self._chunks = [torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)]
        self._free_count = self.num_pages
        self.release_pages: list[torch.Tensor] = []
        self._staged = 0  # host-side count of entries in release_pages
        # Entries that may be holes (page 0): the tail of free_pages (need_sort=False) or the
        # staged ones (need_sort=True). Host-side.
        self._unverified = 0
        # The kept masks of the page_size 1 frees that put them there (`_drop_holes` reads them).
        self._unverified_kept: list[torch.Tensor] = []
        self._rows.fill_(_NEVER_FREED)

    @property
    def free_pages(self) -> torch.Tensor:
        """The free list, head first (joins its chunks; a device op, no sync)."""
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        if not chunks:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        joined = torch.cat(chunks)
        self._chunks = [joined]
        return joined

    @free_pages.setter
    def free_pages(self, pages: torch.Tensor) -> None:
        self._chunks = [pages] if pages.numel() else []
        self._free_count = int(pages.numel())

    @property
    def page_allocated(self) -> torch.Tensor:
        """Which pages are handed out, `[num_pages + 1]` bool (page 0 never is)."""
        return self._state[: self.num_pages + 1] == _ALLOCATED

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        """Free slots (host-side, no sync). Counts staged frees, and holes not yet dropped."""
        return (self._free_count + self._staged) * self.page_size

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
        self._rows.fill_(_NEVER_FREED)
        self._state[: self.num_pages + 1].masked_fill_(state.page_allocated, _ALLOCATED)
        self._unverified = state.unverified
        # Which of the restored entries are holes is not on record: a drop reads them all.
        self._unverified_kept = []

    # ---- bad-free counters ----------------------------------------------------------------

    def _fold(self) -> None:
        """Count the pending classified frees into `_outcomes`, and the checked ones' drops into
        DROP_REPORT's counters (device ops, no sync)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        checked, self._pending_checked = self._pending_checked, 0
        if checked in (0, len(pending)):
            self._fold_entries(pending, report=checked > 0)
        else:  # the level changed between frees (tests): fold each kind apart
            self._fold_entries([p for p in pending if p[3]], report=True)
            self._fold_entries([p for p in pending if not p[3]], report=False)

    def _fold_entries(self, pending: list, *, report: bool) -> None:
        if len(pending) == 1:
            ids, kept, counted, _checked = pending[0]
        else:
            ids = torch.cat([p[0] for p in pending])
            kept = torch.cat([p[1] for p in pending])
            counted = None if pending[0][2] is None else torch.cat([p[2] for p in pending])
        if counted is None:
            # page_size 1: every dropped entry counts once, under its id's kind (kept ones add 0,
            # so their code need not say RECYCLED: that count is never read).
            code = torch.take(self._kind, ids.clamp(-1, self._sink))
            weights = 1 - kept  # (`kept` is int64 1/0 here)
        else:
            code = self._outcome_codes(ids, kept)
            # A page counts once however many of its slots are named; ids outside the pool
            # count per id, as SGLang's out-of-pool location drops do.
            weights = (counted | (code == _OUTSIDE)).to(torch.int64)
        if report:
            # Per code first, so the entries are summed once for both counters.
            delta = torch.zeros_like(self._outcomes).index_add_(0, code, weights)
            self._outcomes.add_(delta)
            DROP_REPORT.add(delta, self._code_index)
        else:
            self._outcomes.index_add_(0, code, weights)

    def flush_counts(self) -> None:
        """Fold now (a count source of DROP_REPORT: every invariant-counter reader calls it)."""
        self._fold()

    def _keep_pending(
        self, ids: torch.Tensor, kept: torch.Tensor, counted: torch.Tensor | None, checked: bool
    ) -> None:
        self._pending.append((ids, kept, counted, checked))
        self._pending_checked += checked
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def drop_counter(self) -> torch.Tensor:
        """Every drop so far, as a 0-dim device tensor (for the step's read-back; no sync)."""
        self._fold()
        return self._drops.sum()

    def note_drop_totals(self, total: int) -> None:
        """What `drop_counter()` read back. No new drop: every entry freed so far is a real page.

        A new drop means holes: they are dropped now (a sync, on the error path only).
        """
        if total != self._drops_known:
            self._drops_known = total
            self._drop_holes(known_holes=True)
        self._unverified = 0
        self._unverified_kept = []

    def _drop_holes(self, *, known_holes: bool = False) -> None:
        """Filter page 0 out of the free list and the staged frees, keeping their order (a sync).

        Unless the caller knows there are holes, the frees' kept masks are read first (the same
        one sync): where every entry was kept there is nothing to filter.
        """
        if self._unverified:
            kept = self._unverified_kept
            # The masks cover the unverified entries only if every one of them came with one.
            covered = bool(kept) and sum(k.numel() for k in kept) == self._unverified
            if known_holes or not covered or not bool(
                (kept[0] if len(kept) == 1 else torch.cat(kept)).all()
            ):
                pages = self.free_pages
                self.free_pages = pages[pages > 0]
                self.release_pages = [t[t > 0] for t in self.release_pages]
                self._staged = sum(int(t.numel()) for t in self.release_pages)
        self._unverified = 0
        self._unverified_kept = []

    def drop_counts(self) -> dict[str, int]:
        """Bad frees dropped so far, by kind (a host read: idle ticks and tests)."""
        self._fold()
        counts = dict(zip(DROP_KINDS, self._drops.tolist(), strict=True))
        self.note_drop_totals(sum(counts.values()))
        return counts

    # ---- pages ----------------------------------------------------------------------------

    def _ready(self, count: int) -> bool:
        """Whether `count` pages can be taken from the head of the free list, hole-free.

        With `need_sort` a short list first folds the staged frees in (SGLang's merge, which
        also drops holes); without, a take that would reach the unverified tail drops them first.
        """
        if self.need_sort:
            if count > self._free_count:
                self.merge_and_sort_free()
        elif count > self._free_count - self._unverified:
            if count > self._free_count:  # dropping holes only shortens the list
                return False
            self._drop_holes()
        return count <= self._free_count

    def _take_pages(self, count: int) -> torch.Tensor | None:
        if not self._ready(count):
            return None
        return self._take_ready(count)

    def _take_ready(self, count: int) -> torch.Tensor:
        """Take `count` pages from the head of the list, after `_ready(count)` said yes."""
        chunks = self._chunks
        if not chunks or count == 0:
            return torch.zeros(0, dtype=_I64, device=self.device)
        head = chunks[0]
        have = head.numel()
        if have == count:
            del chunks[0]
            pages = head
        elif have > count:
            pages = head[:count]
            chunks[0] = head[count:]
        else:
            joined = torch.cat(chunks)
            pages = joined[:count]
            self._chunks = [joined[count:]] if joined.numel() > count else []
        self._free_count -= count
        self._state.index_fill_(0, pages, _ALLOCATED)
        return pages

    def _report(self, report: Report) -> None:
        """Put a free's drops on DROP_REPORT's record: never a crash point.

        The counts were kept with the free (folded with the drop counters); this records the
        context a drain resolves the failing slots from. The drop itself is the containment (the
        data layer); this is only the signal, and like SGLang's drop counters it is read back
        with the step, not asserted at the free.
        """
        note_failures(DROP_REPORT, (report,))

    def _failure_codes(self, data: tuple) -> torch.Tensor:
        """Each entry's DROP_REPORT entry (`_NO_DROP`: none), from what a free kept (a drain
        calls it, only when a drop invariant fired)."""
        raise NotImplementedError

    def _give_back(self, pages: torch.Tensor, *, at_head: bool, may_hold_holes: bool) -> None:
        """Return `pages` to the free list (or stage them, with `need_sort`)."""
        n = int(pages.numel())
        if self.need_sort:
            self.release_pages.append(pages)
            self._staged += n
        elif n:
            if at_head:
                self._chunks.insert(0, pages)
            else:
                self._chunks.append(pages)
            self._free_count += n
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
        if free_index.numel() == 0:
            return
        if free_index.dtype != torch.int64:
            free_index = free_index.to(torch.int64)
        report = self._free(free_index, owned=False, checks=checks_enabled())
        if report is not None:
            self._report(report)

    def _free(self, free_index: torch.Tensor, *, owned: bool, checks: bool) -> Report | None:
        """`free` of a non-empty int64 tensor, without the report: returns its report for
        `_report` when `checks` (its drops then count for DROP_REPORT), else None. `owned`:
        nobody else holds `free_index` (it may be kept until the counts are folded)."""
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

    def _free(self, free_index: torch.Tensor, *, owned: bool, checks: bool) -> Report | None:
        n = free_index.numel()
        state = self._state
        sink = self._sink
        pages = free_index.clamp(0, sink)
        top = self._offer
        low = top - n
        if low < _OFFER_FLOOR:
            # Every value offered so far reads as free; start the offers over (never in practice).
            state.masked_fill_(state != _ALLOCATED, _NEVER_FREED)
            top = _OFFER_TOP
            low = top - n
        self._offer = low
        # Increasing within the call: of a page named twice, the entry named last wins.
        offers = torch.arange(low, top, dtype=_I64, device=self.device)
        state.scatter_reduce_(0, pages, offers, "amax")
        # int64 1/0, compared in place on the fresh gather: multiplying `pages` by an int64 mask
        # is cheaper than by a bool one (every reader of `kept` takes either).
        kept = state.index_select(0, pages).eq_(offers)
        # The fold tells the drop kinds apart by the unclamped id (below 0: outside the pool).
        ids = free_index if owned else free_index.clamp(-1, sink)
        pending = self._pending
        pending.append((ids, kept, None, checks))
        self._pending_checked += checks
        if len(pending) >= _FOLD_EVERY:
            self._fold()
        self._unverified_kept.append(kept)
        routed = pages.mul_(kept)  # holes (page 0) where dropped; `pages` is ours
        if self.need_sort:
            self.release_pages.append(routed)
            self._staged += n
        else:
            self._chunks.append(routed)
            self._free_count += n
        self._unverified += n
        if not checks:
            return None
        return self._failure_codes, (ids, kept), free_index

    def _failure_codes(self, data: tuple) -> torch.Tensor:
        ids, kept = data
        return torch.take(self._entry, ids.clamp(-1, self._sink)).masked_fill_(kept.bool(), _NO_DROP)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """page_size > 1: whole pages are handed out; extends fill a request's partial page first.

    A freed page goes back at the head of the free list (`need_sort=False`): the next page handed
    out.
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
        super().__init__(size, page_size, device, dtype=dtype, kvcache=kvcache, need_sort=need_sort)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        # Scratch rows (as `_rows`) that pick one entry per page named in a free: its last
        # entry of the page carries the page's count.
        self._claims = torch.zeros(self.num_pages + 4, dtype=torch.int64, device=self.device)
        self._zero_page = torch.zeros(1, dtype=torch.int64, device=self.device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise ValueError(f"paged alloc needs a multiple of {self.page_size}, got {need_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._expand_pages(pages)

    def _expand_pages(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.add(self._page_offsets, pages.unsqueeze(1), alpha=self.page_size).reshape(-1)

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
        # Host side, per request (not per token): where each run of output tokens comes from.
        # The sources are the drawn pages expanded to slots (`drawn`), then, only if some request
        # continues a partial page, every request's last_loc page expanded to slots; within a run
        # a token's source index grows by one, so each run is its start and its first source.
        run_starts: list[int] = []
        run_sources: list[int] = []
        carried_runs: list[int] = []  # runs whose source lies past `drawn` (resolved below)
        need_pages = 0
        token = 0
        for req, (prefix, seq) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
            first_new_page = -(-prefix // page)
            carried = min(seq, first_new_page * page) - prefix  # tokens in last_loc's page
            if carried > 0:
                carried_runs.append(len(run_starts))
                run_starts.append(token)
                run_sources.append(req * page + prefix % page)
                token += carried
            fresh = seq - max(prefix, first_new_page * page)  # tokens in newly drawn pages
            if fresh > 0:
                run_starts.append(token)
                run_sources.append(need_pages * page)
                token += fresh
            need_pages += -(-seq // page) - first_new_page
        assert token == extend_num_tokens, "extend_num_tokens disagrees with lengths"
        pages = self._take_pages(need_pages)
        if pages is None:
            return None
        drawn = self._expand_pages(pages)
        if not carried_runs and run_sources == run_starts:
            # Every request starts on a fresh page and the runs sit back to back in `drawn`
            # (only a partial tail page may end it): a page-aligned extend, the common case.
            return drawn if drawn.numel() == token else drawn[:token]
        source = drawn
        if carried_runs:
            for run in carried_runs:
                run_sources[run] += need_pages * page
            if last_loc.dtype != torch.int64:
                last_loc = last_loc.to(torch.int64)
            continued = torch.div(last_loc, page, rounding_mode="floor")
            source = torch.cat([drawn, self._expand_pages(continued)])
        # index[j] = its run's first source + (j - run start): a cumsum of ones that jumps at
        # each run start.
        jumps = []
        previous = 0  # the source index of the token before the run (the first run: none)
        for start, end, first in zip(run_starts, run_starts[1:] + [token], run_sources, strict=True):
            jumps.append(first - previous)
            previous = first + end - start - 1
        deltas = torch.ones(token, dtype=torch.int64, device=self.device)
        meta = _host_ints(run_starts + jumps, self.device)
        runs = len(run_starts)
        deltas.index_copy_(0, meta[:runs], meta[runs:])
        return source.index_select(0, deltas.cumsum_(0))

    def alloc_decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position `seq_len - 1` (a new page only at a boundary)."""
        page = self.page_size
        offsets = [(seq - 1) % page for seq in seq_lens]
        new_pages = offsets.count(0)
        pages = self._take_pages(new_pages)
        if pages is None:
            return None
        reqs = len(seq_lens)
        if new_pages == reqs:
            return pages * page
        # A request that goes on in its page gets the slot after its last one, as SGLang's
        # `alloc_decode` computes it (`last_loc + 1`): a damaged last_loc (a -1) then names the
        # padding slot, for the free-time checks to see, never an index outside the pool.
        continued = last_loc.to(torch.int64) + 1
        if new_pages == 0:
            return continued
        # Sources: the drawn pages' first slots, then each request's next slot.
        index, cursor = [], 0
        for req, offset in enumerate(offsets):
            if offset == 0:
                index.append(cursor)
                cursor += 1
            else:
                index.append(new_pages + req)
        source = torch.cat([pages * page, continued])
        return source.index_select(0, _host_ints(index, self.device))

    def _shifted_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        """Each slot's page + 1, clamped into the rows (see `_rows`): a fresh tensor."""
        page = self.page_size
        if page & (page - 1) == 0:
            # An arithmetic shift floors like the division (negative ids included), far cheaper.
            shifted = torch.add(free_index, page).bitwise_right_shift_(page.bit_length() - 1)
        else:
            shifted = torch.div(free_index, page, rounding_mode="floor").add_(1)
        return shifted.clamp_(0, self.num_pages + 2)

    def _outcome_codes(self, ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Each entry's outcome: `_RECYCLED` where kept, else its drop kind (fixed shape).
        Paged entries are kept as shifted pages (`_shifted_pages`), clamped by construction."""
        return self._kind_rows.index_select(0, ids).masked_fill_(kept, _RECYCLED)

    def _failure_codes(self, data: tuple) -> torch.Tensor:
        # A page counts once, on its last entry named (`first`), an id outside the pool per id.
        shifted, allocated, first = data
        entry = self._entry_rows.index_select(0, shifted).masked_fill_(allocated, _NO_DROP)
        counted = first | (self._kind_rows.index_select(0, shifted) == _OUTSIDE)
        return entry.masked_fill_(~counted, _NO_DROP)

    def _free(
        self,
        free_index: torch.Tensor,
        *,
        owned: bool,
        checks: bool,
        skip_nonpositive: bool = False,
    ) -> Report | None:
        """See the base class. `skip_nonpositive`: entries <= 0 name no slot (an SWA page's
        unmapped slots) and are ignored: neither freed nor counted nor reported."""
        rows = self._rows
        shifted = self._shifted_pages(free_index)
        if skip_nonpositive:
            shifted = torch.where(free_index > 0, shifted, self._ignore_row)
        order = torch.arange(shifted.numel(), dtype=torch.int64, device=self.device)
        claims = self._claims
        claims.index_copy_(0, shifted, order)
        first = claims.index_select(0, shifted) == order
        allocated = rows.index_select(0, shifted) == _ALLOCATED
        # Every page named is free now (page 0 and the other non-pool rows never read allocated).
        rows.index_fill_(0, shifted, _NEVER_FREED)
        # The dedup SGLang's paged free pays a sync for anyway; the added 0 sorts first, so a
        # fixed `[1:]` drops it together with every hole. (Put in front: CPU sort is very slow
        # on an ascending run that ends in its minimum.)
        kept = torch.unique(torch.cat([self._zero_page, shifted * allocated]))[1:].sub_(1)
        self._keep_pending(shifted, allocated, first, checks)
        self._give_back(kept, at_head=True, may_hold_holes=False)
        if not checks:
            return None
        return self._failure_codes, (shifted, allocated, first), free_index


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
