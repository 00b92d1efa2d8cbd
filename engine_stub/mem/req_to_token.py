"""ReqToTokenPool: the request-row -> FULL-slot table that every attention read goes through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the FULL-pool slot of token `pos` of the request in `row`.

    Shape `(size + 1, max_context_len)`, int32, zero-initialised. Row 0 is padding (padded
    batches index it), so rows handed out are `1..size`.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if size < 1:
            raise ValueError(f"ReqToTokenPool size must be >= 1, got {size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=self.device)
        self.free_slots: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """A row for each request (SGLang's `alloc(reqs)`), or None and nothing taken.

        A request whose `row` is already set keeps it: that is only legal for one whose KV is
        committed (`kv_len > 0`, a continuation). The others take rows from the head of the free
        list, in order. Sets `req.row`; returns the rows in request order.
        """
        new = [req for req in reqs if not req.row]
        for req in reqs:
            if req.row:
                assert req.kv_len > 0, f"request {getattr(req, 'rid', '?')} holds row {req.row} with no KV"
        if len(new) > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[: len(new)], self.free_slots[len(new) :]
        for req, row in zip(new, rows, strict=True):
            req.row = row
        return [req.row for req in reqs]

    def free(self, req: Any) -> None:
        """Give a request's row back and clear `req.row` (SGLang's `free(req)`).

        Like SGLang there is no double-free guard beyond the idle ledger and this check that the
        request holds a row.
        """
        row = req.row
        if not 1 <= row <= self.size:
            raise ValueError(f"row {row} is not a request row (1..{self.size})")
        self.free_slots.append(row)
        req.row = 0

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """`req_to_token[row, start:start+len(slots)] = slots` (a tensor copy, no host scalar)."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))
        self.req_to_token.zero_()
