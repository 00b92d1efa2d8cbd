"""The memory census (engine_stub/census.py): a clean engine never trips a rule, at idle or mid
run, on either page size, with or without a radix cache; each rule fires on damage planted
directly into the state it reads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_stub.census import CENSUS_RULES
from engine_stub.config import EngineConfig
from engine_stub.events import EventLog, read_events
from engine_stub.invariants import InvariantCheckLevel, hit_counts, override_level, reset_counters
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req
from engine_stub.scheduler import Scheduler

RULES = [inv.name for inv in CENSUS_RULES]


_LOGS: list[EventLog] = []


@pytest.fixture(autouse=True)
def _close_logs():
    yield
    while _LOGS:
        _LOGS.pop().close()


def _scheduler(tmp_path: Path, *, page_size: int = 1, radix_cache: bool = True, **knobs) -> Scheduler:
    reset_counters()
    config = EngineConfig(device="cpu", page_size=page_size, radix_cache=radix_cache, **knobs)
    log = EventLog(tmp_path / "events.jsonl")
    _LOGS.append(log)
    return Scheduler(config, log)


def _prompts(seed: int, n: int, shared: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB_SIZE) for _ in range(shared)]
    return [head + [rng.randrange(VOCAB_SIZE) for _ in range(length - shared)] for _ in range(n)]


def _mid_run(tmp_path: Path, *, page_size: int = 1, radix_cache: bool = True, **knobs) -> Scheduler:
    """A first wave cached and finished, a second wave (cache hits on its prefix) decoding past a
    window."""
    sched = _scheduler(tmp_path, page_size=page_size, radix_cache=radix_cache, **knobs)
    prompts = _prompts(3, 6, 48, 64)
    for i, prompt in enumerate(prompts[:3]):
        sched.add_request(Req(f"a{i}", prompt, 2))  # no window eviction: cached live
    while sched.has_work:
        sched.step()
    for i, prompt in enumerate(prompts[3:]):
        sched.add_request(Req(f"b{i}", prompt, 40))
    for _ in range(24):  # the prefill, then decode past a window
        sched.step()
    assert len(sched.running) == 3
    return sched


def _hit_prefilled(tmp_path: Path) -> Scheduler:
    """One request cached (live, no window eviction), then a cache hit on all but its last few
    tokens, prefilled: its next window still reads the cached prefix."""
    sched = _scheduler(tmp_path)
    prompt = _prompts(9, 1, 0, 64)[0]
    sched.add_request(Req("a", prompt, 2))
    while sched.has_work:
        sched.step()
    sched.add_request(Req("b", prompt[:56] + [prompt[56] ^ 1, 7], 20))
    sched.step()
    assert sched.running[0].cache_protected_len > sched.running[0].kv_len - sched.window
    return sched


def _failures(sched: Scheduler) -> dict[str, int]:
    return sched.census.check().summary()["failures"]


def _fired(sched: Scheduler, rule: str) -> int:
    """Hits of `rule` after one census handed to `expect` at WARN (its count path)."""
    before = hit_counts()[rule]
    with override_level(InvariantCheckLevel.WARN):
        sched.census.check().expect_all()
    return hit_counts()[rule] - before


@pytest.mark.parametrize("radix_cache", [True, False], ids=["radix", "noradix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_run_trips_no_census_rule_mid_run_or_at_idle(tmp_path: Path, page_size: int, radix_cache: bool) -> None:
    sched = _mid_run(tmp_path, page_size=page_size, radix_cache=radix_cache)
    seen = 0
    while sched.has_work:
        assert _failures(sched) == dict.fromkeys(RULES, 0)
        seen += 1
        sched.step()
    assert seen > 10
    result = sched.idle_tick()
    assert result["census"]["failures"] == dict.fromkeys(RULES, 0), result["census"]
    assert result["census"]["full_held_twice"] == result["census"]["swa_held_twice"] == 0
    assert all(hit_counts()[rule] == 0 for rule in RULES)


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_chunked_prefill_with_hits_trips_no_census_rule_at_any_step(tmp_path: Path, page_size: int) -> None:
    sched = _scheduler(tmp_path, page_size=page_size, swa_pool_tokens=128, full_pool_tokens=1024,
                       max_context_len=512)
    assert sched.chunk_tokens is not None
    prompts = _prompts(5, 4, 160, 200)
    for i, prompt in enumerate(prompts):
        sched.add_request(Req(f"c{i}", prompt, 24))
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        assert _failures(sched) == dict.fromkeys(RULES, 0), steps
    assert sched.stats["prefill_chunks"] > 0 and sched.stats["cached_tokens"] > 0
    assert sched.idle_tick()["census"]["failures"] == dict.fromkeys(RULES, 0)


def test_strict_engine_runs_the_census_where_slots_change_hands(tmp_path: Path, monkeypatch) -> None:
    sched = _scheduler(tmp_path, invariant_check="strict")
    calls = []
    check = sched.census.check
    monkeypatch.setattr(sched.census, "check", lambda: calls.append(sched.step_no) or check())
    for i, prompt in enumerate(_prompts(1, 2, 0, 40)):
        sched.add_request(Req(f"s{i}", prompt, 6))
    with override_level(InvariantCheckLevel.STRICT):
        while sched.has_work:
            sched.step()
    finishes = sched.stats["finished_requests"]
    assert finishes == 2 and calls and len(calls) < sched.step_no  # the finish steps, not every step
    calls.clear()
    with override_level(InvariantCheckLevel.WARN):
        sched.add_request(Req("w", _prompts(2, 1, 0, 40)[0], 6))
        while sched.has_work:
            sched.step()
    assert calls == []  # below STRICT the census waits for idle


def test_leaked_request_has_slots_no_one_owns(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    sched.running.pop()  # gone, neither freed nor cached
    assert _fired(sched, "census.slot_owner") > 0
    assert _failures(sched)["census.ledger"] > 0  # its row is neither free nor held


def test_slot_on_the_free_list_and_in_a_row_has_two_owners(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    req = sched.running[0]
    own = sched.req_to_token_pool.req_to_token[req.row, req.kv_len - 1:req.kv_len].to(torch.int64)
    sched.allocator.full_attn_allocator.free(own)  # the full side only: its peer stays mapped
    assert _fired(sched, "census.slot_owner") > 0
    assert _failures(sched)["census.peer_live"] > 0


def test_free_slot_with_a_peer_trips_peer_live(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    free = sched.allocator.full_attn_allocator.free_pages[:1]
    sched.allocator.full_to_swa_index_mapping[free] = 5
    assert _fired(sched, "census.peer_live") == 1
    assert _failures(sched)["census.slot_owner"] == 0  # a free slot's peer is no owner


def test_in_window_slot_without_a_peer_trips_peer_live(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    req = sched.running[0]
    last = sched.req_to_token_pool.req_to_token[req.row, req.kv_len - 1:req.kv_len].to(torch.int64)
    sched.allocator.clear_full_to_swa_mapping(last)
    assert _fired(sched, "census.peer_live") == 1


def test_window_evicted_slot_still_mapped_trips_peer_live(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path, radix_cache=False)
    req = sched.running[0]
    assert req.swa_evicted_seqlen > 0
    evicted = sched.req_to_token_pool.req_to_token[req.row, :1].to(torch.int64)
    sched.allocator.full_to_swa_index_mapping[evicted] = 7
    assert _fired(sched, "census.peer_live") == 1


def test_lock_no_request_holds_trips_lock_count(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    node = next(iter(sched.tree_cache.root.children.values()))
    node.full_lock_ref += 1
    assert _fired(sched, "census.lock_count") == 1


def test_lock_released_under_a_running_request_trips_lock_count(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    req = next(r for r in sched.running if r.lock is not None and r.cache_protected_len)
    req.lock.node.full_lock_ref -= 1
    assert _fired(sched, "census.lock_count") == 1


def test_row_held_and_free_at_once_trips_ledger(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    sched.req_to_token_pool.free_slots.append(sched.running[0].row)
    assert _fired(sched, "census.ledger") == 1


def test_prefix_row_naming_another_slot_trips_row_matches(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path)
    req = next(r for r in sched.running if r.lock is not None and r.cache_protected_len)
    table = sched.req_to_token_pool.req_to_token
    table[req.row, 0] = table[req.row, req.kv_len - 1]
    assert _fired(sched, "census.row_matches") == 1


def test_prefix_the_window_reads_without_a_peer_trips_row_matches(tmp_path: Path) -> None:
    sched = _hit_prefilled(tmp_path)
    req = sched.running[0]
    inside = sched.req_to_token_pool.req_to_token[req.row, req.cache_protected_len - 1:req.cache_protected_len]
    sched.allocator.clear_full_to_swa_mapping(inside.to(torch.int64))
    assert _fired(sched, "census.row_matches") == 1


def test_idle_census_goes_on_record_and_crashes_when_strict(tmp_path: Path) -> None:
    sched = _mid_run(tmp_path, strict_mem_check_during_idle=True)
    while sched.has_work:
        sched.step()
    sched.allocator.full_to_swa_index_mapping[sched.allocator.full_attn_allocator.free_pages[:1]] = 3
    with pytest.raises(Exception, match="census.peer_live"):
        sched.idle_tick()
    idle = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "idle_check"]
    assert idle[-1]["census"]["failures"]["census.peer_live"] == 1


def test_window_reading_a_prefix_whose_swa_lock_went_back_trips_lock_count(tmp_path: Path) -> None:
    sched = _hit_prefilled(tmp_path)
    req = sched.running[0]
    assert _failures(sched)["census.lock_count"] == 0
    sched.tree_cache.dec_swa_lock_only(req.lock)  # handle and nodes agree, but too early
    assert _fired(sched, "census.lock_count") == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_mid_run_census_adds_no_device_sync(tmp_path: Path, page_size: int) -> None:
    from engine_stub.synccheck import count_syncs

    assert count_syncs(lambda: torch.ones(3).sum().item()).total == 1, "the detector must see a planted sync"
    sched = _mid_run(tmp_path, page_size=page_size)

    def census() -> None:
        with override_level(InvariantCheckLevel.WARN):
            sched.census.check().expect_all()

    check = count_syncs(census)
    assert check.total == 0, check.summary()
