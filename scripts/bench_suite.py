"""The gate's wall time: the default library with fresh engine processes vs warm (forked) starts.

Runs `canary run --jobs J` on the library once per mode per round, alternating fresh and warm so
that machine noise falls on both, and prints each run's wall time, the warm/fresh ratio, and
whether verdicts and event traces are identical between the modes. Then times one scenario via
`canary run FILE` from a cold shell against a bare `python -c "import torch"`, and the torch-free
author commands (`canary validate`, `canary list kinds`).

    python scripts/bench_suite.py                 # 2 rounds, --jobs 2
    python scripts/bench_suite.py --rounds 1 --jobs 1
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
sys.path.insert(0, str(ROOT))

from engine_stub.events import read_events, trace_of  # noqa: E402

SINGLE = ROOT / "configs" / "scenarios" / "corrupt-r2t-strict.yaml"


def _canary(*args: str, env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "canaries.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    return time.perf_counter() - t0, proc


def _run_library(mode: str, jobs: int, report: Path) -> float:
    env = {**os.environ, "CANARY_ENGINE_START": mode}
    wall, proc = _canary("run", "--jobs", str(jobs), "--report-dir", str(report), env=env)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"canary run ({mode}) failed with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall


def _verdicts(report: Path) -> dict[str, tuple[str, str]]:
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return {r["scenario"]: (r["verdict"], r.get("signature", "")) for r in rows if "scenario" in r}


def _modes_of(report: Path) -> set[str]:
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return {r.get("extra", {}).get("start_mode") for r in rows if "scenario" in r}


def _trace_differences(a: Path, b: Path, names: list[str]) -> list[str]:
    return [n for n in names
            if trace_of(read_events(a / n / "events.jsonl")) != trace_of(read_events(b / n / "events.jsonl"))]


def _median_time(cmd, runs: int) -> float:
    """Median wall time of `cmd` (a list, or a function of the run's index giving one)."""
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd(i) if callable(cmd) else cmd, cwd=ROOT, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cold-runs", type=int, default=3, help="repetitions of the cold-shell timings")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    walls: dict[str, list[float]] = {"fresh": [], "warm": []}
    reports: dict[str, Path] = {}
    for r in range(args.rounds):
        for mode in ("fresh", "warm"):
            report = out / f"{mode}-{r}"
            walls[mode].append(_run_library(mode, args.jobs, report))
            reports.setdefault(mode, report)
            print(f"round {r + 1} {mode:5s}: {walls[mode][-1]:6.1f}s  (start modes seen: "
                  f"{', '.join(sorted(m or '?' for m in _modes_of(report)))})", flush=True)
    fresh, warm = statistics.median(walls["fresh"]), statistics.median(walls["warm"])
    a, b = _verdicts(reports["fresh"]), _verdicts(reports["warm"])
    diffs = _trace_differences(reports["fresh"], reports["warm"], sorted(a))
    print(f"\nlibrary ({len(a)} scenarios, --jobs {args.jobs}): fresh {fresh:.1f}s, warm {warm:.1f}s, "
          f"warm/fresh {warm / fresh:.3f} (target <= 0.333)")
    print(f"verdicts identical: {a == b}; event traces identical: {not diffs}"
          + (f" (differ: {', '.join(diffs)})" if diffs else ""))

    torch_s = _median_time([sys.executable, "-c", "import torch"], args.cold_runs)
    # A report dir is written once: each repetition gets its own.
    single = _median_time(lambda i: [sys.executable, "-m", "canaries.cli", "run", str(SINGLE),
                                     "--report-dir", str(out / f"single-{i}")], args.cold_runs)
    print(f"\ncold shell: python -c 'import torch' {torch_s:.2f}s; canary run {SINGLE.name} "
          f"{single:.2f}s = {single / torch_s:.2f}x (target <= 2.5x)")
    for cmd in (["validate", "configs/scenarios"], ["list", "kinds"]):
        t = _median_time([sys.executable, "-m", "canaries.cli", *cmd], args.cold_runs)
        print(f"canary {' '.join(cmd)}: {t:.3f}s (target <= 0.3s)")
    print(f"\nreports under {out}")
    return 0 if a == b and not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
