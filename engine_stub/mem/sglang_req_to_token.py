"""The `memory: sglang` request-row table: SGLang's own `ReqToTokenPool`, from an installed
`sglang`, behind the interface of ours (`engine_stub.mem.req_to_token.ReqToTokenPool`).

SGLang's pool binds rows to its own request objects: 0.5.18 reads and sets `req.req_pool_idx`
and, for a request that keeps its row, checks `inflight_middle_chunks` / `kv_committed_len`;
0.5.19 to 0.5.23 read `req.kv.holds_kv` and `req.kv.kv_allocated_len` and set
`req.kv.req_pool_idx` (`memory_pool.py: ReqToTokenPool.alloc/free`). The adapter hands it a
`_RowRequest` that carries both spellings, made from our `Req` (`row`, 0 for none; `kv_len`),
and copies the row back. The constructor `(size, max_context_len, device,
enable_memory_saver)` is the same in every release. What SGLang does differently is SGLang's
behaviour, kept: rows are popped from the tail of the free list (the first request gets row
`size`), `free` of a row it never handed out is accepted (only the idle ledger sees it), and
`clear` leaves the table's contents alone.

Only this module (and the tree beside it) imports `sglang`, and only when the backend is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SGLangReqToTokenPool"]


@dataclass
class _RowKv:
    """The part of SGLang's `ReqKvInfo` its `ReqToTokenPool` reads (0.5.19 to 0.5.23)."""

    req_pool_idx: int | None
    kv_allocated_len: int

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None


class _RowRequest:
    """What SGLang's `ReqToTokenPool.alloc/free` read of a request, in every release's spelling."""

    def __init__(self, row: int, kv_len: int) -> None:
        self.kv = _RowKv(row or None, kv_len)
        # 0.5.18's reuse check: a request keeping its row is a chunked one or has committed KV.
        self.inflight_middle_chunks = 0
        self.kv_committed_len = kv_len

    @property
    def req_pool_idx(self) -> int | None:  # 0.5.18's spelling
        return self.kv.req_pool_idx

    @req_pool_idx.setter
    def req_pool_idx(self, value: int | None) -> None:
        self.kv.req_pool_idx = value


class SGLangReqToTokenPool:
    """SGLang's `ReqToTokenPool` with our pool's interface: `alloc(reqs)`, `free(req)`,
    `write(row, start, slots)`, `available_size()`, `clear()`, the `req_to_token` table
    (SGLang's tensor: `(size + 1, max_context_len)` int32, row 0 padding) and `impl` (SGLang's
    pool itself, for the tree's `CacheInitParams`)."""

    backend = "sglang"

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size and max_context_len >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.impl = ReqToTokenPool(size, max_context_len, str(self.device), False)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.impl.req_to_token

    def available_size(self) -> int:
        return int(self.impl.available_size())

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """A row for each request (SGLang's `alloc`), or None and nothing taken. A request whose
        `row` is set keeps it (SGLang checks it has KV). Sets `req.row`; returns the rows."""
        shims = [_RowRequest(req.row, req.kv_len) for req in reqs]
        rows = self.impl.alloc(shims)
        if rows is None:
            return None
        for req, shim in zip(reqs, shims, strict=True):
            req.row = int(shim.kv.req_pool_idx)
        return [req.row for req in reqs]

    def free(self, req: Any) -> None:
        """Give a request's row back and clear `req.row` (SGLang's `free(req)`).

        Raises:
            ValueError: the request holds no row (SGLang's own assert, at our boundary).
        """
        if not req.row:
            raise ValueError(f"request {getattr(req, 'rid', '?')} holds no row to free")
        self.impl.free(_RowRequest(req.row, req.kv_len))
        req.row = 0

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """`req_to_token[row, start:start+len(slots)] = slots`, through SGLang's `write`."""
        self.impl.write((row, slice(start, start + slots.numel())), slots.to(torch.int32))

    def clear(self) -> None:
        self.impl.clear()
