"""Verdicts from synthetic event logs, and the JSONL / JUnit reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from canaries.report import Interruption, append_verdict, read_run, read_verdicts, write_junit
from canaries.scenario import Disabled, Expect, Scenario, Workload
from canaries.verdict import PASSING, VERDICTS, Observation, VerdictRecord, judge
from engine_stub.config import EngineConfig
from engine_stub.perturb.spec import PerturbationSpec

ENGINE = {"invariant_check": "strict", "kv_canary": "log", "seed": 3}


def scenario(expect: Expect, *, perturbed: bool = True, engine: dict | None = None) -> Scenario:
    return Scenario(
        name="s", description="", seed=3, profile="cpu-tiny", engine=EngineConfig(**(engine or ENGINE)),
        workload=Workload(),
        perturbations=(PerturbationSpec("strip_swa_mapping"),) if perturbed else (),
        expect=expect, path="s.yaml",
    )


def ev(kind: str, step: int, **fields: object) -> dict:
    return {"seq": 0, "step": step, "kind": kind, "ts": 0.0, **fields}


def start(**config: object) -> dict:
    return ev("engine_start", 0, config={**ENGINE, **config})


def landed(step: int) -> dict:
    return ev("perturbation_landed", step, index=0, perturbation="strip_swa_mapping", site="before_step",
              rid="r0", before={}, after={})


def inv(name: str, step: int, bucket: str) -> dict:
    return ev("invariant_firing", step, invariant=name, bucket=bucket, level="STRICT", site="x",
              msg="m", new_hits=1, total_hits=1, crashed=False, slots=[])


def canary(reason: str, step: int) -> dict:
    return ev("canary_violation", step, reason=reason, group="SWA", phase="TAIL", slot=5)


def crash(step: int, cause: str = "invariant") -> dict:
    return ev("crash", step, cause=cause, error="boom", exit_code=3, detail={})


def shutdown(step: int) -> dict:
    return ev("shutdown", step)


def obs(events: list[dict], exit_code: int | None = 0, **kw: object) -> Observation:
    return Observation(events=events, responses=kw.pop("responses", []), exit_code=exit_code,
                       timed_out=bool(kw.pop("timed_out", False)),
                       oracle_mismatches=list(kw.pop("oracle_mismatches", [])), **kw)


FIRES = Expect(fires=("swa.peer_mapped",), within_steps=2, silent=("swa.peer_released",))
FIRES_CRASH = replace(FIRES, engine="crashes")
CLEAN = Expect(clean=True)
DISABLED = Expect(disabled=Disabled({"invariant_check": "off"}, "peer released first"),
                  detected_by=("kv_canary.verify_chain_hash",))
OFF = {**ENGINE, "invariant_check": "off"}

CASES = [
    ("detected", FIRES_CRASH, True,
     [start(), landed(5), inv("swa.peer_mapped", 6, "FATAL_UNCONTAINABLE"), crash(6)], 3,
     "DETECTED", True),
    ("late", FIRES,
     True, [start(), landed(5), inv("swa.peer_mapped", 9, "FATAL_UNCONTAINABLE"), shutdown(12)], 0,
     "LATE", False),
    ("missed", FIRES, True, [start(), landed(5), shutdown(12)], 0, "MISSED", False),
    ("missed-consumed", FIRES, True,
     [start(), landed(5), ev("perturbation_consumed", 6, index=0, by="a forward"), shutdown(12)], 0,
     "MISSED", False),
    ("not-reached", FIRES, True,
     [start(), landed(5), ev("perturbation_died", 7, index=0, by="its SWA row was freed"), shutdown(12)],
     0, "NOT_REACHED", False),
    ("wrong-via-silent", FIRES, True,
     [start(), landed(5), inv("swa.peer_mapped", 6, "FATAL_UNCONTAINABLE"),
      inv("swa.peer_released", 6, "GUARD"), shutdown(9)], 0, "WRONG_DETECTOR", False),
    ("wrong-via-other", FIRES, True,
     [start(), landed(5), inv("idle.swa_ledger", 8, "GUARD"), shutdown(9)], 0,
     "WRONG_DETECTOR", False),
    ("wrong-bucket", FIRES, True,
     [start(), landed(5), inv("swa.peer_mapped", 6, "GUARD"), shutdown(9)], 0,
     "WRONG_DETECTOR", False),
    ("false-alarm-clean", CLEAN, False, [start(), canary("verify_position", 3), shutdown(9)], 0,
     "FALSE_ALARM", False),
    ("false-alarm-before-landing", FIRES, True,
     [start(), inv("swa.peer_mapped", 2, "FATAL_UNCONTAINABLE"), landed(5), shutdown(9)], 0,
     "FALSE_ALARM", False),
    ("clean", CLEAN, False, [start(), shutdown(9)], 0, "CLEAN", True),
    ("not-injected", FIRES, True, [start(), shutdown(9)], 0, "NOT_INJECTED", False),
    ("killed", FIRES, True, [start(), landed(5)], -9, "INCONCLUSIVE", False),
    ("crash-error", FIRES, True, [start(), landed(5), crash(6, "error")], 1, "INCONCLUSIVE", False),
    ("engine-mismatch", FIRES_CRASH, True,
     [start(), landed(5), inv("swa.peer_mapped", 5, "FATAL_UNCONTAINABLE"), shutdown(9)], 0,
     "INCONCLUSIVE", False),
    ("disabled", DISABLED, True,
     [start(invariant_check="off"), landed(5), canary("verify_chain_hash", 7), shutdown(9)], 0,
     "DISABLED_AS_DECLARED", True),
    ("disabled-missed", DISABLED, True,
     [start(invariant_check="off"), landed(5), shutdown(9)], 0, "MISSED", False),
    ("disabled-not-in-force", DISABLED, True,
     [start(), landed(5), canary("verify_chain_hash", 7), shutdown(9)], 0, "INCONCLUSIVE", False),
    ("census-unreadable-clean", CLEAN, False,
     [start(), ev("census", 0, armed=False, unreadable=True, reason="X.y: not there"), shutdown(9)], 0,
     "INCONCLUSIVE", False),
    ("census-unreadable-missed", FIRES, True,
     [start(), ev("census", 0, armed=False, unreadable=True, reason="X.y: not there"), landed(5),
      shutdown(12)], 0, "INCONCLUSIVE", False),
    ("census-unreadable-detected-by-its-own", FIRES_CRASH, True,
     [start(), ev("census", 0, armed=False, unreadable=True, reason="X.y: not there"), landed(5),
      inv("swa.peer_mapped", 6, "FATAL_UNCONTAINABLE"), crash(6)], 3, "DETECTED", True),
    ("census-off-on-purpose-clean", CLEAN, False,
     [start(), ev("census", 0, armed=False, reason="CANARY_SERVER_CENSUS=off"), shutdown(9)], 0,
     "CLEAN", True),
    ("negative-missed", replace(FIRES, verdict="MISSED"), True,
     [start(), landed(5), shutdown(9)], 0, "MISSED", True),
    ("negative-unexpected", replace(FIRES, verdict="MISSED"), True,
     [start(), landed(5), inv("swa.peer_mapped", 6, "FATAL_UNCONTAINABLE"), shutdown(9)], 0,
     "DETECTED", False),
]


@pytest.mark.parametrize(("expect", "perturbed", "events", "exit_code", "verdict", "passed"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_judge_synthetic_run_gives_expected_verdict(
    expect: Expect, perturbed: bool, events: list[dict], exit_code: int, verdict: str, passed: bool
) -> None:
    engine = OFF if expect.disabled else ENGINE
    record = judge(scenario(expect, perturbed=perturbed, engine=engine), obs(events, exit_code))
    assert (record.verdict, record.passed) == (verdict, passed), record.reason
    assert record.verdict in VERDICTS and record.reason


def test_judge_cases_cover_every_verdict() -> None:
    assert {c[5] for c in CASES} == set(VERDICTS)
    assert PASSING == {"DETECTED", "DISABLED_AS_DECLARED", "CLEAN"}


def test_judge_detected_record_has_latency_signature_and_ledgers() -> None:
    ledgers = {"full": {"available": 10, "evictable": 0, "protected": 0, "total": 10, "delta": 0}}
    events = [start(), landed(5), inv("swa.peer_mapped", 7, "FATAL_UNCONTAINABLE"),
              ev("idle_check", 8, ledgers=ledgers, radix_problems=[], drops=0, balanced=True),
              crash(8)]
    record = judge(scenario(FIRES_CRASH), obs(events, 3))
    assert record.verdict == "DETECTED"
    assert record.latency["swa.peer_mapped"] == 2
    assert record.signature == "DETECTED|swa.peer_mapped|strip_swa_mapping"
    assert record.firings[0]["detector"] == "swa.peer_mapped" and record.firings[0]["latency"] == 2
    assert record.landed == [{k: v for k, v in landed(5).items() if k != "ts"}]
    assert record.ledgers == ledgers and record.engine_outcome == "crashed"
    assert json.loads(json.dumps(record.to_dict()))["verdict"] == "DETECTED"


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [({"responses": [{"rid": "r1", "status": 500}]}, "r1"),
     ({"oracle_mismatches": ["r2"]}, "no-cache oracle"),
     ({"timed_out": True}, "timed out"),
     ({"error": "driver blew up"}, "driver blew up")],
)
def test_judge_clean_run_with_bad_output_is_inconclusive(kw: dict, fragment: str) -> None:
    record = judge(scenario(CLEAN, perturbed=False), obs([start(), shutdown(9)], 0, **kw))
    assert record.verdict == "INCONCLUSIVE" and fragment in record.reason
    assert record.signature == "INCONCLUSIVE||control"


def test_judge_a_perturbation_that_never_landed_is_not_injected() -> None:
    # The second perturbation (the one the first only sets up) never landed: a miss proves nothing.
    two = replace(scenario(replace(FIRES, verdict="MISSED")),
                  perturbations=(PerturbationSpec("strip_swa_mapping"), PerturbationSpec("double_free_swa")))
    record = judge(two, obs([start(), landed(5), shutdown(9)], 0))
    assert record.verdict == "NOT_INJECTED" and not record.passed
    assert "perturbations[1] (double_free_swa) never landed" in record.reason
    both = [start(), landed(5), {**landed(6), "index": 1}, shutdown(9)]
    assert judge(two, obs(both, 0)).verdict == "MISSED"


def test_judge_killed_engine_reason_names_exit_code() -> None:
    record = judge(scenario(FIRES), obs([start(), landed(5)], -9))
    assert record.verdict == "INCONCLUSIVE" and "-9" in record.reason


def record(name: str, verdict: str, passed: bool) -> VerdictRecord:
    return VerdictRecord(scenario=name, verdict=verdict, passed=passed, reason=f"because {name}",
                         signature=f"{verdict}||control", landed=[], firings=[], latency={},
                         engine_outcome="survived", ledgers=None, seed=1, engine={}, expect={})


def test_write_junit_parses_with_right_counts(tmp_path: Path) -> None:
    records = [record("a", "DETECTED", True), record("b", "MISSED", False),
               record("c", "INCONCLUSIVE", False), record("d", "CLEAN", True)]
    path = tmp_path / "out" / "junit.xml"
    write_junit(records, path, durations={"a": 1.5})
    root = ET.parse(path).getroot()
    assert root.tag == "testsuite" and root.get("name") == "serving-canary"
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("4", "1", "1")
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"a", "b", "c", "d"} and cases["a"].get("time") == "1.500"
    assert all(c.get("classname") == "canary" for c in cases.values())
    assert cases["b"].find("failure").get("message") == "MISSED: because b"
    assert cases["c"].find("error") is not None and cases["a"].find("failure") is None
    props = {p.get("name"): p.get("value") for p in cases["b"].iter("property")}
    assert props == {"verdict": "MISSED", "signature": "MISSED||control", "seed": "1"}
    assert [p.name for p in path.parent.iterdir()] == ["junit.xml"]  # no temp file left


def test_append_verdict_keeps_earlier_lines(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    append_verdict(path, record("a", "DETECTED", True))
    first = path.read_bytes()
    append_verdict(path, record("b", "MISSED", False).to_dict())
    assert path.read_bytes().startswith(first)
    assert [r["scenario"] for r in read_verdicts(path)] == ["a", "b"]


def test_read_verdicts_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    append_verdict(path, record("a", "DETECTED", True))
    with open(path, "a") as f:
        f.write('{"scenario": "b", "verd')
    assert [r["scenario"] for r in read_verdicts(path)] == ["a"]
    append_verdict(path, record("c", "CLEAN", True))
    assert [r["scenario"] for r in read_verdicts(path)] == ["a", "c"]
    assert read_verdicts(tmp_path / "missing.jsonl") == []


def test_write_junit_of_an_interrupted_run_fails_and_says_interrupted(tmp_path: Path) -> None:
    records = [record("a", "CLEAN", True), record("b", "INCONCLUSIVE", False),
               record("c", "NOT_RUN", False)]
    interruption = Interruption("SIGTERM", ("a", "b", "c"), ("a",), ("b",), ("c",))
    path = tmp_path / "junit.xml"
    write_junit(records, path, interruption=interruption)
    root = ET.parse(path).getroot()
    props = {p.get("name"): p.get("value") for p in root.find("properties").iter("property")}
    assert props["interrupted"] == "SIGTERM" and "not run: c" in props["interrupted_summary"]
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert cases[("canary", "c")].find("error").get("type") == "NOT_RUN"
    assert cases[("canary.run", "interrupted")].find("error").get("type") == "INTERRUPTED"
    assert root.find(".//skipped") is None
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) \
        == ("4", "0", "3", "0")


def test_read_run_finds_the_run_record_and_read_verdicts_skips_it(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    append_verdict(path, record("a", "CLEAN", True))
    assert read_run(path) is None
    append_verdict(path, record("b", "NOT_RUN", False))
    append_verdict(path, Interruption("SIGINT", ("a", "b"), ("a",), (), ("b",)).to_dict())
    assert [r["scenario"] for r in read_verdicts(path)] == ["a", "b"]
    run = read_run(path)
    assert run["run"] == "interrupted" and run["cause"] == "SIGINT" and run["not_run"] == ["b"]


@pytest.mark.parametrize("bad", [
    {"cause": ""},
    {"judged": ("a",), "not_run": ("a", "b")},
    {"selected": ("a", "a")},
])
def test_interruption_that_does_not_partition_the_selection_is_refused(bad: dict) -> None:
    fields = {"cause": "SIGINT", "selected": ("a", "b"), "judged": ("a",), "interrupted": (),
              "not_run": ("b",), **bad}
    with pytest.raises(ValueError, match="Interruption"):
        Interruption(**fields)


def test_judge_detected_reason_reads_latency_in_steps() -> None:
    events = [start(), landed(5), inv("swa.peer_mapped", 7, "FATAL_UNCONTAINABLE"), crash(7)]
    record = judge(scenario(FIRES_CRASH), obs(events, 3))
    assert record.reason == "fired 2 steps after the perturbation landed: swa.peer_mapped"
    assert "+" not in record.reason


def test_steps_after_groups_detectors_by_latency_soonest_first() -> None:
    from canaries.verdict import steps_after

    assert steps_after({"b": 1}) == "fired 1 step after the perturbation landed: b"
    assert steps_after({"c": 3, "a": 0, "b": 0}) == \
        "fired 0 steps after the perturbation landed: a, b; 3 steps after: c"


def test_judge_rules_run_in_their_documented_order() -> None:
    from canaries.verdict import RULES

    assert [r.__name__ for r in RULES] == [
        "run_told_nothing", "clean_control", "not_injected", "silent_detectors",
        "alarm_before_landing", "disabled_as_declared", "expected_firings", "latency",
        "crash_expectation"]


@pytest.mark.parametrize(("kw", "exit_code", "events", "fragment"), [
    ({"error": "the clean server's oracle failed: RuntimeError: RemoteDisconnected"}, 0, [start(), shutdown(9)],
     "oracle failed"),
    ({"timed_out": True, "hang": "no engine progress for 240 s", "starved": "the machine starved the engine"},
     None, [start()], "no engine progress"),
    ({"responses": [{"rid": "r4", "status": None, "error": "RemoteDisconnected: Remote end closed connection"}]},
     -9, [start()], "lost connections"),
])
def test_judge_a_run_the_harness_failed_is_inconclusive_with_cause_harness(kw, exit_code, events, fragment) -> None:
    record = judge(scenario(CLEAN, perturbed=False), obs(events, exit_code, **kw))
    assert (record.verdict, record.cause) == ("INCONCLUSIVE", "harness") and fragment in record.reason


@pytest.mark.parametrize(("kw", "exit_code", "events"), [
    ({"error": "perturbations[0].kind: no hook in SGLang's scheduler", "unsupported": True}, None, [start()]),
    ({"timed_out": True, "hang": "no engine progress for 240 s"}, None, [start()]),  # the engine's hang
    ({"responses": [{"rid": "r4", "status": None, "error": "RemoteDisconnected: gone"}]}, 3,
     [start(), crash(4)]),  # the engine died of its own check: its connections went with it
    ({"responses": [{"rid": "r4", "status": None, "error": "ConnectionRefusedError: refused"}]}, -11, [start()]),
])
def test_judge_a_run_whose_engine_failed_has_no_harness_cause(kw, exit_code, events) -> None:
    record = judge(scenario(CLEAN, perturbed=False), obs(events, exit_code, **kw))
    assert record.verdict == "INCONCLUSIVE" and record.cause is None


def test_judge_a_clean_server_that_answered_an_error_is_no_oracle_and_the_releases() -> None:
    record = judge(scenario(CLEAN, perturbed=False),
                   obs([start(), shutdown(9)], 0, no_oracle="the release's own clean server answered r0002 "
                       "with HTTP 500 (Out of memory even after retracting)"))
    assert record.verdict == "INCONCLUSIVE" and record.cause is None
    assert record.reason.startswith("no oracle: the release's own clean server answered r0002 with HTTP 500")


def test_record_to_dict_is_asdicts_fresh_copy() -> None:
    import dataclasses

    record = VerdictRecord(
        scenario="s", verdict="DETECTED", passed=True, reason="r", signature="sig",
        landed=[{"step": 3, "slots": [1, 2]}], firings=[{"invariant": "x", "slots": (4, 5)}],
        latency={"x": 2, "y": None}, engine_outcome="ok", ledgers={"full": {"free": 3}}, seed=1,
        engine={"page_size": 16}, expect={"detect": ["x"]}, extra={"phases_s": {"start": 0.1}, "tags": {"a"}})
    plain = record.to_dict()
    assert plain == dataclasses.asdict(record)
    plain["landed"][0]["slots"].append(9)
    plain["extra"]["tags"].add("b")
    assert record.landed[0]["slots"] == [1, 2] and record.extra["tags"] == {"a"}
