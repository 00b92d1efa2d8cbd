"""Perturbation kinds: registered functions that damage engine state at one hook site.

Each kind declares, where it registers, its hook site, its params (typed fields: name, type,
default, bounds; the scenario loader checks a scenario's `params:` against them) and `caught_by`
(the detectors expected to catch it, names from the detector catalogue). A kind works through
the contract of perturb/contract.py: it reads and damages state only through `ctx.view`,
changes what its site does next only through its landing's effect, and never raises, logs a
firing or calls an invariant; whatever detects the damage must do so by reading the damaged
state. It returns None when it found nothing to act on (no landing), else a `Landing`.

Add a kind with `@register_kind("name", Site.X, caught_by=(...), params=(...))` on a function
`(ctx: KindContext[SiteCtx]) -> Landing | None` whose docstring's first line says what it does.
This module never imports torch: `canary list kinds` and scenario validation read the
declarations without it (tensors come from the view and the hook, and are used by method only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_stub.detectors import detector as catalogued
from engine_stub.fields import Field, Int, Table
from engine_stub.perturb.contract import Damage, KindContext, Landing
from engine_stub.perturb.sites import (
    BeforeStep,
    ChunkBoundary,
    ChunkEffect,
    EvictionEffect,
    FinishEffect,
    ReqState,
    RequestFinish,
    Sampling,
    SamplingEffect,
    Site,
    WindowEviction,
)
from engine_stub.perturb.targets import pick_requests, positions, read_start

if TYPE_CHECKING:
    import torch

    from engine_stub.perturb.contract import EngineView

__all__ = ["KINDS", "KindInfo", "register_kind"]


@dataclass(frozen=True)
class KindInfo:
    """A registered kind: what `canary list kinds`, the scenario loader and the perturber read."""

    name: str
    site: Site
    fn: Callable[[KindContext], Landing | None]
    doc: str
    params: Table
    caught_by: tuple[str, ...]

    @property
    def summary(self) -> str:
        """The docstring's first line."""
        return self.doc.splitlines()[0] if self.doc else ""

    def resolved_params(self, given: dict[str, Any]) -> dict[str, Any]:
        """The declared defaults, overridden by `given` (already validated)."""
        return {**self.params.defaults(), **given}


KINDS: dict[str, KindInfo] = {}


def register_kind(name: str, site: Site, *, caught_by: tuple[str, ...],
                  params: tuple[Field, ...] = ()) -> Callable:
    """Register the decorated function as kind `name` at `site`.

    Raises:
        KeyError: `name` is already registered, or a `caught_by` name is not a catalogued
            detector.
        TypeError: `site` is no Site.
    """

    def wrap(fn: Callable[[KindContext], Landing | None]) -> Callable:
        if name in KINDS:
            raise KeyError(f"perturbation kind {name!r} is already registered")
        if not isinstance(site, Site):
            raise TypeError(f"kind {name}: site must be a Site, got {site!r}")
        for name_ in caught_by:
            catalogued(name_)  # KeyError naming the catalogue
        KINDS[name] = KindInfo(name, site, fn, (fn.__doc__ or "").strip(), Table(tuple(params)),
                               tuple(caught_by))
        return fn

    return wrap


# ---- helpers -------------------------------------------------------------------------------------


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def _site_target(ctx: KindContext) -> ReqState | None:
    """The hook's own request if the target selects it among the running ones (at request
    finish it has already left `running`; it is counted in its rid place)."""
    req = ctx.hook.req
    candidates = sorted([*(r for r in ctx.view.running() if r.rid != req.rid), req],
                        key=lambda r: r.rid)
    picked = pick_requests(ctx.target, candidates, ctx.rng)
    return req if any(r.rid == req.rid for r in picked) else None


def _first_read_slot(view: EngineView, req: ReqState) -> int | None:
    """The slot of the oldest position `req`'s next forward reads (in_window), if any."""
    pos = read_start(req, view.window)
    if pos >= req.kv_len:
        return None
    return int(view.slots(req, [pos])[0])


# ---- kinds at the start of a step ----------------------------------------------------------------


@register_kind("corrupt_req_to_token", Site.BEFORE_STEP, caught_by=(
    "swa.peer_mapped", "kv_canary.verify_chain_hash", "kv_canary.verify_position", "idle.swa_ledger",
    "idle.radix_sanity", "alloc.reserved_slot", "alloc.out_of_pool", "sched.prefix_row"))
def corrupt_req_to_token(ctx: KindContext[BeforeStep]) -> Landing | None:
    """Point a req_to_token entry at another live slot, a freed slot, 0 or -1 (target.value).
    other_live_slot/zero on page_size 1: swa.peer_mapped when both owners free the slot (invariants off: kv_canary.verify_chain_hash); freed_slot: kv_canary.verify_chain_hash, else idle.swa_ledger/idle.radix_sanity; zero on larger pages: alloc.reserved_slot; minus_one: alloc.out_of_pool at its free; an entry of a prefix the radix cache holds (never freed from the row): sched.prefix_row at the next chunk boundary or the finish."""
    view, value = ctx.view, ctx.target.value
    running = view.running()
    for req in pick_requests(ctx.target, running, ctx.rng):
        where = positions(ctx.target, req, view.window)
        if not where:
            continue
        pos = where[0]
        old = int(view.slots(req, [pos])[0])
        if value == "zero":
            new = 0
        elif value == "minus_one":
            new = -1
        elif value == "freed_slot":
            free = view.free_full_slot()
            if free is None:
                continue
            new = free
        else:
            picked = next((s for r in running if r.rid != req.rid
                           if (s := _first_read_slot(view, r)) is not None), None)
            if picked is None:
                continue
            new = picked
        if new == old:
            continue
        view.set_slot(req, pos, new)
        return Landing(
            {"rid": req.rid, "row": req.row, "position": pos, "before": old, "after": new,
             "value": value},
            (Damage("req_to_token", request=req.rid, row=req.row, position=pos, before=old,
                    after=new, detail=value),))
    return None


@register_kind("strip_swa_mapping", Site.BEFORE_STEP,
               caught_by=("swa.peer_mapped", "idle.swa_ledger", "idle.radix_sanity"))
def strip_swa_mapping(ctx: KindContext[BeforeStep]) -> Landing | None:
    """Zero the full-to-SWA mapping of live slots, as if their SWA peers were released without a free.
    page_size 1: swa.peer_mapped when free_swa meets them; larger pages: the SWA idle ledger (the peers leak);
    a stripped slot the radix cache then holds in a live node: idle.radix_sanity."""
    view = ctx.view
    for req in pick_requests(ctx.target, view.running(), ctx.rng):
        where = positions(ctx.target, req, view.window)
        if not where:
            continue
        slots = _ints(view.slots(req, where))
        before = view.swa_rows(slots)
        if not all(v > 0 for v in before):
            continue
        view.set_swa_rows(slots, [0] * len(slots))
        return Landing(
            {"rid": req.rid, "positions": where, "slots": slots, "before": before,
             "after": [0] * len(where)},
            tuple(Damage("mapping", slot=slot, position=pos, request=req.rid, before=row, after=0)
                  for pos, slot, row in zip(where, slots, before, strict=True)))
    return None


@register_kind("alias_swa_mapping", Site.BEFORE_STEP, caught_by=("kv_canary.verify_position",))
def alias_swa_mapping(ctx: KindContext[BeforeStep]) -> Landing | None:
    """Make a live slot's mapping name another live slot's SWA peer (two tokens share one SWA slot).
    Caught by the KV canary on the SWA group (verify_position; verify_chain_hash may fire too)."""
    view = ctx.view
    running = view.running()
    for req in pick_requests(ctx.target, running, ctx.rng):
        where = positions(ctx.target, req, view.window)
        others = [s for r in running if r.rid != req.rid
                  if (s := _first_read_slot(view, r)) is not None]
        if not where or not others:
            continue
        slot = int(view.slots(req, where[:1])[0])
        before, after = view.swa_rows([slot, others[0]])
        if before == after or after <= 0:
            continue
        view.set_swa_rows([slot], [after])
        return Landing(
            {"rid": req.rid, "position": where[0], "slot": slot, "before": before, "after": after},
            (Damage("mapping", slot=slot, position=where[0], request=req.rid, before=before,
                    after=after),))
    return None


@register_kind("flip_kv_byte", Site.BEFORE_STEP, caught_by=("kv_canary.verify_real_kv_hash",),
               params=(Field("byte", Int(minimum=0), 0,
                             "which byte of the slot's K row (first layer of the group) to flip; "
                             "one past the row: nothing to flip, no landing"),))
def flip_kv_byte(ctx: KindContext[BeforeStep]) -> Landing | None:
    """XOR 0xFF into one byte of a slot's real K bytes (target.group full|swa; a running request's slot, or request: cached for a slot only the radix cache holds).
    In use: KV canary TAIL verify_real_kv_hash; cached: the SWEEP's verify_real_kv_hash."""
    view, target = ctx.view, ctx.target
    group_swa = target.group == "swa"
    if view.kv_bytes(target.group, 0) is None:  # no layer of that group
        return None
    if target.request == "cached":
        if not view.has_radix_cache:
            return None
        in_use = {s for r in view.running() for s in _ints(view.slot_range(r, 0, r.kv_len))}
        candidates = [s for s in view.radix_held_slots() if s not in in_use]
        if group_swa:
            candidates = [s for s, row in zip(candidates, view.swa_rows(candidates), strict=True)
                          if row > 0]
        if not candidates:
            return None
        slot, rid, pos = sorted(candidates)[0], None, None
    else:
        picked = None
        for req in pick_requests(target, view.running(), ctx.rng):
            where = positions(target, req, view.window)
            if where:
                picked = (req, where[0])
                break
        if picked is None:
            return None
        req, pos = picked
        slot, rid = int(view.slots(req, [pos])[0]), req.rid
    row = view.swa_rows([slot])[0] if group_swa else slot
    if row <= 0:
        return None
    byte = ctx.params["byte"]
    layer, raw = view.kv_bytes(target.group, row)
    if byte >= raw.numel():  # params.byte beyond the row: nothing to flip (a kind never raises)
        return None
    before = int(raw[byte])
    raw[byte] = before ^ 0xFF
    return Landing(
        {"rid": rid, "position": pos, "slot": slot, "pool_row": row, "group": target.group,
         "layer": layer, "byte": byte, "before": before, "after": before ^ 0xFF},
        (Damage("kv_bytes", pool=target.group, slot=slot, pool_row=row, position=pos,
                request=rid, before=before, after=before ^ 0xFF,
                detail=f"layer {layer} byte {byte} of K"),))


# ---- kinds on window eviction ----------------------------------------------------------------------


def _eviction_landing(ctx: KindContext[WindowEviction], effect: EvictionEffect,
                      damage: tuple[Damage, ...]) -> Landing:
    """The window eviction as planned (`before`) and as the kind changed it (`after`)."""
    hook = ctx.hook
    freed = effect.free if effect.free is not None else hook.slots
    new_frontier = effect.new_frontier if effect.new_frontier is not None else hook.new_frontier
    digest = {
        "rid": hook.req.rid,
        "frontier": hook.frontier,
        "before": {"new_frontier": hook.new_frontier, "freed": _ints(hook.slots)},
        "after": {"new_frontier": new_frontier, "freed": _ints(freed)},
    }
    if effect.free_again is not None:
        digest["after"]["freed_again"] = _ints(effect.free_again)
    return Landing(digest, damage, effect)


def _free_list_damage(hook: WindowEviction, slots: list[int], first: int, how: str,
                      before: int, after: int) -> tuple[Damage, ...]:
    return tuple(Damage("free_list", pool="swa", slot=slot, position=first + i,
                        request=hook.req.rid, before=before, after=after, detail=how)
                 for i, slot in enumerate(slots))


@register_kind("skip_free_swa", Site.ON_WINDOW_EVICTION,
               caught_by=("swa.peer_released", "idle.swa_ledger"))
def skip_free_swa(ctx: KindContext[WindowEviction]) -> Landing | None:
    """Advance the window frontier without releasing the SWA peers (the free_swa is skipped).
    Without a radix cache, free_full at finish meets live peers: swa.peer_released; with one, the SWA ledger leaks."""
    hook = ctx.hook
    # Nothing to skip: an earlier kind at this eviction kept every slot already.
    if not hook.slots.numel() or _site_target(ctx) is None:
        return None
    # Owner counts: each slot had one owner until the eviction freed it (0); it keeps one.
    damage = _free_list_damage(hook, _ints(hook.slots), hook.frontier, "kept", 0, 1)
    return _eviction_landing(ctx, EvictionEffect(free=hook.slots[:0]), damage)


@register_kind("never_evict_swa", Site.ON_WINDOW_EVICTION, caught_by=("sched.decode_stall",))
def never_evict_swa(ctx: KindContext[WindowEviction]) -> Landing | None:
    """Keep every out-of-window SWA slot (the frontier never moves); use a large trigger.times.
    The SWA pool runs dry mid-decode: sched.decode_stall."""
    hook = ctx.hook
    if hook.new_frontier <= hook.frontier or _site_target(ctx) is None:
        return None  # the frontier stands still already (an earlier kind at this eviction)
    damage = (Damage("frontier", request=hook.req.rid, before=hook.new_frontier,
                     after=hook.frontier),
              *_free_list_damage(hook, _ints(hook.slots), hook.frontier, "kept", 0, 1))
    return _eviction_landing(ctx, EvictionEffect(free=hook.slots[:0], new_frontier=hook.frontier),
                             damage)


@register_kind("evict_inside_window", Site.ON_WINDOW_EVICTION,
               caught_by=("kv_canary.verify_position",),
               params=(Field("extra_tokens", Int(minimum=1), None,
                             "how far past the planned frontier to push it, in tokens (rounded "
                             "up to a page; default half a window, at least 1)"),))
def evict_inside_window(ctx: KindContext[WindowEviction]) -> Landing | None:
    """Push the window frontier too far (params.extra_tokens, default half a window), releasing SWA slots still in the window.
    The KV canary's SWA group sees in-window positions without a peer (verify_position; verify_chain_hash may fire too)."""
    hook, view = ctx.hook, ctx.view
    req = _site_target(ctx)
    if req is None:
        return None
    page = view.page_size
    extra = ctx.params["extra_tokens"] or max(view.window // 2, 1)
    pushed = min(hook.new_frontier + -(-extra // page) * page, req.kv_len - req.kv_len % page)
    if pushed <= hook.new_frontier:
        return None
    slots = view.slot_range(req, hook.frontier, pushed)
    inside = _ints(slots)[hook.new_frontier - hook.frontier:]
    damage = (Damage("frontier", request=req.rid, before=hook.new_frontier, after=pushed),
              *_free_list_damage(hook, inside, hook.new_frontier, "freed_in_window", 1, 0))
    return _eviction_landing(ctx, EvictionEffect(free=slots, new_frontier=pushed), damage)


@register_kind("double_free_swa", Site.ON_WINDOW_EVICTION, caught_by=("swa.peer_mapped",))
def double_free_swa(ctx: KindContext[WindowEviction]) -> Landing | None:
    """Call free_swa a second time on the slots a window eviction just released.
    page_size 1: swa.peer_mapped (the mapping already reads 0)."""
    hook = ctx.hook
    if not hook.slots.numel() or _site_target(ctx) is None:
        return None  # nothing was freed to free again
    damage = _free_list_damage(hook, _ints(hook.slots), hook.frontier, "freed_twice", 0, -1)
    return _eviction_landing(ctx, EvictionEffect(free_again=hook.slots.clone()), damage)


# ---- kinds at request finish and sampling ------------------------------------------------------------


@register_kind("leak_request", Site.ON_REQUEST_FINISH,
               caught_by=("idle.full_ledger", "idle.swa_ledger", "idle.req_rows_ledger",
                          "sched.admission_stall", "idle.radix_sanity", "census.slot_owner"))
def leak_request(ctx: KindContext[RequestFinish]) -> Landing | None:
    """Never free a finished request: its row and its slots stay taken.
    The idle ledgers (idle.full_ledger, idle.swa_ledger, idle.req_rows_ledger) and the memory
    census (census.slot_owner: slots no one owns; in STRICT already at the finish step); once every
    row is leaked, sched.admission_stall; a leaked cache hit keeps its radix lock: idle.radix_sanity."""
    req = _site_target(ctx)
    if req is None:
        return None
    slots = _ints(ctx.view.slot_range(req, 0, req.kv_len))
    damage = tuple(Damage("free_list", pool="full", slot=slot, position=pos, request=req.rid,
                          row=req.row, before=0, after=1, detail="kept")
                   for pos, slot in enumerate(slots))
    return Landing({"rid": req.rid, "row": req.row, "kv_len": req.kv_len}, damage,
                   FinishEffect(leak=True))


@register_kind("double_free_full", Site.ON_REQUEST_FINISH,
               caught_by=("alloc.double_free", "alloc.pool_bound"))
def double_free_full(ctx: KindContext[RequestFinish]) -> Landing | None:
    """After a finished request is released, free_full its target positions' slots once more.
    The full sub-allocator drops the second free: alloc.double_free (use radix_cache: false, else the tree still holds them); freeing every slot also breaks alloc.pool_bound."""
    req = _site_target(ctx)
    if req is None:
        return None
    where = positions(ctx.target, req, ctx.view.window) or [0]
    slots = ctx.view.slots(req, where)
    listed = _ints(slots)
    damage = tuple(Damage("free_list", pool="full", slot=slot, position=pos, request=req.rid,
                          before=0, after=-1, detail="freed_twice")
                   for pos, slot in zip(where, listed, strict=True))
    return Landing({"rid": req.rid, "positions": where, "slots": listed}, damage,
                   FinishEffect(free_full_again=slots))


@register_kind("swap_next_token", Site.ON_SAMPLING, caught_by=("kv_canary.write_token",))
def swap_next_token(ctx: KindContext[Sampling]) -> Landing | None:
    """Swap two requests' sampled tokens after the sampler (the token oracle already noted them).
    The KV canary's token oracle: write_token; no verify_* reason should fire."""
    reqs, next_ids = ctx.hook.reqs, list(ctx.hook.next_ids)
    pairs = [(i, j) for i in range(len(reqs)) for j in range(i + 1, len(reqs))
             if next_ids[i] != next_ids[j]]
    if not pairs:
        return None
    i, j = pairs[0]
    before = list(next_ids)
    next_ids[i], next_ids[j] = next_ids[j], next_ids[i]
    # The token lands at position kv_len of its request (its next forward's input).
    damage = tuple(Damage("sampled_token", request=reqs[k].rid, position=reqs[k].kv_len,
                          before=before[k], after=next_ids[k]) for k in (i, j))
    return Landing({"rids": [reqs[i].rid, reqs[j].rid], "before": [before[i], before[j]],
                    "after": [next_ids[i], next_ids[j]]}, damage, SamplingEffect(next_ids=next_ids))


# ---- kinds at a chunk boundary (a chunked prefill caches its processed part) ---------------------


@register_kind("unfinished_insert_live_head", Site.ON_CHUNK_BOUNDARY,
               caught_by=("swa.peer_mapped", "kv_canary.verify_position"))
def unfinished_insert_live_head(ctx: KindContext[ChunkBoundary]) -> Landing | None:
    """Cache a chunked request's processed part as if its window-evicted head still had SWA KV (radix cache only).
    The tree holds live nodes whose SWA peers are gone: its SWA eviction free_swa's them again on page 1
    (swa.peer_mapped), the canary's sweep reads them (kv_canary.verify_position)."""
    hook, view = ctx.hook, ctx.view
    req = _site_target(ctx)
    if req is None or not view.has_radix_cache or req.frontier <= hook.protected_len:
        return None
    slots = _ints(view.slot_range(req, hook.protected_len, req.frontier))
    damage = tuple(Damage("radix_node", slot=slot, position=hook.protected_len + i, request=req.rid,
                          before="tombstone", after="live")
                   for i, slot in enumerate(slots))
    return Landing({"rid": req.rid, "head": [hook.protected_len, req.frontier]}, damage,
                   ChunkEffect(swa_evicted_seqlen=hook.protected_len))
