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


@pytest.fixture
def in_server_venv() -> Callable[..., str]:
    """`run(release, script, env=None)`: `script` run by SGLang `release`'s server venv (this
    checkout's root as `sys.argv[1]`), its stdout stripped; skips where the venv is missing, fails
    with the script's output where it exits non-zero."""
    import os
    import subprocess
    from pathlib import Path

    from canaries.sglang.releases.venvs import find_python

    root = Path(__file__).resolve().parents[1]

    def run(release: str, script: str, env: dict[str, str] | None = None) -> str:
        python = find_python(release, server=True)
        if python is None:
            pytest.skip(f"no SGLang {release} server venv: bash scripts/make-sglang-venv.sh --server --version {release}")
        proc = subprocess.run([str(python), "-c", script, str(root)], capture_output=True, text=True, timeout=300,
                              check=False, env=env if env is not None else dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
        return proc.stdout.strip()

    return run
