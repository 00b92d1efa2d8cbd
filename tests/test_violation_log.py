"""A step's KV canary violations reach the event log durably with one fsync per step, not one per
violation (a canary in log mode at sweep interval 1 over a damaged cache logs dozens a step: an
fsync each made a 340-step run take a minute on a loaded machine, and the harness called it a
hang: canary fuzz, seed 25)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine_stub.events as events_module
from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(EngineConfig(device="cpu", window=8, layer_pattern="SFSS", kv_canary="log",
                              full_pool_tokens=512, swa_pool_tokens=128, max_context_len=256,
                              kv_canary_sweep_interval=1, event_log=str(tmp_path / "events.jsonl")),
                 exit_on_crash=False)
    yield eng
    eng.stop(drain_timeout_s=0)


def test_a_steps_violations_are_durable_with_one_fsync(engine: Engine, monkeypatch) -> None:
    rng = random.Random(0)
    req = Req("a", [rng.randrange(VOCAB_SIZE) for _ in range(30)], 20)
    engine.scheduler.add_request(req)
    for _ in range(3):
        engine.scheduler.step()
    pool = engine.scheduler.req_to_token_pool.req_to_token
    for position in range(0, 12):  # a dozen positions pointing at the padding slot
        pool[req.row, position] = 0
    synced: list[int] = []
    real_fsync = events_module.os.fsync
    monkeypatch.setattr(events_module.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    step = engine.scheduler.step_no + 1
    engine.scheduler.step()
    logged = [e for e in read_events(engine.events.path)
              if e["kind"] == "canary_violation" and e["step"] == step]
    assert len(logged) >= 2
    assert len(synced) == 1
