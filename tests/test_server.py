"""The HTTP front end: endpoints, request validation, isolation of bad requests, and the real
server process driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.model import decode_text, encode_text
from engine_stub.server import MAX_NEW_TOKENS_LIMIT, create_app

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "events.jsonl")), exit_on_crash=False)
    eng.start()
    yield eng
    eng.stop(drain_timeout_s=10)


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    # Without the context manager the lifespan (which stops the engine) does not run; the
    # engine fixture stops it.
    yield TestClient(create_app(engine))


def _oracle(engine: Engine, ids: list[int], n: int) -> list[int]:
    return engine.scheduler.model.reference_generate(ids, n)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hello world", "sampling_params": {"max_new_tokens": 6}},
        {"input_ids": list(encode_text("hello world")), "sampling_params": {"max_new_tokens": 6}},
    ],
    ids=["text", "input_ids"],
)
def test_generate_returns_oracle_tokens(client: TestClient, engine: Engine, body: dict) -> None:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    expected = _oracle(engine, list(encode_text("hello world")), 6)
    assert data["output_ids"] == expected
    assert data["text"] == decode_text(expected)
    meta = data["meta_info"]
    assert meta["prompt_tokens"] == 11 and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}


def test_generate_reports_cached_tokens_on_a_continuation(client: TestClient) -> None:
    first = client.post("/generate", json={"text": "x" * 40, "sampling_params": {"max_new_tokens": 30}}).json()
    follow = list(encode_text("x" * 40)) + first["output_ids"] + [10, 11]
    second = client.post("/generate", json={"input_ids": follow, "sampling_params": {"max_new_tokens": 4}})
    assert second.status_code == 200
    assert second.json()["meta_info"]["cached_tokens"] > 0


def test_completions_has_openai_shape_and_matches_generate(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "engine-stub", "prompt": "hello", "max_tokens": 8})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "text_completion" and data["model"] == "engine-stub"
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    (choice,) = data["choices"]
    generated = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 8}}).json()
    assert choice["text"] == generated["text"]
    assert choice["finish_reason"] == "length"


def test_completions_accepts_token_id_prompt(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == 2


def test_health_state_and_metrics_report_the_engine(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 3}})
    state = client.get("/state").json()
    assert state["completed"] == 1 and state["crash"] is None
    assert {"pools", "invariant_hits", "kv_canary", "exercise", "config", "last_idle_check"} <= set(state)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert "# TYPE engine_stub_invariant_hits_total counter" in text
    for name, count in state["invariant_hits"].items():
        assert f'engine_stub_invariant_hits_total{{invariant="{name}"}} {count}' in text
    assert 'engine_stub_pool_size_tokens{pool="swa"} 320' in text
    assert "engine_stub_generated_tokens_total 3" in text
    # Every sample line is `name{labels} value` or `name value`, with a numeric value.
    for line in text.splitlines():
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_health_reports_a_crashed_engine(client: TestClient, engine: Engine) -> None:
    engine.crash = {"cause": "invariant", "error": "planted", "exit_code": 3}
    try:
        response = client.get("/health")
        assert response.status_code == 503
        assert "invariant" in response.json()["error"]["message"]
        assert client.post("/generate", json={"text": "hi"}).status_code == 503
    finally:
        engine.crash = None


BAD_GENERATE: list[tuple[str, Any, str]] = [
    ("malformed_json", b'{"text": "hi"', "malformed JSON"),
    ("not_an_object", b"[1, 2]", "valid dictionary"),
    ("text_not_string", {"text": 5}, "text"),
    ("input_ids_not_list", {"input_ids": "abc"}, "input_ids"),
    ("input_id_bool", {"input_ids": [True]}, "input_ids.0"),
    ("input_id_float", {"input_ids": [1.5]}, "input_ids.0"),
    ("max_new_tokens_string", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ("empty_text", {"text": ""}, "text: the prompt is empty"),
    ("empty_input_ids", {"input_ids": []}, "input_ids: the prompt is empty"),
    ("no_prompt", {"sampling_params": {"max_new_tokens": 4}}, "'text' and 'input_ids'"),
    ("both_prompts", {"text": "hi", "input_ids": [1]}, "'text' and 'input_ids'"),
    ("token_too_large", {"input_ids": [1, 256]}, "input_ids.1"),
    ("token_negative", {"input_ids": [-1]}, "input_ids.0"),
    ("prompt_beyond_context", {"input_ids": [1] * 600}, "max_context_len=512"),
    ("prompt_plus_new_beyond_context", {"text": "hi", "sampling_params": {"max_new_tokens": 4000}},
     "max_context_len=512"),
    ("absurd_max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}},
     "sampling_params.max_new_tokens"),
    ("zero_max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": 0}},
     "sampling_params.max_new_tokens"),
    ("negative_temperature", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("unknown_field", {"text": "hi", "sampling_params": {"top_k": 3}}, "sampling_params.top_k"),
    ("empty_rid", {"text": "hi", "rid": ""}, "rid"),
]


@pytest.mark.parametrize(("case", "body", "reason"), BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_request_gets_400_naming_the_field(
    client: TestClient, engine: Engine, case: str, body: Any, reason: str
) -> None:
    if isinstance(body, bytes):
        response = client.post("/generate", content=body, headers={"content-type": "application/json"})
    else:
        response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert reason in error["message"]
    assert error["code"] == 400
    assert engine.received == 0  # nothing reached the engine


BAD_COMPLETIONS: list[tuple[str, dict, str]] = [
    ("empty_prompt", {"prompt": ""}, "prompt: the prompt is empty"),
    ("missing_prompt", {"max_tokens": 3}, "prompt: Field required"),
    ("prompt_not_text_or_ids", {"prompt": 5}, "prompt"),
    ("token_too_large", {"prompt": [999]}, "prompt.0: Input should be less than 256"),
    ("absurd_max_tokens", {"prompt": "hi", "max_tokens": MAX_NEW_TOKENS_LIMIT + 1}, "max_tokens"),
    ("negative_max_tokens", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("stream", {"prompt": "hi", "stream": True}, "stream"),
    ("n_above_one", {"prompt": "hi", "n": 2}, "n:"),
    ("prompt_beyond_context", {"prompt": "a" * 600}, "max_context_len=512"),
]


@pytest.mark.parametrize(("case", "body", "reason"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completions_request_gets_400_naming_the_field(
    client: TestClient, case: str, body: dict, reason: str
) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]


def test_duplicate_in_flight_rid_gets_400_naming_rid(client: TestClient, engine: Engine) -> None:
    with engine.step_lock:  # the engine cannot finish "taken" meanwhile
        engine.submit([1, 2, 3], 200, rid="taken")
        response = client.post("/generate", json={"text": "hi", "rid": "taken"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "rid"
    assert engine.wait_idle(30)


def test_bad_requests_do_not_disturb_a_concurrent_good_one(engine: Engine) -> None:
    prompt = list(encode_text("a steady request"))
    expected = _oracle(engine, prompt, 40)
    bad_bodies = [body for _, body, _ in BAD_GENERATE]

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            good = asyncio.create_task(
                http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 40}})
            )
            bad = []
            for body in bad_bodies * 2:
                if isinstance(body, bytes):
                    bad.append(http.post("/generate", content=body, headers={"content-type": "application/json"}))
                else:
                    bad.append(http.post("/generate", json=body))
            bad_responses = await asyncio.gather(*bad)
            return await good, list(bad_responses)

    good, bad = asyncio.run(scenario())
    assert all(r.status_code == 400 for r in bad)
    assert good.status_code == 200, good.text
    assert good.json()["output_ids"] == expected
    assert engine.wait_idle(10)
    assert engine.received == engine.completed == 1
    assert engine.last_idle is not None and engine.last_idle["balanced"]


# ---- the real server process --------------------------------------------------------------------


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[str]
    pump: threading.Thread
    lines: queue.Queue[str]
    port: int = 0

    def stop(self) -> None:
        """Kill the whole process group if it is still alive; reap it and its output pipe."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.pump.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _start_server(event_log: Path) -> _Server:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_stub", "--port", "0", "--device", "cpu",
         "--event-log", str(event_log)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, so nothing it starts outlives the test
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    server = _Server(proc, threading.Thread(target=pump, daemon=True), lines)
    server.pump.start()
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith("engine_stub ready on http://"):
            server.port = int(line.strip().rsplit(":", 1)[1])
            return server
    server.stop()
    raise AssertionError(f"server never became ready (exit {proc.poll()}): {''.join(seen)}")


@pytest.mark.slow
def test_openai_client_against_real_server_then_sigterm_exits_cleanly(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    event_log = tmp_path / "events.jsonl"
    server = _start_server(event_log)
    proc, port = server.proc, server.port
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        completion = client.completions.create(model="engine-stub", prompt="hello", max_tokens=8)
        generated = httpx.post(f"http://127.0.0.1:{port}/generate",
                               json={"text": "hello", "sampling_params": {"max_new_tokens": 8}}, timeout=30)
        assert generated.status_code == 200
        assert completion.choices[0].text == generated.json()["text"]
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        bad = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [300]}, timeout=30)
        assert bad.status_code == 400
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json() == {"status": "ok"}

        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        server.stop()
    kinds = [e["kind"] for e in read_events(event_log)]
    assert kinds[0] == "engine_start" and "listening" in kinds
    assert kinds[-1] == "shutdown"
    assert kinds.count("request_finished") == 2
