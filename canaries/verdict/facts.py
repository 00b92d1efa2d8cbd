"""The facts of one run, read once from its event log, that every verdict rule looks at.

A detector is `<invariant>` for an `invariant_firing` event and `kv_canary.<reason>` for a
`canary_violation` event. A firing counts as detection only at or after the first
`perturbation_landed` step, and (an invariant) with the bucket the detector catalogue declares;
latency = firing step - first landed step, in engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from canaries.verdict.record import Observation, detector_of
from engine_stub import detectors as catalogue

if TYPE_CHECKING:
    from canaries.scenario import Expect, Scenario

__all__ = ["Facts", "facts_of"]


@dataclass(frozen=True)
class Facts:
    """scenario, obs: what was judged. landed: the `perturbation_landed` events (no ts).
    first_landed: the step of the first. crash: the last `crash` event. outcome: crashed | error
    | survived | killed | timeout | running | exited:<code>. firings: one record per firing.
    fired: every detector that fired at all; early: those that fired before the first landing;
    detected: detector -> its first latency at or after the landing (right bucket);
    wrong_bucket: detector -> the bucket it fired with, when not the catalogue's. lost: requests
    whose connection went away without an answer from an engine that did not crash."""

    scenario: Scenario
    obs: Observation
    landed: list[dict]
    first_landed: int | None
    crash: dict | None
    engine_start: dict | None
    ledgers: dict | None
    outcome: str
    firings: list[dict]
    fired: frozenset[str]
    early: frozenset[str]
    detected: dict[str, int]
    wrong_bucket: dict[str, str]
    consumed: tuple[dict, ...] = ()  # perturbation_consumed events: damage something read
    died: tuple[dict, ...] = ()  # perturbation_died events: damage gone unread
    # Why the suite's census could not read the engine's state (SGLang's server: a release whose
    # objects lack what it reads, canaries/sglang/server/census.py), or None where it ran or needs none.
    census_unreadable: str | None = None
    lost: tuple[str, ...] = ()  # rids whose connection was lost by an engine that did not crash

    @property
    def expect(self) -> Expect:
        return self.scenario.expect


def _step(event: dict) -> int:
    step = event.get("step")
    return step if isinstance(step, int) else 0


def _catalogued_bucket(name: str) -> str | None:
    try:
        return catalogue.detector(name).bucket
    except KeyError:
        return None


def _engine_outcome(obs: Observation, crash: dict | None, shutdown: bool) -> str:
    if crash is not None:
        return "error" if crash.get("cause") == "error" else "crashed"
    if obs.timed_out:
        return "timeout"
    if obs.exit_code == 0 or (shutdown and (obs.exit_code is None or obs.exit_code < 0)):
        return "survived"
    if obs.exit_code is None:
        return "running"
    if obs.exit_code < 0:
        return "killed"
    return f"exited:{obs.exit_code}"


# What a request's record says when its connection went away with no answer (the driver's
# `_exchange_failed`: the exception's type first).
_LOST = ("RemoteDisconnected", "ConnectionRefusedError", "ConnectionResetError", "BrokenPipeError",
         "ConnectionAbortedError", "IncompleteRead")
# Signals by which an engine dies of its own fault: a lost connection then is the engine's.
_CRASH_SIGNALS = (4, 6, 7, 8, 11)  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV


def _lost(obs: Observation, crash: dict | None) -> tuple[str, ...]:
    """Requests that got no answer because their connection went away, from an engine that
    neither logged a crash nor died by a crash signal: the harness lost them (a process killed
    under the run, a fork parent gone), not the engine under test."""
    if crash is not None or (obs.exit_code is not None and -obs.exit_code in _CRASH_SIGNALS):
        return ()
    return tuple(str(r.get("rid")) for r in obs.responses
                 if r.get("status") is None and not r.get("hang")
                 and str(r.get("error") or "").startswith(_LOST))


def facts_of(s: Scenario, obs: Observation) -> Facts:
    """Read the run's facts from `obs` (the event log in order)."""
    events = list(obs.events)
    landed = [{k: v for k, v in e.items() if k != "ts"} for e in events
              if e.get("kind") == "perturbation_landed"]
    first_landed = min((_step(e) for e in landed), default=None)
    crash = next((e for e in reversed(events) if e.get("kind") == "crash"), None)
    shutdown = any(e.get("kind") == "shutdown" for e in events)
    idle = [e for e in events if e.get("kind") == "idle_check"]

    firings: list[dict] = []
    fired: set[str] = set()
    early: set[str] = set()
    detected: dict[str, int] = {}
    wrong_bucket: dict[str, str] = {}
    for e in events:
        det = detector_of(e)
        if det is None:
            continue
        fired.add(det)
        step = _step(e)
        latency = step - first_landed if first_landed is not None and step >= first_landed else None
        rec: dict[str, Any] = {"detector": det, "step": step, "latency": latency}
        keys = (("bucket", "level", "site", "crashed", "msg", "total_hits")
                if e.get("kind") == "invariant_firing"
                else ("group", "phase", "slot", "position", "request", "pool_row"))
        rec.update({k: e[k] for k in keys if k in e})
        firings.append(rec)
        if latency is None:
            early.add(det)
            continue
        if e.get("kind") == "invariant_firing":
            declared = _catalogued_bucket(det)
            if declared is not None and e.get("bucket") != declared:
                wrong_bucket.setdefault(det, f"{e.get('bucket')} (registered {declared})")
                continue
        detected.setdefault(det, latency)

    return Facts(
        scenario=s, obs=obs, landed=landed, first_landed=first_landed, crash=crash,
        engine_start=next((e for e in events if e.get("kind") == "engine_start"), None),
        ledgers=dict(idle[-1].get("ledgers") or {}) if idle else None,
        outcome=_engine_outcome(obs, crash, shutdown), firings=firings,
        fired=frozenset(fired), early=frozenset(early), detected=detected,
        wrong_bucket=wrong_bucket,
        consumed=tuple(e for e in events if e.get("kind") == "perturbation_consumed"),
        died=tuple(e for e in events if e.get("kind") == "perturbation_died"),
        census_unreadable=next((str(e.get("reason")) for e in events
                                if e.get("kind") == "census" and e.get("unreadable")), None),
        lost=_lost(obs, crash),
    )
