"""`canary repro RUN_DIR/SCENARIO`: rerun exactly what ran, and say whether it ran the same way.

A run dir keeps the scenario file as it ran (`scenario.yaml`), the engine's `spec.json`, and in
`verdict.json` the runtime, device and start mode. The rerun goes to a fresh directory beside it;
its event trace (`engine_stub.events.trace_of`: the events without wall times, pids, ports and
paths) is compared with the original's, event by event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ReproError", "ReproResult", "repro", "rerun_report"]


class ReproError(ValueError):
    """The directory is not a scenario's run dir (the message says what is missing)."""


@dataclass(frozen=True)
class ReproResult:
    """The original and the rerun, side by side."""

    run_dir: Path
    rerun_dir: Path
    verdict: str
    rerun_verdict: str
    signature: str
    rerun_signature: str
    trace_identical: bool
    first_difference: tuple[int, dict | None, dict | None] | None  # (index, original, rerun)

    @property
    def same(self) -> bool:
        return self.trace_identical and (self.verdict, self.signature) == (self.rerun_verdict,
                                                                           self.rerun_signature)

    def to_text(self) -> str:
        lines = [f"repro of {self.run_dir} -> {self.rerun_dir}",
                 f"verdict: {self.verdict} -> {self.rerun_verdict}"
                 + ("" if self.signature == self.rerun_signature
                    else f" (signature {self.signature} -> {self.rerun_signature})"),
                 "event trace: identical" if self.trace_identical else "event trace: DIFFERS"]
        if self.first_difference is not None:
            index, before, after = self.first_difference
            lines.append(f"  first difference at event {index}:")
            lines.append(f"    original: {json.dumps(before, default=str) if before else '(none)'}")
            lines.append(f"    rerun:    {json.dumps(after, default=str) if after else '(none)'}")
        return "\n".join(lines)


def _first_difference(a: list[dict], b: list[dict]) -> tuple[int, dict | None, dict | None] | None:
    for i in range(max(len(a), len(b))):
        left = a[i] if i < len(a) else None
        right = b[i] if i < len(b) else None
        if left != right:
            return i, left, right
    return None


def _load(run_dir: Path) -> tuple[Any, dict]:
    from canaries.scenario import ScenarioError, load_scenario

    verdict_path = run_dir / "verdict.json"
    if not verdict_path.is_file():
        raise ReproError(f"{run_dir}: not a scenario's run dir (no verdict.json)")
    verdict = json.loads(verdict_path.read_text(encoding="utf-8"))
    source = run_dir / "scenario.yaml"
    if not source.is_file():
        raise ReproError(f"{run_dir}: no scenario.yaml (the copy of the scenario as it ran)")
    try:
        return load_scenario(source), verdict
    except ScenarioError as exc:
        raise ReproError(f"{source}: the scenario no longer loads:\n{exc}") from None


def repro(run_dir: str | Path, out_dir: str | Path | None = None) -> ReproResult:
    """Rerun the scenario of `run_dir` as it ran; the comparison."""
    from canaries.runner import run_scenario
    from engine_stub.events import read_events, trace_of

    run_dir = Path(run_dir).resolve()
    scenario, verdict = _load(run_dir)
    extra = verdict.get("extra", {})
    rerun_dir = Path(out_dir) if out_dir else run_dir.parent / f"{run_dir.name}.repro-{datetime.now():%H%M%S}"
    record = run_scenario(scenario, rerun_dir, runtime=extra.get("runtime", "local"),
                          device=extra.get("device"))
    original = trace_of(read_events(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    rerun = trace_of(read_events(rerun_dir / "events.jsonl")) if (rerun_dir / "events.jsonl").exists() else []
    difference = _first_difference(original, rerun)
    return ReproResult(run_dir, rerun_dir, verdict.get("verdict", "?"), record.verdict,
                       verdict.get("signature", ""), record.signature, difference is None, difference)


def rerun_report(report: str | Path, names: list[str], out_dir: str | Path) -> dict[str, Any]:
    """Run the named scenarios of a run report again as they ran there (each run dir's scenario
    file, runtime, device, memory backend and interpreter), into `out_dir`; records by name.
    ReproError for a name whose run dir cannot be rerun."""
    from canaries.runner import run_many

    groups: dict[tuple, list] = {}
    for name in names:
        scenario, verdict = _load(Path(report) / name)
        extra = verdict.get("extra", {})
        memory = extra.get("memory")
        key = (extra.get("runtime", "local"), extra.get("device"), None if memory == "native" else memory,
               extra.get("engine_python"))
        groups.setdefault(key, []).append(scenario)
    records: dict[str, Any] = {}
    for (runtime, device, memory, python), scenarios in groups.items():
        for record in run_many(scenarios, Path(out_dir), runtime=runtime, device=device, memory=memory,
                               engine_python=python, progress=False):
            records[record.scenario] = record
    return records
