"""The regression catalogue: named edits to the engine's code that model real bugs.

Each `Regression` names a file under `engine_stub/`, an exact snippet of it (`old`) and what it
becomes (`new`); applying it to a copy of the engine's sources checks that `old` occurs exactly
once, so an entry that no longer matches the code fails loudly instead of mutating nothing. It
says what it models, and either the scenarios expected to kill it (`caught_by`: a kill is any of
them failing against the mutated engine while it passes against the real one) or why nothing can
(`equivalent`). Entries live one module per area of the memory path; `catalogue()` loads them.

Regressions are applied only to temporary copies (`materialize`), never to the checkout.
"""

from __future__ import annotations

import difflib
import importlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AREAS", "Regression", "RegressionError", "catalogue", "materialize", "regression"]

AREAS = ("pr36723", "free_group", "mapping", "window", "admission", "finish", "radix", "suballoc",
         "paged", "req_to_token", "kv_canary", "ledgers", "chunk")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
ENGINE_PACKAGE = "engine_stub"


class RegressionError(ValueError):
    """A catalogue entry is malformed or no longer applies to the engine's code."""


@dataclass(frozen=True)
class Regression:
    """One named edit of the engine.

    Args:
        name: unique, lower-case (reports, `-k` selection).
        area: one of AREAS.
        file: path under the repo root, inside engine_stub/.
        old: the exact text it replaces; must occur exactly once in `file`.
        new: the replacement.
        models: the real bug it stands for, in a sentence.
        caught_by: scenario names expected to kill it.
        equivalent: why no scenario can tell it apart (instead of `caught_by`).
        also: further `(old, new)` edits of the same file, for a bug that spans two places
            (each applied after the ones before it, each checked to occur exactly once).
    """

    name: str
    area: str
    file: str
    old: str
    new: str
    models: str
    caught_by: tuple[str, ...] = ()
    equivalent: str | None = None
    also: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise RegressionError(f"regression name {self.name!r}: lower-case letters, digits, '.', '_', '-'")
        if self.area not in AREAS:
            raise RegressionError(f"{self.name}: area {self.area!r} is not one of {', '.join(AREAS)}")
        if not self.file.startswith(f"{ENGINE_PACKAGE}/") or not self.file.endswith(".py"):
            raise RegressionError(f"{self.name}: file {self.file!r} must be a .py under {ENGINE_PACKAGE}/")
        for old, new in ((self.old, self.new), *self.also):
            if not old or old == new:
                raise RegressionError(f"{self.name}: old must be non-empty and differ from new")
        if bool(self.caught_by) == bool(self.equivalent):
            raise RegressionError(f"{self.name}: give exactly one of caught_by (scenarios) and equivalent (a reason)")
        if not self.models.strip():
            raise RegressionError(f"{self.name}: say what real bug it models")

    def apply(self, root: str | Path) -> str:
        """Edit `root/file` in place (a copy!); return the unified diff."""
        path = Path(root) / self.file
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise RegressionError(f"{self.name}: cannot read {self.file}: {exc}") from None
        mutated = text
        for i, (old, new) in enumerate(((self.old, self.new), *self.also)):
            count = mutated.count(old)
            if count != 1:
                which = "its snippet" if i == 0 else f"its snippet also[{i - 1}]"
                raise RegressionError(f"{self.name}: {which} occurs {count} times in {self.file} "
                                      "(it must occur exactly once; the code moved on: update the entry)")
            mutated = mutated.replace(old, new)
        path.write_text(mutated, encoding="utf-8")
        return "".join(difflib.unified_diff(text.splitlines(True), mutated.splitlines(True),
                                            f"a/{self.file}", f"b/{self.file}", n=2))


_CATALOGUE: dict[str, Regression] = {}


def regression(**fields) -> Regression:
    """Declare and register a catalogue entry (keyword arguments of `Regression`)."""
    entry = Regression(**fields)
    if entry.name in _CATALOGUE:
        raise RegressionError(f"regression {entry.name!r} is declared twice")
    _CATALOGUE[entry.name] = entry
    return entry


def catalogue() -> dict[str, Regression]:
    """Every entry, by name (importing each area's module once)."""
    for area in AREAS:
        importlib.import_module(f"canaries.regressions.{area}")
    return dict(_CATALOGUE)


def engine_sources() -> Path:
    """The checkout's engine package (what a copy starts from)."""
    return Path(__file__).resolve().parents[2] / ENGINE_PACKAGE


def materialize(root: str | Path, edits: list[Regression] | tuple[Regression, ...] = ()) -> str:
    """Copy the engine's sources to `root/engine_stub` and apply `edits`; the combined diff.

    `root` can then be an `engine_root` of a runtime (it holds an engine_stub/ package)."""
    target = Path(root) / ENGINE_PACKAGE
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(engine_sources(), target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return "".join(edit.apply(root) for edit in edits)
