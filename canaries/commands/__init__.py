"""The `canary` commands, one module each; `canaries/cli.py` dispatches to them.

Each module has `add_parser(subparsers)`, which declares its arguments and sets `func` to its
`run(args) -> exit code`. Modules import what a command needs only when it runs, so `canary
validate`, `list`, `schema` and `new` never import torch or an engine module that does.
"""

COMMANDS = ("run", "list", "validate", "new", "schema", "diff", "report", "repro", "shrink", "bisect", "mutate", "parity", "matrix", "fuzz", "gc")

__all__ = ["COMMANDS"]
