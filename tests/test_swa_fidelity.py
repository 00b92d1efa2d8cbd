"""The scheduler's SWA memory path as SGLang runs it: window-eviction cadence and frontier, and
tombstone recovery when a finished request is cached over a tombstone (inside the finish free
group)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_stub.config import EngineConfig
from engine_stub.events import EventLog
from engine_stub.invariants import hit_counts, override_level
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req
from engine_stub.scheduler import Scheduler

WINDOW = 16


@pytest.fixture
def make_scheduler(tmp_path: Path) -> Iterator[Callable[..., Scheduler]]:
    logs: list[EventLog] = []

    def make(**knobs: object) -> Scheduler:
        config = EngineConfig(device="cpu", window=WINDOW, invariant_check="strict",
                              kv_canary="log", **knobs)
        logs.append(EventLog(tmp_path / f"events-{len(logs)}.jsonl"))
        return Scheduler(config, logs[-1])

    yield make
    for log in logs:
        log.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _run(sched: Scheduler, req: Req) -> list[int]:
    """Run `req` alone to the end; its `swa_evicted_seqlen` before each decode step's forward."""
    sched.add_request(req)
    frontiers = []
    with override_level("strict"):
        while sched.has_work:
            was_decoding = req in sched.running
            sched.step()
            if was_decoding and req in sched.running:
                frontiers.append(req.swa_evicted_seqlen)
    return frontiers


# (page_size, radix_cache, prompt_len, frontier after each decode step)
def _expected(page: int, radix: bool, prompt_len: int, steps: int) -> list[int]:
    keep = max(WINDOW, page) if radix else WINDOW
    frontier, out = 0, []
    for idx in range(steps):  # decode batch idx: kv_len is prompt_len + idx at its start
        if idx >= 1 and (idx - 1) % WINDOW == 0:
            kv_len = prompt_len + idx
            frontier = max(frontier, (kv_len - keep) // page * page)
        out.append(frontier)
    return out


@pytest.mark.parametrize(
    ("page_size", "radix"),
    [(1, True), (1, False), (32, True), (32, False)],
    ids=["page1-radix", "page1-noradix", "page32-radix", "page32-noradix"],
)
def test_window_eviction_runs_once_per_window_of_decode_batches_at_sglang_threshold(
    make_scheduler: Callable[..., Scheduler], page_size: int, radix: bool
) -> None:
    """SGLang's `maybe_evict_swa`: decode batch idx evicts when `idx % window == 1` (never the
    first decode), to `page_floor(kv_len - max(window, page))` with a radix cache and
    `page_floor(kv_len - window)` without."""
    sched = make_scheduler(page_size=page_size, radix_cache=radix,
                           swa_pool_tokens=320 if page_size == 1 else 640)
    prompt_len, new_tokens = 40, 60
    frontiers = _run(sched, Req("a", _prompt(prompt_len), new_tokens))

    # Every decode step but the last one (which finishes the request) is observed.
    assert frontiers == _expected(page_size, radix, prompt_len, new_tokens - 2)
    assert frontiers[-1] > 0, "the window never slid"
    assert sched.stats["swa_evicted_tokens"] == frontiers[-1]
    idle = sched.idle_tick()
    assert idle["balanced"], idle


def test_finish_over_a_tombstone_brings_its_swa_back_so_a_later_prompt_hits_the_cache(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """A long request leaves a tombstone over most of its prefix; a shorter request with the
    same prompt still holds live SWA KV for part of that range, and its finish (inside the
    finish free group) re-adopts it, SGLang's tombstone recovery. A third prompt that ends there
    then reuses the prefix, where without recovery it would match nothing."""
    sched = make_scheduler(page_size=1, radix_cache=True)
    prompt = _prompt(48, seed=3)
    first = Req("a", prompt, 40)
    _run(sched, first)
    (path,) = sched.tree_cache.cached_paths()
    tombstoned = path.swa_live.tolist().index(True)
    assert tombstoned > len(prompt) + 7, "the first request should leave its prompt tombstoned"

    second = Req("b", prompt, 8)
    _run(sched, second)
    assert second.output_ids == first.output_ids[:8]  # greedy: the same tokens, so one path
    (path,) = sched.tree_cache.cached_paths()
    live = path.swa_live.tolist()
    # b slid its window once (to 33) before finishing at 55: [33, 55) came back live.
    assert live[:33] == [False] * 33 and live[33:55] == [True] * 22
    assert hit_counts()["swa.peer_released"] == 0 and hit_counts()["swa.peer_mapped"] == 0

    third = Req("c", prompt + first.output_ids[:7], 4)
    _run(sched, third)
    assert third.cache_protected_len == 54  # all but the last prompt token
    assert third.output_ids == first.output_ids[7:11]
    idle = sched.idle_tick()
    assert idle["balanced"] and not idle["radix_problems"], idle
