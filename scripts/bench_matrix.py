"""The release matrix against one `canary run` of the library, side by side, on this machine.

    python scripts/bench_matrix.py [--releases 0.5.18,0.5.19,0.5.20,0.5.23] [--jobs 2]
        [--columns 2,3] [-k EXPR]

Runs `canary run -j JOBS` once, then `canary matrix --sglang RELEASES -j JOBS --columns N` for
each N, each into a fresh report directory, and prints each wall time and the ratio matrix /
run (target: at most 4.0x for four releases). Needs every release's venv
(scripts/make-sglang-venv.sh); a release without one stops it (`--no-build`). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _timed(argv: list[str], report: Path) -> float:
    env = {**os.environ, "CANARY_PROGRESS": "plain"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", *argv, "--report-dir", str(report)],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    seconds = time.monotonic() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench_matrix: `canary {' '.join(argv)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", default="0.5.18,0.5.19,0.5.20,0.5.23")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--columns", default="2", help="comma-separated --columns values to time")
    parser.add_argument("-k", dest="k", help="a scenario selection (default: the library)")
    args = parser.parse_args(argv)
    select = ["-k", args.k] if args.k else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as scratch:
        run_s = _timed(["run", "-j", str(args.jobs), *select], Path(scratch) / "run")
        print(f"canary run -j {args.jobs}: {run_s:.1f}s", flush=True)
        for columns in [int(c) for c in args.columns.split(",")]:
            matrix_s = _timed(["matrix", "--sglang", args.releases, "-j", str(args.jobs), "--columns", str(columns),
                               "--no-build", *select], Path(scratch) / f"matrix-{columns}")
            ratio = matrix_s / run_s
            rows.append({"columns": columns, "matrix_s": round(matrix_s, 1), "ratio": round(ratio, 2)})
            print(f"canary matrix ({args.releases}) -j {args.jobs} --columns {columns}: {matrix_s:.1f}s = "
                  f"{ratio:.2f}x one run (target <= 4.0x)", flush=True)
    print(json.dumps({"bench": "matrix", "releases": args.releases, "jobs": args.jobs, "run_s": round(run_s, 1),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
