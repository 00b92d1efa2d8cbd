"""The tiny hybrid model: the pooled forward against the no-cache oracle, and the SWA masks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine_stub import model as model_module
from engine_stub.config import EngineConfig
from engine_stub.events import EventLog
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.model import (
    VOCAB_SIZE,
    ForwardBatch,
    ModelConfig,
    TinyHybridModel,
    decode_text,
    encode_text,
)
from engine_stub.req import Req
from engine_stub.scheduler import Scheduler

WINDOW = 8
PATTERN = "SFSS"


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


@pytest.mark.parametrize(
    ("page_size", "prompt_len", "max_new_tokens"),
    [
        (1, 13, 20),  # prompt and generation both longer than the window
        (4, 13, 20),  # a partial last page, pages recycled by window eviction
        (4, 3, 12),  # a prompt shorter than the window crossing it while decoding
    ],
)
def test_forward_through_pools_matches_reference_logits(
    tmp_path: Path, page_size: int, prompt_len: int, max_new_tokens: int
) -> None:
    config = EngineConfig(
        device="cpu", page_size=page_size, window=WINDOW, layer_pattern=PATTERN,
        full_pool_tokens=256, swa_pool_tokens=64, max_context_len=128, radix_cache=False,
    )
    events = EventLog(tmp_path / "events.jsonl")
    sched = Scheduler(config, events)
    captured: list[torch.Tensor] = []
    forward = sched.model.forward

    def capture(*args: object) -> torch.Tensor:
        logits = forward(*args)
        captured.append(logits.clone())
        return logits

    sched.model.forward = capture  # type: ignore[method-assign]
    prompt = _prompt(page_size * 100 + prompt_len, prompt_len)
    req = Req("r0", prompt, max_new_tokens)
    sched.add_request(req)
    try:
        while sched.has_work:
            sched.step()
    finally:
        events.close()

    assert len(captured) == max_new_tokens
    assert sched.stats["swa_evicted_tokens"] > 0, "the window never slid: the SWA path was not exercised"
    for i, logits in enumerate(captured):
        expected = sched.model.reference_logits(prompt + req.output_ids[:i])
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-9)
    assert req.output_ids == sched.model.reference_generate(prompt, max_new_tokens)


def _pooled_decode_setup(prompt_len: int) -> tuple[TinyHybridModel, HybridKVPool, torch.Tensor, list[int]]:
    """Prefill `prompt_len` tokens into slots 1.. of fresh pools with an identity SWA mapping."""
    model = TinyHybridModel(ModelConfig(PATTERN, WINDOW, seed=3))
    rows = prompt_len + 4
    pool = HybridKVPool(
        layer_pattern=PATTERN, full_size=rows, swa_size=rows, page_size=1, num_heads=2, head_dim=16,
        full_to_swa_index_mapping=torch.arange(rows + 1),
    )
    table = torch.zeros(1, 64, dtype=torch.int32)
    table[0, : prompt_len + 1] = torch.arange(1, prompt_len + 2, dtype=torch.int32)
    prompt = _prompt(11, prompt_len)
    prefill = ForwardBatch([0], [0], [prompt_len], torch.tensor(prompt), torch.arange(prompt_len),
                           torch.arange(1, prompt_len + 1))
    model.forward(prefill, pool, table)
    return model, pool, table, prompt


def _decode_logits(model: TinyHybridModel, pool: HybridKVPool, table: torch.Tensor, n: int) -> torch.Tensor:
    """Logits of one decode step at position n (its KV goes to slot n + 1; rerunning is idempotent)."""
    batch = ForwardBatch([0], [n], [n + 1], torch.tensor([7]), torch.tensor([n]), torch.tensor([n + 1]))
    return model.forward(batch, pool, table)


@pytest.mark.parametrize(
    ("layer_kind", "offset_from_query", "changes"),
    [
        ("S", WINDOW, False),  # position q - window: just out of the window, masked
        ("S", WINDOW + 5, False),  # far out of the window
        ("S", WINDOW - 1, True),  # the oldest position inside the window
        ("S", 1, True),
        ("F", WINDOW + 5, True),  # a full layer sees every earlier position
    ],
)
def test_perturbed_key_changes_logits_only_inside_window(
    layer_kind: str, offset_from_query: int, changes: bool
) -> None:
    prompt_len = 20
    model, pool, table, _ = _pooled_decode_setup(prompt_len)
    base = _decode_logits(model, pool, table, prompt_len)
    layer = PATTERN.index(layer_kind)
    position = prompt_len - offset_from_query
    slot = position + 1
    pool.k_buffer[layer][slot] += 3.0
    after = _decode_logits(model, pool, table, prompt_len)
    assert torch.equal(base, after) is not changes


def _two_request_prefill(model: TinyHybridModel, pool: HybridKVPool, table: torch.Tensor,
                         lens: tuple[int, int], prefix: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """One extend of two requests (rows 0 and 1), `lens[i]` new tokens after `prefix[i]` cached."""
    ids = torch.tensor(_prompt(5, lens[0]) + _prompt(6, lens[1]))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens, strict=True)])
    slots = torch.cat([table[r, p:p + n].long() for r, (p, n) in enumerate(zip(prefix, lens, strict=True))])
    batch = ForwardBatch([0, 1], list(prefix), [p + n for p, n in zip(prefix, lens, strict=True)], ids, positions,
                         slots)
    return model.forward(batch, pool, table)


@pytest.mark.parametrize(("lens", "prefix"), [((13, 3), (0, 0)), ((5, 9), (11, 2)), ((1, 17), (20, 0))])
def test_batched_extend_of_unequal_requests_matches_reference_logits(
    lens: tuple[int, int], prefix: tuple[int, int]
) -> None:
    model = TinyHybridModel(ModelConfig(PATTERN, WINDOW, seed=3))
    pool = HybridKVPool(layer_pattern=PATTERN, full_size=128, swa_size=128, page_size=1, num_heads=2,
                        head_dim=16, full_to_swa_index_mapping=torch.arange(129))
    table = torch.zeros(2, 64, dtype=torch.int32)
    table[0, :40] = torch.arange(1, 41, dtype=torch.int32)
    table[1, :40] = torch.arange(41, 81, dtype=torch.int32)
    if any(prefix):  # the cached prefixes' KV first, each request alone
        for row, cached in enumerate(prefix):
            if cached:
                ids = torch.tensor((_prompt(5, 40) if row == 0 else _prompt(6, 40))[:cached])
                model.forward(ForwardBatch([row], [0], [cached], ids, torch.arange(cached),
                                           table[row, :cached].long()), pool, table)
    logits = _two_request_prefill(model, pool, table, lens, prefix)
    # The same tokens' reference: each request's cached prefix then its new tokens.
    for row, (n, cached) in enumerate(zip(lens, prefix, strict=True)):
        full = (_prompt(5, 40) if row == 0 else _prompt(6, 40))[:cached] if cached else []
        new = _prompt(5, n) if row == 0 else _prompt(6, n)
        torch.testing.assert_close(logits[row:row + 1], model.reference_logits(full + new), rtol=0, atol=1e-9)


def test_nan_value_outside_the_window_never_reaches_logits_and_inside_does() -> None:
    # The NaN guard: a masked value is zeroed per query (0 * NaN would poison the sum).
    prompt_len = 20
    model, pool, table, _ = _pooled_decode_setup(prompt_len)
    base = _decode_logits(model, pool, table, prompt_len)
    swa_layer = PATTERN.index("S")
    pool.v_buffer[swa_layer][prompt_len - WINDOW - 2 + 1] = float("nan")  # out of the decode's window
    assert torch.equal(_decode_logits(model, pool, table, prompt_len), base)
    pool.v_buffer[swa_layer][prompt_len - 1 + 1] = float("nan")  # the newest earlier position: read
    assert not torch.isfinite(_decode_logits(model, pool, table, prompt_len)).any()


@pytest.mark.parametrize(
    ("values", "finite"),
    [([1.0, -2.0], True), ([1e308, 1e308], True), ([1.0, float("nan")], False), ([float("inf"), 1.0], False),
     ([float("inf"), float("-inf")], False)],
)
def test_all_finite_check_agrees_with_the_element_wise_one(values: list[float], finite: bool) -> None:
    # The forward's fast check reads a sum; a sum that overflows (1e308 + 1e308) must not pass
    # finite values to the per-query path, nor an infinity that cancels hide there.
    tensor = torch.tensor(values, dtype=torch.float64)
    assert model_module._all_finite(tensor) is finite is bool(torch.isfinite(tensor).all())


def test_reference_ignores_tokens_beyond_window_only_in_swa_layers() -> None:
    # With only SWA layers, the receptive field of the last token is bounded by
    # layers x (window - 1) positions: a change further back cannot reach the logits.
    model = TinyHybridModel(ModelConfig("SS", WINDOW, seed=5))
    tokens = _prompt(5, 40)
    reach = 2 * (WINDOW - 1)
    far = list(tokens)
    far[len(tokens) - 1 - reach - 1] ^= 1
    near = list(tokens)
    near[len(tokens) - 1 - reach] ^= 1
    base = model.reference_logits(tokens)
    assert torch.equal(model.reference_logits(far), base)
    assert not torch.equal(model.reference_logits(near), base)


def test_weights_depend_only_on_seed() -> None:
    a = TinyHybridModel(ModelConfig(PATTERN, WINDOW, seed=1))
    b = TinyHybridModel(ModelConfig(PATTERN, WINDOW, seed=1))
    c = TinyHybridModel(ModelConfig(PATTERN, WINDOW, seed=2))
    tokens = _prompt(1, 12)
    assert torch.equal(a.reference_logits(tokens), b.reference_logits(tokens))
    assert not torch.equal(a.reference_logits(tokens), c.reference_logits(tokens))


@pytest.mark.parametrize("text", ["hello", "héllo wörld", "", "\x00\xff"])
def test_encode_then_decode_round_trips(text: str) -> None:
    ids = encode_text(text)
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    assert decode_text(ids) == text


@pytest.mark.parametrize(
    ("hidden_size", "num_heads", "message"),
    [(30, 4, "not divisible"), (6, 2, "even")],
)
def test_model_config_rejects_bad_shapes(hidden_size: int, num_heads: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(PATTERN, WINDOW, hidden_size=hidden_size, num_heads=num_heads)


def test_reference_next_tokens_agrees_with_step_by_step_generation() -> None:
    model = TinyHybridModel(ModelConfig(layer_pattern="SFSS", window=8, seed=3))
    prompt = list(b"teacher forcing equals greedy")
    generated = model.reference_generate(prompt, 16)
    predicted = model.reference_next_tokens(prompt + generated[:-1])[len(prompt) - 1 :]
    assert predicted == generated
    wrong = list(generated)
    wrong[5] = (wrong[5] + 1) % 256
    assert model.reference_next_tokens(prompt + wrong[:-1])[len(prompt) - 1 :][5] != wrong[5]


def test_kv_buffers_are_views_of_one_row_per_slot_and_group() -> None:
    """The canary hashes a slot's K/V of every layer of a group as one row of `group_kv`."""
    pool = HybridKVPool(layer_pattern=PATTERN, full_size=8, swa_size=6, page_size=1, num_heads=2, head_dim=4,
                        full_to_swa_index_mapping=torch.arange(10))
    for swa in (False, True):
        layers = pool.group_layers(swa)
        buf = pool.group_kv(swa)
        assert buf.shape == (pool.swa_rows if swa else pool.full_rows, len(layers), 2, 2, 4)
        for index, layer in enumerate(layers):
            k, v = (torch.full((1, 2, 4), value, dtype=torch.float64) for value in (float(layer), -1.0))
            pool.set_kv(layer, torch.tensor([3]), k, v)
            assert torch.equal(buf[3, index, 0], torch.full((2, 4), float(layer)))
            assert torch.equal(buf[3, index, 1], torch.full((2, 4), -1.0))
            pool.k_buffer[layer][3].view(-1).view(torch.uint8)[0] ^= 1  # what flip_kv_byte does
            assert buf[3, index, 0].flatten()[0] != float(layer)
