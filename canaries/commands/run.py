"""`canary run`: run scenarios, report verdicts; selection by `-k` and `--shard`.

Exits 0 when every verdict passed, 1 when any failed, 2 on a usage or validation error, 130 on
Ctrl-C and 143 on SIGTERM (128 + the signal). An interrupted run stops every engine, then writes
its reports anyway: every selected scenario is listed (running ones INCONCLUSIVE "interrupted",
the others NOT_RUN) and each report says the run was interrupted; further signals are ignored
until that is done.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from canaries.commands.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    load_scenarios,
)
from canaries.confirm import DEFAULT_RERUNS, FLAKY_POLICIES

__all__ = ["add_parser", "match_k", "parse_shard", "run", "select"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    run_ = sub.add_parser("run", help="run scenarios and report verdicts")
    run_.add_argument("paths", nargs="*", metavar="PATHS",
                      help="scenario files or folders (default: every scenario in configs/scenarios)")
    run_.add_argument("-k", dest="k", metavar="EXPR",
                      help="select by name: case-insensitive substrings with and/or/not")
    run_.add_argument("--runtime", default="local", help="local (default) | docker | sglang-server (SGLang's own server: "
                      "bash scripts/make-sglang-venv.sh --server)")
    run_.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                      help="override every scenario's engine.device")
    run_.add_argument("--report-dir", metavar="DIR", help="default: reports/<run-id>/")
    run_.add_argument("--jobs", "-j", type=int, default=1, help="scenarios run at once")
    run_.add_argument("--shard", metavar="I/N", help="run every Nth scenario starting at I-1")
    run_.add_argument("--memory", choices=("native", "sglang", "sglang-allocator"), default=None,
                      help="override every scenario's memory backend: native (our copy), sglang "
                           "(every part of the memory path the installed release has: allocator, radix "
                           "tree, request-to-token table) or sglang-allocator (its allocator only); "
                           "sglang* need --engine-python with sglang installed")
    run_.add_argument("--engine-python", metavar="PATH", default=None,
                      help="the interpreter engines run under (local runtime), e.g. "
                           ".venv-sglang/bin/python from scripts/make-sglang-venv.sh")
    run_.add_argument("--regression", action="append", default=[], metavar="NAME",
                      help="run the engine with this catalogued regression applied (a copy of its "
                           "sources; repeatable): what a broken engine looks like to the suite")
    run_.add_argument("--reruns", type=int, default=DEFAULT_RERUNS, metavar="N",
                      help="with --baseline: a scenario that passed there and fails here runs N more times "
                           f"before it counts (into REPORT/reruns/; default {DEFAULT_RERUNS}, 0: none)")
    run_.add_argument("--flaky", choices=FLAKY_POLICIES, default="warn",
                      help="with --baseline: a scenario that disagrees with itself on a rerun is FLAKY: shown, "
                           "and the run passes (warn, default) or fails (fail) on it")
    run_.add_argument("--baseline", metavar="REPORT_DIR",
                      help="an earlier run's report: index.html gets a diff against it, and the "
                           "changes are printed (exit 1 on a regression, as for any failure)")
    run_.add_argument("--start", choices=("auto", "warm", "fresh"), default=None,
                      help="local engines: forked from a warm parent, or fresh processes (default "
                           "auto: warm unless the engine is on CUDA; env CANARY_ENGINE_START)")
    run_.set_defaults(func=run)


# ---- selection -----------------------------------------------------------------------------------


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def match_k(expr: str, name: str) -> bool:
    """pytest-style `-k`: case-insensitive substrings joined by `and`, `or`, `not`, parentheses."""
    tokens = _TOKEN.findall(expr)
    if not tokens:
        return True
    pos = 0
    low = name.lower()

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise UsageError(f"-k {expr!r}: unexpected end of expression")
        pos += 1
        return tokens[pos - 1]

    def or_expr() -> bool:
        value = and_expr()
        while peek() == "or":
            take()
            value = and_expr() or value
        return value

    def and_expr() -> bool:
        value = not_expr()
        while peek() == "and":
            take()
            value = not_expr() and value
        return value

    def not_expr() -> bool:
        if peek() == "not":
            take()
            return not not_expr()
        tok = take()
        if tok == "(":
            value = or_expr()
            if take() != ")":
                raise UsageError(f"-k {expr!r}: missing ')'")
            return value
        if tok in (")", "and", "or"):
            raise UsageError(f"-k {expr!r}: unexpected {tok!r}")
        return tok.lower() in low

    result = or_expr()
    if pos != len(tokens):
        raise UsageError(f"-k {expr!r}: unexpected {tokens[pos]!r}")
    return result


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 1/4")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= i <= n:
        raise UsageError(f"--shard {text!r}: need 1 <= I <= N")
    return i, n


def select(scenarios: Sequence[Any], k: str | None = None, shard: str | None = None) -> list:
    """Sorted by name, filtered by `-k`, then every Nth from I-1 for `--shard I/N`."""
    chosen = sorted(scenarios, key=lambda s: s.name)
    if k:
        chosen = [s for s in chosen if match_k(k, s.name)]
    if shard:
        i, n = parse_shard(shard)
        chosen = chosen[i - 1 :: n]
    return chosen


# ---- the run -------------------------------------------------------------------------------------


def _summary(records: list) -> None:
    if not records:
        return
    width = max(len(r.scenario) for r in records)
    print(f"\n{'scenario':<{width}}  {'verdict':<20}  {'time':>6}  reason")
    for r in records:
        reason = (r.reason or "").replace("\n", " ")
        reason = reason if len(reason) <= 90 else reason[:87] + "..."
        dur = r.extra.get("duration_s")
        dur_text = f"{dur:.1f}s" if isinstance(dur, (int, float)) else "-"
        print(f"{r.scenario:<{width}}  {r.verdict:<20}  {dur_text:>6}  {reason}")
    counts = Counter(r.verdict for r in records)
    passed = sum(1 for r in records if r.passed)
    print(f"\n{passed}/{len(records)} passed; " + ", ".join(f"{v}: {c}" for v, c in
                                                         sorted(counts.items())))
    harness = [r.scenario for r in records if getattr(r, "cause", None) == "harness"]
    if harness:
        print(f"{len(harness)} not judged: the harness failed, not the engine (cause: harness, after "
              f"retries): {', '.join(harness)}")


def _planted(names: list[str]) -> Path | None:
    """A temporary copy of the engine with the named catalogue entries applied, or None."""
    if not names:
        return None
    import atexit
    import shutil
    import tempfile

    from canaries.regressions import RegressionError, catalogue, materialize

    entries = catalogue()
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise UsageError(f"--regression {', '.join(unknown)}: not in the catalogue "
                         "(canary mutate --list)")
    root = Path(tempfile.mkdtemp(prefix="canary-planted-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    try:
        materialize(root, [entries[n] for n in names])
    except RegressionError as exc:
        raise UsageError(str(exc)) from None
    return root


def check_engine_python(engine_python: str | None, memory: str | None, runtime: str) -> None:
    """UsageError unless the engine interpreter exists and, for --memory sglang, imports sglang."""
    import subprocess
    import sys

    if engine_python is not None:
        if runtime != "local":
            raise UsageError("--engine-python is for the local runtime")
        if not os.access(engine_python, os.X_OK):
            raise UsageError(f"--engine-python {engine_python}: not an executable")
    if memory in ("sglang", "sglang-allocator"):
        if runtime != "local":
            raise UsageError("--memory sglang runs on the local runtime (the engine image has no sglang)")
        python = engine_python or sys.executable
        probe = subprocess.run([python, "-c", "import sglang.srt.mem_cache.allocator.swa"],
                               capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
            raise UsageError(f"--memory sglang: {python} cannot import SGLang's allocator ({tail}); "
                             "make a venv with scripts/make-sglang-venv.sh and pass --engine-python")


def run(args: argparse.Namespace) -> int:
    from canaries.runner import RunInterrupted, cancel_all, default_report_dir, new_run_id, run_many
    from canaries.runtime import RUNTIMES

    if args.runtime not in RUNTIMES:
        raise UsageError(f"--runtime {args.runtime!r}: valid runtimes: {', '.join(RUNTIMES)}")
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    report_dir = Path(args.report_dir) if args.report_dir else default_report_dir(new_run_id())
    if report_dir.is_dir() and any(report_dir.iterdir()):
        # Event logs and verdicts.jsonl are appended to: a second run into the same directory
        # would be judged together with the first one's events (and its old report lost).
        raise UsageError(f"--report-dir {report_dir}: already holds files (a run?); "
                         "give a new or empty directory")
    if report_dir.exists() and not report_dir.is_dir():
        raise UsageError(f"--report-dir {report_dir}: exists and is not a directory")
    if args.start is not None:
        os.environ["CANARY_ENGINE_START"] = args.start  # read by every LocalRuntime of this run
    if args.runtime == "local" and os.environ.get("CANARY_ENGINE_START", "auto") != "fresh":
        from canaries.runtime.local import PRELOAD
        from canaries.runtime.warm import prestart

        # The fork server imports torch (and SGLang) while the scenarios load.
        prestart(args.engine_python, None, PRELOAD.get(args.memory or "", ()))
    elif args.runtime == "sglang-server" and os.environ.get("CANARY_ENGINE_START", "auto") != "fresh":
        from canaries.sglang.warm_parent import prestart_default_parent

        # SGLang's import in the servers' warm parent (about 10 s) while the harness loads.
        prestart_default_parent(args.device)
    check_engine_python(args.engine_python, args.memory, args.runtime)
    if args.baseline is not None and not (Path(args.baseline) / "verdicts.jsonl").is_file():
        raise UsageError(f"--baseline {args.baseline}: not a report directory (no verdicts.jsonl)")
    scenarios = select(load_scenarios(args.paths), args.k, args.shard)
    if not scenarios:
        raise UsageError("no scenario matches the selection")
    if args.runtime == "docker":
        from canaries.runtime.docker_image import DockerUnavailable, get_client

        try:
            get_client().close()  # fail now, not once per scenario
        except DockerUnavailable as exc:
            raise UsageError(str(exc)) from None
    engine_root = _planted(args.regression)
    print(f"canary: {len(scenarios)} scenario(s), runtime {args.runtime}, jobs {args.jobs}, "
          f"report {report_dir}", flush=True)
    from canaries.runtime.safety import SignalLatch, install_sigterm_handler

    install_sigterm_handler()  # from the main thread: the engines start in worker threads
    t0 = time.monotonic()
    try:
        # Signals stay latched from the run through its reports to the way out: once
        # interrupted, a late signal must not kill the process or print a traceback. One that
        # comes after run_many judged every scenario changes nothing: the reports are complete.
        with SignalLatch() as latch:
            try:
                records = run_many(scenarios, report_dir, jobs=args.jobs, runtime=args.runtime,
                                   device=args.device, progress=True, latch=latch,
                                   baseline=args.baseline, memory=args.memory,
                                   engine_python=args.engine_python, engine_root=engine_root)
            except RunInterrupted as exc:  # the reports are written, and say so
                latch.ignore_on_exit()
                _summary(exc.records)
                print(f"\ncanary: {exc.interruption.summary()}; every engine stopped; report "
                      f"in {report_dir}", file=sys.stderr, flush=True)
                return 128 + exc.signum if exc.signum is not None else EXIT_INTERRUPTED
    except KeyboardInterrupt:
        cancel_all()
        print(f"\ncanary: interrupted; every engine stopped; partial report in {report_dir}",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    _summary(records)
    if (args.runtime, args.device, args.memory, args.engine_python, engine_root) == ("local", None, None, None, None):
        from canaries.native_cache import store_run

        store_run(scenarios, records, report_dir)  # what a matrix's native column would run
    regressed = False
    if args.baseline is not None:
        from canaries.report.diff import diff_runs
        from canaries.report.html import write_html

        diff = diff_runs(Path(args.baseline), report_dir)
        if diff.new_failures and args.reruns > 0:
            by_name = {sc.name: sc for sc in scenarios}

            def rerun(names, attempt: int) -> dict:
                print(f"canary: rerun {attempt}/{args.reruns} of {len(names)} new failure(s): {', '.join(names)}",
                      flush=True)
                return {r.scenario: r for r in run_many(
                    [by_name[n] for n in names], report_dir / "reruns" / f"rerun-{attempt}", jobs=args.jobs,
                    runtime=args.runtime, device=args.device, progress=False, memory=args.memory,
                    engine_python=args.engine_python, engine_root=engine_root)}

            try:
                diff = diff.confirm(args.reruns, rerun, args.flaky)
            except RunInterrupted as exc:
                print(f"\ncanary: the reruns were interrupted: {exc.interruption.summary()}", file=sys.stderr)
                return 128 + exc.signum if exc.signum is not None else EXIT_INTERRUPTED
            write_html(report_dir, diff=diff)
        print("\n" + diff.to_text())
        regressed = diff.regressed
    print(f"\nreport: {report_dir}  ({time.monotonic() - t0:.1f}s); open {report_dir / 'index.html'}")
    return EXIT_OK if all(r.passed for r in records) and not regressed else EXIT_FAILED
