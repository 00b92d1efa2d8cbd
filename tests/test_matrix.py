"""`canary matrix`: release specs, planted SGLang patches, the gate, the reports.

The end-to-end gate tests need SGLang 0.5.23's venv (scripts/make-sglang-venv.sh) and skip,
saying so, without it; everything else runs anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.cli import main as canary
from canaries.sglang.matrix import Cell, Column, MatrixResult, gate
from canaries.sglang.matrix_html import matrix_html
from canaries.sglang.releases import (
    ReleaseError,
    ReleaseSpec,
    SGLangSource,
    parse_releases,
    patched_interpreter,
)
from canaries.sglang.releases.patches import SGLangPatch
from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
# Every release CI builds a venv for; 0.5.21 and 0.5.22 were never pinned by hand (their closures
# were resolved by the tool and 0.5.22's divergences start from 0.5.20's file).
RELEASES = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def _venv_python(version: str) -> Path | None:
    """The interpreter of `version`'s venv here, as `canary matrix` finds it, or None."""
    return find_python(version)


VENV_0523 = _venv_python("0.5.23")
ALL_VENVS = all(_venv_python(v) for v in RELEASES)
needs_0523 = pytest.mark.skipif(VENV_0523 is None, reason="no SGLang 0.5.23 venv: run "
                                "`bash scripts/make-sglang-venv.sh`")


def _cell(verdict: str, passed: bool, status: str = "same") -> Cell:
    return Cell(verdict, ("swa.peer_mapped",) if verdict == "DETECTED" else (), passed, status)


def test_parse_releases_reads_versions_and_patches() -> None:
    specs = parse_releases("0.5.18, 0.5.23+free-swa-contract-removed")
    assert specs == [ReleaseSpec(SGLangSource("index", "0.5.18")),
                     ReleaseSpec(SGLangSource("index", "0.5.23"), ("free-swa-contract-removed",))]
    assert specs[1].label == "0.5.23+free-swa-contract-removed"


@pytest.mark.parametrize(("text", "message"), [
    ("0.5", "not a version"),
    ("0.5.23,0.5.23", "named twice"),
    ("0.5.23+", "empty patch name"),
    ("0.5.23+no-such-patch", "unknown SGLang patch no-such-patch"),
    ("", "name at least one release"),
])
def test_parse_releases_rejects_bad_spec_naming_the_source(text: str, message: str) -> None:
    with pytest.raises(ReleaseError, match=message) as info:
        parse_releases(text, where="matrix.yaml: sglang")
    assert str(info.value).startswith("matrix.yaml: sglang")


def test_gate_names_scenarios_that_passed_on_last_and_fail_on_candidate() -> None:
    cells = {
        "a": {"native": _cell("DETECTED", True, "native"), "old": _cell("DETECTED", True), "new": _cell("MISSED", False)},
        "b": {"native": _cell("CLEAN", True, "native"), "old": _cell("CLEAN", True), "new": _cell("CLEAN", True)},
        "c": {"native": _cell("DETECTED", True, "native"), "old": _cell("MISSED", False), "new": _cell("DETECTED", True)},
    }
    result = gate("old", "new", cells)
    assert result.regressions == ("a",) and result.fixed == ("c",) and not result.ok
    assert gate("old", "old", cells).ok


def _result(tmp_path: Path) -> MatrixResult:
    cells = {"s1": {"native": _cell("DETECTED", True, "native"),
                    "0.5.18": Cell("MISSED", (), False, "known", "the filter absorbs it"),
                    "0.5.23": _cell("DETECTED", True)},
             "s2": {"native": _cell("CLEAN", True, "native"),
                    "0.5.18": Cell("DETECTED", ("idle.swa_ledger",), False, "unexplained"),
                    "0.5.23": _cell("CLEAN", True)}}
    columns = [Column("0.5.18", "0.5.18", "/py18", 10.0, memory_parts={"allocator": "sglang-0.5.18"}),
               Column("0.5.23", "0.5.23", "/py23", 11.0)]
    return MatrixResult(columns, 9.0, cells, gate("0.5.18", "0.5.23", cells), tmp_path)


def test_matrix_reports_show_every_cell_and_the_unexplained(tmp_path: Path) -> None:
    result = _result(tmp_path)
    assert result.unexplained == [("s2", "0.5.18")]
    assert result.ok  # the gate decides: nothing that passed on 0.5.18 fails on 0.5.23
    md = result.to_markdown()
    assert "| s1 | DETECTED | ~~MISSED~~ k | DETECTED = |" in md
    assert "UNEXPLAINED s2 on 0.5.18" in md and "Gate: 0.5.18 -> 0.5.23: PASS" in md
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["scenarios"]["s1"]["0.5.18"]["reason"] == "the filter absorbs it"
    assert doc["gate"]["fixed"] == ["s1", "s2"] and doc["gate"]["ok"]
    page = matrix_html(result)
    assert 'class="unexplained"' in page and "the filter absorbs it" in page and "<table>" in page


def _fake_release(tmp_path: Path, body: str) -> Path:
    site = tmp_path / "fake-site"
    pkg = site / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "alloc.py").write_text(body)
    (pkg / "__pycache__").mkdir()
    return site


def test_patched_interpreter_edits_a_copy_never_the_release(tmp_path: Path, monkeypatch) -> None:
    site = _fake_release(tmp_path, "def free(x):\n    check(x)\n    return x\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    patch = SGLangPatch("drop-check", "srt/alloc.py", "    check(x)\n", "", "the check removed")
    monkeypatch.setattr("canaries.sglang.releases.patches._CATALOGUE", (patch,))
    wrapper, diff = patched_interpreter(Path(sys.executable), "0.0.1", ("drop-check",), tmp_path / "w")
    assert "-    check(x)" in diff
    assert "check(x)" in (site / "sglang" / "srt" / "alloc.py").read_text()  # the release untouched
    out = subprocess.run([str(wrapper), "-c", "import inspect, sglang.srt.alloc as a; print(inspect.getsource(a))"],
                         capture_output=True, text=True, check=True).stdout
    assert "check(x)" not in out
    assert not (tmp_path / "w" / "site" / "sglang" / "srt" / "__pycache__").is_symlink()


def test_patched_interpreter_refuses_a_snippet_that_does_not_match(tmp_path: Path, monkeypatch) -> None:
    site = _fake_release(tmp_path, "def free(x):\n    return x\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    patch = SGLangPatch("drop-check", "srt/alloc.py", "    check(x)\n", "", "the check removed")
    monkeypatch.setattr("canaries.sglang.releases.patches._CATALOGUE", (patch,))
    with pytest.raises(ReleaseError, match="occurs 0 times in SGLang 0.0.1's srt/alloc.py"):
        patched_interpreter(Path(sys.executable), "0.0.1", ("drop-check",), tmp_path / "w")


@pytest.mark.parametrize(("config", "message"), [
    ("sglang: []\n", "sglang: a non-empty list"),
    ("sglang: [0.5.23]\nwho: 1\n", "unknown field(s) who"),
    ("- 0.5.23\n", "expected a mapping"),
    ("sglang: [0.5.23]\njobs: 0\n", "jobs: a positive integer"),
])
def test_matrix_config_errors_name_the_file_and_field(tmp_path: Path, capsys, config: str, message: str) -> None:
    path = tmp_path / "matrix.yaml"
    path.write_text(config)
    assert canary(["matrix", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_matrix_gate_needs_both_releases(capsys) -> None:
    assert canary(["matrix", "--last", "0.5.23"]) == 2
    assert "both --last and --candidate" in capsys.readouterr().err


def test_matrix_missing_venv_without_build_is_a_usage_error(capsys) -> None:
    assert canary(["matrix", "--sglang", "0.0.1", "--no-build", "-k", "clean-page1-noradix"]) == 2
    assert "make-sglang-venv.sh --version 0.0.1" in capsys.readouterr().err


def _gate(tmp_path: Path, candidate: str) -> tuple[int, str, dict]:
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "matrix", "-k", "corrupt-r2t-zero-page1",
                           "--last", "0.5.23", "--candidate", candidate, "--no-build", "-j", "2",
                           "--report-dir", str(report)], capture_output=True, text=True, cwd=REPO, check=False)
    return proc.returncode, proc.stdout + proc.stderr, json.loads((report / "matrix.json").read_text())


@needs_0523
def test_gate_fails_on_release_with_free_swa_contract_removed(tmp_path: Path) -> None:
    code, out, doc = _gate(tmp_path, "0.5.23+free-swa-contract-removed")
    assert code == 1, out
    assert "REGRESSION corrupt-r2t-zero-page1" in out and "GATE FAILED" in out
    assert doc["gate"]["regressions"] == ["corrupt-r2t-zero-page1"]
    assert (tmp_path / "report" / "patch-0.5.23+free-swa-contract-removed.diff").read_text().count("-        expect(") == 1


@needs_0523
def test_gate_passes_on_identical_release(tmp_path: Path) -> None:
    code, out, doc = _gate(tmp_path, "0.5.23+identity")
    assert code == 0, out
    assert doc["gate"]["regressions"] == [] and doc["gate"]["ok"]
    cells = doc["scenarios"]["corrupt-r2t-zero-page1"]
    assert cells["0.5.23"]["verdict"] == cells["0.5.23+identity"]["verdict"] == "DETECTED"



@pytest.mark.skipif(not ALL_VENVS, reason="needs every release's venv: bash scripts/make-sglang-venv.sh "
                    "--version X for X in 0.5.18 to 0.5.22 (and without --version for 0.5.23)")
@pytest.mark.timeout(1200)  # six release columns beside native: several minutes on 2 cores
def test_matrix_over_every_release_explains_every_cell(tmp_path: Path) -> None:
    report = tmp_path / "matrix"
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "matrix", "--sglang", ",".join(RELEASES),
                           "--no-build", "-j", "2", "--report-dir", str(report)],
                          capture_output=True, text=True, cwd=REPO, check=False,
                          env={**os.environ, "CANARY_PROGRESS": "plain"})
    doc = json.loads((report / "matrix.json").read_text())
    assert proc.returncode == 0, doc["unexplained"] or proc.stdout[-3000:]
    assert doc["unexplained"] == [] and doc["native_failures"] == []
    cells = doc["scenarios"]
    # PR #36723's class: caught by swa.peer_mapped from 0.5.20, not before (the filter era).
    row = cells["corrupt-r2t-zero-page1"]
    assert [row[v]["verdict"] for v in RELEASES] == ["WRONG_DETECTOR", "WRONG_DETECTOR"] + ["DETECTED"] * 4
    assert all("swa.peer_mapped" in row[v]["detectors"] for v in RELEASES[2:])
    divergences = {c["label"]: c["divergences"] for c in doc["columns"]}
    assert divergences["0.5.21"] == "sglang-0.5.20.yaml (inherited)"
    assert divergences["0.5.22"].startswith("sglang-0.5.22.yaml")
    assert cells["double-free-swa-page1"]["0.5.19"]["verdict"] == "MISSED"
    assert {c["label"]: c["memory_parts"]["radix_cache"] for c in doc["columns"]} == {
        v: f"sglang-{v}" for v in RELEASES}
    assert (report / "matrix.html").is_file() and "| corrupt-r2t-zero-page1 |" in (report / "matrix.md").read_text()


def test_gate_leaves_a_scenario_one_release_cannot_run_unjudged() -> None:
    cells = {"paged": {"native": _cell("DETECTED", True, "native"), "new": _cell("DETECTED", True),
                       "old": Cell("UNSUPPORTED", (), False, "unsupported", "no CPU path")}}
    result = gate("new", "old", cells)
    assert result.ok and result.regressions == () and result.unjudged == ("paged",)


@needs_0523
def test_parity_with_sglang_allocator_runs_only_the_allocator_from_the_release(tmp_path: Path) -> None:
    report = tmp_path / "parity"
    assert canary(["parity", "-k", "clean-page1-radix", "--memory", "sglang-allocator", "--engine-python",
                   str(VENV_0523), "--report-dir", str(report)]) == 0
    verdict = json.loads((report / "sglang" / "clean-page1-radix" / "verdict.json").read_text())
    assert verdict["extra"]["memory_parts"] == {"allocator": "sglang-0.5.23", "radix_cache": "native",
                                                "req_to_token": "native"}


def test_gate_counts_a_regression_only_when_its_reruns_confirm_it() -> None:
    from canaries.confirm import Confirmation

    cells = {"held": {"native": _cell("CLEAN", True, "native"), "last": _cell("CLEAN", True),
                      "cand": Cell("FALSE_ALARM", ("idle.full_ledger",), False, "unexplained")},
             "flips": {"native": _cell("CLEAN", True, "native"), "last": _cell("CLEAN", True),
                       "cand": Cell("INCONCLUSIVE", (), False, "unexplained")}}
    confirmations = {
        "held": Confirmation("held", (("CLEAN", True),) * 3, (("FALSE_ALARM", False),) * 3),
        "flips": Confirmation("flips", (("CLEAN", True),) * 3,
                              (("INCONCLUSIVE", False), ("CLEAN", True), ("CLEAN", True)))}
    result = gate("last", "cand", cells, confirmations)
    assert result.regressions == ("held",) and result.flaky == ("flips",) and not result.ok
    assert confirmations["flips"].flaky and not confirmations["held"].flaky
    warn = gate("last", "cand", {"flips": cells["flips"]}, confirmations)
    assert warn.ok and warn.flaky == ("flips",)  # --flaky warn (default): shown, not failing
    assert not gate("last", "cand", {"flips": cells["flips"]}, confirmations, flaky="fail").ok


def test_gate_keeps_a_cell_the_harness_failed_apart() -> None:
    cells = {"s": {"native": _cell("CLEAN", True, "native"), "last": _cell("CLEAN", True),
                   "cand": Cell("INCONCLUSIVE", (), False, "harness", "ours: harness error: oracle failed")}}
    result = gate("last", "cand", cells)
    assert result.ok and result.regressions == () and result.harness == ("s",)
    md = MatrixResult([Column("last", "0.5.23", "/py", 1.0), Column("cand", "0.5.23", "/py", 1.0)], 1.0,
                      cells, result, Path("/tmp")).to_markdown()
    assert "INCONCLUSIVE~~ h" in md and "the harness failed a cell" in md
