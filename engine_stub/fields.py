"""Field tables: one declaration per field that both validates a mapping and describes it.

A `Table` is a tuple of `Field`s (name, type, default, doc). `Table.parse(raw, path, report)`
checks a mapping against it (unknown keys, each present field's type, bounds and choices) and
calls `report(path, message, key=...)` once per problem, never stopping at the first;
`Table.schema()` is the same table as JSON Schema (draft 2020-12). The scenario format
(`canaries/scenario/`), the perturbation specs (`perturb/spec.py`) and the kinds' params
(`perturb/kinds.py`) are declared this way, so their validation and their schema cannot drift.

Choices may be given as a callable (kinds, profiles, detectors), read when a value is checked.
Torch-free; imports nothing from the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["INVALID", "Bool", "Choice", "Field", "FieldType", "Int", "IntOrChoice", "NameList",
           "Number", "Report", "Table", "Text", "is_int", "is_number", "raising"]


class _Invalid:
    """What `FieldType.parse` returns for a value it reported as a problem."""

    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()


class Report(Protocol):
    def __call__(self, path: str, message: str, *, key: bool = False) -> None: ...


def raising(error: Callable[[str, str], Exception]) -> Report:
    """A report that raises `error(path, message)` at the first problem (the engine's way)."""

    def report(path: str, message: str, *, key: bool = False) -> None:
        raise error(path, message)

    return report


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choices(choices: tuple[str, ...] | Callable[[], Iterable[str]]) -> tuple[str, ...]:
    return tuple(choices()) if callable(choices) else tuple(choices)


class FieldType:
    """How one field's value is checked (`parse`) and described (`schema`)."""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        """The value as the program holds it, or INVALID after reporting why not."""
        raise NotImplementedError

    def schema(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(FieldType):
    minimum: int | None = None
    maximum: int | None = None

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if not is_int(value):
            report(path, f"expected an integer, got {value!r}")
            return INVALID
        if self.minimum is not None and value < self.minimum:
            report(path, f"must be >= {self.minimum}, got {value}")
            return INVALID
        if self.maximum is not None and value > self.maximum:
            report(path, f"must be <= {self.maximum}, got {value}")
            return INVALID
        return value

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "integer"}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


@dataclass(frozen=True)
class Number(FieldType):
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None

    def _range(self) -> str:
        if self.exclusive_minimum is not None and self.maximum is not None:
            return f"in ({self.exclusive_minimum:g}, {self.maximum:g}]"
        parts = []
        if self.minimum is not None:
            parts.append(f">= {self.minimum:g}")
        if self.exclusive_minimum is not None:
            parts.append(f"> {self.exclusive_minimum:g}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum:g}")
        return " and ".join(parts)

    def parse(self, value: Any, path: str, report: Report) -> Any:
        ok = is_number(value) and value == value  # NaN is no number here
        ok = ok and (self.minimum is None or value >= self.minimum)
        ok = ok and (self.exclusive_minimum is None or value > self.exclusive_minimum)
        ok = ok and (self.maximum is None or value <= self.maximum)
        if not ok:
            report(path, f"expected a number {self._range()}, got {value!r}".replace("  ", " "))
            return INVALID
        return float(value)

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "number"}
        for key, value in (("minimum", self.minimum), ("exclusiveMinimum", self.exclusive_minimum),
                           ("maximum", self.maximum)):
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class Bool(FieldType):
    def parse(self, value: Any, path: str, report: Report) -> Any:
        if not isinstance(value, bool):
            report(path, f"expected true or false, got {value!r}")
            return INVALID
        return value

    def schema(self) -> dict:
        return {"type": "boolean"}


@dataclass(frozen=True)
class Text(FieldType):
    """A string; `pattern` (a full match) and `non_empty` are checked when given."""

    pattern: str | None = None
    non_empty: bool = False

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if not isinstance(value, str):
            report(path, f"expected a string, got {type(value).__name__}")
            return INVALID
        if self.pattern is not None and not re.match(self.pattern, value):
            report(path, f"{value!r} must match {self.pattern}")
            return INVALID
        if self.non_empty and not value.strip():
            report(path, "must be a non-empty string")
            return INVALID
        return value

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "string"}
        if self.pattern is not None:
            out["pattern"] = self.pattern
        if self.non_empty:
            out["minLength"] = 1
        return out


@dataclass(frozen=True)
class Choice(FieldType):
    """One of `choices` (a tuple, or a callable giving them); `what` names them in messages."""

    choices: tuple[str, ...] | Callable[[], Iterable[str]]
    what: str = ""

    def parse(self, value: Any, path: str, report: Report) -> Any:
        choices = _choices(self.choices)
        if not isinstance(value, str) or value not in choices:
            if self.what:
                report(path, f"unknown {self.what} {value!r}; valid {self.what}s: "
                             f"{', '.join(choices)}")
            else:
                report(path, f"{value!r} is not one of {', '.join(choices)}")
            return INVALID
        return value

    def schema(self) -> dict:
        return {"enum": list(_choices(self.choices))}


@dataclass(frozen=True)
class IntOrChoice(FieldType):
    """An integer (checked by `number`) or one of the words of `word`."""

    number: Int
    word: Choice

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if isinstance(value, str):
            return self.word.parse(value, path, report)
        return self.number.parse(value, path, report)

    def schema(self) -> dict:
        return {"oneOf": [self.number.schema(), self.word.schema()]}


@dataclass(frozen=True)
class NameList(FieldType):
    """A list of names from `choices` (a lone string is a list of one); each bad item is
    reported at `path[i]`."""

    choices: tuple[str, ...] | Callable[[], Iterable[str]]
    what: str
    non_empty: bool = False

    def parse(self, value: Any, path: str, report: Report) -> Any:
        if value is None:
            value = []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            report(path, f"expected a list of {self.what} names, got {type(value).__name__}")
            return ()
        if self.non_empty and not value:
            report(path, f"must name at least one {self.what}")
        known = _choices(self.choices)
        out = []
        for i, name in enumerate(value):
            if name not in known:
                report(f"{path}[{i}]", f"unknown {self.what} {name!r}; valid {self.what}s: "
                                       f"{', '.join(known)}")
            else:
                out.append(name)
        return tuple(out)

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "array", "items": {"enum": list(_choices(self.choices))}}
        if self.non_empty:
            out["minItems"] = 1
        return out


@dataclass(frozen=True)
class Field:
    """One field of a table: its key, its type, its default (None: absent) and one line of doc."""

    name: str
    type: FieldType
    default: Any = None
    doc: str = ""

    def schema(self) -> dict:
        out = self.type.schema()
        if self.doc:
            out["description"] = self.doc
        if self.default is not None and not isinstance(self.default, tuple):
            out["default"] = self.default
        return out


@dataclass(frozen=True)
class Table(FieldType):
    """A mapping whose keys are `fields` (plus `aliases`: another name for a field)."""

    fields: tuple[Field, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    required: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)  # more schema keywords

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields) + tuple(a for a, _ in self.aliases)

    def defaults(self) -> dict[str, Any]:
        return {f.name: f.default for f in self.fields}

    def check_keys(self, raw: dict, path: str, report: Report) -> None:
        allowed = self.keys
        for key in raw:
            if key not in allowed:
                sub = f"{path}.{key}" if path else str(key)
                report(sub, f"unknown key {key!r}; valid keys: {', '.join(allowed) or 'none'}",
                       key=True)

    def parse(self, value: Any, path: str, report: Report) -> Any:
        """The present fields' values (None -> {}); INVALID if `value` is no mapping.

        A field whose value was reported is left out, so the caller's defaults stand in."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            report(path, f"expected a mapping, got {type(value).__name__}")
            return INVALID
        self.check_keys(value, path, report)
        for name in self.required:
            if name not in value:
                report(f"{path}.{name}" if path else name, "required", key=True)
        out: dict[str, Any] = {}
        for f in self.fields:
            # The field itself, else its first alias given (the field wins over an alias).
            key = next((k for k in (f.name, *(a for a, n in self.aliases if n == f.name))
                        if k in value), None)
            if key is None:
                continue
            parsed = f.type.parse(value[key], f"{path}.{key}" if path else key, report)
            if parsed is not INVALID:
                out[f.name] = parsed
        return out

    def schema(self) -> dict:
        props = {f.name: f.schema() for f in self.fields}
        for alias, name in self.aliases:
            props[alias] = self[name].type.schema()
        out: dict[str, Any] = {"type": "object", "additionalProperties": False,
                               "properties": props}
        if self.required:
            out["required"] = list(self.required)
        out.update(self.extra)
        return out
