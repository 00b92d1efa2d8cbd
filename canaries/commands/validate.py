"""`canary validate [PATHS...]`: every problem as `file:line: field: message`, warnings too.

Exit 0 when no file has a problem (warnings do not fail), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from canaries.commands.common import EXIT_FAILED, EXIT_OK, scenario_files

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    val = sub.add_parser("validate", help="check scenario files (file:line: field: message)")
    val.add_argument("paths", nargs="*", metavar="PATHS")
    val.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.scenario import check_paths

    files = scenario_files(args.paths)
    problems, warnings = check_paths(files)
    for p in [*problems, *warnings]:
        sys.stdout.write(f"{p}\n")
    # Every problem line is out before the summary goes to the other stream: where both end up
    # in one place, the summary must not land inside a half-flushed problem line.
    sys.stdout.flush()
    if problems:
        bad = len({p.file for p in problems})
        print(f"{len(problems)} problem(s) in {bad} file(s)", file=sys.stderr, flush=True)
        return EXIT_FAILED
    noted = f" ({len(warnings)} warning(s))" if warnings else ""
    print(f"{len(files)} scenarios OK{noted}")
    return EXIT_OK
