"""`workload.extra_requests`: explicit requests after the generated ones (their own prompt,
max_new_tokens and expected answer; follow-up turns made from an earlier answer)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from canaries.driver import FollowUp, make_plan
from canaries.scenario import Expect, Problem, Scenario, ScenarioError, Workload, load_scenario
from canaries.verdict import Observation, judge

HEAD = """\
name: s
seed: 5
engine: {profile: cpu-tiny}
workload:
  requests: 3
  prompt_tokens: [20, 30]
  max_new_tokens: 10
  extra_requests:
"""
TAIL = "expect: {clean: true}\n"


def load(tmp_path: Path, extras: str) -> Scenario:
    path = tmp_path / "s.yaml"
    path.write_text(HEAD + textwrap.indent(textwrap.dedent(extras), "    ") + TAIL)
    return load_scenario(path)


def problem(tmp_path: Path, extras: str) -> Problem:
    with pytest.raises(ScenarioError) as info:
        load(tmp_path, extras)
    (only,) = info.value.problems
    return only


def test_plan_appends_extras_without_changing_the_generated_prompts(tmp_path: Path) -> None:
    s = load(tmp_path, """\
        - {prompt_tokens: 40, max_new_tokens: 4}
        - {prompt_of: 1, keep_tokens: 12, append_tokens: 5, status: 400}
        """)
    plan = make_plan(s.workload, s.seed)
    alone = make_plan(Workload(requests=3, prompt_tokens=(20, 30), max_new_tokens=10), s.seed)
    assert [p.prompt for p in plan[:3]] == [p.prompt for p in alone]
    assert [p.rid for p in plan] == ["r0000", "r0001", "r0002", "r0003", "r0004"]
    assert len(plan[3].prompt) == 40 and plan[3].max_new_tokens == 4 and plan[3].status == 200
    assert plan[4].prompt[:12] == plan[1].prompt[:12] and len(plan[4].prompt) == 17
    assert plan[4].status == 400 and plan[4].max_new_tokens == 10
    assert s.workload.total_requests == 5 and s.workload.served_requests == 4
    assert make_plan(s.workload, s.seed) == plan


def test_follow_up_prompt_is_the_earlier_prompt_and_answer_cut_then_extended(tmp_path: Path) -> None:
    s = load(tmp_path, "- {prompt_of: 0, with_answer: true, keep_tokens: 25, append_tokens: 3}\n")
    follow = make_plan(s.workload, s.seed)[3]
    assert follow.prompt == [] and follow.follow_up is not None
    earlier = {"prompt": list(range(20)), "output_ids": list(range(100, 110))}
    made = follow.follow_up.prompt(earlier)
    assert made is not None and made[:25] == list(range(20)) + list(range(100, 105))
    assert len(made) == 28 and made[25:] == list(follow.follow_up.append)
    assert FollowUp(0, True, None, ()).prompt({"prompt": [1], "output_ids": None}) is None


@pytest.mark.parametrize(
    ("extras", "field", "fragment"),
    [("- {prompt_of: 3}\n", "workload.extra_requests[0].prompt_of", "earlier request"),
     ("- {prompt_tokens: 8, prompt_of: 0}\n", "workload.extra_requests[0]", "exactly one"),
     ("- {max_new_tokens: 3}\n", "workload.extra_requests[0]", "exactly one"),
     ("- {prompt_of: 0, keep_tokens: 21}\n", "workload.extra_requests[0].keep_tokens", "only 20"),
     ("- {prompt_of: 0, with_answer: true, keep_tokens: 31}\n",
      "workload.extra_requests[0].keep_tokens", "prompt and answer may be only 30"),
     ("- {prompt_tokens: 9, keep_tokens: 3}\n", "workload.extra_requests[0].keep_tokens", "only with prompt_of"),
     ("- {prompt_tokens: 9, status: 404}\n", "workload.extra_requests[0].status", "200, 400"),
     ("- {prompt_tokens: 9, bogus: 1}\n", "workload.extra_requests[0].bogus", "valid keys"),
     ("- {prompt_tokens: 500, max_new_tokens: 20}\n", "workload.extra_requests[0]", "status: 400"),
     ("- {prompt_tokens: 9, status: 400}\n- {prompt_of: 3, with_answer: true}\n",
      "workload.extra_requests[1].with_answer", "no answer"),
     ("- {prompt_tokens: 9, min_cached_tokens: 9}\n", "workload.extra_requests[0].min_cached_tokens",
      "below the prompt's length (9"),
     ("- {prompt_tokens: 9, status: 400, min_cached_tokens: 2}\n",
      "workload.extra_requests[0].min_cached_tokens", "needs a served request")],
)
def test_bad_extra_request_is_named_by_its_field(tmp_path: Path, extras: str, field: str, fragment: str) -> None:
    p = problem(tmp_path, extras)
    assert p.field == field and fragment in p.message, str(p)
    assert p.line is not None and p.line >= 9


def _judge_control(responses: list[dict]) -> tuple[str, str]:
    """The verdict and reason of a clean control whose engine ran fine and answered `responses`."""
    from engine_stub.config import EngineConfig

    control = Scenario(name="s", description="", seed=0, profile="cpu-tiny", engine=EngineConfig(),
                       workload=Workload(), perturbations=(), expect=Expect(clean=True), path="s.yaml")
    events = [{"seq": 0, "step": 0, "kind": "engine_start", "ts": 0.0, "config": {}},
              {"seq": 1, "step": 9, "kind": "shutdown", "ts": 0.0}]
    record = judge(control, Observation(events=events, responses=responses, exit_code=0,
                                        timed_out=False, oracle_mismatches=[]))
    return record.verdict, record.reason


def test_planned_refusal_counts_as_answered_in_a_control_and_a_served_one_does_not() -> None:
    refused = {"rid": "r0001", "status": 400, "expect_status": 400, "error": "cannot be prefilled"}
    assert _judge_control([{"rid": "r0000", "status": 200}, refused])[0] == "CLEAN"
    v, reason = _judge_control([{**refused, "status": 200, "error": None}])
    assert v == "INCONCLUSIVE" and "r0001 (200, expected 400)" in reason
    v, reason = _judge_control([{"rid": "r0002", "status": 400, "error": "x"}])
    assert v == "INCONCLUSIVE" and "r0002 (400, expected 200)" in reason


def test_fewer_cached_tokens_than_planned_makes_a_control_inconclusive() -> None:
    def with_cached(cached: int | None) -> list[dict]:
        return [{"rid": "r0004", "status": 200, "expect_cached_tokens": 32,
                 "meta_info": {"cached_tokens": cached}}]

    assert _judge_control(with_cached(39))[0] == "CLEAN"
    assert _judge_control(with_cached(32))[0] == "CLEAN"
    v, reason = _judge_control(with_cached(0))
    assert v == "INCONCLUSIVE" and "r0004 (0 prompt tokens from the cache, expected at least 32)" in reason


@pytest.mark.slow
def test_follow_up_beside_its_source_keeps_the_lockstep_trace(tmp_path: Path) -> None:
    # Request 1 follows request 0's answer while request 0 runs: the driver holds it back, and
    # the gate must count it as in flight (not wait gate_timeout_s a step for it).
    from canaries.runner import run_scenario
    from engine_stub.events import read_events, trace_of

    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent("""\
        name: follow-up-beside-source
        seed: 2
        engine: {profile: cpu-tiny}
        workload:
          requests: 1
          concurrency: 2
          prompt_tokens: 12
          max_new_tokens: 6
          extra_requests:
            - {prompt_of: 0, with_answer: true, append_tokens: 3, max_new_tokens: 4}
            - {prompt_tokens: 20, max_new_tokens: 30}
        expect: {clean: true}
        """))
    scenario = load_scenario(path)
    traces = []
    for run in ("a", "b"):
        record = run_scenario(scenario, tmp_path / run, runtime="local")
        assert record.verdict == "CLEAN", record.reason
        events = read_events(tmp_path / run / "events.jsonl")
        assert not [e for e in events if e["kind"] == "gate_timeout"]
        traces.append([e for e in trace_of(events) if e["kind"] != "engine_start"])
    assert traces[0] == traces[1]
