"""A gate confirms before it fails: a scenario that passed before and fails now is run again.

A release gate (`canary matrix --last --candidate`) or a run against a baseline (`canary run
--baseline`, `canary diff --reruns`) names a regression only when it holds: each suspect (passed on
the side before, fails on the side after) is rerun `reruns` times on every side that can run again
(both columns of a matrix; the new run against a kept report). `Confirmation` keeps each side's
verdicts, first run first. A side that disagrees with itself makes the cell FLAKY: not a
regression, shown apart, and failing the gate only under the `fail` policy (`--flaky fail`). A
rerun the harness failed (`cause: harness`, after its own retries) tells nothing and is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DEFAULT_RERUNS", "FLAKY", "FLAKY_POLICIES", "Confirmation", "confirm", "confirmation_from_dict"]

FLAKY = "FLAKY"
FLAKY_POLICIES = ("warn", "fail")  # a flaky cell: shown, the gate passes / the gate fails
DEFAULT_RERUNS = 2

# scenario names -> their records, one per name (a rerun of those scenarios on one side)
Rerun = Callable[[Sequence[str], int], Mapping[str, Any]]


@dataclass(frozen=True)
class Confirmation:
    """One suspect's runs: `before` (the side it passed on) and `after` (the side it fails on),
    each a tuple of (verdict, passed), the first run first."""

    scenario: str
    before: tuple[tuple[str, bool], ...]
    after: tuple[tuple[str, bool], ...]

    @property
    def flaky(self) -> bool:
        """Some side disagrees with itself (passed on one of its runs and failed on another)."""
        return any(len({passed for _, passed in side}) > 1 for side in (self.before, self.after))

    @property
    def confirmed(self) -> bool:
        """Every run before passed and every run after failed: the regression holds."""
        return all(p for _, p in self.before) and not any(p for _, p in self.after)

    def describe(self, before: str = "before", after: str = "after") -> str:
        def side(runs: tuple[tuple[str, bool], ...]) -> str:
            return f"passed {sum(p for _, p in runs)}/{len(runs)} ({', '.join(v for v, _ in runs)})"

        return f"{before}: {side(self.before)}; {after}: {side(self.after)}"

    def to_dict(self) -> dict:
        return asdict(self)


def confirmation_from_dict(doc: Mapping[str, Any]) -> Confirmation:
    """A `Confirmation` read back from its `to_dict()` (a kept report)."""
    return Confirmation(str(doc["scenario"]), tuple((str(v), bool(p)) for v, p in doc.get("before") or ()),
                        tuple((str(v), bool(p)) for v, p in doc.get("after") or ()))


def _judged(record: Any) -> bool:
    cause = getattr(record, "cause", None)
    if cause is None and isinstance(record, Mapping):
        cause = record.get("cause")
    return cause != "harness"


def _outcome(record: Any) -> tuple[str, bool]:
    if isinstance(record, Mapping):
        return str(record.get("verdict")), bool(record.get("passed"))
    return str(record.verdict), bool(record.passed)


def confirm(suspects: Sequence[str], first_before: Mapping[str, Any], first_after: Mapping[str, Any],
            reruns: int, rerun_after: Rerun, rerun_before: Rerun | None = None) -> dict[str, Confirmation]:
    """Run each suspect again `reruns` times on each side that can (`rerun_before` None: the side
    before is a kept report) and return its `Confirmation`; `first_*`: each side's first record
    by scenario name (records or dicts with `verdict`, `passed` and `cause`)."""
    runs: dict[str, dict[str, list[tuple[str, bool]]]] = {
        name: {"before": [_outcome(first_before[name])], "after": [_outcome(first_after[name])]}
        for name in suspects}
    for attempt in range(1, reruns + 1):
        for side, rerun in (("before", rerun_before), ("after", rerun_after)):
            if rerun is None or not suspects:
                continue
            for name, record in rerun(list(suspects), attempt).items():
                if name in runs and _judged(record):
                    runs[name][side].append(_outcome(record))
    return {name: Confirmation(name, tuple(r["before"]), tuple(r["after"])) for name, r in runs.items()}
