"""`canaries.report.diff`: two run reports compared scenario by scenario, on synthetic reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.report.diff import DiffResult, ReportError, diff_runs, load_report, main


def record(name: str, verdict: str = "DETECTED", passed: bool | None = None,
           detectors: tuple[str, ...] = ("swa.peer_mapped",), latency: dict | None = None,
           kind: str = "strip_swa_mapping", expect_verdict: str | None = None,
           reason: str | None = None) -> dict:
    """One verdicts.jsonl line, shaped like the runner's."""
    if passed is None:
        passed = verdict in ("DETECTED", "DISABLED_AS_DECLARED", "CLEAN")
    if latency is None:
        latency = dict.fromkeys(detectors, 1)
    return {
        "scenario": name, "verdict": verdict, "passed": passed,
        "reason": reason or f"{verdict.lower()} for {name}",
        "signature": f"{verdict}|{','.join(sorted(detectors))}|{kind}",
        "landed": [{"step": 2, "index": 0, "perturbation": kind}],
        "firings": [{"detector": d, "step": 2 + (latency.get(d) or 0),
                     "latency": latency.get(d)} for d in detectors],
        "latency": latency, "engine_outcome": "crashed", "ledgers": None, "seed": 1,
        "engine": {}, "expect": {"fires": list(detectors)[:1], "verdict": expect_verdict},
        "extra": {},
    }


def report(path: Path, *records: dict, run: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + ([json.dumps(run)] if run else [])
    (path / "verdicts.jsonl").write_text("".join(line + "\n" for line in lines))
    return path


BASE = (record("a"), record("b"), record("c", "CLEAN", detectors=(), kind="control"),
        record("neg", "MISSED", passed=True, detectors=(), expect_verdict="MISSED"))


def test_identical_runs_no_change(tmp_path):
    base = report(tmp_path / "base", *BASE)
    run = report(tmp_path / "run", *BASE)
    d = diff_runs(base, run)
    assert not d.regressed and not d.changed
    assert d.unchanged == 4
    assert "no change (4 scenario(s) compared)" in d.to_text()
    assert main([str(base), str(run)]) == 0


def test_new_failures_grouped_by_signature_and_exit_1(tmp_path, capsys):
    base = report(tmp_path / "base", *BASE)
    run = report(tmp_path / "run",
                 record("a", "WRONG_DETECTOR", detectors=("swa.peer_released",)),
                 record("b", "WRONG_DETECTOR", detectors=("swa.peer_released",)),
                 record("c", "FALSE_ALARM", detectors=("idle.full_ledger",), kind="control"),
                 BASE[3])
    d = diff_runs(base, run)
    assert d.regressed
    assert [c.scenario for c in d.new_failures] == ["a", "b", "c"]
    groups = d.new_failures_by_signature()
    assert list(groups) == ["WRONG_DETECTOR|swa.peer_released|strip_swa_mapping",
                            "FALSE_ALARM|idle.full_ledger|control"]  # the largest group first
    assert [c.scenario for c in groups["WRONG_DETECTOR|swa.peer_released|strip_swa_mapping"]] \
        == ["a", "b"]
    assert not d.changed_detector  # a new failure is reported once, as a new failure
    text = d.to_text()
    assert "REGRESSED: 3 scenario(s) passed in BASE and fail in RUN" in text
    assert "  WRONG_DETECTOR|swa.peer_released|strip_swa_mapping  (2)" in text
    assert "    a: DETECTED -> WRONG_DETECTOR: wrong_detector for a" in text
    assert main([str(base), str(run)]) == 1
    assert "REGRESSED" in capsys.readouterr().out


def test_fixed_is_not_a_regression(tmp_path):
    base = report(tmp_path / "base", record("a", "MISSED", detectors=()), BASE[1])
    run = report(tmp_path / "run", record("a"), BASE[1])
    d = diff_runs(base, run)
    assert [c.scenario for c in d.fixed] == ["a"] and not d.regressed
    assert "fixed (1):\n  a: MISSED -> DETECTED" in d.to_text()
    assert main([str(base), str(run)]) == 0


def test_changed_detector_same_pass_state(tmp_path):
    base = report(tmp_path / "base", record("a", detectors=("swa.peer_mapped", "idle.swa_ledger")))
    run = report(tmp_path / "run", record("a", detectors=("swa.peer_mapped", "kv_canary.verify_position")))
    d = diff_runs(base, run)
    assert not d.regressed
    (c,) = d.changed_detector
    assert c.detectors_added == ("kv_canary.verify_position",)
    assert c.detectors_removed == ("idle.swa_ledger",)
    assert "a: DETECTED: +kv_canary.verify_position -idle.swa_ledger" in d.to_text()
    # the signature names the detectors: that change is reported once, as a detector change
    assert not d.changed_verdict


def test_changed_verdict_between_failures_is_not_a_regression(tmp_path):
    base = report(tmp_path / "base", record("a", "MISSED", detectors=()))
    run = report(tmp_path / "run", record("a", "WRONG_DETECTOR", detectors=("x.y",)))
    d = diff_runs(base, run)
    assert not d.regressed
    assert [c.scenario for c in d.changed_verdict] == ["a"]
    assert main([str(base), str(run)]) == 0


@pytest.mark.parametrize(("base_lat", "run_lat", "threshold", "reported"), [
    (1, 3, 2, False),   # moved by exactly the threshold
    (1, 4, 2, True),    # beyond it
    (5, 1, 2, True),    # faster counts too
    (1, 2, 0, True),
    (1, 4, 5, False),
])
def test_latency_threshold(tmp_path, base_lat, run_lat, threshold, reported):
    base = report(tmp_path / "base", record("a", latency={"swa.peer_mapped": base_lat}))
    run = report(tmp_path / "run", record("a", latency={"swa.peer_mapped": run_lat}))
    d = diff_runs(base, run, latency_threshold_steps=threshold)
    assert bool(d.changed_latency) is reported
    assert not d.regressed
    if reported:
        assert d.changed_latency[0].latency == {"swa.peer_mapped": (base_lat, run_lat)}
        assert f"a: swa.peer_mapped {base_lat} -> {run_lat} steps" in d.to_text()


def test_latency_of_a_detector_that_did_not_fire_is_not_a_latency_change(tmp_path):
    base = report(tmp_path / "base", record("a", latency={"swa.peer_mapped": 1}))
    run = report(tmp_path / "run", record("a", latency={"swa.peer_mapped": None}))
    assert not diff_runs(base, run).changed_latency


def test_added_and_removed(tmp_path):
    base = report(tmp_path / "base", record("a"), record("gone", "CLEAN", detectors=()))
    run = report(tmp_path / "run", record("a"), record("new-ok"), record("new-bad", "MISSED",
                                                                           detectors=()))
    d = diff_runs(base, run)
    assert [a["scenario"] for a in d.added] == ["new-bad", "new-ok"]
    assert [r["scenario"] for r in d.removed] == ["gone"]
    assert not d.regressed  # a new scenario that fails is no pass that now fails
    text = d.to_text()
    assert "  new-bad: MISSED (failing)" in text and "  gone: was CLEAN" in text


def test_negative_test_uses_passed_not_the_verdict(tmp_path):
    # A negative test passes with MISSED; reporting DETECTED instead is a regression.
    base = report(tmp_path / "base", BASE[3])
    run = report(tmp_path / "run", record("neg", "DETECTED", passed=False,
                                          expect_verdict="MISSED"))
    d = diff_runs(base, run)
    assert d.regressed and d.new_failures[0].run_verdict == "DETECTED"


def test_interrupted_run(tmp_path):
    base = report(tmp_path / "base", record("a"), record("b"))
    run = report(tmp_path / "run", record("a"),
                 record("b", "NOT_RUN", detectors=(), reason="not run: interrupted"),
                 run={"run": "interrupted", "cause": "SIGINT",
                      "summary": "the run was interrupted (SIGINT): 1 of 2 scenario(s) judged"})
    d = diff_runs(base, run)
    assert d.regressed and d.new_failures[0].scenario == "b"
    assert d.run_interrupted["cause"] == "SIGINT" and d.base_interrupted is None
    assert "note: RUN was interrupted: the run was interrupted (SIGINT)" in d.to_text()


def test_last_record_of_a_name_wins(tmp_path):
    base = report(tmp_path / "base", record("a"))
    run = report(tmp_path / "run", record("a", "MISSED", detectors=()), record("a"))
    assert not diff_runs(base, run).changed


def test_json_output(tmp_path, capsys):
    base = report(tmp_path / "base", *BASE)
    run = report(tmp_path / "run", record("a", "LATE"), *BASE[1:])
    assert main([str(base), str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["regressed"] is True
    assert data["new_failures_by_signature"] == {"LATE|swa.peer_mapped|strip_swa_mapping": ["a"]}
    assert data["new_failures"][0]["base_verdict"] == "DETECTED"
    assert set(data) >= {"fixed", "changed_detector", "changed_latency", "added", "removed",
                         "unchanged", "base", "run", "latency_threshold_steps"}
    assert json.loads(diff_runs(base, run).to_json()) == data


@pytest.mark.parametrize("make", ["missing", "file", "no_verdicts", "empty", "corrupt", "no_name"])
def test_bad_input_exits_2_naming_the_path(tmp_path, capsys, make):
    good = report(tmp_path / "good", record("a"))
    bad = tmp_path / "bad"
    if make == "file":
        bad.write_text("x")
    elif make == "no_verdicts":
        bad.mkdir()
        (bad / "junit.xml").write_text("<testsuite/>")
    elif make == "empty":
        report(bad)
    elif make == "corrupt":
        bad.mkdir()
        # not a torn write (those are skipped): a whole line that is no JSON
        (bad / "verdicts.jsonl").write_text('{"scenario": "a",}\n{"scenario": "b", "verdict": "X"}\n')
    elif make == "no_name":
        bad.mkdir()
        (bad / "verdicts.jsonl").write_text('{"verdict": "DETECTED"}\n')
    for argv in ([str(good), str(bad)], [str(bad), str(good)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and err.startswith("canary diff: ")
    with pytest.raises(ReportError, match=str(bad)):
        load_report(bad)


def test_a_verdicts_file_is_accepted_for_its_directory(tmp_path):
    base = report(tmp_path / "base", record("a"))
    run = report(tmp_path / "run", record("a"))
    assert not diff_runs(base / "verdicts.jsonl", run).changed


def test_bad_threshold(tmp_path):
    base = report(tmp_path / "base", record("a"))
    assert main([str(base), str(base), "--latency-threshold", "-1"]) == 2
    with pytest.raises(ValueError):
        diff_runs(base, base, latency_threshold_steps=-1)


def test_usage_error_exits_2():
    assert main([]) == 2


def test_module_entry_point(tmp_path):
    base = report(tmp_path / "base", record("a"))
    run = report(tmp_path / "run", record("a", "MISSED", detectors=()))
    proc = subprocess.run([sys.executable, "-m", "canaries.report.diff", str(base), str(run)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "new failures (1), by signature:" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "canaries.report.diff", str(base),
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope: no such directory" in proc.stderr


def test_result_is_a_value():
    d = DiffResult(base="b", run="r", latency_threshold_steps=2)
    assert not d.regressed and not d.changed and d.to_dict()["new_failures"] == []


def test_canary_diff_command_exits_1_on_a_regression_and_writes_the_html_section(tmp_path, capsys):
    from canaries.cli import main as canary

    base = report(tmp_path / "base", *BASE)
    broken = (record("a", "MISSED", passed=False, detectors=()), *BASE[1:])
    run = report(tmp_path / "run", *broken)
    assert canary(["diff", str(base), str(base)]) == 0
    assert canary(["diff", str(base), str(run), "--html"]) == 1
    out = capsys.readouterr().out
    assert "a: DETECTED -> MISSED" in out
    page = (run / "index.html").read_text()
    assert 'data-regressed="true"' in page
    assert canary(["diff", str(base), str(tmp_path / "nowhere")]) == 2


def test_canary_report_command_writes_index_html(tmp_path):
    from canaries.cli import main as canary

    run = report(tmp_path / "run", *BASE)
    assert canary(["report", str(run)]) == 0
    assert "<html" in (run / "index.html").read_text()


@pytest.mark.slow
def test_diff_of_a_run_against_a_planted_regression_exits_1_naming_scenarios_and_signatures(tmp_path, capsys):
    from canaries.cli import main as canary

    select = ["-k", "leak-request or clean-page1-radix", "--jobs", "2"]
    assert canary(["run", *select, "--report-dir", str(tmp_path / "base")]) == 0
    assert canary(["run", *select, "--regression", "ledgers.full-never-fails",
                   "--report-dir", str(tmp_path / "planted")]) == 1
    capsys.readouterr()
    assert canary(["diff", str(tmp_path / "base"), str(tmp_path / "planted")]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out
    assert "leak-request-strict-idle: DETECTED -> WRONG_DETECTOR" in out
    # The census sees the leak the blinded ledger no longer reports (issue 25): its rules join
    # the signature.
    assert "WRONG_DETECTOR|census.ledger,census.slot_owner,idle.swa_ledger|leak_request" in out
    assert "clean-page1-radix" not in out.split("new failures", 1)[1].split("unchanged", 1)[0]


def test_new_failure_that_passes_when_run_again_is_flaky_not_a_regression(tmp_path):
    base = report(tmp_path / "base", *BASE)
    run = report(tmp_path / "run", record("a", "MISSED", detectors=()), *BASE[1:])
    again = {"a": record("a")}  # RUN's side runs `a` again: it passes
    d = diff_runs(base, run).confirm(2, lambda names, attempt: {n: again[n] for n in names})
    assert not d.regressed and [c.scenario for c in d.flaky] == ["a"] and d.new_failures == ()
    assert d.confirmations["a"].after == (("MISSED", False), ("DETECTED", True), ("DETECTED", True))
    assert "FLAKY (1)" in d.to_text() and "no regression" in d.to_text()
    assert diff_runs(base, run).confirm(2, lambda names, attempt: {n: again[n] for n in names},
                                        flaky="fail").regressed


def test_new_failure_that_fails_every_rerun_stays_a_regression(tmp_path):
    base = report(tmp_path / "base", *BASE)
    run = report(tmp_path / "run", record("a", "MISSED", detectors=()), *BASE[1:])
    calls = []

    def rerun(names, attempt):
        calls.append((tuple(names), attempt))
        return {n: record(n, "MISSED", detectors=()) for n in names}

    d = diff_runs(base, run).confirm(2, rerun)
    assert d.regressed and [c.scenario for c in d.new_failures] == ["a"] and d.flaky == ()
    assert calls == [(("a",), 1), (("a",), 2)]


@pytest.mark.slow
def test_canary_diff_reruns_a_new_failure_as_it_ran_and_calls_it_flaky(tmp_path, capsys):
    """A run whose record says a clean control failed (as a loaded machine's run once did), and
    which passes when `canary diff --reruns` runs it again from its run dir: FLAKY, exit 0."""
    from canaries.cli import main as canary

    scenario = Path(__file__).resolve().parents[1] / "configs" / "scenarios" / "clean-page1-radix.yaml"
    base, run = tmp_path / "base", tmp_path / "run"
    assert canary(["run", str(scenario), "--report-dir", str(base)]) == 0
    assert canary(["run", str(scenario), "--report-dir", str(run)]) == 0
    lines = (run / "verdicts.jsonl").read_text().splitlines()
    failed = {**json.loads(lines[0]), "verdict": "INCONCLUSIVE", "passed": False, "reason": "a loaded machine"}
    (run / "verdicts.jsonl").write_text(json.dumps(failed) + "\n")
    capsys.readouterr()
    assert canary(["diff", str(base), str(run), "--reruns", "1"]) == 0
    out = capsys.readouterr().out
    assert "FLAKY (1)" in out and "clean-page1-radix" in out
    assert (run / "reruns" / "rerun-1" / "clean-page1-radix" / "verdict.json").is_file()
    assert canary(["diff", str(base), str(run), "--reruns", "1", "--flaky", "fail"]) == 1
