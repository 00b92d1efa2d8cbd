"""SchedulerView: the `EngineView` of a running scheduler, the only engine state kinds touch.

Built by the perturber on its first hook call (so an engine with no scenario never builds one).
It reaches the scheduler's pools by attribute, without importing the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine_stub.perturb.sites import ReqState

if TYPE_CHECKING:
    from engine_stub.scheduler import Scheduler

__all__ = ["SchedulerView", "TableView"]


class TableView:
    """The request-row and mapping half of an `EngineView`, over whatever table and mapping
    `_table()` and `_mapping()` name (our scheduler's, or SGLang's in its own process)."""

    def _table(self) -> torch.Tensor:
        raise NotImplementedError

    def _mapping(self) -> torch.Tensor:
        raise NotImplementedError

    def slots(self, req: ReqState, positions: Sequence[int]) -> torch.Tensor:
        return self._table()[req.row, list(positions)].to(torch.int64)

    def slot_range(self, req: ReqState, lo: int, hi: int) -> torch.Tensor:
        return self._table()[req.row, lo:hi].to(torch.int64)

    def set_slot(self, req: ReqState, position: int, slot: int) -> None:
        self._table()[req.row, position] = slot

    def swa_rows(self, slots: Sequence[int]) -> list[int]:
        index = torch.as_tensor(list(slots), dtype=torch.int64, device=self._mapping().device)
        return [int(v) for v in self._mapping()[index].tolist()]

    def set_swa_rows(self, slots: Sequence[int], rows: Sequence[int]) -> None:
        mapping = self._mapping()
        index = torch.as_tensor(list(slots), dtype=torch.int64, device=mapping.device)
        mapping[index] = torch.as_tensor(list(rows), dtype=mapping.dtype, device=mapping.device)


class SchedulerView(TableView):
    """`EngineView` over `sched` (see perturb/contract.py for each method's contract)."""

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self.window = sched.window
        self.page_size = sched.page_size
        self.has_radix_cache = sched.tree_cache is not None

    def running(self) -> list[ReqState]:
        chunked = self._sched.chunked_req  # prefilled in chunks: it holds KV and a row too
        reqs = self._sched.running if chunked is None else [chunked, *self._sched.running]
        return sorted((ReqState.of(r) for r in reqs if r.kv_len > 0), key=lambda r: r.rid)

    def _table(self) -> torch.Tensor:
        return self._sched.req_to_token_pool.req_to_token

    def _mapping(self) -> torch.Tensor:
        return self._sched.allocator.full_to_swa_index_mapping

    def free_full_slot(self) -> int | None:
        full = self._sched.allocator.full_attn_allocator
        full.merge_and_sort_free()
        if full.free_pages.numel() == 0:
            return None
        return int(full.free_pages[0]) * self.page_size

    def kv_bytes(self, group: str, pool_row: int) -> tuple[int, torch.Tensor] | None:
        kv_pool = self._sched.kv_pool
        layers = kv_pool.group_layers(group == "swa")
        if not layers:
            return None
        return layers[0], kv_pool.k_buffer[layers[0]][pool_row].view(-1).view(torch.uint8)

    def radix_held_slots(self) -> list[int]:
        tree = self._sched.tree_cache
        if tree is None:
            return []
        return [int(s) for s in tree.held_slots().reshape(-1).tolist()]
