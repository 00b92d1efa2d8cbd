"""Fixtures of the canary suite's own tests: scenario files in tmp_path, no engine left behind."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its parent's wait is due


def engines_under(path: Path) -> list[int]:
    """Pids of live engine processes launched for run dirs under `path` (a test's own engines).

    Fresh engines name the path in their command line; a warm engine is a fork of the fork
    server and carries its command line instead, so its pid is read from the event log it wrote.
    """
    out = subprocess.run(["pgrep", "-f", f"engine_stub --scenario {path}"], capture_output=True,
                         text=True, check=False)
    pids = {int(p) for p in out.stdout.split()}
    for log in Path(path).rglob("events.jsonl"):
        with contextlib.suppress(OSError, ValueError):
            first = json.loads(log.read_text(encoding="utf-8").splitlines()[0])
            if first.get("kind") == "engine_start":
                pids.add(int(first["pid"]))
    return sorted(p for p in pids if _alive(p))


def sigint_as_on_a_terminal() -> None:
    """A `preexec_fn` for a child that a test sends Ctrl-C.

    An xdist worker (or a shell's background job) ignores SIGINT, and a child inherits that:
    Python then installs no KeyboardInterrupt handler, so the Ctrl-C under test would be lost.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def assert_no_engine_left():
    """Call with a run dir: fails if an engine launched under it is still alive after 5 s."""

    def check(path: Path) -> None:
        deadline = time.monotonic() + 5
        while engines_under(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engines_under(path) == [], f"engine processes survived the run under {path}"

    return check


@pytest.fixture
def write_scenario(tmp_path: Path):
    """Write a scenario mapping as YAML under tmp_path and return its path."""

    def write(doc: dict, name: str | None = None) -> Path:
        path = tmp_path / f"{name or doc['name']}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        return path

    return write
