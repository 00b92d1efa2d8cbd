"""`canary mutate`: the library against mutated engines (catalogued regressions, or automatic
mutants from cosmic-ray); exit 1 when a non-equivalent catalogued regression survives."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_FAILED, EXIT_OK, UsageError, load_scenarios

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    mutate = sub.add_parser("mutate", help="kill mutants of the engine with the scenario library")
    what = mutate.add_mutually_exclusive_group()
    what.add_argument("--catalogue", action="store_true", help="the regression catalogue (default)")
    what.add_argument("--auto", type=int, metavar="N", help="a seeded sample of N cosmic-ray mutants")
    mutate.add_argument("--seed", type=int, default=0, help="the --auto sample's seed")
    mutate.add_argument("-k", dest="k", metavar="EXPR", help="select mutants by name (and/or/not)")
    mutate.add_argument("--scenarios", nargs="*", default=[], metavar="PATH",
                        help="scenario files or folders (default: the library)")
    mutate.add_argument("--all-scenarios", action="store_true",
                        help="run every scenario against every mutant, not only the ones it names")
    mutate.add_argument("--jobs", "-j", type=int, default=1, help="scenarios run at once")
    mutate.add_argument("--runtime", default="local", help="local (default) | docker")
    mutate.add_argument("--report-dir", metavar="DIR", help="default: reports/mutate-<run-id>/")
    mutate.add_argument("--list", action="store_true", help="list the mutants and exit")
    mutate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from canaries.commands.run import match_k
    from canaries.regressions import RegressionError, catalogue

    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    try:
        if args.auto is not None:
            if args.auto < 1:
                raise UsageError("--auto N needs N >= 1")
            from canaries.automutants import sample_mutants

            mutants, kind = sample_mutants(args.auto, args.seed), "auto"
        else:
            mutants, kind = sorted(catalogue().values(), key=lambda m: m.name), "catalogue"
    except RegressionError as exc:
        raise UsageError(str(exc)) from None
    if args.k:
        mutants = [m for m in mutants if match_k(args.k, m.name)]
    if not mutants:
        raise UsageError("no mutant matches the selection")
    if args.list:
        for m in mutants:
            print(f"{m.name:<48} {m.file:<28} {m.models}")
        return EXIT_OK
    from canaries.mutate import run_campaign
    from canaries.runner import default_report_dir, new_run_id

    report = Path(args.report_dir) if args.report_dir else default_report_dir(f"mutate-{new_run_id()}")
    try:
        result = run_campaign(mutants, load_scenarios(args.scenarios), report, kind=kind,
                              jobs=args.jobs, runtime=args.runtime, all_scenarios=args.all_scenarios)
    except RegressionError as exc:
        raise UsageError(str(exc)) from None
    print("\n" + result.summary())
    print(f"\nreport: {report} (mutants.jsonl, mutant_matrix.md)")
    return EXIT_FAILED if result.gate_fails else EXIT_OK
