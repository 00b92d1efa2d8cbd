"""The engine at the pools' limit: the radix cache fills the full pool, and every answer must
still come back whole and equal to the no-cache oracle (no silent truncation, no stall)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req, RequestRejected

NEW_TOKENS = 120


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(12, 40))] for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> list[Req]:
    """Submit `prompts` keeping `concurrency` in flight; every finished Req, in prompt order."""
    done: dict[int, Req] = {}
    slots = threading.Semaphore(concurrency)
    finished = threading.Event()

    def on_finish(i: int):
        def record(req: Req) -> None:
            done[i] = req
            slots.release()
            if len(done) == len(prompts):
                finished.set()
        return record

    for i, prompt in enumerate(prompts):
        slots.acquire()
        engine.submit(prompt, new_tokens, rid=f"p{i:03d}", on_finish=on_finish(i))
    assert finished.wait(300), f"{len(done)} of {len(prompts)} requests finished"
    return [done[i] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize(("page_size", "concurrency"), [(1, 1), (1, 3), (4, 3)],
                         ids=["page1-serial", "page1-concurrent", "page4-concurrent"])
def test_long_outputs_past_the_full_pool_come_back_whole_and_match_the_oracle(
    tmp_path: Path, page_size: int, concurrency: int
) -> None:
    # 14 x (prompt + 120) tokens is about twice the full pool: the radix cache must be evicted
    # for later requests, and at STRICT a decode stall would crash the engine.
    config = EngineConfig(device="cpu", page_size=page_size, full_pool_tokens=1024,
                          swa_pool_tokens=160, window=16, max_running_requests=4,
                          invariant_check="strict", kv_canary="log",
                          event_log=str(tmp_path / "events.jsonl"))
    engine = Engine(config, exit_on_crash=False)
    engine.start()
    try:
        prompts = _prompts(14, seed=page_size * 10 + concurrency)
        reqs = _run(engine, prompts, concurrency, NEW_TOKENS)
        assert engine.wait_idle(30)
        state = engine.state()
    finally:
        engine.stop(drain_timeout_s=10)
    assert state["crash"] is None
    assert [r.finish_reason for r in reqs] == ["length"] * len(reqs)
    assert [len(r.output_ids) for r in reqs] == [NEW_TOKENS] * len(reqs)
    model = engine.scheduler.model
    for req in reqs:
        predicted = model.reference_next_tokens(req.origin_input_ids + req.output_ids[:-1])
        assert req.output_ids == predicted[req.prompt_len - 1:], f"{req.rid} differs from the oracle"
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if e["kind"] == "decode_stall"]
    assert all(v == 0 for v in state["invariant_hits"].values()), state["invariant_hits"]
    assert state["kv_canary"]["violations"] == 0
    assert all(ledger["delta"] == 0 for ledger in state["last_idle_check"]["ledgers"].values())
    # The pressure was real: the cache had to give back KV to admit and decode later requests.
    assert state["stats"]["prompt_tokens"] + state["stats"]["generated_tokens"] > config.full_pool_tokens


def test_request_larger_than_the_full_pool_is_rejected_at_submit(tmp_path: Path) -> None:
    # It fits max_context_len, but not what admission must reserve (one page of slack): it
    # would wait forever for room an empty engine cannot give.
    config = EngineConfig(device="cpu", full_pool_tokens=512, swa_pool_tokens=128,
                          max_context_len=512, event_log=str(tmp_path / "events.jsonl"))
    engine = Engine(config, exit_on_crash=False)
    try:
        with pytest.raises(RequestRejected, match="full_pool_tokens=512") as info:
            engine.submit([1] * 20, 492)
        assert info.value.param == "max_new_tokens"
    finally:
        engine.stop(drain_timeout_s=1)


def test_abort_frees_a_running_request_at_the_next_step(tmp_path: Path) -> None:
    config = EngineConfig(device="cpu", event_log=str(tmp_path / "events.jsonl"))
    engine = Engine(config, exit_on_crash=False)
    finished = threading.Event()
    engine.start()
    try:
        req = engine.submit(_prompts(1, seed=3)[0], 400, rid="gone", on_finish=lambda r: finished.set())
        while len(req.output_ids) < 5:
            threading.Event().wait(0.01)
        assert engine.abort("gone")
        assert finished.wait(10)
        assert not engine.abort("gone"), "a finished request cannot be aborted again"
        assert engine.wait_idle(10)
        state = engine.state()
    finally:
        engine.stop(drain_timeout_s=5)
    assert req.finish_reason == "abort"
    assert len(req.output_ids) < 400
    assert all(ledger["delta"] == 0 for ledger in state["last_idle_check"]["ledgers"].values())
    finishes = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "request_finished"]
    assert [(e["rid"], e["finish_reason"]) for e in finishes] == [("gone", "abort")]


@pytest.mark.parametrize("level", ["strict", "warn"])
def test_leaked_rows_make_an_idle_engine_fire_admission_stall_not_hang(tmp_path: Path, level: str) -> None:
    # Planted: every request row taken by no request (a row leak), then one request arrives.
    config = EngineConfig(device="cpu", invariant_check=level, strict_mem_check_during_idle=False,
                          event_log=str(tmp_path / "events.jsonl"))
    engine = Engine(config, exit_on_crash=False)
    rows = engine.scheduler.req_to_token_pool
    leaked = [Req(rid=f"leak{i}", origin_input_ids=[1], max_new_tokens=1) for i in range(rows.available_size())]
    rows.alloc(leaked)
    finished = threading.Event()
    engine.start()
    try:
        req = engine.submit(_prompts(1, seed=5)[0], 8, rid="starved", on_finish=lambda r: finished.set())
        if level == "strict":
            for _ in range(500):
                if engine.state()["crash"] is not None:
                    break
                threading.Event().wait(0.01)
            crash = engine.state()["crash"]
            assert crash is not None and "[sched.admission_stall]" in crash["error"], crash
        else:
            assert finished.wait(10), "the starved request hung"
            assert req.finish_reason == "abort" and req.output_ids == []
            assert engine.state()["invariant_hits"]["sched.admission_stall"] >= 1
    finally:
        engine.stop(drain_timeout_s=1)
    events = read_events(tmp_path / "events.jsonl")
    stall = next(e for e in events if e["kind"] == "admission_stall")
    assert stall["free_rows"] == 0 and stall["waiting"] == 1
    # The ledgers ran first and name the leak.
    idle = next(e for e in events if e["kind"] == "idle_check")
    assert idle["ledgers"]["req_rows"]["delta"] != 0
