"""The scenario field table: every field of a scenario file declared once.

Each `Field` (engine_stub/fields.py) has a name, a type (which carries its bounds or choices), a
default and one line of doc. The loader validates a file with these tables and the schema
generator describes them; the model's dataclasses take their defaults from them. The
perturbations' fields are the engine's own tables (`engine_stub/perturb/spec.py`: TRIGGER,
TARGET, and each kind's declared params); the engine knobs are EngineConfig's fields (checked by
EngineConfig when the loader builds it). What no single field can say (expect's modes,
`within_steps` needing `fires`, a prompt plus its output fitting the context) the loader checks.

Registries (profiles, engine knobs, detectors, kinds) are read from the files and the torch-free
catalogues: importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from engine_stub import config as engine_config
from engine_stub import detectors as detector_catalogue
from engine_stub.config import EngineConfig
from engine_stub.fields import (
    INVALID,
    Bool,
    Choice,
    Field,
    FieldType,
    Int,
    NameList,
    Number,
    Report,
    Table,
    Text,
    is_int,
)
from engine_stub.perturb.spec import check_perturbations, item_schema

__all__ = ["DEFAULT_PROFILE", "DISABLED", "ENGINE", "ENGINE_OUTCOMES", "EXPECT", "NAME_RE",
           "PASSING", "PROFILE_DIR", "REPO_ROOT", "SCENARIO", "SCENARIO_DIR", "VERDICTS",
           "WORKLOAD", "engine_knobs", "known_detectors", "known_kinds", "profile_paths"]

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIO_DIR = REPO_ROOT / "configs" / "scenarios"
PROFILE_DIR = REPO_ROOT / "configs" / "engines"
DEFAULT_PROFILE = "cpu-tiny"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# The verdicts a run can get (`expect.verdict` names one; canaries/verdict judges them).
VERDICTS = ("DETECTED", "DISABLED_AS_DECLARED", "CLEAN", "MISSED", "WRONG_DETECTOR", "LATE",
            "FALSE_ALARM", "NOT_INJECTED", "NOT_REACHED", "INCONCLUSIVE")
PASSING = frozenset({"DETECTED", "DISABLED_AS_DECLARED", "CLEAN"})
ENGINE_OUTCOMES = ("crashes", "survives")
# Knobs the harness owns (where the engine listens and logs, the lockstep gate), and the seed,
# which a scenario sets once at top level.
_HARNESS_KNOBS = ("sources", "host", "port", "event_log", "seed")


# ---- registries ------------------------------------------------------------------------------


def engine_knobs() -> dict[str, dataclasses.Field]:
    """Engine knobs a scenario or profile may set (EngineConfig fields minus the harness's)."""
    return {
        f.name: f
        for f in dataclasses.fields(EngineConfig)
        if f.name not in _HARNESS_KNOBS and not f.name.startswith("gate_")
    }


def known_kinds() -> tuple[str, ...]:
    """Registered perturbation kinds (engine_stub.perturb.kinds.KINDS), in registration order."""
    from engine_stub.perturb.kinds import KINDS

    return tuple(KINDS)


def known_detectors() -> list[str]:
    """Every catalogued detector: the invariants by name, then `kv_canary.<reason>`."""
    return list(detector_catalogue.detector_names())


def profile_paths() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))}


# ---- field types a scenario adds to engine_stub.fields ---------------------------------------


class Knob(FieldType):
    """An engine knob: its value is EngineConfig's to check (when the loader builds it); the
    schema comes from the knob's default, choices and help."""

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.default = name, default

    def parse(self, value: Any, path: str, report: Report) -> Any:
        return value

    def schema(self) -> dict:
        choices = engine_config.CHOICES.get(self.name)
        if choices:
            return {"enum": [*choices, 0, 1, 2] if self.name == "invariant_check" else list(choices)}
        if self.name == "chunked_prefill_size":
            return {"oneOf": [{"enum": ["auto", "off"]}, {"type": "integer", "minimum": -1}]}
        for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number")):
            if isinstance(self.default, kind):
                return {"type": name}
        return {"type": "string"}


class PromptTokens(FieldType):
    """An integer, or [min, max] with 1 <= min <= max."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        pair = [value, value] if is_int(value) else value
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(x) for x in pair)):
            report(path, f"expected an integer or [min, max], got {value!r}")
            return INVALID
        if not 1 <= pair[0] <= pair[1]:
            report(path, f"needs 1 <= min <= max, got {value!r}")
            return INVALID
        return (pair[0], pair[1])

    def schema(self) -> dict:
        positive = {"type": "integer", "minimum": 1}
        return {"oneOf": [positive, {"type": "array", "items": positive, "minItems": 2,
                                     "maxItems": 2}]}


class Perturbations(FieldType):
    """The perturbation list, checked by the engine's own parser (each kind's params included)."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        return tuple(check_perturbations(value, report, path=path))

    def schema(self) -> dict:
        return {"type": "array", "items": item_schema()}


# ---- the tables ------------------------------------------------------------------------------


def _knob_fields() -> tuple[Field, ...]:
    return tuple(Field(name, Knob(name, f.default), f.default, engine_config.KNOB_HELP.get(name, ""))
                 for name, f in engine_knobs().items())


ENGINE = Table((
    Field("profile", Choice(lambda: tuple(profile_paths()), what="profile"), DEFAULT_PROFILE,
          "an engine profile of configs/engines (its knobs, under the scenario's own)"),
    *_knob_fields(),
))

class ExtraRequests(FieldType):
    """A list of explicit requests (the EXTRA_REQUEST table each), sent after the generated ones."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if not isinstance(value, list):
            report(path, f"expected a list of requests, got {type(value).__name__}")
            return INVALID
        items = []
        for i, item in enumerate(value):
            where = f"{path}[{i}]"
            parsed = EXTRA_REQUEST.parse(item, where, report)
            if parsed is INVALID:
                return INVALID
            if ("prompt_tokens" in parsed) == ("prompt_of" in parsed):
                report(where, "give exactly one of prompt_tokens (a fresh prompt) and prompt_of "
                              "(an earlier request's prompt)")
                return INVALID
            for key in ("keep_tokens", "with_answer"):
                if key in parsed and "prompt_of" not in parsed:
                    report(f"{where}.{key}", "only with prompt_of")
                    return INVALID
            items.append(parsed)
        return tuple(items)

    def schema(self) -> dict:
        return {"type": "array", "items": EXTRA_REQUEST.schema()}


# The answers a planned request may expect: served, or refused at admission as unservable.
PLANNED_STATUSES = (200, 400)


class Status(FieldType):
    """An HTTP status a planned request expects (one of PLANNED_STATUSES)."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if not is_int(value) or value not in PLANNED_STATUSES:
            report(path, f"expected one of {', '.join(map(str, PLANNED_STATUSES))}, got {value!r}")
            return INVALID
        return int(value)

    def schema(self) -> dict:
        return {"enum": list(PLANNED_STATUSES)}


EXTRA_REQUEST = Table((
    Field("prompt_tokens", Int(minimum=1), None,
          "a fresh prompt of this many tokens (starting with the shared prefix)"),
    Field("prompt_of", Int(minimum=0), None,
          "the prompt of an earlier request (its index: generated requests first, then these)"),
    Field("with_answer", Bool(), False,
          "with prompt_of: that prompt followed by its answer (a follow-up turn; sent once the "
          "answer is in)"),
    Field("keep_tokens", Int(minimum=1), None,
          "with prompt_of: only the first N tokens (of the prompt, or of prompt and answer)"),
    Field("append_tokens", Int(minimum=0), 0, "fresh tokens appended to the prompt"),
    Field("max_new_tokens", Int(minimum=1), None, "tokens it generates (default: the workload's)"),
    Field("status", Status(), 200,
          "the answer the engine must give: 200 (served) or 400 (refused as unservable)"),
    Field("min_cached_tokens", Int(minimum=1), None,
          "in a control: the radix cache must serve at least this many of its prompt tokens "
          "(a cache that silently stops hitting is a regression too)"),
    Field("hang_up_after_tokens", Int(minimum=1), None,
          "the client hangs up once the request has this many output tokens (below its "
          "max_new_tokens): the engine aborts it at the next step, the same step on every run"),
))

WORKLOAD = Table((
    Field("requests", Int(minimum=1), 8, "requests the driver sends, in rid order"),
    Field("concurrency", Int(minimum=1), 4, "requests the driver keeps in flight (at most this "
                                            "many run at once)"),
    Field("prompt_tokens", PromptTokens(), (24, 64), "prompt length: an integer or [min, max]"),
    Field("shared_prefix_tokens", Int(minimum=0), 0,
          "tokens every prompt shares at its start (below the shortest prompt)"),
    Field("max_new_tokens", Int(minimum=1), 48, "tokens each request generates"),
    Field("temperature", Number(minimum=0), 0.0, "sampling temperature (0: greedy)"),
    Field("unique_prompts", Bool(), False, "no two prompts alike"),
    Field("extra_requests", ExtraRequests(), (),
          "explicit requests sent after the generated ones, in order (a prompt of its own length, "
          "or an earlier request's prompt cut or extended; its own max_new_tokens; the answer "
          "expected)"),
))

_DETECTORS = known_detectors
DISABLED = Table((
    Field("reason", Text(non_empty=True), None, "why the check is off"),
    *_knob_fields(),
), extra={"required": ["reason"]})

EXPECT = Table((
    Field("clean", Bool(), False,
          "a control: no detector may fire and every output must match the no-cache oracle"),
    Field("fires", NameList(_DETECTORS, "detector", non_empty=True), (),
          "detectors that must fire after the first landing (canary list invariants)"),
    Field("any", Bool(), False,
          "with fires: one of them firing suffices (generated scenarios say this)"),
    Field("within_steps", Int(minimum=0), None,
          "steps from the first landing to each first firing, at most (with fires)"),
    Field("silent", NameList(_DETECTORS, "detector"), (), "detectors that must not fire"),
    Field("engine", Choice(ENGINE_OUTCOMES), None, "the engine crashes or survives"),
    Field("disabled", DISABLED, None,
          "a deliberately disabled check: the knobs in force and the reason"),
    Field("detected_by", NameList(_DETECTORS, "detector", non_empty=True), (),
          "with disabled: the detectors that still catch the damage"),
    Field("verdict", Choice(VERDICTS, what="verdict"), None,
          "a negative test: passes only with exactly this verdict"),
), extra={"oneOf": [
    {"required": ["clean"], "properties": {"clean": {"const": True}}},
    {"required": ["fires"]},
    {"required": ["disabled", "detected_by"]},
]})

def _regression_names() -> tuple[str, ...]:
    from canaries.regressions import catalogue  # plain data: no torch

    return tuple(sorted(catalogue()))


SCENARIO = Table((
    Field("name", Text(pattern=NAME_RE.pattern), None,
          "unique: reports, -k selection and signatures use it"),
    Field("description", Text(), "", "one line on what the scenario proves"),
    Field("seed", Int(minimum=0), 0, "same seed, same scenario: the same event trace"),
    Field("engine", ENGINE, None, "an engine profile and knob overrides"),
    Field("workload", WORKLOAD, None, "the requests the driver sends"),
    Field("perturbations", Perturbations(), (), "what to damage, when, and where "
                                                 "(canary list kinds)"),
    Field("expect", EXPECT, None, "what the suite must observe"),
    Field("regressions", NameList(_regression_names, "regression"), (),
          "catalogued regressions (canary mutate --catalogue --list) the engine runs with: the "
          "scenario judges a deliberately broken engine (a negative test)"),
), required=("name", "expect"))
