"""The engine's hook sites other than `before_step`, placed in SGLang's own code (0.5.22 and 0.5.23:
the same functions, `release_sites` checks a release has each).

Each wrapper builds the site's context from SGLang's request and the slots it is about to act on,
lets the armed `Perturber` fold the effect, and applies it with SGLang's own calls:

    site                 SGLang function wrapped                        effect applied
    on_window_eviction   mem_cache/common.py free_swa_out_of_window_slots
                         (its free_segment call: the out-of-window slots) skip / replace the free,
                                                                        free again, move the frontier
    on_request_finish    mem_cache/common.py release_kv_cache (finished) skip it (leak), free_full again
    on_sampling          Scheduler._relay_forward_payload (the sampled  the swapped ids, in place, before
                         ids, before the next input and output_ids)     the relay and the output append
    on_chunk_boundary    SWAComponent.free_out_of_window_slots, inside  the insert's SWA evicted length
                         Scheduler.stash_chunked_request

Unarmed (no scenario, or another process) every wrapper calls SGLang's function unchanged. The
wrappers take the originals as arguments so the logic is testable without SGLang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_stub.perturb.sites import (
    ChunkBoundary,
    ReqState,
    RequestFinish,
    Sampling,
    Site,
    WindowEviction,
)

__all__ = ["arm", "armed", "checkpoint_into_tree", "chunk_boundary", "reading", "relay_sampled", "release_kv_cache", "req_state",
           "set_forward", "stash_chunked_request", "window_eviction"]

_armed: tuple[Any, Any] | None = None  # (Perturber, SchedulerFacade) of this scheduler process
_stashing: list[Any] = []  # the request Scheduler.stash_chunked_request is caching (a chunk boundary)


def arm(perturber: Any, facade: Any) -> None:
    """Make `perturber` (over `facade`) the one every site hook of this process consults."""
    global _armed
    _armed = (perturber, facade)


def armed(site: Site) -> tuple[Any, Any] | None:
    """The armed (perturber, facade) if a perturbation acts at `site`, else None."""
    if _armed is None or site not in _armed[0].sites:
        return None
    return _armed


def reading() -> Any | None:
    """The armed perturber's reachability tracker while some damage is still open (else None):
    the readers SGLang runs here report to it (canaries/sglang/server/reach.py)."""
    tracker = getattr(_armed[0], "reach", None) if _armed is not None else None
    return tracker if tracker is not None and tracker.open else None


def _read_row(tracker: Any, req: Any, lo: int, hi: int, by: str) -> None:
    tracker.table_read(int(req.kv.req_pool_idx), str(req.rid), lo, hi, by)


# Per request of the batch about to run (by id), the tokens its forward writes. SGLang allocates
# their slots and counts them in `kv_committed_len` before `run_batch` (mem_cache/allocation.py:
# `alloc_for_decode` adds one, `alloc_for_extend` sets the new seq_len), so at the before_step site
# a request's KV is written only up to kv_committed_len minus these: the kinds' `kv_len`, as ours.
_unwritten: dict[int, int] = {}


def set_forward(batch: Any | None) -> None:
    """The batch whose forward runs next (None once it ran): see `_unwritten`."""
    _unwritten.clear()
    mode = getattr(batch, "forward_mode", None)
    if batch is None or mode is None:
        return
    if mode.is_decode():
        _unwritten.update({id(r): 1 for r in batch.reqs})
    elif mode.is_extend():
        _unwritten.update({id(r): int(getattr(r, "extend_input_len", 0) or 0) for r in batch.reqs})


def req_state(req: Any) -> ReqState:
    """An SGLang `Req` as the kinds see a request (0.5.23's `req.kv`: `ReqKvInfo`): its KV
    written so far is `kv_len`."""
    kv = req.kv
    written = int(kv.kv_committed_len) - _unwritten.get(id(req), 0)
    return ReqState(str(req.rid), int(kv.req_pool_idx), max(written, 0), int(kv.max_evicted_seqlen))


def window_eviction(original: Callable[..., None]) -> Callable[..., None]:
    """`free_swa_out_of_window_slots`, its SWA free passed through the on_window_eviction site.

    SGLang computes the frontier and frees `req_to_token[row, frontier:new_frontier]` through one
    `free_segment(slots, start_pos=frontier)` call, then sets the request's evicted length; the
    hook stands in for that call and, where a kind moved the frontier, sets it after SGLang did.
    The frontier itself is the release's: 0.5.22 keeps `max(window, page)` (common.py l.100),
    0.5.23 rounds that up to whole pages (l.116); the hook sees whichever slots the release frees.
    """
    component_default = (original.__kwdefaults__ or {}).get("component_type")

    def free_swa_out_of_window_slots(req: Any, pre_len: int, **kwargs: Any) -> None:
        component = kwargs.get("component_type", component_default)
        hooked = armed(Site.ON_WINDOW_EVICTION) if getattr(component, "name", "SWA") == "SWA" else None
        tracker = reading()
        if hooked is None and tracker is None:
            return original(req, pre_len, **kwargs)
        if tracker is not None:  # SGLang reads the frontier whether or not it frees
            tracker.read([("frontier", str(req.rid))], "window eviction")
        segment = kwargs.get("free_segment") or kwargs["token_to_kv_pool_allocator"].free_swa_segment
        frontiers: list[int] = []

        def free_segment(slots: Any, *, start_pos: int) -> None:
            import torch

            slots = slots.to(torch.int64)
            if tracker is not None:  # SGLang read the evicted span of the row, from the frontier
                _read_row(tracker, req, start_pos, start_pos + int(slots.numel()), "window eviction")
            if hooked is None:
                segment(slots, start_pos=start_pos)
                return
            perturber, facade = hooked
            hook = WindowEviction(req_state(req), slots, start_pos, start_pos + int(slots.numel()))
            effect = perturber.at(hook, facade)
            if effect.free is not None and effect.free.numel():
                segment(effect.free, start_pos=start_pos)
            if effect.free_again is not None:  # a caller's second free of the same slots
                segment(effect.free_again, start_pos=start_pos)
            frontiers.append(effect.new_frontier)

        original(req, pre_len, **{**kwargs, "free_segment": free_segment})
        if frontiers:
            req.kv.set_evicted_seqlen(component, frontiers[-1])

    free_swa_out_of_window_slots.__wrapped__ = original
    return free_swa_out_of_window_slots


def release_kv_cache(original: Callable[..., None]) -> Callable[..., None]:
    """`release_kv_cache` of a finished request, through the on_request_finish site: a leak skips
    SGLang's release (row, slots and tree lock stay taken); `free_full_again` frees those slots
    once more after it, in the same free group."""

    def release(req: Any, tree_cache: Any, *, checkpoint: bool) -> None:
        tracker = reading()
        if tracker is not None and req.kv.holds_kv:  # any release: finish, abort, retraction
            _read_row(tracker, req, 0, int(req.kv.kv_allocated_len), "the release of a request")
            if req.finished():
                tracker.finished(str(req.rid))
        hooked = armed(Site.ON_REQUEST_FINISH)
        if hooked is None or not req.finished() or not req.kv.holds_kv:
            return original(req, tree_cache, checkpoint=checkpoint)
        perturber, facade = hooked
        effect = perturber.at(RequestFinish(req_state(req)), facade)
        if not effect.leak:
            original(req, tree_cache, checkpoint=checkpoint)
        if effect.free_full_again is not None:
            tree_cache.token_to_kv_pool_allocator.free_full(effect.free_full_again)

    release.__wrapped__ = original
    return release


def relay_sampled(original: Callable[..., None]) -> Callable[..., None]:
    """`Scheduler._relay_forward_payload`, the sampled ids first through the on_sampling site.

    The relay hands `next_token_ids` to the next forward's input and `process_batch_result`
    appends the same tensor to the requests' output_ids: a swap written into it in place reaches
    both, as a sampler's would. A chunk that does not end its prompt samples nothing (its id is
    discarded), so it is not among the context's requests.
    """

    def relay(self: Any, batch: Any, future_indices: Any, batch_result: Any) -> None:
        hooked = armed(Site.ON_SAMPLING)
        ids = getattr(batch_result, "next_token_ids", None)
        if hooked is not None and ids is not None and getattr(ids, "dim", lambda: 0)() == 1:
            _sample_site(hooked, batch, ids)
        return original(self, batch, future_indices, batch_result)

    relay.__wrapped__ = original
    return relay


def _sample_site(hooked: tuple[Any, Any], batch: Any, ids: Any) -> None:
    perturber, facade = hooked
    rows = [i for i, r in enumerate(batch.reqs[: int(ids.shape[0])])
            if getattr(r, "inflight_middle_chunks", 0) <= 0 and not r.finished() and r.kv.holds_kv]
    if not rows:
        return
    sampled = [int(v) for v in ids[rows].tolist()]
    effect = perturber.at(Sampling(tuple(req_state(batch.reqs[i]) for i in rows), tuple(sampled)), facade)
    if effect.next_ids is not None and list(effect.next_ids) != sampled:
        for i, token in zip(rows, effect.next_ids, strict=True):
            ids[i] = int(token)


def stash_chunked_request(original: Callable[..., None]) -> Callable[..., None]:
    """`Scheduler.stash_chunked_request`: marks its request as at a chunk boundary while SGLang
    caches its processed part (`checkpoint_kv_cache` -> `cache_unfinished_req`)."""

    def stash(self: Any, req: Any) -> None:
        tracker = reading()
        if tracker is not None and req.kv.holds_kv:  # the insert keys the processed part's row
            _read_row(tracker, req, 0, int(req.kv.kv_allocated_len), "the cache of a chunked request's processed part")
        _stashing.append(req)
        try:
            return original(self, req)
        finally:
            _stashing.pop()

    stash.__wrapped__ = original
    return stash


def checkpoint_into_tree(original: Callable[..., None]) -> Callable[..., None]:
    """`UnifiedRadixCache.checkpoint_into_tree` (after every prefill, at each chunk boundary and
    at a finish): a reader only, for reachability: the insert keys the row below `up_to`."""

    def checkpoint(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
        tracker = reading()
        if tracker is not None and req.kv.holds_kv:
            _read_row(tracker, req, 0, int(up_to), "the tree's insert of a request (checkpoint)")
        return original(self, req, up_to=up_to, **kwargs)

    checkpoint.__wrapped__ = original
    return checkpoint


def chunk_boundary(original: Callable[..., None]) -> Callable[..., None]:
    """`SWAComponent.free_out_of_window_slots` of a request at a chunk boundary: after SGLang
    moved its frontier and wrote it into the insert's params, the on_chunk_boundary site; its
    effect is the SWA evicted length the insert tombstones below."""

    def free_out_of_window_slots(self: Any, req: Any, pre_len: int, insert_params: Any) -> None:
        # Its frees pass through the window-eviction hook (the module-level function it calls).
        original(self, req, pre_len, insert_params)
        hooked = armed(Site.ON_CHUNK_BOUNDARY)
        if hooked is None or not _stashing or _stashing[-1] is not req:
            return
        perturber, facade = hooked
        effect = perturber.at(ChunkBoundary(req_state(req), int(req.kv.cache_protected_len)), facade)
        if effect.swa_evicted_seqlen is not None:
            insert_params.set_evicted_seqlen(self.component_type, effect.swa_evicted_seqlen)

    free_out_of_window_slots.__wrapped__ = original
    return free_out_of_window_slots
