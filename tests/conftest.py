"""Fixtures shared by the engine_stub unit tests."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import pytest
import torch

from engine_stub import invariants


@pytest.fixture(autouse=True)
def _fresh_invariant_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start every test at level OFF with zeroed counters, no firing sink, and a seeded torch."""
    monkeypatch.delenv(invariants.LEVEL_ENV, raising=False)
    invariants.set_default_level(None)
    invariants.set_firing_sink(None)
    invariants.reset_counters()
    torch.manual_seed(0)
    yield
    # A test that pinned a level or a sink must not hand it to the next one.
    invariants.set_default_level(None)
    invariants.set_firing_sink(None)
    invariants.reset_counters()


def _sigint_as_on_a_terminal() -> None:
    # An xdist worker (or a shell's background job) ignores SIGINT, and a child inherits that:
    # Python then installs no KeyboardInterrupt handler, so a Ctrl-C under test would be lost.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def terminal_sigint() -> Callable[[], None]:
    """A `preexec_fn` for a child that a test sends Ctrl-C: SIGINT as a terminal's child has it."""
    return _sigint_as_on_a_terminal
