"""`canary report RUN_DIR`: (re)write a run's index.html, optionally with a diff against a base."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="write a run report's index.html")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run's report directory")
    report.add_argument("--base", metavar="BASE", help="a base report to diff against")
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from canaries.report.diff import ReportError, diff_runs
    from canaries.report.html import write_html

    run_dir = Path(args.run_dir)
    if not (run_dir / "verdicts.jsonl").is_file():
        raise UsageError(f"{run_dir}: not a report directory (no verdicts.jsonl)")
    try:
        diff = diff_runs(Path(args.base), run_dir) if args.base else None
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {write_html(run_dir, diff=diff)}")
    return EXIT_OK
