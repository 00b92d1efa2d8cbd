"""Targeting: which running requests and which of their positions a perturbation acts on.

Positions are named against the SWA attention mask (`engine_stub/model.py` `_attend`): a query at
position q reads the keys with `q - window < key_pos <= q`. At a hook, a running request has KV at
positions `[0, kv_len)` and its next forward is a decode whose query sits at `kv_len`, so it reads
`[kv_len - window + 1, kv_len]` in its SWA layers (the KV canary's SWA TAIL window after that
forward, `[seq_len - window, seq_len)` with `seq_len = kv_len + 1`, is the same range). Window
eviction is rate-limited (once per `window` decode batches), so the frontier lags:

    [0, frontier)                        SWA KV released (out_of_window counts down from frontier)
    [frontier, kv_len - window + 1)      retained but unread: SWA KV held, no forward reads it
                                         again; the next eviction frees it (retained_unread)
    [kv_len - window + 1, kv_len)        in the window: the next forward reads it (in_window)

`in_window` is the oldest position the next forward reads, `max(kv_len - window + 1, frontier, 0)`
(the frontier is above it only where a kind pushed it); `retained_unread` is the oldest retained
position, the frontier itself, when any position is retained-but-unread; a `count` of them never
runs into the window. Pure Python over `ReqState`s: testable without an engine.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from engine_stub.perturb.sites import ReqState

if TYPE_CHECKING:
    from engine_stub.perturb.spec import TargetSpec

__all__ = ["pick_requests", "positions", "read_start", "retained_unread"]


def pick_requests(target: TargetSpec, candidates: list[ReqState], rng: random.Random) -> list[ReqState]:
    """`target.request` among `candidates` (in rid order): an index, `random`, `all`; `cached`
    picks no running request."""
    want = target.request
    if not candidates or want == "cached":
        return []
    if want == "all":
        return candidates
    if want == "random":
        return [rng.choice(candidates)]
    return [candidates[want]] if want < len(candidates) else []


def read_start(req: ReqState, window: int) -> int:
    """The oldest position of `req` its next forward reads (in_window)."""
    return max(req.kv_len - window + 1, req.frontier, 0)


def retained_unread(req: ReqState, window: int) -> range:
    """Positions whose SWA KV `req` still holds but no forward of it reads again."""
    return range(req.frontier, max(req.frontier, req.kv_len - window + 1))


def positions(target: TargetSpec, req: ReqState, window: int) -> list[int]:
    """`target.positions` (and `target.count`) of `req`, limited to positions that have KV."""
    kv_len, count = req.kv_len, target.count
    where = target.positions
    if where == "in_window":
        start = read_start(req, window)
        return list(range(start, min(start + count, kv_len)))
    if where == "retained_unread":
        unread = retained_unread(req, window)
        return list(unread[:count])
    if where == "out_of_window":
        start = req.frontier - count
        return list(range(start, req.frontier)) if start >= 0 else []
    if where == "last":
        return list(range(max(kv_len - count, 0), kv_len))
    lo, hi = where
    return list(range(lo, min(hi, kv_len)))
