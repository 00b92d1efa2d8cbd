"""The `sglang` memory backend: SGLang's own `SWATokenToKVPoolAllocator`, from an installed
`sglang`, behind the interface the engine uses for ours.

The adapter maps the engine's calls onto the installed release's API (`alloc_extend` and
`alloc_decode` take device and CPU length tensors), hands SGLang a `BaseSWAKVPool` that only
forwards the mapping to our `HybridKVPool` (SGLang never touches K/V bytes here), and turns
SGLang's invariant signals into our firings: its counters (`name@rankN`, read with the step's
one device-to-host copy) and its crash messages (`invariant-check FAILED [name]: ...`).

Only this module imports `sglang`, and only when the backend is chosen. What SGLang lacks (it
drops no bad free: a double free is recycled) is SGLang's behaviour, reported as it is.

Releases (0.5.18, 0.5.19, 0.5.20, 0.5.23; one venv each, scripts/make-sglang-venv.sh --version).
The adapter detects each difference by capability, never by version string, and where a
release lacks a call the engine makes, does what that release's own code did at that point
(paths under sglang/srt/mem_cache/):

| engine call | 0.5.18 | 0.5.19 | 0.5.20, 0.5.23 |
| --- | --- | --- | --- |
| `free_full` | no such method: `impl.free` (1) | `free_full`, no check | `free_full`, `swa.peer_released` |
| `clear_full_to_swa_mapping` | no such method: zeros written into the mapping (2) | native | native |
| `free_swa` | a zero entry filtered out; in a group the mapping is read at group end | filtered, read at enqueue | `swa.peer_mapped` (page 1) |
| `free_group` | an empty list outside a group: read as None (3) | native | native |
| `backup_state` | none (4) | none | none |

(1) 0.5.18 frees a full side alone with `free`, relying on `free_swa`'s `> 0` filter of entries
    already zeroed: swa_radix_cache.py `SWARadixCache.evict`, `_iteratively_delete_tombstone_leaf`
    and `_insert_helper`'s tombstone branches; chunk_cache.py `ChunkCache.cache_finished_req`
    frees a finished row, window-evicted prefix included, the same way. A slot whose peer is
    still mapped therefore loses its peer too, where 0.5.19's `free_full` strands it and 0.5.20's
    counts `swa.peer_released`.
(2) As 0.5.18's swa_radix_cache.py `_recover_tombstone_keeping_locked_full` and allocator/swa.py
    `alloc_extend_swa_tail` clear entries: `full_to_swa_index_mapping[indices] = 0`.
(3) 0.5.18 marks a group with `is_not_in_free_group`; ours, 0.5.19's and later use None.
(4) No release's hybrid allocator has `backup_state`/`restore_state` (the engine never calls
    them on this backend); the adapter raises NotImplementedError rather than imitate one.

`alloc`, `alloc_extend`, `alloc_decode`, `new_pages_available`, `set_full_to_swa_mapping`,
`free`, `free_group_begin`/`end` and `merge_and_sort_free` are native in all four; the length
parameters of `alloc_extend`/`alloc_decode` are checked at construction. Pages (page_size > 1)
need a CUDA device before 0.5.23: allocator/paged.py `alloc_extend`/`alloc_decode` launch their
Triton kernels unconditionally (0.5.23 has `use_triton_kernels` and a torch path), so there the
adapter refuses a CPU device at construction instead of crashing at the first allocation.
Invariants: 0.5.18 and 0.5.19 register none of ours (no `swa.*`), so their counters read as
none; 0.5.20 and 0.5.23 register `swa.peer_mapped` and `swa.peer_released`.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import torch

__all__ = ["ReleaseUnsupported", "SGLangSWAAllocator", "sglang_version", "SGLANG_LEVEL_ENV", "sglang_crash_invariant"]


class ReleaseUnsupported(NotImplementedError):
    """This release cannot run this configuration here (e.g. paged allocation on a CPU before
    0.5.23): the engine refuses to start, saying why; reports show the cell as unsupported."""

SGLANG_LEVEL_ENV = "SGLANG_INVARIANT_CHECK"  # an integer there: 0 off, 1 warn, 2 strict
_LEVELS = {"off": 0, "warn": 1, "strict": 2}
_CRASH_RE = re.compile(r"invariant-check FAILED \[([^\]]+)\]")
# The length parameters the adapter passes, in order (every release from 0.5.18 to 0.5.23).
_EXTEND_PARAMS = ("prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc", "extend_num_tokens")
_DECODE_PARAMS = ("seq_lens", "seq_lens_cpu", "last_loc")


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
        for name, expected in (("alloc_extend", _EXTEND_PARAMS), ("alloc_decode", _DECODE_PARAMS)):
            params = tuple(inspect.signature(getattr(self.impl, name)).parameters)
            if params != expected:
                raise TypeError(f"SGLang {self.version}'s {name}{params} is not the {expected} this "
                                "adapter passes")
        if page_size > 1 and self.device.type != "cuda" and not hasattr(self.full_attn_allocator,
                                                                        "use_triton_kernels"):
            raise ReleaseUnsupported(
                f"SGLang {self.version}'s PagedTokenToKVPoolAllocator launches its Triton kernels "
                "(alloc_extend_kernel, alloc_decode_kernel) on every page allocation and has no "
                f"CPU path: page_size {page_size} needs a CUDA device with this release")
        # The release's own way to release a full side alone (module docstring, note 1).
        self._free_full = getattr(self.impl, "free_full", self.impl.free)

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
        """Unpair `full_indices` (0.5.18 has no method for it: the zeros its tree writes)."""
        if hasattr(self.impl, "clear_full_to_swa_mapping"):
            self.impl.clear_full_to_swa_mapping(full_indices)
        elif full_indices.numel():
            self.impl.full_to_swa_index_mapping[full_indices.to(torch.int64)] = 0

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
        """Release the full side of slots whose SWA peers are gone: the release's `free_full`, or
        on 0.5.18, which has none, its `free` (module docstring, note 1)."""
        self._bounded(self._free_full, free_index.to(torch.int64))

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
        """The open free group's pending frees, None outside a group (as ours)."""
        if getattr(self.impl, "is_not_in_free_group", False):  # 0.5.18 keeps [] outside a group
            return None
        return self.impl.free_group

    def merge_and_sort_free(self) -> None:
        for side in (self.full_attn_allocator, self.swa_attn_allocator):
            side.merge_and_sort_free()

    def backup_state(self) -> Any:
        """The release's allocator snapshot; none of 0.5.18-0.5.23 has one (NotImplementedError)."""
        return self._native("backup_state")()

    def restore_state(self, state: Any) -> None:
        """Restore a `backup_state` snapshot, where the release has one."""
        self._native("restore_state")(state)

    def _native(self, name: str) -> Any:
        call = getattr(self.impl, name, None)
        if call is None:
            raise NotImplementedError(f"SGLang {self.version}'s SWATokenToKVPoolAllocator has no {name}")
        return call

    # ---- what SGLang does not have -------------------------------------------------------------

    def drop_counts(self) -> dict[str, dict[str, int]]:
        """Always zero: no release from 0.5.18 to 0.5.23 drops a bad free. Their token and paged
        allocators keep no bitmap; a double free or a foreign id goes back on the free list."""
        zero = {"double_free": 0, "out_of_pool": 0, "reserved": 0}
        return {"full": dict(zero), "swa": dict(zero)}

    def drop_counter(self) -> torch.Tensor:
        return self._zero_drops

    def note_drop_totals(self, totals: list[int]) -> None:
        return None

    # ---- SGLang's invariant signals --------------------------------------------------------------

    @staticmethod
    def invariant_counters() -> tuple[list[str], torch.Tensor | None]:
        """SGLang's per-invariant hit counters (`name@rankN` keys, the rank dropped), on device;
        ([], None) while it has counted none of ours (0.5.18 and 0.5.19 register none)."""
        from sglang.srt.utils import invariants

        from engine_stub.detectors import detector_names

        # Only the invariants of the allocator built here: SGLang registers others (e.g.
        # unified_swa.*) for allocators this engine never builds.
        ours = set(detector_names())
        counters = getattr(getattr(invariants, "_reporter", None), "_dev", {})
        kept = [(key.split("@", 1)[0], t) for key, t in counters.items() if key.split("@", 1)[0] in ours]
        if not kept:
            return [], None
        return [name for name, _ in kept], torch.cat([t.reshape(1) for _, t in kept])

    @staticmethod
    def invariant_bucket(name: str) -> str | None:
        """SGLang's bucket of `name` as our bucket's name (e.g. GUARD), or None if unknown."""
        from sglang.srt.utils import invariants

        inv = invariants.registered_invariants().get(name)
        return inv.bucket.name if inv is not None else None
