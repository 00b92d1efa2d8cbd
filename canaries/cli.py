"""`canary`: run, list, validate, create and describe fault-injection scenarios.

    canary run [PATHS...] [-k EXPR] [--runtime local|docker] [--device auto|cpu|cuda]
               [--report-dir DIR] [--jobs N] [--shard I/N]
    canary list [kinds|invariants|scenarios|profiles]
    canary validate [PATHS...]
    canary new NAME --from SCENARIO [--dir configs/scenarios]
    canary schema
    canary gc [--all] [--images]

`run` exits 0 when every verdict passed, 1 when any failed, 2 on a usage or validation error,
130 on Ctrl-C and 143 on SIGTERM (128 + the signal). An interrupted run stops every engine, then
writes its reports anyway: every selected scenario is listed (running ones INCONCLUSIVE
"interrupted", the others NOT_RUN) and each report says the run was interrupted; further
signals are ignored until that is done.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "match_k", "parse_shard", "select"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad arguments or invalid scenarios: exit 2 with the message."""


def scenarios_dir() -> Path:
    from canaries.scenario import SCENARIO_DIR

    here = Path.cwd() / "configs" / "scenarios"
    return here if here.is_dir() else SCENARIO_DIR


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


# ---- loading -------------------------------------------------------------------------------------


def _scenario_files(paths: Sequence[str]) -> list[Path]:
    from canaries import scenario as sc

    if not paths:
        return [Path(p) for p in sc.discover()]
    for raw in paths:
        if not Path(raw).exists():
            raise UsageError(f"{raw}: no such file or directory")
    return [Path(p) for p in sc.discover(paths)]


def _problems(files: Sequence[Path]) -> list:
    from canaries import scenario as sc

    return sc.validate_paths(files)


def load_scenarios(paths: Sequence[str]) -> list:
    """Load and validate; UsageError listing every problem (duplicate names included)."""
    from canaries import scenario as sc

    files = _scenario_files(paths)
    if not files:
        raise UsageError("no scenario files found")
    problems = _problems(files)
    if problems:
        raise UsageError("\n".join(str(p) for p in problems))
    return [sc.load_scenario(f) for f in files]


# ---- commands ------------------------------------------------------------------------------------


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


def cmd_run(args: argparse.Namespace) -> int:
    from canaries.runner import RunInterrupted, cancel_all, default_report_dir, new_run_id, run_many
    from canaries.runtime import RUNTIMES

    if args.runtime not in RUNTIMES:
        raise UsageError(f"--runtime {args.runtime!r}: valid runtimes: {', '.join(RUNTIMES)}")
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    if args.start is not None:
        os.environ["CANARY_ENGINE_START"] = args.start  # read by every LocalRuntime of this run
    if args.runtime == "local" and os.environ.get("CANARY_ENGINE_START", "auto") != "fresh":
        from canaries.runtime.warm import prestart

        prestart()  # the fork server imports torch while the scenarios load
    scenarios = select(load_scenarios(args.paths), args.k, args.shard)
    if not scenarios:
        raise UsageError("no scenario matches the selection")
    if args.runtime == "docker":
        from canaries.runtime.docker_image import DockerUnavailable, get_client

        try:
            get_client().close()  # fail now, not once per scenario
        except DockerUnavailable as exc:
            raise UsageError(str(exc)) from None
    report_dir = Path(args.report_dir) if args.report_dir else default_report_dir(new_run_id())
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
                                   device=args.device, progress=True, latch=latch)
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
    print(f"\nreport: {report_dir}  ({time.monotonic() - t0:.1f}s)")
    return EXIT_OK if all(r.passed for r in records) else EXIT_FAILED


def _first_doc_line(doc: str) -> str:
    return (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""


def cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what == "kinds":
        from engine_stub.perturb.kinds import KINDS

        width = max(len(n) for n in KINDS)
        for name in sorted(KINDS):
            info = KINDS[name]
            print(f"{name:<{width}}  {_first_doc_line(info.doc)}")
    elif what == "invariants":
        for inv in _invariants():
            print(f"{inv.name:<28}  {inv.bucket.name:<20}  {inv.description}")
        from engine_stub.kv_canary import REASONS

        for reason in REASONS:
            print(f"{'kv_canary.' + reason:<28}  {'KV_CANARY':<20}  KV canary violation reason")
    elif what == "scenarios":
        scenarios = sorted(load_scenarios([]), key=lambda s: s.name)
        width = max((len(s.name) for s in scenarios), default=8)
        for s in scenarios:
            print(f"{s.name:<{width}}  {(getattr(s, 'description', '') or '').strip()}")
    elif what == "profiles":
        from canaries import scenario as sc

        for name, body in sc.list_profiles().items():
            print(f"{name}  {json.dumps(body, sort_keys=True)}")
    return EXIT_OK


def _invariants() -> tuple:
    from canaries.scenario import load_invariant_registry
    from engine_stub.invariants import registered_invariants

    load_invariant_registry()
    return registered_invariants()


def cmd_validate(args: argparse.Namespace) -> int:
    files = _scenario_files(args.paths)
    problems = _problems(files)
    for p in problems:
        sys.stdout.write(f"{p}\n")
    # Every problem line is out before the summary goes to the other stream: where both end up
    # in one place, the summary must not land inside a half-flushed problem line.
    sys.stdout.flush()
    if problems:
        bad = len({p.file for p in problems})
        print(f"{len(problems)} problem(s) in {bad} file(s)", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(f"{len(files)} scenarios OK")
    return EXIT_OK


def cmd_new(args: argparse.Namespace) -> int:
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


def cmd_schema(args: argparse.Namespace) -> int:
    from canaries import scenario as sc

    print(json.dumps(sc.json_schema(), indent=2))
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from canaries.runtime.docker import DockerUnavailable, gc

    try:
        removed = gc(include_live=args.all, images=args.images)
    except DockerUnavailable as exc:
        raise UsageError(str(exc)) from None
    print(f"removed {removed} serving-canary container(s)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canary", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="run scenarios and report verdicts")
    run.add_argument("paths", nargs="*", metavar="PATHS",
                     help="scenario files or folders (default: every scenario in configs/scenarios)")
    run.add_argument("-k", dest="k", metavar="EXPR",
                     help="select by name: case-insensitive substrings with and/or/not")
    run.add_argument("--runtime", default="local", help="local (default) | docker")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                     help="override every scenario's engine.device")
    run.add_argument("--report-dir", metavar="DIR", help="default: reports/<run-id>/")
    run.add_argument("--jobs", "-j", type=int, default=1, help="scenarios run at once")
    run.add_argument("--shard", metavar="I/N", help="run every Nth scenario starting at I-1")
    run.add_argument("--start", choices=("auto", "warm", "fresh"), default=None,
                     help="local engines: forked from a warm parent, or fresh processes (default "
                          "auto: warm unless the engine is on CUDA; env CANARY_ENGINE_START)")
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="list perturbation kinds, invariants, scenarios, profiles")
    lst.add_argument("what", nargs="?", default="scenarios",
                     choices=("kinds", "invariants", "scenarios", "profiles"))
    lst.set_defaults(func=cmd_list)

    val = sub.add_parser("validate", help="check scenario files (file:line: field: message)")
    val.add_argument("paths", nargs="*", metavar="PATHS")
    val.set_defaults(func=cmd_validate)

    new = sub.add_parser("new", help="copy a scenario under a new name")
    new.add_argument("name", metavar="NAME")
    new.add_argument("--from", dest="source", required=True, metavar="SCENARIO",
                     help="a scenario file, or the name of one in configs/scenarios")
    new.add_argument("--dir", default=None, help="where to write it (default configs/scenarios)")
    new.set_defaults(func=cmd_new)

    schema = sub.add_parser("schema", help="print the scenario JSON Schema")
    schema.set_defaults(func=cmd_schema)

    gc = sub.add_parser("gc", help="remove engine containers left behind by earlier runs")
    gc.add_argument("--all", action="store_true", help="also containers of runs still going")
    gc.add_argument("--images", action="store_true", help="also engine images of older sources")
    gc.set_defaults(func=cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"canary: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        from canaries.runner import cancel_all

        cancel_all()
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
