"""Progress of a run: a live display on a terminal, plain lines anywhere else (CI logs).

The live display (rich) shows done/total, the scenarios running now, the failures so far, the
elapsed time and an estimate of what is left (from the mean time per scenario and the jobs); the
finished scenarios' lines scroll above it, as the plain form prints them. `progress_for` picks
the form: live only when stdout is a terminal and `CANARY_PROGRESS` is not `plain`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

__all__ = ["LiveProgress", "PlainProgress", "Prefixed", "progress_for", "result_line"]


def result_line(k: int, n: int, name: str, record: Any, duration: float) -> str:
    """`[k/n] NAME VERDICT (1.2s) reason`: one finished scenario."""
    reason = (getattr(record, "reason", "") or "").replace("\n", " ")
    if len(reason) > 120:
        reason = reason[:117] + "..."
    width = len(str(n))
    return f"[{k:>{width}}/{n}] {name} {record.verdict} ({duration:.1f}s) {reason}"


class PlainProgress:
    """One line per finished scenario (what CI logs show)."""

    def __init__(self, total: int, jobs: int = 1) -> None:
        self.total, self.jobs, self.done = total, jobs, 0
        self._lock = threading.Lock()

    def started(self, name: str) -> None:
        return None

    def finished(self, name: str, record: Any, duration: float) -> None:
        with self._lock:
            self.done += 1
            print(result_line(self.done, self.total, name, record, duration), flush=True)

    def close(self) -> None:
        return None

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LiveProgress(PlainProgress):
    """A rich live panel under the finished scenarios' lines."""

    def __init__(self, total: int, jobs: int = 1, console: Any = None) -> None:
        super().__init__(total, jobs)
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console()
        self.running: dict[str, float] = {}
        self.failures: list[str] = []
        self.durations: list[float] = []
        self.t0 = time.monotonic()
        self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True,
                          get_renderable=self._render)
        self._live.start()

    def _estimate(self) -> str:
        if not self.durations:
            return "?"
        left = self.total - self.done
        per = sum(self.durations) / len(self.durations)
        return f"{per * left / max(1, self.jobs):.0f}s"

    def _render(self) -> Any:
        from rich.text import Text

        now = time.monotonic()
        running = ", ".join(f"{n} ({now - t:.0f}s)" for n, t in sorted(self.running.items()))
        text = Text()
        text.append(f"canary: {self.done}/{self.total} done", style="bold")
        text.append(f"  failures {len(self.failures)}", style="red" if self.failures else "green")
        text.append(f"  elapsed {now - self.t0:.0f}s  left ~{self._estimate()}\n")
        text.append(f"running: {running or '-'}")
        if self.failures:
            text.append(f"\nfailed: {', '.join(self.failures[-6:])}", style="red")
        return text

    def started(self, name: str) -> None:
        with self._lock:
            self.running[name] = time.monotonic()

    def finished(self, name: str, record: Any, duration: float) -> None:
        with self._lock:
            self.done += 1
            self.running.pop(name, None)
            self.durations.append(duration)
            if not getattr(record, "passed", True):
                self.failures.append(f"{name} ({record.verdict})")
            self.console.print(result_line(self.done, self.total, name, record, duration),
                               highlight=False, markup=False)

    def close(self) -> None:
        self._live.stop()


def progress_for(total: int, jobs: int = 1) -> PlainProgress:
    """Live on a terminal, plain lines otherwise (or with CANARY_PROGRESS=plain)."""
    if sys.stdout.isatty() and os.environ.get("CANARY_PROGRESS", "") != "plain":
        try:
            return LiveProgress(total, jobs)
        except ImportError:  # rich missing: the plain form says the same
            pass
    return PlainProgress(total, jobs)


class Prefixed:
    """One part of a bigger display (a matrix column): names carry `label`; opening and closing
    the display is its owner's business, not the part's."""

    def __init__(self, label: str, inner: PlainProgress) -> None:
        self.label, self.inner = label, inner

    def started(self, name: str) -> None:
        self.inner.started(f"{self.label} {name}")

    def finished(self, name: str, record: Any, duration: float) -> None:
        self.inner.finished(f"{self.label} {name}", record, duration)

    def __enter__(self) -> Prefixed:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
