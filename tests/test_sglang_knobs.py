"""SGLang's own perturbation knobs as a placement of the project's kinds (`via: sglang_knob`):
what the launcher sets, what it refuses with the field named, how each knob line becomes the
scenario's landing, and that every other runtime refuses them. No SGLang needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canaries.runner import run_scenario
from canaries.scenario import load_scenario
from canaries.sglang.server.knobs import KNOB_INDEX_ENV, knob_env, knob_refusals, landing_of_line
from engine_stub.perturb.loader import load_engine_scenario
from engine_stub.perturb.spec import SpecError, parse_perturbations

REPO = Path(__file__).resolve().parents[1]
KNOBS = REPO / "configs" / "scenarios" / "sglang-knobs"


def _specs(*items: dict) -> list:
    return parse_perturbations(list(items))


def test_knob_env_sets_the_probability_warmup_group_and_the_plugins_index() -> None:
    specs = _specs({"kind": "strip_swa_mapping"},
                   {"kind": "flip_kv_byte", "via": "sglang_knob", "trigger": {"probability": 0.5},
                    "target": {"group": "swa", "request": "cached"}})
    assert knob_refusals(specs, {"kv_canary": "log"}) == []
    assert knob_env(specs) == {
        "SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB": "0.5",
        "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "0",  # SGLang's own default is 50
        "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "swa",
        KNOB_INDEX_ENV: json.dumps({"real_kv_unused_cache": 1}),
    }


@pytest.mark.parametrize(("item", "engine", "field", "named"), [
    ({"kind": "swap_next_token", "via": "sglang_knob"}, {"kv_canary": "log"}, "perturbations[0].via", "token-oracle"),
    ({"kind": "corrupt_req_to_token", "via": "sglang_knob", "target": {"value": "zero"}}, {"kv_canary": "log"},
     "perturbations[0].target.value", "other_live_slot"),
    ({"kind": "corrupt_req_to_token", "via": "sglang_knob", "target": {"positions": "in_window"}},
     {"kv_canary": "log"}, "perturbations[0].target.positions", "picks its own target"),
    ({"kind": "flip_kv_byte", "via": "sglang_knob", "trigger": {"event": "request_finish"}}, {"kv_canary": "log"},
     "perturbations[0].trigger.event", "probability per forward step"),
    ({"kind": "corrupt_req_to_token", "via": "sglang_knob"}, {"kv_canary": "off"}, "engine.kv_canary", "KV canary"),
])
def test_knob_refusals_name_the_field_sglangs_knob_cannot_honour(item, engine, field, named) -> None:
    found = knob_refusals(_specs(item), engine)
    assert [where for where, _ in found] == [field]
    assert named in found[0][1]


def test_knob_refusals_of_two_perturbations_on_one_knob_name_the_second() -> None:
    item = {"kind": "corrupt_req_to_token", "via": "sglang_knob"}
    (found,) = knob_refusals(_specs(item, item), {"kv_canary": "log"})
    assert found[0] == "perturbations[1].via" and "perturbations[0]" in found[1]


def test_landing_of_a_kv_byte_knob_line_is_the_scenarios_landing_with_its_damage() -> None:
    line = ("kv_canary perturb real_kv_used: group=SWA source_idx=1 slot=57 row=12 col=0 "
            "original_byte=0x1F new_byte=0xE0")
    landing = landing_of_line(line, step=9, indices={"real_kv_used": 2})
    assert landing["index"] == 2 and landing["perturbation"] == "flip_kv_byte" and landing["step"] == 9
    assert landing["damage"] == [{"kind": "kv_bytes", "pool": "swa", "slot": 57, "pool_row": 12, "before": 0x1F,
                                  "after": 0xE0, "detail": "sglang_perturb real_kv_used source 1 byte 0"}]
    # a knob no perturbation asked for, and SGLang's skip lines, land nothing
    assert landing_of_line(line, step=9, indices={"req_to_token": 0}) is None
    assert landing_of_line("kv_canary perturb real_kv_used: skipped because no active slot was found for "
                           "group=SWA", step=9, indices={"real_kv_used": 0}) is None


def test_engine_refuses_a_knob_perturbation_naming_its_field(tmp_path) -> None:
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"perturbations": [{"kind": "corrupt_req_to_token", "via": "sglang_knob"}]}))
    with pytest.raises(SpecError, match=r"perturbations\[0\]\.via"):
        load_engine_scenario(scenario)
    _, perturber = load_engine_scenario(scenario, sglang_knobs=True)
    assert perturber is not None and perturber.armed == []  # SGLang's knob does it, never our kind


def test_run_of_a_knob_scenario_on_our_engine_is_refused_as_unsupported(tmp_path) -> None:
    from canaries.sglang.parity import UNSUPPORTED_NOTE, unsupported_reason

    record = run_scenario(load_scenario(KNOBS / "knob-real-kv-used.yaml"), tmp_path / "run")
    assert record.verdict == "INCONCLUSIVE"
    assert "perturbations[0].via: sglang_knob" in record.reason
    assert (tmp_path / "run" / UNSUPPORTED_NOTE).is_file()
    assert "only SGLang's server runs it" in unsupported_reason(tmp_path / "run")


def test_library_knob_scenarios_validate_for_the_server_runtime() -> None:
    from canaries.runner import spec_for
    from canaries.sglang.runtime import spec_refusals

    paths = sorted(KNOBS.glob("*.yaml"))
    assert len(paths) == 3
    for path in paths:
        assert spec_refusals(spec_for(load_scenario(path), None, None)) == [], path.name


def test_validate_for_our_engine_names_the_knob_field_at_its_line(capsys) -> None:
    from canaries.cli import main

    assert main(["validate", str(KNOBS / "knob-real-kv-used.yaml")]) == 1
    out = capsys.readouterr().out
    assert "knob-real-kv-used.yaml:8: perturbations[0].via: --runtime local: sglang_knob" in out
    assert main(["validate", "--runtime", "sglang-server", str(KNOBS / "knob-real-kv-used.yaml")]) == 0
