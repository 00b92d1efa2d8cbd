"""What the suite's census costs SGLang's server: the same scenarios with it and without it.

Runs the selection on `--runtime sglang-server` with `CANARY_SERVER_CENSUS=off` (SGLang's own
detectors alone) and on (the census at every idle pass; with `invariant_check: strict` also after
every batch that moved slots between owners), alternating rounds in one process tree so that
machine noise falls on both, and prints each run's wall time and the on/off ratio (issue 31's
goal: <= 1.1x). The census also clocks itself inside the scheduler (`census_cost` in each
`idle_check` event): the script sums it per mode of the census, so the per-step cost is read
directly, not as the difference of two noisy wall times.

    python scripts/bench_server_census.py                     # every 3rd library scenario, --jobs 2
    python scripts/bench_server_census.py --every 1 --rounds 2
    python scripts/bench_server_census.py --strict            # only scenarios at invariant_check: strict
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "configs" / "scenarios"


def _strict(path: Path) -> bool:
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return (doc.get("engine") or {}).get("invariant_check") == "strict"


def _run(files: list[Path], census: str, jobs: int, report: Path) -> tuple[float, list[dict]]:
    env = {**os.environ, "CANARY_SERVER_CENSUS": census}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", "run", *map(str, files), "--runtime",
                           "sglang-server", "--jobs", str(jobs), "--report-dir", str(report)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"canary run (census {census}) failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return wall, [r for r in rows if "scenario" in r]


def _census_clock(report: Path) -> dict[str, float]:
    """The census's own clock, summed over the run's scenarios (the last idle pass of each has
    its scheduler's totals so far, idle passes summed)."""
    total = {"idle_ms": 0.0, "idle_passes": 0, "after_batch_ms": 0.0, "after_batch_runs": 0, "batches": 0}
    for events in report.glob("*/events.jsonl"):
        last = None
        for line in events.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("kind") == "idle_check" and "census_cost" in event:
                cost = event["census_cost"]
                total["idle_ms"] += cost["idle_ms"]
                total["idle_passes"] += 1
                last = cost
        if last is not None:
            for key in ("after_batch_ms", "after_batch_runs", "batches"):
                total[key] += last[key]
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=3, help="every Nth library scenario, by name (1: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="alternate off/on this many times (median)")
    parser.add_argument("--strict", action="store_true", help="only scenarios at invariant_check: strict")
    args = parser.parse_args()
    if args.every < 1 or args.jobs < 1 or args.rounds < 1:
        parser.error("--every, --jobs and --rounds must be >= 1")
    files = sorted(LIBRARY.glob("*.yaml"))
    if args.strict:
        files = [f for f in files if _strict(f)]
    files = files[:: args.every]
    walls: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-census-") as tmp:
        for round_no in range(args.rounds):
            for census in ("off", "on"):
                report = Path(tmp) / f"{census}-{round_no}"
                wall, rows = _run(files, census, args.jobs, report)
                walls[census].append(wall)
                verdicts: dict[str, int] = {}
                for r in rows:
                    verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
                line = (f"census {census:3}  {len(rows)} scenarios  wall {wall:7.1f} s  "
                        f"{wall / max(len(rows), 1):6.2f} s/scenario  {verdicts}")
                if census == "on":
                    clock = _census_clock(report)
                    per_pass = clock["idle_ms"] / max(clock["idle_passes"], 1)
                    per_run = clock["after_batch_ms"] / max(clock["after_batch_runs"], 1)
                    per_batch = clock["after_batch_ms"] / max(clock["batches"], 1)
                    line += (f"\n  census clock: {clock['idle_passes']} idle passes, {clock['idle_ms']:.0f} ms "
                             f"({per_pass:.1f} ms each); after batches (strict): {clock['batches']} batches, "
                             f"{clock['after_batch_runs']} censuses, {clock['after_batch_ms']:.0f} ms "
                             f"({per_run:.1f} ms a census, {per_batch:.2f} ms a batch)")
                print(line, flush=True)
    ratios = ", ".join(f"{on / off:.3f}" for on, off in zip(walls["on"], walls["off"], strict=True))
    print(f"ratio census on / off: {statistics.median(walls['on']) / statistics.median(walls['off']):.3f}x "
          f"median (per round: {ratios}; goal <= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
