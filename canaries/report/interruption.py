"""How a run was cut short: the run-level fact every report of an interrupted run carries."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Interruption"]


@dataclass(frozen=True)
class Interruption:
    """An interrupted run: what stopped it and where each selected scenario was left.

    `cause` is the signal's name (`SIGINT`, `SIGTERM`) or what else stopped the run.
    `selected` lists every scenario the run was asked for, each in exactly one of `judged`
    (finished: a real verdict), `interrupted` (running: INCONCLUSIVE) and `not_run`.
    """

    cause: str
    selected: tuple[str, ...]
    judged: tuple[str, ...]
    interrupted: tuple[str, ...]
    not_run: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.cause, str) or not self.cause.strip():
            raise ValueError(f"Interruption.cause must be a non-empty string, got {self.cause!r}")
        if len(set(self.selected)) != len(self.selected):
            raise ValueError("Interruption.selected names a scenario twice")
        parts = (*self.judged, *self.interrupted, *self.not_run)
        if sorted(parts) != sorted(self.selected):
            raise ValueError("Interruption: judged, interrupted and not_run must partition "
                             f"selected; got {parts!r} for {self.selected!r}")

    def summary(self) -> str:
        """One line: the cause, how many scenarios were judged, which were cut off."""
        text = (f"the run was interrupted ({self.cause}): {len(self.judged)} of "
                f"{len(self.selected)} scenario(s) judged")
        if self.interrupted:
            text += f"; interrupted while running: {', '.join(self.interrupted)}"
        if self.not_run:
            text += f"; not run: {', '.join(self.not_run)}"
        return text

    def to_dict(self) -> dict:
        """The run-level record (`"run": "interrupted"`) verdicts.jsonl ends with."""
        return {"run": "interrupted", "cause": self.cause, "summary": self.summary(),
                "selected": list(self.selected), "judged": list(self.judged),
                "interrupted": list(self.interrupted), "not_run": list(self.not_run)}
