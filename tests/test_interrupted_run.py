"""An interrupted `canary run` must not look green: its reports list every selected scenario,
say the run was interrupted, and are written however many signals arrive.

Each test starts a real `canary run` on four control scenarios (two engines at a time) and
signals it as soon as the first two engines serve: their workloads take seconds, so both are
still running when the signal comes, and the other two have not started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from canaries.conftest import engines_under
from canaries.report import read_run, read_verdicts

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NAMES = ("intr-a", "intr-b", "intr-c", "intr-d")  # `canary run` sorts by name: a, b start first
READY = "engine_stub ready on"


@pytest.fixture(autouse=True)
def _reap_engines(tmp_path: Path):
    """Whatever a failing run left behind under tmp_path is killed after the test."""
    yield
    for pid in engines_under(tmp_path):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _write_scenarios(folder: Path) -> list[Path]:
    folder.mkdir()
    paths = []
    for i, name in enumerate(NAMES):
        doc = {"name": name, "seed": i,
               "engine": {"profile": "cpu-tiny", "page_size": 1, "invariant_check": "strict",
                          "kv_canary": "log"},
               "workload": {"requests": 12, "concurrency": 2, "prompt_tokens": [24, 40],
                            "max_new_tokens": 128},
               "expect": {"clean": True}}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        paths.append(path)
    return paths


def _serving(report: Path) -> int:
    count = 0
    for log in report.glob("*/engine.log"):
        try:
            count += READY in log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            pass
    return count


def _interrupt_mid_run(tmp_path: Path, signals: tuple[signal.Signals, ...],
                       preexec: Callable[[], None]) -> tuple[int, str, Path]:
    """Run the four scenarios with --jobs 2, send `signals` 0.15 s apart once two engines serve."""
    paths = _write_scenarios(tmp_path / "scenarios")
    report = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "canaries.cli", "run", *map(str, paths), "--jobs", "2",
         "--report-dir", str(report)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=preexec)
    try:
        deadline = time.monotonic() + 60
        while _serving(report) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert _serving(report) == 2, "the first two engines never served"
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.15)
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, report


@pytest.mark.parametrize("signals", [
    (signal.SIGINT,),
    (signal.SIGINT, signal.SIGINT),
    (signal.SIGTERM,),
    (signal.SIGTERM, signal.SIGTERM),
], ids=["sigint", "sigint-twice", "sigterm", "sigterm-twice"])
def test_interrupted_run_reports_every_scenario_and_fails_the_gate(tmp_path, signals, terminal_sigint):
    rc, out, report = _interrupt_mid_run(tmp_path, signals, terminal_sigint)
    first = signals[0]
    assert rc == 128 + first, out

    # junit.xml: one testcase per selected scenario, red, and saying the run was interrupted.
    suite = ET.parse(report / "junit.xml").getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase") if c.get("classname") == "canary"}
    assert sorted(cases) == list(NAMES), out
    assert int(suite.get("failures")) + int(suite.get("errors")) > 0
    props = {p.get("name"): p.get("value") for p in suite.find("properties").iter("property")}
    assert props.get("interrupted") == first.name
    for name in ("intr-c", "intr-d"):  # never started: an error, not a skip
        assert cases[name].find("error") is not None and cases[name].find("skipped") is None

    # verdicts.jsonl: a line for every selected scenario, and the run-level record.
    records = {r["scenario"]: r for r in read_verdicts(report / "verdicts.jsonl")}
    assert sorted(records) == list(NAMES), out
    assert records["intr-c"]["verdict"] == records["intr-d"]["verdict"] == "NOT_RUN"
    for name in ("intr-a", "intr-b"):  # serving when the signal came
        assert (records[name]["verdict"], records[name]["reason"]) == ("INCONCLUSIVE",
                                                                       "interrupted"), out
        assert not records[name]["passed"]
    run = read_run(report / "verdicts.jsonl")
    assert run is not None and run["cause"] == first.name
    assert sorted(run["not_run"]) == ["intr-c", "intr-d"]

    # The kill matrix is written and says so too.
    assert (report / "kill_matrix.md").exists()
    matrix = yaml.safe_load((report / "kill_matrix.json").read_text())
    assert matrix["interrupted"]["cause"] == first.name
    assert "interrupted" in (report / "kill_matrix.md").read_text()

    deadline = time.monotonic() + 5
    while engines_under(report) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engines_under(report) == [], "an engine outlived the interrupted run"
