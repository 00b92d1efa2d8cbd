"""Scenario files: loading, profile merging, and validation problems that name file, line, field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from canaries.scenario import (
    Problem,
    ScenarioError,
    discover,
    engine_spec,
    json_schema,
    known_detectors,
    known_kinds,
    list_profiles,
    load_scenario,
    validate_paths,
)

VALID = """\
name: strip-mapping-page1
description: free_swa meets a stripped peer on page_size 1
seed: 7
engine: {profile: cpu-tiny, window: 24, kv_canary: raise}
workload: {requests: 8, concurrency: 4, prompt_tokens: [24, 64], max_new_tokens: 48}
perturbations:
  - kind: strip_swa_mapping
    trigger: {event: window_cross, times: 1}
    target: {request: 0, positions: in_window}
expect:
  fires: [swa.peer_mapped]
  within_steps: 2
  silent: [swa.peer_released]
  engine: crashes
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path) -> list[Problem]:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return info.value.problems


def only(problems: list[Problem], field: str) -> Problem:
    hits = [p for p in problems if p.field == field]
    assert hits, f"no problem on {field}: {[str(p) for p in problems]}"
    return hits[0]


def test_load_valid_scenario_merges_profile_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    s = load_scenario(path)
    profile = list_profiles()["cpu-tiny"]
    assert s.name == "strip-mapping-page1" and s.seed == 7 and s.profile == "cpu-tiny"
    assert s.engine["window"] == 24  # overridden by the scenario
    assert s.engine["kv_canary"] == "raise"
    assert s.engine["swa_pool_tokens"] == profile["swa_pool_tokens"]  # from the profile
    assert s.engine["invariant_check"] == "strict"
    assert "profile" not in s.engine and s.engine["seed"] == 7
    assert s.workload.prompt_tokens == (24, 64)
    assert s.perturbations[0].kind == "strip_swa_mapping"
    assert s.perturbations[0].trigger.event == "window_cross"
    assert s.expect.fires == ("swa.peer_mapped",) and s.expect.within_steps == 2
    assert s.expect.engine == "crashes" and s.path == str(path)


def test_engine_spec_holds_flat_knobs_and_raw_perturbations(tmp_path: Path) -> None:
    spec = engine_spec(load_scenario(write(tmp_path, VALID)))
    assert spec["name"] == "strip-mapping-page1" and spec["seed"] == 7
    assert spec["engine"]["seed"] == 7 and spec["engine"]["window"] == 24
    assert "profile" not in spec["engine"] and "port" not in spec["engine"]
    assert spec["perturbations"] == [{
        "kind": "strip_swa_mapping",
        "trigger": {"event": "window_cross", "times": 1},
        "target": {"request": 0, "positions": "in_window"},
    }]


def test_load_default_profile_and_int_prompt_tokens_is_accepted(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, """\
        name: control-a
        workload: {prompt_tokens: 32}
        expect: {clean: true}
        """))
    assert s.profile == "cpu-tiny" and s.engine["device"] == "cpu"
    assert s.workload.prompt_tokens == (32, 32) and s.expect.clean and s.perturbations == ()


def test_load_unknown_top_level_key_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + "bogus: 1\n")
    p = only(problems_of(path), "bogus")
    assert p.file == str(path) and p.line == 15
    assert "valid keys" in p.message and "perturbations" in p.message
    assert str(p).startswith(f"{path}:15: bogus: ")


def test_load_unknown_engine_knob_is_reported_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("engine: {profile: cpu-tiny, window: 24, kv_canary: raise}",
                                         "engine:\n  profile: cpu-tiny\n  windw: 24"))
    p = only(problems_of(path), "engine.windw")
    assert p.line == 6 and "valid keys" in p.message and "window" in p.message


def test_load_bad_knob_value_is_reported_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("engine: {profile: cpu-tiny, window: 24, kv_canary: raise}",
                                         "engine:\n  profile: cpu-tiny\n  kv_canary: loud\n  page_size: 0"))
    problems = problems_of(path)
    assert only(problems, "engine.kv_canary").line == 6
    assert "off|log|raise" in only(problems, "engine.kv_canary").message
    assert only(problems, "engine.page_size").line == 7


def test_load_unknown_profile_lists_valid_profiles(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("profile: cpu-tiny", "profile: tpu-huge"))
    p = only(problems_of(path), "engine.profile")
    assert p.line == 4 and "cpu-tiny" in p.message and "cuda-small" in p.message


def test_load_unknown_kind_lists_valid_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("kind: strip_swa_mapping", "kind: strip_everything"))
    p = only(problems_of(path), "perturbations[0].kind")
    assert p.line == 7
    assert all(kind in p.message for kind in known_kinds())


def test_load_bad_trigger_event_lists_valid_events(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("event: window_cross", "event: full_moon"))
    p = only(problems_of(path), "perturbations[0].trigger.event")
    assert p.line == 8 and "window_cross" in p.message and "first_swa_eviction" in p.message


def test_load_bad_param_is_reported_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("    target: {request: 0, positions: in_window}\n",
                                         "    target: {request: 0, positions: in_window}\n    params: {byte: -1}\n"))
    p = only(problems_of(path), "perturbations[0].params.byte")
    assert p.line == 10 and ">= 0" in p.message


def test_load_unknown_detector_lists_valid_detectors(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("fires: [swa.peer_mapped]", "fires: [swa.peer_mappd]"))
    p = only(problems_of(path), "expect.fires[0]")
    assert p.line == 11 and "swa.peer_mapped" in p.message and "kv_canary.verify_chain_hash" in p.message


def test_load_clean_with_perturbations_is_a_conflict(tmp_path: Path) -> None:
    text = VALID[: VALID.index("expect:")] + "expect: {clean: true}\n"
    p = only(problems_of(write(tmp_path, text)), "perturbations")
    assert p.line == 6 and "clean" in p.message


def test_load_two_expect_modes_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("  engine: crashes\n", "  engine: crashes\n  clean: true\n"))
    p = only(problems_of(path), "expect")
    assert "exactly one" in p.message and p.line == 11


def test_load_disabled_knob_not_in_force_is_an_error(tmp_path: Path) -> None:
    text = VALID[: VALID.index("expect:")] + textwrap.dedent("""\
        expect:
          disabled: {invariant_check: off, reason: "peer released before free_swa"}
          detected_by: [kv_canary.verify_chain_hash]
        """)
    p = only(problems_of(write(tmp_path, text)), "expect.disabled.invariant_check")
    assert p.line == 11 and "'off'" in p.message and "'strict'" in p.message


def test_load_disabled_knob_in_force_is_accepted(tmp_path: Path) -> None:
    text = VALID[: VALID.index("expect:")] + textwrap.dedent("""\
        expect:
          disabled: {invariant_check: off, reason: "peer released before free_swa"}
          detected_by: [kv_canary.verify_chain_hash]
        """)
    text = text.replace("kv_canary: raise}", "kv_canary: raise, invariant_check: off}")
    s = load_scenario(write(tmp_path, text))
    assert s.engine["invariant_check"] == "off"
    assert s.expect.disabled is not None and s.expect.disabled.checks == {"invariant_check": "off"}
    assert s.expect.detected_by == ("kv_canary.verify_chain_hash",)


def test_load_disabled_without_reason_is_an_error(tmp_path: Path) -> None:
    text = VALID[: VALID.index("expect:")] + textwrap.dedent("""\
        expect:
          disabled: {invariant_check: off}
          detected_by: [kv_canary.verify_chain_hash]
        """)
    text = text.replace("kv_canary: raise}", "kv_canary: raise, invariant_check: off}")
    assert only(problems_of(write(tmp_path, text)), "expect.disabled.reason").line == 11


def test_load_yaml_syntax_error_reports_parser_line(tmp_path: Path) -> None:
    path = write(tmp_path, "name: broken\nexpect:\n  fires: [a, b\n  silent: c\n")
    problems = problems_of(path)
    assert len(problems) == 1
    assert problems[0].line == 4 and "YAML syntax error" in problems[0].message
    assert str(problems[0]).startswith(f"{path}:4: ")


def test_load_reports_every_problem_not_just_the_first(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        name: Bad Name
        seed: -1
        workload: {requests: 0, concurrency: 0, prompt_tokens: [64, 24]}
        expect: {fires: [swa.peer_mapped]}
        """)
    fields = {p.field for p in problems_of(path)}
    assert {"name", "seed", "workload.requests", "workload.concurrency",
            "workload.prompt_tokens", "perturbations"} <= fields


def test_scenario_error_lists_one_problem_per_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + "bogus: 1\nworse: 2\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{path}:") for line in lines)


def test_validate_paths_finds_duplicate_names(tmp_path: Path) -> None:
    write(tmp_path, VALID, "a.yaml")
    write(tmp_path, VALID, "b.yaml")
    problems = validate_paths([tmp_path])
    assert len(problems) == 1
    assert problems[0].field == "name" and problems[0].file.endswith("b.yaml")
    assert "duplicate" in problems[0].message and "a.yaml" in problems[0].message


def test_validate_paths_on_valid_files_is_empty(tmp_path: Path) -> None:
    write(tmp_path, VALID, "a.yaml")
    write(tmp_path, VALID.replace("strip-mapping-page1", "other"), "b.yaml")
    assert validate_paths([tmp_path]) == []
    assert [p.name for p in discover([tmp_path])] == ["a.yaml", "b.yaml"]


def test_profiles_validate_and_hold_only_engine_knobs() -> None:
    profiles = list_profiles()
    assert {"cpu-tiny", "cuda-small"} <= set(profiles)
    assert profiles["cpu-tiny"]["device"] == "cpu" and profiles["cuda-small"]["device"] == "cuda"


def test_shipped_scenarios_validate() -> None:
    assert [str(p) for p in validate_paths(discover())] == []


def test_known_detectors_include_invariants_and_canary_reasons() -> None:
    detectors = known_detectors()
    assert "swa.peer_mapped" in detectors and "kv_canary.verify_chain_hash" in detectors


def test_json_schema_has_every_top_level_key() -> None:
    schema = json_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    assert set(schema["properties"]) == {"name", "description", "seed", "engine", "workload",
                                         "perturbations", "expect"}
    assert schema["additionalProperties"] is False
    assert "window" in schema["properties"]["engine"]["properties"]
    assert "strip_swa_mapping" in schema["properties"]["perturbations"]["items"]["properties"]["kind"]["enum"]


def test_json_schema_accepts_valid_and_rejects_unknown_keys() -> None:
    import jsonschema
    import yaml

    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    doc = yaml.safe_load(VALID)
    assert list(validator.iter_errors(doc)) == []
    assert list(validator.iter_errors({**doc, "bogus": 1}))
    assert list(validator.iter_errors({**doc, "expect": {"clean": True, "fires": ["swa.peer_mapped"]}}))
