"""The functions SGLang's server calls on a CPU that no installable package provides here.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports two CPU ops from `sgl_kernel` at start-up
(`mem_cache/allocation.py`, `kernels/ops/kvcache/cache_move.py`). Their only build lives in
SGLang's source tree (`sgl-kernel/csrc/cpu`); the `sgl-kernel` wheels on the index are CUDA-only.
This module provides both, written in plain torch from what SGLang's own Triton kernels of the
same names do, and `install()` puts them in a `sgl_kernel` module where none is importable. It is
loaded only into an SGLang process on a CPU (the plugin's `sitecustomize`), never on a GPU runner.

`assign_req_to_token_pool_cpu` is on the memory path under test (it writes each request's new
slots into its `req_to_token` row): it must do exactly what SGLang's kernel does, and
tests/test_server_standins.py checks it against SGLang's Triton kernel run in Triton's
interpreter.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import types

import torch

__all__ = ["SPECULATIVE_ONLY", "assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", "install",
           "translate_swa_reads"]

# Imported from sgl_kernel at start-up by SGLang's speculative-decoding modules
# (kernels/ops/speculative/{cache_locs,eagle,multi_layer_eagle,spec_tree}.py in 0.5.23) and called
# only with speculative decoding on, which the suite never enables: each stands in as a function
# that refuses to run.
SPECULATIVE_ONLY = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: `req_to_token[req_pool_indices[i], start[i]:end[i]]` takes the next
    `end[i] - start[i]` entries of `out_cache_loc`, the requests' slices laid end to end in batch
    order (SGLang's `assign_req_to_token_pool` kernel; `pool_len` is the row length it strides by)."""
    assert req_to_token.shape[1] == pool_len, "pool_len is req_to_token's row length"
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start  # the kernel copies nothing for a span <= 0
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += end - start  # as the kernel sums them, a negative span included


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every layer buffer (a base address in `data_ptrs`, a row stride in bytes in
    `strides`): row `tgt_loc[j]` takes a copy of row `src_loc[j]` (SGLang's
    `copy_all_layer_kv_cache_tiled` kernel, which reads every source row before it writes)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + src * stride, stride) for _, src in pairs]
        for (tgt, _), row in zip(pairs, rows, strict=True):
            ctypes.memmove(base + tgt * stride, row, stride)


class _DeviceTolerantCpuStream(torch.cpu.Stream):
    """SGLang's `create_device_stream` (utils/common.py) builds `Stream(device=...)` for any
    device, and the KV canary asks for one; torch's CPU stream takes only `priority`."""

    def __init__(self, device: object = None, priority: int = -1) -> None:
        super().__init__(priority=priority)
        self.device = torch.device("cpu")


def _unpinned(factory):
    """`factory` with `pin_memory=True` dropped: the KV canary allocates its host buffers pinned
    (kv_canary/req_to_expected_token_ids_manager.py, runner/future_tensor.py), which torch refuses
    without an accelerator; with none, page-locking has nothing to speed up."""

    def build(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    build.__name__ = factory.__name__
    build.__doc__ = factory.__doc__
    return build


PINNED_FACTORIES = ("empty", "zeros", "ones", "full", "tensor")


def install() -> None:
    """Provide `sgl_kernel`'s CPU ops where no `sgl_kernel` is importable, a CPU stream that takes
    a device, unpinned host buffers where torch has no accelerator, the torch_native attention
    backend's SWA reads through the mapping (`translate_swa_reads`), the KV canary's verify over
    all slots at once (`canary_verify`), its plan and write over lists (`canary_plan`, `canary_write`) and its phase check on the host (`phase_check`) once
    SGLang imports them (idempotent)."""
    if not isinstance(torch.cpu.Stream, type) or not issubclass(torch.cpu.Stream, _DeviceTolerantCpuStream):
        torch.cpu.Stream = _DeviceTolerantCpuStream
    if not torch.cuda.is_available():
        for name in PINNED_FACTORIES:
            factory = getattr(torch, name)
            if getattr(factory, "__wrapped_unpinned__", False):
                continue
            wrapped = _unpinned(factory)
            wrapped.__wrapped_unpinned__ = True
            setattr(torch, name, wrapped)
    from canaries.sglang.server.import_hooks import after_import

    after_import("sglang.srt.layers.attention.torch_native_backend",
                 lambda module: translate_swa_reads(module.TorchNativeAttnBackend))
    # SGLang's KV-canary verify on a CPU, over all slots at once (byte for byte its reference's).
    from canaries.sglang.server import canary_verify

    after_import("sglang.kernels.ops.kv_canary.verify_ref", canary_verify.install)
    from canaries.sglang.server import canary_write

    def install_write(module: types.ModuleType) -> None:  # one hook a module: both, in this order
        canary_verify.install_write(module)
        canary_write.install(module)

    after_import("sglang.kernels.ops.kv_canary.write_ref", install_write)
    from canaries.sglang.server import canary_plan

    after_import("sglang.kernels.ops.kv_canary.plan_ref", canary_plan.install)
    # Its phase checker's one-program kernel on the host, not in Triton's interpreter.
    from canaries.sglang.server import phase_check

    after_import("sglang.srt.utils.phase_checker", phase_check.install)
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None:
        return
    module = types.ModuleType("sgl_kernel")
    module.__doc__ = f"serving-canary's CPU stand-ins ({__name__})"
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    module.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu
    for name in SPECULATIVE_ONLY:
        setattr(module, name, _speculative_only(name))
    sys.modules["sgl_kernel"] = module


def _speculative_only(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: serving-canary has no CPU stand-in for it "
                                  "(only speculative decoding calls it)")

    refuse.__name__ = name
    return refuse


class _TranslatedRows:
    """A request-to-token pool whose rows name SWA slots: what an SWA layer must read."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


def translate_swa_reads(backend_class: type) -> None:
    """Make `backend_class` (SGLang's `TorchNativeAttnBackend`) read an SWA layer's KV at the SWA
    slots its rows map to.

    On a CPU without AMX the torch_native backend is the only one, and in 0.5.23 it writes an SWA
    layer's K/V at the translated slots (`init_forward_metadata`: `translate_loc_from_full_to_swa`)
    but reads them at the rows' FULL slot ids (`_run_sdpa_forward_extend`/`_decode`:
    `k_cache[req_to_token[row]]`), so an SWA layer reads other tokens' KV, or fails with an
    IndexError once a full slot id passes the SWA pool's size. Every GPU backend and the AMX one
    translate; this gives the torch_native one the same read, through SGLang's own mapping, and
    nothing else: what it writes, its masks and its memory path are SGLang's.
    """
    if getattr(backend_class, "__canary_swa_reads__", False):
        return
    for name in ("forward_extend", "forward_decode"):
        original = getattr(backend_class, name)

        def forward(self, q, k, v, layer, forward_batch, *args, _original=original, **kwargs):
            pool = self.token_to_kv_pool
            mapping = getattr(pool, "full_to_swa_index_mapping", None)
            if not self.use_sliding_window_kv_pool or mapping is None or not pool.layers_mapping[layer.layer_id][1]:
                return _original(self, q, k, v, layer, forward_batch, *args, **kwargs)
            rows = self.req_to_token_pool
            self.req_to_token_pool = _TranslatedRows(mapping[rows.req_to_token.to(torch.int64)])
            try:
                return _original(self, q, k, v, layer, forward_batch, *args, **kwargs)
            finally:
                self.req_to_token_pool = rows

        setattr(backend_class, name, forward)
    backend_class.__canary_swa_reads__ = True
