"""`canary schema`: the scenario format's JSON Schema, for editors."""

from __future__ import annotations

import argparse
import json

from canaries.commands.common import EXIT_OK

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    schema = sub.add_parser("schema", help="print the scenario JSON Schema")
    schema.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.scenario import json_schema

    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK
