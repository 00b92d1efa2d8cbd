"""The `sglang` memory backend: SGLang's own `SWATokenToKVPoolAllocator`, from an installed
`sglang`, behind the interface the engine uses for ours.

The adapter maps the engine's calls onto the installed version's API (0.5.23: `alloc_extend` and
`alloc_decode` take device and CPU length tensors), hands SGLang a `BaseSWAKVPool` that only
forwards the mapping to our `HybridKVPool` (SGLang never touches K/V bytes here), and turns
SGLang's invariant signals into our firings: its counters (`name@rankN`, read with the step's
one device-to-host copy) and its crash messages (`invariant-check FAILED [name]: ...`).

Only this module imports `sglang`, and only when the backend is chosen. What SGLang lacks (it
drops no bad free: a double free is recycled) is SGLang's behaviour, reported as it is.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = ["SGLangSWAAllocator", "sglang_version", "SGLANG_LEVEL_ENV", "sglang_crash_invariant"]

SGLANG_LEVEL_ENV = "SGLANG_INVARIANT_CHECK"  # an integer there: 0 off, 1 warn, 2 strict
_LEVELS = {"off": 0, "warn": 1, "strict": 2}
_CRASH_RE = re.compile(r"invariant-check FAILED \[([^\]]+)\]")


def sglang_version() -> str | None:
    """The installed sglang's version, or None where it does not import."""
    try:
        import sglang
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    return str(getattr(sglang, "__version__", "unknown"))


def sglang_crash_invariant(exc: BaseException) -> str | None:
    """The invariant an SGLang async-assert failure names (its message), else None."""
    match = _CRASH_RE.search(str(exc))
    return match.group(1) if match else None


def set_sglang_level(level: str) -> None:
    """Set SGLang's invariant level (it re-reads the variable on every `expect`)."""
    os.environ[SGLANG_LEVEL_ENV] = str(_LEVELS[level])


def set_level_from() -> None:
    """SGLang's level follows ours (the engine's `invariant_check`, in force by now)."""
    from engine_stub.invariants import resolve_level

    set_sglang_level(resolve_level().name.lower())


def _mapping_pool_class():
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

    class MappingOnlySWAKVPool(BaseSWAKVPool):
        """SGLang's view of our pools: the mapping, forwarded to `target`; no K/V of its own."""

        swa_req_ring_size = None

        def __init__(self, target: Any, page_size: int) -> None:  # no super(): no buffers
            self.target = target
            self.page_size = page_size
            self.full_to_swa_index_mapping = None
            self.full_kv_pool = None
            self.swa_kv_pool = None

        def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = full_to_swa_index_mapping
            if self.target is not None:
                self.target.register_mapping(full_to_swa_index_mapping)

        def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
            return self.full_to_swa_index_mapping[kv_indices.to(torch.int64)]

        def get_key_buffer(self, layer_id: int) -> torch.Tensor:
            raise NotImplementedError("the engine keeps K/V in its own pool")

        def get_value_buffer(self, layer_id: int) -> torch.Tensor:
            raise NotImplementedError("the engine keeps K/V in its own pool")

        def get_kv_buffer(self, layer_id: int):
            raise NotImplementedError("the engine keeps K/V in its own pool")

        def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("the engine keeps K/V in its own pool")

        def get_state_buf_infos(self):
            return [], [], []

    return MappingOnlySWAKVPool


class SGLangSWAAllocator:
    """SGLang's hybrid allocator with the engine's allocator interface.

    Args: as `engine_stub.mem.swa.SWATokenToKVPoolAllocator`; `kvcache` is our HybridKVPool (it
    receives the mapping), `need_sort` is passed to SGLang.
    """

    backend = "sglang"

    def __init__(self, size: int, size_swa: int, page_size: int = 1, device: torch.device | str = "cpu",
                 *, dtype: torch.dtype = torch.float64, kvcache: Any = None, need_sort: bool = False) -> None:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator as SGLangAllocator

        self.version = sglang_version()
        self.page_size = page_size
        self.device = torch.device(device)
        pool = _mapping_pool_class()(kvcache, page_size)
        self.impl = SGLangAllocator(size, size_swa, page_size, dtype, str(self.device), pool, need_sort)
        self.full_to_swa_index_mapping = self.impl.full_to_swa_index_mapping
        self.full_attn_allocator = self.impl.full_attn_allocator
        self.swa_attn_allocator = self.impl.swa_attn_allocator
        self._zero_drops = torch.zeros(2, dtype=torch.int64, device=self.device)

    # ---- sizes and mapping ---------------------------------------------------------------------

    @property
    def size_full(self) -> int:
        return int(self.impl.size_full)

    @property
    def size_swa(self) -> int:
        return int(self.impl.size_swa)

    @property
    def size(self) -> int:
        return min(self.size_full, self.size_swa)

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return int(self.impl.full_available_size())

    def swa_available_size(self) -> int:
        return int(self.impl.swa_available_size())

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[kv_indices.to(torch.int64)]

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        self.impl.set_full_to_swa_mapping(full_indices, swa_indices)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        self.impl.clear_full_to_swa_mapping(full_indices)

    # ---- alloc ---------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.impl.alloc(need_size)

    def _lengths(self, values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cpu = torch.tensor(values, dtype=torch.int64)
        return cpu.to(self.device), cpu

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: torch.Tensor,
                     extend_num_tokens: int) -> torch.Tensor | None:
        prefix, prefix_cpu = self._lengths(prefix_lens)
        seq, seq_cpu = self._lengths(seq_lens)
        return self.impl.alloc_extend(prefix, prefix_cpu, seq, seq_cpu, last_loc.to(torch.int64),
                                      extend_num_tokens)

    def alloc_decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        seq, seq_cpu = self._lengths(seq_lens)
        return self.impl.alloc_decode(seq, seq_cpu, last_loc.to(torch.int64))

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        return bool(self.impl.new_pages_available(num_full_pages, num_swa_pages))

    # ---- free ----------------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        self._bounded(self.impl.free, free_index.to(torch.int64))

    def free_swa(self, free_index: torch.Tensor) -> None:
        self._bounded(self.impl.free_swa, free_index.to(torch.int64))

    def free_full(self, free_index: torch.Tensor) -> None:
        self._bounded(self.impl.free_full, free_index.to(torch.int64))

    def free_group_begin(self) -> None:
        self.impl.free_group_begin()

    def free_group_end(self) -> None:
        self._bounded(self.impl.free_group_end)

    def _bounded(self, call: Any, *args: Any) -> None:
        """Run an SGLang free; its `available_size() <= size` assert becomes our pool bound.

        SGLang checks the bound with a plain `assert`, which crashes at any level; it stays a
        crash, recorded as the firing of the detector that means the same (`alloc.pool_bound`).
        """
        try:
            call(*args)
        except AssertionError:
            sides = (self.full_attn_allocator, self.swa_attn_allocator)
            breached = [side for side in sides if side.available_size() > side.size]
            if not breached:
                raise
            from engine_stub.invariants import InvariantCheckLevel, expect, override_level
            from engine_stub.mem.swa import POOL_BOUND

            side = breached[0]
            with override_level(InvariantCheckLevel.STRICT):
                expect(POOL_BOUND, torch.tensor(side.available_size() / side.size),
                       "SGLang's free: available > size")
            raise

    @property
    def free_group(self) -> Any:
        return self.impl.free_group

    def merge_and_sort_free(self) -> None:
        for side in (self.full_attn_allocator, self.swa_attn_allocator):
            side.merge_and_sort_free()

    def backup_state(self) -> Any:
        return self.impl.backup_state()

    def restore_state(self, state: Any) -> None:
        self.impl.restore_state(state)

    # ---- what SGLang does not have -------------------------------------------------------------

    def drop_counts(self) -> dict[str, dict[str, int]]:
        """SGLang 0.5.23 drops no bad free (it recycles them): nothing is ever counted."""
        zero = {"double_free": 0, "out_of_pool": 0, "reserved": 0}
        return {"full": dict(zero), "swa": dict(zero)}

    def drop_counter(self) -> torch.Tensor:
        return self._zero_drops

    def note_drop_totals(self, totals: list[int]) -> None:
        return None

    # ---- SGLang's invariant signals --------------------------------------------------------------

    @staticmethod
    def invariant_counters() -> tuple[list[str], torch.Tensor | None]:
        """SGLang's per-invariant hit counters (`name@rankN` keys, the rank dropped), on device."""
        from sglang.srt.utils import invariants

        from engine_stub.detectors import detector_names

        # Only the invariants of the allocator built here: SGLang registers others (e.g.
        # unified_swa.*) for allocators this engine never builds.
        ours = set(detector_names())
        kept = [(key.split("@", 1)[0], t) for key, t in invariants._reporter._dev.items()
                if key.split("@", 1)[0] in ours]
        if not kept:
            return [], None
        return [name for name, _ in kept], torch.cat([t.reshape(1) for _, t in kept])

    @staticmethod
    def invariant_bucket(name: str) -> str | None:
        """SGLang's bucket of `name` as our bucket's name (e.g. GUARD), or None if unknown."""
        from sglang.srt.utils import invariants

        inv = invariants.registered_invariants().get(name)
        return inv.bucket.name if inv is not None else None
