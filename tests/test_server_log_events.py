"""SGLang's log lines read as the suite's events (canaries/sglang/server/log_events.py): the lines below
are SGLang 0.5.23's, as its server wrote them on this machine's CPU."""

from __future__ import annotations

from canaries.sglang.server.knobs import KNOB_INDEX_ENV
from canaries.sglang.server.log_events import events_of_line, events_of_record
from canaries.verdict.record import detector_of

CANARY_LINE = ("[2026-12-03 10:02:11] kv_canary violation: launch_tag=HEAD_K_FULL "
               "fail_reason=verify_chain_hash+verify_position slot_idx=1 position=0 stored_token=10 "
               "expected_token=-1 stored_chain_hash=0x00000000deadbeef expected_aux=0x0000000000000001")
HIT_LINE = ("[2026-12-03 10:02:11] invariant-check [swa.peer_released@rank0]: +1 hit(s), 1 total. "
            "is_true: caller wants free")
FAILED_LINE = "RuntimeError: invariant-check FAILED [swa.peer_mapped]: is_true: caller wants free_full"
LEAK_LINE = ("[2026-12-03 10:02:11] req_to_token_pool memory leak detected!available_size=3, "
             "session_held=0, total_size=4")


def test_canary_line_becomes_one_violation_per_reason_under_the_engines_names() -> None:
    events = events_of_line(CANARY_LINE, step=7)
    assert [detector_of(e) for e in events] == ["kv_canary.verify_chain_hash", "kv_canary.verify_position"]
    assert events[0]["group"] == "FULL" and events[0]["phase"] == "HEAD"
    assert events[0]["slot"] == 1 and events[0]["position"] == 0 and events[0]["step"] == 7


def test_invariant_hit_line_becomes_a_counted_firing_with_the_catalogue_bucket() -> None:
    (event,) = events_of_line(HIT_LINE, step=3, level="WARN")
    assert detector_of(event) == "swa.peer_released"
    assert event["bucket"] == "GUARD" and event["crashed"] is False
    assert event["new_hits"] == 1 and event["msg"] == "is_true: caller wants free"


def test_failed_invariant_line_is_a_crashing_firing_then_the_crash() -> None:
    firing, crash = events_of_line(FAILED_LINE, step=4, level="STRICT")
    assert detector_of(firing) == "swa.peer_mapped" and firing["crashed"] is True
    assert firing["bucket"] == "FATAL_UNCONTAINABLE"
    assert crash["kind"] == "crash" and crash["cause"] == "invariant" and crash["invariant"] == "swa.peer_mapped"


def test_idle_leak_line_is_the_matching_idle_ledger() -> None:
    (event,) = events_of_line(LEAK_LINE, step=9)
    assert detector_of(event) == "idle.req_rows_ledger"


def test_unknown_invariant_keeps_sglangs_name_and_ordinary_lines_report_nothing() -> None:
    (event,) = events_of_line("invariant-check [radix.lock_ref@rank0]: +2 hit(s), 2 total. x", step=1)
    assert detector_of(event) == "radix.lock_ref" and event["bucket"] == "UNKNOWN"
    assert events_of_line("[2026-12-03] Prefill batch. #new-seq: 1, #new-token: 5", step=1) == []
    assert events_of_line("kv_canary perturb: enabled after warmup window at step=0", step=1) == []


def test_plugin_writes_sglang_records_as_events_stamped_with_the_scheduler_step(tmp_path, monkeypatch) -> None:
    import json
    import logging

    from canaries.sglang.server import scheduler_plugin

    class FakeScheduler:
        def __init__(self) -> None:
            self.forward_ct = 0

    monkeypatch.setenv(scheduler_plugin.EVENT_LOG_ENV, str(tmp_path / "events.jsonl"))
    monkeypatch.setenv(KNOB_INDEX_ENV, '{"req_to_token": 0}')
    monkeypatch.setenv("SGLANG_INVARIANT_CHECK", "1")
    scheduler_plugin._watch(FakeScheduler)
    scheduler = FakeScheduler()
    logger = logging.getLogger("sglang.srt.kv_canary.runner.violation_reporter")
    try:
        scheduler.forward_ct = 2
        logger.warning("kv_canary perturb req_to_token: req_pool_idx=4 position=2 original_slot=3 new_slot=1")
        scheduler.forward_ct = 3
        logger.warning(CANARY_LINE)
        logger.warning(HIT_LINE)
    finally:
        for handler in list(logging.getLogger("sglang").handlers):
            if isinstance(handler, scheduler_plugin.EventLogHandler):
                logging.getLogger("sglang").removeHandler(handler)
                handler.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["engine_start", "census", "perturbation_landed", "canary_violation",
                                           "canary_violation", "invariant_firing"]
    census = events.pop(1)  # a scheduler with no memory pools: the census says it cannot read one
    assert census["armed"] is False and census["unreadable"] is True
    landed = events[1]
    assert landed["step"] == 2 and landed["index"] == 0 and landed["landing"] == 1
    assert landed["damage"] == [{"kind": "req_to_token", "position": 2, "row": 4, "before": 3, "after": 1,
                                 "detail": "sglang_perturb"}]
    assert {e["step"] for e in events[2:]} == {3}
    assert events[4]["level"] == "WARN" and [e["seq"] for e in events] == [1, 3, 4, 5, 6]


def test_scheduler_death_by_an_idle_leak_is_that_ledgers_crash() -> None:
    record = ("Scheduler hit an exception: Traceback (most recent call last):\n"
              '  File "scheduler.py", line 6367, in run_scheduler_process\n'
              "ValueError: pool memory leak detected! [full] total=2048, available=2047, evictable=0")
    firing, crash = events_of_record(record, step=40, level="STRICT")
    assert detector_of(firing) == "idle.full_ledger" and firing["crashed"] is True
    assert crash == {"kind": "crash", "cause": "invariant", "invariant": "idle.full_ledger",
                     "error": "ValueError: pool memory leak detected! [full] total=2048, available=2047, evictable=0",
                     "step": 40}


def test_scheduler_death_by_anything_else_is_an_error_crash() -> None:
    (crash,) = events_of_record("Scheduler hit an exception: Traceback\nKeyError: 'x'", step=3)
    assert crash["cause"] == "error" and crash["error"] == "KeyError: 'x'"
    failed = events_of_record("Scheduler hit an exception: Traceback\n" + FAILED_LINE, step=3)
    assert [e["kind"] for e in failed] == ["invariant_firing", "crash"]  # the invariant's own crash


def test_a_traceback_quoting_sglangs_source_line_is_no_firing() -> None:
    quoted = '    torch._assert_async(ok.all(), f"invariant-check FAILED [{inv.name}]: {msg}")'
    assert events_of_line(quoted, step=2) == []
    record = "Scheduler hit an exception: Traceback\n" + quoted + "\n" + FAILED_LINE
    assert [detector_of(e) for e in events_of_record(record, step=2)] == ["swa.peer_mapped", None]


def test_token_pool_leak_report_names_each_pool_whose_ledger_does_not_balance() -> None:
    record = ("pool memory leak detected! [full] total=2048, available=1612, evictable=356, protected=41, "
              "session_held=0, uncached=0\n[swa] total=320, available=80, evictable=201, protected=16, "
              "session_held=0, uncached=0")
    assert [e["invariant"] for e in events_of_record(record)] == ["idle.full_ledger", "idle.swa_ledger"]
    swa_only = ("[2026-12-04 19:19:20] pool memory leak detected! [full] total=8, available=8, evictable=0, "
                "protected=0, session_held=0, uncached=0\n[swa] total=4, available=1, evictable=0, protected=0, "
                "session_held=0, uncached=0")
    assert [e["invariant"] for e in events_of_record(swa_only)] == ["idle.swa_ledger"]


def test_scheduler_death_by_the_allocators_bound_assert_is_alloc_pool_bound() -> None:
    record = ("Scheduler hit an exception: Traceback (most recent call last):\n"
              '  File "sglang/srt/mem_cache/allocator/swa.py", line 663, in free_group_end\n'
              "    self.full_attn_allocator.available_size() <= self.full_attn_allocator.size\n"
              "AssertionError\n")
    firing, crash = events_of_record(record, step=82, level="STRICT")
    assert detector_of(firing) == "alloc.pool_bound" and firing["crashed"] is True
    assert crash["cause"] == "invariant" and crash["invariant"] == "alloc.pool_bound"
    other = events_of_record("Scheduler hit an exception: Traceback\n    assert x < 3\nAssertionError\n", step=1)
    assert [e["cause"] for e in other] == ["error"]


def test_scheduler_death_by_the_canarys_raise_is_a_kv_canary_crash() -> None:
    record = ("Scheduler hit an exception: Traceback (most recent call last):\n"
              '    raise RuntimeError("\\n".join(messages))\n'
              "RuntimeError: kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash "
              "slot_idx=119 position=34 stored_token=39 expected_token=-1\n"
              "  total_violations=2 ring_overflow=False step_when_pumped=7\n")
    *violations, crash = events_of_record(record, step=7, level="STRICT")
    assert [v["reason"] for v in violations] == ["verify_real_kv_hash"]
    assert crash["kind"] == "crash" and crash["cause"] == "kv_canary" and crash["violations"] == 1
