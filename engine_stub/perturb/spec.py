"""Perturbation specs: the `perturbations:` section of a scenario, parsed and validated.

Both the engine (which applies them) and the canary suite (which validates scenario files) parse
through here, from the field tables below and each kind's declared params, so the two never
disagree about what a trigger, a target or a param means. `check_perturbations` reports every
problem with its field path (`perturbations[0].trigger.event`) for the caller to map to a file
and line; `parse_perturbations`, the engine's, raises a `SpecError` at the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_stub.fields import (
    INVALID,
    Choice,
    Field,
    FieldType,
    Int,
    IntOrChoice,
    Number,
    Report,
    Table,
    is_int,
    raising,
)

if TYPE_CHECKING:
    from engine_stub.perturb.kinds import KindInfo

__all__ = ["GROUP_WORDS", "POSITION_WORDS", "REQUEST_WORDS", "TARGET", "TRIGGER", "TRIGGER_EVENTS",
           "VALUE_WORDS", "VIA_WORDS", "PerturbationSpec", "SpecError", "TargetSpec", "TriggerSpec",
           "check_perturbations", "item_schema", "parse_perturbations"]

TRIGGER_EVENTS = ("window_cross", "first_swa_eviction", "request_finish", "cache_hit", "chunk_boundary")
POSITION_WORDS = ("in_window", "retained_unread", "out_of_window", "last")
REQUEST_WORDS = ("random", "all", "cached")
VALUE_WORDS = ("other_live_slot", "freed_slot", "zero", "minus_one")
GROUP_WORDS = ("full", "swa")
# Who carries a perturbation out: the engine's own kind at its hook site, or SGLang's own
# perturbation knob (`SGLANG_KV_CANARY_PERTURB_*`), which only SGLang's server has.
VIA_WORDS = ("engine", "sglang_knob")


class SpecError(ValueError):
    """A bad field in a perturbation spec; `path` names it (e.g. `perturbations[1].target`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class Positions(FieldType):
    """A position word, `[lo, hi]` or `{from: lo, to: hi}` (both: lo <= position < hi)."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if isinstance(value, str):
            return Choice(POSITION_WORDS).parse(value, path, report)
        bounds = None
        if isinstance(value, list) and len(value) == 2:
            bounds = value
        elif isinstance(value, dict) and set(value) == {"from", "to"}:
            bounds = [value["from"], value["to"]]
        if bounds is None or not all(is_int(b) for b in bounds):
            report(path, f"expected one of {', '.join(POSITION_WORDS)}, [lo, hi] or "
                         f"{{from: lo, to: hi}}, got {value!r}")
            return INVALID
        if not 0 <= bounds[0] < bounds[1]:
            report(path, f"a range [lo, hi] (lo <= position < hi) needs 0 <= lo < hi, got {value}")
            return INVALID
        return (bounds[0], bounds[1])

    def schema(self) -> dict:
        nonneg = {"type": "integer", "minimum": 0}
        return {"oneOf": [
            {"enum": list(POSITION_WORDS)},
            {"type": "array", "items": nonneg, "minItems": 2, "maxItems": 2},
            {"type": "object", "additionalProperties": False, "required": ["from", "to"],
             "properties": {"from": nonneg, "to": nonneg}},
        ]}


TRIGGER = Table((
    Field("at_step", Int(minimum=0), None, "only at this engine step"),
    Field("after_step", Int(minimum=0), None, "only after this engine step"),
    Field("warmup_steps", Int(minimum=0), 0, "not in the first N steps"),
    Field("event", Choice(TRIGGER_EVENTS), None, "arm on this serving event first"),
    Field("probability", Number(exclusive_minimum=0, maximum=1), 1.0,
          "seeded chance per eligible hook call"),
    Field("interval", Int(minimum=1), 1, "act on every Nth eligible hook call"),
    Field("times", Int(minimum=1), 1, "at most this many landings"),
))

TARGET = Table((
    Field("request", IntOrChoice(Int(minimum=0), Choice(REQUEST_WORDS)), 0,
          "an index into the running requests in rid order, random (seeded), all, or cached (a "
          "slot only the radix cache holds)"),
    Field("positions", Positions(), "last",
          "in_window (the oldest position the next forward reads), retained_unread (the oldest "
          "position whose SWA KV is held but never read again), out_of_window, last, or "
          "[lo, hi] / {from: lo, to: hi} (lo <= position < hi)"),
    Field("group", Choice(GROUP_WORDS), "full", "the KV group: full or swa"),
    Field("value", Choice(VALUE_WORDS), "other_live_slot",
          "what a corrupting kind writes (minus_one: the -1 an empty prefix's last_loc carries)"),
    Field("count", Int(minimum=1), 1, "how many entries"),
), aliases=(("index", "request"),))


@dataclass(frozen=True)
class TriggerSpec:
    """When a perturbation acts (the TRIGGER table): all given conditions must hold at an
    eligible hook call."""

    at_step: int | None = TRIGGER["at_step"].default
    after_step: int | None = TRIGGER["after_step"].default
    warmup_steps: int = TRIGGER["warmup_steps"].default
    event: str | None = TRIGGER["event"].default
    probability: float = TRIGGER["probability"].default
    interval: int = TRIGGER["interval"].default
    times: int = TRIGGER["times"].default


@dataclass(frozen=True)
class TargetSpec:
    """What a perturbation touches (the TARGET table; positions: see perturb/targets.py)."""

    request: int | str = TARGET["request"].default
    positions: str | tuple[int, int] = TARGET["positions"].default
    group: str = TARGET["group"].default
    value: str = TARGET["value"].default
    count: int = TARGET["count"].default


@dataclass(frozen=True)
class PerturbationSpec:
    kind: str
    trigger: TriggerSpec = field(default_factory=TriggerSpec)
    target: TargetSpec = field(default_factory=TargetSpec)
    params: dict[str, Any] = field(default_factory=dict)  # as written; defaults are the kind's
    via: str = "engine"  # VIA_WORDS; sglang_knob: SGLang's knob does it, the engine never arms it


ITEM_KEYS = ("kind", "trigger", "target", "params", "via")


def _registered() -> Mapping[str, KindInfo]:
    from engine_stub.perturb.kinds import KINDS

    return KINDS


def check_perturbations(raw: Any, report: Report, kinds: Mapping[str, KindInfo] | None = None,
                        path: str = "perturbations") -> list[PerturbationSpec]:
    """The valid specs of a `perturbations:` list, every problem reported; a bad item is left out.

    `kinds`: the kind registry (default: the registered kinds), whose declared params check
    each item's `params:`.
    """
    kinds = _registered() if kinds is None else kinds
    if raw is None:
        return []
    if not isinstance(raw, list):
        report(path, f"expected a list, got {type(raw).__name__}")
        return []
    specs = []
    bad: list[str] = []  # the fields of the item at hand that were reported

    def note(p: str, message: str, *, key: bool = False) -> None:
        bad.append(p)
        report(p, message, key=key)

    for i, item in enumerate(raw):
        item_path = f"{path}[{i}]"
        if item is None:
            item = {}
        if not isinstance(item, dict):
            report(item_path, f"expected a mapping, got {type(item).__name__}")
            continue
        bad.clear()
        for key in item:
            if key not in ITEM_KEYS:
                note(f"{item_path}.{key}", f"unknown key {key!r}; valid keys: "
                                           f"{', '.join(ITEM_KEYS)}", key=True)
        info = None
        if "kind" not in item:
            note(f"{item_path}.kind", f"missing; valid kinds: {', '.join(kinds)}", key=True)
        elif Choice(tuple(kinds), what="kind").parse(item["kind"], f"{item_path}.kind",
                                                    note) is not INVALID:
            info = kinds[item["kind"]]
        trigger = TRIGGER.parse(item.get("trigger"), f"{item_path}.trigger", note)
        target = TARGET.parse(item.get("target"), f"{item_path}.target", note)
        params = (info.params.parse(item.get("params"), f"{item_path}.params", note)
                  if info is not None else INVALID)
        via = Choice(VIA_WORDS).parse(item.get("via", "engine"), f"{item_path}.via", note)
        if bad or INVALID in (trigger, target, params, via):
            continue
        specs.append(PerturbationSpec(info.name, TriggerSpec(**trigger), TargetSpec(**target),
                                      dict(params), via))
    return specs


def parse_perturbations(raw: Any, kinds: Mapping[str, KindInfo] | None = None,
                        path: str = "perturbations") -> list[PerturbationSpec]:
    """Parse a `perturbations:` list (the engine's boundary); raises SpecError at the first
    bad field."""
    return check_perturbations(raw, raising(SpecError), kinds, path)


def item_schema(kinds: Mapping[str, KindInfo] | None = None) -> dict:
    """JSON Schema of one `perturbations:` item: each kind's params from its declaration."""
    kinds = _registered() if kinds is None else kinds
    return {
        "type": "object", "additionalProperties": False, "required": ["kind"],
        "properties": {
            "kind": {"enum": list(kinds)},
            "trigger": TRIGGER.schema(),
            "target": TARGET.schema(),
            "params": {"type": "object"},
            "via": {"enum": list(VIA_WORDS)},
        },
        "allOf": [{"if": {"properties": {"kind": {"const": name}}, "required": ["kind"]},
                   "then": {"properties": {"params": info.params.schema()}}}
                  for name, info in kinds.items()],
    }
