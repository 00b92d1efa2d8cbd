"""A tiny hybrid transformer whose attention reads its KV through the pools.

Byte-level vocabulary (256 ids, no tokenizer), rotary positions, a configurable pattern of
full-attention (F) and sliding-window (S) layers, weights drawn from a seed. Full layers gather
their keys through `req_to_token`; SWA layers through `req_to_token` and then the full-to-SWA
mapping, and see only the last `window` positions. A corrupted row or mapping therefore changes
the bytes that are read, and the output.

`reference_generate` recomputes every token from scratch with the right causal and window masks:
the output oracle. It runs in float64, so an undamaged engine run matches it exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine_stub.mem.kv_pool import HybridKVPool

__all__ = ["GREEDY_TEMPERATURE_EPS", "VOCAB_SIZE", "ForwardBatch", "ModelConfig", "TinyHybridModel",
           "decode_text", "encode_text"]

VOCAB_SIZE = 256
# Temperatures below this are greedy (as in SGLang): dividing logits by them would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_text(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ModelConfig:
    layer_pattern: str
    window: int
    hidden_size: int = 32
    num_heads: int = 2
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} not divisible by num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ForwardBatch:
    """One step's tokens. Requests' new tokens are contiguous in the flat tensors.

    Attributes:
        req_pool_indices: request rows in `req_to_token`, one per request.
        prefix_lens: tokens whose KV is already in the pools, per request.
        seq_lens: tokens with KV after this step, per request.
        input_ids, positions, out_cache_loc: int64 `[num_new_tokens]`; `out_cache_loc` holds the
            FULL slots the new tokens' KV goes to.
    """

    req_pool_indices: list[int]
    prefix_lens: list[int]
    seq_lens: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor

    @property
    def extend_lens(self) -> list[int]:
        return [seq - prefix for prefix, seq in zip(self.prefix_lens, self.seq_lens, strict=True)]


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, x.shape[-1:], eps=1e-6)


def _rotary_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, 1, head_dim // 2]` of the rotate-half rotary embedding (base 10000) at
    `positions`: the same for every layer and for queries and keys, so computed once a step."""
    angles = positions.to(dtype)[:, None] * _inverse_frequencies(head_dim, dtype, positions.device)[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


@functools.cache
def _inverse_frequencies(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / (10000 ** (torch.arange(half, dtype=dtype, device=device) / half))


def _rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [T, heads, head_dim], tables from `_rotary_tables` at x's positions.
    cos, sin = tables
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attention_mask(q_pos: torch.Tensor, key_valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[T, L]`: which keys query t sees (key l sits at position l): those that exist, up to its
    own position, and within the window in SWA layers (keys at positions <= q_pos - window masked)."""
    key_pos = torch.arange(key_valid.shape[1], device=q_pos.device)
    mask = key_valid & (key_pos[None, :] <= q_pos[:, None])
    if window is not None:
        mask &= key_pos[None, :] > (q_pos[:, None] - window)
    return mask


def _attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    window: int | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention of each query over its own key row.

    Args:
        q: `[T, heads, head_dim]`; q_pos: `[T]` positions of the queries.
        keys, values: `[T, L, heads, head_dim]`, key l of query t sits at position l.
        key_valid: `[T, L]` which keys exist at all.
        window: None for full attention, else keys at positions <= q_pos - window are masked.
        mask: `_attention_mask(q_pos, key_valid, window)` where the caller has it already.
    """
    if mask is None:
        mask = _attention_mask(q_pos, key_valid, window)
    # Batched matmuls over (query, head) rather than einsum: the same sums, a fraction of the
    # dispatch cost at these sizes (the engine runs a few hundred such steps a scenario).
    scores = torch.matmul(q.unsqueeze(2), keys.permute(0, 2, 3, 1)).squeeze(2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Zero masked values too: a NaN in a masked (e.g. evicted) row must not leak through 0 * NaN.
    values = torch.where(mask[:, :, None, None], values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.matmul(probs.unsqueeze(2), values.transpose(1, 2)).squeeze(2)


def _attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masked_out: torch.Tensor) -> torch.Tensor:
    """`_attend` with one key row per request instead of one per query: `q` `[B, Tq, heads,
    head_dim]` (a request's queries, padded), `keys`, `values` `[B, L, heads, head_dim]`,
    `masked_out` `[B, 1, Tq, L]` the keys each query must not see (`~mask[:, None]`). The values
    must be finite: a masked value is not zeroed per query, so a NaN in it
    would leak through 0 * NaN (the caller takes `_attend` then)."""
    scores = torch.matmul(q.transpose(1, 2), keys.permute(0, 2, 3, 1)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(masked_out, float("-inf")), dim=-1)
    return torch.matmul(probs, values.transpose(1, 2)).transpose(1, 2)


def _all_finite(values: torch.Tensor) -> bool:
    # A finite sum proves every element finite (a NaN or an infinity makes the sum one), at a
    # fraction of `isfinite().all()`'s cost; only a non-finite sum needs the element-wise look.
    return bool(values.sum().isfinite()) or bool(torch.isfinite(values).all())


class TinyHybridModel:
    """Deterministic tiny decoder. `forward` writes KV through the pool and returns last logits."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        hidden, dtype = config.hidden_size, config.dtype

        def weight(rows: int, cols: int, scale: float) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale
            return w.to(dtype=dtype, device=self.device)

        self.embed = weight(VOCAB_SIZE, hidden, 1.0)
        self.layers = []
        for _ in config.layer_pattern:
            self.layers.append(
                {
                    "wq": weight(hidden, hidden, hidden**-0.5),
                    "wk": weight(hidden, hidden, hidden**-0.5),
                    "wv": weight(hidden, hidden, hidden**-0.5),
                    "wo": weight(hidden, hidden, hidden**-0.5),
                    "w_up": weight(hidden, 2 * hidden, hidden**-0.5),
                    "w_down": weight(2 * hidden, hidden, (2 * hidden) ** -0.5),
                }
            )
        # A wide head keeps top-1 margins large, so greedy decoding is robust to rounding.
        self.lm_head = weight(hidden, VOCAB_SIZE, 4.0 * hidden**-0.5)
        # One projection a layer for Q, K and V (their weights side by side): the same products,
        # one matmul instead of three.
        for w in self.layers:
            w["wqkv"] = torch.cat([w["wq"], w["wk"], w["wv"]], dim=1)

    def _window_of(self, layer: int) -> int | None:
        return self.config.window if self.config.layer_pattern[layer] == "S" else None

    def _qkv(self, layer: int, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        w = self.layers[layer]
        heads, head_dim = self.config.num_heads, self.config.head_dim
        qkv = (_rms_norm(x) @ w["wqkv"]).view(-1, 3 * heads, head_dim)
        # Q's and K's heads rotate together: the same tables at the same positions.
        qk = _rotate(qkv[:, : 2 * heads], rotary)
        return qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads:]

    def _finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        w = self.layers[layer]
        x = x + attn.reshape(x.shape) @ w["wo"]
        return x + torch.relu(_rms_norm(x) @ w["w_up"]) @ w["w_down"]

    def forward(
        self, batch: ForwardBatch, kv_pool: HybridKVPool, req_to_token: torch.Tensor
    ) -> torch.Tensor:
        """Run one step: write the new tokens' KV at `out_cache_loc`, attend through the pools.

        Returns:
            logits `[num_reqs, VOCAB_SIZE]` of each request's last new token.
        """
        device = self.device
        extend_lens = batch.extend_lens
        extend_lens_t = torch.tensor(extend_lens, device=device)
        num_reqs, num_tokens, max_extend = len(extend_lens), sum(extend_lens), max(extend_lens)
        req_of_token = torch.repeat_interleave(
            torch.arange(num_reqs, device=device), extend_lens_t, output_size=num_tokens
        )
        # Where each new token sits among its request's new tokens (queries padded per request).
        first_token = extend_lens_t.cumsum(0) - extend_lens_t
        offset_of_token = torch.arange(num_tokens, device=device) - first_token[req_of_token]
        max_len = max(batch.seq_lens)
        req_rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        key_slots = req_to_token[req_rows, :max_len].to(torch.int64)  # [B, L] full slots
        key_valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
        padded_positions = torch.full((num_reqs, max_extend), -1, dtype=batch.positions.dtype, device=device)
        padded_positions[req_of_token, offset_of_token] = batch.positions  # -1: padding, sees no key
        x = self.embed[batch.input_ids]
        # The same in every layer: computed once a step (full layers share one mask, SWA layers
        # another; each group's slots translate once, as the mapping cannot move inside a forward).
        rotary = _rotary_tables(batch.positions, self.config.head_dim, x.dtype)
        masked_out: dict[int | None, torch.Tensor] = {}
        group_rows: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # (write rows, read rows)
        heads, head_dim = self.config.num_heads, self.config.head_dim
        for layer in range(len(self.layers)):
            q, k, v = self._qkv(layer, x, rotary)
            swa = kv_pool.is_swa_layer[layer]
            if swa not in group_rows:
                group_rows[swa] = (kv_pool.rows_of(layer, batch.out_cache_loc),
                                   kv_pool.rows_of(layer, key_slots.reshape(-1)))
            write_rows, read_rows = group_rows[swa]
            kv_pool.set_kv_rows(layer, write_rows, k, v)
            keys, values = kv_pool.get_kv_rows(layer, read_rows)
            keys = keys.view(num_reqs, max_len, heads, head_dim)
            values = values.view(num_reqs, max_len, heads, head_dim)
            window = self._window_of(layer)
            if window not in masked_out:
                masked_out[window] = ~_attention_mask(padded_positions.reshape(-1), key_valid.repeat_interleave(
                    max_extend, dim=0), window).view(num_reqs, 1, max_extend, max_len)
            if not _all_finite(values):
                # Damaged bytes: a key row per query, so each query's masked values are zeroed.
                attn = _attend(q, batch.positions, keys[req_of_token], values[req_of_token],
                               key_valid[req_of_token], window)
            elif num_tokens == num_reqs * max_extend:  # as many new tokens each (a decode): no padding
                attn = _attend_rows(q.view(num_reqs, max_extend, heads, head_dim), keys, values,
                                    masked_out[window]).reshape(num_tokens, heads, head_dim)
            else:
                padded_q = q.new_zeros((num_reqs, max_extend, heads, head_dim))
                padded_q[req_of_token, offset_of_token] = q
                attn = _attend_rows(padded_q, keys, values, masked_out[window])[req_of_token, offset_of_token]
            x = self._finish_layer(layer, x, attn)
        last = extend_lens_t.cumsum(0) - 1
        return _rms_norm(x[last]) @ self.lm_head

    def _reference_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Final hidden states of every position, recomputed from scratch (no cache).

        Every query attends over the one sequence's keys (causal, and the window in SWA layers):
        the same scores and weights as `_attend`, which gathers a key row per query (what the
        pools hand the engine) and costs O(n^2 * hidden) memory where this costs O(n^2 * heads)."""
        device = self.device
        n = len(token_ids)
        positions = torch.arange(n, device=device)
        x = self.embed[torch.tensor(token_ids, device=device)]
        causal = positions[None, :] <= positions[:, None]  # [query, key]
        rotary = _rotary_tables(positions, self.config.head_dim, x.dtype)
        for layer in range(len(self.layers)):
            q, k, v = self._qkv(layer, x, rotary)
            mask = causal
            window = self._window_of(layer)
            if window is not None:
                mask = causal & (positions[None, :] > positions[:, None] - window)
            scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) / math.sqrt(q.shape[-1])  # [h, t, l]
            probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
            x = self._finish_layer(layer, x, torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1))
        return _rms_norm(x)

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits after `token_ids`, recomputed from scratch (no cache): the oracle."""
        return self._reference_hidden(token_ids)[-1:] @ self.lm_head

    def reference_next_tokens(self, token_ids: list[int]) -> list[int]:
        """The greedy next token after every prefix of `token_ids` (teacher forcing, one pass).

        A greedy output equals `reference_generate` iff each of its tokens is the entry here
        for the position before it.
        """
        return [int(t) for t in (self._reference_hidden(token_ids) @ self.lm_head).argmax(-1).tolist()]

    def reference_generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of `prompt_ids` by recomputing every step: the output oracle."""
        tokens = list(prompt_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(self.reference_logits(tokens).argmax(-1)[0])
            out.append(next_id)
            tokens.append(next_id)
        return out


def sample(
    logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Greedy where the temperature is below `GREEDY_TEMPERATURE_EPS`, else seeded multinomial.

    Returns int64 `[num_reqs]` on the device. Sampling runs in float64 on the host, on logits
    shifted by their max, so the largest scaled logit is 0 and every temperature >= the epsilon
    gives finite probabilities from finite logits. A row whose logits are not finite (damaged
    state) gets its greedy token: a request always gets an answer.
    """
    greedy = logits.argmax(-1)
    if all(t < GREEDY_TEMPERATURE_EPS for t in temperatures):
        return greedy
    out = greedy.clone()
    for i, (temp, gen) in enumerate(zip(temperatures, generators, strict=True)):
        if temp >= GREEDY_TEMPERATURE_EPS:
            row = logits[i].to(torch.float64).cpu()
            probs = torch.softmax((row - row.max()) / temp, dim=-1)
            if torch.isfinite(probs).all():  # a host tensor: no device sync
                out[i] = torch.multinomial(probs, 1, generator=gen).to(out.device)[0]
    return out
