"""EngineConfig: every knob of the engine, settable by flag, environment variable or scenario YAML.

Precedence (highest first): the scenario's engine section, command-line flags, `ENGINE_STUB_*`
environment variables, defaults. The engine records the config in force in its event log and in
`GET /state`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHOICES", "CHUNKED_PREFILL_AUTO", "CHUNKED_PREFILL_OFF", "EngineConfig", "ConfigError", "coerce_knob", "config_from_sources",
           "add_config_flags", "KNOB_HELP"]

ENV_PREFIX = "ENGINE_STUB_"
CHUNKED_PREFILL_AUTO = 0
CHUNKED_PREFILL_OFF = -1


class ConfigError(ValueError):
    """A knob has a bad value; the message names the knob, where it came from, and the value."""


KNOB_HELP: dict[str, str] = {
    "device": "auto | cpu | cuda (auto: cuda when available)",
    "memory": "native (our copy of SGLang's memory path) | sglang (SGLang's own allocator, radix tree and "
              "req-to-token pool, from an installed sglang) | sglang-allocator (SGLang's allocator only)",
    "page_size": "slots per KV page, both pools",
    "window": "sliding-window size in tokens of the SWA layers",
    "full_pool_tokens": "slots in the full-attention KV pool",
    "swa_pool_tokens": "slots in the SWA KV pool (size it below the workload footprint so slots recycle)",
    "layer_pattern": "one letter per layer: F full attention, S sliding window (e.g. FSSF)",
    "max_running_requests": "request rows in the req-to-token pool",
    "max_context_len": "longest prompt + generation a request may have",
    "max_prefill_tokens": "token budget of one prefill step",
    "chunked_prefill_size": "tokens of one prefill chunk: a longer prompt is prefilled over several steps "
                            "(auto: the most the SWA pool holds beside one request's headroom; off: never chunk)",
    "radix_cache": "keep finished requests' KV in the SWA radix cache (true|false)",
    "invariant_check": "off | warn | strict (also 0|1|2)",
    "strict_mem_check_during_idle": "1: a failed idle ledger crashes the engine; 0: count and log",
    "kv_canary": "off | log | raise",
    "kv_canary_sweep_interval": "steps between sweeps of every slot the radix cache holds (0: never)",
    "seed": "seed of the model weights and of seeded sampling",
    "hidden_size": "model width",
    "num_heads": "attention heads (head_dim = hidden_size / num_heads)",
    "host": "address to bind (loopback unless told otherwise)",
    "port": "port to bind (0: pick a free one and report it)",
    "event_log": "path of the JSONL event log ('' : <tmp>/engine_stub-<pid>.events.jsonl)",
    "gate_requests": "lockstep gate for deterministic replay: total requests the driver will send (0: off)",
    "gate_concurrency": "lockstep gate: requests the driver keeps in flight",
    "gate_timeout_s": "longest a gated step waits for the driver before it goes on without it",
    "step_delay_s": "test-only: seconds the engine waits before each step (a slow engine, as on a loaded "
                    "runner or a shared GPU; a huge value stalls it); 0: none",
}

CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "memory": ("native", "sglang", "sglang-allocator"),
    "invariant_check": ("off", "warn", "strict"),
    "kv_canary": ("off", "log", "raise"),
}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. Validated on construction; `ConfigError` names the field."""

    device: str = "auto"
    memory: str = "native"
    page_size: int = 1
    window: int = 16
    full_pool_tokens: int = 2048
    swa_pool_tokens: int = 320
    layer_pattern: str = "SFSS"
    max_running_requests: int = 4
    max_context_len: int = 512
    max_prefill_tokens: int = 1024
    # 0 is "auto" (derived from the pools), -1 is "off" (SGLang's value for no chunking).
    chunked_prefill_size: int = 0
    radix_cache: bool = True
    invariant_check: str = "off"
    strict_mem_check_during_idle: bool = True
    kv_canary: str = "off"
    kv_canary_sweep_interval: int = 8
    seed: int = 0
    hidden_size: int = 32
    num_heads: int = 2
    host: str = "127.0.0.1"
    port: int = 30000
    event_log: str = ""
    gate_requests: int = 0
    gate_concurrency: int = 0
    gate_timeout_s: float = 5.0
    step_delay_s: float = 0.0
    # Not a knob: which source set each field, recorded with the config in force.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            where = self.sources.get(name, "default")
            return ConfigError(f"{name}={getattr(self, name)!r} (from {where}): {why}")

        def rank(name: str) -> int:
            where = self.sources.get(name)
            if where is None:
                return 0
            return 1 if where.startswith(ENV_PREFIX) else 2 if where.startswith("--") else 3

        def culprit(*names: str) -> str:
            # A constraint between knobs blames the one set by the strongest source (the one the
            # user most likely just changed), not a default it happens to clash with.
            return max(names, key=rank)

        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise bad(name, f"must be one of {'|'.join(choices)}")
        for name in ("page_size", "window", "full_pool_tokens", "swa_pool_tokens",
                     "max_running_requests", "max_context_len", "max_prefill_tokens",
                     "hidden_size", "num_heads"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        for name in ("full_pool_tokens", "swa_pool_tokens"):
            if getattr(self, name) % self.page_size:
                raise bad(culprit(name, "page_size"),
                          f"{name}={getattr(self, name)} must be a multiple of page_size={self.page_size}")
        headroom = self.swa_headroom
        if self.swa_pool_tokens < headroom + self.page_size:
            raise bad(culprit("swa_pool_tokens", "window", "page_size"),
                      f"swa_pool_tokens={self.swa_pool_tokens} must hold one request's SWA headroom, "
                      f"max(window, page_size) + window + 2 * page_size = {headroom}, plus one page "
                      f"({self.page_size}) to prefill into")
        if self.chunked_prefill_size not in (CHUNKED_PREFILL_AUTO, CHUNKED_PREFILL_OFF) \
                and self.chunked_prefill_size < self.page_size:
            raise bad(culprit("chunked_prefill_size", "page_size"),
                      f"must be auto, off, or at least page_size={self.page_size} (a chunk is whole pages)")
        if self.swa_pool_tokens > self.full_pool_tokens:
            raise bad(culprit("swa_pool_tokens", "full_pool_tokens"),
                      f"swa_pool_tokens={self.swa_pool_tokens} must not exceed "
                      f"full_pool_tokens={self.full_pool_tokens}")
        if not self.layer_pattern or set(self.layer_pattern) - {"F", "S"}:
            raise bad("layer_pattern", "must be a non-empty string of F (full) and S (sliding window)")
        if self.hidden_size % self.num_heads:
            raise bad(culprit("hidden_size", "num_heads"),
                      f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise bad(culprit("hidden_size", "num_heads"),
                      f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be even "
                      "(rotary positions)")
        if not 0 <= self.port <= 65535:
            raise bad("port", "must be in 0..65535")
        if self.kv_canary_sweep_interval < 0:
            raise bad("kv_canary_sweep_interval", "must be >= 0")
        for name in ("gate_requests", "gate_concurrency"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if not self.gate_timeout_s > 0:  # also rejects NaN
            raise bad("gate_timeout_s", "must be > 0")
        if not 0 <= self.step_delay_s < float("inf"):  # also rejects NaN
            raise bad("step_delay_s", "must be a finite number >= 0")
        if self.max_context_len > self.full_pool_tokens:
            raise bad(culprit("max_context_len", "full_pool_tokens"),
                      f"max_context_len={self.max_context_len} must fit in "
                      f"full_pool_tokens={self.full_pool_tokens}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def swa_headroom(self) -> int:
        """SWA slots one running request may hold between two window evictions: its kept window
        (at least a page), one eviction interval of new tokens (a window, the scheduler's
        cadence) and two pages of rounding."""
        return max(self.window, self.page_size) + self.window + 2 * self.page_size

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """Tokens one prefill chunk holds at most (whole pages), or None when chunking is off.

        Never more than the SWA pool holds beside one request's headroom (SGLang likewise
        shrinks a chunk to the SWA room left): `auto` is exactly that, so a prompt that would
        not fit at once is served in chunks and one that fits is not chunked at all."""
        if self.chunked_prefill_size == CHUNKED_PREFILL_OFF:
            return None
        room = self.swa_pool_tokens - self.swa_headroom
        if self.chunked_prefill_size != CHUNKED_PREFILL_AUTO:
            room = min(room, self.chunked_prefill_size)
        return room - room % self.page_size

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def knobs(self) -> dict[str, Any]:
        """Every knob and its value (what the run records as the config in force)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}


def _knob_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "sources"}


def coerce_knob(name: str, raw: Any, source: str) -> Any:
    """Turn a flag/env/YAML value into knob `name`'s type, or raise ConfigError naming it.

    Only the value's type and spelling (`0|1|2` for invariant_check, case): the constraints
    between knobs are EngineConfig's, checked when one is built."""
    default = _knob_fields()[name].default
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true|false|1|0")
        if name == "chunked_prefill_size" and str(raw).strip().lower() in ("auto", "off"):
            return CHUNKED_PREFILL_AUTO if str(raw).strip().lower() == "auto" else CHUNKED_PREFILL_OFF
        if isinstance(default, int):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if name == "invariant_check":
            return {"0": "off", "1": "warn", "2": "strict"}.get(str(raw).strip().lower(), str(raw).strip().lower())
        if name in CHOICES:
            return str(raw).strip().lower()
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={raw!r} (from {source}): {exc}") from None


def config_from_sources(
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_source: str = "scenario",
) -> EngineConfig:
    """Build the config in force: defaults < environment < flags < overrides (the scenario).

    Args:
        flags: parsed command-line values; None entries mean "not given".
        environ: the environment (default `os.environ`), read for `ENGINE_STUB_<KNOB>`.
        overrides: the scenario's engine section (already validated names).
        overrides_source: how to name the overrides in errors and in `sources`.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in _knob_fields():
        env_name = ENV_PREFIX + name.upper()
        if environ.get(env_name, "") != "":
            values[name] = coerce_knob(name, environ[env_name], env_name)
            sources[name] = env_name
    for name, raw in (flags or {}).items():
        if raw is not None:
            values[name] = coerce_knob(name, raw, "--" + name.replace("_", "-"))
            sources[name] = "--" + name.replace("_", "-")
    for name, raw in (overrides or {}).items():
        if name not in _knob_fields():
            raise ConfigError(f"unknown engine knob {name!r} (from {overrides_source}); known: {', '.join(_knob_fields())}")
        values[name] = coerce_knob(name, raw, overrides_source)
        sources[name] = overrides_source
    return EngineConfig(**values, sources=sources)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One `--knob-name` flag per knob; every default is None so unset flags defer to the env."""
    for name, f in _knob_fields().items():
        env_name = ENV_PREFIX + name.upper()
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar=type(f.default).__name__.upper(),
            help=f"{KNOB_HELP[name]} [env {env_name}; default {f.default!r}]",
        )
