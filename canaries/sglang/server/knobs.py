"""SGLang's own perturbation knobs as a placement of the project's kinds (`via: sglang_knob`).

SGLang's KV canary carries perturbations of its own, switched on by environment variables
(`SGLANG_KV_CANARY_PERTURB_*`, `kv_canary/perturb/`): each draws its probability at every forward
step after a warmup, picks its own target among the live state, and logs one line per landing.
A scenario perturbation written `via: sglang_knob` asks SGLang's knob to do what the kind says,
instead of the project's plugin; the launcher sets the knob's variables (`knob_env`), the
scheduler plugin turns each landing line into the project's landing event with its damage
(`landing_of_line`), so NOT_INJECTED keeps its meaning. What a knob cannot express is refused with
the field named (`knob_refusals`); only SGLang's server has the knobs (the engine refuses them).

    kind                               SGLang's knob (its log line's name)
    corrupt_req_to_token               SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB (req_to_token)
    flip_kv_byte                       SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB (real_kv_used)
    flip_kv_byte, request: cached      SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB
                                       (real_kv_unused_cache)

SGLang's draws are its own (`torch.randint`, unseeded by the scenario): which entry a knob hits
is recorded from its line, not chosen by the scenario.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_stub.perturb.spec import PerturbationSpec, TargetSpec, TriggerSpec

__all__ = ["KNOB_INDEX_ENV", "Knob", "knob_env", "knob_of", "knob_refusals", "landing_of_line"]

# {knob name: the index of the scenario's perturbation it carries out}, JSON, for the plugin.
KNOB_INDEX_ENV = "CANARY_SERVER_KNOB_INDEX"
_PREFIX = "SGLANG_KV_CANARY_PERTURB_"


@dataclass(frozen=True)
class Knob:
    """One of SGLang's perturbation knobs: its name in its log lines and its probability variable."""

    name: str
    probability_env: str
    needs_group: bool  # reads SGLANG_KV_CANARY_PERTURB_TARGET_GROUP (full | swa)


REQ_TO_TOKEN = Knob("req_to_token", _PREFIX + "REQ_TO_TOKEN_PROB", needs_group=False)
REAL_KV_USED = Knob("real_kv_used", _PREFIX + "REAL_KV_USED_PROB", needs_group=True)
REAL_KV_UNUSED_CACHE = Knob("real_kv_unused_cache", _PREFIX + "REAL_KV_UNUSED_CACHE_PROB", needs_group=True)

# Why a kind has no knob (SGLang 0.5.23, kv_canary/perturb/).
_NO_KNOB = {
    "swap_next_token": "SGLang's next_token_swap knob runs only inside its token-oracle sampler "
                       "(kv_canary/token_oracle/sampler.py, --sampling-backend token_oracle), which "
                       "replaces the model's tokens; the launcher samples with the model",
}


def knob_of(spec: PerturbationSpec) -> Knob | None:
    """The knob that does what `spec`'s kind does, or None."""
    if spec.kind == "corrupt_req_to_token":
        return REQ_TO_TOKEN
    if spec.kind == "flip_kv_byte":
        return REAL_KV_UNUSED_CACHE if spec.target.request == "cached" else REAL_KV_USED
    return None


def _target_refusals(spec: PerturbationSpec, path: str) -> list[tuple[str, str]]:
    given = TargetSpec(request=spec.target.request, positions=spec.target.positions,
                       group=spec.target.group, value=spec.target.value, count=spec.target.count)
    allowed = {"group"} if spec.kind == "flip_kv_byte" else set()
    if spec.kind == "flip_kv_byte" and given.request == "cached":
        allowed.add("request")
    if spec.kind == "corrupt_req_to_token" and given.value != "other_live_slot":
        return [(f"{path}.target.value", f"{given.value}: SGLang's req_to_token knob writes another live "
                                          "entry's slot only (other_live_slot)")]
    default = TargetSpec()
    return [(f"{path}.target.{name}", f"SGLang's knob picks its own target among the live state; "
                                      f"only {', '.join(sorted(allowed)) or 'nothing'} can be chosen here")
            for name in ("request", "positions", "group", "count")
            if name not in allowed and getattr(given, name) != getattr(default, name)]


def _trigger_refusals(spec: PerturbationSpec, path: str) -> list[tuple[str, str]]:
    default = TriggerSpec()
    return [(f"{path}.trigger.{name}", "SGLang's knob has a probability per forward step and a warmup "
                                       f"({_PREFIX}WARMUP_STEPS) only; it lands at every step its draw allows")
            for name in ("at_step", "after_step", "event", "interval", "times")
            if getattr(spec.trigger, name) != getattr(default, name)]


def knob_refusals(specs: list[PerturbationSpec], engine: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field path, why) for each `via: sglang_knob` perturbation SGLang's knobs cannot carry out
    as written; empty: `knob_env` expresses them all."""
    found: list[tuple[str, str]] = []
    warmups: set[int] = set()
    groups: set[str] = set()
    used: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.via != "sglang_knob":
            continue
        path = f"perturbations[{i}]"
        knob = knob_of(spec)
        if knob is None:
            why = _NO_KNOB.get(spec.kind, "no SGLang knob does this kind")
            found.append((f"{path}.via", f"sglang_knob: {spec.kind}: {why}"))
            continue
        if knob.name in used:
            found.append((f"{path}.via", f"sglang_knob: perturbations[{used[knob.name]}] already uses SGLang's "
                                         f"{knob.name} knob (one variable per knob)"))
        used.setdefault(knob.name, i)
        found += _target_refusals(spec, path) + _trigger_refusals(spec, path)
        warmups.add(spec.trigger.warmup_steps)
        if knob.needs_group:
            groups.add(spec.target.group)
    if used and str(engine.get("kv_canary", "off")) == "off":
        found.append(("engine.kv_canary", "off: SGLang's perturbation knobs live in its KV canary "
                                          "(kv_canary/runner/canary_manager.py); turn it on (log or raise)"))
    if len(warmups) > 1:
        found.append(("perturbations", f"SGLang's knobs share one warmup ({_PREFIX}WARMUP_STEPS); "
                                       f"these ask for {sorted(warmups)}"))
    if len(groups) > 1:
        found.append(("perturbations", f"SGLang's KV-byte knobs share one group ({_PREFIX}TARGET_GROUP); "
                                       f"these ask for {sorted(groups)}"))
    return found


def knob_env(specs: list[PerturbationSpec]) -> dict[str, str]:
    """The variables that switch SGLang's knobs on for the `via: sglang_knob` perturbations
    (checked by `knob_refusals` first), and the plugin's map of knob to perturbation index."""
    env: dict[str, str] = {}
    index: dict[str, int] = {}
    for i, spec in enumerate(specs):
        knob = knob_of(spec) if spec.via == "sglang_knob" else None
        if knob is None:
            continue
        env[knob.probability_env] = repr(float(spec.trigger.probability))
        # SGLang's default warmup is 50 steps: the scenario's own (default 0) always goes in.
        env[_PREFIX + "WARMUP_STEPS"] = str(spec.trigger.warmup_steps)
        if knob.needs_group:
            env[_PREFIX + "TARGET_GROUP"] = spec.target.group
        index[knob.name] = i
    if index:
        env[KNOB_INDEX_ENV] = json.dumps(index, sort_keys=True)
    return env


# `kv_canary perturb req_to_token: req_pool_idx=4 position=2 original_slot=3 new_slot=1`
_R2T_RE = re.compile(r"kv_canary perturb req_to_token: req_pool_idx=(?P<row>\d+) position=(?P<position>\d+) "
                     r"original_slot=(?P<before>-?\d+) new_slot=(?P<after>-?\d+)")
# `kv_canary perturb real_kv_used: group=SWA source_idx=0 slot=12 row=12 col=3 original_byte=0x1F
# new_byte=0xE0` (real_kv_unused_cache: the same fields)
_KV_BYTE_RE = re.compile(r"kv_canary perturb (?P<knob>real_kv_used|real_kv_unused_cache): group=(?P<group>\w+) "
                         r"source_idx=(?P<source>\d+) slot=(?P<slot>-?\d+) row=(?P<row>-?\d+) col=(?P<col>\d+) "
                         r"original_byte=0x(?P<before>[0-9A-Fa-f]+) new_byte=0x(?P<after>[0-9A-Fa-f]+)")


def landing_of_line(line: str, *, step: int, indices: Mapping[str, int]) -> dict | None:
    """The landing one of SGLang's knob lines records, as the project's landing event of the
    scenario perturbation `indices[knob]`, with its damage in the engine's terms; None for any
    other line, or a knob no perturbation asked for."""
    match = _R2T_RE.search(line)
    if match is not None and "req_to_token" in indices:
        row, position = int(match["row"]), int(match["position"])
        before, after = int(match["before"]), int(match["after"])
        return {"kind": "perturbation_landed", "index": indices["req_to_token"],
                "perturbation": "corrupt_req_to_token", "site": "sglang:kv_canary_perturb", "step": step,
                "row": row, "position": position, "before": before, "after": after,
                "damage": [{"kind": "req_to_token", "position": position, "row": row, "before": before,
                            "after": after, "detail": "sglang_perturb"}]}
    match = _KV_BYTE_RE.search(line)
    if match is not None and match["knob"] in indices:
        group = match["group"].lower()
        slot, row, col = int(match["slot"]), int(match["row"]), int(match["col"])
        before, after = int(match["before"], 16), int(match["after"], 16)
        return {"kind": "perturbation_landed", "index": indices[match["knob"]], "perturbation": "flip_kv_byte",
                "site": "sglang:kv_canary_perturb", "step": step, "slot": slot, "pool_row": row,
                "group": group, "byte": col, "before": before, "after": after,
                "damage": [{"kind": "kv_bytes", "pool": group, "slot": slot, "pool_row": row,
                            "before": before, "after": after,
                            "detail": f"sglang_perturb {match['knob']} source {match['source']} byte {col}"}]}
    return None
