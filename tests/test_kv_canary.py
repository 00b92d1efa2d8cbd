"""The KV canary catches planted damage at the right slot, position and request, and nothing else.

Each test drives `engine.scheduler.step()` directly (no engine thread), so damage lands between
two known steps; violations are read back from the durable event log, as the harness reads them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.kv_canary import REASONS, CanaryViolation
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req
from engine_stub.scheduler import CanaryRaised

WINDOW = 8
PATTERN = "SFSS"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, layer_pattern=PATTERN, kv_canary="log",
                     full_pool_tokens=512, swa_pool_tokens=128, max_context_len=256,
                     kv_canary_sweep_interval=4, event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    yield eng
    eng.stop(drain_timeout_s=0)


def _add(engine: Engine, rid: str, prompt_len: int, max_new_tokens: int) -> Req:
    rng = random.Random(rid)
    req = Req(rid, [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)], max_new_tokens)
    engine.scheduler.add_request(req)
    return req


def _steps(engine: Engine, n: int) -> None:
    for _ in range(n):
        engine.scheduler.step()


def _violations(engine: Engine, step: int | None = None) -> list[dict]:
    events = read_events(engine.events.path)
    return [e for e in events if e["kind"] == "canary_violation" and (step is None or e["step"] == step)]


def _slot(engine: Engine, req: Req, position: int) -> int:
    return int(engine.scheduler.req_to_token_pool.req_to_token[req.row, position])


def _two_decoding(engine: Engine) -> tuple[Req, Req]:
    """Two requests of different lengths, decoding well past one window (SWA peers recycled)."""
    a = _add(engine, "a", 20, 40)
    b = _add(engine, "b", 27, 40)
    _steps(engine, 1 + 2 * WINDOW)
    assert a.kv_len > a.prompt_len + WINDOW and b.kv_len > b.prompt_len + WINDOW
    assert engine.scheduler.stats["swa_evicted_tokens"] > 0
    assert _violations(engine) == []
    return a, b


@pytest.mark.parametrize(
    ("where", "groups"),
    [
        ("out_of_window", {"FULL"}),  # only the full group reads that position
        ("in_window", {"FULL", "SWA"}),  # both groups read it
    ],
)
def test_wrong_slot_in_req_to_token_reports_slot_position_and_request(
    engine: Engine, where: str, groups: set[str]
) -> None:
    a, b = _two_decoding(engine)
    position = 5 if where == "out_of_window" else a.kv_len - 3
    wrong = _slot(engine, b, b.kv_len - 2)  # another live request's slot, in its window
    engine.scheduler.req_to_token_pool.req_to_token[a.row, position] = wrong
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)

    hits = [v for v in _violations(engine, step)
            if v["slot"] == wrong and v["position"] == position and v["request"] == "a"]
    assert {v["reason"] for v in hits} >= {"verify_position"}
    assert {v["reason"] for v in hits} <= {"verify_position", "verify_chain_hash"}
    assert {v["group"] for v in hits if v["phase"] == "HEAD"} == groups
    position_hit = next(v for v in hits if v["reason"] == "verify_position")
    assert (position_hit["stored"], position_hit["expected"]) == (b.kv_len - 3, position)
    assert "fail_reason=verify_position" in position_hit["line"]
    # Nothing is blamed on the undamaged request.
    assert all(v["request"] in ("a", "") for v in _violations(engine, step))


def test_zeroed_req_to_token_entry_breaks_the_next_chain_link(engine: Engine) -> None:
    a, _ = _two_decoding(engine)
    position = 6
    engine.scheduler.req_to_token_pool.req_to_token[a.row, position] = 0  # the padding slot
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)
    found = {(v["reason"], v["position"], v["request"]) for v in _violations(engine, step)}
    # Slot 0 itself is never verified; its successor's chain no longer links.
    assert ("verify_chain_hash", position + 1, "a") in found
    assert not any(p == position for _, p, _ in found)


@pytest.mark.parametrize("group", ["FULL", "SWA"])
def test_flipped_kv_byte_gives_real_kv_hash_violation_in_tail(engine: Engine, group: str) -> None:
    a, _ = _two_decoding(engine)
    position = a.kv_len - 2  # live in both pools
    slot = _slot(engine, a, position)
    layer = PATTERN.index("F" if group == "FULL" else "S")
    pool = engine.scheduler.kv_pool
    row = int(pool.rows_of(layer, torch.tensor([slot]))[0])
    raw = pool.k_buffer[layer][row].view(torch.uint8)  # float64 row as bytes
    raw[0, 0] ^= 0x01  # the lowest mantissa byte: a small, finite change
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)

    violations = _violations(engine, step)
    assert violations, "a flipped KV byte went unnoticed"
    assert {(v["phase"], v["group"], v["reason"]) for v in violations} == {
        ("TAIL", group, "verify_real_kv_hash")
    }
    (hit,) = violations
    assert (hit["slot"], hit["pool_row"], hit["position"], hit["request"]) == (slot, row, position, "a")


def test_flipped_byte_of_cached_slot_is_caught_by_sweep(engine: Engine) -> None:
    short = _add(engine, "short", 12, 12)
    _add(engine, "long", 16, 60)
    while short.finish_reason is None:
        _steps(engine, 1)
    tree = engine.scheduler.tree_cache
    assert tree is not None and tree.total_size() > 0
    cached = tree.cached_paths()[0].slots
    slot = int(cached[3])
    layer = PATTERN.index("F")
    engine.scheduler.kv_pool.v_buffer[layer][slot].view(torch.uint8)[1, 2] ^= 0x10
    interval = engine.config.kv_canary_sweep_interval
    _steps(engine, interval)
    sweeps = [v for v in _violations(engine) if v["phase"] == "SWEEP"]
    assert sweeps
    assert {(v["reason"], v["group"], v["slot"], v["position"], v["request"]) for v in sweeps} == {
        ("verify_real_kv_hash", "FULL", slot, 3, "")
    }


def test_token_oracle_mismatch_gives_write_token(engine: Engine) -> None:
    a, _ = _two_decoding(engine)
    actual = a.output_ids[-1]
    wrong = (actual + 1) % VOCAB_SIZE
    engine.scheduler.canary.note_sampled("a", wrong)
    position = a.kv_len
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)
    violations = _violations(engine, step)
    assert [(v["reason"], v["phase"], v["request"], v["position"], v["stored"], v["expected"])
            for v in violations] == [("write_token", "WRITE", "a", position, actual, wrong)]


@pytest.mark.parametrize(("page_size", "radix_cache"), [(1, True), (1, False), (4, True)])
def test_clean_run_has_no_violations_and_verifies_less_swa_than_full(
    tmp_path: Path, page_size: int, radix_cache: bool
) -> None:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, page_size=page_size, kv_canary="log",
                     radix_cache=radix_cache, full_pool_tokens=512, swa_pool_tokens=128,
                     max_context_len=256, kv_canary_sweep_interval=3,
                     event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    try:
        shared = [random.Random(0).randrange(VOCAB_SIZE) for _ in range(20)]
        for i in range(6):
            suffix = [random.Random(i).randrange(VOCAB_SIZE) for _ in range(3 + i)]
            eng.scheduler.add_request(Req(f"r{i}", shared + suffix if i % 2 else suffix * 4, 20))
        while eng.scheduler.has_work:
            eng.scheduler.step()
        stats = eng.scheduler.canary.stats
        assert _violations(eng) == []
        assert stats["violations"] == 0
        assert 0 < stats["verify_swa"] < stats["verify_full"]
        assert stats["writes"] > 0
        if radix_cache:
            assert stats["sweep_passes"] > 0
    finally:
        eng.stop(drain_timeout_s=0)


def test_raise_mode_raises_with_the_violations(tmp_path: Path) -> None:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, kv_canary="raise", full_pool_tokens=512,
                     swa_pool_tokens=128, max_context_len=256, event_log=str(tmp_path / "e.jsonl")),
        exit_on_crash=False,
    )
    try:
        a, b = _add(eng, "a", 20, 30), _add(eng, "b", 24, 30)
        _steps(eng, 4)
        eng.scheduler.req_to_token_pool.req_to_token[a.row, 2] = _slot(eng, b, 9)
        with pytest.raises(CanaryRaised) as info:
            _steps(eng, 1)
        assert any(v.reason == "verify_position" and v.request == "a" for v in info.value.violations)
        assert "kv_canary violation: launch_tag=HEAD_FULL" in str(info.value)
        # The violations were logged durably before the raise.
        assert len(_violations(eng)) == len(info.value.violations)
    finally:
        eng.scheduler.running.clear()
        eng.stop(drain_timeout_s=0)


def test_off_mode_records_nothing(tmp_path: Path) -> None:
    eng = Engine(EngineConfig(device="cpu", window=WINDOW, kv_canary="off",
                              event_log=str(tmp_path / "e.jsonl")), exit_on_crash=False)
    try:
        a = _add(eng, "a", 20, 12)
        _steps(eng, 3)
        eng.scheduler.req_to_token_pool.req_to_token[a.row, 2] = 0
        _steps(eng, 1)
        assert _violations(eng) == []
        assert eng.scheduler.canary.stats == dict.fromkeys(eng.scheduler.canary.stats, 0)
    finally:
        eng.scheduler.running.clear()
        eng.stop(drain_timeout_s=0)


def test_violation_log_line_has_the_frozen_format() -> None:
    v = CanaryViolation("verify_position", "SWA", "HEAD", 17, 5, 9, "req-1", 3, 9, 42)
    assert v.log_line() == (
        "kv_canary violation: launch_tag=HEAD_SWA fail_reason=verify_position slot_idx=17 "
        "pool_row=5 position=9 request=req-1 stored=0x3 expected=0x9 step=42"
    )
    assert v.to_dict()["reason"] in REASONS
