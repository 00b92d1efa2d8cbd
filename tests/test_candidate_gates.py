"""The pre-release gate on every candidate form, end to end: a pull request's diff against a
release, a wheel and a source checkout (each made here from the installed 0.5.23, so no network
is needed beyond the package index), and a release built without a lock.

Each needs SGLang 0.5.23's venv (scripts/make-sglang-venv.sh) and skips, saying so, without it.
The wheel and tree tests build a venv of their own (torch plus 0.5.23's lock as the first
guess, a minute or two) and remove it afterwards.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from canaries.sglang.releases import SGLangSource
from canaries.sglang.releases.clone import CLONED_FROM
from canaries.sglang.releases.locks import read_lock
from canaries.sglang.releases.venvs import find_python, venv_for

REPO = Path(__file__).resolve().parents[1]
REVERT_DIFF = REPO / "configs" / "sglang" / "diffs" / "revert-pr-36723-0.5.23.diff"
SCENARIO = "corrupt-r2t-zero-page1"


def _venv_python(version: str) -> Path | None:
    """The interpreter of `version`'s venv here, as `canary matrix` finds it, or None."""
    return find_python(version)


VENV_0523 = _venv_python("0.5.23")
needs_0523 = pytest.mark.skipif(VENV_0523 is None, reason="no SGLang 0.5.23 venv: run "
                                "`bash scripts/make-sglang-venv.sh`")
# A wheel or tree column builds its venv first (torch alone is a minute or more).
pytestmark = [pytest.mark.slow, needs_0523, pytest.mark.timeout(1200)]


def _matrix(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "matrix", "-k", SCENARIO, "-j", "2",
                           "--report-dir", str(report), *args],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=900)
    doc = json.loads((report / "matrix.json").read_text()) if (report / "matrix.json").is_file() else {}
    return proc.returncode, proc.stdout + proc.stderr, doc


def _package_dir() -> Path:
    out = subprocess.run([str(VENV_0523), "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out).parent


def test_gate_fails_on_a_diff_reverting_pr_36723(tmp_path: Path) -> None:
    code, out, doc = _matrix(tmp_path, "--no-build", "--last", "0.5.23", "--candidate", f"0.5.23+{REVERT_DIFF}")
    assert code == 1, out
    candidate = f"0.5.23+{REVERT_DIFF.name}"
    assert doc["gate"]["regressions"] == [SCENARIO], out
    assert f"REGRESSION {SCENARIO}" in out and "GATE FAILED" in out
    column = next(c for c in doc["columns"] if c["label"] == candidate)
    assert column["provenance"]["diffs"][0]["sha256"], column


def test_gate_passes_on_an_empty_diff(tmp_path: Path) -> None:
    empty = tmp_path / "empty.diff"
    empty.write_text("", encoding="utf-8")
    code, out, doc = _matrix(tmp_path, "--no-build", "--last", "0.5.23", "--candidate", f"0.5.23+{empty}")
    assert code == 0, out
    assert doc["gate"]["ok"] and doc["gate"]["regressions"] == []


def _wheel_from_installed(tmp_path: Path) -> Path:
    """sglang 0.5.23's installed files as a wheel (stored, not compressed: it only has to install)."""
    package = _package_dir()
    site = package.parent
    info = next(site.glob("sglang-0.5.23.dist-info"))
    wheel = tmp_path / "sglang-0.5.23-cp311-cp311-linux_x86_64.whl"
    records = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as out:
        for path in sorted(package.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                name = str(path.relative_to(site))
                out.write(path, name)
                records.append(name)
        for name in ("METADATA", "WHEEL"):
            out.write(info / name, f"{info.name}/{name}")
            records.append(f"{info.name}/{name}")
        records.append(f"{info.name}/RECORD")
        table = io.StringIO()  # CSV: some of sglang's file names hold commas
        csv.writer(table, lineterminator="\n").writerows([name, "", ""] for name in records)
        out.writestr(f"{info.name}/RECORD", table.getvalue())
    return wheel


def test_wheel_candidate_builds_its_venv_and_gates_like_its_release(tmp_path: Path) -> None:
    wheel = _wheel_from_installed(tmp_path)
    venv, _ = venv_for(SGLangSource("wheel", "0.5.23", str(wheel)))
    try:
        code, out, doc = _matrix(tmp_path, "--last", "0.5.23", "--candidate", str(wheel))
        assert code == 0, out[-3000:]
        column = next(c for c in doc["columns"] if c["label"] == f"wheel:{wheel.name}")
        assert column["provenance"]["kind"] == "wheel" and len(column["provenance"]["sha256"]) == 64
        cells = doc["scenarios"][SCENARIO]
        assert cells["0.5.23"]["verdict"] == cells[f"wheel:{wheel.name}"]["verdict"] == "DETECTED"
        lock = read_lock(venv / "sglang-closure.lock")
        assert lock.version == "0.5.23" and len(lock.pins) > 20
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_tree_candidate_builds_its_venv_and_records_its_commit(tmp_path: Path) -> None:
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(_package_dir(), checkout / "python" / "sglang",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "python" / "pyproject.toml").write_text(
        '[project]\nname = "sglang"\ndynamic = ["version"]\ndependencies = ["numpy", "transformers==5.19.0"]\n',
        encoding="utf-8")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    venv, _ = venv_for(SGLangSource.parse(str(checkout)))
    try:
        code, out, doc = _matrix(tmp_path, "--last", "0.5.23", "--candidate", str(checkout))
        assert code == 0, out[-3000:]
        column = next(c for c in doc["columns"] if c["label"].startswith("tree:"))
        assert column["provenance"]["commit"] == commit and column["provenance"]["dirty"] is False
        assert doc["scenarios"][SCENARIO][column["label"]]["verdict"] == "DETECTED"
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_raw_checkout_at_its_release_tag_gates_like_its_release(tmp_path: Path) -> None:
    """A plain `git clone` of SGLang: no build step ran, so no generated sglang/_version.py; its
    version is `git describe`'s (the release tag), and its venv starts from 0.5.23's."""
    checkout = tmp_path / "sglang"
    shutil.copytree(_package_dir(), checkout / "python" / "sglang",
                    ignore=shutil.ignore_patterns("__pycache__", "_version.py"))
    (checkout / "python" / "pyproject.toml").write_text(
        '[project]\nname = "sglang"\ndynamic = ["version"]\ndependencies = ["numpy"]\n', encoding="utf-8")
    (checkout / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v0.5.23"], check=True)
    subprocess.run([*git, "tag", "v0.5.23"], check=True)
    node = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    source = SGLangSource.parse(str(checkout))
    assert source.kind == "tree" and source.version == "0.5.23"
    venv, _ = venv_for(source)
    try:
        code, out, doc = _matrix(tmp_path, "--last", "0.5.23", "--candidate", str(checkout))
        assert code == 0, out[-3000:]
        column = next(c for c in doc["columns"] if c["label"] == "tree:sglang")
        assert column["version"] == "0.5.23"
        assert column["provenance"]["version_from"] == f"git describe v0.5.23-0-g{node}"
        assert doc["scenarios"][SCENARIO]["tree:sglang"]["verdict"] == "DETECTED"
        assert doc["gate"]["ok"] and doc["gate"]["regressions"] == []
        assert (venv / CLONED_FROM).is_file()  # built from a release's venv: torch not installed again
    finally:
        shutil.rmtree(venv, ignore_errors=True)
