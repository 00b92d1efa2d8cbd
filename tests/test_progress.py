"""The run's progress: plain lines off a terminal, a live panel on one."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from canaries.progress import LiveProgress, PlainProgress, progress_for


def _record(verdict: str, passed: bool) -> SimpleNamespace:
    return SimpleNamespace(verdict=verdict, passed=passed, reason=f"{verdict.lower()} because")


def test_plain_progress_prints_one_line_per_finished_scenario(capsys) -> None:
    with PlainProgress(2) as shown:
        shown.started("a")
        shown.finished("a", _record("DETECTED", True), 1.25)
    assert capsys.readouterr().out == "[1/2] a DETECTED (1.2s) detected because\n"


def test_off_a_terminal_progress_is_plain() -> None:
    assert type(progress_for(3)) is PlainProgress  # pytest's stdout is no terminal


def test_live_progress_shows_running_failures_and_an_estimate() -> None:
    out = io.StringIO()
    shown = LiveProgress(3, jobs=2, console=Console(file=out, force_terminal=True, width=120))
    shown.started("a")
    shown.started("b")
    panel = shown._render().plain
    assert "0/3 done" in panel and "running: a (0s), b (0s)" in panel and "left ~?" in panel
    shown.finished("a", _record("MISSED", False), 2.0)
    panel = shown._render().plain
    assert "1/3 done" in panel and "failures 1" in panel and "failed: a (MISSED)" in panel
    assert "left ~2s" in panel  # 2 s a scenario, 2 left, 2 jobs
    shown.close()
    assert "[1/3] a MISSED (2.0s)" in out.getvalue()
