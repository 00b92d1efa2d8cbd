"""Scale-out with the engines we have: `--shard I/N` across runners and pytest-xdist over the
pytest canaries give the same scenarios, once each, with the same verdicts."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from canaries.cli import main as canary
from canaries.commands.run import select
from canaries.report.jsonl import read_verdicts
from canaries.scenario import discover, load_scenario

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [load_scenario(p) for p in discover()]
SUBSET = "clean-page1-radix or corrupt-r2t-strict or leak-request or flip-kv-swa-in-use"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_and_cover_the_library(n: int) -> None:
    shards = [[s.name for s in select(LIBRARY, shard=f"{i}/{n}")] for i in range(1, n + 1)]
    names = [name for shard in shards for name in shard]
    assert len(names) == len(set(names)), "a scenario ran in two shards"
    assert sorted(names) == sorted(s.name for s in LIBRARY)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1, "unbalanced shards"


@pytest.mark.slow
def test_xdist_run_of_the_pytest_canaries_gives_canary_runs_verdicts(tmp_path: Path) -> None:
    junit = tmp_path / "xdist.xml"
    proc = subprocess.run(
        # no:benchmark: pytest-benchmark (where a machine has it) warns under xdist, and our
        # filterwarnings = error turns that warning into a failed start.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", "-n", "2",
         "canaries/test_scenarios.py", "-k", SUBSET, f"--junitxml={junit}", "-o", "junit_family=xunit1"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    by_test = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "verdict" in props:
            by_test[case.get("name").split("[", 1)[1].rstrip("]")] = (props["verdict"], props["signature"])
    assert canary(["run", "-k", SUBSET, "--jobs", "2", "--report-dir", str(tmp_path / "run")]) == 0
    serial = {r["scenario"]: (r["verdict"], r["signature"]) for r in read_verdicts(tmp_path / "run" / "verdicts.jsonl")}
    assert by_test == serial and len(serial) >= 4
