"""`canary new NAME --from SCENARIO [--dir DIR]`: copy a scenario under a new name."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from canaries.commands.common import EXIT_OK, UsageError, scenarios_dir

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    new = sub.add_parser("new", help="copy a scenario under a new name")
    new.add_argument("name", metavar="NAME")
    new.add_argument("--from", dest="source", required=True, metavar="SCENARIO",
                     help="a scenario file, or the name of one in configs/scenarios")
    new.add_argument("--dir", default=None, help="where to write it (default configs/scenarios)")
    new.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.scenario import NAME_RE

    name = args.name
    if not NAME_RE.match(name):
        raise UsageError(f"{name!r}: a scenario name is lower-case letters, digits, '.', '_', '-'")
    source = Path(args.source)
    if not source.exists():
        candidate = scenarios_dir() / f"{args.source}.yaml"
        if candidate.exists():
            source = candidate
        else:
            raise UsageError(f"--from {args.source!r}: no such scenario file or name")
    out_dir = Path(args.dir) if args.dir else scenarios_dir()
    target = out_dir / f"{name}.yaml"
    if target.exists():
        raise UsageError(f"{target} exists; refusing to overwrite it")
    text = source.read_text(encoding="utf-8")
    new_text, count = re.subn(r"(?m)^name:[ \t]*\S.*$", f"name: {name}", text, count=1)
    if count == 0:
        new_text = f"name: {name}\n{text}"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(target, "x", encoding="utf-8") as f:
        f.write(new_text)
    print(f"wrote {target}")
    return EXIT_OK
