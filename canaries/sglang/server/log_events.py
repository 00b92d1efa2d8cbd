"""SGLang's own log lines, read as the suite's events, under the detector names the native engine
uses, so that a scenario's `expect` means the same on both runtimes.

One function per line SGLang writes (0.5.23, `python/sglang/srt/`), each returning the events the
verdict rules read (`invariant_firing`, `canary_violation`, `crash`, `idle_check`) or none;
`events_of_line` tries them all. The table in docs/sglang-server.md lists which line becomes which
detector. A KV-canary reason or an invariant our catalogue lacks keeps SGLang's own name, so it
shows up in reports as fired instead of vanishing.
"""

from __future__ import annotations

import re

from engine_stub.detectors import detector

__all__ = ["CANARY_REASONS", "events_of_line", "events_of_record"]

# kv_canary/runner/violation_reporter.py `_format_violation` (a format SGLang's tests freeze):
# `kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash+verify_position
# slot_idx=1 position=0 stored_token=10 expected_token=-1 stored_chain_hash=0x.. expected_aux=0x..`
_CANARY_RE = re.compile(
    r"kv_canary violation: launch_tag=(?P<tag>\S+) fail_reason=(?P<reasons>\S+) slot_idx=(?P<slot>-?\d+) "
    r"position=(?P<position>-?\d+) stored_token=(?P<stored>-?\d+) expected_token=(?P<expected>-?\d+)")
# SGLang's FailReason bits (kernels/ops/kv_canary/consts.py), labelled without `_mismatch`, and
# the engine's reason each one is.
CANARY_REASONS = {
    "verify_chain_hash": "verify_chain_hash",
    "verify_position": "verify_position",
    "verify_real_kv_hash": "verify_real_kv_hash",
    "write_token": "write_token",
    "write_position": "write_position",
    "verify_token": "verify_token",
}
# utils/invariants.py `_CheckReporter.report`: `invariant-check [name@rank0]: +k hit(s), T total. msg`
_HIT_RE = re.compile(r"invariant-check \[(?P<name>[A-Za-z0-9_.]+)@rank\d+\]: \+(?P<new>\d+) hit\(s\), "
                     r"(?P<total>\d+) total\.\s?(?P<msg>.*)")
# The strict path (and FATAL_UNCONTAINABLE at any level): `invariant-check FAILED [name]: msg`.
# A name is dotted words: a traceback that quotes SGLang's own source line
# (`f"invariant-check FAILED [{inv.name}]: {msg}"`) is not a firing.
_FAILED_RE = re.compile(r"invariant-check FAILED \[(?P<name>[A-Za-z0-9_.]+)\]:?\s?(?P<msg>.*)")
# managers/scheduler_components/invariant_checker.py: the idle memory check.
_LEAK_RE = re.compile(r"(?P<pool>[\w ]+?) memory leak detected!")
# Which idle ledger each of SGLang's leak reports is (a token-pool report whose pool lines parse
# is named by them instead).
IDLE_LEDGERS = {"req_to_token_pool": "idle.req_rows_ledger", "pool": "idle.full_ledger"}
# `_check_pool_invariant`'s message: available + evictable + protected + session_held + uncached
# must equal total; the token-pool report joins one such line per pool.
_POOL_LINE_RE = re.compile(r"(?:pool memory leak detected! |^)\[(?P<pool>full|swa)\] total=(?P<total>\d+), "
                           r"available=(?P<available>\d+), evictable=(?P<evictable>\d+), "
                           r"protected=(?P<protected>\d+), session_held=(?P<session_held>\d+), "
                           r"uncached=(?P<uncached>\d+)")


def _bucket(name: str) -> str:
    try:
        return detector(name).bucket
    except KeyError:  # one of SGLang's invariants the engine lacks: still reported, as SGLang's
        return "UNKNOWN"


def canary_events(line: str, step: int) -> list[dict]:
    match = _CANARY_RE.search(line)
    if match is None:
        return []
    tag = match["tag"]  # HEAD|TAIL|SWEEP _ K|V _ FULL|SWA
    parts = tag.split("_")
    return [{"kind": "canary_violation", "reason": CANARY_REASONS.get(reason, reason),
             "group": parts[-1] if len(parts) == 3 else tag, "phase": parts[0],
             "slot": int(match["slot"]), "position": int(match["position"]),
             "stored": int(match["stored"]), "expected": int(match["expected"]), "step": step,
             "launch_tag": tag}
            for reason in match["reasons"].split("+") if reason != "none"]


def hit_events(line: str, step: int, level: str) -> list[dict]:
    match = _HIT_RE.search(line)
    if match is None:
        return []
    name = match["name"]
    return [{"kind": "invariant_firing", "invariant": name, "bucket": _bucket(name), "level": level,
             "site": "sglang", "msg": match["msg"].strip(), "new_hits": int(match["new"]),
             "total_hits": int(match["total"]), "crashed": False, "step": step}]


def failed_events(line: str, step: int, level: str) -> list[dict]:
    match = _FAILED_RE.search(line)
    if match is None:
        return []
    name = match["name"]
    firing = {"kind": "invariant_firing", "invariant": name, "bucket": _bucket(name), "level": level,
              "site": "sglang", "msg": match["msg"].strip(), "new_hits": 1, "total_hits": 1,
              "crashed": True, "step": step}
    crash = {"kind": "crash", "cause": "invariant", "error": line.strip()[:2000], "invariant": name,
             "step": step}
    return [firing, crash]


def leak_events(line: str, step: int, level: str) -> list[dict]:
    match = _LEAK_RE.search(line)
    pool_line = _POOL_LINE_RE.search(line.strip())
    if match is None and pool_line is None:
        return []
    if pool_line is not None:
        # One pool's ledger of SGLang's token-pool leak report (the report's first line carries
        # [full], the next [swa]): only a pool whose ledger does not balance leaked.
        counts = {k: int(v) for k, v in pool_line.groupdict().items() if k != "pool"}
        if sum(v for k, v in counts.items() if k != "total") == counts["total"]:
            return []
        name = f"idle.{pool_line['pool']}_ledger"
    else:
        pool = match["pool"].strip().split()[-1]
        name = IDLE_LEDGERS.get(pool, f"idle.{pool}_ledger")
    return [{"kind": "invariant_firing", "invariant": name, "bucket": _bucket(name), "level": level,
             "site": "sglang idle check", "msg": line.strip()[:500], "new_hits": 1, "total_hits": 1,
             "crashed": False, "step": step}]


def events_of_line(line: str, *, step: int = 0, level: str = "WARN") -> list[dict]:
    """The events one line of SGLang's log reports (`step`: the scheduler's forward count then)."""
    found = canary_events(line, step)
    if found:
        return found
    for parse in (hit_events, failed_events, leak_events):
        found = parse(line, step, level)
        if found:
            return found
    return []


# The engine's detectors SGLang's server has (the table in docs/sglang-server.md): its own lines,
# and the suite's census and radix sanity check, run inside its scheduler process
# (canaries/sglang/server/census.py). `canary parity --runtime sglang-server` compares detectors within
# this set; the scheduler's stalls and prefix check and our allocator's drops exist on our engine
# only.
SERVER_DETECTORS = frozenset({
    "kv_canary.verify_chain_hash", "kv_canary.verify_position", "kv_canary.verify_real_kv_hash",
    "kv_canary.write_token", "swa.peer_mapped", "swa.peer_released", "idle.full_ledger",
    "idle.swa_ledger", "idle.req_rows_ledger", "alloc.pool_bound", "idle.radix_sanity",
    "census.slot_owner", "census.peer_live", "census.lock_count", "census.ledger", "census.row_matches",
})

# managers/scheduler.py run_scheduler_process: the scheduler's last words before it dies.
_SCHEDULER_DIED = "Scheduler hit an exception"
# The allocator's bound (mem_cache/allocator/swa.py `free_group_end` and the hybrid `free`): a plain
# `assert ...available_size() <= ...size`, which crashes at any invariant level. The memory-path
# backend records the same assert as `alloc.pool_bound` (engine_stub/mem/sglang_backend.py).
_POOL_BOUND_RE = re.compile(r"^\s*(?:assert\s+)?\(?\s*self\.\w+\.available_size\(\)\s*<=\s*self\.\w+\.size")


def _pool_bound(text: str, step: int, level: str) -> dict | None:
    """`alloc.pool_bound`'s firing where the traceback ends in the allocator's bound assert."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2 or lines[-1].strip() != "AssertionError" or not _POOL_BOUND_RE.search(lines[-2]):
        return None
    return {"kind": "invariant_firing", "invariant": "alloc.pool_bound", "bucket": _bucket("alloc.pool_bound"),
            "level": level, "site": "sglang", "msg": lines[-2].strip(), "new_hits": 1, "total_hits": 1,
            "crashed": True, "step": step}


def events_of_record(text: str, *, step: int = 0, level: str = "WARN") -> list[dict]:
    """The events of one log record (its lines, traceback included). A record saying the
    scheduler died ends with a `crash`: the invariant whose failure killed it (an idle leak report
    at strict too, as our engine's idle ledgers crash there), the KV canary's raise (its
    violations are in the record), else the exception's last line."""
    events = [event for line in text.splitlines() for event in events_of_line(line, step=step, level=level)]
    if _SCHEDULER_DIED not in text or any(e["kind"] == "crash" for e in events):
        return events
    firings = [e for e in events if e["kind"] == "invariant_firing"]
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    bound = _pool_bound(text, step, level)
    if bound is not None:
        firings.append(bound)
        events.append(bound)
    violations = [e for e in events if e["kind"] == "canary_violation"]
    if firings:
        for firing in firings:
            firing["crashed"] = True
        events.append({"kind": "crash", "cause": "invariant", "invariant": firings[-1]["invariant"],
                       "error": last[:2000], "step": step})
    elif violations:  # --kv-canary raise: its reporter raises with the violations' lines
        events.append({"kind": "crash", "cause": "kv_canary", "violations": len(violations),
                       "error": last[:2000], "step": step})
    else:
        events.append({"kind": "crash", "cause": "error", "error": last[:2000], "step": step})
    return events
