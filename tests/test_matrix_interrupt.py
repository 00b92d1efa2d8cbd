"""Ctrl-C stops a server matrix as it stops `canary run` (issue 32): a SIGINT to the process or to
its group interrupts at once, the matrix of what ran is written (unfinished cells NOT_RUN or
interrupted), the exit status is 130, and no server, oracle's clean server or fork parent is left.
Before, a matrix went on for minutes after a SIGINT: its threads waited on fork parents being
started one after another, and a clean server started after the stop ran its whole workload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = [REPO / "configs" / "scenarios" / f"{name}.yaml"
             for name in ("clean-cache-hits", "clean-page1-radix", "clean-page16-radix")]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _left(path: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if str(path) in line]


@pytest.mark.parametrize("to_group", [False, True], ids=["process", "group"])
def test_sigint_stops_a_server_matrix_at_once_and_writes_what_ran(tmp_path: Path, to_group: bool) -> None:
    if find_python("0.5.23", server=True) is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    report = tmp_path / "matrix"
    proc = subprocess.Popen([sys.executable, "-m", "canaries.cli", "matrix", "--runtime", "sglang-server",
                             "--sglang", "0.5.23", "-j", "1", "--report-dir", str(report), *map(str, SCENARIOS)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "CANARY_PROGRESS": "plain"})
    try:
        # The first server's workload is under way once the driver has noted its plan.
        gate = report / "runs" / "0.5.23" / "clean-cache-hits" / "gate.jsonl"
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not (gate.is_file() and gate.stat().st_size):
            time.sleep(0.05)
        assert proc.poll() is None, "the matrix ended before it could be interrupted"
        sent = time.monotonic()
        (os.killpg if to_group else os.kill)(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    assert took < 30, f"the matrix took {took:.0f} s to stop after SIGINT"
    doc = json.loads((report / "matrix.json").read_text())
    verdicts = {name: row["0.5.23"]["verdict"] for name, row in doc["scenarios"].items()}
    assert verdicts["clean-page16-radix"] == "NOT_RUN"
    assert "matrix interrupted" in out
    deadline = time.monotonic() + 15
    while _left(report) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left(report) == []
