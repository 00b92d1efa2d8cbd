"""SGLang's phase-checker kernel on a CPU without Triton's interpreter: what the interpreter does
with it, done on the host.

The KV canary steps a `SimplePhaseChecker` (`utils/phase_checker.py`) four times a forward; on a
CPU its one-program Triton kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`), about
1.4 ms a launch, a tenth of a CPU server's scheduler time. The kernel loads the phase, prints a
FAIL line when its assert flag is set and the phase is not the one expected, and stores the next
phase. Its `tl.device_assert` never fires there: the interpreter builds with `debug=False`
whatever the decorator says (Triton 3.9 `InterpreterOptions`), so the mismatch is printed and the
run goes on. `install` puts a host function doing exactly that in the kernel's place, only when
the kernel's source and Triton's version are ones tests/test_server_phase_check.py held it to
against the interpreter; any other pair keeps the interpreter.
"""

from __future__ import annotations

import hashlib
import inspect
from types import ModuleType

import torch

__all__ = ["HostPhaseCheck", "VERIFIED", "install", "kernel_key"]

# (sha256 of the kernel's source, triton.__version__): the pairs the test compared launch by launch
# with the interpreter (SGLang 0.5.18-0.5.23 carry the same kernel).
VERIFIED = frozenset({
    ("b2a55d25d520", "3.9.0"),
})


def kernel_key(kernel: object) -> tuple[str, str]:
    """(a digest of the kernel function's source, the running Triton's version)."""
    import triton

    source = inspect.getsource(kernel.fn)
    return hashlib.sha256(source.encode()).hexdigest()[:12], str(triton.__version__)


class HostPhaseCheck:
    """`_phase_check_kernel[grid](phase, enable_assert, EXPECT_PHASE=, NEXT_PHASE=, CALLER_TAG=)`
    on CPU tensors for the grid (1,) SGLang launches it with; anything else goes to the kernel."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.fn = kernel.fn

    def __getitem__(self, grid):
        if tuple(grid) != (1,):
            return self.kernel[grid]
        return self._launch

    def _launch(self, phase_ptr: torch.Tensor, enable_assert_ptr: torch.Tensor, *,
                EXPECT_PHASE: int, NEXT_PHASE: int, CALLER_TAG: int) -> None:
        if phase_ptr.device.type != "cpu" or enable_assert_ptr.device.type != "cpu":
            return self.kernel[(1,)](phase_ptr, enable_assert_ptr, EXPECT_PHASE=EXPECT_PHASE,
                                     NEXT_PHASE=NEXT_PHASE, CALLER_TAG=CALLER_TAG)
        phase = phase_ptr.view(-1)
        current = int(phase[0])
        if int(enable_assert_ptr.view(-1)[0]) != 0 and current != EXPECT_PHASE:
            # The interpreter's device_print: the program id, the prefix, ": ", the loaded value.
            print(f"(0, 0, 0)  [SimplePhaseChecker FAIL] caller_tag={CALLER_TAG} expect={EXPECT_PHASE} "
                  f"next={NEXT_PHASE} actual=:  [{current}]")
        phase[0] = NEXT_PHASE


def install(module: ModuleType) -> None:
    """In `module` (`sglang.srt.utils.phase_checker`), launch the phase check on the host when
    its kernel and Triton are a verified pair and Triton interprets (idempotent)."""
    import triton

    kernel = getattr(module, "_phase_check_kernel", None)
    if kernel is None or isinstance(kernel, HostPhaseCheck) or not triton.knobs.runtime.interpret:
        return
    if kernel_key(kernel) in VERIFIED:
        module._phase_check_kernel = HostPhaseCheck(kernel)
