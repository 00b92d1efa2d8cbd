"""The suite's self-tests: a scenario that cannot pass must not pass, and no engine outlives a run.

Each live test runs a real engine from a scenario written to tmp_path.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from canaries.cli import main as canary_main
from canaries.cli import match_k, parse_shard, select
from canaries.conftest import sigint_as_on_a_terminal
from canaries.driver import make_plan
from canaries.runner import run_scenario, spec_for
from canaries.runtime import get_runtime
from canaries.scenario import load_scenario
from canaries.verdict import Observation, judge

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = {"requests": 4, "concurrency": 2, "prompt_tokens": [24, 40], "max_new_tokens": 32}


def _doc(name: str, **over) -> dict:
    doc = {"name": name, "seed": 3,
           "engine": {"profile": "cpu-tiny", "page_size": 1, "invariant_check": "strict",
                      "kv_canary": "log"},
           "workload": dict(WORKLOAD)}
    doc.update(over)
    return doc


@pytest.fixture
def run(write_scenario, tmp_path: Path, assert_no_engine_left):
    """Run a scenario mapping end to end under tmp_path/<name>; no engine may outlive it."""

    def go(doc: dict, **kw):
        scenario = load_scenario(write_scenario(doc))
        run_dir = tmp_path / doc["name"]
        record = run_scenario(scenario, run_dir, **kw)
        assert_no_engine_left(run_dir)
        return record

    return go


# ---- verdicts that must fail -------------------------------------------------------------------


@pytest.mark.slow
def test_trigger_that_never_matches_is_not_injected(run):
    doc = _doc("never-lands", perturbations=[
        {"kind": "flip_kv_byte", "trigger": {"at_step": 100000},
         "target": {"request": 0, "positions": "last"}}],
        expect={"fires": ["kv_canary.verify_real_kv_hash"]})
    record = run(doc)
    assert record.verdict == "NOT_INJECTED", record.reason
    assert not record.passed


@pytest.mark.slow
def test_detection_outside_within_steps_is_late(run):
    # A leaked request is only seen by the idle ledgers, once the workload has drained.
    doc = _doc("late-ledger", engine={"profile": "cpu-tiny", "invariant_check": "strict",
                                      "strict_mem_check_during_idle": False, "kv_canary": "off"},
               perturbations=[{"kind": "leak_request", "trigger": {"event": "request_finish"},
                               "target": {"request": 0}}],
               expect={"fires": ["idle.req_rows_ledger"], "within_steps": 0})
    record = run(doc)
    assert record.verdict == "LATE", record.reason
    assert not record.passed


@pytest.mark.slow
def test_a_silent_detector_that_fires_is_wrong_detector(run):
    doc = _doc("loud-silent", engine={"profile": "cpu-tiny", "invariant_check": "strict",
                                      "kv_canary": "off"},
               perturbations=[{"kind": "double_free_swa", "trigger": {"event": "first_swa_eviction"},
                               "target": {"request": 0}}],
               expect={"fires": ["alloc.double_free"], "silent": ["swa.peer_mapped"]})
    record = run(doc)
    assert record.verdict == "WRONG_DETECTOR", record.reason
    assert not record.passed


def test_a_control_whose_invariant_fires_is_a_false_alarm(write_scenario):
    scenario = load_scenario(write_scenario(_doc("control", expect={"clean": True})))
    events = [
        {"seq": 1, "step": 0, "kind": "engine_start", "config": scenario.engine_knobs},
        {"seq": 2, "step": 5, "kind": "invariant_firing", "invariant": "swa.peer_mapped",
         "bucket": "FATAL_UNCONTAINABLE", "level": "STRICT"},
        {"seq": 3, "step": 5, "kind": "shutdown"},
    ]
    responses = [{"rid": f"r{i:04d}", "status": 200, "output_ids": [1]} for i in range(4)]
    record = judge(scenario, Observation(events, responses, 0, False, []))
    assert record.verdict == "FALSE_ALARM", record.reason
    assert not record.passed


@pytest.mark.slow
def test_an_engine_killed_from_outside_is_inconclusive(run):
    doc = _doc("killed", workload={**WORKLOAD, "requests": 8, "max_new_tokens": 64},
               expect={"clean": True})
    pids = []

    def kill_soon(rt) -> None:
        pids.append(rt.pid)
        threading.Timer(0.3, rt.kill, args=(signal.SIGKILL,)).start()

    record = run(doc, on_started=kill_soon)
    assert record.verdict == "INCONCLUSIVE", record.reason
    assert not record.passed
    assert pids and _stat_is_not_engine(pids[0])


def _stat_is_not_engine(pid: int) -> bool:
    try:
        return "engine_stub" not in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return True


@pytest.mark.slow
def test_a_control_run_passes_and_leaves_no_engine(run, tmp_path):
    record = run(_doc("control-ok", expect={"clean": True}))
    assert record.verdict == "CLEAN", record.reason
    run_dir = tmp_path / "control-ok"
    for name in ("spec.json", "engine.log", "events.jsonl", "responses.jsonl", "verdict.json"):
        assert (run_dir / name).exists(), name


# ---- the runtime ------------------------------------------------------------------------------


def test_an_engine_that_cannot_start_raises_with_its_log(tmp_path, assert_no_engine_left):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "bad", "engine": {"page_size": 0}}')
    with get_runtime("local") as rt, pytest.raises(RuntimeError, match="page_size"):
        rt.start(bad, tmp_path / "run")
    assert rt.exit_code is not None
    assert_no_engine_left(bad)


def test_unknown_runtime_names_the_valid_ones():
    with pytest.raises(ValueError, match="local"):
        get_runtime("podman")


@pytest.mark.slow
def test_runtime_stops_the_engine_on_an_exception(write_scenario, tmp_path, assert_no_engine_left):
    scenario = load_scenario(write_scenario(_doc("ctx", expect={"clean": True})))
    import json

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_for(scenario)))
    with pytest.raises(KeyError), get_runtime("local") as rt:  # noqa: PT012
        rt.start(spec, tmp_path / "ctx")
        assert rt.running
        raise KeyError("boom")
    assert not rt.running
    assert rt.exit_code == 0  # SIGTERM drains and exits cleanly
    assert_no_engine_left(spec)


@pytest.mark.slow
def test_ctrl_c_stops_every_engine_and_exits_130(tmp_path, assert_no_engine_left):
    report = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "canaries.cli", "run", "-k", "clean-page1", "--jobs", "2",
         "--report-dir", str(report)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, preexec_fn=sigint_as_on_a_terminal)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(report.glob("*/engine.log")):
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert_no_engine_left(report)


# ---- selection and prompts ----------------------------------------------------------------------


def test_k_expressions():
    assert match_k("strip", "strip-mapping-page1")
    assert match_k("STRIP", "strip-mapping-page1")
    assert match_k("clean or strip", "clean-page1-radix")
    assert not match_k("not clean", "clean-page1-radix")
    assert match_k("page1 and not noradix", "clean-page1-radix")
    assert not match_k("page1 and not noradix", "clean-page1-noradix")
    assert match_k("(a or strip) and page16", "strip-mapping-page16")


def test_shards_partition_the_sorted_list():
    class S:
        def __init__(self, name):
            self.name = name

    items = [S(n) for n in "edcba"]
    shards = [[s.name for s in select(items, shard=f"{i}/2")] for i in (1, 2)]
    assert shards == [["a", "c", "e"], ["b", "d"]]
    assert parse_shard("3/3") == (3, 3)
    for bad in ("0/2", "3/2", "x"):
        with pytest.raises(Exception, match="shard"):
            parse_shard(bad)


def test_prompts_are_deterministic_and_printable():
    from canaries.scenario import Workload

    wl = Workload(requests=6, concurrency=2, prompt_tokens=(10, 20), shared_prefix_tokens=4,
                  unique_prompts=True)
    a, b = [p.prompt for p in make_plan(wl, 7)], [p.prompt for p in make_plan(wl, 7)]
    assert a == b and a != [p.prompt for p in make_plan(wl, 8)]
    assert all(32 <= t <= 126 for p in a for t in p)
    assert all(10 <= len(p) <= 20 for p in a)
    assert len({tuple(p[:4]) for p in a}) == 1
    assert len({tuple(p) for p in a}) == 6


# ---- the other subcommands -------------------------------------------------------------------


def test_validate_reports_file_line_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nengine: {page_size: 1, nonsense: 3}\nworkload: {requests: 2}\n"
                   "expect: {clean: true}\n")
    assert canary_main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:2:" in out and "nonsense" in out


def test_new_copies_and_refuses_to_overwrite(tmp_path, capsys):
    src = REPO / "configs" / "scenarios" / "clean-page1-radix.yaml"
    assert canary_main(["new", "my-copy", "--from", str(src), "--dir", str(tmp_path)]) == 0
    text = (tmp_path / "my-copy.yaml").read_text()
    assert "name: my-copy" in text
    assert canary_main(["validate", str(tmp_path / "my-copy.yaml")]) == 0
    assert canary_main(["new", "my-copy", "--from", str(src), "--dir", str(tmp_path)]) == 2


def test_run_with_no_match_is_a_usage_error(capsys):
    assert canary_main(["run", "-k", "no-such-scenario-anywhere"]) == 2


def test_list_and_schema(capsys):
    for what in ("kinds", "invariants", "scenarios", "profiles"):
        assert canary_main(["list", what]) == 0
    out = capsys.readouterr().out
    assert "strip_swa_mapping" in out and "swa.peer_mapped" in out and "cpu-tiny" in out
    assert canary_main(["schema"]) == 0
    assert '"properties"' in capsys.readouterr().out


# ---- the output oracle ------------------------------------------------------------------------


def test_teacher_forced_oracle_equals_the_step_by_step_reference():
    import random

    from canaries.driver import Planned
    from canaries.runner import _reference, oracle_mismatches

    cfg = {"layer_pattern": "SFSS", "window": 16, "hidden_size": 32, "num_heads": 2, "seed": 4}
    key = ("SFSS", 16, 32, 2, 4)
    rng = random.Random(1)
    prompts = [[rng.randint(32, 126) for _ in range(rng.randint(20, 30))] for _ in range(2)]
    refs = [list(_reference(key, tuple(p), 24)) for p in prompts]
    plan = [Planned(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    good = [{"rid": f"r{i}", "output_ids": r} for i, r in enumerate(refs)]
    assert oracle_mismatches(cfg, plan, good) == []
    bad = [dict(good[0]), {"rid": "r1", "output_ids": refs[1][:7] + [(refs[1][7] + 1) % 256]
                           + refs[1][8:]}]
    (mismatch,) = oracle_mismatches(cfg, plan, bad)
    assert mismatch["rid"] == "r1" and mismatch["first_diff"] == 7
    assert mismatch["expected"] == refs[1]
    short = [dict(good[0]), {"rid": "r1", "output_ids": refs[1][:10]}]
    assert [m["first_diff"] for m in oracle_mismatches(cfg, plan, short)] == [10]


@pytest.mark.slow
def test_same_seed_same_scenario_same_trace(tmp_path):
    """The lockstep gate and in-order rids make the event trace a function of the seed."""
    from engine_stub.events import read_events, trace_of

    scenario = load_scenario(REPO / "configs" / "scenarios" / "swap-next-token-probability.yaml")
    traces = []
    for i in range(2):
        run_dir = tmp_path / f"run{i}"
        record = run_scenario(scenario, run_dir)
        assert record.passed, record.reason
        traces.append(trace_of(read_events(run_dir / "events.jsonl")))
    assert traces[0] == traces[1]
