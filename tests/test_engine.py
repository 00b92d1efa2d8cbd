"""The engine end to end, in process: oracle equality, balanced ledgers, proof of exercise,
determinism under the lockstep gate, and the crash path."""

from __future__ import annotations

import functools
import queue
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events, trace_of
from engine_stub.model import VOCAB_SIZE, ModelConfig, TinyHybridModel
from engine_stub.req import Req, RequestRejected

WINDOW = 8
NEW_TOKENS = 20  # > WINDOW, and for page 16 leaves a live SWA tail on the shared-prefix requests
SHARED_PREFIX = 24


@functools.cache
def _model(layer_pattern: str, window: int, hidden_size: int, num_heads: int, seed: int) -> TinyHybridModel:
    return TinyHybridModel(ModelConfig(layer_pattern, window, hidden_size, num_heads, seed))


@functools.cache
def _oracle_cached(key: tuple, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(_model(*key).reference_generate(list(prompt), n))


def _oracle(engine: Engine, req: Req) -> list[int]:
    """The no-cache reference continuation (`scheduler.model.reference_generate`), memoised:
    the weights depend only on these knobs, so it is shared by every config of one model."""
    cfg = engine.config
    key = (cfg.layer_pattern, cfg.window, cfg.hidden_size, cfg.num_heads, cfg.seed)
    assert engine.scheduler.model.config.seed == cfg.seed
    return list(_oracle_cached(key, tuple(req.origin_input_ids), req.max_new_tokens))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _first_wave() -> list[list[int]]:
    """8 prompts longer than the window; the even ones share a 24-token prefix."""
    rng = random.Random(7)
    shared = _tokens(rng, SHARED_PREFIX)
    prompts = []
    for i in range(8):
        if i % 2 == 0:
            prompts.append(shared + _tokens(rng, 5 + i // 2))  # 29..32 tokens
        else:
            prompts.append(_tokens(rng, 12 + 8 * (i // 2)))  # 12..36 tokens
    return prompts


def _assert_clean(engine: Engine) -> dict:
    state = engine.state()
    assert state["crash"] is None
    assert state["kv_canary"]["violations"] == 0
    assert all(n == 0 for n in state["invariant_hits"].values()), state["invariant_hits"]
    assert engine.last_idle is not None and engine.last_idle["balanced"], engine.last_idle
    for name, ledger in engine.last_idle["ledgers"].items():
        assert ledger["delta"] == 0, (name, ledger)
    return state


@pytest.mark.parametrize("radix_cache", [True, False], ids=["radix", "noradix"])
@pytest.mark.parametrize(("page_size", "swa_pool_tokens"), [(1, 192), (16, 256)], ids=["page1", "page16"])
def test_concurrent_shared_prefix_requests_match_no_cache_oracle(
    tmp_path: Path, page_size: int, swa_pool_tokens: int, radix_cache: bool
) -> None:
    concurrency = 4
    config = EngineConfig(
        device="cpu", page_size=page_size, window=WINDOW, full_pool_tokens=1024,
        swa_pool_tokens=swa_pool_tokens, max_running_requests=concurrency, max_context_len=128,
        radix_cache=radix_cache, invariant_check="strict", kv_canary="log",
        event_log=str(tmp_path / "events.jsonl"),
    )
    prompts = _first_wave()
    # Sized so SWA slots must recycle, yet every running request fits with its window.
    footprint = sum(len(p) + NEW_TOKENS for p in prompts)
    widest = max(-(-len(p) // page_size) * page_size for p in prompts)
    assert concurrency * (widest + WINDOW) <= swa_pool_tokens < footprint

    engine = Engine(config, exit_on_crash=False)
    engine.start()
    try:
        first = [engine.submit(p, NEW_TOKENS, rid=f"a{i}") for i, p in enumerate(prompts)]
        assert engine.wait_idle(30)
        # Second wave: each shared-prefix conversation continues (its prompt is the first turn,
        # its answer and a few new tokens), arriving after the first wave has finished.
        rng = random.Random(11)
        second = [engine.submit(first[i].all_ids + _tokens(rng, 3), NEW_TOKENS, rid=f"b{i}")
                  for i in range(0, 8, 2)]
        assert engine.wait_idle(30)
        state = _assert_clean(engine)
    finally:
        engine.stop()

    for req in first + second:
        assert req.finish_reason == "length"
        assert req.output_ids == _oracle(engine, req), req.rid
    if radix_cache:
        assert all(req.cache_protected_len > 0 for req in second), [r.cache_protected_len for r in second]
        assert all(req.cache_protected_len % page_size == 0 for req in second)
        assert state["stats"]["cached_tokens"] > 0
    else:
        assert state["stats"]["cached_tokens"] == 0
    assert state["exercise"]["swa_slots_reused"] > 0
    assert state["exercise"]["swa_evicted_tokens"] > 0


def _default_suite_workload(seed: int = 0) -> list[list[int]]:
    """Like the default suite: 8 requests of 24-64 prompt tokens (48 new tokens each)."""
    rng = random.Random(seed)
    return [_tokens(rng, rng.randint(24, 64)) for _ in range(8)]


def test_default_config_balances_ledgers_and_proves_exercise(tmp_path: Path) -> None:
    config = EngineConfig(event_log=str(tmp_path / "events.jsonl"))
    assert config.max_running_requests == 4  # the default suite's concurrency
    engine = Engine(config, exit_on_crash=False)
    engine.start()
    try:
        reqs = [engine.submit(p, 48, rid=f"r{i}") for i, p in enumerate(_default_suite_workload())]
        assert engine.wait_idle(60)
        state = _assert_clean(engine)
    finally:
        engine.stop()
    assert all(len(r.output_ids) == 48 for r in reqs)
    exercise = state["exercise"]
    assert max(exercise["mapping_nonidentity"], exercise["max_mapping_nonidentity"]) > 0, exercise
    assert exercise["swa_evicted_tokens"] > 0, exercise
    assert exercise["swa_slots_reused"] > 0, exercise
    assert exercise["divergent_allocs"] > 0, exercise
    idle_checks = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "idle_check"]
    assert idle_checks and idle_checks[-1]["balanced"]


def _gated_run(
    path: Path, *, seed: int = 0, driver_delay_s: float = 0.0, perturb: Callable[[Engine], None] | None = None
) -> list[dict]:
    """8 requests, 4 in flight, the driver replacing each finished one (as over HTTP)."""
    config = EngineConfig(
        device="cpu", seed=seed, event_log=str(path), gate_requests=8, gate_concurrency=4,
        invariant_check="strict", kv_canary="log",
    )
    engine = Engine(config, exit_on_crash=False)
    if perturb is not None:
        perturb(engine)
    engine.start()
    rng = random.Random(3)
    work = [(_tokens(rng, rng.randint(24, 64)), 16, 0.7 if i % 3 == 0 else 0.0) for i in range(8)]
    finished: queue.Queue[Req] = queue.Queue()
    try:
        for i, (ids, n, temp) in enumerate(work[:4]):
            engine.submit(ids, n, temperature=temp, rid=f"r{i:02d}", on_finish=finished.put)
        for i in range(4, 8 + 4):
            finished.get(timeout=30)
            time.sleep(driver_delay_s)  # a slow client: the engine runs dry meanwhile
            if i < 8:
                ids, n, temp = work[i]
                engine.submit(ids, n, temperature=temp, rid=f"r{i:02d}", on_finish=finished.put)
        assert engine.wait_idle(30)
    finally:
        engine.stop()
    trace = trace_of(read_events(path))
    start = trace[0]
    assert start["kind"] == "engine_start"
    assert "event_log" not in start["config"]  # the run's own path is not part of its trace
    return trace


def test_same_seed_gives_identical_event_trace(tmp_path: Path) -> None:
    fast = _gated_run(tmp_path / "fast.jsonl")
    slow = _gated_run(tmp_path / "slow.jsonl", driver_delay_s=0.05)
    assert [e["kind"] for e in fast] == [e["kind"] for e in slow]
    assert fast == slow
    kinds = {e["kind"] for e in fast}
    assert {"engine_start", "request_admitted", "request_finished", "step", "idle_check", "shutdown"} <= kinds
    assert "gate_timeout" not in kinds
    # Idle ticks run only once the driver is done, never between its waves.
    idle_steps = [e["step"] for e in fast if e["kind"] == "idle_check"]
    last_step = max(e["step"] for e in fast if e["kind"] == "step")
    assert idle_steps == [last_step]


def test_different_seed_gives_different_trace(tmp_path: Path) -> None:
    a = _gated_run(tmp_path / "a.jsonl", seed=0)
    b = _gated_run(tmp_path / "b.jsonl", seed=1)
    assert a != b


def test_gated_engine_idles_after_gate_timeout_when_driver_stops_early(tmp_path: Path) -> None:
    config = EngineConfig(device="cpu", event_log=str(tmp_path / "e.jsonl"), gate_requests=3,
                          gate_concurrency=1, gate_timeout_s=0.2)
    engine = Engine(config, exit_on_crash=False)
    engine.start()
    try:
        req = engine.submit([1, 2, 3], 4, rid="only")
        assert engine.wait_idle(10)  # the driver never sends the other two
    finally:
        engine.stop()
    assert req.output_ids and engine.last_idle is not None and engine.last_idle["balanced"]
    kinds = [e["kind"] for e in read_events(tmp_path / "e.jsonl")]
    assert "gate_timeout" in kinds
    assert kinds.index("gate_timeout") < len(kinds) - 1 - kinds[::-1].index("idle_check")


@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens", "message"),
    [
        (500, 20, "max_context_len=512"),
        (40, 480, "max_context_len=512"),
        (310, 8, "swa_pool_tokens=320 .* chunked_prefill_size is off"),
    ],
)
def test_submit_rejects_requests_that_can_never_fit(
    tmp_path: Path, prompt_len: int, max_new_tokens: int, message: str
) -> None:
    # Chunked prefill off: the SWA pool must hold the whole prompt beside its headroom.
    config = EngineConfig(device="cpu", event_log=str(tmp_path / "e.jsonl"), chunked_prefill_size=-1)
    engine = Engine(config, exit_on_crash=False)
    try:
        with pytest.raises(RequestRejected, match=message):
            engine.submit([1] * prompt_len, max_new_tokens)
        assert engine.received == 0
    finally:
        engine.stop(drain_timeout_s=0)


def test_submit_rejects_a_rid_already_in_flight(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "e.jsonl")), exit_on_crash=False)
    try:
        engine.submit([1, 2, 3], 4, rid="dup")
        with pytest.raises(RequestRejected, match="already in flight") as info:
            engine.submit([4, 5, 6], 4, rid="dup")
        assert info.value.param == "rid"
        engine.start()
        assert engine.wait_idle(10)
        engine.submit([4, 5, 6], 4, rid="dup")  # finished rids may be reused
        assert engine.wait_idle(10)
    finally:
        engine.stop()
    assert engine.completed == 2


def test_crash_in_a_step_is_logged_and_fails_pending_requests(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "e.jsonl")), exit_on_crash=False)
    real_step = engine.scheduler.step
    calls = {"n": 0}

    def failing_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")
        return real_step()

    engine.scheduler.step = failing_step  # type: ignore[method-assign]
    done: list[Req] = []
    engine.start()
    try:
        reqs = [engine.submit([1, 2, 3, 4], 8, rid=f"r{i}", on_finish=done.append) for i in range(2)]
        deadline = time.monotonic() + 10
        # The crash record appears first; the pending requests are failed right after it.
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.crash is not None
        assert engine.crash["cause"] == "error" and engine.crash["exit_code"] == 1
        assert all(r.finish_reason == "engine_crashed" for r in reqs)
        assert sorted(r.rid for r in done) == ["r0", "r1"]
        with pytest.raises(RuntimeError, match="engine crashed"):
            engine.submit([1], 1)
        assert not engine.wait_idle(0.2)
    finally:
        engine.stop()
    crashes = [e for e in read_events(tmp_path / "e.jsonl") if e["kind"] == "crash"]
    assert len(crashes) == 1 and "planted failure" in crashes[0]["error"]


def test_state_reports_pools_and_config(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(device="cpu", event_log=str(tmp_path / "e.jsonl")), exit_on_crash=False)
    engine.start()
    try:
        engine.submit(list(range(30)), 5)
        assert engine.wait_idle(10)
        state = engine.state()
    finally:
        engine.stop()
    assert state["received"] == state["completed"] == 1
    assert state["pools"]["full"]["size"] == 2048 and state["pools"]["swa"]["size"] == 320
    assert state["pools"]["req_rows"]["available"] == 4
    assert state["config"]["window"] == 16
    assert state["event_log"] == str(tmp_path / "e.jsonl")
    assert state["last_idle_check"]["after_step"] == state["step"]


def test_decode_stall_below_crash_level_aborts_the_youngest_request(tmp_path: Path) -> None:
    from engine_stub.events import EventLog
    from engine_stub.invariants import hit_counts, override_level
    from engine_stub.scheduler import Scheduler

    config = EngineConfig(device="cpu", invariant_check="warn", window=8, swa_pool_tokens=64)
    events = EventLog(tmp_path / "events.jsonl")
    sched = Scheduler(config, events)
    for i in range(2):  # prompts shorter than the window: the first decode evicts nothing
        sched.add_request(Req(f"r{i}", list(range(40, 46)), 20))
    with override_level("warn"):
        sched.step()  # both prefill together
        # Something leaked every free SWA slot: the next decode cannot allocate.
        stolen = sched.allocator.swa_attn_allocator.alloc(sched.allocator.swa_available_size())
        assert stolen is not None
        sched.step()
    events.close()
    assert hit_counts()["sched.decode_stall"] == 1
    aborted = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "request_finished"]
    assert [(e["rid"], e["finish_reason"]) for e in aborted] == [("r1", "abort")]  # the youngest
    assert [r.rid for r in sched.running] == ["r0"]
