"""Chunked prefill, end to end in process: prompts far longer than the SWA pool are served a
chunk at a time, their answers equal to the no-cache oracle and the ledgers balanced."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from engine_stub.config import ConfigError, EngineConfig, config_from_sources
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.model import VOCAB_SIZE, ModelConfig, TinyHybridModel
from engine_stub.req import Req, RequestRejected


@functools.cache
def _model(layer_pattern: str, window: int, hidden_size: int, num_heads: int, seed: int) -> TinyHybridModel:
    return TinyHybridModel(ModelConfig(layer_pattern, window, hidden_size, num_heads, seed))


def _oracle(config: EngineConfig, req: Req) -> list[int]:
    model = _model(config.layer_pattern, config.window, config.hidden_size, config.num_heads, config.seed)
    return model.reference_generate(list(req.origin_input_ids), req.max_new_tokens)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _serve(config: EngineConfig, prompts: list[list[int]], new_tokens: list[int]) -> tuple[list[Req], dict]:
    engine = Engine(config, exit_on_crash=False)
    engine.start()
    try:
        reqs = [engine.submit(p, n, rid=f"r{i:02d}") for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]
        assert engine.wait_idle(120)
        state = engine.state()
    finally:
        engine.stop()
    assert state["crash"] is None, state["crash"]
    assert state["kv_canary"]["violations"] == 0
    assert all(n == 0 for n in state["invariant_hits"].values()), state["invariant_hits"]
    assert engine.last_idle is not None and engine.last_idle["balanced"], engine.last_idle
    for req in reqs:
        assert req.finish_reason == "length", (req.rid, req.finish_reason)
        assert req.output_ids == _oracle(config, req), req.rid
    return reqs, state


@pytest.mark.parametrize("radix_cache", [True, False], ids=["radix", "noradix"])
@pytest.mark.parametrize(("page_size", "windows"), [(1, 4), (16, 8)], ids=["page1-4windows", "page16-8windows"])
def test_prompt_of_max_context_minus_one_is_served_on_a_few_windows_matching_oracle(
    tmp_path: Path, page_size: int, windows: int, radix_cache: bool
) -> None:
    window = 16
    config = EngineConfig(
        device="cpu", page_size=page_size, window=window, full_pool_tokens=1024,
        swa_pool_tokens=windows * window, max_context_len=512, radix_cache=radix_cache,
        invariant_check="strict", kv_canary="log", event_log=str(tmp_path / "events.jsonl"),
    )
    prompt = _tokens(random.Random(5), config.max_context_len - 1)
    (req,), state = _serve(config, [prompt], [1])
    chunk = config.prefill_chunk_tokens
    assert chunk is not None and chunk < len(prompt)
    stats = state["stats"]
    assert stats["chunked_requests"] == 1
    assert stats["prefill_chunks"] == -(-len(prompt) // chunk) - 1
    # The SWA pool really recycled: it handed out far more slots than it has.
    assert state["exercise"]["swa_slots_reused"] >= len(prompt) - config.swa_pool_tokens
    assert state["exercise"]["swa_evicted_tokens"] > 0
    events = read_events(tmp_path / "events.jsonl")
    chunks = [e for e in events if e["kind"] == "prefill_chunk"]
    assert [e["kv_len"] for e in chunks] == [chunk * (i + 1) for i in range(len(chunks))]
    if radix_cache:
        # Each boundary cached the processed part: the tree owns it, its head a tombstone.
        assert all(e["protected"] == e["kv_len"] for e in chunks)
        assert chunks[-1]["frontier"] == chunks[-1]["kv_len"]


def test_chunked_and_whole_prompts_share_the_engine_matching_oracle(tmp_path: Path) -> None:
    rng = random.Random(9)
    shared = _tokens(rng, 40)
    prompts = [_tokens(rng, 200), shared + _tokens(rng, 30), _tokens(rng, 20), shared + _tokens(rng, 150),
               _tokens(rng, 90)]
    config = EngineConfig(
        device="cpu", window=8, full_pool_tokens=1024, swa_pool_tokens=96, max_context_len=256,
        max_running_requests=3, radix_cache=True, invariant_check="strict", kv_canary="log",
        kv_canary_sweep_interval=4, event_log=str(tmp_path / "events.jsonl"),
    )
    reqs, state = _serve(config, prompts, [12, 20, 16, 9, 30])
    assert state["stats"]["chunked_requests"] >= 2
    assert state["exercise"]["swa_slots_reused"] > 0


@pytest.mark.parametrize(
    ("page_size", "window", "swa_pool_tokens", "prompt_len", "radix_cache"),
    [(8, 1, 64, 66, True), (1, 17, 64, 70, False), (32, 5, 160, 36, True), (4, 9, 64, 61, False),
     (16, 13, 112, 70, True)],
    ids=["page8-window1", "page1-window17", "page32-window5", "page4-window9", "page16-window13"],
)
def test_configs_that_refused_unchunked_prompts_now_serve_them(
    tmp_path: Path, page_size: int, window: int, swa_pool_tokens: int, prompt_len: int, radix_cache: bool
) -> None:
    config = EngineConfig(
        device="cpu", page_size=page_size, window=window, full_pool_tokens=512,
        swa_pool_tokens=swa_pool_tokens, max_context_len=256, radix_cache=radix_cache,
        invariant_check="strict", kv_canary="log", event_log=str(tmp_path / "events.jsonl"),
    )
    unchunked = EngineConfig(**{**config.knobs(), "chunked_prefill_size": -1})
    rng = random.Random(page_size * 100 + window)
    prompts = [_tokens(rng, prompt_len - i) for i in range(3)]
    refusing = Engine(unchunked, exit_on_crash=False)
    refusing.start()
    try:
        with pytest.raises(RequestRejected, match="chunked_prefill_size is off"):
            refusing.submit(prompts[0], 8)
    finally:
        refusing.stop()
    _serve(config, prompts, [8, 12, 5])


def test_default_chunk_is_what_the_swa_pool_holds_beside_one_headroom() -> None:
    config = EngineConfig(page_size=16, window=16, swa_pool_tokens=128, full_pool_tokens=1024)
    assert config.swa_headroom == 64
    assert config.prefill_chunk_tokens == 64
    assert EngineConfig(page_size=16, window=16, swa_pool_tokens=128, full_pool_tokens=1024,
                        chunked_prefill_size=40).prefill_chunk_tokens == 32
    assert EngineConfig(chunked_prefill_size=-1).prefill_chunk_tokens is None


@pytest.mark.parametrize(("raw", "value"), [("auto", 0), ("off", -1), ("OFF", -1), ("48", 48)])
def test_chunked_prefill_size_knob_accepts_auto_off_and_tokens(raw: str, value: int) -> None:
    config = config_from_sources(environ={"ENGINE_STUB_CHUNKED_PREFILL_SIZE": raw})
    assert config.chunked_prefill_size == value


def test_chunk_smaller_than_a_page_is_refused_naming_the_knob() -> None:
    with pytest.raises(ConfigError, match="chunked_prefill_size=8 .*at least page_size=16"):
        config_from_sources(overrides={"chunked_prefill_size": 8, "page_size": 16, "swa_pool_tokens": 128})


def _alloc_page_aligned(allocator, n: int, page_size: int):
    import torch

    if page_size == 1:
        return allocator.alloc(n)
    return allocator.alloc_extend([0], [n], torch.tensor([-1], dtype=torch.int64), n)


def test_cache_unfinished_inserts_an_evicted_prefix_as_a_tombstone() -> None:
    """SGLang's TestCacheUnfinishedReqEvictedPrefix on our tree: 16 tokens, page 4, window 4,
    the first 8 already window-evicted."""
    from engine_stub.mem.radix import SWARadixCache
    from engine_stub.mem.swa import SWATokenToKVPoolAllocator

    page_size, window, num_tokens, evicted = 4, 4, 16, 8
    allocator = SWATokenToKVPoolAllocator(256, 64, page_size)
    tree = SWARadixCache(allocator, page_size, window)
    slots = _alloc_page_aligned(allocator, num_tokens, page_size)
    allocator.free_swa(slots[:evicted])  # as window eviction would
    swa_before = allocator.swa_available_size()

    result = tree.cache_unfinished(list(range(1, num_tokens + 1)), slots, prev_prefix_len=0,
                                   swa_evicted_seqlen=evicted, lock=None)

    assert allocator.swa_available_size() == swa_before  # the insert itself frees nothing
    assert result.protected_len == num_tokens  # the live leaf holds a window: all matchable
    (first,) = tree.root.children.values()
    assert first.swa_tombstone and len(first.value) == evicted
    assert tree.swa_evictable_size() + tree.swa_protected_size() == num_tokens - evicted
    # Finishing: insert the same tokens again (the tree's own), drop the lock; nothing moves.
    tree.insert(list(range(1, num_tokens + 1)), result.slots, prev_prefix_len=num_tokens,
                swa_evicted_seqlen=evicted)
    tree.dec_lock_ref(result.lock)
    assert allocator.swa_available_size() == swa_before
    assert tree.swa_evictable_size() + tree.swa_protected_size() == num_tokens - evicted
    assert tree.sanity_check() == []


def test_chunk_boundary_caches_the_window_evicted_head_as_a_tombstone(tmp_path: Path) -> None:
    """The same case through the scheduler: a chunk of 16 on page 4 whose frontier is at 8
    (window 8) is cached with [0, 8) a tombstone and the request locked past it."""
    config = EngineConfig(device="cpu", page_size=4, window=8, full_pool_tokens=256, swa_pool_tokens=64,
                          max_context_len=128, chunked_prefill_size=16, radix_cache=True,
                          invariant_check="strict", kv_canary="log", event_log=str(tmp_path / "e.jsonl"))
    engine = Engine(config, exit_on_crash=False)
    sched = engine.scheduler
    req = Req("r0", _tokens(random.Random(1), 20), 4)
    sched.add_request(req)
    swa_free_at_start = sched.allocator.swa_available_size()
    sched.step()  # the first chunk, [0, 16)
    assert (req.kv_len, req.cache_protected_len, req.swa_evicted_seqlen) == (16, 16, 16)
    tree = sched.tree_cache
    (first,) = tree.root.children.values()
    assert first.swa_tombstone and len(first.key) == 8
    (second,) = first.children.values()
    assert not second.swa_tombstone and len(second.key) == 8 and second.swa_lock_ref == 1
    assert sched.allocator.swa_available_size() == swa_free_at_start - 8
    while sched.has_work:
        sched.step()
    assert req.output_ids == _oracle(config, req)
    result = sched.idle_tick()
    assert result["balanced"], result
    engine.events.close()
