"""A release column: `VERSION` (an SGLang release from the package index) or
`VERSION+PATCH[+PATCH...]` (that release with catalogued patches applied to a throwaway copy)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ReleaseError", "ReleaseSpec", "parse_releases"]

_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+|rc\d+)?$")


class ReleaseError(ValueError):
    """A release spec, venv or patch that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ReleaseSpec:
    """One column of the matrix: SGLang `version`, with `patches` (catalogue names) applied."""

    version: str
    patches: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _VERSION_RE.match(self.version):
            raise ReleaseError(f"release {self.version!r}: not a version like 0.5.23")
        if len(set(self.patches)) != len(self.patches):
            raise ReleaseError(f"release {self.label}: a patch is named twice")

    @property
    def label(self) -> str:
        """How reports and `--last/--candidate` name the column (`0.5.23`, `0.5.23+name`)."""
        return "+".join((self.version, *self.patches))

    @classmethod
    def parse(cls, text: str) -> ReleaseSpec:
        version, *patches = text.strip().split("+")
        if any(not p for p in patches):
            raise ReleaseError(f"release {text!r}: empty patch name after '+'")
        return cls(version, tuple(patches))


def parse_releases(items: list[str] | str, *, where: str = "--sglang") -> list[ReleaseSpec]:
    """Release specs from a comma-separated string or a list; `where` names the source in errors."""
    raw = items.split(",") if isinstance(items, str) else [str(i) for i in items]
    specs = []
    for text in raw:
        if not text.strip():
            continue
        try:
            spec = ReleaseSpec.parse(text)
        except ReleaseError as exc:
            raise ReleaseError(f"{where}: {exc}") from None
        from canaries.releases.patches import patch_catalogue

        unknown = [p for p in spec.patches if p not in patch_catalogue()]
        if unknown:
            raise ReleaseError(f"{where}: {spec.label}: unknown SGLang patch {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(patch_catalogue()))})")
        specs.append(spec)
    labels = [s.label for s in specs]
    if not specs:
        raise ReleaseError(f"{where}: name at least one release (e.g. 0.5.20,0.5.23)")
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        raise ReleaseError(f"{where}: {', '.join(dupes)} named twice")
    return specs
