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
  and `free_group_end` frees the full indices on the full sub-allocator directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_stub.invariants import (
    Bucket,
    InClosedRange,
    Invariant,
    IsZero,
    Positive,
    checks_enabled,
    expect,
)
from engine_stub.mem.allocator import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    create_sub_allocator,
    num_new_pages,
)

__all__ = ["SWATokenToKVPoolAllocator", "SWAAllocatorState"]

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
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if size_swa > size:
            raise ValueError(f"size_swa={size_swa} must not exceed the full size={size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.size_full = size
        self.size_swa = size_swa
        self.full_attn_allocator: BaseTokenToKVPoolAllocator = create_sub_allocator(size, page_size, device)
        self.swa_attn_allocator: BaseTokenToKVPoolAllocator = create_sub_allocator(
            size_swa, page_size, device
        )
        # Held by identity by whoever translates slots (the KV pool, the canary): mutate in place.
        self.full_to_swa_index_mapping = torch.zeros(
            size + page_size + 1, dtype=torch.int64, device=self.device
        )
        self.full_to_swa_index_mapping[-1] = -1
        self.free_group: list[torch.Tensor] | None = None
        self.full_free_group: list[torch.Tensor] = []
        # Debug switch (like SGLANG_DEBUG_REVERT_PR): the pre-PR-36723 silent filter, no checks.
        self.revert_pr_36723 = False

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
        self.full_to_swa_index_mapping.index_copy_(
            0, full_indices.to(torch.int64), swa_indices.to(torch.int64)
        )

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        # index_fill_, not `mapping[idx] = 0`: assigning a host scalar is a blocking H2D copy.
        self.full_to_swa_index_mapping.index_fill_(0, full_indices.to(torch.int64), 0)

    # ---- alloc -------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots on both sides, or None with nothing taken. Returns FULL indices."""
        if not self._both_sides_have(-(-need_size // self.page_size)):
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
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
        if not self._both_sides_have(num_new_pages(prefix_lens, seq_lens, self.page_size)):
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
        if not self._both_sides_have(sum((seq - 1) % self.page_size == 0 for seq in seq_lens)):
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

    def _both_sides_have(self, need_pages: int) -> bool:
        """Whether both sub-allocators can hand out `need_pages` pages, decided before either does.

        `available_size` also counts staged frees, and a bad free staged there is dropped at the
        merge, so it can promise more than a side holds. When a side's merged free list alone
        falls short, fold its staged frees first (the merge its own alloc would run anyway):
        then the answer is exact, and no side can fail after the other took its pages. Undoing
        a half-done extend would be wrong: its slots include the prefix's partial page.
        """
        for side in (self.full_attn_allocator, self.swa_attn_allocator):
            if need_pages * self.page_size > side.available_size():  # an upper bound: no merge helps
                return False
            if need_pages > side.free_pages.numel():
                side.merge_and_sort_free()
                if need_pages > side.free_pages.numel():
                    return False
        return True

    def _pair(self, full: torch.Tensor | None, swa: torch.Tensor | None) -> torch.Tensor:
        assert full is not None and swa is not None, "a side failed after _both_sides_have"
        self.set_full_to_swa_mapping(full, swa)
        return full

    # ---- free --------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Release both sides of FULL slots. Not idempotent: the SWA side reads the mapping."""
        if free_index.numel() == 0:
            return
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Release the SWA peers of FULL slots and zero their mapping entries."""
        if free_index.numel() == 0:
            return
        if free_index.dtype != torch.int64:
            free_index = free_index.to(torch.int64)
        mapping_indices = free_index if self.page_size == 1 else self._expand_to_full_pages(free_index)
        swa_indices = self.full_to_swa_index_mapping[mapping_indices]
        if self.page_size == 1 and not self.revert_pr_36723:
            # No `> 0` filter here: its data-dependent shape would cost a device-to-host sync.
            expect(SWA_PEER_MAPPED, swa_indices, "caller wants free_full", slots=free_index)
        # index_fill_, not `mapping[idx] = 0`: assigning a host scalar is a blocking H2D copy.
        self.full_to_swa_index_mapping.index_fill_(0, mapping_indices, 0)
        if self.free_group is not None:
            # Ownership is resolved now: a later action in this group may re-pair the slot.
            self.free_group.append(swa_indices)
        else:
            self._release_swa(swa_indices)

    def _expand_to_full_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        # Duplicates are kept on purpose: the paged free dedups, and dedup here would sync.
        page = self.page_size
        first_slots = torch.div(free_index, page, rounding_mode="floor") * page
        offsets = torch.arange(page, dtype=torch.int64, device=self.device)
        return (first_slots[:, None] + offsets).reshape(-1)

    def _release_swa(self, swa_indices: torch.Tensor) -> None:
        if self.page_size > 1 or self.revert_pr_36723:
            # HiCache load-back can leave unmapped slots inside a page; one filter per group.
            swa_indices = swa_indices[swa_indices > 0]
        self.swa_attn_allocator.free(swa_indices)
        self._expect_within_bound(self.swa_attn_allocator)

    def free_full(self, free_index: torch.Tensor) -> None:
        """Release the full side only. The SWA peers must already be released."""
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64)
        # Checked at enqueue: a cache action later in this group may pair the slot again, and
        # that new peer is not this call's to judge.
        if not self.revert_pr_36723 and checks_enabled():
            expect(
                SWA_PEER_RELEASED,
                self.full_to_swa_index_mapping[free_index],
                "caller wants free",
                slots=free_index,
            )
        if self.free_group is None:
            self.full_attn_allocator.free(free_index)
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
        if swa_group:
            self._release_swa(torch.cat(swa_group))
        if self.full_free_group:
            full_group, self.full_free_group = self.full_free_group, []
            # Straight to the sub-allocator: the GUARD ran at enqueue, not again here.
            self.full_attn_allocator.free(torch.cat(full_group))
        self._expect_within_bound(self.full_attn_allocator)

    def _expect_within_bound(self, side: BaseTokenToKVPoolAllocator) -> None:
        # Host ints on both sides, so the host already knows the answer, and a passing value
        # never fires: only a breach pays for the (CPU scalar, sync-free) check.
        fraction = side.available_size() / side.size
        if not 0 <= fraction <= 1:
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
        """Fold staged frees on both sides (the idle tick calls this before its ledgers)."""
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    def drop_counts(self) -> dict[str, dict[str, int]]:
        return {"full": self.full_attn_allocator.drop_counts(), "swa": self.swa_attn_allocator.drop_counts()}
