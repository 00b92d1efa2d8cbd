"""CUDA-only checks (skipped without a device): PR #36723's sync-freedom, with the real detector.

Each test first proves that `torch.cuda.set_sync_debug_mode("error")` flags the pre-fix form, so
a detector blind to that sync class cannot make it pass.
"""

from __future__ import annotations

import pytest
import torch

from engine_stub.invariants import InvariantCheckLevel, override_level
from engine_stub.mem import SWATokenToKVPoolAllocator
from engine_stub.synccheck import set_cuda_sync_debug_mode

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sync_error(fn) -> RuntimeError | None:
    """The RuntimeError torch raises if `fn` synchronizes the device, or None."""
    torch.cuda.synchronize()
    try:
        set_cuda_sync_debug_mode("error")
        fn()
    except RuntimeError as exc:
        return exc
    finally:
        set_cuda_sync_debug_mode("default")
        torch.cuda.synchronize()
    return None


def _allocator() -> SWATokenToKVPoolAllocator:
    allocator = SWATokenToKVPoolAllocator(256, 128, 1, "cuda")
    # Warm up outside the window: a first cudaMalloc can synchronize on its own.
    allocator.free(allocator.alloc(4))
    return allocator


@pytest.mark.parametrize("level", ["off", "strict"])
def test_free_swa_does_not_synchronize(level: str) -> None:
    allocator = _allocator()
    indices = allocator.alloc(8)
    peers = allocator.full_to_swa_index_mapping[indices]
    assert _sync_error(lambda: peers[peers > 0]) is not None, "the detector must flag the old filter"
    with override_level(InvariantCheckLevel.parse(level)):
        assert _sync_error(lambda: allocator.free_swa(indices)) is None


def test_clearing_the_mapping_does_not_synchronize() -> None:
    allocator = _allocator()
    indices = allocator.alloc(8)
    mapping = allocator.full_to_swa_index_mapping
    if _sync_error(lambda: mapping.__setitem__(indices, 0)) is None:
        pytest.skip("sync debug mode does not flag a host-scalar assignment here")
    assert _sync_error(lambda: allocator.clear_full_to_swa_mapping(indices)) is None
