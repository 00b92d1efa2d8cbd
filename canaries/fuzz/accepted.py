"""Findings accepted on purpose (`configs/fuzz/accepted.yaml`): signature patterns with reasons."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["ACCEPTED_FILE", "Accepted", "load_accepted"]

ACCEPTED_FILE = Path(__file__).resolve().parents[2] / "configs" / "fuzz" / "accepted.yaml"


@dataclass(frozen=True)
class Accepted:
    """One accepted signature pattern (shell-style) and why."""

    signature: str
    reason: str

    def __post_init__(self) -> None:
        if not self.signature or "|" not in self.signature:
            raise ValueError(f"an accepted signature is outcome|kinds|...: got {self.signature!r}")
        if not self.reason.strip():
            raise ValueError(f"accepted {self.signature!r}: give the reason")

    def matches(self, signature: str) -> bool:
        return fnmatch.fnmatchcase(signature, self.signature)


def load_accepted(path: Path = ACCEPTED_FILE) -> tuple[Accepted, ...]:
    """The accepted patterns; a malformed file raises ValueError naming it and the entry."""
    if not path.is_file():
        return ()
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = data.get("accepted") or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: accepted must be a list")
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(Accepted(str(entry["signature"]), str(entry["reason"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: accepted[{i}]: {exc}") from None
    return tuple(out)
