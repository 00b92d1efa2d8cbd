"""`canary repro RUN_DIR/SCENARIO`: rerun exactly what ran; exit 0 when it ran the same way."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    repro = sub.add_parser("repro", help="rerun a scenario of a report and compare event traces")
    repro.add_argument("run_dir", metavar="RUN_DIR/SCENARIO", help="a scenario's directory in a report")
    repro.add_argument("--out", metavar="DIR", help="where the rerun goes (default: beside it)")
    repro.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.triage.repro import ReproError, repro

    try:
        result = repro(args.run_dir, args.out)
    except ReproError as exc:
        raise UsageError(str(exc)) from None
    print(result.to_text())
    return EXIT_OK if result.same else EXIT_FAILED
