"""The perturbation contract: what a kind sees (`KindContext`, `EngineView`) and returns (`Landing`).

A kind is a function `(ctx: KindContext[SiteCtx]) -> Landing | None`. It reads and damages engine
state only through `ctx.view`, a narrow facade of the engine (never the scheduler itself), and
changes what the engine does next only through the effect of its landing. It never raises, logs
or calls an invariant. `None` means it found nothing to act on: not landed, the trigger stays armed.

A landing says what was damaged twice: `digest`, free-form JSON for people, and `damage`, one
typed `Damage` per damaged location, for machines (a reachability tracker will follow each one
until it is consumed or dies). Torch-free: tensors cross this contract typed, never imported.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from engine_stub.perturb.sites import ReqState, SiteContext

if TYPE_CHECKING:
    import torch

    from engine_stub.perturb.spec import PerturbationSpec, TargetSpec

__all__ = ["DAMAGE_KINDS", "Damage", "EngineView", "KindContext", "Landing"]

# What each damage kind's location fields mean. `slot` is always a FULL slot id (the
# req_to_token value space); `pool_row` a row of `pool`'s KV buffer (the SWA row for pool swa).
DAMAGE_KINDS: dict[str, str] = {
    "kv_bytes": "bytes of a KV row: pool (full|swa), pool_row, slot, layer and byte in detail; "
                "before/after the byte",
    "req_to_token": "a req_to_token entry: request, row, position; before/after full slots",
    "mapping": "a full-to-SWA mapping entry: slot (full); before/after SWA rows (0: released)",
    "free_list": "a pool's free list: pool, slot (and pool_row when known); detail says how "
                 "(kept: never freed, freed_in_window, freed_twice); before/after its owner count",
    "frontier": "a request's window frontier: request; before/after positions",
    "sampled_token": "a sampled token: request, position; before/after token ids",
    "radix_node": "a radix-cached slot's SWA state: slot (full), position, request; before/after "
                  "tombstone|live",
    "switch": "an engine behaviour switch: detail names it; before/after its value",
}
POOLS = ("full", "swa")


@dataclass(frozen=True)
class Damage:
    """One damaged location, before and after; the fields `DAMAGE_KINDS[kind]` does not name
    stay None."""

    kind: str
    pool: str | None = None
    slot: int | None = None
    pool_row: int | None = None
    position: int | None = None
    request: str | None = None
    row: int | None = None
    before: Any = None
    after: Any = None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in DAMAGE_KINDS:
            raise ValueError(f"damage kind {self.kind!r} is not one of {', '.join(DAMAGE_KINDS)}")
        if self.pool is not None and self.pool not in POOLS:
            raise ValueError(f"damage pool {self.pool!r} is not one of {', '.join(POOLS)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, without the fields left unset."""
        out: dict[str, Any] = {"kind": self.kind}
        for name in ("pool", "slot", "pool_row", "position", "request", "row", "before", "after"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True)
class Landing:
    """What a kind did: `digest` (JSON-able, for the `perturbation_landed` event), `damage` (at
    least one typed record) and `effect` (the site's effect type, or None: as planned)."""

    digest: dict[str, Any]
    damage: tuple[Damage, ...]
    effect: Any = None

    def __post_init__(self) -> None:
        if not self.damage:
            raise ValueError("a landing names what it damaged: give at least one Damage")


class EngineView(Protocol):
    """Exactly the engine state a kind may read and write.

    Slots are FULL slot ids; tensors are int64 on the engine's device. A read of a single value
    is a host read: only perturbed runs make it.
    """

    window: int
    page_size: int
    has_radix_cache: bool

    def running(self) -> list[ReqState]:
        """Running requests that have KV (kv_len > 0), sorted by rid."""

    def slots(self, req: ReqState, positions: Sequence[int]) -> torch.Tensor:
        """req_to_token[req.row, positions]."""

    def slot_range(self, req: ReqState, lo: int, hi: int) -> torch.Tensor:
        """req_to_token[req.row, lo:hi]."""

    def set_slot(self, req: ReqState, position: int, slot: int) -> None:
        """Write req_to_token[req.row, position] = slot."""

    def swa_rows(self, slots: Sequence[int]) -> list[int]:
        """The full-to-SWA mapping of `slots` (0: no SWA peer)."""

    def set_swa_rows(self, slots: Sequence[int], rows: Sequence[int]) -> None:
        """Write the full-to-SWA mapping of `slots`."""

    def free_full_slot(self) -> int | None:
        """The first slot of the lowest free page of the full pool (None: none free)."""

    def kv_bytes(self, group: str, pool_row: int) -> tuple[int, torch.Tensor] | None:
        """(layer, writable uint8 view of that layer's K row `pool_row`) for the first layer of
        `group` (full|swa); None if the model has no layer of that group."""

    def radix_held_slots(self) -> list[int]:
        """Slots the radix cache holds (empty without one)."""


HookT = TypeVar("HookT", bound=SiteContext)


@dataclass(frozen=True)
class KindContext(Generic[HookT]):
    """One call of a kind: the engine view, its site's context, its spec, params and rng.

    params: the kind's declared params, the scenario's values over the declared defaults.
    """

    view: EngineView
    hook: HookT
    spec: PerturbationSpec
    params: Mapping[str, Any] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def target(self) -> TargetSpec:
        return self.spec.target
