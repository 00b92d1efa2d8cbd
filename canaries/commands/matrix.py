"""`canary matrix`: the library on native and on each SGLang release's own memory path.

    canary matrix --sglang 0.5.18,0.5.19,0.5.20,0.5.23 [-j N] [--report-dir DIR]
    canary matrix --config configs/matrix/releases.yaml
    canary matrix --last 0.5.23 --candidate 0.5.23+free-swa-contract-removed    # the gate
    canary matrix --last 0.5.23 --candidate ./dist/sglang-0.5.24-...whl          # a wheel
    canary matrix --last 0.5.23 --candidate ~/src/sglang                         # a checkout
    canary matrix --last 0.5.23 --candidate 0.5.23+./pr.diff                     # a diff
    canary matrix --runtime sglang-server --sglang 0.5.22,0.5.23                 # their servers
    canary matrix --runtime sglang-server --last 0.5.22 --candidate 0.5.23       # the gate on servers
    canary matrix --rejudge reports/matrix-<run>/      # judge a kept matrix again (nothing reruns)

A release is a version on the index, a wheel file or a source checkout, each optionally
followed by `+PATCH` (canaries/sglang/releases/patches.py) or `+path/to/change.diff` parts. With
`--runtime sglang-server` each column is that release's own server (its venv from
`make-sglang-venv.sh --server`), a patched column's server running the patched copy.

As a gate, a scenario that passed on `--last` and fails on `--candidate` runs `--reruns` more
times on both before it counts; one that disagrees with itself is FLAKY (shown; the gate fails on
it only with `--flaky fail`). A cell the harness failed (`cause: harness`) is no verdict on the
release: it is shown apart and never fails the gate.

Exit 0 when every cell is explained (or, as a gate, when no scenario that passed on `--last`
fails on `--candidate` every time), 1 otherwise (naming the scenarios), 2 on bad arguments or a
release that cannot be had, 130 on Ctrl-C (SIGINT or SIGTERM: every column stops at once and the
matrix of what ran is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from canaries.commands.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    load_scenarios,
)
from canaries.confirm import DEFAULT_RERUNS, FLAKY_POLICIES

__all__ = ["add_parser", "run", "read_config"]

_CONFIG_FIELDS = {"sglang", "last", "candidate", "jobs", "runtime", "reruns", "flaky"}
RUNTIMES = ("local", "sglang-server")


def add_parser(sub: argparse._SubParsersAction) -> None:
    matrix = sub.add_parser("matrix", help="the library across SGLang releases (and as a pre-release gate)")
    matrix.add_argument("paths", nargs="*", metavar="PATHS", help="scenario files (default: the library)")
    matrix.add_argument("-k", dest="k", metavar="EXPR", help="select scenarios by name")
    matrix.add_argument("--sglang", metavar="RELEASES",
                        help="comma-separated releases: versions (0.5.18,0.5.23), wheel files, source "
                             "checkouts; +PATCH or +FILE.diff applies a catalogued patch or a diff to a "
                             "throwaway copy")
    matrix.add_argument("--config", metavar="FILE", help="a YAML file with sglang: [...] (and last, candidate, jobs)")
    matrix.add_argument("--last", metavar="RELEASE", help="gate: the release the candidate must not fall behind "
                        "(any form --sglang takes, or a column's label)")
    matrix.add_argument("--candidate", metavar="RELEASE", help="gate: the release under test (a version, a wheel, "
                        "a checkout, BASE+PATCH, BASE+FILE.diff)")
    matrix.add_argument("--jobs", "-j", type=int, default=None, help="scenarios run at once (default 1)")
    matrix.add_argument("--columns", type=int, default=3, metavar="N",
                        help="release columns run side by side (default 3; each runs --jobs scenarios)")
    matrix.add_argument("--runtime", choices=RUNTIMES, default=None,
                        help="SGLang's side: each release's memory path under our engine (local, default) or "
                             "each release's own server (sglang-server; known divergences: configs/parity/server/)")
    matrix.add_argument("--no-build", action="store_true", help="fail instead of building a missing venv")
    matrix.add_argument("--rerun-native", action="store_true",
                        help="run every native scenario, none reused from an earlier run of the same engine, "
                             "harness and scenario (kept under $CANARY_CACHE_DIR, default ~/.cache/serving-canary)")
    matrix.add_argument("--report-dir", metavar="DIR", help="default: reports/matrix-<run-id>/")
    matrix.add_argument("--reruns", type=int, default=None, metavar="N",
                        help="gate: a scenario that passed on --last and fails on --candidate runs N more times "
                             f"on both before it counts (default {DEFAULT_RERUNS}; 0: no reruns)")
    matrix.add_argument("--flaky", choices=FLAKY_POLICIES, default=None,
                        help="gate: a cell that disagrees with itself on a rerun is FLAKY: shown, and the gate "
                             "passes (warn, default) or fails (fail)")
    matrix.add_argument("--rejudge", metavar="DIR",
                        help="judge this matrix report's kept runs again against today's known divergences "
                             "(its columns, runtime and gate as they ran; nothing reruns)")
    matrix.set_defaults(func=run)


def read_config(path: str) -> dict:
    """The matrix config file, checked: unknown fields and wrong types name the file and field."""
    import yaml

    file = Path(path)
    try:
        doc = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping with a `sglang` list")
    unknown = sorted(set(doc) - _CONFIG_FIELDS)
    if unknown:
        raise UsageError(f"{path}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_CONFIG_FIELDS))})")
    releases = doc.get("sglang")
    if not isinstance(releases, list) or not releases:
        raise UsageError(f"{path}: sglang: a non-empty list of releases")
    for key in ("last", "candidate"):
        if key in doc and not isinstance(doc[key], str | float):
            raise UsageError(f"{path}: {key}: a release, e.g. 0.5.23")
    if "jobs" in doc and (not isinstance(doc["jobs"], int) or doc["jobs"] < 1):
        raise UsageError(f"{path}: jobs: a positive integer")
    if "runtime" in doc and doc["runtime"] not in RUNTIMES:
        raise UsageError(f"{path}: runtime: one of {', '.join(RUNTIMES)}")
    if "reruns" in doc and (not isinstance(doc["reruns"], int) or isinstance(doc["reruns"], bool)
                            or doc["reruns"] < 0):
        raise UsageError(f"{path}: reruns: a whole number >= 0")
    if "flaky" in doc and doc["flaky"] not in FLAKY_POLICIES:
        raise UsageError(f"{path}: flaky: one of {', '.join(FLAKY_POLICIES)}")
    return doc


def run(args: argparse.Namespace) -> int:
    from canaries.commands.run import select
    from canaries.runner import RunInterrupted, default_report_dir, new_run_id
    from canaries.sglang.matrix import rejudge_matrix, run_matrix
    from canaries.sglang.releases import ReleaseError, match_release, parse_releases

    if args.rejudge:
        try:
            result = rejudge_matrix(args.rejudge)
        except ValueError as exc:
            raise UsageError(f"--rejudge: {exc}") from None
        print(result.to_markdown())
        return EXIT_OK if result.ok else EXIT_FAILED
    config = read_config(args.config) if args.config else {}
    where = "--sglang" if args.sglang else f"{args.config}: sglang" if config else "--sglang"
    raw = args.sglang or config.get("sglang") or []
    last = args.last or (str(config["last"]) if "last" in config else None)
    candidate = args.candidate or (str(config["candidate"]) if "candidate" in config else None)
    if bool(last) != bool(candidate):
        raise UsageError("the gate needs both --last and --candidate")
    jobs = args.jobs or config.get("jobs") or 1
    runtime = args.runtime or config.get("runtime") or "local"
    reruns = args.reruns if args.reruns is not None else config.get("reruns", DEFAULT_RERUNS)
    flaky = args.flaky or config.get("flaky") or "warn"
    if jobs < 1:
        raise UsageError("--jobs: at least 1")
    if reruns < 0:
        raise UsageError("--reruns: at least 0")
    if args.columns < 1:
        raise UsageError("--columns: at least 1")
    try:
        releases = parse_releases(raw, where=where) if raw else []
        gate_labels = []
        for name, extra in (("--last", last), ("--candidate", candidate)):
            if not extra:
                continue
            # The gate's two releases need not be listed again; named as in the list (or by its
            # label), they are that column.
            spec = match_release(extra, releases, where=name)
            if spec not in releases:
                releases.append(spec)
            gate_labels.append(spec.label)
        if gate_labels:
            last, candidate = gate_labels
        if not releases:
            raise UsageError("name the releases: --sglang 0.5.20,0.5.23, --config FILE, or --last/--candidate")
    except ReleaseError as exc:
        raise UsageError(str(exc)) from None
    scenarios = select(load_scenarios(args.paths), args.k)
    if not scenarios:
        raise UsageError("no scenario matches the selection")
    report = Path(args.report_dir) if args.report_dir else default_report_dir(f"matrix-{new_run_id()}")
    try:
        result = run_matrix(scenarios, releases, report, jobs=jobs, columns_at_once=args.columns,
                            build=not args.no_build, reuse_native=not args.rerun_native,
                            last=last, candidate=candidate, runtime=runtime, reruns=reruns, flaky=flaky)
    except ReleaseError as exc:
        raise UsageError(str(exc)) from None
    except RunInterrupted as exc:
        print(f"canary: matrix interrupted ({exc.interruption.cause}); every engine stopped; what ran is in "
              f"{report}/matrix.md (its unfinished cells NOT_RUN or interrupted) and {report}/runs/",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(result.to_markdown())
    print(f"report: {report} (matrix.md, matrix.json, matrix.html, runs/)")
    g = result.gate
    if g is not None and not g.ok:
        failing = [*g.regressions, *(g.flaky if g.flaky_fails else ())]
        print(f"GATE FAILED: {len(failing)} scenario(s) pass on {last} and fail on {candidate}"
              f"{' (flaky ones count: --flaky fail)' if g.flaky_fails and g.flaky else ''}: {', '.join(failing)}")
    elif g is not None and g.flaky:
        print(f"GATE PASSED with {len(g.flaky)} FLAKY cell(s) (passed on {last}, failed on {candidate}, then "
              f"disagreed with themselves; --flaky fail makes them fail the gate): {', '.join(g.flaky)}")
    return EXIT_OK if result.ok else EXIT_FAILED
