"""`canary diff BASE RUN`: what changed between two runs' reports, scenario by scenario.

Each report directory is read through its `verdicts.jsonl` (the last record of a scenario wins;
an interrupted run's run-level record is kept aside). Categories, for scenarios in both runs:

- **new failures**: passed in BASE, fail in RUN (grouped by RUN's signature): a regression;
- **fixed**: failed in BASE, pass in RUN;
- **changed verdict**: the same pass state but another verdict (e.g. a failure that changed
  shape, MISSED -> WRONG_DETECTOR), or another signature with the same detectors;
- **changed detector**: the same pass state, a different set of firing detectors;
- **changed latency**: a detector whose detection latency (steps from the first landing to its
  first firing) moved by more than the threshold;
- **added** / **removed**: scenarios in only one of the runs;
- **flaky**: new failures that passed when RUN's side ran them again (`DiffResult.confirm`:
  `canary diff --reruns N`, `canary run --baseline`): not a regression (`--flaky fail` makes them one).

A scenario can be in several of the last three. `regressed` is True iff some scenario passed in
BASE and fails in RUN. `python -m canaries.report.diff BASE RUN [--json]` prints the text (or the
JSON) and exits 1 on a regression, 0 otherwise, 2 when an input is not a report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from canaries.report.jsonl import read_run, read_verdicts

__all__ = ["Change", "DiffResult", "ReportError", "diff_runs", "load_report", "main"]

DEFAULT_LATENCY_THRESHOLD_STEPS = 2



class ReportError(ValueError):
    """A path that is not a readable run report (names the path)."""


@dataclass(frozen=True)
class Change:
    """One scenario present in both runs, as it was in each."""

    scenario: str
    base_verdict: str
    run_verdict: str
    base_passed: bool
    run_passed: bool
    base_signature: str
    run_signature: str
    base_reason: str
    run_reason: str
    base_detectors: tuple[str, ...]
    run_detectors: tuple[str, ...]
    # detector -> (base latency, run latency), only for latencies that moved beyond the threshold
    latency: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def detectors_added(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.run_detectors) - set(self.base_detectors)))

    @property
    def detectors_removed(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.base_detectors) - set(self.run_detectors)))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["base_detectors"] = list(self.base_detectors)
        d["run_detectors"] = list(self.run_detectors)
        d["latency"] = {k: list(v) for k, v in self.latency.items()}
        d["detectors_added"] = list(self.detectors_added)
        d["detectors_removed"] = list(self.detectors_removed)
        return d


@dataclass(frozen=True)
class DiffResult:
    base: str
    run: str
    latency_threshold_steps: int
    new_failures: tuple[Change, ...] = ()
    fixed: tuple[Change, ...] = ()
    changed_verdict: tuple[Change, ...] = ()
    changed_detector: tuple[Change, ...] = ()
    changed_latency: tuple[Change, ...] = ()
    added: tuple[dict, ...] = ()  # {"scenario", "verdict", "passed", "signature"}
    removed: tuple[dict, ...] = ()
    unchanged: int = 0  # scenarios in both runs that are in none of the categories above
    base_interrupted: dict | None = None  # the run-level record of an interrupted run
    run_interrupted: dict | None = None
    # New failures that disagreed with themselves when RUN's side ran them again (`confirm`):
    # not regressions, failing the gate only under `flaky_fails` (`--flaky fail`).
    flaky: tuple[Change, ...] = ()
    flaky_fails: bool = False
    confirmations: dict = field(default_factory=dict)  # scenario -> canaries.confirm.Confirmation

    @property
    def regressed(self) -> bool:
        """True iff some scenario passed in BASE and fails in RUN (every time RUN's side ran it
        again, when it did), or a flaky one does and the flaky policy fails them."""
        return bool(self.new_failures) or (self.flaky_fails and bool(self.flaky))

    def confirm(self, reruns: int, rerun: Callable[[Sequence[str], int], Mapping[str, Any]],
                flaky: str = "warn") -> DiffResult:
        """This diff once each new failure ran `reruns` more times on RUN's side (`rerun`: names
        and attempt -> records by name): one that passed on a rerun is flaky, not a new failure
        (canaries/confirm.py); `flaky` "fail" makes flaky ones fail the gate too."""
        from canaries.confirm import confirm

        names = [c.scenario for c in self.new_failures]
        first_before = {c.scenario: {"verdict": c.base_verdict, "passed": c.base_passed} for c in self.new_failures}
        first_after = {c.scenario: {"verdict": c.run_verdict, "passed": c.run_passed} for c in self.new_failures}
        confirmations = confirm(names, first_before, first_after, reruns, rerun_after=rerun) if reruns > 0 else {}
        disagreed = {name for name, c in confirmations.items() if c.flaky}
        held = tuple(c for c in self.new_failures if c.scenario not in disagreed)
        shaky = tuple(c for c in self.new_failures if c.scenario in disagreed)
        return replace(self, new_failures=held, flaky=self.flaky + shaky, flaky_fails=flaky == "fail",
                       confirmations={**self.confirmations, **confirmations})

    @property
    def changed(self) -> bool:
        return any((self.new_failures, self.fixed, self.changed_verdict, self.changed_detector,
                    self.changed_latency, self.added, self.removed, self.flaky))

    def new_failures_by_signature(self) -> dict[str, list[Change]]:
        """RUN's signature -> the new failures with it, largest group first."""
        groups: dict[str, list[Change]] = {}
        for c in self.new_failures:
            groups.setdefault(c.run_signature, []).append(c)
        return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))

    def to_dict(self) -> dict:
        return {
            "base": self.base,
            "run": self.run,
            "regressed": self.regressed,
            "latency_threshold_steps": self.latency_threshold_steps,
            "new_failures": [c.to_dict() for c in self.new_failures],
            "new_failures_by_signature": {sig: [c.scenario for c in cs] for sig, cs
                                          in self.new_failures_by_signature().items()},
            "fixed": [c.to_dict() for c in self.fixed],
            "changed_verdict": [c.to_dict() for c in self.changed_verdict],
            "changed_detector": [c.to_dict() for c in self.changed_detector],
            "changed_latency": [c.to_dict() for c in self.changed_latency],
            "added": list(self.added),
            "removed": list(self.removed),
            "unchanged": self.unchanged,
            "base_interrupted": self.base_interrupted,
            "run_interrupted": self.run_interrupted,
            "flaky": [c.to_dict() for c in self.flaky],
            "flaky_fails": self.flaky_fails,
            "confirmations": {name: c.to_dict() for name, c in self.confirmations.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_text(self) -> str:
        lines = [f"canary diff: {self.base} -> {self.run}"]
        for which, rec in (("BASE", self.base_interrupted), ("RUN", self.run_interrupted)):
            if rec:
                lines.append(f"note: {which} was interrupted: {rec.get('summary', rec)}")
        if self.regressed:
            lines.append(f"REGRESSED: {len(self.new_failures)} scenario(s) passed in BASE and "
                         "fail in RUN" + (f", {len(self.flaky)} flaky (--flaky fail)" if self.flaky_fails
                                          and self.flaky else ""))
        elif self.flaky:
            lines.append(f"no regression; {len(self.flaky)} FLAKY scenario(s) (--flaky fail makes them fail)")
        elif not self.changed:
            lines.append(f"no change ({self.unchanged} scenario(s) compared)")
        else:
            lines.append("no regression")
        if self.new_failures:
            lines.append("")
            lines.append(f"new failures ({len(self.new_failures)}), by signature:")
            for sig, changes in self.new_failures_by_signature().items():
                lines.append(f"  {sig}  ({len(changes)})")
                for c in changes:
                    lines.append(f"    {c.scenario}: {c.base_verdict} -> {c.run_verdict}: "
                                 f"{c.run_reason}")
        if self.flaky:
            lines.append("")
            lines.append(f"FLAKY ({len(self.flaky)}): passed in BASE, failed in RUN, then disagreed with "
                         "themselves when run again:")
            lines.extend(f"  {c.scenario}: {self.confirmations[c.scenario].describe('BASE', 'RUN')}"
                         if c.scenario in self.confirmations else f"  {c.scenario}" for c in self.flaky)
        sections = (("fixed", self.fixed, lambda c: f"{c.base_verdict} -> {c.run_verdict}"),
                    ("changed verdict (same pass state)", self.changed_verdict,
                     lambda c: f"{c.base_verdict} -> {c.run_verdict} ({c.base_signature} -> "
                               f"{c.run_signature})"),
                    ("changed detector", self.changed_detector, _detector_text),
                    (f"changed latency (by more than {self.latency_threshold_steps} steps)",
                     self.changed_latency, _latency_text))
        for title, changes, describe in sections:
            if changes:
                lines.append("")
                lines.append(f"{title} ({len(changes)}):")
                lines.extend(f"  {c.scenario}: {describe(c)}" for c in changes)
        if self.added:
            lines.append("")
            lines.append(f"added ({len(self.added)}):")
            lines.extend(f"  {a['scenario']}: {a['verdict']}"
                         + ("" if a.get("passed") else " (failing)") for a in self.added)
        if self.removed:
            lines.append("")
            lines.append(f"removed ({len(self.removed)}):")
            lines.extend(f"  {r['scenario']}: was {r['verdict']}" for r in self.removed)
        if self.changed:
            lines.append("")
            lines.append(f"unchanged: {self.unchanged}")
        return "\n".join(lines) + "\n"


def _detector_text(c: Change) -> str:
    parts = [f"+{d}" for d in c.detectors_added] + [f"-{d}" for d in c.detectors_removed]
    return f"{c.run_verdict}: " + " ".join(parts)


def _latency_text(c: Change) -> str:
    return ", ".join(f"{d} {b} -> {r} steps" for d, (b, r) in sorted(c.latency.items()))


def _report_file(path: Path) -> Path:
    if path.is_file() and path.name == "verdicts.jsonl":
        return path
    if not path.exists():
        raise ReportError(f"{path}: no such directory")
    if not path.is_dir():
        raise ReportError(f"{path}: not a report directory")
    file = path / "verdicts.jsonl"
    if not file.is_file():
        raise ReportError(f"{path}: not a run report: it has no verdicts.jsonl")
    return file


def load_report(path: str | Path) -> tuple[dict[str, dict], dict | None]:
    """A report's scenario records by name (the last record of a name wins) and its run-level
    record (an interrupted run's) or None. ReportError when `path` is not a readable report."""
    file = _report_file(Path(path))
    try:
        records = read_verdicts(file)
        run = read_run(file)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{file}: unreadable: {exc}") from None
    by_name: dict[str, dict] = {}
    for r in records:
        name = r.get("scenario")
        if not isinstance(name, str) or "verdict" not in r:
            raise ReportError(f"{file}: a record without a scenario name or verdict: "
                              f"{json.dumps(r)[:120]}")
        by_name[name] = r
    if not by_name:
        raise ReportError(f"{file}: no scenario records")
    return by_name, run


def _detectors(record: dict) -> tuple[str, ...]:
    return tuple(sorted({str(f.get("detector")) for f in record.get("firings") or []
                         if f.get("detector") is not None}))


def _latencies(record: dict) -> dict[str, int]:
    return {d: v for d, v in (record.get("latency") or {}).items()
            if isinstance(v, int) and not isinstance(v, bool)}


def _passed(record: dict) -> bool:
    return bool(record.get("passed"))


def _change(name: str, b: dict, r: dict, threshold: int) -> Change:
    lb, lr = _latencies(b), _latencies(r)
    moved = {d: (lb[d], lr[d]) for d in sorted(set(lb) & set(lr)) if abs(lr[d] - lb[d]) > threshold}
    return Change(
        scenario=name, base_verdict=str(b.get("verdict")), run_verdict=str(r.get("verdict")),
        base_passed=_passed(b), run_passed=_passed(r),
        base_signature=str(b.get("signature", "")), run_signature=str(r.get("signature", "")),
        base_reason=str(b.get("reason", "")), run_reason=str(r.get("reason", "")),
        base_detectors=_detectors(b), run_detectors=_detectors(r), latency=moved)


def _brief(record: dict) -> dict:
    return {"scenario": record.get("scenario"), "verdict": record.get("verdict"),
            "passed": _passed(record), "signature": record.get("signature", "")}


def diff_runs(base: Path, run: Path,
              latency_threshold_steps: int = DEFAULT_LATENCY_THRESHOLD_STEPS) -> DiffResult:
    """Compare two report directories scenario by scenario (module docstring).
    ReportError when either is not a readable report."""
    if latency_threshold_steps < 0:
        raise ValueError(f"latency_threshold_steps must be >= 0, got {latency_threshold_steps}")
    base_records, base_run = load_report(base)
    run_records, run_run = load_report(run)
    new_failures, fixed, verdicts, detectors, latency = [], [], [], [], []
    unchanged = 0
    for name in sorted(set(base_records) & set(run_records)):
        c = _change(name, base_records[name], run_records[name], latency_threshold_steps)
        if c.base_passed and not c.run_passed:
            new_failures.append(c)
            continue
        if not c.base_passed and c.run_passed:
            fixed.append(c)
            continue
        touched = False
        if c.base_verdict != c.run_verdict or (c.base_signature != c.run_signature
                                                and c.base_detectors == c.run_detectors):
            verdicts.append(c)
            touched = True
        if c.base_detectors != c.run_detectors:
            detectors.append(c)
            touched = True
        if c.latency:
            latency.append(c)
            touched = True
        unchanged += not touched
    return DiffResult(
        base=str(base), run=str(run), latency_threshold_steps=latency_threshold_steps,
        new_failures=tuple(new_failures), fixed=tuple(fixed), changed_verdict=tuple(verdicts),
        changed_detector=tuple(detectors), changed_latency=tuple(latency),
        added=tuple(_brief(run_records[n]) for n in sorted(set(run_records) - set(base_records))),
        removed=tuple(_brief(base_records[n])
                      for n in sorted(set(base_records) - set(run_records))),
        unchanged=unchanged, base_interrupted=base_run, run_interrupted=run_run)


def main(argv: Sequence[str] | None = None) -> int:
    """`canary diff BASE RUN [--json] [--latency-threshold N]`: 1 on a regression, 0 otherwise,
    2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="canary diff",
        description="Compare two run reports (directories with verdicts.jsonl) scenario by "
                    "scenario. Exit status: 1 if a scenario that passed in BASE fails in RUN, "
                    "0 otherwise, 2 if an input is not a report.")
    parser.add_argument("base", type=Path, help="the last good run's report directory")
    parser.add_argument("run", type=Path, help="the run to judge")
    parser.add_argument("--json", action="store_true", help="print the diff as JSON")
    parser.add_argument("--latency-threshold", type=int, default=DEFAULT_LATENCY_THRESHOLD_STEPS,
                        metavar="STEPS", help="report latency changes beyond this many steps "
                                              f"(default {DEFAULT_LATENCY_THRESHOLD_STEPS})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage already; keep --help at 0
        return int(exc.code or 0)
    if args.latency_threshold < 0:
        print("canary diff: --latency-threshold must be >= 0", file=sys.stderr)
        return 2
    try:
        result = diff_runs(args.base, args.run, args.latency_threshold)
    except ReportError as exc:
        print(f"canary diff: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result.to_json() + "\n" if args.json else result.to_text())
    return 1 if result.regressed else 0


if __name__ == "__main__":
    sys.exit(main())
