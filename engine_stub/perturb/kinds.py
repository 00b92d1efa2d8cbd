"""Perturbation kinds: registered functions that damage engine state at one hook site.

A kind changes state only. It never raises, logs a firing or calls an invariant: whatever
detects the damage must do so by reading the damaged state. It returns None when it found
nothing to act on (no landing), or a `Landing`: the digest of exactly what it touched (before and
after), plus the overrides its hook site honours (e.g. the slots a window eviction frees).

Add a kind with `@register_kind("name", Site.X)` on a function `(ctx: KindContext) -> Landing | None`
whose docstring's first line says what it does and its second what should catch it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_stub.perturb.sites import Site
from engine_stub.perturb.spec import PerturbationSpec

if TYPE_CHECKING:
    from engine_stub.req import Req
    from engine_stub.scheduler import Scheduler

__all__ = ["KINDS", "KindContext", "KindInfo", "Landing", "register_kind"]


@dataclass(frozen=True)
class KindContext:
    sched: Scheduler
    spec: PerturbationSpec
    rng: random.Random
    site_ctx: dict[str, Any]


@dataclass
class Landing:
    """What a kind touched (JSON-able digest) and the overrides for its hook site."""

    digest: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KindInfo:
    name: str
    site: Site
    fn: Callable[[KindContext], Landing | None]
    doc: str


KINDS: dict[str, KindInfo] = {}


def register_kind(name: str, site: Site) -> Callable:
    def wrap(fn: Callable[[KindContext], Landing | None]) -> Callable:
        if name in KINDS:
            raise KeyError(f"perturbation kind {name!r} is already registered")
        KINDS[name] = KindInfo(name, site, fn, (fn.__doc__ or "").strip())
        return fn

    return wrap


# ---- targeting helpers ---------------------------------------------------------------------------


def _running(ctx: KindContext) -> list[Req]:
    return sorted((r for r in ctx.sched.running if r.kv_len > 0), key=lambda r: r.rid)


def _pick_requests(ctx: KindContext, candidates: list[Req]) -> list[Req]:
    want = ctx.spec.target.request
    if not candidates or want == "cached":
        return []
    if want == "all":
        return candidates
    if want == "random":
        return [ctx.rng.choice(candidates)]
    return [candidates[want]] if want < len(candidates) else []


def _site_target(ctx: KindContext) -> Req | None:
    """The hook's own request (site_ctx["req"]) if the target selects it among the running ones
    (at request finish it has already left `running`; it is counted in its rid place)."""
    req = ctx.site_ctx["req"]
    candidates = sorted({*_running(ctx), req}, key=lambda r: r.rid)
    return req if req in _pick_requests(ctx, candidates) else None


def _window_start(sched: Scheduler, req: Req) -> int:
    """The oldest position of `req` inside its attention window, whose SWA KV is live.

    Window eviction is rate-limited (SGLang's cadence), so the frontier lags: positions in
    `[swa_evicted_seqlen, kv_len - window)` are already out of the window yet keep their SWA KV
    until the next eviction. The frontier only passes `kv_len - window` when a kind pushed it.
    """
    return max(req.kv_len - sched.window, req.swa_evicted_seqlen)


def _positions(ctx: KindContext, req: Req) -> list[int]:
    """Target positions of `req` whose KV exists (see TargetSpec)."""
    target, sched = ctx.spec.target, ctx.sched
    kv_len, frontier = req.kv_len, req.swa_evicted_seqlen
    if target.positions == "in_window":
        start = _window_start(sched, req)
    elif target.positions == "out_of_window":
        start = frontier - target.count
        if start < 0:
            return []
    elif target.positions == "last":
        start = kv_len - target.count
    else:
        start, end = target.positions
        return list(range(start, min(end, kv_len)))
    return [p for p in range(max(start, 0), start + target.count) if p < kv_len]


def _slots(sched: Scheduler, req: Req, positions: list[int]) -> torch.Tensor:
    table = sched.req_to_token_pool.req_to_token
    return table[req.row, positions].to(torch.int64)


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def _first_in_window_slot(ctx: KindContext, req: Req) -> tuple[int, int] | None:
    pos = _window_start(ctx.sched, req)
    if pos >= req.kv_len:
        return None
    return pos, int(ctx.sched.req_to_token_pool.req_to_token[req.row, pos])


# ---- kinds at the start of a step --------------------------------------------------------------


@register_kind("corrupt_req_to_token", Site.BEFORE_STEP)
def corrupt_req_to_token(ctx: KindContext) -> Landing | None:
    """Point a req_to_token entry at another live slot, a freed slot, 0 or -1 (target.value).
    other_live_slot/zero on page_size 1: swa.peer_mapped when both owners free the slot (invariants off: kv_canary.verify_chain_hash); freed_slot: kv_canary.verify_chain_hash, else idle.swa_ledger/idle.radix_sanity; zero on larger pages: alloc.reserved_slot; minus_one: alloc.out_of_pool at its free."""
    sched, value = ctx.sched, ctx.spec.target.value
    running = _running(ctx)
    for req in _pick_requests(ctx, running):
        positions = _positions(ctx, req)
        if not positions:
            continue
        pos = positions[0]
        old = int(sched.req_to_token_pool.req_to_token[req.row, pos])
        if value == "zero":
            new = 0
        elif value == "minus_one":
            new = -1
        elif value == "freed_slot":
            sched.allocator.full_attn_allocator.merge_and_sort_free()
            free = sched.allocator.full_attn_allocator.free_pages
            if free.numel() == 0:
                continue
            new = int(free[0]) * sched.page_size
        else:
            others = [r for r in running if r is not req]
            picked = next((s for r in others if (s := _first_in_window_slot(ctx, r))), None)
            if picked is None:
                continue
            new = picked[1]
        if new == old:
            continue
        sched.req_to_token_pool.req_to_token[req.row, pos] = new
        return Landing({"rid": req.rid, "row": req.row, "position": pos, "before": old, "after": new,
                        "value": value})
    return None


@register_kind("strip_swa_mapping", Site.BEFORE_STEP)
def strip_swa_mapping(ctx: KindContext) -> Landing | None:
    """Zero the full-to-SWA mapping of live slots, as if their SWA peers were released without a free.
    page_size 1: swa.peer_mapped when free_swa meets them; larger pages: the SWA idle ledger (the peers leak)."""
    sched = ctx.sched
    mapping = sched.allocator.full_to_swa_index_mapping
    for req in _pick_requests(ctx, _running(ctx)):
        positions = _positions(ctx, req)
        if not positions:
            continue
        slots = _slots(sched, req, positions)
        before = _ints(mapping[slots])
        if not all(v > 0 for v in before):
            continue
        mapping.index_fill_(0, slots, 0)
        return Landing({"rid": req.rid, "positions": positions, "slots": _ints(slots),
                        "before": before, "after": [0] * len(positions)})
    return None


@register_kind("alias_swa_mapping", Site.BEFORE_STEP)
def alias_swa_mapping(ctx: KindContext) -> Landing | None:
    """Make a live slot's mapping name another live slot's SWA peer (two tokens share one SWA slot).
    Caught by the KV canary on the SWA group (verify_position/verify_chain_hash)."""
    sched = ctx.sched
    mapping = sched.allocator.full_to_swa_index_mapping
    running = _running(ctx)
    for req in _pick_requests(ctx, running):
        positions = _positions(ctx, req)
        others = [s for r in running if r is not req and (s := _first_in_window_slot(ctx, r))]
        if not positions or not others:
            continue
        slot = int(_slots(sched, req, positions[:1])[0])
        before, after = int(mapping[slot]), int(mapping[others[0][1]])
        if before == after or after <= 0:
            continue
        mapping[slot] = after
        return Landing({"rid": req.rid, "position": positions[0], "slot": slot, "before": before,
                        "after": after})
    return None


@register_kind("flip_kv_byte", Site.BEFORE_STEP)
def flip_kv_byte(ctx: KindContext) -> Landing | None:
    """XOR 0xFF into one byte of a slot's real K bytes (target.group full|swa; a running request's slot, or request: cached for a slot only the radix cache holds).
    In use: KV canary TAIL verify_real_kv_hash; cached: the SWEEP's verify_real_kv_hash."""
    sched, target = ctx.sched, ctx.spec.target
    group_swa = target.group == "swa"
    layers = sched.kv_pool.group_layers(group_swa)
    if not layers:
        return None
    mapping = sched.allocator.full_to_swa_index_mapping
    if target.request == "cached":
        if sched.tree_cache is None:
            return None
        in_use = {s for r in sched.running for s in _ints(sched.req_to_token_pool.req_to_token[r.row, : r.kv_len])}
        candidates = [s for s in _ints(sched.tree_cache.held_slots()) if s not in in_use]
        if group_swa:
            candidates = [s for s in candidates if int(mapping[s]) > 0]
        if not candidates:
            return None
        slot, rid, pos = sorted(candidates)[0], None, None
    else:
        picked = None
        for req in _pick_requests(ctx, _running(ctx)):
            positions = _positions(ctx, req)
            if positions:
                picked = (req, positions[0])
                break
        if picked is None:
            return None
        req, pos = picked
        slot, rid = int(sched.req_to_token_pool.req_to_token[req.row, pos]), req.rid
    row = int(mapping[slot]) if group_swa else slot
    if row <= 0:
        return None
    byte = int(ctx.spec.params.get("byte", 0))
    raw = sched.kv_pool.k_buffer[layers[0]][row].view(-1).view(torch.uint8)
    if byte >= raw.numel():  # params.byte beyond the row: nothing to flip (a kind never raises)
        return None
    before = int(raw[byte])
    raw[byte] = before ^ 0xFF
    return Landing({"rid": rid, "position": pos, "slot": slot, "pool_row": row, "group": target.group,
                    "layer": layers[0], "byte": byte, "before": before, "after": before ^ 0xFF})


@register_kind("revert_pr_36723", Site.BEFORE_STEP)
def revert_pr_36723(ctx: KindContext) -> Landing | None:
    """Restore the allocator's pre-PR-36723 behaviour: free_swa silently filters unmapped peers, free_full checks nothing.
    Nothing should catch a damage this hides: its scenarios expect the suite to report MISSED."""
    allocator = ctx.sched.allocator
    if allocator.revert_pr_36723:
        return None
    allocator.revert_pr_36723 = True
    return Landing({"before": False, "after": True, "switch": "revert_pr_36723"})


# ---- kinds on window eviction ----------------------------------------------------------------------


def _eviction_landing(ctx: KindContext, req: Req, **after: Any) -> Landing:
    """The window eviction as planned (`before`) and as the kind changed it (`after`).

    `after` may set `slots` (what free_swa gets), `new_frontier`, and `then_free_swa` (slots a
    second free_swa call gets); unset ones keep the planned value.
    """
    planned = {"slots": ctx.site_ctx["slots"], "new_frontier": ctx.site_ctx["new_frontier"]}
    changed = {**planned, **after}
    digest = {
        "rid": req.rid,
        "frontier": ctx.site_ctx["frontier"],
        "before": {"new_frontier": planned["new_frontier"], "freed": _ints(planned["slots"])},
        "after": {"new_frontier": changed["new_frontier"], "freed": _ints(changed["slots"])},
    }
    if "then_free_swa" in after:
        digest["after"]["freed_again"] = _ints(after["then_free_swa"])
    return Landing(digest, after)


@register_kind("skip_free_swa", Site.ON_WINDOW_EVICTION)
def skip_free_swa(ctx: KindContext) -> Landing | None:
    """Advance the window frontier without releasing the SWA peers (the free_swa is skipped).
    Without a radix cache, free_full at finish meets live peers: swa.peer_released; with one, the SWA ledger leaks."""
    req = _site_target(ctx)
    if req is None:
        return None
    return _eviction_landing(ctx, req, slots=ctx.site_ctx["slots"][:0])


@register_kind("never_evict_swa", Site.ON_WINDOW_EVICTION)
def never_evict_swa(ctx: KindContext) -> Landing | None:
    """Keep every out-of-window SWA slot (the frontier never moves); use a large trigger.times.
    The SWA pool runs dry mid-decode: sched.decode_stall."""
    req = _site_target(ctx)
    if req is None:
        return None
    return _eviction_landing(ctx, req, slots=ctx.site_ctx["slots"][:0],
                             new_frontier=ctx.site_ctx["frontier"])


@register_kind("evict_inside_window", Site.ON_WINDOW_EVICTION)
def evict_inside_window(ctx: KindContext) -> Landing | None:
    """Push the window frontier too far (params.extra_tokens, default half a window), releasing SWA slots still in the window.
    The KV canary's SWA group sees in-window positions without a peer (verify_position/verify_chain_hash)."""
    req = _site_target(ctx)
    if req is None:
        return None
    sched = ctx.sched
    page = sched.page_size
    extra = int(ctx.spec.params.get("extra_tokens", max(sched.window // 2, 1)))
    frontier, new_frontier = ctx.site_ctx["frontier"], ctx.site_ctx["new_frontier"]
    pushed = min(new_frontier + -(-extra // page) * page, req.kv_len - req.kv_len % page)
    if pushed <= new_frontier:
        return None
    slots = sched.req_to_token_pool.req_to_token[req.row, frontier:pushed].to(torch.int64)
    return _eviction_landing(ctx, req, slots=slots, new_frontier=pushed)


@register_kind("double_free_swa", Site.ON_WINDOW_EVICTION)
def double_free_swa(ctx: KindContext) -> Landing | None:
    """Call free_swa a second time on the slots a window eviction just released.
    page_size 1: swa.peer_mapped (the mapping already reads 0)."""
    req = _site_target(ctx)
    if req is None:
        return None
    return _eviction_landing(ctx, req, then_free_swa=ctx.site_ctx["slots"].clone())


# ---- kinds at request finish and sampling ------------------------------------------------------------


@register_kind("leak_request", Site.ON_REQUEST_FINISH)
def leak_request(ctx: KindContext) -> Landing | None:
    """Never free a finished request: its row and its slots stay taken.
    The idle ledgers (idle.full_ledger, idle.swa_ledger, idle.req_rows_ledger)."""
    req = _site_target(ctx)
    if req is None:
        return None
    return Landing({"rid": req.rid, "row": req.row, "kv_len": req.kv_len}, {"leak": True})


@register_kind("double_free_full", Site.ON_REQUEST_FINISH)
def double_free_full(ctx: KindContext) -> Landing | None:
    """After a finished request is released, free_full its target positions' slots once more.
    The full sub-allocator drops the second free: alloc.double_free (use radix_cache: false, else the tree still holds them); freeing every slot also breaks alloc.pool_bound."""
    req = _site_target(ctx)
    if req is None:
        return None
    positions = _positions(ctx, req) or [0]
    slots = _slots(ctx.sched, req, positions)
    return Landing({"rid": req.rid, "positions": positions, "slots": _ints(slots)}, {"then_free_full": slots})


@register_kind("swap_next_token", Site.ON_SAMPLING)
def swap_next_token(ctx: KindContext) -> Landing | None:
    """Swap two requests' sampled tokens after the sampler (the token oracle already noted them).
    The KV canary's token oracle: write_token; no verify_* reason should fire."""
    reqs, next_ids = ctx.site_ctx["reqs"], list(ctx.site_ctx["next_ids"])
    pairs = [(i, j) for i in range(len(reqs)) for j in range(i + 1, len(reqs)) if next_ids[i] != next_ids[j]]
    if not pairs:
        return None
    i, j = pairs[0]
    before = list(next_ids)
    next_ids[i], next_ids[j] = next_ids[j], next_ids[i]
    return Landing({"rids": [reqs[i].rid, reqs[j].rid], "before": [before[i], before[j]],
                    "after": [next_ids[i], next_ids[j]]}, {"next_ids": next_ids})
