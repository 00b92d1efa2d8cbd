"""How much a process group ran, and how long it waited for a CPU (Linux `/proc/<pid>/schedstat`).

A workload that stalls tells two stories apart by this: an engine that could not run (the machine
starved it: its threads waited on a run queue the whole window) is the harness's problem, while
one that ran and made no progress, or slept waiting on something, is the engine's hang.
"""

from __future__ import annotations

import os

__all__ = ["CpuTime", "group_cpu", "starved"]

CpuTime = tuple[float, float]  # (seconds on a CPU, seconds runnable but waiting for one)
STARVED_WAITING = 0.5  # waited for a CPU at least this share of the window
STARVED_RUNNING = 0.05  # and ran at most this share of it


def _group_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def group_cpu(pgid: int) -> CpuTime | None:
    """Every thread of every live process of group `pgid`, summed; None where /proc has no
    schedstat (no Linux, or scheduler statistics off)."""
    ran = waited = 0
    seen = False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if _group_of(pid) != pgid:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as stat:
                    fields = stat.read().split()
                ran, waited, seen = ran + int(fields[0]), waited + int(fields[1]), True
            except (OSError, IndexError, ValueError):
                continue
    return (ran / 1e9, waited / 1e9) if seen else None


def starved(before: CpuTime | None, after: CpuTime | None, window_s: float,
            max_running: float | None = STARVED_RUNNING) -> str | None:
    """How the machine starved the group between two readings `window_s` apart (it waited for a
    CPU at least half the window and, unless `max_running` is None, ran at most that share of it:
    a stalled engine that ran more was spinning, its own hang), or None (it was not, or /proc
    cannot say). None for `max_running` judges a workload that progressed but too slowly."""
    if before is None or after is None or window_s <= 0:
        return None
    ran, waited = max(0.0, after[0] - before[0]), max(0.0, after[1] - before[1])
    if waited >= STARVED_WAITING * window_s and (max_running is None or ran <= max_running * window_s):
        return f"the machine starved the engine: it waited {waited:.0f} s for a CPU and ran {ran:.1f} s"
    return None
