"""`canary mutate`: run the library against mutated copies of the engine; a mutant a scenario
tells apart from the real engine is killed.

Mutants are catalogued regressions (`canaries.regressions`) or automatic ones (a seeded sample of
cosmic-ray's mutations over `engine_stub/mem/` and the scheduler's memory calls, see
`canaries.automutants`). Each runs from a temporary copy of the engine's sources (`engine_root`),
never the checkout. The scenarios run first against the real engine (the baseline); a mutant is
killed when a scenario that passes there fails against it. Writes, under the report dir:
`mutants.jsonl` (one line per mutant: diff, status, the scenarios that killed it and their
verdicts), `mutant_matrix.md`/`.json` (mutant x scenario) and each mutant's own run report.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canaries.regressions import Regression, RegressionError, materialize

__all__ = ["CampaignResult", "MutantOutcome", "run_campaign"]

KILLED, SURVIVED, EQUIVALENT, STALE = "killed", "survived", "equivalent", "stale"


@dataclass
class MutantOutcome:
    """What one mutant did to the scenarios it met."""

    mutant: str
    kind: str  # catalogue | auto
    area: str
    file: str
    models: str
    status: str
    diff: str = ""
    scenarios: list[str] = field(default_factory=list)
    killed_by: list[dict] = field(default_factory=list)  # {scenario, baseline, verdict, reason}
    verdicts: dict[str, str] = field(default_factory=dict)
    expected_killers: list[str] = field(default_factory=list)
    equivalent: str | None = None
    error: str | None = None
    duration_s: float = 0.0

    @property
    def gate_fails(self) -> bool:
        """A non-equivalent catalogued mutant that survived (or no longer applies)."""
        return self.kind == "catalogue" and self.status in (SURVIVED, STALE)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CampaignResult:
    outcomes: list[MutantOutcome]
    baseline: dict[str, str]
    baseline_failures: list[str]
    report_dir: Path
    wall_s: float

    @property
    def score(self) -> tuple[int, int]:
        """(killed, non-equivalent mutants)."""
        counted = [o for o in self.outcomes if o.status in (KILLED, SURVIVED)]
        return sum(o.status == KILLED for o in counted), len(counted)

    @property
    def gate_fails(self) -> bool:
        return any(o.gate_fails for o in self.outcomes)

    def summary(self) -> str:
        killed, total = self.score
        lines = [f"{'mutant':<44} {'status':<10} killed by"]
        for o in self.outcomes:
            by = ", ".join(f"{k['scenario']} ({k['verdict']})" for k in o.killed_by[:3])
            if len(o.killed_by) > 3:
                by += f", +{len(o.killed_by) - 3}"
            note = o.equivalent if o.status == EQUIVALENT else o.error or by
            lines.append(f"{o.mutant:<44} {o.status:<10} {note or '-'}")
        pct = f"{100 * killed / total:.0f}%" if total else "n/a"
        lines.append(f"\nscore: {killed}/{total} killed ({pct}); "
                     f"{sum(o.status == EQUIVALENT for o in self.outcomes)} equivalent; "
                     f"{sum(o.status == STALE for o in self.outcomes)} stale; {self.wall_s:.0f}s")
        if self.baseline_failures:
            lines.append("scenarios failing on the real engine (they cannot kill): "
                         + ", ".join(self.baseline_failures))
        return "\n".join(lines)


def _write(report_dir: Path, result: CampaignResult) -> None:
    from canaries.report.atomic import write_atomic

    write_atomic(report_dir / "mutants.jsonl",
                 "".join(json.dumps(o.to_dict(), default=str) + "\n" for o in result.outcomes).encode())
    scenarios = sorted({s for o in result.outcomes for s in o.scenarios})
    matrix = {o.mutant: {s: ("K" if any(k["scenario"] == s for k in o.killed_by)
                             else "." if s in o.verdicts else "-") for s in scenarios}
              for o in result.outcomes}
    killed, total = result.score
    write_atomic(report_dir / "mutant_matrix.json", json.dumps(
        {"score": {"killed": killed, "non_equivalent": total}, "scenarios": scenarios,
         "matrix": matrix, "status": {o.mutant: o.status for o in result.outcomes}}, indent=2).encode() + b"\n")
    lines = [f"# Mutants x scenarios: {killed}/{total} killed", "",
             "K: the scenario killed the mutant; .: ran, passed; -: not run.", "",
             "| mutant | status | " + " | ".join(scenarios) + " |",
             "|---|---|" + "---|" * len(scenarios)]
    for o in result.outcomes:
        lines.append(f"| {o.mutant} | {o.status} | " + " | ".join(matrix[o.mutant][s] for s in scenarios) + " |")
    write_atomic(report_dir / "mutant_matrix.md", ("\n".join(lines) + "\n").encode())


def _judge(outcome: MutantOutcome, records: Sequence[Any], baseline: dict[str, bool]) -> None:
    for record in records:
        outcome.verdicts[record.scenario] = record.verdict
        if baseline.get(record.scenario) and not record.passed:
            outcome.killed_by.append({"scenario": record.scenario, "baseline": "passed",
                                      "verdict": record.verdict, "reason": (record.reason or "")[:300]})
    outcome.status = KILLED if outcome.killed_by else SURVIVED


def run_campaign(
    mutants: Sequence[Regression],
    scenarios: Sequence[Any],
    report_dir: str | Path,
    *,
    kind: str = "catalogue",
    jobs: int = 1,
    runtime: str = "local",
    all_scenarios: bool = False,
    progress: Callable[[str], None] | None = print,
) -> CampaignResult:
    """Run every mutant against its scenarios (its `caught_by`, or all with `all_scenarios`)."""
    from canaries.runner import run_many
    from canaries.runtime.warm import close_fork_server

    t0 = time.monotonic()
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    by_name = {s.name: s for s in scenarios}
    for m in mutants:
        missing = [n for n in m.caught_by if n not in by_name]
        if missing:
            raise RegressionError(f"{m.name}: caught_by names unknown scenarios: {', '.join(missing)}")

    # A scenario that plants catalogue entries of its own (`regressions:`) judges that broken
    # engine, not a mutant: it cannot run on a mutant's copy, and is left out of the "all" set.
    unplanted = [s for s in scenarios if not s.regressions]

    def chosen(m: Regression) -> list[Any]:
        if all_scenarios or not m.caught_by:
            return list(unplanted)
        return [by_name[n] for n in m.caught_by]

    needed = sorted({s.name for m in mutants if not m.equivalent for s in chosen(m)})
    say = progress or (lambda _: None)
    say(f"canary mutate: baseline of {len(needed)} scenario(s) on the real engine")
    base_records = run_many([by_name[n] for n in needed], report_dir / "baseline", jobs=jobs,
                            runtime=runtime, progress=False) if needed else []
    baseline = {r.scenario: r.passed for r in base_records}
    outcomes: list[MutantOutcome] = []
    work = Path(tempfile.mkdtemp(prefix="canary-mutants-"))
    try:
        for i, m in enumerate(mutants, 1):
            started = time.monotonic()
            outcome = MutantOutcome(m.name, kind, m.area, m.file, m.models, SURVIVED,
                                    expected_killers=list(m.caught_by), equivalent=m.equivalent)
            root = work / m.name
            try:
                outcome.diff = materialize(root, [m])
            except RegressionError as exc:
                outcome.status, outcome.error = STALE, str(exc)
            else:
                if m.equivalent:
                    outcome.status = EQUIVALENT
                else:
                    picked = [s for s in chosen(m) if baseline.get(s.name)]
                    outcome.scenarios = [s.name for s in picked]
                    try:
                        records = run_many(picked, report_dir / "mutants" / m.name, jobs=jobs,
                                           runtime=runtime, progress=False, engine_root=root)
                    finally:
                        close_fork_server(engine_root=root)
                    _judge(outcome, records, baseline)
            shutil.rmtree(root, ignore_errors=True)
            outcome.duration_s = round(time.monotonic() - started, 2)
            outcomes.append(outcome)
            say(f"[{i}/{len(mutants)}] {m.name}: {outcome.status}"
                + (f" by {', '.join(k['scenario'] for k in outcome.killed_by[:3])}" if outcome.killed_by else "")
                + (f" ({outcome.error})" if outcome.error else "") + f" ({outcome.duration_s:.1f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = CampaignResult(outcomes, {r.scenario: r.verdict for r in base_records},
                            [n for n, ok in baseline.items() if not ok], report_dir,
                            round(time.monotonic() - t0, 1))
    _write(report_dir, result)
    return result
