"""Fixtures shared by the engine_stub unit tests."""

from __future__ import annotations

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


@pytest.fixture(autouse=True)
def _own_native_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test (and every `canary` it starts) keeps its native runs (canaries/native_cache.py) and
    its server references' answers (canaries/sglang/oracle_cache.py) apart: none is reused from
    another test or from the user's own runs."""
    from canaries.native_cache import CACHE_ENV
    from canaries.sglang.oracle_cache import ORACLE_CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("canary-cache")))
    monkeypatch.delenv(ORACLE_CACHE_ENV, raising=False)


@pytest.fixture
def terminal_sigint() -> Callable[[], None]:
    """A `preexec_fn` for a child that a test sends Ctrl-C (canaries.conftest says why)."""
    from canaries.conftest import sigint_as_on_a_terminal

    return sigint_as_on_a_terminal
