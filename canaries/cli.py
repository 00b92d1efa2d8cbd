"""`canary`: run, list, validate, create and describe fault-injection scenarios.

    canary run [PATHS...] [-k EXPR] [--runtime local|docker] [--device auto|cpu|cuda]
               [--report-dir DIR] [--jobs N] [--shard I/N] [--start auto|warm|fresh]
    canary list [kinds|invariants|scenarios|profiles]
    canary validate [PATHS...]
    canary new NAME --from SCENARIO [--dir configs/scenarios]
    canary schema
    canary gc [--all] [--images]

`run` exits 0 when every verdict passed, 1 when any failed, 2 on a usage or validation error,
130 on Ctrl-C and 143 on SIGTERM (128 + the signal). An interrupted run stops every engine, then
writes its reports anyway: every selected scenario is listed (running ones INCONCLUSIVE
"interrupted", the others NOT_RUN) and each report says the run was interrupted; further
signals are ignored until that is done.

A thin dispatcher: each command is a module of canaries/commands/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from canaries.commands import COMMANDS
from canaries.commands.common import EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from canaries.commands.run import match_k, parse_shard, select

__all__ = ["main", "build_parser", "match_k", "parse_shard", "select"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canary", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"canaries.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"canary: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        from canaries.runner import cancel_all

        cancel_all()
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
