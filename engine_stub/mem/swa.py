"""The hybrid sliding-window allocator: a full pool, an SWA pool, and the mapping between them.

Semantics follow SGLang after PR #36723:

- only FULL indices leave the allocator; an SWA slot is always `full_to_swa_index_mapping[full]`;
- mapping entry 0 means "no SWA peer" (slot 0 is padding); the tail entry is -1 so that
  `last_loc = -1` translates to -1;
- `free = free_swa + free_full`, SWA side first because it reads the mapping;
- `free_swa` on page_size 1 gathers the peers with no filter (a filter's data-dependent shape
  would cost a sync) and expects every peer mapped (`swa.peer_mapped`, FATAL_UNCONTAINABLE); on
  larger pages it expands to whole pages and filters unmapped slots once per free group;
- `free_full` expects the peer already released (`swa.peer_released`, GUARD), at enqueue time;
- inside a free group the SWA side resolves ownership at enqueue, the full side queues a copy,
  and `free_group_end` frees the full indices on the full sub-allocator directly;
- `need_sort` is passed to both sub-allocators (False outside PD disaggregation, as in SGLang);
  the mapping is registered with the KV pool (`kvcache`) that translates through it.

At STRICT, `free_swa` has one crash point (`swa.peer_mapped`), as in SGLang: the sub-allocators'
bad-free drops are counted, and read back with the step (`drop_counter`/`note_drop_totals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine_stub.invariants import (
    Bucket,
    InClosedRange,
    Invariant,
    IsZero,
    Positive,
    checks_enabled,
    expect,
    note_failures,
)
from engine_stub.mem.allocator import (
    DROP_REPORT,
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    Report,
    create_sub_allocator,
    num_new_pages,
)

__all__ = ["PureSWATokenToKVPoolAllocator", "SWAAllocatorState", "SWATokenToKVPoolAllocator"]

# free_swa releases whatever the mapping names, so a peer that reads as the padding slot would
# push slot 0 into the SWA free list and hand it out twice.
SWA_PEER_MAPPED = Invariant(
    "swa.peer_mapped",
    Bucket.FATAL_UNCONTAINABLE,
    Positive(),
    site="SWATokenToKVPoolAllocator.free_swa",
    description="free_swa (page_size 1) met a slot whose SWA peer is already released",
)
# free_full leaves the mapping alone, so a live entry would strand its SWA peer.
SWA_PEER_RELEASED = Invariant(
    "swa.peer_released",
    Bucket.GUARD,
    IsZero(),
    site="SWATokenToKVPoolAllocator.free_full",
    description="free_full met a slot whose SWA peer is still mapped (the peer would leak)",
)
POOL_BOUND = Invariant(
    "alloc.pool_bound",
    Bucket.FATAL_CONTAINABLE,
    InClosedRange(0, 1),
    site="SWATokenToKVPoolAllocator.free_group_end",
    description="a sub-allocator reports more free slots than it has (an over-free)",
)


def _report_drops(first: Report | None, second: Report | None = None) -> None:
    """Put the sub-allocators' bad-free drops on their invariants' record, as one report.

    Each report is what a sub-allocator's `_free` returned (None: checks were off or nothing was
    freed); its counts were kept with the free. Joined, the firings list the same slots in the
    same order as separate reports. Count-only at every level, never a crash point (see
    `engine_stub.mem.allocator`).
    """
    if first is None:
        if second is not None:
            note_failures(DROP_REPORT, (second,))
    else:
        note_failures(DROP_REPORT, (first,) if second is None else (first, second))


@dataclass(frozen=True)
class SWAAllocatorState:
    full: AllocatorState
    swa: AllocatorState
    mapping: torch.Tensor


class SWATokenToKVPoolAllocator:
    """Allocator for the hybrid SWA KV cache.

    Args:
        size: full-pool slots (the full-attention layers' capacity).
        size_swa: SWA-pool slots (the sliding-window layers' capacity).
        page_size: slots per page, shared by both pools.
        device: where the free lists, bitmaps and mapping live.
        dtype: the KV dtype of the pools (SGLang's argument; kept, not used to allocate).
        kvcache: the KV pool; the mapping is registered with it (`register_mapping`).
        need_sort: the sub-allocators' free-list policy (see `engine_stub.mem.allocator`).
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float64,
        kvcache: Any = None,
        need_sort: bool = False,
    ) -> None:
        if size_swa > size:
            raise ValueError(f"size_swa={size_swa} must not exceed the full size={size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.need_sort = need_sort
        self.size_full = size
        self.size_swa = size_swa
        self.full_attn_allocator: BaseTokenToKVPoolAllocator = create_sub_allocator(
            size, page_size, device, dtype=dtype, kvcache=getattr(kvcache, "full_kv_pool", None),
            need_sort=need_sort,
        )
        self.swa_attn_allocator: BaseTokenToKVPoolAllocator = create_sub_allocator(
            size_swa, page_size, device, dtype=dtype, kvcache=getattr(kvcache, "swa_kv_pool", None),
            need_sort=need_sort,
        )
        # Held by identity by whoever translates slots (the KV pool, the canary): mutate in place.
        self.full_to_swa_index_mapping = torch.zeros(
            size + page_size + 1, dtype=torch.int64, device=self.device
        )
        self.full_to_swa_index_mapping[-1] = -1
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.free_group: list[torch.Tensor] | None = None
        self.full_free_group: list[torch.Tensor] = []
        self._kvcache = kvcache
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    def get_kvcache(self) -> Any:
        return self._kvcache

    def clear(self) -> None:
        """Both pools free, the mapping back to all-unmapped (the -1 tail kept), no open group."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1].zero_()
        self.free_group = None
        self.full_free_group = []

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return min(self.size_full, self.size_swa)

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    # ---- mapping -----------------------------------------------------------------------------

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of `kv_indices` (a gather; -1 stays -1, unmapped reads 0)."""
        return self.full_to_swa_index_mapping[kv_indices.to(torch.int64)]

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        if full_indices.dtype != torch.int64:
            full_indices = full_indices.to(torch.int64)
        if swa_indices.dtype != torch.int64:
            swa_indices = swa_indices.to(torch.int64)
        self.full_to_swa_index_mapping.index_copy_(0, full_indices, swa_indices)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        if full_indices.dtype != torch.int64:
            full_indices = full_indices.to(torch.int64)
        # index_fill_, not `mapping[idx] = 0`: assigning a host scalar is a blocking H2D copy.
        self.full_to_swa_index_mapping.index_fill_(0, full_indices, 0)

    # ---- alloc -------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots on both sides, or None with nothing taken. Returns FULL indices."""
        pages = -(-need_size // self.page_size)
        full_side, swa_side = self.full_attn_allocator, self.swa_attn_allocator
        if not (full_side._ready(pages) and swa_side._ready(pages)):
            return None
        if self.page_size == 1:
            # Both sides are ready: take the pages without asking again.
            full = full_side._take_ready(need_size)
            swa = swa_side._take_ready(need_size)
        else:
            full = full_side.alloc(need_size)
            swa = swa_side.alloc(need_size)
        return self._pair(full, swa)

    def alloc_extend(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Paged extend on both sides (page_size > 1); see PagedTokenToKVPoolAllocator."""
        full_side, swa_side = self._paged_sides()
        pages = num_new_pages(prefix_lens, seq_lens, self.page_size)
        if not self.new_pages_available(pages, pages):
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = full_side.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)
        swa = swa_side.alloc_extend(prefix_lens, seq_lens, swa_last_loc, extend_num_tokens)
        return self._pair(full, swa)

    def alloc_decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        """Paged decode on both sides (page_size > 1).

        Unlike SGLang, both sides are checked before either allocates, so a short SWA side
        cannot strand the full side's new pages.
        """
        full_side, swa_side = self._paged_sides()
        pages = sum((seq - 1) % self.page_size == 0 for seq in seq_lens)
        if not self.new_pages_available(pages, pages):
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = full_side.alloc_decode(seq_lens, last_loc)
        swa = swa_side.alloc_decode(seq_lens, swa_last_loc)
        return self._pair(full, swa)

    def _paged_sides(self) -> tuple[PagedTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator]:
        full_side, swa_side = self.full_attn_allocator, self.swa_attn_allocator
        if not isinstance(full_side, PagedTokenToKVPoolAllocator):
            raise TypeError("alloc_extend/alloc_decode are for page_size > 1; use alloc")
        assert isinstance(swa_side, PagedTokenToKVPoolAllocator)
        return full_side, swa_side

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        """Whether the full side can hand out `num_full_pages` and the SWA side `num_swa_pages`,
        decided before either does.

        `available_size` also counts staged frees and the holes of bad frees not yet dropped, so
        it can promise more than a side holds; each side's own readiness check folds or drops
        those first (what its alloc would do anyway), so the answer is exact and no side can fail
        after the other took its pages. Undoing a half-done extend would be wrong: its slots
        include the prefix's partial page.
        """
        return self.full_attn_allocator._ready(num_full_pages) and self.swa_attn_allocator._ready(
            num_swa_pages
        )

    def _pair(self, full: torch.Tensor | None, swa: torch.Tensor | None) -> torch.Tensor:
        assert full is not None and swa is not None, "a side failed after new_pages_available"
        # Both are int64 tensors of ours: no conversion on the way in.
        self.full_to_swa_index_mapping.index_copy_(0, full, swa)
        return full

    # ---- free --------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Release both sides of FULL slots. Not idempotent: the SWA side reads the mapping.

        `free_swa` then `free_full`; outside a free group the two run fused, with one report of
        both sides' bad-free drops. The fused `free_full` skips its `swa.peer_released` check:
        `free_swa` has just zeroed every mapping entry it reads, so it cannot fire.
        """
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_swa(free_index)
            self.free_full(free_index)
            return
        if free_index.dtype != torch.int64:
            free_index = free_index.to(torch.int64)
        mapping = self.full_to_swa_index_mapping
        checks = checks_enabled()
        # Gathers are `torch.take`: on a 1-D mapping the same values and errors as
        # `mapping[idx]` (negative ids wrap), at a fraction of advanced indexing's cost.
        if self.page_size == 1:
            swa_indices = torch.take(mapping, free_index)
            if checks:
                # No `> 0` filter here: its data-dependent shape would cost a device-to-host sync.
                expect(SWA_PEER_MAPPED, swa_indices, "caller wants free_full", slots=free_index)
            mapping.index_fill_(0, free_index, 0)
        else:
            mapping_indices = self._expand_to_full_pages(free_index)
            swa_indices = torch.take(mapping, mapping_indices)
            mapping.index_fill_(0, mapping_indices, 0)
        swa_report = self._release_swa_unreported(swa_indices, checks)
        full_report = self.full_attn_allocator._free(free_index, owned=False, checks=checks)
        _report_drops(swa_report, full_report)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Release the SWA peers of FULL slots and zero their mapping entries."""
        if free_index.numel() == 0:
            return
        if free_index.dtype != torch.int64:
            free_index = free_index.to(torch.int64)
        mapping = self.full_to_swa_index_mapping
        if self.page_size == 1:
            swa_indices = torch.take(mapping, free_index)
            # No `> 0` filter here: its data-dependent shape would cost a device-to-host sync.
            expect(SWA_PEER_MAPPED, swa_indices, "caller wants free_full", slots=free_index)
            # index_fill_, not `mapping[idx] = 0`: assigning a host scalar is a blocking H2D copy.
            mapping.index_fill_(0, free_index, 0)
        else:
            mapping_indices = self._expand_to_full_pages(free_index)
            swa_indices = torch.take(mapping, mapping_indices)
            mapping.index_fill_(0, mapping_indices, 0)
        group = self.free_group
        if group is not None:
            # Ownership is resolved now: a later action in this group may re-pair the slot.
            group.append(swa_indices)
        else:
            self._release_swa(swa_indices)

    def _expand_to_full_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        # Duplicates are kept on purpose: the paged free dedups, and dedup here would sync.
        page = self.page_size
        if page & (page - 1) == 0:
            # An arithmetic shift floors like the division (negative ids included), far cheaper.
            first_pages = free_index >> (page.bit_length() - 1)
        else:
            first_pages = torch.div(free_index, page, rounding_mode="floor")
        return torch.add(self._page_offsets, first_pages.unsqueeze(1), alpha=page).reshape(-1)

    def _release_swa(self, swa_indices: torch.Tensor) -> None:
        _report_drops(self._release_swa_unreported(swa_indices, checks_enabled()))

    def _release_swa_unreported(self, swa_indices: torch.Tensor, checks: bool) -> Report | None:
        """Free SWA ids of ours on the SWA side; returns its drop report (see `_report_drops`).

        Past a pool-bound breach the report is made here, before the bound check that crashes at
        STRICT, so that its drops are on record first (as an unfused free reports them).
        """
        side = self.swa_attn_allocator
        if self.page_size > 1:
            # HiCache load-back can leave unmapped slots inside a page. SGLang filters them out
            # once per group (a sync); the paged free skips them in place instead, fixed-shape,
            # ahead of the dedup it syncs for anyway: the same slots freed, counted, reported.
            report = side._free(swa_indices, owned=True, checks=checks, skip_nonpositive=True)
        else:
            report = side._free(swa_indices, owned=True, checks=checks)
        if side.available_size() > side.size:  # (it is never negative)
            _report_drops(report)
            report = None
            self._expect_within_bound(side)
        return report

    def free_full(self, free_index: torch.Tensor) -> None:
        """Release the full side only. The SWA peers must already be released."""
        if free_index.numel() == 0:
            return
        if free_index.dtype != torch.int64:
            free_index = free_index.to(torch.int64)
        # Checked at enqueue: a cache action later in this group may pair the slot again, and
        # that new peer is not this call's to judge.
        checks = checks_enabled()
        if checks:
            expect(
                SWA_PEER_RELEASED,
                torch.take(self.full_to_swa_index_mapping, free_index),
                "caller wants free",
                slots=free_index,
            )
        if self.free_group is None:
            _report_drops(self.full_attn_allocator._free(free_index, owned=False, checks=checks))
        else:
            # A copy: the caller may mutate its view before the group ends.
            self.full_free_group.append(free_index.clone())

    def free_group_begin(self) -> None:
        assert self.free_group is None, "free groups do not nest"
        self.free_group = []
        self.full_free_group = []

    def free_group_end(self) -> None:
        assert self.free_group is not None, "free_group_end without free_group_begin"
        swa_group, self.free_group = self.free_group, None
        checks = checks_enabled()
        swa_report = full_report = None
        if swa_group:
            swa_indices = swa_group[0] if len(swa_group) == 1 else torch.cat(swa_group)
            swa_report = self._release_swa_unreported(swa_indices, checks)
        if self.full_free_group:
            full_group, self.full_free_group = self.full_free_group, []
            full_indices = full_group[0] if len(full_group) == 1 else torch.cat(full_group)
            # Straight to the sub-allocator: the GUARD ran at enqueue, not again here. Its
            # entries are copies of ours (free_full clones them).
            full_report = self.full_attn_allocator._free(full_indices, owned=True, checks=checks)
        # One report for both sides, SWA first (the order of the frees).
        _report_drops(swa_report, full_report)
        self._expect_within_bound(self.full_attn_allocator)

    def _expect_within_bound(self, side: BaseTokenToKVPoolAllocator) -> None:
        # Host ints on both sides, so the host already knows the answer, and a passing value
        # never fires: only a breach pays for the (CPU scalar, sync-free) check.
        fraction = side.available_size() / side.size
        if not 0 <= fraction <= 1:
            # The count still includes the holes of bad frees the step's read-back has not
            # reported yet (as SGLang's page_size 1 free list would hold the duplicates); at
            # STRICT the crash path drains those drops' firings before this one's.
            expect(POOL_BOUND, torch.tensor(fraction), "available > size")

    # ---- snapshots -----------------------------------------------------------------------------

    def backup_state(self) -> SWAAllocatorState:
        """Snapshot both free lists, their bitmaps, and the mapping."""
        return SWAAllocatorState(
            self.full_attn_allocator.backup_state(),
            self.swa_attn_allocator.backup_state(),
            self.full_to_swa_index_mapping.clone(),
        )

    def restore_state(self, state: SWAAllocatorState) -> None:
        self.full_attn_allocator.restore_state(state.full)
        self.swa_attn_allocator.restore_state(state.swa)
        self.full_to_swa_index_mapping.copy_(state.mapping)

    def merge_and_sort_free(self) -> None:
        """Fold staged frees and drop holes on both sides (the idle tick, before its ledgers)."""
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    def drop_counts(self) -> dict[str, dict[str, int]]:
        return {"full": self.full_attn_allocator.drop_counts(), "swa": self.swa_attn_allocator.drop_counts()}

    def drop_counter(self) -> torch.Tensor:
        """Both sides' drop totals, `[full, swa]`, on the device: for the step's one read-back."""
        return torch.stack([self.full_attn_allocator.drop_counter(), self.swa_attn_allocator.drop_counter()])

    def note_drop_totals(self, totals: list[int]) -> None:
        """The host values of `drop_counter()`, read back with the step's sampled tokens."""
        full, swa = totals
        self.full_attn_allocator.note_drop_totals(full)
        self.swa_attn_allocator.note_drop_totals(swa)


class PureSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):
    """Allocator for a model whose every layer is sliding-window attention: one pool.

    The full side is the SWA side (one sub-allocator under both names) and the mapping is the
    identity, so it cannot be edited. `free_full` has nothing to release; `free` and `free_swa`
    release the slots themselves, dropping 0 entries. page_size 1 only, as in SGLang.
    """

    def __init__(
        self,
        size_swa: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float64,
        kvcache: Any = None,
        need_sort: bool = False,
    ) -> None:
        if page_size != 1:
            raise ValueError(f"PureSWATokenToKVPoolAllocator needs page_size 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.need_sort = need_sort
        self.size_full = self.size_swa = size_swa
        self.swa_attn_allocator = create_sub_allocator(
            size_swa, page_size, device, dtype=dtype, kvcache=getattr(kvcache, "swa_kv_pool", None),
            need_sort=need_sort,
        )
        self.full_attn_allocator = self.swa_attn_allocator
        mapping = torch.arange(size_swa + page_size + 1, dtype=torch.int64, device=self.device)
        mapping[-1] = -1
        self.full_to_swa_index_mapping = mapping
        self.free_group = None
        self.full_free_group = []
        self._kvcache = kvcache
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    def clear(self) -> None:
        self.swa_attn_allocator.clear()
        self.free_group = None

    def available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def full_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        return self.swa_attn_allocator._ready(max(num_full_pages, num_swa_pages))

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return kv_indices

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        raise NotImplementedError("PureSWATokenToKVPoolAllocator has no full-to-SWA mapping to rewrite")

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        raise NotImplementedError("PureSWATokenToKVPoolAllocator has no full-to-SWA mapping to clear")

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.swa_attn_allocator.alloc(need_size)

    def alloc_extend(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        raise NotImplementedError("PureSWATokenToKVPoolAllocator does not support page_size > 1")

    def alloc_decode(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        raise NotImplementedError("PureSWATokenToKVPoolAllocator does not support page_size > 1")

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            # SGLang's filter: an entry reading 0 names no slot (a data-dependent shape: a sync).
            self.swa_attn_allocator.free(free_index[free_index > 0])
        else:
            self.free_group.append(free_index.clone())
        self._expect_within_bound(self.swa_attn_allocator)

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.free(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        """Nothing to release: there is no full pool apart from the SWA one."""

    def free_group_begin(self) -> None:
        assert self.free_group is None, "free groups do not nest"
        self.free_group = []

    def free_group_end(self) -> None:
        assert self.free_group is not None, "free_group_end without free_group_begin"
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))

    def backup_state(self) -> SWAAllocatorState:
        state = self.swa_attn_allocator.backup_state()
        return SWAAllocatorState(state, state, self.full_to_swa_index_mapping.clone())

    def restore_state(self, state: SWAAllocatorState) -> None:
        self.swa_attn_allocator.restore_state(state.swa)

    def merge_and_sort_free(self) -> None:
        self.swa_attn_allocator.merge_and_sort_free()

    def drop_counts(self) -> dict[str, dict[str, int]]:
        counts = self.swa_attn_allocator.drop_counts()
        return {"full": counts, "swa": counts}

    def drop_counter(self) -> torch.Tensor:
        total = self.swa_attn_allocator.drop_counter()
        return torch.stack([total, total])

    def note_drop_totals(self, totals: list[int]) -> None:
        self.swa_attn_allocator.note_drop_totals(totals[1])
