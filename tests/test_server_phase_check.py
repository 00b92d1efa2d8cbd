"""SGLang's phase-checker kernel on the host (canaries/sglang/server/phase_check.py) against the
kernel itself in Triton's interpreter, launch by launch, in every SGLang venv here that has it: the
same phase stored, the same lines printed, the same (absent) exception. Also that an unverified
kernel keeps the interpreter, and that the CPU stand-ins every server process installs put it in place."""

from __future__ import annotations

import os
import textwrap

import pytest

SIDE_BY_SIDE = textwrap.dedent("""
    import contextlib, io, random, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from canaries.sglang.server import cpu_standins, phase_check

    cpu_standins.install()  # what every SGLang process of a CPU server runs first (sitecustomize)
    from sglang.srt.utils import phase_checker

    assert isinstance(phase_checker._phase_check_kernel, phase_check.HostPhaseCheck)
    kernel = phase_checker._phase_check_kernel.kernel
    assert type(kernel).__name__ == "InterpretedFunction", type(kernel)
    assert phase_check.kernel_key(kernel) in phase_check.VERIFIED, phase_check.kernel_key(kernel)
    host = phase_check.HostPhaseCheck(kernel)
    rng = random.Random(11)

    def launch(run, phase, enable, expect, nxt, tag):
        out, error = io.StringIO(), None
        try:
            with contextlib.redirect_stdout(out):
                run[(1,)](phase, enable, EXPECT_PHASE=expect, NEXT_PHASE=nxt, CALLER_TAG=tag)
        except BaseException as exc:
            error = repr(exc)
        return out.getvalue(), error, int(phase)

    cases = mismatches = 0
    for _ in range(300):
        current = rng.choice([0, 1, 2, 3, 7, -1, 2**31 - 1])
        expect = current if rng.random() < 0.5 else rng.choice([0, 1, 2, 5, -3])
        nxt, tag, enable = rng.choice([0, 1, 2, 4, -2]), rng.randint(1, 9), rng.choice([0, 1, 2])
        state = []
        for run in (kernel, host):
            phase = torch.tensor(current, dtype=torch.int32)
            state.append(launch(run, phase, torch.tensor([enable], dtype=torch.int32), expect, nxt, tag))
        assert state[0] == state[1], (current, expect, nxt, tag, enable, state)
        cases += 1
        mismatches += bool(state[0][0])
    assert mismatches > 20, mismatches  # the FAIL line was compared, not only silence

    # Through SGLang's own class: enable_assert resets, a wrong order prints, the phase moves on.
    for use_host in (False, True):
        phase_checker._phase_check_kernel = host if use_host else kernel
        checker = phase_checker.SimplePhaseChecker(initial_phase=0, device=torch.device("cpu"))
        checker.enable_assert()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            checker.update(expect_phase=0, next_phase=1, caller_name="pre")
            checker.update(expect_phase=2, next_phase=3, caller_name="post")
        state.append((out.getvalue(), int(checker._phase)))
    assert state[-1] == state[-2] and "caller_tag=2 expect=2 next=3 actual=:  [1]" in state[-1][0], state[-2:]

    # An unverified kernel (one changed line) keeps the interpreter.
    phase_checker._phase_check_kernel = kernel
    phase_check.VERIFIED_SAVED = phase_check.VERIFIED
    phase_check.VERIFIED = frozenset()
    phase_check.install(phase_checker)
    assert phase_checker._phase_check_kernel is kernel
    phase_check.VERIFIED = phase_check.VERIFIED_SAVED
    phase_check.install(phase_checker)
    assert isinstance(phase_checker._phase_check_kernel, phase_check.HostPhaseCheck)
    print("same", cases)
""")


@pytest.mark.parametrize("release", ["0.5.23", "0.5.22"])
def test_host_phase_check_matches_the_interpreted_kernel(release: str, in_server_venv) -> None:
    assert in_server_venv(release, SIDE_BY_SIDE, {**os.environ, "TRITON_INTERPRET": "1"}) == "same 300"


def test_host_phase_check_refuses_a_kernel_launch_it_does_not_know() -> None:
    from canaries.sglang.server.phase_check import HostPhaseCheck

    class Kernel:
        fn = staticmethod(lambda: None)

        def __getitem__(self, grid):
            return ("kernel", grid)

    assert HostPhaseCheck(Kernel())[(2,)] == ("kernel", (2,))
