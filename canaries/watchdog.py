"""The workload's watchdog: a hang is judged by the engine's progress, not by the clock alone.

While requests are outstanding the watchdog probes the engine's progress (its step counter,
generated tokens, completed requests) every `poll_s`. Any change restarts the stall clock, so a
slow engine (a loaded runner, a GPU shared by eight engines) is never called hung; only
`stall_s` without any progress while requests are outstanding is a hang. `hard_cap_s` bounds the
whole workload however the engine progresses, so nothing runs forever. Either way the watchdog
aborts every outstanding request (each registered its own abort) and keeps the reason, which
says which of the two it was.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from canaries.schedstat import CpuTime, starved

__all__ = ["Patience", "Watchdog"]


@dataclass(frozen=True)
class Patience:
    """How long a workload may wait on its engine.

    stall_s: no progress for this long with requests outstanding is a hang.
    hard_cap_s: the whole workload, however the engine progresses.
    poll_s: how often the engine's progress is probed.
    """

    stall_s: float = 30.0
    hard_cap_s: float = 600.0
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("stall_s", "hard_cap_s", "poll_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Patience.{name}={value!r}: must be a finite number > 0")
        if self.poll_s > self.stall_s:
            raise ValueError(f"Patience.poll_s={self.poll_s} must not exceed stall_s={self.stall_s}")
        if self.stall_s > self.hard_cap_s:
            raise ValueError(f"Patience.stall_s={self.stall_s} must not exceed hard_cap_s={self.hard_cap_s}")


class Watchdog:
    """Watches one workload. `probe()` returns a snapshot of the engine's progress (anything
    comparable; None when the engine did not answer). Use as a context manager around the
    workload; requests `track` themselves with the callable that aborts them."""

    def __init__(self, patience: Patience, probe: Callable[[], Hashable | None],
                 clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], CpuTime | None] | None = None) -> None:
        self.patience = patience
        self._probe = probe
        self._cpu = cpu or (lambda: None)  # the engine's (ran, waited for a CPU) seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._aborts: dict[int, Callable[[], None]] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reason: str | None = None  # why it fired; None while it has not
        self.starved: str | None = None  # a stall while the machine starved the engine: how

    @property
    def fired(self) -> bool:
        return self.reason is not None

    def track(self, abort: Callable[[], None]) -> int:
        """An outstanding request and how to abort it; its token for `untrack`. A request
        tracked after the watchdog fired is aborted at once."""
        with self._lock:
            token = self._next_id
            self._next_id += 1
            self._aborts[token] = abort
            fired = self.fired
        if fired:
            abort()
        return token

    def untrack(self, token: int) -> None:
        with self._lock:
            self._aborts.pop(token, None)

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._aborts)

    def __enter__(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, name="canary-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        started = last_progress = self._clock()
        at_start = self._cpu()
        last: Hashable | None = None
        stalled_from: tuple[float, CpuTime | None] | None = None  # when a stall began, its CPU reading
        while not self._stop.wait(self.patience.poll_s):
            now = self._clock()
            outstanding = self.outstanding
            if now - started >= self.patience.hard_cap_s and outstanding:
                # It progressed, too slowly: the machine's fault if the engine mostly waited for a CPU.
                self.starved = starved(at_start, self._cpu(), now - started, max_running=None)
                self._fire(f"hard cap: the workload ran {self.patience.hard_cap_s:g} s with "
                           f"{outstanding} request(s) outstanding" + (f" ({self.starved})" if self.starved else ""))
                return
            if not outstanding:
                last_progress, stalled_from = now, None  # the stall clock runs only while answers are owed
                continue
            snapshot = self._probe()
            if snapshot is not None and snapshot != last:
                last, last_progress, stalled_from = snapshot, self._clock(), None
            elif now - last_progress >= self.patience.stall_s:
                reason = (f"no engine progress for {self.patience.stall_s:g} s with "
                          f"{outstanding} request(s) outstanding")
                if stalled_from is not None:
                    self.starved = starved(stalled_from[1], self._cpu(), now - stalled_from[0])
                self._fire(reason + (f" ({self.starved})" if self.starved else ""))
                return
            elif stalled_from is None:
                stalled_from = (now, self._cpu())

    def _fire(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            aborts = list(self._aborts.values())
        for abort in aborts:
            abort()
