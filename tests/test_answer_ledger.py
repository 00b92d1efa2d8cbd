"""idle.answer_ledger: an idle engine owes no answer.

Planted: a request whose scheduler-side answer hook is cut (`Req.on_finish = None`, as a
scheduler path that finishes a request without answering it would leave it), so the request
is served and finished but its client is never told.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.req import Req


def _engine(tmp_path: Path, level: str) -> Engine:
    config = EngineConfig(device="cpu", invariant_check=level, event_log=str(tmp_path / "events.jsonl"))
    return Engine(config, exit_on_crash=False)


def test_answered_requests_leave_the_ledger_silent(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "strict")
    got: list[Req] = []
    engine.start()
    try:
        engine.submit([5, 6, 7, 8], 4, rid="fine", on_finish=got.append)
        assert engine.wait_idle(10)
    finally:
        engine.stop(drain_timeout_s=1)
    assert [r.rid for r in got] == ["fine"] and engine.state()["crash"] is None
    kinds = {e["kind"] for e in read_events(tmp_path / "events.jsonl")}
    assert "unanswered_requests" not in kinds


@pytest.mark.parametrize("level", ["strict", "warn"])
def test_finished_request_left_unanswered_fires_answer_ledger(tmp_path: Path, level: str) -> None:
    engine = _engine(tmp_path, level)
    answered = threading.Event()
    got: list[Req] = []

    def on_finish(req: Req) -> None:
        got.append(req)
        answered.set()

    req = engine.submit([5, 6, 7, 8], 4, rid="lost", on_finish=on_finish)
    req.on_finish = None  # the planted bug: the scheduler finishes it without an answer
    engine.start()
    try:
        assert answered.wait(10), "the client was never answered"
        if level == "strict":
            crash = engine.state()["crash"]  # set before the crash path answers
            assert crash is not None
            assert "[idle.answer_ledger]" in crash["error"], crash
            assert got[0].finish_reason == "engine_crashed"
        else:
            # Below STRICT the owed answer is delivered late, but whole.
            assert got[0].finish_reason == "length" and len(got[0].output_ids) == 4
            assert engine.state()["invariant_hits"]["idle.answer_ledger"] == 1
    finally:
        engine.stop(drain_timeout_s=1)
    assert len(got) == 1, "answered twice"
    events = read_events(tmp_path / "events.jsonl")
    orphaned = [e for e in events if e["kind"] == "unanswered_requests"]
    assert [e["rids"] for e in orphaned] == [["lost"]]
    # The firing is on record (a crash event names it at STRICT, a firing event below).
    named = [e for e in events if e["kind"] in ("invariant_firing", "crash")
             and "idle.answer_ledger" in json.dumps(e)]
    assert named, "the answer ledger's firing never reached the event log"


def test_lost_answer_after_every_planned_request_arrived_fires_without_a_gate_timeout(tmp_path: Path) -> None:
    # Gated for two requests: once both have arrived nothing more can, so the idle tick that
    # names the lost answer must not wait out the gate's timeout (an hour here) for a third.
    config = EngineConfig(device="cpu", invariant_check="warn", event_log=str(tmp_path / "events.jsonl"),
                          gate_requests=2, gate_concurrency=2, gate_timeout_s=3600)
    engine = Engine(config, exit_on_crash=False)
    answered = threading.Event()
    got: list[Req] = []

    def on_finish(req: Req) -> None:
        got.append(req)
        if len(got) == 2:
            answered.set()

    engine.submit([5, 6, 7, 8], 4, rid="fine", on_finish=on_finish)
    lost = engine.submit([9, 10, 11], 4, rid="lost", on_finish=on_finish)
    lost.on_finish = None  # the planted bug: finished without an answer
    engine.start()
    try:
        assert answered.wait(30), "the lost answer was never delivered by the idle tick"
    finally:
        engine.stop(drain_timeout_s=1)
    events = read_events(tmp_path / "events.jsonl")
    assert [e["rids"] for e in events if e["kind"] == "unanswered_requests"] == [["lost"]]
    assert not [e for e in events if e["kind"] == "gate_timeout"]
