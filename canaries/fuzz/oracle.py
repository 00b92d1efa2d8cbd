"""The fuzzer's oracle: judge a run without a hand-written expectation.

A control (no perturbation) must be CLEAN: nothing fired, every request answered as planned,
every answer equal to the no-cache oracle. A perturbed run, in order:

1. the run told nothing (harness error) -> `inconclusive`; the engine raised -> finding
   `engine_error`; a request the workload's watchdog cut (no engine progress while it was
   outstanding, or the hard cap; `canaries.watchdog`) -> finding `hang`;
2. an answer cut short behind an HTTP 200 (fewer tokens than asked, no finish) -> finding
   `cut_short`, whatever fired;
3. a detector fired before the first landing -> finding `false_alarm`;
4. no perturbation landed -> `not_injected` (the generator's miss, not a finding; one that
   never landed beside one that did changed nothing, so the run is judged on those that did);
5. a detector fired after the landing -> `detected`;
6. nothing fired, and every damaged location died unread -> `not_reached`;
7. nothing fired, and some kind that landed has every detector it is caught by switched off
   in this engine (the KV canary off for content damage, invariants off) -> `disabled`, not a
   finding: the scenario turned off what would see it;
   nothing fired, yet a planned request was not served -> finding `unserved`;
8. nothing fired and the engine provably absorbed the damage -> `absorbed`: every idle ledger
   balanced and the radix cache sane, the engine's memory census (engine_stub/census.py, in the
   idle check's event) clean: no slot of either pool held by two owners at idle and no census
   rule failing, every answer equal to the no-cache oracle. A two-owner slot during the run that both owners wrote
   changes what one of them reads, so it shows as a wrong answer; one never written twice did
   no harm. Anything else -> finding `blind_spot`, with what was wrong.

With an sglang interpreter, the campaign also runs each scenario on SGLang's allocator: an
outcome that differs is a finding `parity` (`canaries/fuzz/campaign.py`).

A finding's signature names its class, the kinds, the fired detectors and, for a blind spot,
the symptoms and which detectors were on, so that a campaign counts distinct findings, not runs,
and shrinking keeps it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine_stub.perturb.kinds import KINDS

__all__ = ["FINDINGS", "Judgement", "judge_run"]

# Outcomes that are findings; the others say what the run did.
FINDINGS = frozenset({"false_alarm", "control_failed", "engine_error", "hang", "cut_short",
                      "unserved", "blind_spot", "parity"})


@dataclass(frozen=True)
class Judgement:
    """outcome: see the module docstring; finding: whether it is one; signature: what groups it
    with the same finding elsewhere; reason: one line for people."""

    outcome: str
    signature: str
    reason: str

    @property
    def finding(self) -> bool:
        return self.outcome in FINDINGS

    def to_dict(self) -> dict:
        return {**asdict(self), "finding": self.finding}


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _kinds(scenario: Any) -> str:
    return "+".join(sorted({p.kind for p in scenario.perturbations})) or "control"


def _cut_short(responses: list[dict]) -> list[str]:
    """200 answers with fewer tokens than asked (an engine answer cut short behind a 200)."""
    return [r["rid"] for r in responses
            if r.get("status") == 200 and r.get("output_ids") is not None
            and len(r["output_ids"]) != r.get("max_new_tokens")]


def _unserved(responses: list[dict]) -> list[str]:
    return [r["rid"] for r in responses if r.get("expect_status", 200) == 200
            and (r.get("status") != 200 or r.get("error"))]


def _symptoms(scenario: Any, events: list[dict], responses: list[dict], record: Any, run_dir: Path) -> list[str]:
    """What is wrong with a run nothing detected (empty: the engine absorbed the damage)."""
    from canaries.driver import make_plan
    from canaries.runner import oracle_mismatches

    server = record.extra.get("runtime") == "sglang-server"
    idle = [e for e in events if e.get("kind") == "idle_check"]
    if server and not idle:
        # The census could not run there (the release's objects, or switched off): what is
        # left to see is its answers, against a reference server's to the same plan.
        return _server_answers(scenario, record, run_dir, responses) if scenario.workload.temperature == 0 else []
    if not idle:
        return ["no idle check"]
    last = idle[-1]
    out = [f"ledger:{name}" for name, ledger in sorted((last.get("ledgers") or {}).items())
           if ledger.get("delta")]
    if last.get("radix_problems"):
        out.append("radix")
    census = last.get("census")
    if census is None:
        out.append("census:unknown")
    else:  # the engine's census summary (engine_stub/census.py `CensusReport.summary`)
        out += [f"held_twice:{k.removesuffix('_held_twice')}" for k, v in sorted(census.items())
                if k.endswith("_held_twice") and v]
        out += [f"census:{name.removeprefix('census.')}" for name, v in
                sorted((census.get("failures") or {}).items()) if v]
    if server:  # the census's idle summary on SGLang's server too (canaries/sglang/server/census.py)
        if scenario.workload.temperature == 0:
            out += _server_answers(scenario, record, run_dir, responses)
    elif scenario.workload.temperature == 0:
        start = next((e for e in events if e.get("kind") == "engine_start"), {})
        config = start.get("config") or dict(record.engine)
        plan = make_plan(scenario.workload, scenario.seed)
        if oracle_mismatches(config, plan, responses):
            out.append("answers")
    return out


def judge_run(scenario: Any, record: Any, run_dir: str | Path) -> Judgement:
    """Judge the run of `scenario` that left `record` (its VerdictRecord) and `run_dir`."""
    run_dir = Path(run_dir)
    events = _read_jsonl(run_dir / "events.jsonl")
    responses = _read_jsonl(run_dir / "responses.jsonl")
    kinds = _kinds(scenario)
    fired = sorted({f["detector"] for f in record.firings})
    fired_txt = ",".join(fired) or "-"

    def judged(outcome: str, reason: str, *extra: str) -> Judgement:
        return Judgement(outcome, "|".join((outcome, kinds, fired_txt, *extra)), reason)

    crash = record.extra.get("crash") or {}
    if crash.get("cause") == "error":
        return judged("engine_error", f"the engine raised: {crash.get('error', '')}"[:300],
                      str(crash.get("error", "")).split(":")[0][:60])
    if "harness error" in record.reason:
        return Judgement("inconclusive", "inconclusive", record.reason[:300])
    hung = [r["rid"] for r in responses if r.get("hang")]  # cut by the watchdog (canaries.watchdog)
    if hung or "timed out" in record.reason:
        return judged("hang", f"request(s) {', '.join(hung[:5]) or '?'} hung: {record.reason[:200]}")
    short = _cut_short(responses)
    if short:
        return judged("cut_short", f"HTTP 200 with fewer tokens than asked: {', '.join(short[:5])}")
    if not scenario.perturbations:
        if record.verdict == "CLEAN":
            return judged("clean", record.reason)
        outcome = "false_alarm" if record.verdict == "FALSE_ALARM" else "control_failed"
        return judged(outcome, record.reason[:300], *(() if record.verdict == "FALSE_ALARM"
                                                      else (record.reason.split(":")[0][:60],)))
    landed = [e for e in events if e.get("kind") == "perturbation_landed"]
    first = min((e.get("step") or 0 for e in landed), default=None)
    early = sorted({f["detector"] for f in record.firings if first is None or f["step"] < first})
    if early and first is not None:
        return judged("false_alarm", f"{', '.join(early)} fired before the first landing (step {first})")
    if not landed:
        return judged("not_injected", record.reason[:300])
    if fired:
        return judged("detected", record.reason[:300])
    consumed = [e for e in events if e.get("kind") == "perturbation_consumed"]
    died = [e for e in events if e.get("kind") == "perturbation_died"]
    if died and not consumed:
        return judged("not_reached", "every damaged location died unread")
    landed_kinds = sorted({scenario.perturbations[e["index"]].kind for e in landed
                           if isinstance(e.get("index"), int) and e["index"] < len(scenario.perturbations)})
    unseeable = [kind for kind in landed_kinds if not any(_enabled(d, scenario.engine)
                                                          for d in KINDS[kind].caught_by)]
    if unseeable:
        return judged("disabled", f"nothing fired: every detector of {', '.join(unseeable)} is "
                                  "off in this engine (the run shows what it costs: "
                                  f"{', '.join(_symptoms(scenario, events, responses, record, run_dir)) or 'nothing'})")
    unserved = _unserved(responses)
    if unserved:
        return judged("unserved", f"nothing fired, yet {', '.join(unserved[:5])} not served as planned",
                      _levels(scenario))
    symptoms = _symptoms(scenario, events, responses, record, run_dir)
    if not symptoms and record.extra.get("runtime") == "sglang-server":
        return judged("absorbed", "nothing fired; answers equal to a clean server's (SGLang's server: "
                                  "no census proves the memory state)")
    if not symptoms:
        return judged("absorbed", "nothing fired; ledgers balanced, no slot held twice, answers "
                                  "equal to the no-cache oracle")
    return judged("blind_spot", f"damage read, nothing fired, and: {', '.join(symptoms)}",
                  ",".join(symptoms), _levels(scenario))


def _server_answers(scenario: Any, record: Any, run_dir: Path, responses: list[dict]) -> list[str]:
    """["answers"] if the run's answers differ from a reference SGLang server's (["no oracle"] if
    none could be had), else []: what the run's own oracle found, if it judged (its verdict
    records it), else computed now."""
    from canaries.driver import make_plan
    from canaries.runner import patience_for
    from canaries.sglang.oracle import answer_mismatches
    from canaries.sglang.runtime import SGLangServerRuntime

    judged = record.extra.get("oracle") or {}
    if judged.get("judged") and "differs" in judged:
        return ["answers"] if judged["differs"] else []
    try:
        spec = json.loads((run_dir / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ["no oracle"]
    plan = make_plan(scenario.workload, scenario.seed)
    found, error = answer_mismatches(spec, plan, run_dir, scenario.workload, scenario.seed,
                                     patience_for(scenario.workload, SGLangServerRuntime), responses)
    if error:
        return ["no oracle"]
    return ["answers"] if found else []


def _enabled(detector: str, engine: Any) -> bool:
    """Whether `engine`'s knobs let `detector` fire: the KV canary's reasons need the canary
    on; the idle checks and the memory census always run at idle (their switch picks WARN or
    STRICT); every other invariant needs invariant_check above off."""
    if detector.startswith("kv_canary."):
        return engine.kv_canary != "off"
    if detector.startswith(("idle.", "census.")):
        return True
    return engine.invariant_check != "off"


def _levels(scenario: Any) -> str:
    e = scenario.engine
    return (f"inv={e.invariant_check},canary={e.kv_canary},page={'1' if e.page_size == 1 else '>1'},"
            f"radix={'on' if e.radix_cache else 'off'}")
