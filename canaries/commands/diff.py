"""`canary diff BASE RUN`: what changed between two runs' reports, grouped by signature; with
`--reruns N` each new failure runs again as it ran in RUN before it counts (FLAKY if it passes)."""

from __future__ import annotations

import argparse
import sys

from canaries.commands.common import UsageError
from canaries.confirm import FLAKY_POLICIES

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
    diff.add_argument("--reruns", type=int, default=0, metavar="N",
                      help="run each new failure N more times as it ran in RUN (into RUN/reruns/) before it "
                           "counts: one that passes on a rerun is FLAKY, not a regression (default 0)")
    diff.add_argument("--flaky", choices=FLAKY_POLICIES, default="warn",
                      help="a FLAKY scenario: shown, exit 0 (warn, default), or a regression (fail)")
    diff.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from canaries.report.diff import ReportError, diff_runs, main

    if args.reruns < 0:
        raise UsageError("--reruns: at least 0")
    if args.reruns == 0 and args.flaky == "warn":
        argv = [args.base, args.run, "--latency-threshold", str(args.latency_threshold)]
        code = main(argv + (["--json"] if args.json else []))
        result = None
    else:
        from canaries.triage.repro import ReproError, rerun_report

        try:
            result = diff_runs(Path(args.base), Path(args.run), args.latency_threshold)
            result = result.confirm(args.reruns, lambda names, attempt: rerun_report(
                args.run, list(names), Path(args.run) / "reruns" / f"rerun-{attempt}"), args.flaky)
        except (ReportError, ReproError, ValueError) as exc:
            print(f"canary diff: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(result.to_json() + "\n" if args.json else result.to_text())
        code = 1 if result.regressed else 0
    if args.html and code in (0, 1):
        from canaries.report.html import write_html

        path = write_html(Path(args.run), diff=result or diff_runs(Path(args.base), Path(args.run),
                                                                   args.latency_threshold))
        print(f"wrote {path}")
    return code
