"""A release column: an SGLang source (a release on the index, a wheel file, a source checkout),
optionally with catalogued patches and unified diffs applied to a throwaway copy.

    0.5.23                                  the release from the package index
    0.5.23+free-swa-contract-removed        with a catalogued patch (canaries/sglang/releases/patches.py)
    0.5.23+./pr.diff                        with a unified diff (a `+` part that is a file, or
                                            ends in .diff/.patch)
    ./dist/sglang-0.5.23-...whl+pr.diff     any source may be the base; several `+` parts allowed
    ~/src/sglang                            a source checkout (repo root or its python/ dir)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.provenance import file_sha256
from canaries.sglang.releases.source import SGLangSource

__all__ = ["ReleaseError", "ReleaseSpec", "SGLangSource", "file_label", "match_release", "parse_releases"]

_DIFF_SUFFIXES = (".diff", ".patch")


def file_label(label: str) -> str:
    """`label` made safe as one file name (`wheel:x.whl` -> `wheel_x.whl`)."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", label)


@dataclass(frozen=True)
class ReleaseSpec:
    """One column of the matrix: SGLang from `base`, with `patches` (catalogue names) and then
    `diffs` (absolute paths of unified diffs) applied, in that order."""

    base: SGLangSource
    patches: tuple[str, ...] = ()
    diffs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.base, SGLangSource):
            raise ReleaseError(f"release base {self.base!r}: an SGLangSource")
        if len(set(self.patches)) != len(self.patches):
            raise ReleaseError(f"release {self.label}: a patch is named twice")
        from canaries.sglang.releases.patches import patch_catalogue

        unknown = [p for p in self.patches if p not in patch_catalogue()]
        if unknown:
            raise ReleaseError(f"release {self.label}: unknown SGLang patch {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(patch_catalogue()))})")
        for diff in self.diffs:
            if not os.path.isabs(diff):
                raise ReleaseError(f"release {self.label}: diff {diff!r}: the path must be absolute")
            if not os.path.isfile(diff):
                raise ReleaseError(f"release {self.label}: diff {diff}: no such file")
        names = [os.path.basename(d) for d in self.diffs]
        if len(set(names)) != len(names) or set(names) & set(self.patches):
            raise ReleaseError(f"release {self.label}: two diffs or patches share a name")

    @property
    def version(self) -> str:
        """The base's SGLang version (what configs/parity/ is looked up by)."""
        return self.base.version

    @property
    def label(self) -> str:
        """How reports and `--last/--candidate` name the column: the base's label (`0.5.23`,
        `wheel:<file>`, `tree:<checkout>`), then `+name` per patch and `+<file name>` per diff."""
        return "+".join((self.base.label, *self.patches, *(os.path.basename(d) for d in self.diffs)))

    def provenance(self) -> dict:
        """What exactly runs: the base's provenance (kind, version, a wheel's sha256, a tree's
        commit/dirty/py_sha256), the catalogue patches, each diff's path and sha256."""
        return self.base.provenance() | {
            "patches": list(self.patches),
            "diffs": [{"path": d, "sha256": file_sha256(d)} for d in self.diffs]}

    @classmethod
    def parse(cls, text: str) -> ReleaseSpec:
        """The column `text` names (see the module docstring); ReleaseError naming `text` and why."""
        base, *extras = _split(text.strip())
        if not base or any(not part for part in extras):
            raise ReleaseError(f"release {text!r}: empty patch name around '+'")
        patches, diffs = [], []
        for part in extras:
            path = os.path.abspath(os.path.expanduser(part))
            if os.path.isfile(path):
                diffs.append(path)
            elif part.endswith(_DIFF_SUFFIXES):
                raise ReleaseError(f"release {text!r}: diff {part}: no such file ({path})")
            else:
                patches.append(part)
        try:
            source = SGLangSource.parse(base)
        except ReleaseError as exc:
            if base == text.strip():
                raise
            why = str(exc).removeprefix(f"release {base!r}: ")
            raise ReleaseError(f"release {text.strip()!r}: {base}: {why}") from None
        return cls(source, tuple(patches), tuple(diffs))

def _split(text: str) -> list[str]:
    """`text`'s `+` parts, where a run of parts that together name an existing path (a wheel
    with a local version, `sglang-0.5.24+g1a2b-...whl`) stays one part."""
    parts, out, i = text.split("+"), [], 0
    while i < len(parts):
        j = next((j for j in range(len(parts), i + 1, -1)
                  if os.path.exists(os.path.expanduser("+".join(parts[i:j])))), i + 1)
        out.append("+".join(parts[i:j]).strip())
        i = j
    return out


def parse_releases(items: list[str] | str, *, where: str = "--sglang") -> list[ReleaseSpec]:
    """Release specs from a comma-separated string or a list; `where` names the source in errors."""
    raw = items.split(",") if isinstance(items, str) else [str(i) for i in items]
    specs = []
    for text in raw:
        if not text.strip():
            continue
        try:
            specs.append(ReleaseSpec.parse(text))
        except ReleaseError as exc:
            raise ReleaseError(f"{where}: {exc}") from None
    if not specs:
        raise ReleaseError(f"{where}: name at least one release (e.g. 0.5.20,0.5.23)")
    labels = [s.label for s in specs]
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        raise ReleaseError(f"{where}: {', '.join(dupes)} named twice")
    return specs


def match_release(text: str, specs: list[ReleaseSpec], *, where: str) -> ReleaseSpec:
    """The column `text` (a `--last`/`--candidate`) names: one of `specs` when it is that spec's
    label or the same release however spelled (`./dist/x.whl` and `dist/x.whl`), else the new
    spec it parses to. ReleaseError when it names a different release under a taken label."""
    for spec in specs:
        if spec.label == text.strip():
            return spec
    try:
        spec = ReleaseSpec.parse(text)
    except ReleaseError as exc:
        raise ReleaseError(f"{where}: {exc}") from None
    for other in specs:
        if other.label == spec.label and other != spec:
            raise ReleaseError(f"{where}: {text.strip()} is labelled {spec.label}, like another column "
                               "that is a different release")
    return next((other for other in specs if other == spec), spec)
