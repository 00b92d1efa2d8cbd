"""`canary shrink SCENARIO`: a smaller scenario with the same verdict and signature."""

from __future__ import annotations

import argparse
from pathlib import Path

from canaries.commands.common import EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    shrink = sub.add_parser("shrink", help="delta-debug a scenario to a smaller one with the same verdict")
    shrink.add_argument("scenario", metavar="SCENARIO", help="a scenario file")
    shrink.add_argument("--out", metavar="FILE", help="default: NAME-shrunk.yaml beside it")
    shrink.add_argument("--runtime", default="local", help="local (default) | docker")
    shrink.add_argument("--memory", choices=("native", "sglang", "sglang-allocator"), default=None,
                        help="override the scenario's memory path (sglang*: with --engine-python)")
    shrink.add_argument("--engine-python", metavar="PATH", help="an interpreter with sglang (a release's venv)")
    shrink.add_argument("--max-steps", type=int, default=60, help="candidates to try at most")
    shrink.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.commands.run import check_engine_python
    from canaries.scenario import ScenarioError
    from canaries.triage.shrink import shrink

    check_engine_python(args.engine_python, args.memory, args.runtime)
    if not Path(args.scenario).is_file():
        raise UsageError(f"{args.scenario}: no such scenario file")
    if args.out and Path(args.out).exists():
        raise UsageError(f"{args.out} exists; refusing to overwrite it")

    def show(step) -> None:
        print(f"  {step.change}: {step.verdict} ({'kept' if step.kept else 'rejected'}, size {step.size})",
              flush=True)

    try:
        result = shrink(args.scenario, args.out, runtime=args.runtime, max_steps=args.max_steps,
                        progress=show, memory=args.memory, engine_python=args.engine_python)
    except ScenarioError as exc:
        raise UsageError(str(exc)) from None
    print(result.to_text().splitlines()[-1])
    return EXIT_OK
