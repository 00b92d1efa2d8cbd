"""What a run left behind (`Observation`) and what the suite concluded (`VerdictRecord`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EXIT_CANARY", "EXIT_CLEAN", "EXIT_ERROR", "EXIT_INVARIANT", "HARNESS", "Observation",
           "VerdictRecord", "detector_of"]

HARNESS = "harness"  # a record's `cause` when the harness failed, not the engine

# Engine exit codes.
EXIT_CLEAN, EXIT_ERROR, EXIT_INVARIANT, EXIT_CANARY = 0, 1, 3, 4


@dataclass(frozen=True)
class Observation:
    """What a run left behind.

    events: the engine's event log (dicts). responses: one dict per request, with `rid` and
    `status` (HTTP status; absent means 200) and optionally `error`. exit_code: the engine's exit
    status (negative: killed by a signal; None: still running or unknown). oracle_mismatches: rids
    whose output differed from the no-cache oracle (clean scenarios only). error: a harness error
    (`unsupported`: a refusal instead, the runtime cannot run the scenario). hang: why the
    workload's watchdog cut it (no engine progress, or its hard cap), with `timed_out`; `starved`:
    how the machine starved the engine meanwhile (then the harness's failure). no_oracle: why
    there is no reference answer though the harness worked (the release's own clean server did not
    answer the plan: its behaviour, not the harness's).
    """

    events: list[dict]
    responses: list[dict]
    exit_code: int | None
    timed_out: bool
    oracle_mismatches: list[str]
    error: str | None = None
    hang: str | None = None
    unsupported: bool = False
    starved: str | None = None
    no_oracle: str | None = None


@dataclass(frozen=True)
class VerdictRecord:
    scenario: str
    verdict: str
    passed: bool
    reason: str
    signature: str
    landed: list[dict]
    firings: list[dict]
    latency: dict[str, int | None]
    engine_outcome: str
    ledgers: dict | None
    seed: int
    engine: dict
    expect: dict
    extra: dict = field(default_factory=dict)
    # "harness": the harness, not the engine under test, left the run without a verdict (an
    # oracle or start-up failure, lost connections, a stall while the machine starved the engine);
    # such a run is INCONCLUSIVE and no verdict on the release. None: the run's verdict is the engine's.
    cause: str | None = None

    def to_dict(self) -> dict:
        """A plain copy, as `dataclasses.asdict` gives (a fresh container at every level), at a
        fraction of its cost: every record is written three or four times per run."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return type(value)(*map(_plain, value)) if hasattr(value, "_fields") else tuple(map(_plain, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value if isinstance(value, str | int | float | None) else copy.deepcopy(value)


def detector_of(event: dict) -> str | None:
    """The detector an event reports, or None if it reports none."""
    kind = event.get("kind")
    if kind == "invariant_firing":
        return str(event.get("invariant"))
    if kind == "canary_violation":
        return f"kv_canary.{event.get('reason')}"
    return None
