"""The scenario data model: a validated Scenario, its parts, and the problems validation finds.

Defaults of the parts come from the field table (`canaries/scenario/fields.py`), the one place
that declares each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from canaries.scenario.fields import ENGINE_OUTCOMES, PASSING, VERDICTS, WORKLOAD, engine_knobs

if TYPE_CHECKING:
    from engine_stub.config import EngineConfig
    from engine_stub.perturb.spec import PerturbationSpec

__all__ = ["ENGINE_OUTCOMES", "PASSING", "VERDICTS", "Disabled", "Expect", "ExtraRequest", "Problem",
           "Scenario", "ScenarioError", "Workload"]


def _printable(text: str) -> str:
    """`text` with every non-printable character escaped (a key or path may hold any)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


@dataclass(frozen=True)
class Problem:
    """One validation problem (or, with `warning`, a warning): where it is (file, 1-based line,
    field path) and what is wrong.

    `str()` gives `file:line: field: message` (a warning: `file:line: field: warning: message`):
    one line, or more when the message has line breaks (each further line indented), never a
    trailing newline or a bare carriage return.
    """

    file: str
    line: int | None
    field: str
    message: str
    warning: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not self.file:
            raise ValueError(f"Problem.file must be a non-empty path, got {self.file!r}")
        if self.line is not None and (not isinstance(self.line, int) or self.line < 1):
            raise ValueError(f"Problem.line must be None or >= 1, got {self.line!r}")
        if not isinstance(self.field, str):
            raise ValueError(f"Problem.field must be a string, got {self.field!r}")
        if not isinstance(self.message, str) or not self.message.strip():
            raise ValueError(f"Problem.message must be a non-empty string, got {self.message!r}")

    def __str__(self) -> str:
        file = _printable(self.file)
        where = f"{file}:{self.line}" if self.line is not None else file
        lines = [_printable(part.rstrip()) for part in self.message.splitlines() if part.strip()]
        tag = "warning: " if self.warning else ""
        return f"{where}: {_printable(self.field) or '<document>'}: {tag}" + "\n    ".join(lines)


class ScenarioError(ValueError):
    """A scenario file failed validation; `problems` holds every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class ExtraRequest:
    """One explicit request of `workload.extra_requests` (the EXTRA_REQUEST table): a fresh
    prompt of `prompt_tokens`, or request `prompt_of`'s prompt (followed by its answer with
    `with_answer`; its first `keep_tokens`), then `append_tokens` fresh tokens; `max_new_tokens`
    None means the workload's; `status` is the answer the engine must give, and
    `min_cached_tokens` how many prompt tokens the radix cache must serve (judged in controls);
    `hang_up_after_tokens`: its client hangs up after that many output tokens (never answered)."""

    prompt_tokens: int | None = None
    prompt_of: int | None = None
    with_answer: bool = False
    keep_tokens: int | None = None
    append_tokens: int = 0
    max_new_tokens: int | None = None
    status: int = 200
    min_cached_tokens: int | None = None
    hang_up_after_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt_tokens is None) == (self.prompt_of is None):
            raise ValueError("an extra request needs exactly one of prompt_tokens and prompt_of")
        if (self.keep_tokens is not None or self.with_answer) and self.prompt_of is None:
            raise ValueError("keep_tokens and with_answer need prompt_of")


@dataclass(frozen=True)
class Workload:
    """The requests the driver sends (the WORKLOAD table)."""

    requests: int = WORKLOAD["requests"].default
    concurrency: int = WORKLOAD["concurrency"].default
    prompt_tokens: tuple[int, int] = WORKLOAD["prompt_tokens"].default
    shared_prefix_tokens: int = WORKLOAD["shared_prefix_tokens"].default
    max_new_tokens: int = WORKLOAD["max_new_tokens"].default
    temperature: float = WORKLOAD["temperature"].default
    unique_prompts: bool = WORKLOAD["unique_prompts"].default
    extra_requests: tuple[ExtraRequest, ...] = ()

    @property
    def total_requests(self) -> int:
        """Generated requests plus the explicit ones."""
        return self.requests + len(self.extra_requests)

    @property
    def served_requests(self) -> int:
        """The requests the engine must serve (the explicit ones expecting a refusal aside)."""
        return self.requests + sum(1 for x in self.extra_requests if x.status == 200)


@dataclass(frozen=True)
class Disabled:
    """A deliberately disabled check: the knob values that must be in force, and why."""

    checks: dict[str, object]
    reason: str


@dataclass(frozen=True)
class Expect:
    """What the suite must observe (the EXPECT table). Exactly one of clean / fires / disabled
    is the mode."""

    clean: bool = False
    fires: tuple[str, ...] = ()
    any: bool = False  # with fires: one of them suffices
    within_steps: int | None = None
    silent: tuple[str, ...] = ()
    engine: str | None = None
    disabled: Disabled | None = None
    detected_by: tuple[str, ...] = ()
    verdict: str | None = None


@dataclass(frozen=True)
class Scenario:
    """A validated scenario.

    `engine` is the EngineConfig the scenario resolves to (profile < the scenario's keys, the
    scenario seed as `seed`), validated once by the loader; `raw` is the YAML document as read.
    """

    name: str
    description: str
    seed: int
    profile: str
    engine: EngineConfig
    workload: Workload
    perturbations: tuple[PerturbationSpec, ...]
    expect: Expect
    path: str
    regressions: tuple[str, ...] = ()  # catalogue entries the engine runs with (negative tests)
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    warnings: tuple[Problem, ...] = field(default=(), compare=False, repr=False)

    @property
    def engine_knobs(self) -> dict:
        """The knobs a scenario may set, with their resolved values, plus `seed`: what the
        engine's spec carries as JSON and the verdict records."""
        knobs = {name: getattr(self.engine, name) for name in engine_knobs()}
        knobs["seed"] = self.engine.seed
        return knobs

