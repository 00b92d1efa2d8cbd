"""SGLang's own server as the system under test, on this machine's CPU (SGLang 0.5.23, from the
venv `bash scripts/make-sglang-venv.sh --server` builds; skipped, naming it, where there is none).

SGLang's own seed case (`test_self_e2e_perturb_req_to_token`'s situation): a req_to_token entry
pointed at another live slot, with SGLang's invariants and its strict idle check off. On the real
server the project's kind lands on SGLang's own table inside its scheduler process, SGLang's KV
canary reports it, and the run is DISABLED_AS_DECLARED; every process of the server is gone after.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from canaries.runner import run_scenario
from canaries.scenario import load_scenario
from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _require_server_venv() -> None:
    if find_python("0.5.23", server=True) is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")


def _processes_under(path: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if str(path) in line]


def test_seed_case_on_the_real_server_is_disabled_as_declared_and_caught_by_its_canary(tmp_path: Path) -> None:
    _require_server_venv()
    scenario = load_scenario(REPO / "configs" / "scenarios" / "corrupt-r2t-invariants-off.yaml")
    record = run_scenario(scenario, tmp_path / "run", runtime="sglang-server")
    assert record.verdict == "DISABLED_AS_DECLARED", record.reason
    assert "kv_canary.verify_chain_hash" in record.reason
    landed = record.to_dict()["landed"]
    assert landed and landed[0]["perturbation"] == "corrupt_req_to_token" and landed[0]["rid"] == "r0000"
    log = (tmp_path / "run" / "server.log").read_text(encoding="utf-8", errors="replace")
    # The full pool is the engine section's; with the radix cache off SGLang 0.5.23 sizes the SWA
    # pool from its per-request cap, not from the ratio (docs/sglang-server.md).
    assert re.search(r"swa size: \d+, full size: 2048", log)
    assert "kv_canary violation: launch_tag=" in log
    assert _processes_under(tmp_path) == []


def test_request_level_regression_fails_the_real_server_where_memory_sglang_cannot_reach_it(tmp_path: Path) -> None:
    """`release-leaks-last-slot` edits SGLang's `release_kv_cache` (mem_cache/common.py), which only
    SGLang's own scheduler calls: the clean control on the real server is a FALSE_ALARM, SGLang's
    strict idle check reporting the leaked slot (the unmodified release is CLEAN there; the same
    patch under `memory: sglang` is CLEAN too, as that path never runs)."""
    _require_server_venv()
    from canaries.sglang.releases.patches import patched_interpreter

    python, diff = patched_interpreter(find_python("0.5.23", server=True), "0.5.23", ("release-leaks-last-slot",),
                                       tmp_path / "patched")
    assert "owned_kv_len - 1" in diff
    scenario = load_scenario(REPO / "configs" / "scenarios" / "clean-page1-noradix.yaml")
    record = run_scenario(scenario, tmp_path / "run", runtime="sglang-server", engine_python=str(python))
    assert record.verdict == "FALSE_ALARM", record.reason
    assert "idle.full_ledger" in record.reason
    assert _processes_under(tmp_path) == []


def test_allocator_regression_escapes_sglangs_checks_and_not_the_census(tmp_path: Path, monkeypatch) -> None:
    """`free-swa-contract-removed` drops PR #36723's check from SGLang's own `free_swa`: the
    library's corrupt-r2t-zero-page1 (DETECTED by `swa.peer_mapped` on the unmodified release's
    server) lands its perturbation and none of SGLang's checks fires (the census switched off);
    the suite's census, inside the same scheduler, sees the padding slot a request row names (and,
    as the scheduler's timing falls, the SWA peer nobody owns or the ledger drifting with it)."""
    _require_server_venv()
    from canaries.sglang.releases.patches import patched_interpreter
    from canaries.sglang.server.census import CENSUS_ENV

    python, _ = patched_interpreter(find_python("0.5.23", server=True), "0.5.23", ("free-swa-contract-removed",),
                                    tmp_path / "patched")
    scenario = load_scenario(REPO / "configs" / "scenarios" / "corrupt-r2t-zero-page1.yaml")
    monkeypatch.setenv(CENSUS_ENV, "off")
    blind = run_scenario(scenario, tmp_path / "sglang-only", runtime="sglang-server", engine_python=str(python))
    assert blind.verdict == "MISSED", blind.reason
    assert blind.to_dict()["landed"], "the perturbation landed on SGLang's table"
    monkeypatch.delenv(CENSUS_ENV)
    seen = run_scenario(scenario, tmp_path / "census", runtime="sglang-server", engine_python=str(python))
    fired = {f["detector"] for f in seen.firings}
    # Caught, by the wrong detector for the scenario (it expects SGLang's own check): the gate
    # still tells the edited release from the unmodified one, and the census says what it saw.
    assert seen.verdict == "WRONG_DETECTOR" and "census.slot_owner" in fired, seen.reason
    assert "swa.peer_mapped" not in fired and all(d.startswith("census.") for d in fired), fired
    assert _processes_under(tmp_path) == []


def test_window_eviction_kind_lands_in_sglangs_own_eviction_and_its_invariant_detects_it(tmp_path: Path) -> None:
    """`double_free_swa` through the on_window_eviction hook (canaries/sglang/server/site_hooks.py, in
    SGLang's `free_swa_out_of_window_slots`): the window eviction's slots are freed a second time,
    and SGLang's own `free_swa` check (PR #36723's `swa.peer_mapped`) crashes the scheduler."""
    _require_server_venv()
    scenario = load_scenario(REPO / "configs" / "scenarios" / "double-free-swa-page1.yaml")
    record = run_scenario(scenario, tmp_path / "run", runtime="sglang-server")
    assert record.verdict == "DETECTED", record.reason
    assert "swa.peer_mapped" in record.reason
    (landed,) = record.to_dict()["landed"]
    assert landed["perturbation"] == "double_free_swa" and landed["site"] == "on_window_eviction"
    assert landed["after"]["freed_again"] == landed["before"]["freed"] != []
    assert _processes_under(tmp_path) == []


def test_clean_control_on_the_real_server_is_clean_and_records_the_server(tmp_path: Path) -> None:
    """The control the request-level regression turns into a FALSE_ALARM: on the unmodified
    release every answer equals a clean server's, and the verdict records which server ran."""
    _require_server_venv()
    scenario = load_scenario(REPO / "configs" / "scenarios" / "clean-page1-noradix.yaml")
    record = run_scenario(scenario, tmp_path / "run", runtime="sglang-server")
    assert record.verdict == "CLEAN", record.reason
    server = record.extra["server"]
    assert server["sglang_version"] == "0.5.23"
    assert "--skip-server-warmup" in server["args"] and server["env"]["SGLANG_INVARIANT_CHECK"] == "2"
    assert _processes_under(tmp_path) == []


def test_sglangs_own_req_to_token_knob_lands_as_the_scenarios_perturbation_and_its_canary_catches_it(
        tmp_path: Path) -> None:
    """`via: sglang_knob`: SGLang's SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB does the damage, each
    of its lines is the scenario's landing with the entry it rewrote."""
    _require_server_venv()
    scenario = load_scenario(REPO / "configs" / "scenarios" / "sglang-knobs" / "knob-req-to-token-invariants-off.yaml")
    record = run_scenario(scenario, tmp_path / "run", runtime="sglang-server")
    assert record.verdict == "DISABLED_AS_DECLARED", record.reason
    server = record.extra["server"]
    assert server["env"]["SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB"] == "0.25"
    assert server["env"]["SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS"] == "4"
    landed = record.to_dict()["landed"]
    assert landed and landed[0]["site"] == "sglang:kv_canary_perturb" and landed[0]["step"] >= 4
    assert landed[0]["damage"][0]["kind"] == "req_to_token"
