"""Scenario files: loading, profile merging, and validation problems that name file, line, field."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
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

REPO = Path(__file__).resolve().parents[1]

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
    assert s.engine.window == 24  # overridden by the scenario
    assert s.engine.kv_canary == "raise"
    assert s.engine.swa_pool_tokens == profile["swa_pool_tokens"]  # from the profile
    assert s.engine.invariant_check == "strict"
    assert "profile" not in s.engine_knobs and s.engine.seed == 7
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
    assert s.profile == "cpu-tiny" and s.engine.device == "cpu"
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
    # Params are per kind, checked against the kind's declaration: flip_kv_byte declares byte.
    path = write(tmp_path, VALID.replace("    target: {request: 0, positions: in_window}\n",
                                         "    target: {request: 0, positions: in_window}\n    params: {byte: -1}\n")
                 .replace("kind: strip_swa_mapping", "kind: flip_kv_byte"))
    p = only(problems_of(path), "perturbations[0].params.byte")
    assert p.line == 10 and ">= 0" in p.message


def test_load_param_the_kind_does_not_declare_is_an_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("    target: {request: 0, positions: in_window}\n",
                                         "    target: {request: 0, positions: in_window}\n    params: {byte: 1}\n"))
    p = only(problems_of(path), "perturbations[0].params.byte")
    assert p.line == 10 and "unknown key 'byte'" in p.message


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
    assert s.engine.invariant_check == "off"
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
                                         "perturbations", "expect", "regressions"}
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


# ---- hostile files: refused fast, as problems, never a traceback ------------------------------

MEMORY_LIMIT = 1536 * 2**20  # the address space a hostile file gets to fail in


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The "billion laughs": each level a list of `width` aliases of the one before."""
    names = [chr(ord("a") + i) for i in range(levels)]
    items = ", ".join(['"x"'] * width)
    lines = [f"{names[0]}: &{names[0]} [{items}]"]
    for prev, name in zip(names, names[1:], strict=False):
        items = ", ".join([f"*{prev}"] * width)
        lines.append(f"{name}: &{name} [{items}]")
    return "\n".join(lines) + "\n"


def _run_limited(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose address space is capped at MEMORY_LIMIT."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, preexec_fn=cap, check=False)


TIMED_VALIDATE = """\
import json, sys, time
from canaries.scenario import known_detectors, validate_paths
known_detectors()  # the registries load once per process: not the file's cost
t0 = time.perf_counter()
problems = validate_paths([sys.argv[1]])
print(json.dumps({"seconds": time.perf_counter() - t0, "problems": [str(p) for p in problems]}))
"""


def test_validate_alias_bomb_is_refused_within_a_second_under_a_memory_cap(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\nexpect: {clean: true}\n" + alias_bomb())
    assert path.stat().st_size < 1024
    proc = _run_limited(TIMED_VALIDATE, str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["seconds"] < 1.0, result
    assert any(re.match(rf"{re.escape(str(path))}:\d+: \S+: .*alias", p)
               for p in result["problems"]), result["problems"]


@pytest.mark.parametrize(("command", "exit_code"), [("validate", 1), ("run", 2)])
def test_cli_alias_bomb_is_a_problem_not_a_traceback(tmp_path: Path, command: str,
                                                     exit_code: int) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\nexpect: {clean: true}\n" + alias_bomb())
    proc = _run_limited("import sys; from canaries.cli import main; sys.exit(main(sys.argv[1:]))",
                        command, str(path), "--report-dir" if command == "run" else "",
                        str(tmp_path / "report") if command == "run" else "")
    text = proc.stdout + proc.stderr
    assert proc.returncode == exit_code, text[-2000:]
    assert "Traceback" not in text and f"{path}:" in text and "alias" in text


def test_load_few_aliases_expanding_past_the_node_limit_are_refused(tmp_path: Path) -> None:
    # Under the alias limit, yet 30 copies of a 100-item list: refused by its expanded size.
    path = write(tmp_path, "name: wide\nexpect: {clean: true}\nbase: &a [" + ", ".join(["x"] * 100)
                 + "]\ncopies: [" + ", ".join(["*a"] * 30) + "]\n")
    problem = only(problems_of(path), "<yaml>")
    assert problem.line == 4 and "expand" in problem.message


def test_load_recursive_alias_is_a_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "name: loop\nexpect: {clean: true}\nloop: &a [*a]\n")
    problem = only(problems_of(path), "<yaml>")
    assert problem.line == 3 and "alias" in problem.message


def test_load_deep_nesting_is_a_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "name: deep\nexpect: {clean: true}\ndeep: " + "[" * 5000 + "]" * 5000
                 + "\n")
    problem = only(problems_of(path), "<yaml>")
    assert problem.line == 3 and "nest" in problem.message


def test_load_file_over_the_size_limit_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "huge.yaml"
    with open(path, "w", encoding="utf-8") as f:
        f.write(VALID)
        f.write(("# padding " + "x" * 90 + "\n") * 50_000)  # 5 MB of comments: valid YAML
    assert path.stat().st_size > 5_000_000

    def no_full_read(self, *args, **kwargs):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(Path, "read_text", no_full_read)
    monkeypatch.setattr(Path, "read_bytes", no_full_read)
    problem = only(problems_of(path), "<file>")
    assert problem.line == 1 and "bytes" in problem.message
    assert str(problem).startswith(f"{path}:1: <file>: ")


def test_load_non_utf8_file_names_line_and_column_of_the_bad_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(VALID.replace("free_swa meets", "caf\xe9 meets").encode("latin-1"))
    problem = only(problems_of(path), "<file>")
    assert problem.line == 2 and "column 17" in problem.message and "UTF-8" in problem.message
    assert str(problem).startswith(f"{path}:2: ")


def test_load_control_character_is_a_problem_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\ndescription: bell\x07\nexpect: {clean: true}\n")
    problem = only(problems_of(path), "<yaml>")
    assert problem.line == 2 and "#x0007" in problem.message


def test_problem_with_line_breaks_prints_as_complete_lines() -> None:
    problem = Problem("s.yaml", 3, "engine.a\rb", "first\nsecond\r\u2028third\n")
    text = str(problem)
    lines = text.split("\n")
    assert lines[0].startswith("s.yaml:3: ") and all(ln.startswith("    ") for ln in lines[1:])
    assert not any(ch in text for ch in "\r\u2028") and not text.endswith("\n")


def test_cli_validate_prints_each_problem_on_lines_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "a-syntax.yaml").write_text("name: bad\nexpect: {clean: true\n")
    (tmp_path / "b-key.yaml").write_text('name: bad2\n"bo\\rgus": 1\nexpect: {clean: true}\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "validate", str(tmp_path)],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          timeout=60, check=False)
    lines = proc.stdout.decode("utf-8").split("\n")
    assert proc.returncode == 1
    assert lines[-2:] == ["2 problem(s) in 2 file(s)", ""], lines
    assert all(line.startswith(f"{tmp_path}/") or line.startswith("    ")
               for line in lines[:-2]), lines


# ---- one field table: the validator and the schema agree; the engine config once -----------


@pytest.mark.parametrize("path", discover(), ids=lambda p: p.stem)
def test_json_schema_accepts_every_library_scenario(path: Path) -> None:
    import jsonschema

    from canaries.scenario.yamldoc import read_doc

    # Read as the suite reads it (YAML 1.2 booleans: `off` stays a string, as in editors).
    jsonschema.Draft202012Validator(json_schema()).validate(read_doc(path).data)


def test_json_schema_takes_each_kinds_params_from_its_declaration() -> None:
    import jsonschema
    import yaml

    validator = jsonschema.Draft202012Validator(json_schema())
    doc = yaml.safe_load(VALID)
    flip = {"kind": "flip_kv_byte", "params": {"byte": 3}}
    assert not list(validator.iter_errors({**doc, "perturbations": [flip]}))
    for bad in ({**flip, "params": {"byte": -1}}, {**flip, "params": {"extra_tokens": 2}},
                {"kind": "strip_swa_mapping", "params": {"byte": 3}}):
        assert list(validator.iter_errors({**doc, "perturbations": [bad]})), bad


def test_scenario_engine_is_the_engine_config_the_engine_process_builds(tmp_path: Path) -> None:
    from engine_stub.config import EngineConfig, config_from_sources

    s = load_scenario(write(tmp_path, VALID))
    assert isinstance(s.engine, EngineConfig)
    spec = json.loads(json.dumps(engine_spec(s)))  # as spec.json carries it
    engine_side = config_from_sources(environ={}, overrides=spec["engine"])
    assert {k: getattr(engine_side, k) for k in s.engine_knobs} == s.engine_knobs


@pytest.mark.parametrize("positions", ["[3, 9]", "{from: 3, to: 9}"])
def test_load_positions_as_yaml_range(tmp_path: Path, positions: str) -> None:
    s = load_scenario(write(tmp_path, VALID.replace("positions: in_window",
                                                    f"positions: {positions}")))
    assert s.perturbations[0].target.positions == (3, 9)


def test_load_retained_unread_is_a_position_word(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, VALID.replace("in_window", "retained_unread")))
    assert s.perturbations[0].target.positions == "retained_unread"


# ---- warnings ------------------------------------------------------------------------------


def test_request_index_beyond_the_concurrency_is_a_warning_not_a_problem(tmp_path: Path) -> None:
    from canaries.scenario import check_paths

    path = write(tmp_path, VALID.replace("target: {request: 0,", "target: {request: 4,"))
    problems, warnings = check_paths([path])
    assert problems == [] and load_scenario(path).warnings == tuple(warnings)
    (warning,) = warnings
    assert (warning.line, warning.field) == (9, "perturbations[0].target.request")
    assert "at most 4 run at once" in warning.message and "rid order" in warning.message
    assert str(warning).startswith(f"{path}:9: perturbations[0].target.request: warning: ")
    assert check_paths([write(tmp_path, VALID, "ok.yaml")]) == ([], [])


def test_cli_validate_prints_the_warning_and_exits_zero(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("target: {request: 0,", "target: {request: 7,"))
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "validate", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{path}:9: perturbations[0].target.request: warning: request 7 can never be picked: "
        "requests are picked among the running ones in rid order, and at most 4 run at once "
        "(workload.concurrency 4); use an index below 4",
        "1 scenarios OK (1 warning(s))"]


def test_readme_scenario_example_is_valid(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    example = text.split("### Writing a new scenario", 1)[1].split("```yaml\n", 1)[1]
    path = write(tmp_path, example.split("```", 1)[0])
    assert load_scenario(path).name == "strip-mapping-page1"
