"""A hang is judged by the engine's progress: a slow engine is not hung, a stalled one is, fast.

The engine's test-only `step_delay_s` knob waits before every step: a small delay makes a slow
engine (a loaded runner, a GPU shared by eight engines), a huge one an engine that never steps.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from canaries.conftest import engines_under
from canaries.fuzz.oracle import judge_run
from canaries.runner import run_scenario
from canaries.scenario import load_scenario
from canaries.watchdog import Patience

CONTROL = {
    "seed": 4,
    "engine": {"profile": "cpu-tiny", "page_size": 1, "radix_cache": True, "invariant_check": "strict",
               "kv_canary": "log"},
    "workload": {"requests": 6, "concurrency": 3, "prompt_tokens": [24, 48], "shared_prefix_tokens": 8,
                 "max_new_tokens": 24},
    "expect": {"clean": True},
}


def _scenario(tmp_path: Path, name: str, step_delay_s: float):
    doc = {"name": name, "description": f"a control whose engine waits {step_delay_s} s before each step",
           **CONTROL, "engine": {**CONTROL["engine"], "step_delay_s": step_delay_s}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return load_scenario(path)


@pytest.mark.slow
def test_slow_engine_that_keeps_stepping_is_judged_on_its_answers_not_hung(tmp_path):
    patience = Patience(stall_s=1.0, hard_cap_s=300, poll_s=0.1)
    scenario = _scenario(tmp_path, "slow-control", 0.1)
    record = run_scenario(scenario, tmp_path / "run", patience=patience)
    assert engines_under(tmp_path) == []
    assert (record.verdict, record.reason) == (
        "CLEAN", "no detector fired and every output matched the no-cache oracle")
    # Its workload outlasted many stall windows: only progress kept it from being called hung.
    assert record.extra["phases_s"]["drive"] > 4 * patience.stall_s
    assert judge_run(scenario, record, tmp_path / "run").outcome == "clean"


@pytest.mark.slow
def test_stalled_engine_is_judged_hung_within_its_stall_window(tmp_path):
    patience = Patience(stall_s=1.5, hard_cap_s=300, poll_s=0.1)
    t0 = time.monotonic()
    scenario = _scenario(tmp_path, "stalled-control", 3600.0)
    record = run_scenario(scenario, tmp_path / "run", patience=patience)
    elapsed = time.monotonic() - t0
    assert engines_under(tmp_path) == []
    assert record.verdict == "INCONCLUSIVE"
    assert record.reason == "the run timed out: no engine progress for 1.5 s with 3 request(s) outstanding"
    assert record.engine_outcome == "timeout"
    assert record.extra["phases_s"]["drive"] < 10 * patience.stall_s
    assert elapsed < 60, f"a stalled engine took {elapsed:.0f}s to judge"
    judged = judge_run(scenario, record, tmp_path / "run")
    assert judged.outcome == "hang"
    assert judged.reason == ("request(s) r0000, r0001, r0002 hung: the run timed out: no engine progress "
                             "for 1.5 s with 3 request(s) outstanding")
