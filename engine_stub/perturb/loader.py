"""Load the engine's part of a scenario: its engine knobs and its perturbations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from engine_stub.perturb.perturber import Perturber
from engine_stub.perturb.spec import SpecError, parse_perturbations

__all__ = ["load_engine_scenario"]


def load_engine_scenario(path: str | Path, *, sglang_knobs: bool = False) -> tuple[dict[str, Any], Perturber | None]:
    """(engine knob overrides, perturber or None) from a scenario file (YAML or JSON).

    The engine's process boundary: the knobs are validated once, by `config_from_sources` in
    `__main__`, and the perturbations here (a SpecError names the first bad field). Reads
    `seed`, `engine` (flat knobs; a `profile` key is the canary suite's business and must be
    resolved before the engine sees the file) and `perturbations`; other keys are ignored.
    `sglang_knobs`: accept perturbations `via: sglang_knob` (SGLang's server: its knob does
    them, the perturber leaves them alone); elsewhere they are a SpecError.
    """
    text = Path(path).read_text(encoding="utf-8")
    raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a scenario must be a mapping")
    engine = dict(raw.get("engine") or {})
    if "profile" in engine:
        raise ValueError(f"{path}: engine.profile must be resolved by the canary suite (use canary run)")
    if "seed" in raw:
        engine.setdefault("seed", raw["seed"])
    specs = parse_perturbations(raw.get("perturbations"))
    for i, spec in enumerate(specs):
        if spec.via != "engine" and not sglang_knobs:
            raise SpecError(f"perturbations[{i}].via", f"{spec.via}: SGLang's own perturbation knob; only "
                                                       "SGLang's server runs it (canary run --runtime sglang-server)")
    perturber = Perturber(specs, int(engine.get("seed", 0))) if specs else None
    return engine, perturber
