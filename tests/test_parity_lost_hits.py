"""`canary parity` and `canary matrix` hold SGLang's own log against the engine's firings: a hit
SGLang counted that the engine never reported makes the cell unexplained, whatever its verdict."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from canaries.sglang.parity import compare, lost_sglang_hits

SGLANG_LINE = "invariant-check [swa.peer_released@rank0]: +5 hit(s), 5 total. is_true: caller wants free\n"


def _run_dir(tmp_path: Path, log: str, firings: list[tuple[str, int]]) -> Path:
    tmp_path.joinpath("engine.log").write_text("engine_stub: ready\n" + log)
    lines = [json.dumps({"kind": "invariant_firing", "invariant": name, "total_hits": total})
             for name, total in firings]
    tmp_path.joinpath("events.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_lost_sglang_hits_names_a_hit_the_engine_never_reported(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, SGLANG_LINE, [("idle.swa_ledger", 1)])
    assert lost_sglang_hits(run) == "hits lost: swa.peer_released (SGLang logged 5, the engine reported 0)"


def test_lost_sglang_hits_is_empty_when_every_hit_was_reported(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, SGLANG_LINE, [("swa.peer_released", 5)])
    assert lost_sglang_hits(run) == ""


def test_compare_marks_lost_hits_unexplained_even_with_the_same_verdict() -> None:
    record = SimpleNamespace(scenario="s", verdict="DETECTED", firings=[{"name": "idle.swa_ledger"}], latency={})
    rows = compare([record], [record], {}, {"s": "hits lost: swa.peer_released"})
    assert rows[0].status == "unexplained" and "swa.peer_released" in rows[0].reason
    assert compare([record], [record], {})[0].status == "same"


def test_compare_marks_a_release_refusal_unsupported_not_unexplained(tmp_path: Path) -> None:
    from canaries.sglang.parity import unsupported_reason

    tmp_path.joinpath("engine.log").write_text(
        "Traceback ...\nengine_stub.mem.sglang_backend.ReleaseUnsupported: SGLang 0.5.18's paged "
        "allocator has no CPU path\n")
    why = unsupported_reason(tmp_path)
    assert why == "SGLang 0.5.18's paged allocator has no CPU path"
    native = SimpleNamespace(scenario="s", verdict="DETECTED", firings=[], latency={})
    refused = SimpleNamespace(scenario="s", verdict="INCONCLUSIVE", firings=[], latency={})
    assert compare([native], [refused], {}, {}, {"s": why})[0].status == "unsupported"
    assert compare([native], [refused], {}, {}, {})[0].status == "unexplained"


def _write_side(report: Path, side: str, rows: list[dict]) -> None:
    (report / side).mkdir(parents=True, exist_ok=True)
    (report / side / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rejudge_reads_a_report_back_and_counts_a_server_refusal_unsupported(tmp_path: Path) -> None:
    from canaries.sglang.parity import rejudge

    base = {"firings": [], "latency": {}, "passed": True}
    _write_side(tmp_path, "native", [{**base, "scenario": "a", "verdict": "CLEAN"},
                                     {**base, "scenario": "b", "verdict": "DETECTED"},
                                     {**base, "scenario": "c", "verdict": "DETECTED"}])
    _write_side(tmp_path, "sglang", [
        {**base, "scenario": "a", "verdict": "CLEAN"},
        {**base, "scenario": "b", "verdict": "INCONCLUSIVE",
         "reason": "harness error: ServerUnsupported: another engine_stub does not apply"},
        {**base, "scenario": "c", "verdict": "MISSED"}])
    (tmp_path / "parity.json").write_text(json.dumps({"sglang_version": "0.0.1", "runtime": "sglang-server"}))
    result = rejudge(tmp_path)
    assert [(r.scenario, r.status) for r in result.rows] == [("a", "same"), ("b", "unsupported"),
                                                             ("c", "unexplained")]
    assert "another engine_stub" in result.rows[1].reason and not result.ok
    assert "(server)" in (tmp_path / "parity.md").read_text()


def test_compare_accepts_any_of_the_verdicts_a_known_divergence_lists() -> None:
    native = SimpleNamespace(scenario="s", verdict="DETECTED", firings=[], latency={})
    known = {"s": {"verdict": ["NOT_INJECTED", "MISSED"], "reason": "timing"}}
    for seen in ("NOT_INJECTED", "MISSED"):
        server = SimpleNamespace(scenario="s", verdict=seen, firings=[], latency={})
        assert compare([native], [server], known)[0].status == "known"
    late = SimpleNamespace(scenario="s", verdict="LATE", firings=[], latency={})
    row = compare([native], [late], known)[0]
    assert row.status == "unexplained" and row.reason == "recorded as NOT_INJECTED or MISSED, got LATE"
