"""Stability: the library N times on one runtime, and the scenarios whose verdict differs between runs.

Runs `canary run` over the same scenarios `--rounds` times for each runtime asked for (native: our
engine; sglang: our engine on SGLang's memory path, `--memory sglang`; server: SGLang's own server,
`--runtime sglang-server`), optionally beside `--busy N` busy loops (a loaded machine), and prints,
per runtime, how many scenarios gave one verdict every time and a table of those that did not
(verdict per round). Each round's load average is printed with it. A harness failure
(`cause: harness`, issue 32) is counted apart: it says the harness, not the engine, was unstable.

    python scripts/stability.py --runtime server --rounds 3 --jobs 3
    python scripts/stability.py --runtime native,sglang,server --rounds 3 --busy 2
    python scripts/stability.py --runtime server --rounds 2 -k swap-next-token
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "configs" / "scenarios"
RUNTIMES = {"native": ["--runtime", "local"], "sglang": ["--runtime", "local", "--memory", "sglang"],
            "server": ["--runtime", "sglang-server"]}
MEMORY_VENV = ROOT / ".venv-sglang" / "bin" / "python"  # SGLang's memory path (make-sglang-venv.sh)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


@contextlib.contextmanager
def _busy_loops(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each, stopped (by their pids) on the way out."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


class RoundFailed(RuntimeError):
    """`canary run` itself failed (not a scenario): the message has its command and stderr."""


def _round(files: list[Path], runtime: str, jobs: int, report: Path, k: str | None,
           memory_python: Path) -> tuple[float, dict[str, dict]]:
    cmd = [sys.executable, "-m", "canaries.cli", "run", *map(str, files), *RUNTIMES[runtime],
           "--jobs", str(jobs), "--report-dir", str(report)] + (["-k", k] if k else [])
    if runtime == "sglang":
        cmd += ["--engine-python", str(memory_python)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise RoundFailed(f"canary run --runtime {runtime} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    rows = [json.loads(line) for line in (report / "verdicts.jsonl").read_text().splitlines() if line.strip()]
    return wall, {r["scenario"]: r for r in rows if "scenario" in r}


def _shown(row: dict) -> str:
    cause = (row.get("extra") or {}).get("cause")
    return f"{row['verdict']} (harness)" if cause == "harness" else row["verdict"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="server", help=f"comma-separated: {', '.join(RUNTIMES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="scenarios at once (above the cores: a loaded machine)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the runs (a loaded machine)")
    parser.add_argument("-k", metavar="EXPR", help="select scenarios by name, as `canary run -k`")
    parser.add_argument("--keep", metavar="DIR", help="keep every round's report under DIR")
    parser.add_argument("--memory-python", type=Path, default=MEMORY_VENV,
                        help=f"the interpreter of the `sglang` runtime's venv (default {MEMORY_VENV})")
    parser.add_argument("paths", nargs="*", help="scenario files (default: the library)")
    args = parser.parse_args()
    runtimes = [r.strip() for r in args.runtime.split(",") if r.strip()]
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown or not runtimes:
        parser.error(f"--runtime: {', '.join(unknown) or 'none'}: one or more of {', '.join(RUNTIMES)}")
    if args.rounds < 2 or args.jobs < 1 or args.busy < 0:
        parser.error("--rounds must be >= 2, --jobs >= 1, --busy >= 0")
    files = [Path(p).resolve() for p in args.paths] or sorted(LIBRARY.glob("*.yaml"))
    print(f"{len(files)} scenario file(s), {args.rounds} rounds, --jobs {args.jobs}, {args.busy} busy loop(s), "
          f"{os.cpu_count()} cores; load {_load()}", flush=True)
    summary: list[tuple[str, int, dict[str, list[str]]]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stability-") as tmp, _busy_loops(args.busy):
        base = Path(args.keep) if args.keep else Path(tmp)
        for runtime in runtimes:
            rounds: list[dict[str, dict]] = []
            for n in range(args.rounds):
                try:
                    wall, rows = _round(files, runtime, args.jobs, base / f"{runtime}-{n}", args.k, args.memory_python)
                except RoundFailed as exc:  # the other runtimes still run and report
                    print(f"{runtime:7} round {n + 1}: {exc}", flush=True)
                    failed.append(runtime)
                    break
                rounds.append(rows)
                harness = sum((r.get("extra") or {}).get("cause") == "harness" for r in rows.values())
                print(f"{runtime:7} round {n + 1}: {len(rows)} scenarios in {wall:6.1f} s, {harness} harness "
                      f"failure(s); load {_load()}", flush=True)
            if runtime in failed:
                continue
            names = sorted(set().union(*rounds))
            unstable = {name: [_shown(r[name]) if name in r else "-" for r in rounds] for name in names}
            unstable = {name: shown for name, shown in unstable.items() if len(set(shown)) > 1}
            summary.append((runtime, len(names), unstable))
    print()
    print("| runtime | scenarios | same verdict every round | differ |")
    print("|---|---|---|---|")
    for runtime, total, unstable in summary:
        print(f"| {runtime} | {total} | {total - len(unstable)} | {len(unstable)} |")
    for runtime, _, unstable in summary:
        if unstable:
            print(f"\n{runtime}: verdicts that differ between rounds")
            print("| scenario | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |")
            print("|---|" + "---|" * args.rounds)
            for name, shown in unstable.items():
                print(f"| {name} | " + " | ".join(shown) + " |")
    if failed:
        print(f"\nnot measured (canary run failed): {', '.join(failed)}")
    return 1 if failed or any(unstable for _, _, unstable in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
