"""The gate's time, side by side in one run: the library against a bare `import torch`, the release
matrix against one library run, SGLang's server against our engine, and the server matrix against
one server run.

    python scripts/bench_matrix.py [--releases 0.5.21,0.5.22,0.5.23]
        [--server-columns 0.5.22,0.5.23,0.5.23+release-leaks-last-slot] [--jobs 2] [--columns 3]
        [--every N] [--skip memory|server] [--rerun-native] [--cold-only]

In this order, each into a fresh report directory, with the machine's load average beside each:

1. `python -c "import torch"`, three times before step 2 and three times after it: the unit (the
   mean of the two medians);
2. `canary run -j JOBS` (our engine): its time per scenario in `import torch` units (target
   <= 0.15); this run also stores the native results the matrices below reuse
   (canaries/native_cache.py), as any library run does;
3. `canary matrix --sglang RELEASES -j JOBS --columns N --no-build` (the memory path): the ratio
   to step 2 (target <= 3.0x for native plus three releases, issue 33; the default is the three
   newest, the heaviest: 0.5.22 and 0.5.23 run every scenario, 0.5.21 all but those with a page
   size above 1, which need CUDA there; 0.5.18-0.5.20 refuse them too);
4. `canary run --runtime sglang-server -j JOBS`, twice: cold (every server reference's clean
   answers computed, as on a fresh machine) and warm (the same run, the answers kept from the
   cold one: canaries/sglang/oracle_cache.py); each run's ratio to step 2 (target <= 3.0x);
   `--cold-only` skips the warm one;
5. `canary matrix --runtime sglang-server --sglang SERVER_COLUMNS -j JOBS --columns N --no-build`,
   cold: the ratio to step 4's cold run (target <= 3.0x for three server columns).

`--every N` takes every Nth library scenario by name (1: the whole library). `--rerun-native`
makes the matrices run their native column too. Needs every venv (scripts/make-sglang-venv.sh,
`--server` for the server columns). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORACLE_CACHE_ENV = "CANARY_SERVER_ORACLE_CACHE"  # canaries/sglang/oracle_cache.py
LIBRARY = REPO / "configs" / "scenarios"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _canary(argv: list[str], report: Path, env: dict[str, str] | None = None) -> tuple[float, dict]:
    """Wall time of `canary ARGV --report-dir REPORT` (with `env` added) and its matrix.json (or {})."""
    env = {**os.environ, "CANARY_PROGRESS": "plain", **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", *argv, "--report-dir", str(report)],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    seconds = time.monotonic() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench_matrix: `canary {' '.join(argv)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    doc = report / "matrix.json"
    return seconds, json.loads(doc.read_text()) if doc.is_file() else {}


def _verdicts(report: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return {r["scenario"]: r["verdict"] for r in rows if "scenario" in r}


def _torch_unit(runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", default="0.5.21,0.5.22,0.5.23")
    parser.add_argument("--server-columns", default="0.5.22,0.5.23,0.5.23+release-leaks-last-slot")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--columns", type=int, default=3, help="matrix columns side by side")
    parser.add_argument("--every", type=int, default=1, help="every Nth library scenario (1: all)")
    parser.add_argument("--skip", choices=("memory", "server"), action="append", default=[],
                        help="leave out the memory-path matrix or both server steps")
    parser.add_argument("--rerun-native", action="store_true", help="the matrices run their native column too")
    parser.add_argument("--cold-only", action="store_true",
                        help="run the server library once (every reference computed), not again with them kept")
    parser.add_argument("--keep", metavar="DIR", help="write the reports under DIR (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.every < 1 or args.jobs < 1 or args.columns < 1:
        parser.error("--every, --jobs and --columns must be >= 1")
    files = [str(p) for p in sorted(LIBRARY.glob("*.yaml"))[:: args.every]]
    jobs = ["-j", str(args.jobs)]
    matrix_flags = [*jobs, "--columns", str(args.columns), "--no-build",
                    *(["--rerun-native"] if args.rerun_native else [])]
    out: dict = {"bench": "gate", "jobs": args.jobs, "scenarios": len(files), "columns": args.columns}
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        load = _load()
        unit = _torch_unit()
        out["import_torch_s"] = round(unit, 3)
        print(f"python -c 'import torch': {unit:.2f}s (median of 3; load {load})", flush=True)

        load = _load()
        run_s, _ = _canary(["run", *files, *jobs], tmp / "run")
        per = run_s / len(files)
        # The unit moves by a third between runs on these machines: measured again right after
        # the run, and the run judged against the mean of both medians.
        after = _torch_unit()
        unit = (unit + after) / 2
        out |= {"import_torch_after_s": round(after, 3), "run_s": round(run_s, 1), "run_units": round(per / unit, 3)}
        print(f"canary run -j {args.jobs} ({len(files)} scenarios): {run_s:.1f}s, {per:.3f}s a scenario = "
              f"{per / unit:.3f} import-torch units (target <= 0.15; unit {unit:.2f}s, {after:.2f}s after "
              f"the run; load {load} -> {_load()})", flush=True)

        if "memory" not in args.skip:
            load = _load()
            matrix_s, doc = _canary(["matrix", *files, "--sglang", args.releases, *matrix_flags], tmp / "matrix")
            out |= {"matrix_s": round(matrix_s, 1), "matrix_ratio": round(matrix_s / run_s, 2),
                    "matrix_native_cached": doc.get("native_cached", 0)}
            print(f"canary matrix --sglang {args.releases}: {matrix_s:.1f}s = {matrix_s / run_s:.2f}x one run "
                  f"(target <= 3.0x; native {doc.get('native_cached', 0)} of {len(files)} reused; "
                  f"load {load} -> {_load()})", flush=True)

        if "server" not in args.skip:
            # Cold: every reference's answers computed (a fresh machine); warm: the same run
            # again, each reference's answers kept from the cold one (canaries/sglang/oracle_cache.py).
            oracle_dir = tmp / "server-oracle"
            rounds = ("cold",) if args.cold_only else ("cold", "warm")
            cold_s = 0.0
            for round_ in rounds:
                load = _load()
                server_s, _ = _canary(["run", *files, *jobs, "--runtime", "sglang-server"], tmp / f"server-{round_}",
                                      env={ORACLE_CACHE_ENV: str(oracle_dir)})
                kept = len(list(oracle_dir.rglob("*.json")))
                cold_s = cold_s or server_s
                out |= {f"server_{round_}_s": round(server_s, 1), f"server_{round_}_ratio": round(server_s / run_s, 2)}
                print(f"canary run --runtime sglang-server -j {args.jobs} ({round_} references, {kept} kept after): "
                      f"{server_s:.1f}s, {server_s / len(files):.3f}s a scenario = {server_s / run_s:.2f}x our engine "
                      f"(target <= 3.0x; load {load} -> {_load()})", flush=True)
            load = _load()
            smatrix_s, doc = _canary(["matrix", *files, "--runtime", "sglang-server", "--sglang",
                                      args.server_columns, *matrix_flags], tmp / "server-matrix",
                                     env={ORACLE_CACHE_ENV: str(tmp / "server-matrix-oracle")})
            out |= {"server_matrix_s": round(smatrix_s, 1), "server_matrix_ratio": round(smatrix_s / cold_s, 2)}
            print(f"canary matrix --runtime sglang-server --sglang {args.server_columns}: {smatrix_s:.1f}s = "
                  f"{smatrix_s / cold_s:.2f}x one cold server run (target <= 3.0x; native "
                  f"{doc.get('native_cached', 0)} of {len(files)} reused; load {load} -> {_load()})", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
