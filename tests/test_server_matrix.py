"""`canary matrix --runtime sglang-server`: releases' own servers as columns, and the gate on them.

The gate's proof needs SGLang 0.5.23's server venv (`bash scripts/make-sglang-venv.sh --server`)
and skips, naming it, without one; the rest runs anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.cli import main as canary
from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "configs" / "scenarios"


def test_server_matrix_without_the_release_server_venv_names_the_server_build(capsys) -> None:
    code = canary(["matrix", "--runtime", "sglang-server", "--sglang", "0.0.1", "--no-build",
                   "-k", "clean-page1-noradix"])
    assert code == 2
    assert "make-sglang-venv.sh --server --version 0.0.1" in capsys.readouterr().err


def test_matrix_config_with_an_unknown_runtime_is_a_usage_error(tmp_path: Path, capsys) -> None:
    config = tmp_path / "matrix.yaml"
    config.write_text("sglang: [0.5.23]\nruntime: docker\n", encoding="utf-8")
    assert canary(["matrix", "--config", str(config)]) == 2
    assert "runtime: one of local, sglang-server" in capsys.readouterr().err


def _kept_matrix(root: Path, runtime: str) -> Path:
    """A matrix report as `canary matrix` keeps it: one 0.5.22 column whose server gave
    clean-page12-radix a FALSE_ALARM (SGLang's idle check), native CLEAN."""
    column = {"label": "0.5.22", "version": "0.5.22", "python": "/venv/bin/python", "seconds": 1.0,
              "patches": [], "diff": "", "memory_parts": {}, "provenance": {"kind": "index"}, "divergences": ""}
    (root / "matrix.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "matrix.json").write_text(json.dumps({"runtime": runtime, "columns": [column], "native_seconds": 1.0,
                                                   "wall_seconds": 2.0, "gate": None}), encoding="utf-8")
    for label, record in (("native", {"verdict": "CLEAN", "passed": True}),
                          ("0.5.22", {"verdict": "FALSE_ALARM", "passed": False,
                                      "firings": [{"detector": "idle.full_ledger"}]})):
        (root / "runs" / label).mkdir(parents=True)
        (root / "runs" / label / "verdicts.jsonl").write_text(
            json.dumps({"scenario": "clean-page12-radix", **record}) + "\n", encoding="utf-8")
    return root


def test_rejudged_server_matrix_reads_the_release_server_divergences(tmp_path: Path, capsys) -> None:
    report = _kept_matrix(tmp_path / "report", "sglang-server")
    assert canary(["matrix", "--rejudge", str(report)]) == 0
    doc = json.loads((report / "matrix.json").read_text(encoding="utf-8"))
    cell = doc["scenarios"]["clean-page12-radix"]["0.5.22"]
    assert cell["status"] == "known" and "checkpoint_into_tree" in cell["reason"]
    assert doc["columns"][0]["divergences"] == "sglang-0.5.22.yaml, sglang-0.5.23.yaml (inherited)"
    assert "native vs SGLang's own server" in capsys.readouterr().out


def test_rejudged_memory_path_matrix_holds_the_same_cell_unexplained(tmp_path: Path) -> None:
    """The server's divergence is not the memory path's: configs/parity/ has no such entry."""
    report = _kept_matrix(tmp_path / "report", "local")
    assert canary(["matrix", "--rejudge", str(report)]) == 1
    doc = json.loads((report / "matrix.json").read_text(encoding="utf-8"))
    assert doc["unexplained"] == [{"scenario": "clean-page12-radix", "release": "0.5.22"}]


def test_rejudge_of_a_directory_that_is_no_matrix_report_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert canary(["matrix", "--rejudge", str(tmp_path)]) == 2
    assert "not a matrix report" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_server_gate_fails_on_planted_regressions_that_unmodified_release_passes(tmp_path: Path) -> None:
    """The gate on servers, last = 0.5.23 as released, candidate = 0.5.23 with two planted
    regressions (canaries/sglang/releases/patches.py): `release-leaks-last-slot` (request level, only
    SGLang's own scheduler runs it: the control's idle check reports the leaked slot) and
    `free-swa-contract-removed` (PR #36723's check gone from `free_swa`: the zeroed row entry is
    freed unchecked, and only the leak's idle check fires there). Both scenarios pass on the
    unmodified server; the gate names both."""
    if find_python("0.5.23", server=True) is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    report = tmp_path / "report"
    candidate = "0.5.23+release-leaks-last-slot+free-swa-contract-removed"
    proc = subprocess.run(
        [sys.executable, "-m", "canaries.cli", "matrix", "--runtime", "sglang-server",
         str(SCENARIOS / "clean-page1-noradix.yaml"), str(SCENARIOS / "corrupt-r2t-zero-page1.yaml"),
         "--last", "0.5.23", "--candidate", candidate, "--no-build", "-j", "1", "--columns", "2",
         "--reruns", "1", "--report-dir", str(report)],
        capture_output=True, text=True, cwd=REPO, check=False)
    out = proc.stdout + proc.stderr
    doc = json.loads((report / "matrix.json").read_text(encoding="utf-8"))
    assert proc.returncode == 1, out
    assert doc["runtime"] == "sglang-server" and "GATE FAILED" in out
    assert sorted(doc["gate"]["regressions"]) == ["clean-page1-noradix", "corrupt-r2t-zero-page1"]
    # Confirmed before it failed: each ran once more on both columns, and held.
    for confirmation in doc["gate"]["confirmations"].values():
        assert [p for _, p in confirmation["before"]] == [True, True]
        assert [p for _, p in confirmation["after"]] == [False, False]
    cells = doc["scenarios"]
    assert cells["clean-page1-noradix"]["0.5.23"]["verdict"] == "CLEAN"
    assert cells["corrupt-r2t-zero-page1"]["0.5.23"]["verdict"] == "DETECTED"
    assert cells["clean-page1-noradix"][candidate]["verdict"] == "FALSE_ALARM"
    assert "idle.full_ledger" in cells["clean-page1-noradix"][candidate]["detectors"]
    # Without PR #36723's check the zeroed entry is freed unchecked: only the leak's idle check fires.
    damaged = cells["corrupt-r2t-zero-page1"][candidate]
    assert not damaged["passed"] and "swa.peer_mapped" not in damaged["detectors"], damaged
    server = json.loads((report / "runs" / candidate / "verdicts.jsonl").read_text().splitlines()[0])
    assert server["extra"]["server"]["sglang_version"] == "0.5.23"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_server_matrix_runs_the_window_eviction_hook_on_both_releases_servers(tmp_path: Path) -> None:
    """0.5.22's server beside 0.5.23's: the same hook (SGLang's own window eviction, where
    double_free_swa frees the evicted slots again) lands on each, and each release's PR #36723
    check (`swa.peer_mapped` in `free_swa`) catches it, as our engine does."""
    missing = [v for v in ("0.5.22", "0.5.23") if find_python(v, server=True) is None]
    if missing:
        pytest.skip(f"no server venv for {', '.join(missing)}: bash scripts/make-sglang-venv.sh --server "
                    "[--version 0.5.22]")
    report = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "canaries.cli", "matrix", "--runtime", "sglang-server", "--sglang", "0.5.22,0.5.23",
         str(SCENARIOS / "double-free-swa-page1.yaml"), "--no-build", "-j", "1", "--columns", "2",
         "--report-dir", str(report)],
        capture_output=True, text=True, cwd=REPO, check=False)
    doc = json.loads((report / "matrix.json").read_text(encoding="utf-8"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = doc["scenarios"]["double-free-swa-page1"]
    for release in ("0.5.22", "0.5.23"):
        assert (row[release]["verdict"], row[release]["status"]) == ("DETECTED", "same")
        assert row[release]["detectors"] == ["swa.peer_mapped"]
    assert [c["version"] for c in doc["columns"]] == ["0.5.22", "0.5.23"]
