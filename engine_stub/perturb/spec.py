"""Perturbation specs: the `perturbations:` section of a scenario, parsed and validated.

Both the engine (which applies them) and the canary suite (which validates scenario files) parse
through here, so the two never disagree about what a trigger or a target means. Errors are
`SpecError`s carrying the field path (`perturbations[0].trigger.event`) for the caller to map to a
file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARAM_MINIMUMS", "PerturbationSpec", "SpecError", "TargetSpec", "TriggerSpec", "TRIGGER_EVENTS",
           "parse_perturbations"]

TRIGGER_EVENTS = ("window_cross", "first_swa_eviction", "request_finish", "cache_hit")
POSITION_WORDS = ("in_window", "out_of_window", "last")
REQUEST_WORDS = ("random", "all", "cached")
VALUE_WORDS = ("other_live_slot", "freed_slot", "zero", "minus_one")
GROUP_WORDS = ("full", "swa")
# params a kind reads, each an integer with this minimum (evict_inside_window, flip_kv_byte).
PARAM_MINIMUMS = {"extra_tokens": 1, "byte": 0}


class SpecError(ValueError):
    """A bad field in a perturbation spec; `path` names it (e.g. `perturbations[1].target`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class TriggerSpec:
    """When a perturbation acts. All given conditions must hold at an eligible hook call.

    at_step: only at this engine step. after_step: only after it. warmup_steps: not before.
    event: arm on a serving event first (window_cross, first_swa_eviction, request_finish,
    cache_hit). probability: seeded chance per eligible call. interval: act on every Nth eligible
    call. times: at most this many landings (default 1).
    """

    at_step: int | None = None
    after_step: int | None = None
    warmup_steps: int = 0
    event: str | None = None
    probability: float = 1.0
    interval: int = 1
    times: int = 1


@dataclass(frozen=True)
class TargetSpec:
    """What a perturbation touches.

    request: an index into the running requests in rid order, `random` (seeded), `all`, or
    `cached` (a slot only the radix cache holds). positions: `in_window` (the oldest position
    still inside the window: the next to slide out), `out_of_window`, `last`, or `[lo, hi)`.
    group: `full` or `swa`. value: for corrupting kinds, what to write (`minus_one`: the -1 an
    empty prefix's last_loc carries, written into a row by mistake). count: how many entries.
    """

    request: int | str = 0
    positions: str | tuple[int, int] = "last"
    group: str = "full"
    value: str = "other_live_slot"
    count: int = 1


@dataclass(frozen=True)
class PerturbationSpec:
    kind: str
    trigger: TriggerSpec = field(default_factory=TriggerSpec)
    target: TargetSpec = field(default_factory=TargetSpec)
    params: dict[str, Any] = field(default_factory=dict)


def _int(path: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(path, f"must be >= {minimum}, got {value}")
    return value


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(path, f"{value!r} is not one of {', '.join(choices)}")
    return value


def _mapping(path: str, raw: Any, allowed: tuple[str, ...]) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(path, f"expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in allowed:
            raise SpecError(f"{path}.{key}", f"unknown key; valid keys: {', '.join(allowed)}")
    return raw


def _trigger(path: str, raw: Any) -> TriggerSpec:
    raw = _mapping(path, raw, tuple(TriggerSpec.__dataclass_fields__))
    values: dict[str, Any] = {}
    for key, minimum in (("at_step", 0), ("after_step", 0), ("warmup_steps", 0), ("interval", 1), ("times", 1)):
        if key in raw:
            values[key] = _int(f"{path}.{key}", raw[key], minimum=minimum)
    if "event" in raw:
        values["event"] = _choice(f"{path}.event", raw["event"], TRIGGER_EVENTS)
    if "probability" in raw:
        p = raw["probability"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise SpecError(f"{path}.probability", f"must be a number in (0, 1], got {p!r}")
        values["probability"] = float(p)
    return TriggerSpec(**values)


def _target(path: str, raw: Any) -> TargetSpec:
    raw = _mapping(path, raw, tuple(TargetSpec.__dataclass_fields__) + ("index",))
    values: dict[str, Any] = {}
    request = raw.get("request", raw.get("index", 0))
    if isinstance(request, str):
        values["request"] = _choice(f"{path}.request", request, REQUEST_WORDS)
    else:
        values["request"] = _int(f"{path}.request", request, minimum=0)
    if "positions" in raw:
        pos = raw["positions"]
        if isinstance(pos, str):
            values["positions"] = _choice(f"{path}.positions", pos, POSITION_WORDS)
        elif isinstance(pos, list) and len(pos) == 2 and all(isinstance(p, int) and not isinstance(p, bool) for p in pos):
            if not 0 <= pos[0] < pos[1]:
                raise SpecError(f"{path}.positions", f"a range [lo, hi) needs 0 <= lo < hi, got {pos}")
            values["positions"] = (pos[0], pos[1])
        else:
            raise SpecError(f"{path}.positions", f"expected one of {', '.join(POSITION_WORDS)} or [lo, hi], got {pos!r}")
    if "group" in raw:
        values["group"] = _choice(f"{path}.group", raw["group"], GROUP_WORDS)
    if "value" in raw:
        values["value"] = _choice(f"{path}.value", raw["value"], VALUE_WORDS)
    if "count" in raw:
        values["count"] = _int(f"{path}.count", raw["count"], minimum=1)
    return TargetSpec(**values)


def parse_perturbations(raw: Any, known_kinds: tuple[str, ...], path: str = "perturbations") -> list[PerturbationSpec]:
    """Parse a scenario's `perturbations:` list; raises SpecError naming the bad field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise SpecError(path, f"expected a list, got {type(raw).__name__}")
    specs = []
    for i, item in enumerate(raw):
        item_path = f"{path}[{i}]"
        item = _mapping(item_path, item, ("kind", "trigger", "target", "params"))
        if "kind" not in item:
            raise SpecError(f"{item_path}.kind", f"missing; valid kinds: {', '.join(known_kinds)}")
        kind = item["kind"]
        if kind not in known_kinds:
            raise SpecError(f"{item_path}.kind", f"unknown kind {kind!r}; valid kinds: {', '.join(known_kinds)}")
        params = _mapping(f"{item_path}.params", item.get("params"), tuple(PARAM_MINIMUMS))
        params = {k: _int(f"{item_path}.params.{k}", v, minimum=PARAM_MINIMUMS[k]) for k, v in params.items()}
        specs.append(
            PerturbationSpec(kind, _trigger(f"{item_path}.trigger", item.get("trigger")),
                             _target(f"{item_path}.target", item.get("target")), params)
        )
    return specs
