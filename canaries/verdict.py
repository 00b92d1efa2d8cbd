"""Verdicts: judge one scenario run from its event log, its responses and the engine's exit.

A detector is `<invariant>` for an `invariant_firing` event and `kv_canary.<reason>` for a
`canary_violation` event. A firing counts as detection only at or after the first
`perturbation_landed` step; latency = firing step - first landed step.

Rules, first match wins:
1. harness error, timeout, engine gone without a `crash` event (no `shutdown` either, exit code < 0 or unknown, or any other non-zero code), or a crash with cause `error` -> INCONCLUSIVE.
2. clean scenario: any detector fired -> FALSE_ALARM; a non-200 response, an unexplained crash or an output that differs from the no-cache oracle -> INCONCLUSIVE; else CLEAN.
3. perturbation scenario in which some perturbation (by index) has no `perturbation_landed` event -> NOT_INJECTED.
4. a detector listed in `expect.silent` fired -> WRONG_DETECTOR.
5. any detector fired before the first perturbation landed -> FALSE_ALARM.
6. disabled scenario: `engine_start` must show every disabled knob in force (else INCONCLUSIVE); a `detected_by` detector did not fire -> MISSED; engine expectation mismatched -> INCONCLUSIVE; else DISABLED_AS_DECLARED.
7. fires scenario: no expected detector fired (an invariant must fire with its registered bucket) -> WRONG_DETECTOR if another detector fired, else MISSED; only some fired -> MISSED naming the rest; a latency above `within_steps` -> LATE; engine expectation (crashes|survives) mismatched -> INCONCLUSIVE; else DETECTED.
8. `expect.verdict` set (a negative test): passed = (verdict == expect.verdict); otherwise passed = verdict in PASSING.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from canaries.scenario import Scenario

__all__ = ["VERDICTS", "PASSING", "Observation", "VerdictRecord", "judge", "detector_of"]

VERDICTS = ("DETECTED", "DISABLED_AS_DECLARED", "CLEAN", "MISSED", "WRONG_DETECTOR", "LATE",
            "FALSE_ALARM", "NOT_INJECTED", "INCONCLUSIVE")
PASSING = frozenset({"DETECTED", "DISABLED_AS_DECLARED", "CLEAN"})

# Engine exit codes.
EXIT_CLEAN, EXIT_ERROR, EXIT_INVARIANT, EXIT_CANARY = 0, 1, 3, 4


@dataclass(frozen=True)
class Observation:
    """What a run left behind.

    events: the engine's event log (dicts). responses: one dict per request, with `rid` and
    `status` (HTTP status; absent means 200) and optionally `error`. exit_code: the engine's exit
    status (negative: killed by a signal; None: still running or unknown). oracle_mismatches: rids
    whose output differed from the no-cache oracle (clean scenarios only). error: a harness error.
    """

    events: list[dict]
    responses: list[dict]
    exit_code: int | None
    timed_out: bool
    oracle_mismatches: list[str]
    error: str | None = None


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def detector_of(event: dict) -> str | None:
    """The detector an event reports, or None if it reports none."""
    kind = event.get("kind")
    if kind == "invariant_firing":
        return str(event.get("invariant"))
    if kind == "canary_violation":
        return f"kv_canary.{event.get('reason')}"
    return None


def _registered_bucket(name: str) -> str | None:
    from canaries.scenario import load_invariant_registry
    from engine_stub.invariants import get_invariant

    load_invariant_registry()
    try:
        return get_invariant(name).bucket.name
    except KeyError:
        return None


def _step(event: dict) -> int:
    step = event.get("step")
    return step if isinstance(step, int) else 0


def _engine_outcome(obs: Observation, crash: dict | None, shutdown: bool) -> str:
    """crashed | error | survived | killed | timeout | running | exited:<code>."""
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


def _names(names: list[str] | set[str] | tuple[str, ...]) -> str:
    return ", ".join(sorted(names))


def judge(s: Scenario, obs: Observation) -> VerdictRecord:
    """Judge one run of `s` (rules in the module docstring)."""
    events = list(obs.events)
    landed = [{k: v for k, v in e.items() if k != "ts"} for e in events
              if e.get("kind") == "perturbation_landed"]
    first_landed = min((_step(e) for e in landed), default=None)
    landed_indices = {e.get("index") for e in landed}
    crash = next((e for e in reversed(events) if e.get("kind") == "crash"), None)
    shutdown = any(e.get("kind") == "shutdown" for e in events)
    engine_start = next((e for e in events if e.get("kind") == "engine_start"), None)
    idle = [e for e in events if e.get("kind") == "idle_check"]
    ledgers = dict(idle[-1].get("ledgers") or {}) if idle else None
    outcome = _engine_outcome(obs, crash, shutdown)
    ex = s.expect

    # Firings, with latency and registered-bucket check.
    firings: list[dict] = []
    fired: set[str] = set()               # every detector that fired at all
    early: set[str] = set()               # fired before the first landing
    detected: dict[str, int] = {}         # detector -> first latency at/after landing, right bucket
    wrong_bucket: dict[str, str] = {}     # detector -> bucket seen, when not the registered one
    for e in events:
        det = detector_of(e)
        if det is None:
            continue
        fired.add(det)
        step = _step(e)
        latency = step - first_landed if first_landed is not None and step >= first_landed else None
        rec: dict[str, Any] = {"detector": det, "step": step, "latency": latency}
        if e.get("kind") == "invariant_firing":
            for k in ("bucket", "level", "site", "crashed", "msg", "total_hits"):
                if k in e:
                    rec[k] = e[k]
        else:
            for k in ("group", "phase", "slot", "position", "request", "pool_row"):
                if k in e:
                    rec[k] = e[k]
        firings.append(rec)
        if first_landed is None or step < first_landed:
            early.add(det)
            continue
        if e.get("kind") == "invariant_firing":
            registered = _registered_bucket(det)
            if registered is not None and e.get("bucket") != registered:
                wrong_bucket.setdefault(det, f"{e.get('bucket')} (registered {registered})")
                continue
        detected.setdefault(det, step - first_landed)

    expected = tuple(ex.fires) + tuple(ex.detected_by)
    latency_map: dict[str, int | None] = {d: detected.get(d) for d in (*expected, *sorted(fired))}

    def engine_mismatch() -> str | None:
        if ex.engine == "crashes" and outcome != "crashed":
            return f"expected the engine to crash, it {outcome}"
        if ex.engine == "survives" and outcome != "survived":
            return f"expected the engine to survive, it {outcome}"
        return None

    def decide() -> tuple[str, str]:
        # 1. Runs that tell us nothing.
        if obs.error:
            return "INCONCLUSIVE", f"harness error: {obs.error}"
        if obs.timed_out:
            return "INCONCLUSIVE", "the run timed out"
        if crash is not None and crash.get("cause") == "error":
            return "INCONCLUSIVE", f"engine crashed with an error: {crash.get('error', '')}".strip()
        if crash is None and outcome == "killed":
            return "INCONCLUSIVE", f"engine killed from outside (exit code {obs.exit_code}) without a crash event"
        if crash is None and outcome == "running":
            return "INCONCLUSIVE", "engine exit unknown (still running?) and no crash or shutdown event"
        if crash is None and outcome.startswith("exited:"):
            return "INCONCLUSIVE", f"engine exited with code {obs.exit_code} without a crash event"

        # 2. Controls.
        if ex.clean:
            if fired:
                return "FALSE_ALARM", f"control scenario, yet {_names(fired)} fired"
            bad = [r for r in obs.responses if r.get("status", 200) != 200 or r.get("error")]
            if bad:
                rids = ", ".join(str(r.get("rid", "?")) for r in bad)
                return "INCONCLUSIVE", f"{len(bad)} request(s) failed: {rids}"
            if crash is not None:
                return "INCONCLUSIVE", f"engine crashed ({crash.get('cause')}) with no detector firing"
            if obs.oracle_mismatches:
                return "INCONCLUSIVE", ("output differs from the no-cache oracle for rids "
                                        + ", ".join(map(str, obs.oracle_mismatches)))
            return "CLEAN", "no detector fired and every output matched the no-cache oracle"

        # 3. Did every fault land?
        unlanded = [i for i in range(len(s.perturbations)) if i not in landed_indices]
        if not landed or unlanded:
            also = f" ({_names(fired)} fired anyway)" if fired else ""
            if not landed:
                return "NOT_INJECTED", f"no perturbation landed{also}"
            what = ", ".join(f"perturbations[{i}] ({s.perturbations[i].kind})" for i in unlanded)
            return "NOT_INJECTED", f"{what} never landed{also}"

        # 4. Specificity.
        loud = sorted(set(ex.silent) & fired)
        if loud:
            return "WRONG_DETECTOR", f"silent detector(s) fired: {_names(loud)}"

        # 5. An alarm before any fault is a false alarm.
        if early:
            return "FALSE_ALARM", (f"{_names(early)} fired before the first perturbation landed "
                                   f"(step {first_landed})")

        # 6. Deliberately disabled checks.
        if ex.disabled is not None:
            if engine_start is None:
                return "INCONCLUSIVE", "no engine_start event: cannot confirm the disabled knobs"
            config = engine_start.get("config") or {}
            wrong = [f"{k}={config.get(k)!r} (declared {v!r})"
                     for k, v in ex.disabled.checks.items() if config.get(k) != v]
            if wrong:
                return "INCONCLUSIVE", f"declared-disabled knobs not in force: {'; '.join(wrong)}"
            missing = [d for d in ex.detected_by if d not in detected]
            if missing:
                return "MISSED", (f"check disabled as declared ({ex.disabled.reason}), but "
                                  f"{_names(missing)} did not fire")
            mismatch = engine_mismatch()
            if mismatch:
                return "INCONCLUSIVE", mismatch
            return "DISABLED_AS_DECLARED", (f"disabled as declared ({ex.disabled.reason}); caught by "
                                            f"{_names(ex.detected_by)}")

        # 7. Expected detectors.
        hit = [d for d in ex.fires if d in detected]
        if not hit:
            others = sorted(fired - set(ex.fires)) + [f"{d} with bucket {b}" for d, b in sorted(wrong_bucket.items())]
            if others:
                return "WRONG_DETECTOR", f"expected {_names(ex.fires)}; instead: {', '.join(others)}"
            return "MISSED", f"perturbation landed at step {first_landed} but no detector fired"
        missing = [d for d in ex.fires if d not in detected]
        if missing:
            extra = "".join(f"; {d} fired with bucket {wrong_bucket[d]}" for d in missing if d in wrong_bucket)
            return "MISSED", f"{_names(hit)} fired but {_names(missing)} did not{extra}"
        if ex.within_steps is not None:
            late = {d: detected[d] for d in ex.fires if detected[d] > ex.within_steps}
            if late:
                what = ", ".join(f"{d} after {n} steps" for d, n in sorted(late.items()))
                return "LATE", f"{what} (within_steps {ex.within_steps})"
        mismatch = engine_mismatch()
        if mismatch:
            return "INCONCLUSIVE", mismatch
        lat = ", ".join(f"{d} +{detected[d]}" for d in ex.fires)
        return "DETECTED", f"fired after the perturbation landed: {lat}"

    verdict, reason = decide()
    if ex.verdict is not None:
        passed = verdict == ex.verdict
        reason = (f"negative test expects {ex.verdict}, got {verdict}: {reason}")
    else:
        passed = verdict in PASSING

    first_kind = s.perturbations[0].kind if s.perturbations else "control"
    signature = f"{verdict}|{','.join(sorted(fired))}|{first_kind}"
    return VerdictRecord(
        scenario=s.name,
        verdict=verdict,
        passed=passed,
        reason=reason,
        signature=signature,
        landed=landed,
        firings=firings,
        latency=latency_map,
        engine_outcome=outcome,
        ledgers=ledgers,
        seed=s.seed,
        engine=dict(s.engine),
        expect=dataclasses.asdict(s.expect),
        extra={"crash": {k: v for k, v in crash.items() if k != "ts"}} if crash else {},
    )
