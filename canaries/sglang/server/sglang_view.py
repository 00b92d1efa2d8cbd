"""The project's perturbation kinds on SGLang's own objects, inside its scheduler process.

`SGLangView` is the kinds' `EngineView` (engine_stub/perturb/contract.py) over SGLang 0.5.23's
`Scheduler`: its running batch and chunked request, its `req_to_token` table, the hybrid
allocator's `full_to_swa_index_mapping` and free pages, and the `SWAKVPool`'s K buffers.
`SchedulerFacade` is what the engine's `Perturber` reads of a scheduler (step, window, running
requests, the stats its trigger events come from, the event log), so the same triggers, targets
and kinds run unchanged; their landings are the project's landing events, with their damage.

The attributes read here are 0.5.23's (`req.kv`, `ReqKvInfo`), and 0.5.22's are the same names
(its `ReqKvInfo`, allocator and pools differ only in fields the view does not read); a release
without `ReqKvInfo` is refused before it runs (`release_sites`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from canaries.sglang.server.site_hooks import req_state as _state
from engine_stub.perturb.sites import ReqState
from engine_stub.perturb.view import TableView

__all__ = ["SGLangView", "SchedulerFacade"]


def _reqs(scheduler: Any) -> list[Any]:
    batch = getattr(scheduler, "running_batch", None)
    reqs = list(getattr(batch, "reqs", None) or [])
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None and chunked not in reqs:
        reqs.insert(0, chunked)
    return [r for r in reqs if getattr(r.kv, "req_pool_idx", None) is not None]


class SGLangView(TableView):
    """`EngineView` over SGLang's scheduler (see perturb/contract.py for each method's contract)."""

    def __init__(self, scheduler: Any, window: int, page_size: int) -> None:
        self._scheduler = scheduler
        self.window = window
        self.page_size = page_size
        self.has_radix_cache = not getattr(scheduler.server_args, "disable_radix_cache", False)

    def running(self) -> list[ReqState]:
        return sorted((state for state in map(_state, _reqs(self._scheduler)) if state.kv_len > 0),
                      key=lambda r: r.rid)

    def _table(self) -> torch.Tensor:
        return self._scheduler.req_to_token_pool.req_to_token

    def _allocator(self) -> Any:
        return self._scheduler.token_to_kv_pool_allocator

    def _mapping(self) -> torch.Tensor:
        return self._allocator().full_to_swa_index_mapping

    def free_full_slot(self) -> int | None:
        full = self._allocator().full_attn_allocator
        pages = torch.cat([full.free_pages, full.release_pages])
        if pages.numel() == 0:
            return None
        return int(pages.min()) * self.page_size

    def kv_bytes(self, group: str, pool_row: int) -> tuple[int, torch.Tensor] | None:
        kvcache = self._allocator().get_kvcache()
        pool = kvcache.swa_kv_pool if group == "swa" else kvcache.full_kv_pool
        if not pool.k_buffer:
            return None
        return 0, pool.k_buffer[0][pool_row].view(-1).view(torch.uint8)

    def radix_held_slots(self) -> list[int]:
        tree_cache = getattr(self._scheduler, "tree_cache", None)
        core = getattr(tree_cache, "tree_core", None)
        if not self.has_radix_cache or core is None:
            return []
        # The tree core's own flat walk (its KV canary's sweep reads the same): 0.5.23's default
        # core is Rust-backed and has no Python nodes to walk (`root_node` raises there).
        walk = core.walk_for_kv_canary(unlocked_only=False, swa_resident_only=False)
        return sorted(int(v) for v in walk.slot_indices.tolist())


class _Events:
    def __init__(self, write: Callable[[dict], None], step: Callable[[], int]) -> None:
        self._write = write
        self._step = step

    def write(self, kind: str, durable: bool = False, **fields: Any) -> None:
        self._write({"kind": kind, "step": self._step(), **fields})


class SchedulerFacade:
    """What the engine's `Perturber` reads of a scheduler, from SGLang's."""

    def __init__(self, scheduler: Any, window: int, page_size: int, write: Callable[[dict], None]) -> None:
        self._scheduler = scheduler
        self.window = window
        self.page_size = page_size
        self.events = _Events(write, lambda: self.step_no)
        self.finished_requests = 0
        self._seen = {"swa_evicted_tokens": 0, "cached_tokens": 0, "prefill_chunks": 0}

    @property
    def step_no(self) -> int:
        return int(self._scheduler.forward_ct)

    @property
    def running(self) -> list[ReqState]:
        return [_state(r) for r in _reqs(self._scheduler)]

    @property
    def stats(self) -> dict[str, int]:
        reqs = _reqs(self._scheduler)
        seen = self._seen
        seen["swa_evicted_tokens"] = max(seen["swa_evicted_tokens"], sum(r.kv.max_evicted_seqlen for r in reqs))
        seen["cached_tokens"] = max(seen["cached_tokens"], sum(int(getattr(r, "cached_tokens", 0) or 0) for r in reqs))
        if getattr(self._scheduler, "chunked_req", None) is not None:
            seen["prefill_chunks"] += 1
        return {**seen, "finished_requests": self.finished_requests}
