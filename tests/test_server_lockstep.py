"""The lockstep gate on SGLang's server (canaries/sglang/server/lockstep.py): the driver's notes in the
gate file, the scheduler's side holding the plan's requests back until the driver has in flight
what it keeps there; here with stand-ins for SGLang's messages, then on the real server."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from canaries.driver import Planned
from canaries.sglang.server.lockstep import GateNotes, LockstepGate

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TokenizedGenerateReqInput:  # SGLang's message, by its name
    rid: str


@dataclass
class AbortReq:
    rid: str


@dataclass
class BatchTokenIDOutput:
    rids: list
    finished_reasons: list
    completion_tokens: list


def _gate(tmp_path: Path, n: int = 4, concurrency: int = 2, hang_ups: dict | None = None,
          timeout_s: float = 5.0) -> tuple[LockstepGate, GateNotes, list[dict]]:
    events: list[dict] = []
    notes = GateNotes(tmp_path / "gate.jsonl", timeout_s=timeout_s)
    plan = [Planned(f"r{i:04d}", [1, 2], 4, hang_up_after=(hang_ups or {}).get(f"r{i:04d}")) for i in range(n)]
    notes.planned(plan, concurrency)
    return LockstepGate(notes.path, events.append, step=lambda: 7), notes, events


def _pull(*batches: list):
    """SGLang's receive: each call the next batch of arrivals (then nothing)."""
    queue = list(batches)
    return lambda first: queue.pop(0) if queue else []


def test_gate_holds_requests_until_the_concurrency_arrived_then_lets_them_in_in_plan_order(tmp_path):
    gate, _, events = _gate(tmp_path)
    r1, r0 = TokenizedGenerateReqInput("r0001"), TokenizedGenerateReqInput("r0000")
    health = TokenizedGenerateReqInput("HEALTH_CHECK_1")
    admitted = gate.admit(_pull([r1, health], [], [r0]))
    assert admitted == [health, r0, r1]
    assert events == [{"kind": "admitted", "step": 7, "rids": ["r0000", "r0001"]}]


def test_gate_waits_for_the_replacement_of_a_finished_request(tmp_path):
    gate, _, _ = _gate(tmp_path)
    gate.admit(_pull([TokenizedGenerateReqInput("r0000"), TokenizedGenerateReqInput("r0001")]))
    gate.observe_output(BatchTokenIDOutput(["r0000", "r0001"], [{"type": "stop"}, None], [4, 3]))
    assert not gate.ready()  # the driver will send r0002 for r0000: the next pass waits for it
    assert gate.admit(_pull([], [TokenizedGenerateReqInput("r0002")])) == [TokenizedGenerateReqInput("r0002")]


def test_request_the_scheduler_never_sees_is_gone_once_the_driver_is_done_with_it(tmp_path):
    gate, notes, _ = _gate(tmp_path, n=2, concurrency=2, timeout_s=0.05)
    gate.admit(_pull([TokenizedGenerateReqInput("r0000")], []))
    assert gate.timeouts == 1  # r0001 was refused before the scheduler (HTTP 400) and not yet noted
    notes.done("r0001")
    gate.read_notes()
    assert gate.ready()


def test_held_follow_up_counts_in_flight_until_its_earlier_request_is_answered(tmp_path):
    gate, notes, _ = _gate(tmp_path, n=2, concurrency=2)
    notes.hold("r0001", "r0000")
    gate.admit(_pull([TokenizedGenerateReqInput("r0000")]))
    assert gate.timeouts == 0
    gate.observe_output(BatchTokenIDOutput(["r0000"], [{"type": "length"}], [4]))
    assert not gate.ready()  # answered: now r0001 is on its way
    notes.skip("r0001")  # (or it never comes: the driver says so)
    gate.read_notes()
    assert gate.ready()


def test_planned_hang_up_pauses_the_scheduler_until_its_abort_arrives(tmp_path):
    gate, notes, _ = _gate(tmp_path, n=2, concurrency=1, hang_ups={"r0000": 2})
    gate.admit(_pull([TokenizedGenerateReqInput("r0000")]))
    gate.observe_output(BatchTokenIDOutput(["r0000"], [None], [2]))
    notes.done("r0000")  # the client hung up after its two tokens
    abort = AbortReq("r0000")
    admitted = gate.admit(_pull([TokenizedGenerateReqInput("r0001")], [], [abort]))
    assert admitted == [abort, TokenizedGenerateReqInput("r0001")]
    assert gate.timeouts == 0


def test_gate_that_waits_past_its_timeout_lets_the_pass_go_and_says_so(tmp_path):
    gate, _, events = _gate(tmp_path, timeout_s=0.05)
    assert gate.admit(_pull([TokenizedGenerateReqInput("r0000")])) == [TokenizedGenerateReqInput("r0000")]
    assert gate.timeouts == 1
    assert events[0]["kind"] == "gate_timeout" and events[0]["in_flight"] == 1 and events[0]["want"] == 2


def test_request_pulled_as_the_plan_is_written_is_counted_and_held(tmp_path):
    """The race of a real run (a pass of 60 s gate timeouts after each step): the scheduler read
    the empty gate file, then the driver wrote its plan and sent r0000, which the same pass pulled."""
    path = tmp_path / "gate.jsonl"
    path.write_text("")
    events: list[dict] = []
    gate = LockstepGate(path, events.append, step=lambda: 1)
    notes = GateNotes(path, timeout_s=0.2)

    def pull(first: bool) -> list:
        if first:
            notes.planned([Planned(f"r{i:04d}", [1, 2], 4) for i in range(2)], 1)
            return [TokenizedGenerateReqInput("r0000")]
        return []

    assert gate.admit(pull) == [TokenizedGenerateReqInput("r0000")]
    assert gate.timeouts == 0 and events == [{"kind": "admitted", "step": 1, "rids": ["r0000"]}]
    assert gate.ready()  # the next pass does not wait for r0000 again


def test_without_a_plan_everything_passes_at_once(tmp_path):
    (tmp_path / "gate.jsonl").write_text("")
    gate = LockstepGate(tmp_path / "gate.jsonl")
    assert gate.admit(_pull([TokenizedGenerateReqInput("r0000")])) == [TokenizedGenerateReqInput("r0000")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_timing_dependent_scenario_gives_the_same_admissions_and_verdict_on_a_loaded_server(tmp_path):
    from canaries.runner import run_scenario
    from canaries.scenario import load_scenario
    from canaries.sglang.releases.venvs import find_python
    from engine_stub.events import read_events

    if find_python("0.5.23", server=True) is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    # Two requests' sampled tokens in one relay: before the gate, whether SGLang's scheduler ever
    # held two at the trigger's step depended on arrival (NOT_INJECTED on some runs, MISSED on others).
    scenario = load_scenario(REPO / "configs" / "scenarios" / "swap-next-token-last-step.yaml")
    runs = []
    for busy in (0, 2):
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            record = run_scenario(scenario, tmp_path / f"busy-{busy}", runtime="sglang-server")
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        admitted = [(e["step"], e["rids"]) for e in read_events(tmp_path / f"busy-{busy}" / "events.jsonl")
                    if e["kind"] in ("admitted", "gate_timeout")]
        runs.append((record.verdict, admitted))
    assert runs[0] == runs[1]
    assert runs[0][0] == "MISSED" and runs[0][1]
