"""EngineConfig: precedence of the sources, errors that name the knob and its source, --help."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine_stub.__main__ import build_parser, main
from engine_stub.config import KNOB_HELP, ConfigError, EngineConfig, config_from_sources

KNOBS = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "sources"]


def _env(name: str) -> str:
    return "ENGINE_STUB_" + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize(
    ("env", "flags", "overrides", "expected", "source"),
    [
        ({}, {}, {}, 16, "default"),
        ({"ENGINE_STUB_WINDOW": "12"}, {}, {}, 12, "ENGINE_STUB_WINDOW"),
        ({"ENGINE_STUB_WINDOW": "12"}, {"window": "10"}, {}, 10, "--window"),
        ({"ENGINE_STUB_WINDOW": "12"}, {"window": "10"}, {"window": 24}, 24, "scenario"),
        ({}, {"window": None}, {}, 16, "default"),  # an unset flag defers
        ({"ENGINE_STUB_WINDOW": ""}, {}, {}, 16, "default"),  # an empty variable is unset
        ({}, {}, {"window": 24}, 24, "scenario"),
        ({"ENGINE_STUB_WINDOW": "12"}, {}, {"window": 24}, 24, "scenario"),
    ],
)
def test_sources_apply_in_precedence_order(
    env: dict[str, str], flags: dict[str, Any], overrides: dict[str, Any], expected: int, source: str
) -> None:
    config = config_from_sources(flags=flags, environ=env, overrides=overrides)
    assert config.window == expected
    assert config.sources.get("window", "default") == source


def test_each_knob_keeps_its_own_source() -> None:
    config = config_from_sources(
        environ={"ENGINE_STUB_PAGE_SIZE": "2", "ENGINE_STUB_SEED": "9", "ENGINE_STUB_KV_CANARY": "LOG"},
        flags={"seed": "5", "radix_cache": "false"},
        overrides={"invariant_check": 2},
        overrides_source="configs/scenarios/x.yaml",
    )
    assert (config.page_size, config.seed, config.kv_canary, config.radix_cache, config.invariant_check) == (
        2, 5, "log", False, "strict")
    assert dict(config.sources) == {
        "page_size": "ENGINE_STUB_PAGE_SIZE", "kv_canary": "ENGINE_STUB_KV_CANARY",
        "seed": "--seed", "radix_cache": "--radix-cache", "invariant_check": "configs/scenarios/x.yaml",
    }
    assert config.knobs()["seed"] == 5 and "sources" not in config.knobs()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("Off", False)],
)
def test_boolean_knob_accepts_usual_spellings(raw: str, expected: bool) -> None:
    assert config_from_sources(environ={"ENGINE_STUB_RADIX_CACHE": raw}).radix_cache is expected


@pytest.mark.parametrize(("raw", "expected"), [("0", "off"), ("1", "warn"), ("2", "strict"), ("WARN", "warn")])
def test_invariant_check_accepts_numeric_levels(raw: str, expected: str) -> None:
    assert config_from_sources(environ={"ENGINE_STUB_INVARIANT_CHECK": raw}).invariant_check == expected


# One bad value per knob that can be wrong (host and event_log are free-form strings).
BAD_VALUES: list[tuple[str, Any]] = [
    ("device", "tpu"),
    ("page_size", "0"),
    ("page_size", "two"),
    ("window", "-3"),
    ("full_pool_tokens", "0"),
    ("full_pool_tokens", "100"),  # below max_context_len
    ("swa_pool_tokens", "abc"),
    ("swa_pool_tokens", "16"),  # no room for one window plus two pages
    ("swa_pool_tokens", "4096"),  # above full_pool_tokens
    ("layer_pattern", "FXS"),
    ("layer_pattern", "fs"),
    ("max_running_requests", "0"),
    ("max_context_len", "99999"),
    ("max_prefill_tokens", "0"),
    ("radix_cache", "maybe"),
    ("invariant_check", "loud"),
    ("strict_mem_check_during_idle", "2"),
    ("kv_canary", "panic"),
    ("kv_canary_sweep_interval", "-1"),
    ("seed", "1.5"),
    ("hidden_size", "33"),
    ("hidden_size", "6"),  # head_dim 3: rotary needs an even head_dim
    ("num_heads", "0"),
    ("port", "70000"),
    ("port", "http"),
    ("gate_requests", "-1"),
    ("gate_concurrency", "-2"),
    ("gate_timeout_s", "0"),
    ("gate_timeout_s", "nan"),
    ("gate_timeout_s", "soon"),
]


@pytest.mark.parametrize("via", ["env", "flag", "scenario"])
@pytest.mark.parametrize(("knob", "value"), BAD_VALUES, ids=[f"{k}={v}" for k, v in BAD_VALUES])
def test_bad_value_raises_config_error_naming_knob_and_source(knob: str, value: Any, via: str) -> None:
    if via == "env":
        kwargs, source = {"environ": {_env(knob): value}}, _env(knob)
    elif via == "flag":
        kwargs, source = {"flags": {knob: value}, "environ": {}}, _flag(knob)
    else:
        kwargs, source = {"overrides": {knob: value}, "environ": {}, "overrides_source": "my.yaml"}, "my.yaml"
    with pytest.raises(ConfigError) as info:
        config_from_sources(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{knob}="), message
    assert f"(from {source})" in message, message


def test_knob_coupled_to_a_default_names_the_knob_actually_given() -> None:
    with pytest.raises(ConfigError, match=r"^page_size=3 \(from --page-size\): full_pool_tokens=2048 must be"):
        config_from_sources(flags={"page_size": "3"}, environ={})
    with pytest.raises(ConfigError, match=r"^window=400 \(from ENGINE_STUB_WINDOW\): swa_pool_tokens=320"):
        config_from_sources(environ={"ENGINE_STUB_WINDOW": "400"})
    # Both given: the stronger source is blamed.
    with pytest.raises(ConfigError, match=r"^max_context_len=4096 \(from s.yaml\)"):
        config_from_sources(environ={"ENGINE_STUB_FULL_POOL_TOKENS": "1024"},
                            overrides={"max_context_len": 4096}, overrides_source="s.yaml")


@pytest.mark.parametrize(("knob", "value"), [("radix_cache", 1.5), ("page_size", True), ("seed", 2.5)])
def test_yaml_typed_bad_value_is_rejected(knob: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{knob}=.*\(from scenario\)"):
        config_from_sources(overrides={knob: value}, environ={})


def test_unknown_override_knob_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine knob 'windw' \(from s.yaml\)"):
        config_from_sources(overrides={"windw": 8}, overrides_source="s.yaml", environ={})


def test_direct_construction_names_default_source() -> None:
    with pytest.raises(ConfigError, match=r"^window=0 \(from default\)"):
        EngineConfig(window=0)


def test_every_knob_has_help() -> None:
    assert set(KNOB_HELP) == set(KNOBS)


def test_help_lists_every_knob_with_its_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere in a help
    assert "--scenario" in text and "ENGINE_STUB_SCENARIO" in text
    for knob in KNOBS:
        assert _flag(knob) in text, knob
        assert f"env {_env(knob)};" in text, knob


def test_main_rejects_a_bad_flag_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--window", "zero"]) == 2
    err = capsys.readouterr().err
    assert "window='zero' (from --window)" in err


def test_main_rejects_a_bad_env_var_before_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_STUB_KV_CANARY", "loud")
    assert main([]) == 2
    assert "kv_canary='loud' (from ENGINE_STUB_KV_CANARY)" in capsys.readouterr().err
