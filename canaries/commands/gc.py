"""`canary gc [--all] [--images]`: remove engine containers (and images) earlier runs left."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser("gc", help="remove engine containers left behind by earlier runs")
    gc.add_argument("--all", action="store_true", help="also containers of runs still going")
    gc.add_argument("--images", action="store_true", help="also engine images of older sources")
    gc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.runtime.docker import DockerUnavailable, gc

    try:
        removed = gc(include_live=args.all, images=args.images)
    except DockerUnavailable as exc:
        raise UsageError(str(exc)) from None
    print(f"removed {removed} serving-canary container(s)")
    return EXIT_OK
