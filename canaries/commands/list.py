"""`canary list [kinds|invariants|scenarios|profiles]`: what a scenario may name."""

from __future__ import annotations

import argparse
import json

from canaries.commands.common import EXIT_OK, load_scenarios

__all__ = ["add_parser", "run"]

WHAT = ("kinds", "invariants", "scenarios", "profiles")


def add_parser(sub: argparse._SubParsersAction) -> None:
    lst = sub.add_parser("list", help="list perturbation kinds, invariants, scenarios, profiles")
    lst.add_argument("what", nargs="?", default="scenarios", choices=WHAT)
    lst.set_defaults(func=run)


def _kinds() -> None:
    from engine_stub.perturb.kinds import KINDS

    width = max(len(n) for n in KINDS)
    for name in sorted(KINDS):
        print(f"{name:<{width}}  {KINDS[name].summary}")


def _invariants() -> None:
    from engine_stub.detectors import CANARY_PREFIX, canary_reasons, detector, invariant_entries

    entries = [*invariant_entries(), *(detector(CANARY_PREFIX + r) for r in canary_reasons())]
    for d in entries:
        print(f"{d.name:<28}  {d.bucket:<20}  {d.description}")


def _scenarios() -> None:
    scenarios = sorted(load_scenarios([]), key=lambda s: s.name)
    width = max((len(s.name) for s in scenarios), default=8)
    for s in scenarios:
        print(f"{s.name:<{width}}  {(s.description or '').strip()}")


def _profiles() -> None:
    from canaries.scenario import list_profiles

    for name, body in list_profiles().items():
        print(f"{name}  {json.dumps(body, sort_keys=True)}")


def run(args: argparse.Namespace) -> int:
    {"kinds": _kinds, "invariants": _invariants, "scenarios": _scenarios,
     "profiles": _profiles}[args.what]()
    return EXIT_OK
