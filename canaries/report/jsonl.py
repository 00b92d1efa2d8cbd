"""verdicts.jsonl: one JSON line per judged scenario, appended durably, never rewritten."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["append_verdict", "as_dict", "read_verdicts"]


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


def read_verdicts(path: str | os.PathLike) -> list[dict]:
    """Every record in `path` (none if it does not exist); unparsable lines are skipped only
    when they are torn writes (the last line, or closed off by a later append)."""
    path = Path(path)
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
