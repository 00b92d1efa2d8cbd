"""Hundreds of warm engines started and stopped at once on a busy machine: no harness error, no
engine left behind (issue 25: a library run once died in the fork server's protocol under load).

ENGINES engines go through the harness's own path (`LocalRuntime`, warm start: fork request,
ready line, SIGTERM, exit code), CONCURRENCY at a time, above the core count, while BURNERS
processes keep every core busy. A warm spawn + ready + stop costs about 0.1 s of wall time
here (2 cores), so 300 engines take well under a minute, long enough for hundreds of
fork/ready/exit interleavings under contention.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from canaries.runtime.local import LocalRuntime
from canaries.runtime.warm import fork_server

ENGINES = 300
CONCURRENCY = 8
BURNERS = 3


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _start_and_stop(run_dir: Path) -> tuple[int, str, int | None]:
    runtime = LocalRuntime(start="warm")
    try:
        base_url = runtime.start(None, run_dir)
    finally:
        code = runtime.stop()
    assert runtime.pid is not None
    return runtime.pid, base_url, code


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hundreds_of_warm_engines_under_load_start_and_stop_without_a_harness_error(tmp_path):
    server = fork_server()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        assert len(burners) + CONCURRENCY > (os.cpu_count() or 1), "the load must exceed the cores"
        with ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="stress") as pool:
            futures = [pool.submit(_start_and_stop, tmp_path / f"engine-{i}") for i in range(ENGINES)]
            outcomes = [(f.exception() or f.result()) for f in futures]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    assert errors == [], f"{len(errors)} harness error(s), the first: {errors[:3]}"
    pids = [pid for pid, _, _ in outcomes]
    assert len(set(pids)) == ENGINES
    assert all(url.startswith("http://127.0.0.1:") for _, url, _ in outcomes)
    assert {code for _, _, code in outcomes} == {0}, "every engine stops cleanly on SIGTERM"
    assert [pid for pid in pids if _alive(pid)] == [], "an engine outlived its stop"
    assert server.alive and _children(server.proc.pid) == [], "the fork server holds unreaped engines"
