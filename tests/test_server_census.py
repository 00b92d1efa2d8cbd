"""The suite's census inside SGLang's scheduler (canaries/sglang/server/census.py): what SGLang's own
checks cannot see on its real server, and the planted regressions it kills there.

Needs SGLang 0.5.23's server venv (`bash scripts/make-sglang-venv.sh --server`); each test skips,
naming it, without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.runner import run_scenario
from canaries.scenario import load_scenario
from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "configs" / "scenarios"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _server_python() -> Path:
    python = find_python("0.5.23", server=True)
    if python is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    return python


def test_catalogue_patches_apply_once_to_the_installed_release(tmp_path: Path) -> None:
    from canaries.sglang.releases.patches import package_dir, patch_catalogue

    package = package_dir(_server_python())
    for patch in patch_catalogue().values():
        text = (package / patch.file).read_text(encoding="utf-8")
        assert text.count(patch.old) == 1, f"{patch.name}: its snippet occurs {text.count(patch.old)} times"


def test_leaked_request_is_seen_by_the_census_where_sglangs_idle_check_only_counts(tmp_path: Path) -> None:
    """leak-request-census-idle (MISSED on the server before the census: SGLang's ledgers fire, the
    scenario also names census.slot_owner): the census finds the slots with no owner at the idle
    pass, and the lock the leaked request's prefill took (SGLang locks a prompt once prefilled)."""
    _server_python()
    record = run_scenario(load_scenario(SCENARIOS / "leak-request-census-idle.yaml"), tmp_path / "run",
                          runtime="sglang-server")
    assert record.verdict == "DETECTED", record.reason
    fired = {f["detector"] for f in record.firings}
    assert {"census.slot_owner", "census.lock_count", "idle.radix_sanity"} <= fired
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (armed,) = [e for e in events if e["kind"] == "census"]
    assert armed["armed"] is True
    idle = [e for e in events if e["kind"] == "idle_check"]
    assert idle and idle[-1]["census"]["failures"]["census.slot_owner"] > 0
    assert idle[-1]["census_cost"]["idle_ms"] >= 0


def _gate(report: Path, scenario: Path, candidate: str, census: str) -> tuple[int, dict, str]:
    env = {**os.environ, "CANARY_SERVER_CENSUS": census}
    proc = subprocess.run(
        [sys.executable, "-m", "canaries.cli", "matrix", "--runtime", "sglang-server", str(scenario),
         "--last", "0.5.23", "--candidate", candidate, "--no-build", "-j", "1", "--columns", "2",
         "--report-dir", str(report)],
        capture_output=True, text=True, cwd=REPO, env=env, check=False)
    return proc.returncode, json.loads((report / "matrix.json").read_text(encoding="utf-8")), proc.stdout + proc.stderr


@pytest.mark.parametrize(("candidate", "scenario_name"), [
    ("0.5.23+relock-same-node-leaks", "clean-radix-two-node-match-page16"),
    ("0.5.23+unlock-only-when-checkpointed", "clean-server-retraction-radix"),
    ("0.5.23+admission-pin-kept", "clean-cache-hits"),
    ("0.5.23+abort-release-drops-only-swa", "clean-chunked-lock-one-window"),
])
def test_census_fails_the_gate_on_a_lock_leak_sglangs_own_checks_pass(tmp_path: Path, candidate: str,
                                                                     scenario_name: str) -> None:
    """Four lock-lifetime regressions of the catalogue (canaries/sglang/releases/patches.py): an
    insert that adds no page relocks its node, a retracted request keeps its lock, the prefill
    adder's pin of a matched prefix is never taken out, an aborted request's release drops only its lock's SWA part. Each leaves a lock no request holds; no
    answer changes and SGLang's idle ledger balances (the node is protected instead of
    evictable): with SGLang's checks alone the gate passes; with the census it fails, naming the
    control and census.lock_count."""
    _server_python()
    scenario = SCENARIOS / f"{scenario_name}.yaml"
    code, doc, out = _gate(tmp_path / "sglang-only", scenario, candidate, "off")
    assert code == 0 and doc["gate"]["regressions"] == [], out
    assert doc["scenarios"][scenario.stem][candidate]["verdict"] == "CLEAN"
    code, doc, out = _gate(tmp_path / "census", scenario, candidate, "on")
    assert code == 1 and doc["gate"]["regressions"] == [scenario.stem], out
    cell = doc["scenarios"][scenario.stem][candidate]
    assert cell["verdict"] == "FALSE_ALARM" and "census.lock_count" in cell["detectors"], cell
    assert not {"idle.full_ledger", "idle.swa_ledger"} & set(cell["detectors"])
