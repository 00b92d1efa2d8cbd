"""GET /progress: the counters a harness's watchdog reads, growing with the engine's work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.server import create_app


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "events.jsonl")), exit_on_crash=False)
    eng.start()
    yield eng
    eng.stop(drain_timeout_s=10)


def test_progress_counts_the_steps_and_tokens_of_a_request(engine: Engine) -> None:
    client = TestClient(create_app(engine))
    assert client.get("/progress").json() == {"step": 0, "generated_tokens": 0, "received": 0, "completed": 0}
    answer = client.post("/generate", json={"input_ids": [40, 41, 42], "sampling_params": {"max_new_tokens": 5}})
    assert answer.status_code == 200
    after = client.get("/progress").json()
    assert after["generated_tokens"] == 5 and after["step"] >= 5
    assert (after["received"], after["completed"]) == (1, 1)


def test_progress_answers_while_a_step_holds_the_step_lock(engine: Engine) -> None:
    client = TestClient(create_app(engine))
    with engine.step_lock:  # a stuck step: /state would wait, /progress must not
        assert client.get("/progress").json()["step"] == 0
