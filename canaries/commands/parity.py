"""`canary parity`: the library on our memory path and on SGLang's own; exit 1 on an
unexplained difference (one not recorded in configs/parity/sglang-<version>.yaml, nor inherited
by it or, for a release with no file, from the nearest older release's: canaries/sglang/divergences.py)."""

from __future__ import annotations

import argparse

from canaries.commands.common import EXIT_FAILED, EXIT_OK, UsageError, load_scenarios

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parity = sub.add_parser("parity", help="compare verdicts on native vs SGLang's own memory path")
    parity.add_argument("paths", nargs="*", metavar="PATHS", help="scenario files (default: the library)")
    parity.add_argument("-k", dest="k", metavar="EXPR", help="select scenarios by name")
    parity.add_argument("--shard", metavar="I/N", help="compare every Nth scenario starting at I-1")
    parity.add_argument("--engine-python", metavar="PATH",
                        help="an interpreter with sglang (scripts/make-sglang-venv.sh); with --runtime "
                             "sglang-server, default the server venv's")
    parity.add_argument("--runtime", choices=("local", "sglang-server"), default="local",
                        help="SGLang's side: its memory path under our engine (local, default) or its "
                             "own server (known divergences: configs/parity/server/)")
    parity.add_argument("--memory", choices=("sglang", "sglang-allocator"), default="sglang",
                        help="SGLang's side: every part the release has (default) or its allocator alone")
    parity.add_argument("--device", choices=("cpu", "cuda"), help="SGLang's side's device (e.g. its server on CUDA); ours runs on the harness's")
    parity.add_argument("--jobs", "-j", type=int, default=1, help="scenarios run at once")
    parity.add_argument("--report-dir", metavar="DIR", help="default: reports/parity-<run-id>/")
    parity.add_argument("--rejudge", metavar="DIR",
                        help="judge this parity report's runs again against today's known divergences "
                             "(nothing reruns)")
    parity.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from canaries.commands.run import check_engine_python, select
    from canaries.runner import default_report_dir, new_run_id
    from canaries.sglang.parity import rejudge, run_parity

    if args.rejudge:
        try:
            result = rejudge(args.rejudge, args.engine_python, args.runtime if args.runtime != "local" else None)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--rejudge: {exc}") from None
        print(result.to_markdown())
        return EXIT_OK if result.ok else EXIT_FAILED

    if args.runtime == "sglang-server":
        from canaries.sglang.releases.venvs import find_python

        if args.engine_python is None:
            found = find_python("0.5.23", server=True)
            if found is None:
                raise UsageError("--runtime sglang-server: no server venv here "
                                 "(bash scripts/make-sglang-venv.sh --server), or give --engine-python")
            args.engine_python = str(found)
    elif args.engine_python is None:
        raise UsageError("--engine-python is required (an interpreter with sglang: scripts/make-sglang-venv.sh)")
    else:
        check_engine_python(args.engine_python, args.memory, "local")
    scenarios = select(load_scenarios(args.paths), args.k, args.shard)
    if not scenarios:
        raise UsageError("no scenario matches the selection")
    report = Path(args.report_dir) if args.report_dir else default_report_dir(f"parity-{new_run_id()}")
    try:
        result = run_parity(scenarios, report, args.engine_python, jobs=args.jobs, memory=args.memory,
                            runtime=args.runtime, device=args.device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(result.to_markdown())
    print(f"report: {report} (parity.md, native/, sglang/)")
    return EXIT_OK if result.ok else EXIT_FAILED
