"""`canary diff BASE RUN`: what changed between two runs' reports, grouped by signature."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    diff = sub.add_parser("diff", help="compare two run reports (exit 1 on a regression)")
    diff.add_argument("base", metavar="BASE", help="the earlier (good) run's report directory")
    diff.add_argument("run", metavar="RUN", help="the run to judge against it")
    diff.add_argument("--json", action="store_true", help="print the changes as JSON")
    diff.add_argument("--latency-threshold", type=int, default=2, metavar="STEPS",
                      help="report a detection latency change beyond this many steps (default 2)")
    diff.add_argument("--html", action="store_true",
                      help="also rewrite RUN/index.html with the diff section")
    diff.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from canaries.report.diff import main

    argv = [args.base, args.run, "--latency-threshold", str(args.latency_threshold)]
    code = main(argv + (["--json"] if args.json else []))
    if args.html and code in (0, 1):
        from canaries.report.diff import diff_runs
        from canaries.report.html import write_html

        path = write_html(Path(args.run), diff=diff_runs(Path(args.base), Path(args.run),
                                                         args.latency_threshold))
        print(f"wrote {path}")
    return code
