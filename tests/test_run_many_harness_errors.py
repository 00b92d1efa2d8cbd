"""A harness failure in one scenario is that scenario's INCONCLUSIVE verdict; the run goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

import canaries.runner as runner
from canaries.conftest import engines_under
from canaries.runner import run_many
from canaries.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "configs" / "scenarios"
NAMES = ["leak-every-row-warn", "clean-page1-radix", "clean-hang-up-radix", "leak-request"]


@pytest.mark.slow
def test_run_many_with_harness_failures_judges_every_other_scenario(tmp_path, monkeypatch):
    scenarios = [load_scenario(SCENARIOS / f"{name}.yaml") for name in NAMES]
    before_engine, inside_run = scenarios[1], scenarios[2]

    spec_for = runner.spec_for

    def spec_for_failing_once(scenario, *args, **kwargs):
        if scenario is before_engine:  # before run_scenario's own error handling
            raise OSError("planted: the run dir's disk went away")
        return spec_for(scenario, *args, **kwargs)

    drive = runner.drive_workload

    def drive_failing_once(base_url, workload, *args, **kwargs):
        if workload is inside_run.workload:  # with the engine up: it must still be stopped
            raise ValueError("planted: Expecting value: line 1 column 1 (char 0)")
        return drive(base_url, workload, *args, **kwargs)

    monkeypatch.setattr(runner, "spec_for", spec_for_failing_once)
    monkeypatch.setattr(runner, "drive_workload", drive_failing_once)

    records = run_many(scenarios, tmp_path / "report", jobs=2, progress=False)

    by_name = {r.scenario: r for r in records}
    assert [r.scenario for r in records] == NAMES
    assert (by_name["clean-page1-radix"].verdict, by_name["clean-page1-radix"].reason) == (
        "INCONCLUSIVE", "harness error: OSError: planted: the run dir's disk went away")
    assert (by_name["clean-hang-up-radix"].verdict, by_name["clean-hang-up-radix"].reason) == (
        "INCONCLUSIVE", "harness error: ValueError: planted: Expecting value: line 1 column 1 (char 0)")
    for name in ("clean-page1-radix", "clean-hang-up-radix"):  # retried twice, then kept apart
        assert by_name[name].cause == "harness" and len(by_name[name].extra["harness_retries"]) == 2
        assert (tmp_path / "report" / f"{name}.harness-2").is_dir()
    assert by_name["leak-every-row-warn"].verdict == "DETECTED"
    assert by_name["leak-request"].verdict == "DETECTED"
    assert "interrupted" not in by_name["clean-page1-radix"].extra
    verdicts = (tmp_path / "report" / "verdicts.jsonl").read_text(encoding="utf-8")
    assert verdicts.count('"scenario"') == len(NAMES) and "NOT_RUN" not in verdicts
    assert (tmp_path / "report" / "junit.xml").exists()
    assert engines_under(tmp_path) == []


@pytest.mark.slow
def test_run_many_retries_a_run_the_harness_failed_and_keeps_the_engines_verdict(tmp_path, monkeypatch):
    scenario = load_scenario(SCENARIOS / "clean-page1-radix.yaml")
    drive = runner.drive_workload
    failures = []

    def drive_losing_the_first_connection(base_url, workload, *args, **kwargs):
        if not failures:  # a lost connection, once: the harness's failure, not the engine's
            failures.append(base_url)
            raise ConnectionResetError("planted: connection reset by peer")
        return drive(base_url, workload, *args, **kwargs)

    monkeypatch.setattr(runner, "drive_workload", drive_losing_the_first_connection)
    [record] = run_many([scenario], tmp_path / "report", progress=False)
    assert (record.verdict, record.cause) == ("CLEAN", None)
    assert record.extra["harness_retries"] == ["harness error: ConnectionResetError: planted: connection reset by peer"]
    assert (tmp_path / "report" / "clean-page1-radix.harness-1" / "verdict.json").is_file()
    assert engines_under(tmp_path) == []


class _RefusingRuntime:
    """An engine that stops at start the way a release without a CPU path does."""

    starts: list[Path] = []

    def __init__(self, **options: object) -> None:
        self.running = False

    def start(self, spec_path: Path, run_dir: Path) -> str:
        type(self).starts.append(Path(run_dir))
        (Path(run_dir) / "engine.log").write_text(
            "engine_stub.mem.sglang_backend.ReleaseUnsupported: SGLang 0.5.18's PagedTokenToKVPoolAllocator "
            "launches its Triton kernels: page_size 16 needs a CUDA device with this release\n", encoding="utf-8")
        raise RuntimeError("the engine exited with code 1 before it was ready")

    def stop(self, timeout: float = 10.0) -> int:
        return 1


def test_release_refusal_at_start_is_not_retried_and_names_the_release(tmp_path, monkeypatch):
    import canaries.runtime

    _RefusingRuntime.starts = []
    monkeypatch.setattr(canaries.runtime, "get_runtime", lambda name, **options: _RefusingRuntime(**options))
    [record] = run_many([load_scenario(SCENARIOS / "clean-page1-radix.yaml")], tmp_path / "report", progress=False)
    assert len(_RefusingRuntime.starts) == 1, "a refusal is the release's answer: no harness retry"
    assert (record.verdict, record.cause) == ("INCONCLUSIVE", None)
    assert record.reason.startswith("not run here: ReleaseUnsupported: SGLang 0.5.18's")
    assert "harness_retries" not in record.extra
