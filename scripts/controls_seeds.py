"""Clean controls over many seeds: zero false alarms, or the gate's green means nothing.

Every library scenario that expects `clean: true` is copied once per seed (its `seed`, which
drives the prompts, the sampler and the model weights, replaced; its name suffixed `-s<seed>`),
and all the copies run in one `canary run` (warm engines, `--jobs J`). Prints, per control, how
many seeds stayed CLEAN and the verdict and reason of every one that did not; exits 1 on any.

    python scripts/controls_seeds.py                  # every control, seeds 1..20
    python scripts/controls_seeds.py --seeds 50 -k pressure --jobs 2
    python scripts/controls_seeds.py --runtime sglang-server --seeds 5   # on SGLang's own server

On SGLang's server a control whose verdict there is a recorded divergence
(configs/parity/server/sglang-<version>.yaml, with its reason traced to SGLang's source) is counted
`known`, not a false alarm, when its verdict is one the divergence allows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's canaries, installed or not (run as a script)
LIBRARY = ROOT / "configs" / "scenarios"


def controls(name_filter: str | None) -> list[tuple[Path, dict]]:
    """The library's clean controls (path, parsed document), sorted by name."""
    found = []
    for path in sorted(LIBRARY.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not (doc.get("expect") or {}).get("clean"):
            continue
        if name_filter and name_filter.lower() not in doc["name"].lower():
            continue
        found.append((path, doc))
    return found


def _server_divergences() -> dict[str, tuple[str, ...]]:
    """{control: the verdicts its recorded divergence allows} on the server venv's release."""
    from canaries.sglang.divergences import known_divergences
    from canaries.sglang.parity import SERVER_PARITY_DIR, engine_sglang_version, recorded_verdicts
    from canaries.sglang.releases.venvs import find_python

    python = find_python("0.5.23", server=True)
    if python is None:
        raise SystemExit("no server venv: bash scripts/make-sglang-venv.sh --server")
    entries = known_divergences(engine_sglang_version(str(python)), SERVER_PARITY_DIR).entries
    return {name: recorded_verdicts(entry) for name, entry in entries.items()}


def write_copies(chosen: list[tuple[Path, dict]], seeds: range, into: Path) -> dict[str, str]:
    """One file per (control, seed) under `into`; maps each copy's name to its control's.

    The copy is the file's text with its top-level `name:` and `seed:` lines replaced (not a
    YAML round trip, which would turn the scenario's own `off` into `false`)."""
    origin = {}
    for path, doc in chosen:
        lines = path.read_text(encoding="utf-8").splitlines()
        for seed in seeds:
            name = f"{doc['name']}-s{seed}"
            copy = [f"name: {name}" if line.startswith("name:") else
                    f"seed: {seed}" if line.startswith("seed:") else line for line in lines]
            if not any(line.startswith("seed:") for line in lines):
                copy.append(f"seed: {seed}")
            (into / f"{name}.yaml").write_text("\n".join(copy) + "\n", encoding="utf-8")
            origin[name] = doc["name"]
    return origin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 1..N per control (default 20)")
    parser.add_argument("-k", dest="name_filter", help="only controls whose name contains this")
    parser.add_argument("--jobs", "-j", type=int, default=2)
    parser.add_argument("--report-dir", type=Path, help="default: a temporary directory")
    parser.add_argument("--runtime", default="local", choices=("local", "sglang-server"))
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    chosen = controls(args.name_filter)
    if not chosen:
        parser.error("no clean control matches")
    with tempfile.TemporaryDirectory(prefix="controls-") as tmp:
        scenarios = Path(tmp) / "scenarios"
        scenarios.mkdir()
        origin = write_copies(chosen, range(1, args.seeds + 1), scenarios)
        report = args.report_dir or Path(tmp) / "report"
        print(f"controls: {len(chosen)} controls x {args.seeds} seeds = {len(origin)} runs, "
              f"jobs {args.jobs}, report {report}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "canaries.cli", "run", str(scenarios),
                               "--jobs", str(args.jobs), "--report-dir", str(report),
                               "--runtime", args.runtime],
                              cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
        verdicts_file = report / "verdicts.jsonl"
        if proc.returncode not in (0, 1) or not verdicts_file.is_file():  # 1: a verdict failed
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
            print(f"controls: `canary run` exited {proc.returncode}"
                  + ("" if verdicts_file.is_file() else " and wrote no verdicts"), file=sys.stderr)
            return 2
        records = {}
        for line in verdicts_file.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            records[record["scenario"]] = record
    known = _server_divergences() if args.runtime == "sglang-server" else {}
    clean: dict[str, int] = defaultdict(int)
    alarms: dict[str, list[str]] = defaultdict(list)
    expected: dict[str, list[str]] = defaultdict(list)
    for copy, control in sorted(origin.items()):
        record = records.get(copy)
        if record is None:
            alarms[control].append(f"{copy}: no verdict (the run stopped early?)")
        elif record["verdict"] == "CLEAN":
            clean[control] += 1
        elif control in known and record["verdict"] in known[control]:
            expected[control].append(f"{copy}: {record['verdict']} (known: configs/parity/server/)")
        else:
            alarms[control].append(f"{copy}: {record['verdict']}: {record['reason']}")
    width = max(len(doc["name"]) for _, doc in chosen)
    for _, doc in chosen:
        name = doc["name"]
        print(f"{name:<{width}}  {clean[name]:>3}/{args.seeds} CLEAN"
              + (f", {len(expected[name])} known divergence" if expected[name] else ""))
        for line in alarms[name]:
            print(f"    {line}")
    total_alarms = sum(map(len, alarms.values()))
    total_known = sum(map(len, expected.values()))
    print(f"\n{sum(clean.values())}/{len(origin)} CLEAN, {total_known} known divergence(s), "
          f"{total_alarms} false alarm(s); {wall:.1f}s wall")
    return 1 if total_alarms else 0


if __name__ == "__main__":
    sys.exit(main())
