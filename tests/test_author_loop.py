"""The author's loop never imports torch: `canary validate`, `list`, `schema` and `new` run
in a fresh interpreter and leave torch (and the engine modules that import it) unimported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Engine modules that import torch: none may be loaded by the author's loop either.
HEAVY = ("torch", "engine_stub.scheduler", "engine_stub.model", "engine_stub.mem",
         "engine_stub.kv_canary", "engine_stub.invariants", "engine_stub.perturb.view",
         "canaries.runner")

PROBE = """\
import contextlib, io, json, sys
from canaries.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
heavy = json.loads({heavy!r})
print(json.dumps({{"code": code, "loaded": sorted(m for m in heavy if m in sys.modules)}}))
"""


def _run(*argv: str) -> dict:
    code = PROBE.format(heavy=json.dumps(HEAVY))
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ("validate", "configs/scenarios"),
    ("list", "kinds"),
    ("list", "invariants"),
    ("list", "scenarios"),
    ("list", "profiles"),
    ("schema",),
], ids=lambda argv: " ".join(argv))
def test_command_imports_no_torch(argv: tuple[str, ...]) -> None:
    result = _run(*argv)
    assert result == {"code": 0, "loaded": []}, result


def test_new_imports_no_torch(tmp_path: Path) -> None:
    result = _run("new", "copied", "--from", "strip-mapping-page1", "--dir", str(tmp_path))
    assert result == {"code": 0, "loaded": []}, result
    assert (tmp_path / "copied.yaml").read_text().startswith("name: copied\n")


def test_validate_of_an_invalid_file_imports_no_torch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nperturbations: [{kind: flip_kv_byte, params: {byte: -1}}]\n"
                   "expect: {fires: [kv_canary.verify_real_kv_hash]}\n")
    result = _run("validate", str(bad))
    assert result == {"code": 1, "loaded": []}, result


def test_diff_and_report_import_no_torch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    line = {"scenario": "a", "verdict": "CLEAN", "passed": True, "reason": "ok",
            "signature": "CLEAN||control", "landed": [], "firings": [], "latency": {}, "extra": {}}
    (run / "verdicts.jsonl").write_text(json.dumps(line) + "\n")
    assert _run("diff", str(run), str(run)) == {"code": 0, "loaded": []}
    assert _run("report", str(run)) == {"code": 0, "loaded": []}
    assert (run / "index.html").is_file()


def test_run_into_a_used_report_dir_is_refused_and_keeps_its_files(tmp_path: Path, capsys) -> None:
    from canaries.cli import main

    used = tmp_path / "report"
    used.mkdir()
    (used / "verdicts.jsonl").write_text('{"scenario": "old"}\n')
    assert main(["run", "configs/scenarios/clean-page1-noradix.yaml", "--report-dir", str(used)]) == 2
    assert f"--report-dir {used}: already holds files" in capsys.readouterr().err
    assert (used / "verdicts.jsonl").read_text() == '{"scenario": "old"}\n'
