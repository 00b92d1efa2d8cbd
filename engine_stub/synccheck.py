"""Detect, on CPU, the tensor operations that would synchronize a CUDA device.

Every tensor inside a check stands in for a device tensor: an op is recorded when, run on CUDA,
it would block the host (a scalar read, a copy to host, an output shape that depends on the data,
a blocking host-to-device copy of a Python scalar). A `TorchDispatchMode` sees the aten ops; the
host reads that never reach aten on CPU (`Tensor.tolist`, `Tensor.numpy`) are patched for the
duration of the check. Where CUDA is available the check also arms
`torch.cuda.set_sync_debug_mode("error")`, so a sync the CPU rules miss still fails loudly.

Known blind spots on CPU: `.cpu()`/`.to("cpu")` of a CPU tensor is the identity and is not seen,
and a 0-dim device tensor assigned through `t[idx] = v` reads like a host scalar and is flagged.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SyncCheck",
    "SyncDetected",
    "SyncRecord",
    "assert_no_sync",
    "count_syncs",
    "synccheck",
]

# Each of these hands the host a value (`.item()`, `bool(t)`, `int(t)`, `float(t)`, `if t:` and
# `__index__` all reach aten as `_local_scalar_dense`) or an output whose size depends on data.
_ALWAYS_SYNC = frozenset(
    {
        "_local_scalar_dense",
        "equal",
        "allclose",
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
    }
)
_INDEX_OPS = frozenset({"index", "index_put", "index_put_"})
_MASK_DTYPES = (torch.bool, torch.uint8)
_HOST_READS = ("tolist", "numpy")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True)
class SyncRecord:
    """One kind of would-be sync: the op, where the caller made it, and how often."""

    op: str
    site: str
    count: int


class SyncDetected(AssertionError):
    """Raised by `assert_no_sync` when the checked call would synchronize the device."""


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name."""
    names = [arg.name for arg in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The record name for an aten op that would sync, or None for a sync-free one."""
    name = func._overloadpacket.__name__
    if name in _ALWAYS_SYNC:
        return f"aten::{name}"
    if name in _INDEX_OPS:
        bound = _bound(func, args, kwargs)
        # A mask becomes indices through nonzero, whose length only the device knows.
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in bound["indices"]):
            return "bool-mask index"
        # `t[idx] = 0` arrives as a 0-dim host tensor, copied to the device with a blocking H2D.
        values = bound.get("values")
        if isinstance(values, torch.Tensor) and values.dim() == 0:
            return f"host-scalar aten::{name}"
    if name == "repeat_interleave":
        bound = _bound(func, args, kwargs)
        # Without output_size the host must read the repeats' sum to size the output.
        if isinstance(bound.get("repeats"), torch.Tensor) and bound.get("output_size") is None:
            return "aten::repeat_interleave"
    return None


def _caller_site() -> str:
    """`file:LINE in func` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
            relative = os.path.relpath(filename)
            shown = filename if relative.startswith("..") else relative
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


class _SyncDispatchMode(TorchDispatchMode):
    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None:
            # Recorded before running: under the CUDA debug mode the op itself raises.
            self._record(kind)
        return func(*args, **kwargs)


class SyncCheck:
    """Context manager that records would-be device syncs made inside it.

    `records` aggregates by (op, site) in first-seen order and accumulates across uses of the
    same instance. Nested checks each record; entering one instance twice arms it once. Not
    thread-safe.
    """

    def __init__(self, *, cuda_sync_debug: bool | None = None) -> None:
        if cuda_sync_debug is None:
            cuda_sync_debug = torch.cuda.is_available()
        elif cuda_sync_debug and not torch.cuda.is_available():
            raise ValueError("cuda_sync_debug=True needs a CUDA device")
        self.records: list[SyncRecord] = []
        self._cuda_sync_debug = cuda_sync_debug
        self._depth = 0
        self._mode: _SyncDispatchMode | None = None
        self._saved_attrs: dict[str, Any] = {}
        self._saved_debug_mode: int | None = None

    @property
    def total(self) -> int:
        """Sum of the counts over all records."""
        return sum(record.count for record in self.records)

    def summary(self) -> str:
        """One line per record: `op at site x count`."""
        return "\n".join(f"{r.op} at {r.site} x {r.count}" for r in self.records)

    def _record(self, op: str) -> None:
        site = _caller_site()
        for i, record in enumerate(self.records):
            if (record.op, record.site) == (op, site):
                self.records[i] = SyncRecord(op, site, record.count + 1)
                return
        self.records.append(SyncRecord(op, site, 1))

    def _host_read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._record(f"Tensor.{name}")
            return original(*args, **kwargs)

        return wrapper

    def __enter__(self) -> SyncCheck:
        self._depth += 1
        if self._depth > 1:
            return self
        for name in _HOST_READS:
            # Saved from the class's own dict so exit can tell "was inherited" from "was set".
            self._saved_attrs[name] = vars(torch.Tensor).get(name)
            setattr(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name)))
        self._mode = _SyncDispatchMode(self._record)
        self._mode.__enter__()
        if self._cuda_sync_debug:
            self._saved_debug_mode = torch.cuda.get_sync_debug_mode()
            set_cuda_sync_debug_mode("error")
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._cuda_sync_debug:
            set_cuda_sync_debug_mode(self._saved_debug_mode)
        self._mode.__exit__(*exc)
        self._mode = None
        for name, saved in self._saved_attrs.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        self._saved_attrs.clear()


def set_cuda_sync_debug_mode(mode: int | str) -> None:
    """`torch.cuda.set_sync_debug_mode(mode)`, without the warning torch emits on arming it.

    torch warns "Synchronization debug mode is a prototype feature" each time the mode is set to
    warn or error; where warnings are errors (the test suite) that warning escapes after the mode
    is already set, leaving every later CUDA call in the process erroring.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


def synccheck(*, cuda_sync_debug: bool | None = None) -> SyncCheck:
    """A fresh `SyncCheck`.

    `cuda_sync_debug=None` arms `torch.cuda.set_sync_debug_mode("error")` iff CUDA is available;
    True demands CUDA, False keeps the check CPU-only.
    """
    return SyncCheck(cuda_sync_debug=cuda_sync_debug)


def count_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> SyncCheck:
    """Run `fn(*args, **kwargs)` under a CPU-only check and return the filled check.

    The CUDA debug mode stays off so that the call runs to the end and every sync is counted.
    """
    with synccheck(cuda_sync_debug=False) as check:
        fn(*args, **kwargs)
    return check


def _detected(check: SyncCheck) -> SyncDetected:
    return SyncDetected(f"{check.total} would-be device sync(s):\n{check.summary()}")


def assert_no_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run `fn(*args, **kwargs)` and raise `SyncDetected` listing every would-be sync."""
    check = synccheck()
    try:
        with check:
            fn(*args, **kwargs)
    except RuntimeError as err:
        # On CUDA the debug mode raises at the first sync, which the check recorded just before.
        if not check.records:
            raise
        raise _detected(check) from err
    if check.records:
        raise _detected(check)
