"""`canary validate --runtime sglang-server` names what SGLang's server cannot run, at its line:
engine regressions a scenario plants in our engine (and any engine knob or kind it cannot take)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCENARIO = """\
name: server-refusals
seed: 3
engine: {profile: cpu-tiny}
regressions: [kv_canary.chain-never-checked]
workload: {requests: 2, prompt_tokens: 24, max_new_tokens: 8}
expect: {clean: true}
"""


def _validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "canaries.cli", "validate", *args], cwd=REPO,
                          capture_output=True, text=True, check=False)


def test_validate_for_the_server_runtime_names_each_refusal_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(SCENARIO))
    assert _validate(str(path)).returncode == 0  # the local runtime runs it
    proc = _validate("--runtime", "sglang-server", str(path))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    assert f"{path}:4: regressions: --runtime sglang-server: the server runs SGLang's code" in lines[0]


def test_validate_for_the_server_runtime_passes_a_scenario_it_can_run(tmp_path: Path) -> None:
    proc = _validate("--runtime", "sglang-server", str(REPO / "configs/scenarios/corrupt-r2t-strict.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
