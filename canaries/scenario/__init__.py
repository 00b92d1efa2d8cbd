"""Scenario files: load, validate and resolve the YAML that describes one canary run.

A scenario names a seed, an engine (a profile from `configs/engines/` plus knob overrides), a
workload, the perturbations to inject and what the suite expects to see. Validation collects every
problem it can find and names the file, the line and the field of each; it never stops at the first.

    fields.py   the field table: every field once (type, default, bounds/choices, doc)
    model.py    Scenario, Workload, ExtraRequest, Expect, Disabled, Problem, ScenarioError
    yamldoc.py  YAML with line numbers, hostile files refused fast
    loader.py   file -> validated Scenario (cross-field checks, the EngineConfig, warnings)
    schema.py   the JSON Schema, generated from the field table

Torch-free: nothing here imports torch or an engine module that does.
"""

from canaries.scenario.fields import (
    DEFAULT_PROFILE,
    ENGINE_OUTCOMES,
    NAME_RE,
    PASSING,
    PROFILE_DIR,
    REPO_ROOT,
    SCENARIO_DIR,
    VERDICTS,
    engine_knobs,
    known_detectors,
    known_kinds,
)
from canaries.scenario.loader import (
    check_paths,
    discover,
    engine_spec,
    list_profiles,
    load_paths,
    load_scenario,
    validate_paths,
)
from canaries.scenario.model import (
    Disabled,
    Expect,
    ExtraRequest,
    Problem,
    Scenario,
    ScenarioError,
    Workload,
)
from canaries.scenario.schema import json_schema

__all__ = [
    "DEFAULT_PROFILE",
    "ENGINE_OUTCOMES",
    "NAME_RE",
    "PASSING",
    "PROFILE_DIR",
    "REPO_ROOT",
    "SCENARIO_DIR",
    "VERDICTS",
    "Disabled",
    "Expect",
    "ExtraRequest",
    "Problem",
    "Scenario",
    "ScenarioError",
    "Workload",
    "check_paths",
    "discover",
    "engine_knobs",
    "engine_spec",
    "json_schema",
    "known_detectors",
    "known_kinds",
    "list_profiles",
    "load_paths",
    "load_scenario",
    "validate_paths",
]
