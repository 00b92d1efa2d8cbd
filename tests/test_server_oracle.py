"""The sglang-server runtime's answer oracle: a reference server's answers to the same plan (here
read from its cache: no server needed), held against a control's answers for its verdict, and
against a silent perturbed run's as evidence that the damage was read."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from canaries.driver import make_plan
from canaries.scenario import load_scenario
from canaries.sglang.oracle import ServerAnswerOracle, ServerOracle, ServerReference
from canaries.watchdog import Patience

REPO = Path(__file__).resolve().parents[1]
PLAIN = ServerReference.of_release("/venv/bin/python", "0.5.23")


def _oracle_with_cached_answers(tmp_path: Path, answers: dict[str, list[int]], name: str = "clean-page1-noradix",
                                reference: ServerReference = PLAIN) -> ServerAnswerOracle:
    scenario = load_scenario(REPO / "configs" / "scenarios" / f"{name}.yaml")
    spec = {"engine": scenario.engine_knobs, "perturbations": []}
    plan = make_plan(scenario.workload, scenario.seed)
    run_dir = tmp_path / "report" / scenario.name
    run_dir.mkdir(parents=True)
    cache = ServerOracle(run_dir.parent / ".server-oracle", reference.engine(spec["engine"]), plan,
                         reference.describe() + f" [{reference.python}]")
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(json.dumps(answers))
    return ServerAnswerOracle(scenario, spec, plan, run_dir, Patience(), reference)


def test_server_oracle_names_an_answer_that_differs_from_the_reference(tmp_path: Path) -> None:
    oracle = _oracle_with_cached_answers(tmp_path, {"r0000": [1, 2, 3], "r0001": [4, 5, 6]})
    responses = [{"rid": "r0000", "output_ids": [1, 2, 3]}, {"rid": "r0001", "output_ids": [4, 9, 6]}]
    oracle.start(responses)
    mismatches, error = oracle.result()
    assert error is None
    assert [(m["rid"], m["first_diff"]) for m in mismatches] == [("r0001", 1)]
    assert oracle.record()["reference"]["label"] == "0.5.23" and oracle.record()["judged"]


def test_server_oracle_holds_nothing_against_a_run_where_a_detector_fired(tmp_path: Path) -> None:
    oracle = _oracle_with_cached_answers(tmp_path, {"r0000": [1, 2, 3]})
    events = tmp_path / "report" / "clean-page1-noradix" / "events.jsonl"
    events.write_text(json.dumps({"kind": "invariant_firing", "invariant": "swa.peer_mapped", "step": 3}) + "\n")
    oracle.start([{"rid": "r0000", "output_ids": [7, 7, 7]}])
    assert oracle.result() == ([], None)
    assert oracle.record() is None


def test_silent_perturbed_run_records_the_answers_that_differ_without_judging_by_them(tmp_path: Path) -> None:
    oracle = _oracle_with_cached_answers(tmp_path, {"r0000": [1, 2, 3], "r0001": [4, 5, 6]},
                                         name="swap-next-token")
    oracle.start([{"rid": "r0000", "output_ids": [1, 2, 3]}, {"rid": "r0001", "output_ids": [4, 5, 7]}])
    assert oracle.result() == ([], None)  # a perturbed run's verdict is not the oracle's
    assert oracle.record()["differs"] == [{"rid": "r0001", "first_diff": 2}]


def test_silent_perturbed_run_whose_server_fires_as_it_stops_starts_no_reference(tmp_path: Path) -> None:
    # No answers kept: a reference wanted here would start a server from an interpreter that does
    # not exist, and say so in the record. The firing lands after the drive, at the last idle pass.
    oracle = _oracle_with_cached_answers(tmp_path, {}, name="swap-next-token")
    next(iter((tmp_path / "report" / ".server-oracle").glob("*.json"))).unlink()
    events = tmp_path / "report" / "swap-next-token" / "events.jsonl"
    events.write_text("")
    oracle.start([{"rid": "r0000", "output_ids": [1, 2, 3]}])
    events.write_text(json.dumps({"kind": "invariant_firing", "invariant": "idle.swa_ledger", "step": 9}) + "\n")
    assert oracle.result() == ([], None)
    assert oracle.record() is None


def test_plain_reference_runs_no_cache_reuse_no_eviction_one_request_at_a_time() -> None:
    engine = {"radix_cache": True, "full_pool_tokens": 512, "swa_pool_tokens": 96, "max_running_requests": 4,
              "kv_canary": "log", "invariant_check": "strict", "page_size": 16}
    plain = PLAIN.engine(engine)
    assert plain == {**engine, "radix_cache": False, "swa_pool_tokens": 512, "max_running_requests": 1,
                     "kv_canary": "off", "invariant_check": "off", "strict_mem_check_during_idle": False}
    assert int(PLAIN.env()["SGLANG_SWA_EVICTION_INTERVAL"]) > 100_000
    last = ServerReference("/last/bin/python", "0.5.22", plain=False)
    assert last.engine(engine) == engine and last.env() == {}
    assert "0.5.22" in last.describe() and "plain" in PLAIN.describe()


def test_server_reference_refuses_an_empty_interpreter() -> None:
    with pytest.raises(ValueError, match="interpreter"):
        ServerReference("", "0.5.23", plain=True)


def test_two_runs_needing_the_same_reference_at_once_compute_it_once(tmp_path: Path) -> None:
    scenario = load_scenario(REPO / "configs" / "scenarios" / "clean-page1-noradix.yaml")
    plan = make_plan(scenario.workload, scenario.seed)
    engine = PLAIN.engine(scenario.engine_knobs)
    computed: list[int] = []
    first_started = threading.Event()

    def compute() -> list[dict]:
        computed.append(1)
        first_started.set()
        time.sleep(0.3)  # the second caller arrives while this one is still computing
        return [{"rid": p.rid, "output_ids": [7, len(computed)]} for p in plan]

    answers: list[dict] = []
    threads = [threading.Thread(target=lambda: answers.append(
        ServerOracle(tmp_path, engine, plan, PLAIN.describe()).reference(compute))) for _ in range(2)]
    threads[0].start()
    assert first_started.wait(10)
    threads[1].start()
    for thread in threads:
        thread.join(10)
    assert len(computed) == 1
    assert answers[0] == answers[1] == {p.rid: [7, 1] for p in plan}
