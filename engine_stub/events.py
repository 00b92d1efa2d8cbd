"""The durable event log: one JSON line per event, the harness's source of truth.

Every line carries `seq` (a counter), `step` (the engine step), `kind`, and `ts` (wall time,
excluded from trace comparisons). Events that explain a death (`durable=True`: firings,
violations, crashes) are flushed and fsynced before `write` returns.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events", "trace_of"]

# Fields that differ between two runs of the same seed and scenario (paths name the run dir).
NONDETERMINISTIC_FIELDS = frozenset(
    {"ts", "pid", "path", "port", "wall_s", "host", "config_sources", "traceback"}
)
NONDETERMINISTIC_CONFIG_KEYS = frozenset({"event_log", "port", "host"})


class EventLog:
    """Append-only JSONL writer, safe to call from the engine and server threads."""

    def __init__(self, path: str | os.PathLike, *, exclusive: bool = False) -> None:
        """Open `path` for appending; `exclusive`: create it, refusing an existing file or link."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        if exclusive:
            flags |= os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.path, flags, 0o600 if exclusive else 0o644)
        self._file = os.fdopen(fd, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._seq = 0
        self.step = 0

    def write(self, kind: str, *, durable: bool = False, **fields: Any) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._seq += 1
            record = {"seq": self._seq, "step": fields.pop("step", self.step), "kind": kind,
                      "ts": round(time.time(), 6), **fields}
            self._file.write(json.dumps(record, sort_keys=False, default=str) + "\n")
            self._file.flush()
            if durable:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()


def read_events(path: str | os.PathLike) -> list[dict]:
    """Every complete event in `path`; a torn last line (a crash mid-write) is skipped."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def trace_of(events: list[dict]) -> list[dict]:
    """Events without the fields that legitimately differ between identical runs."""
    trace = []
    for event in events:
        kept = {k: v for k, v in event.items() if k not in NONDETERMINISTIC_FIELDS}
        if isinstance(kept.get("config"), dict):
            kept["config"] = {k: v for k, v in kept["config"].items() if k not in NONDETERMINISTIC_CONFIG_KEYS}
        trace.append(kept)
    return trace
