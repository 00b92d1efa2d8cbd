"""Client hang-ups (`extra_requests[].hang_up_after_tokens`): the client disconnects once its
request has that many output tokens; the lockstep gate makes the abort land at the same step on
every run, so the engine's abort path is a scenario like any other."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from canaries.runner import run_scenario
from canaries.scenario import ScenarioError, load_scenario

SCENARIO = """\
name: hang-up
seed: 5
engine: {profile: cpu-tiny, page_size: 1, radix_cache: true, invariant_check: strict, kv_canary: log}
workload:
  requests: 3
  concurrency: 2
  prompt_tokens: [20, 40]
  max_new_tokens: 24
  extra_requests:
"""


def write(tmp_path: Path, extras: str) -> Path:
    path = tmp_path / "hang-up.yaml"
    path.write_text(SCENARIO + textwrap.indent(textwrap.dedent(extras), "    ")
                    + "expect: {clean: true}\n")
    return path


def _trace(run_dir: Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [{k: v for k, v in e.items() if k not in ("ts", "pid", "port")}
            for e in events if e["kind"] not in ("engine_start", "listening")]


def test_hang_up_aborts_at_the_same_step_on_every_run(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        - {prompt_of: 0, append_tokens: 4, hang_up_after_tokens: 5}
        - {prompt_of: 1, with_answer: true, append_tokens: 3}
    """)
    scenario = load_scenario(path)
    traces = []
    for n in range(2):
        record = run_scenario(scenario, tmp_path / f"run{n}")
        assert record.verdict == "CLEAN", record.reason
        traces.append(_trace(tmp_path / f"run{n}"))
    assert traces[0] == traces[1]
    (aborted,) = [e for e in traces[0] if e["kind"] == "request_finished" and e["rid"] == "r0003"]
    assert aborted["finish_reason"] == "abort" and aborted["output_len"] == 5
    responses = [json.loads(line) for line in (tmp_path / "run0" / "responses.jsonl").read_text().splitlines()]
    assert [(r["status"], r.get("hung_up")) for r in responses][3] == (499, True)


@pytest.mark.parametrize("extras, field, words", [
    ("- {prompt_of: 0, hang_up_after_tokens: 24}\n", "hang_up_after_tokens", "fewer tokens"),
    ("- {prompt_of: 0, hang_up_after_tokens: 3, status: 400}\n", "hang_up_after_tokens", "status 200"),
    ("- {prompt_of: 0, hang_up_after_tokens: 3}\n- {prompt_of: 3, with_answer: true}\n",
     "with_answer", "hung up on"),
])
def test_hang_up_that_cannot_happen_is_a_validation_error(tmp_path: Path, extras: str, field: str,
                                                          words: str) -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, extras))
    (problem,) = info.value.problems
    assert problem.field.endswith(field) and words in problem.message and problem.line
