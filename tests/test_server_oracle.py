"""The sglang-server runtime's output oracle: a clean server's answers to the same plan, computed
beside the run (here read from its cache: no server needed) and held against the run's answers."""

from __future__ import annotations

import json
from pathlib import Path

from canaries.driver import make_plan
from canaries.runner import _ServerOracle
from canaries.scenario import load_scenario
from canaries.server.oracle import ServerOracle
from canaries.watchdog import Patience

REPO = Path(__file__).resolve().parents[1]


def _oracle_with_cached_answers(tmp_path: Path, answers: dict[str, list[int]]) -> tuple[_ServerOracle, list]:
    scenario = load_scenario(REPO / "configs" / "scenarios" / "clean-page1-noradix.yaml")
    spec = {"engine": scenario.engine_knobs, "perturbations": []}
    plan = make_plan(scenario.workload, scenario.seed)
    run_dir = tmp_path / "report" / scenario.name
    run_dir.mkdir(parents=True)
    cache = ServerOracle(run_dir.parent / ".server-oracle", spec["engine"], plan, release="0.5.23")
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(json.dumps(answers))
    return _ServerOracle(scenario, spec, plan, run_dir, Patience()), plan


def test_server_oracle_names_an_answer_that_differs_from_the_clean_servers(tmp_path: Path) -> None:
    oracle, plan = _oracle_with_cached_answers(tmp_path, {"r0000": [1, 2, 3], "r0001": [4, 5, 6]})
    responses = [{"rid": "r0000", "output_ids": [1, 2, 3]}, {"rid": "r0001", "output_ids": [4, 9, 6]}]
    oracle.start(responses)
    mismatches, error = oracle.result()
    assert error is None
    assert [(m["rid"], m["first_diff"]) for m in mismatches] == [("r0001", 1)]


def test_server_oracle_holds_nothing_against_a_run_where_a_detector_fired(tmp_path: Path) -> None:
    oracle, _ = _oracle_with_cached_answers(tmp_path, {"r0000": [1, 2, 3]})
    events = tmp_path / "report" / "clean-page1-noradix" / "events.jsonl"
    events.write_text(json.dumps({"kind": "invariant_firing", "invariant": "swa.peer_mapped", "step": 3}) + "\n")
    oracle.start([{"rid": "r0000", "output_ids": [7, 7, 7]}])
    assert oracle.result() == ([], None)
