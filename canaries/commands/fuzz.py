"""`canary fuzz`: generated scenarios judged without expectations; findings shrunk and kept.

    canary fuzz [--budget 10m | --count N] [--seed S] [--jobs N] [--steer on|off]
                [--shard I/N] [--report-dir DIR]
    canary fuzz --merge DIR [DIR...] --report-dir OUT
    canary fuzz --replay FILE...

Exits 0 when the campaign found nothing, 1 when it found something (each finding is a scenario
file under `<report-dir>/findings/`), 2 on a usage error, 130 when interrupted (findings so far
are kept). `--merge` unions shards' reports by signature (exit 1 if any found something).
`--replay` reruns finding files under the same oracle: exit 1 if any still finds.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from canaries.commands.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError

__all__ = ["DEFAULT_STEER", "add_parser", "parse_budget", "run"]

STEER_MODES = ("on", "off")
DEFAULT_STEER = "off"

_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_budget(text: str) -> float:
    """`90`, `90s`, `10m`, `2h` -> seconds (> 0)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--budget {text!r}: expected a positive duration such as 90s, 10m or 2h")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    fuzz = sub.add_parser("fuzz", help="run generated scenarios; find blind spots and false alarms")
    fuzz.add_argument("--budget", metavar="DURATION", help="how long to generate: 90s, 10m, 2h")
    fuzz.add_argument("--count", type=int, metavar="N", help="run exactly N generated scenarios")
    fuzz.add_argument("--seed", type=int, default=0, help="the campaign's seed (default 0)")
    fuzz.add_argument("--jobs", "-j", type=int, default=1, help="scenarios run at once")
    fuzz.add_argument("--report-dir", metavar="DIR", help="default: reports/fuzz-<run-id>/")
    fuzz.add_argument("--runtime", default="local",
                      help="local (default) | docker | sglang-server (SGLang's own server; draws it cannot "
                           "run are inconclusive)")
    fuzz.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                      help="override every generated scenario's engine.device")
    fuzz.add_argument("--shrink-steps", type=int, default=16, metavar="N",
                      help="runs to spend shrinking each new finding (0: do not shrink)")
    fuzz.add_argument("--engine-python", metavar="PATH", default=None,
                      help="an interpreter with sglang (scripts/make-sglang-venv.sh): every scenario "
                           "also runs on SGLang's allocator, and a different outcome is a finding")
    fuzz.add_argument("--keep-runs", action="store_true",
                      help="keep every run's directory (default: only those of findings)")
    fuzz.add_argument("--replay", nargs="+", metavar="FILE",
                      help="rerun these scenario files (findings) under the fuzzer's oracle")
    fuzz.add_argument("--steer", default=DEFAULT_STEER, metavar="on|off",
                      help="on: a corpus-guided sequence fed with what each run reached; off: the "
                           f"seed's generated draws in order (default {DEFAULT_STEER})")
    fuzz.add_argument("--shard", metavar="I/N", default="1/1",
                      help="this runner's part: unsteered, every Nth draw of the seed from the "
                           "(I-1)th; steered, a sub-campaign seeded from (seed, I)")
    fuzz.add_argument("--merge", nargs="+", metavar="DIR",
                      help="union these shards' report dirs by signature into --report-dir")
    fuzz.add_argument("--mutants", action="store_true",
                      help="measure the fuzzer: the regression catalogue's mutants against the "
                           "seed's generated scenarios (--budget per mutant, default 60s)")
    fuzz.add_argument("-k", dest="k", metavar="EXPR", help="with --mutants: select mutants by name")
    fuzz.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.runner import default_report_dir, new_run_id

    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: must be at least 1")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count {args.count}: must be at least 1")
    if args.shrink_steps < 0:
        raise UsageError(f"--shrink-steps {args.shrink_steps}: must be at least 0")
    from canaries.fuzz.shard import parse_shard

    try:
        shard = parse_shard(args.shard)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.steer not in STEER_MODES:
        raise UsageError(f"--steer {args.steer!r}: expected one of {', '.join(STEER_MODES)}")
    if args.merge:
        return _merge(args)
    report = Path(args.report_dir) if args.report_dir else default_report_dir(f"fuzz-{new_run_id()}")
    if args.replay:
        return _replay(args, report)
    if args.mutants:
        return _mutants(args, report)
    if args.budget is None and args.count is None:
        raise UsageError("give --budget DURATION (e.g. 10m) or --count N")
    from canaries.commands.run import check_engine_python
    from canaries.fuzz.campaign import fuzz

    if args.engine_python:
        check_engine_python(args.engine_python, "sglang", args.runtime)
    result = fuzz(args.seed, report, budget_s=parse_budget(args.budget) if args.budget else None,
                  count=args.count, jobs=args.jobs, runtime=args.runtime, device=args.device,
                  shrink_steps=args.shrink_steps, keep_runs=args.keep_runs,
                  sglang_python=args.engine_python, steer=args.steer, shard=shard)
    print(f"report: {report / 'index.html'}")
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if result.findings else EXIT_OK


def _replay(args: argparse.Namespace, report: Path) -> int:
    from canaries.fuzz.accepted import load_accepted
    from canaries.fuzz.campaign import replay
    from canaries.scenario import ScenarioError

    paths = [Path(p) for p in args.replay]
    for path in paths:
        if not path.is_file():
            raise UsageError(f"{path}: no such scenario file")
    try:
        judged = replay(paths, report, runtime=args.runtime, device=args.device)
    except ScenarioError as exc:
        raise UsageError(str(exc)) from None
    accepted = load_accepted()
    found = 0
    for path, judgement in judged:
        known = next((a for a in accepted if judgement.finding and a.matches(judgement.signature)), None)
        found += judgement.finding and known is None
        what = f"accepted {judgement.outcome}" if known else judgement.outcome
        print(f"{path}: {what} ({judgement.signature}) {judgement.reason}")
    return EXIT_FAILED if found else EXIT_OK


def _merge(args: argparse.Namespace) -> int:
    from canaries.fuzz.merge import MergeError, merge_reports

    if not args.report_dir:
        raise UsageError("--merge needs --report-dir OUT")
    try:
        result = merge_reports([Path(d) for d in args.merge], Path(args.report_dir))
    except MergeError as exc:
        raise UsageError(str(exc)) from None
    print(f"canary fuzz --merge: {len(args.merge)} shard(s), {result.runs} scenario(s), "
          f"{len(result.findings)} distinct finding(s)")
    print(f"report: {Path(args.report_dir) / 'index.html'}")
    return EXIT_FAILED if result.findings else EXIT_OK


def _mutants(args: argparse.Namespace, report: Path) -> int:
    from canaries.commands.run import match_k
    from canaries.fuzz.kill import fuzz_mutants
    from canaries.regressions import catalogue

    mutants = [m for m in sorted(catalogue().values(), key=lambda m: m.name)
               if not args.k or match_k(args.k, m.name)]
    if not mutants:
        raise UsageError(f"-k {args.k!r}: no catalogue entry matches")
    budget = parse_budget(args.budget) if args.budget else 60.0
    results = fuzz_mutants(mutants, args.seed, report, budget_s=budget, jobs=args.jobs,
                           runtime=args.runtime, steer=args.steer)  # catalogue mutants: the local runtime's engine copies
    counted = [r for r in results if r.status in ("killed", "survived")]
    killed = sum(r.status == "killed" for r in counted)
    print(f"fuzzer kill rate (seed {args.seed}, steer {args.steer}, {budget:.0f}s per mutant, {args.jobs} job(s)): "
          f"{killed}/{len(counted)} non-equivalent mutants killed")
    for r in counted:
        if r.status == "survived":
            print(f"  survived: {r.mutant} ({r.scenarios_run} scenario(s))")
    print(f"report: {report / 'fuzz_mutants.jsonl'}")
    return EXIT_OK if killed == len(counted) else EXIT_FAILED
