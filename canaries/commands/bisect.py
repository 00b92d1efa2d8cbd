"""`canary bisect GOOD BAD SCENARIO`: the first engine commit that changed the scenario's verdict."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    bisect = sub.add_parser("bisect", help="git-bisect the engine for a scenario's verdict change")
    bisect.add_argument("good", metavar="GOOD", help="a commit where the scenario has its good verdict")
    bisect.add_argument("bad", metavar="BAD", help="a later commit where the verdict differs")
    bisect.add_argument("scenario", metavar="SCENARIO", help="the scenario file")
    bisect.add_argument("--repo", default=None, help="the git repository (default: this checkout)")
    bisect.add_argument("--runtime", default="local", help="local (default) | docker")
    bisect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.triage.bisect import BisectError, bisect

    try:
        result = bisect(args.good, args.bad, args.scenario, repo=args.repo, runtime=args.runtime)
    except BisectError as exc:
        raise UsageError(str(exc)) from None
    print(result.to_text())
    return EXIT_OK
