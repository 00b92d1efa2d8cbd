"""The event log's file: where the default one lives and what an exclusive open refuses."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine_stub.engine import default_event_log_path
from engine_stub.events import EventLog, read_events


def test_default_event_log_lives_in_a_fresh_private_directory() -> None:
    first, second = default_event_log_path(), default_event_log_path()
    assert first.parent != second.parent, "a predictable path could be planted in advance"
    for path in (first, second):
        mode = stat.S_IMODE(path.parent.stat().st_mode)
        assert mode == 0o700, oct(mode)
        path.parent.rmdir()


def test_exclusive_event_log_refuses_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "victim.txt"
    target.write_text("keep me\n")
    planted = tmp_path / "events.jsonl"
    os.symlink(target, planted)
    with pytest.raises(FileExistsError):
        EventLog(planted, exclusive=True)
    assert target.read_text() == "keep me\n"


def test_event_log_appends_to_a_given_path(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for kind in ("first", "second"):
        log = EventLog(path)
        log.write(kind)
        log.close()
    assert [e["kind"] for e in read_events(path)] == ["first", "second"]
