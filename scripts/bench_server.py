"""Time per scenario: SGLang's real server (`--runtime sglang-server`) against our engine.

Runs the same scenarios with `canary run --runtime local` and `--runtime sglang-server` (forked
from the warm parent; `--fresh` adds a round of fresh `python -m sglang.launch_server` starts),
one after the other in one process tree so that machine noise falls on all, and prints each
run's wall time, its time per scenario and the server/native ratio (issue 23's target: <= 5x).

    python scripts/bench_server.py                      # every 6th library scenario, --jobs 2
    python scripts/bench_server.py --every 1 --jobs 2   # the whole library
    python scripts/bench_server.py --fresh              # also fresh server starts
    python scripts/bench_server.py --every 3 --rounds 2 # two alternating rounds, median ratio
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

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "configs" / "scenarios"


def _run(files: list[Path], runtime: str, jobs: int, report: Path, start: str) -> tuple[float, list[dict]]:
    env = {**os.environ, "CANARY_ENGINE_START": start}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "run", *map(str, files), "--runtime", runtime,
                           "--jobs", str(jobs), "--report-dir", str(report)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"canary run --runtime {runtime} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return wall, [r for r in rows if "scenario" in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=6, help="every Nth library scenario, by name (1: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="also time fresh server starts")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the runs this many times (median)")
    args = parser.parse_args()
    if args.every < 1 or args.jobs < 1 or args.rounds < 1:
        parser.error("--every, --jobs and --rounds must be >= 1")
    files = sorted(LIBRARY.glob("*.yaml"))[:: args.every]
    modes = [("local", "auto"), ("sglang-server", "warm")] + ([("sglang-server", "fresh")] if args.fresh else [])
    walls: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        for round_no, (runtime, start) in ((r, m) for r in range(args.rounds) for m in modes):
            wall, rows = _run(files, runtime, args.jobs, Path(tmp) / f"{runtime}-{start}-{round_no}", start)
            walls.setdefault((runtime, start), []).append(wall)
            verdicts = {}
            for r in rows:
                verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
            starts = [r.get("extra", {}).get("phases_s", {}).get("start") for r in rows]
            starts = [s for s in starts if isinstance(s, (int, float))]
            mean_start = sum(starts) / len(starts) if starts else float("nan")
            print(f"{runtime:14} start={start:6} {len(rows)} scenarios  wall {wall:7.1f} s  "
                  f"{wall / max(len(rows), 1):6.2f} s/scenario  mean start {mean_start:5.2f} s  {verdicts}",
                  flush=True)
    native = statistics.median(walls[("local", "auto")])
    for (runtime, start), values in walls.items():
        if runtime != "local":
            ratios = ", ".join(f"{w / n:.2f}" for w, n in zip(values, walls[("local", "auto")], strict=True))
            print(f"ratio {runtime} ({start}) / local: {statistics.median(values) / native:.2f}x median "
                  f"(per round: {ratios}; target <= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
