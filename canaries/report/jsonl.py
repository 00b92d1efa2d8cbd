"""verdicts.jsonl: one JSON line per scenario, appended durably, never rewritten.

An interrupted run's file also has a line for every scenario it did not judge (INCONCLUSIVE or
NOT_RUN) and ends with one run-level record, `{"run": "interrupted", ...}` (`read_run`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["RUN_KEY", "append_verdict", "as_dict", "read_run", "read_verdicts"]

RUN_KEY = "run"  # the key that marks a run-level record, as opposed to a scenario's


def as_dict(record: Any) -> dict:
    """A VerdictRecord (or anything with `to_dict`) as its dict; a dict as itself."""
    if isinstance(record, dict):
        return record
    to_dict = getattr(record, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"expected a VerdictRecord or a dict, got {type(record).__name__}")
    return to_dict()


def append_verdict(path: str | os.PathLike, record: Any) -> None:
    """Append `record` (a VerdictRecord or dict) as one JSON line, flushed and fsynced.

    Earlier lines are never touched; a torn last line (a crash mid-write) is closed off with a
    newline first so the new record stays on a line of its own.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(as_dict(record), sort_keys=False, default=str) + "\n"
    with open(path, "ab") as f:
        if f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) or not line.rstrip().endswith("}"):
                continue  # a torn write
            raise ValueError(f"{path}:{i}: not a JSON record: {exc}") from None
    return records


def read_verdicts(path: str | os.PathLike) -> list[dict]:
    """Every scenario record in `path` (none if it does not exist); unparsable lines are skipped
    only when they are torn writes (the last line, or closed off by a later append)."""
    return [r for r in _read_records(Path(path)) if RUN_KEY not in r]


def read_run(path: str | os.PathLike) -> dict | None:
    """The last run-level record in `path` (an interrupted run's), or None."""
    runs = [r for r in _read_records(Path(path)) if RUN_KEY in r]
    return runs[-1] if runs else None
