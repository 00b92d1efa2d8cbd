"""A memory backend's own invariant counters (SGLang counts its checks itself): no hit is lost.

The step reads counters back once, with its sampled tokens; a backend hit counted after that
read (SGLang's checks inside a finish's frees) must still reach the event log: at the idle tick
that follows, or at shutdown. Planted here with a stand-in backend counter bumped by the
finish's frees, so these run without an installed sglang.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events

NAME = "swa.peer_released"


class LateBackendCounter:
    """A backend counter source (the `invariant_counters` contract) that counts one hit per
    allocator `free` call: hits that land after the step's read-back, as SGLang's do."""

    def __init__(self) -> None:
        self.hits = 0

    def __call__(self) -> tuple[list[str], torch.Tensor]:
        return [NAME], torch.tensor([self.hits], dtype=torch.int64)


def _engine_with_late_counter(tmp_path: Path) -> tuple[Engine, LateBackendCounter]:
    engine = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "events.jsonl")), exit_on_crash=False)
    counter = LateBackendCounter()
    sched = engine.scheduler
    sched._extra_counters = counter
    real_free = sched.allocator.free

    def counting_free(free_index: torch.Tensor) -> None:
        counter.hits += 1
        real_free(free_index)

    sched.allocator.free = counting_free
    return engine, counter


def _fired_hits(path: Path) -> int:
    return sum(e["new_hits"] for e in read_events(path) if e["kind"] == "invariant_firing" and e["invariant"] == NAME)


def test_backend_hit_after_last_read_back_fires_at_idle_tick(tmp_path: Path) -> None:
    engine, counter = _engine_with_late_counter(tmp_path)
    engine.start()
    try:
        engine.submit(list(range(1, 20)), 6, rid="r0")
        assert engine.wait_idle(30)
        assert counter.hits > 0  # the finish freed: hits counted after the last step's read
        assert engine.state()["invariant_hits"][NAME] == counter.hits
    finally:
        engine.stop()
    assert _fired_hits(tmp_path / "events.jsonl") == counter.hits


def test_backend_hit_after_idle_tick_fires_before_shutdown(tmp_path: Path) -> None:
    engine, counter = _engine_with_late_counter(tmp_path)
    engine.start()
    engine.submit(list(range(1, 20)), 6, rid="r0")
    assert engine.wait_idle(30)
    counter.hits += 3  # counted with no step and no idle tick to follow
    engine.stop()
    events = read_events(tmp_path / "events.jsonl")
    assert _fired_hits(tmp_path / "events.jsonl") == counter.hits
    last_firing = max(i for i, e in enumerate(events) if e["kind"] == "invariant_firing")
    assert events[-1]["kind"] == "shutdown" and last_firing < len(events) - 1


def test_backend_hit_is_logged_before_an_idle_check_crash(tmp_path: Path) -> None:
    engine, counter = _engine_with_late_counter(tmp_path)

    def crashing_check() -> dict:
        raise RuntimeError("planted: an idle ledger crashes the engine")

    engine.start()
    assert engine.wait_idle(30)  # the first idle tick, before any request
    engine.scheduler.idle.check = crashing_check
    engine.submit(list(range(1, 20)), 6, rid="r0")
    deadline = time.monotonic() + 30
    while engine.crash is None and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.stop()
    assert engine.crash is not None and counter.hits > 0
    events = read_events(tmp_path / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert _fired_hits(tmp_path / "events.jsonl") == counter.hits
    assert max(i for i, k in enumerate(kinds) if k == "invariant_firing") < kinds.index("crash")
