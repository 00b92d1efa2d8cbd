"""Hook sites: the named places where the engine hands a loaded perturbation a typed context.

Each site has a frozen context (what the engine is about to do there) and, where a kind may
change what happens next, a typed effect the scheduler applies:

    site                 context                                          effect
    before_step          BeforeStep()                                     -
    after_forward        AfterForward(reqs)                               -
    on_sampling          Sampling(reqs, next_ids)                         SamplingEffect(next_ids)
    on_window_eviction   WindowEviction(req, slots, frontier, new_frontier)
                                                     EvictionEffect(free, new_frontier, free_again)
    on_request_finish    RequestFinish(req)                               FinishEffect(leak,
                                                                          free_full_again)
    cache_hit            CacheHit(req, cached_len)                        -
    on_chunk_boundary    ChunkBoundary(req, protected_len)                ChunkEffect(swa_evicted_seqlen)

A kind's effect names only what it changes (None: as planned); the perturber folds the effects of
every kind that landed into the site's planned effect (`planned()`), which the scheduler applies.
Requests appear as `ReqState` snapshots, never as the engine's own `Req`.

With no scenario loaded the engine holds no perturber, builds no context and calls nothing.
Torch-free: the slot tensors are the scheduler's, typed here only.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["AfterForward", "BeforeStep", "CacheHit", "ChunkBoundary", "ChunkEffect", "EvictionEffect", "FinishEffect",
           "NO_FINISH_EFFECT", "ReqState", "RequestFinish", "Sampling", "SamplingEffect",
           "Site", "SiteContext", "WindowEviction", "merge_effects"]


class Site(str, enum.Enum):
    BEFORE_STEP = "before_step"
    AFTER_FORWARD = "after_forward"
    ON_SAMPLING = "on_sampling"
    ON_WINDOW_EVICTION = "on_window_eviction"
    ON_REQUEST_FINISH = "on_request_finish"
    CACHE_HIT = "cache_hit"
    ON_CHUNK_BOUNDARY = "on_chunk_boundary"


class _Req(Protocol):
    rid: str
    row: int
    kv_len: int
    swa_evicted_seqlen: int


@dataclass(frozen=True)
class ReqState:
    """A request as a perturbation sees it, at the moment of the hook.

    kv_len: positions `[0, kv_len)` have KV. frontier: the window frontier
    (`swa_evicted_seqlen`): positions below it hold no SWA KV of this request's own.
    row: its req_to_token row.
    """

    rid: str
    row: int
    kv_len: int
    frontier: int

    @classmethod
    def of(cls, req: _Req) -> ReqState:
        return cls(req.rid, req.row, req.kv_len, req.swa_evicted_seqlen)


# ---- effects: None (or False) in a field means "as planned" ---------------------------------


@dataclass(frozen=True, eq=False)
class SamplingEffect:
    next_ids: list[int] | None = None  # the tokens the requests get instead of the sampled ones


@dataclass(frozen=True, eq=False)
class EvictionEffect:
    free: torch.Tensor | None = None  # the slots free_swa gets (int64 full slots)
    new_frontier: int | None = None  # where the request's window frontier goes
    free_again: torch.Tensor | None = None  # slots of a second free_swa call


@dataclass(frozen=True, eq=False)
class FinishEffect:
    leak: bool | None = None  # True: the request's row and slots are never freed
    free_full_again: torch.Tensor | None = None  # slots free_full gets once more, after release


NO_FINISH_EFFECT = FinishEffect()


@dataclass(frozen=True)
class ChunkEffect:
    swa_evicted_seqlen: int | None = None  # where the cached part's tombstone head ends


def merge_effects(base: Any, change: Any) -> Any:
    """`base` with every field `change` sets (not None) taken from `change`."""
    changed = {f.name: getattr(change, f.name) for f in dataclasses.fields(change)
               if getattr(change, f.name) is not None}
    return dataclasses.replace(base, **changed) if changed else base


# ---- contexts --------------------------------------------------------------------------------


class SiteContext:
    """What every site context has: its site, its effect type, the planned effect, and the
    context a later kind at the same call sees once an effect changed it."""

    SITE: ClassVar[Site]
    EFFECT: ClassVar[type | None] = None

    def planned(self) -> Any:
        """The effect of no perturbation at all (None for a site without effects)."""
        return None

    def after(self, effect: Any) -> SiteContext:
        return self


@dataclass(frozen=True)
class BeforeStep(SiteContext):
    """The start of a step, before aborted requests are dropped and a batch is scheduled."""

    SITE: ClassVar[Site] = Site.BEFORE_STEP


@dataclass(frozen=True)
class AfterForward(SiteContext):
    """A batch's forward ran: `reqs` hold their new kv_len; the canary has not written yet."""

    SITE: ClassVar[Site] = Site.AFTER_FORWARD
    reqs: tuple[ReqState, ...]


@dataclass(frozen=True)
class Sampling(SiteContext):
    """The sampler produced `next_ids` (one per request of `reqs`); the token oracle noted them."""

    SITE: ClassVar[Site] = Site.ON_SAMPLING
    EFFECT: ClassVar[type] = SamplingEffect
    reqs: tuple[ReqState, ...]
    next_ids: tuple[int, ...]

    def planned(self) -> SamplingEffect:
        return SamplingEffect(next_ids=list(self.next_ids))

    def after(self, effect: SamplingEffect) -> Sampling:
        return dataclasses.replace(self, next_ids=tuple(effect.next_ids or self.next_ids))


@dataclass(frozen=True, eq=False)
class WindowEviction(SiteContext):
    """A window eviction is about to free_swa `slots` (positions `[frontier, new_frontier)`)."""

    SITE: ClassVar[Site] = Site.ON_WINDOW_EVICTION
    EFFECT: ClassVar[type] = EvictionEffect
    req: ReqState
    slots: torch.Tensor  # int64 full slots of positions [frontier, new_frontier)
    frontier: int
    new_frontier: int

    def planned(self) -> EvictionEffect:
        return EvictionEffect(free=self.slots, new_frontier=self.new_frontier)

    def after(self, effect: EvictionEffect) -> WindowEviction:
        return dataclasses.replace(self, slots=effect.free, new_frontier=effect.new_frontier)


@dataclass(frozen=True)
class RequestFinish(SiteContext):
    """A request finished and left `running`; its KV and row are about to be released."""

    SITE: ClassVar[Site] = Site.ON_REQUEST_FINISH
    EFFECT: ClassVar[type] = FinishEffect
    req: ReqState

    def planned(self) -> FinishEffect:
        return NO_FINISH_EFFECT


@dataclass(frozen=True)
class CacheHit(SiteContext):
    """A request was admitted with `cached_len` prompt tokens matched in the radix cache."""

    SITE: ClassVar[Site] = Site.CACHE_HIT
    req: ReqState
    cached_len: int


@dataclass(frozen=True)
class ChunkBoundary(SiteContext):
    """A chunk that does not end `req`'s prompt ran and its window frontier moved; with a radix
    cache, `[0, req.kv_len)` is about to be cached (`cache_unfinished`): below `req.frontier` as a
    tombstone, the lock moved to its last node. `protected_len`: the request's cached prefix
    before this insert."""

    SITE: ClassVar[Site] = Site.ON_CHUNK_BOUNDARY
    EFFECT: ClassVar[type] = ChunkEffect
    req: ReqState
    protected_len: int

    def planned(self) -> ChunkEffect:
        return ChunkEffect()
