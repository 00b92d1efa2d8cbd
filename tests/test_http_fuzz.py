"""A bounded schemathesis pass over the real server: `/openapi.json` says what the server does.

Every check runs (`--checks all`): no 5xx, every status, content type and body as documented, all
that the schema accepts accepted, all that it rejects rejected. The engine must be healthy after,
with its greedy answers unchanged.

This module is also the pass's hooks module (`SCHEMATHESIS_HOOKS=test_http_fuzz`, with `tests/` on
the path). One rule of the server JSON Schema cannot state: a prompt is counted in tokens, i.e.
its UTF-8 bytes, and prompt tokens + new tokens must fit the context. The hooks bring each
schema-valid case inside that rule, and cap the new tokens so the pass stays fast on a CPU; they
leave the cases meant to be rejected alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import REPO_ROOT, start_server  # tests/ is on the path, as for pytest

schemathesis = pytest.importorskip("schemathesis")

FUZZ_MAX_NEW_TOKENS = 8
MAX_EXAMPLES = 20
PASS_TIMEOUT_S = 150

BASELINE = {"text": "a fixed greedy request", "sampling_params": {"max_new_tokens": 12}}


def _max_prompt_tokens(case: Any) -> int:
    """The prompt limit the document gives (every prompt field carries the same one)."""
    schema = case.operation.schema.raw_schema["components"]["schemas"]["GenerateRequest"]
    (ids,) = [b for b in schema["properties"]["input_ids"]["anyOf"] if b.get("type") == "array"]
    return ids["maxItems"]


def _fit_prompt(prompt: Any, limit: int) -> Any:
    if isinstance(prompt, str):
        while len(prompt.encode("utf-8", "surrogatepass")) > limit:
            prompt = prompt[:-1]
    elif isinstance(prompt, list):
        prompt = prompt[:limit]
    return prompt


def _cap(container: dict, key: str) -> None:
    value = container.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        container[key] = min(value, FUZZ_MAX_NEW_TOKENS)


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """Schema-valid generation bodies: a prompt within the token limit, few new tokens."""
    body = case.body
    meta = case.meta
    if meta is None or meta.generation.mode != schemathesis.GenerationMode.POSITIVE or not isinstance(body, dict):
        return case
    # The documented limit leaves room for one new token; the cap below allows a few more, and
    # prompt + new tokens must fit the context (a rule between fields no schema can state).
    limit = _max_prompt_tokens(case) + 1 - FUZZ_MAX_NEW_TOKENS
    if case.operation.path == "/generate":
        if "text" in body:
            body["text"] = _fit_prompt(body["text"], limit)
        if isinstance(body.get("sampling_params"), dict):
            _cap(body["sampling_params"], "max_new_tokens")
    elif case.operation.path == "/v1/completions":
        body["prompt"] = _fit_prompt(body.get("prompt"), limit)
        _cap(body, "max_tokens")
    return case


@pytest.mark.slow
def test_schemathesis_pass_finds_no_failures_and_leaves_the_engine_healthy(tmp_path: Path) -> None:
    server = start_server(tmp_path / "events.jsonl")
    base = server.url
    try:
        before = httpx.post(f"{base}/generate", json=BASELINE, timeout=30)
        assert before.status_code == 200, before.text
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "test_http_fuzz",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), str(REPO_ROOT)]),
               "NO_COLOR": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json", "--checks", "all",
             "--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--workers", "1",
             "--request-timeout", "30"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=PASS_TIMEOUT_S,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert counts and counts[1] == counts[2] and int(counts[1]) >= 100, run.stdout[-3000:]

        assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
        after = httpx.post(f"{base}/generate", json=BASELINE, timeout=30)
        assert after.status_code == 200 and after.json()["output_ids"] == before.json()["output_ids"]
        state = httpx.get(f"{base}/state", timeout=30).json()
        assert state["crash"] is None and state["running"] == 0 and state["waiting"] == 0
        assert state["last_idle_check"]["balanced"], state["last_idle_check"]
        assert server.proc.poll() is None
    finally:
        server.stop()
