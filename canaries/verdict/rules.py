"""Verdicts: judge one scenario run by its rules, in order; the first that decides wins.

Each rule is a small function `(facts) -> (verdict, reason) | None` (None: not its case, ask
the next). In order:

1. `run_told_nothing`: harness error, timeout, lost connections (requests without an answer from
   an engine that did not crash), engine gone without a `crash` event (no `shutdown` either,
   exit code < 0 or unknown, or any other non-zero code), or a crash with cause `error` ->
   INCONCLUSIVE.
2. `clean_control`: a control: any detector fired -> FALSE_ALARM; a response not answered as
   planned (200, or the 400 a `workload.extra_requests` entry expects, and its
   `min_cached_tokens`), a crash, no oracle (the release's own clean server did not answer
   the plan) or an output that differs from the no-cache oracle -> INCONCLUSIVE; else CLEAN.
3. `not_injected`: some perturbation (by index) has no `perturbation_landed` event -> NOT_INJECTED.
4. `silent_detectors`: a detector listed in `expect.silent` fired -> WRONG_DETECTOR.
5. `alarm_before_landing`: any detector fired before the first perturbation landed -> FALSE_ALARM.
6. `disabled_as_declared`: `engine_start` must show every disabled knob in force (else
   INCONCLUSIVE); a `detected_by` detector did not fire -> MISSED.
7. `expected_firings`: no expected detector fired (an invariant must fire with its catalogued
   bucket) -> WRONG_DETECTOR if another detector fired, else MISSED; only some fired -> MISSED
   naming the rest (unless `expect.any`: one suffices).
8. `latency`: a first firing later than `within_steps` steps after the landing -> LATE.
9. `crash_expectation`: `expect.engine` (crashes|survives) mismatched -> INCONCLUSIVE.
10. `as_expected`: DISABLED_AS_DECLARED, or DETECTED with each detector's latency in steps.

An INCONCLUSIVE verdict whose cause is the harness's (`harness_failure`: a harness error, a stall
while the machine starved the engine, lost connections) gets `cause: harness`: no verdict on the
engine under test. Then `unreached`: a MISSED whose damage nothing ever read (the engine followed every damaged
location: `perturbation_died` for each, `perturbation_consumed` for none) -> NOT_REACHED: no
detector could have seen it, so the scenario, not a detector, is at fault. Then `blind`: where the
suite's census could not read the engine's state (a `census` event saying so: an SGLang release
whose objects lack what it reads), a verdict resting on it (a silence: CLEAN, MISSED, NOT_REACHED;
or a census or radix-sanity detector the scenario names) -> INCONCLUSIVE with the reason: never
judged blind. And `negative_test`:
with `expect.verdict` set, passed = (verdict == expect.verdict); otherwise passed = verdict in
PASSING.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from canaries.scenario.fields import PASSING
from canaries.verdict.facts import Facts, facts_of
from canaries.verdict.record import HARNESS, Observation, VerdictRecord

if TYPE_CHECKING:
    from canaries.scenario import Scenario

__all__ = ["RULES", "blind", "harness_failure", "judge", "steps_after", "unreached"]

Decision = tuple[str, str]
Rule = Callable[[Facts], "Decision | None"]


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def steps_after(latencies: dict[str, int]) -> str:
    """'fired 2 steps after the perturbation landed: a, b' (grouped by latency, soonest first;
    a latency is in engine steps, never a hit count)."""
    by_latency: dict[int, list[str]] = {}
    for name, n in latencies.items():
        by_latency.setdefault(n, []).append(name)
    groups = [f"{_steps(n)} after{' the perturbation landed' if i == 0 else ''}: "
              f"{', '.join(names)}" for i, (n, names) in enumerate(sorted(by_latency.items()))]
    return "fired " + "; ".join(groups)


def run_told_nothing(f: Facts) -> Decision | None:
    obs, crash, outcome = f.obs, f.crash, f.outcome
    if obs.error:
        return "INCONCLUSIVE", f"{'not run here' if obs.unsupported else 'harness error'}: {obs.error}"
    if obs.timed_out:
        return "INCONCLUSIVE", "the run timed out" + (f": {obs.hang}" if obs.hang else "")
    if f.lost:
        return "INCONCLUSIVE", (f"harness error: lost connections: {len(f.lost)} request(s) got no answer "
                                f"from an engine that did not crash: {', '.join(f.lost[:8])}")
    if crash is not None and crash.get("cause") == "error":
        return "INCONCLUSIVE", f"engine crashed with an error: {crash.get('error', '')}".strip()
    if crash is None and outcome == "killed":
        return "INCONCLUSIVE", (f"engine killed from outside (exit code {obs.exit_code}) "
                                "without a crash event")
    if crash is None and outcome == "running":
        return "INCONCLUSIVE", "engine exit unknown (still running?) and no crash or shutdown event"
    if crash is None and outcome.startswith("exited:"):
        return "INCONCLUSIVE", f"engine exited with code {obs.exit_code} without a crash event"
    return None


def _unexpected_answer(response: dict) -> str | None:
    """How a response differs from the plan (its status: 200 unless the workload plans a
    refusal; a planned success with an error; fewer cached prompt tokens than planned), or None."""
    want = response.get("expect_status", 200)
    status = response.get("status", 200)
    if status != want or (want == 200 and response.get("error")):
        return f"{status}, expected {want}"
    min_cached = response.get("expect_cached_tokens")
    cached = (response.get("meta_info") or {}).get("cached_tokens")
    if min_cached is not None and (cached is None or cached < min_cached):
        return f"{cached} prompt tokens from the cache, expected at least {min_cached}"
    return None


def clean_control(f: Facts) -> Decision | None:
    if not f.expect.clean:
        return None
    if f.fired:
        return "FALSE_ALARM", f"control scenario, yet {_names(f.fired)} fired"
    bad = [(r.get("rid", "?"), why) for r in f.obs.responses if (why := _unexpected_answer(r))]
    if bad:
        rids = ", ".join(f"{rid} ({why})" for rid, why in bad[:8])
        return "INCONCLUSIVE", f"{len(bad)} request(s) not answered as planned: {rids}"
    if f.crash is not None:
        return "INCONCLUSIVE", f"engine crashed ({f.crash.get('cause')}) with no detector firing"
    if f.obs.no_oracle:
        return "INCONCLUSIVE", f"no oracle: {f.obs.no_oracle}"
    if f.obs.oracle_mismatches:
        return "INCONCLUSIVE", ("output differs from the no-cache oracle for rids "
                                + ", ".join(map(str, f.obs.oracle_mismatches)))
    return "CLEAN", "no detector fired and every output matched the no-cache oracle"


def not_injected(f: Facts) -> Decision | None:
    perturbations = f.scenario.perturbations
    landed = {e.get("index") for e in f.landed}
    unlanded = [i for i in range(len(perturbations)) if i not in landed]
    if f.landed and not unlanded:
        return None
    also = f" ({_names(f.fired)} fired anyway)" if f.fired else ""
    if not f.landed:
        return "NOT_INJECTED", f"no perturbation landed{also}"
    what = ", ".join(f"perturbations[{i}] ({perturbations[i].kind})" for i in unlanded)
    return "NOT_INJECTED", f"{what} never landed{also}"


def silent_detectors(f: Facts) -> Decision | None:
    loud = set(f.expect.silent) & f.fired
    return ("WRONG_DETECTOR", f"silent detector(s) fired: {_names(loud)}") if loud else None


def alarm_before_landing(f: Facts) -> Decision | None:
    if not f.early:
        return None
    return "FALSE_ALARM", (f"{_names(f.early)} fired before the first perturbation landed "
                           f"(step {f.first_landed})")


def disabled_as_declared(f: Facts) -> Decision | None:
    disabled = f.expect.disabled
    if disabled is None:
        return None
    if f.engine_start is None:
        return "INCONCLUSIVE", "no engine_start event: cannot confirm the disabled knobs"
    config = f.engine_start.get("config") or {}
    wrong = [f"{k}={config.get(k)!r} (declared {v!r})"
             for k, v in disabled.checks.items() if config.get(k) != v]
    if wrong:
        return "INCONCLUSIVE", f"declared-disabled knobs not in force: {'; '.join(wrong)}"
    missing = [d for d in f.expect.detected_by if d not in f.detected]
    if missing:
        return "MISSED", (f"check disabled as declared ({disabled.reason}), but "
                          f"{_names(missing)} did not fire")
    return None


def expected_firings(f: Facts) -> Decision | None:
    ex = f.expect
    if ex.disabled is not None:
        return None
    hit = [d for d in ex.fires if d in f.detected]
    if not hit:
        others = sorted(f.fired - set(ex.fires)) + [f"{d} with bucket {b}"
                                                    for d, b in sorted(f.wrong_bucket.items())]
        if others:
            return "WRONG_DETECTOR", f"expected {_names(ex.fires)}; instead: {', '.join(others)}"
        return "MISSED", f"perturbation landed at step {f.first_landed} but no detector fired"
    missing = [d for d in ex.fires if d not in f.detected]
    if missing and not ex.any:
        extra = "".join(f"; {d} fired with bucket {f.wrong_bucket[d]}"
                        for d in missing if d in f.wrong_bucket)
        return "MISSED", f"{_names(hit)} fired but {_names(missing)} did not{extra}"
    return None


def latency(f: Facts) -> Decision | None:
    ex = f.expect
    if ex.disabled is not None or ex.within_steps is None:
        return None
    late = {d: f.detected[d] for d in ex.fires if d in f.detected and f.detected[d] > ex.within_steps}
    if not late:
        return None
    what = ", ".join(f"{d} after {_steps(n)}" for d, n in sorted(late.items()))
    return "LATE", f"{what} (within_steps {ex.within_steps})"


def crash_expectation(f: Facts) -> Decision | None:
    want, outcome = f.expect.engine, f.outcome
    if want == "crashes" and outcome != "crashed":
        return "INCONCLUSIVE", f"expected the engine to crash, it {outcome}"
    if want == "survives" and outcome != "survived":
        return "INCONCLUSIVE", f"expected the engine to survive, it {outcome}"
    return None


def as_expected(f: Facts) -> Decision:
    ex = f.expect
    if ex.disabled is not None:
        return "DISABLED_AS_DECLARED", (f"disabled as declared ({ex.disabled.reason}); caught by "
                                        f"{_names(ex.detected_by)}")
    return "DETECTED", steps_after({d: f.detected[d] for d in ex.fires if d in f.detected})


RULES: tuple[Rule, ...] = (run_told_nothing, clean_control, not_injected, silent_detectors,
                           alarm_before_landing, disabled_as_declared, expected_firings, latency,
                           crash_expectation)


def harness_failure(f: Facts) -> bool:
    """Whether the harness, not the engine under test, left the run without a verdict: a harness
    error (not a refusal), a stall or a workload past its hard cap while the machine starved the
    engine, lost connections."""
    obs = f.obs
    return bool((obs.error and not obs.unsupported) or (obs.timed_out and obs.starved) or f.lost)


def unreached(f: Facts, verdict: str, reason: str) -> Decision:
    """MISSED -> NOT_REACHED when every damage died unread (see the module docstring)."""
    if verdict != "MISSED" or f.consumed or not f.died:
        return verdict, reason
    how = sorted({str(e.get("by")) for e in f.died})
    died = sum(int(e.get("count") or 1) for e in f.died)
    return "NOT_REACHED", (f"every damage died unread ({died} location(s): {'; '.join(how)}), "
                           f"so no detector could have seen it; was: {reason}")


# What only the suite's own census reads (engine_stub/census.py; on SGLang's server,
# canaries/sglang/server/census.py).
_CENSUS_READ = ("census.", "idle.radix_sanity")


def blind(f: Facts, verdict: str, reason: str) -> Decision:
    """-> INCONCLUSIVE where the verdict rests on a census that could not read the engine."""
    if f.census_unreadable is None:
        return verdict, reason
    named = (*f.expect.fires, *f.expect.detected_by, *f.expect.silent)
    if verdict in ("CLEAN", "MISSED", "NOT_REACHED") or any(d.startswith(_CENSUS_READ) for d in named):
        return "INCONCLUSIVE", (f"the suite's census cannot read this engine's state "
                                f"({f.census_unreadable}), and the verdict rests on it; was {verdict}: {reason}")
    return verdict, reason


def negative_test(f: Facts, verdict: str, reason: str) -> tuple[bool, str]:
    """(passed, reason): a negative test passes on exactly its expected verdict."""
    want = f.expect.verdict
    if want is None:
        return verdict in PASSING, reason
    return verdict == want, f"negative test expects {want}, got {verdict}: {reason}"


def judge(s: Scenario, obs: Observation) -> VerdictRecord:
    """Judge one run of `s` by RULES (see the module docstring), then `negative_test`."""
    f = facts_of(s, obs)
    verdict, reason = next((d for rule in RULES if (d := rule(f)) is not None), None) \
        or as_expected(f)
    verdict, reason = unreached(f, verdict, reason)
    verdict, reason = blind(f, verdict, reason)
    passed, reason = negative_test(f, verdict, reason)
    expected = tuple(s.expect.fires) + tuple(s.expect.detected_by)
    first_kind = s.perturbations[0].kind if s.perturbations else "control"
    return VerdictRecord(
        scenario=s.name,
        verdict=verdict,
        passed=passed,
        reason=reason,
        signature=f"{verdict}|{','.join(sorted(f.fired))}|{first_kind}",
        landed=f.landed,
        firings=f.firings,
        latency={d: f.detected.get(d) for d in (*expected, *sorted(f.fired))},
        engine_outcome=f.outcome,
        ledgers=f.ledgers,
        seed=s.seed,
        engine=s.engine_knobs,
        expect=dataclasses.asdict(s.expect),
        extra={"crash": {k: v for k, v in f.crash.items() if k != "ts"}} if f.crash else {},
        cause=HARNESS if verdict == "INCONCLUSIVE" and harness_failure(f) else None,
    )
