"""Triage commands end to end: `canary repro`, `canary shrink`, `canary bisect`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from canaries.cli import main as canary
from canaries.scenario import load_scenario
from canaries.triage.shrink import scenario_size

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "configs" / "scenarios"


def _copy_scenario(name: str, tmp_path: Path, new_name: str) -> Path:
    from canaries.scenario.yamldoc import read_doc

    doc = read_doc(LIBRARY / f"{name}.yaml").data
    doc["name"] = new_name
    path = tmp_path / f"{new_name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.slow
def test_repro_of_a_run_reports_an_identical_trace_and_a_tampered_one_differs(tmp_path, capsys):
    report = tmp_path / "report"
    assert canary(["run", str(LIBRARY / "leak-request.yaml"), "--report-dir", str(report)]) == 0
    run_dir = report / "leak-request"
    assert (run_dir / "scenario.yaml").is_file()
    assert canary(["repro", str(run_dir), "--out", str(tmp_path / "again")]) == 0
    assert "event trace: identical" in capsys.readouterr().out
    # Damage the original's record of one step: the rerun must no longer match it.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    step = next(e for e in events if e["kind"] == "step")
    step["running"] += 1
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert canary(["repro", str(run_dir), "--out", str(tmp_path / "third")]) == 1
    out = capsys.readouterr().out
    assert "event trace: DIFFERS" in out and "first difference at event" in out


def test_repro_of_a_directory_that_is_no_run_dir_is_a_usage_error(tmp_path, capsys):
    assert canary(["repro", str(tmp_path)]) == 2
    assert "no verdict.json" in capsys.readouterr().err


@pytest.mark.slow
def test_shrink_halves_a_failing_library_scenario_keeping_verdict_and_signature(tmp_path):
    # A library scenario made to fail: it expects the wrong detector (WRONG_DETECTOR).
    source = _copy_scenario("corrupt-r2t-strict", tmp_path, "wrong-detector")
    doc = yaml.safe_load(source.read_text())
    doc["expect"]["fires"] = ["swa.peer_released"]
    source.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "small.yaml"
    assert canary(["shrink", str(source), "--out", str(out), "--max-steps", "40"]) == 0
    original, small = load_scenario(source), load_scenario(out)
    assert scenario_size(small) * 2 <= scenario_size(original)
    assert out.read_text().startswith(f"# shrunk by `canary shrink` from {source}")
    report = tmp_path / "check"
    canary(["run", str(out), "--report-dir", str(report)])
    before = json.loads((tmp_path / "check" / small.name / "verdict.json").read_text())
    assert before["verdict"] == "WRONG_DETECTOR"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.slow
def test_bisect_finds_the_planted_regression_commit_in_a_throwaway_repo(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "engine_stub", "pyproject.toml"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")

    def commit(message: str) -> str:
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", message)
        return _git(repo, "rev-parse", "HEAD")

    good = commit("good engine")
    (repo / "NOTES").write_text("harmless\n")
    commit("a harmless change")
    idle = repo / "engine_stub" / "idle_check.py"
    text = idle.read_text()
    planted = '(FULL_LEDGER, ledgers["full"]["delta"] == 0,'
    assert text.count(planted) == 1
    idle.write_text(text.replace(planted, "(FULL_LEDGER, True,"))  # the full ledger never fails
    regression = commit("the planted regression")
    (repo / "NOTES").write_text("still harmless\n")
    bad = commit("another harmless change")
    scenario = LIBRARY / "leak-request-strict-idle.yaml"
    assert canary(["bisect", good, bad, str(scenario), "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    assert regression in out and "the planted regression" in out
    assert _git(repo, "worktree", "list").count("\n") == 0, "the bisect worktree was left behind"
    assert not (repo / ".git" / "BISECT_LOG").exists(), "the user's checkout got bisect state"
    shutil.rmtree(repo)
