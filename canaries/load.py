"""A bounded load test against one local engine: many concurrent clients, mixed endpoints, long
and short prompts, and clients that hang up mid-request.

Every answer that came back is checked afterwards: an HTTP 200 must be whole (as many tokens as
asked for, finish_reason "length") and equal the no-cache oracle (greedy), and the engine must
end healthy, its ledgers balanced, with no invariant firing and no canary violation. Loopback
only; bounded in clients, time and tokens.

    python scripts/load_test.py --clients 64 --duration 60
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LoadConfig", "LoadResult", "run_load"]

# Engine knobs of the run: the default profile's pools, checks at their strictest.
ENGINE_FLAGS = ("--device", "cpu", "--invariant-check", "strict", "--kv-canary", "log")


@dataclass(frozen=True)
class LoadConfig:
    """What the load test sends.

    Args:
        clients: concurrent clients, each sending one request after another.
        duration_s: how long clients start new requests (in-flight ones then finish).
        disconnect_fraction: share of requests whose client hangs up before the answer.
        long_fraction: share of requests with a long prompt (100-280 tokens, past the window).
        max_new_tokens: the largest output asked for (each request draws 1..this).
        seed: prompts, lengths, endpoints and disconnects are drawn from it.
    """

    clients: int = 64
    duration_s: float = 60.0
    disconnect_fraction: float = 0.1
    long_fraction: float = 0.3
    max_new_tokens: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not 0 < self.duration_s <= 3600:
            raise ValueError(f"duration_s must be in (0, 3600], got {self.duration_s}")
        for name in ("disconnect_fraction", "long_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 1 <= self.max_new_tokens <= 200:
            raise ValueError(f"max_new_tokens must be in [1, 200], got {self.max_new_tokens}")


@dataclass
class Sent:
    """One request and what came back."""

    endpoint: str
    prompt: list[int]
    max_new_tokens: int
    hang_up_after_s: float | None
    status: int | None = None
    output_ids: list[int] | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    latency_s: float = 0.0


@dataclass
class LoadResult:
    """The figures of one load run (`summary()` prints them)."""

    config: LoadConfig
    wall_s: float
    sent: list[Sent]
    truncated: list[Sent] = field(default_factory=list)
    mismatched: list[Sent] = field(default_factory=list)
    engine_state: dict = field(default_factory=dict)
    engine_exit_code: int | None = None
    engine_problems: list[str] = field(default_factory=list)

    @property
    def answered(self) -> list[Sent]:
        return [s for s in self.sent if s.status == 200]

    @property
    def errors(self) -> list[Sent]:
        """Requests that got neither a 200 nor were hung up on by their own client."""
        return [s for s in self.sent if s.status != 200 and s.hang_up_after_s is None]

    @property
    def ok(self) -> bool:
        return not (self.truncated or self.mismatched or self.errors or self.engine_problems)

    def summary(self) -> str:
        answered = self.answered
        latencies = sorted(s.latency_s for s in answered)
        tokens = sum(s.completion_tokens or 0 for s in answered)
        hung_up = [s for s in self.sent if s.hang_up_after_s is not None]
        by_endpoint: dict[str, int] = {}
        for s in answered:
            by_endpoint[s.endpoint] = by_endpoint.get(s.endpoint, 0) + 1
        aborted = self.engine_state.get("stats", {}).get("aborted_requests")
        lines = [
            f"clients {self.config.clients}, {self.wall_s:.1f}s, seed {self.config.seed}",
            f"requests: {len(self.sent)} sent, {len(answered)} answered 200 "
            f"({', '.join(f'{k} {v}' for k, v in sorted(by_endpoint.items()))}), "
            f"{len(hung_up)} hung up by their client, {len(self.errors)} errors",
            f"throughput: {len(answered) / self.wall_s:.1f} req/s, {tokens / self.wall_s:.0f} tok/s",
        ]
        if latencies:
            lines.append(f"latency: p50 {_quantile(latencies, 0.5):.3f}s, p99 {_quantile(latencies, 0.99):.3f}s, "
                         f"max {latencies[-1]:.3f}s")
        lines += [
            f"truncated answers: {len(self.truncated)}",
            f"oracle mismatches: {len(self.mismatched)} of {len(answered)}",
            f"engine: exit {self.engine_exit_code}, aborted requests {aborted}, problems: "
            + ("; ".join(self.engine_problems) or "none"),
        ]
        for s in self.errors[:5]:
            lines.append(f"  error: {s.endpoint} status {s.status}: {s.error}")
        return "\n".join(lines)


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _plan(config: LoadConfig, rng: random.Random, shared: list[list[int]]) -> tuple[str, list[int], int, float | None]:
    long = rng.random() < config.long_fraction
    length = rng.randint(100, 280) if long else rng.randint(4, 40)
    if rng.random() < 0.3:  # a continuation of a shared prefix: radix cache hits
        base = rng.choice(shared)
        prompt = base[: min(len(base), length - 1)] + [rng.randint(32, 126) for _ in range(4)]
    else:
        prompt = [rng.randint(32, 126) for _ in range(length)]
    endpoint = rng.choice(("/generate:text", "/generate:ids", "/v1/completions"))
    hang_up = rng.uniform(0.05, 1.5) if rng.random() < config.disconnect_fraction else None
    return endpoint, prompt, rng.randint(1, config.max_new_tokens), hang_up


def _body(endpoint: str, prompt: list[int], max_new_tokens: int) -> tuple[str, dict]:
    if endpoint == "/v1/completions":
        return endpoint, {"model": "engine-stub", "prompt": prompt, "max_tokens": max_new_tokens,
                          "temperature": 0}
    if endpoint == "/generate:text":
        return "/generate", {"text": bytes(prompt).decode("ascii"),
                             "sampling_params": {"max_new_tokens": max_new_tokens}}
    return "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}}


async def _send(client: Any, base_url: str, item: Sent) -> None:
    path, body = _body(item.endpoint, item.prompt, item.max_new_tokens)
    start = time.monotonic()
    try:
        request = client.post(f"{base_url}{path}", json=body)
        if item.hang_up_after_s is not None:
            resp = await asyncio.wait_for(request, item.hang_up_after_s)
        else:
            resp = await request
    except asyncio.TimeoutError:
        item.error = "hung up"
        return
    except Exception as exc:  # noqa: BLE001 - every failure is a figure of the run
        item.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    finally:
        item.latency_s = time.monotonic() - start
    item.status = resp.status_code
    payload = resp.json()
    if resp.status_code != 200:
        item.error = str(payload.get("error", payload))[:300]
        return
    if path == "/generate":
        meta = payload["meta_info"]
        item.output_ids = payload["output_ids"]
        item.finish_reason = meta["finish_reason"]["type"]
        item.completion_tokens = meta["completion_tokens"]
    else:
        choice = payload["choices"][0]
        item.text = choice["text"]
        item.finish_reason = choice["finish_reason"]
        item.completion_tokens = payload["usage"]["completion_tokens"]


async def _clients(config: LoadConfig, base_url: str) -> list[Sent]:
    import httpx

    sent: list[Sent] = []
    stop_at = time.monotonic() + config.duration_s
    prefix_rng = random.Random(f"load-prefixes:{config.seed}")
    shared = [[prefix_rng.randint(32, 126) for _ in range(prefix_rng.randint(20, 200))] for _ in range(6)]
    limits = httpx.Limits(max_connections=config.clients * 2, max_keepalive_connections=config.clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def one_client(index: int) -> None:
            rng = random.Random(f"load-client:{config.seed}:{index}")
            while time.monotonic() < stop_at:
                item = Sent(*_plan(config, rng, shared))
                sent.append(item)
                await _send(client, base_url, item)

        await asyncio.gather(*(one_client(i) for i in range(config.clients)))
    return sent


def _check_answers(result: LoadResult) -> None:
    """Whole answers, equal to the oracle of the engine's config (greedy)."""
    from engine_stub.config import EngineConfig
    from engine_stub.model import ModelConfig, TinyHybridModel, decode_text

    knobs = result.engine_state.get("config") or {}
    defaults = EngineConfig()
    model = TinyHybridModel(ModelConfig(
        knobs.get("layer_pattern", defaults.layer_pattern), knobs.get("window", defaults.window),
        knobs.get("hidden_size", defaults.hidden_size), knobs.get("num_heads", defaults.num_heads),
        knobs.get("seed", defaults.seed)))
    for item in result.answered:
        if item.finish_reason != "length" or item.completion_tokens != item.max_new_tokens:
            result.truncated.append(item)
            continue
        if item.output_ids is not None:
            predicted = model.reference_next_tokens(item.prompt + item.output_ids[:-1])
            if item.output_ids != predicted[len(item.prompt) - 1:]:
                result.mismatched.append(item)
        elif item.text != decode_text(model.reference_generate(item.prompt, item.max_new_tokens)):
            result.mismatched.append(item)


def _engine_problems(state: dict) -> list[str]:
    problems = []
    if not state:
        return ["no /state after the run"]
    if state.get("crash"):
        problems.append(f"crashed: {state['crash'].get('cause')}")
    hits = {k: v for k, v in (state.get("invariant_hits") or {}).items() if v}
    if hits:
        problems.append(f"invariants fired: {hits}")
    if (state.get("kv_canary") or {}).get("violations"):
        problems.append(f"{state['kv_canary']['violations']} canary violations")
    idle = state.get("last_idle_check") or {}
    off = {k: v["delta"] for k, v in (idle.get("ledgers") or {}).items() if v["delta"]}
    if off or not idle:
        problems.append(f"ledgers off: {off}" if off else "no idle check ran")
    if state.get("running") or state.get("waiting"):
        problems.append(f"still busy: {state.get('running')} running, {state.get('waiting')} waiting")
    return problems


def _idle_state(base_url: str, timeout_s: float = 60.0) -> dict:
    import requests

    deadline = time.monotonic() + timeout_s
    state: dict = {}
    while time.monotonic() < deadline:
        state = requests.get(f"{base_url}/state", timeout=5).json()
        idle = state.get("last_idle_check") or {}
        if not state["running"] and not state["waiting"] and idle.get("after_step") == state["step"]:
            break
        time.sleep(0.1)
    return state


def run_load(config: LoadConfig, run_dir: str | Path | None = None) -> LoadResult:
    """Start an engine, drive `config`'s load at it, check every answer; the figures."""
    from canaries.runtime.local import LocalRuntime

    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="canary-load-"))
    runtime = LocalRuntime(ready_timeout=60)
    base_url = runtime.start(None, run_dir, extra_flags=ENGINE_FLAGS)
    try:
        t0 = time.monotonic()
        sent = asyncio.run(_clients(config, base_url))
        wall = time.monotonic() - t0
        state = _idle_state(base_url)
    finally:
        exit_code = runtime.stop(timeout=30)
    result = LoadResult(config=config, wall_s=wall, sent=sent, engine_state=state,
                        engine_exit_code=exit_code)
    result.engine_problems = _engine_problems(state)
    if exit_code != 0:
        result.engine_problems.append(f"the engine exited with {exit_code}")
    _check_answers(result)
    return result
