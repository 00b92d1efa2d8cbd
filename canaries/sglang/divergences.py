"""Known divergences of an SGLang release from our memory path: configs/parity/sglang-X.yaml.

A file lists `divergences:` (scenario -> {verdict, reason}; the verdict may be a list where the
run's timing decides between them). It may say `inherits: 0.5.20`: its
divergences are then that release's (recursively), less the scenarios it lists as `resolved:`
(the release behaves as native there), overlaid with its own. A release with no file at all
inherits from the nearest older release that has one (PEP 440 order: 0.5.24.dev0 inherits
0.5.23). An inherited entry keeps its verdict; its reason says where it comes from
(`inherited from 0.5.20: ...`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from canaries.sglang.releases.versions import version_key

__all__ = ["PARITY_DIR", "KnownDivergences", "known_divergences", "parity_files"]

PARITY_DIR = Path(__file__).resolve().parents[2] / "configs" / "parity"
_FILE_RE = re.compile(r"^sglang-(.+)\.yaml$")


@dataclass(frozen=True)
class KnownDivergences:
    """The divergences a release is held to, and the files they came from.

    Args:
        version: the release asked for.
        entries: scenario -> {verdict, reason} (and `inherited_from`, a version, when inherited).
        files: the files read, the release's own first (when it has one), then each it inherits.
        own: whether `files[0]` is the release's own file.
    """

    version: str
    entries: dict[str, dict] = field(default_factory=dict)
    files: tuple[Path, ...] = ()
    own: bool = False

    def describe(self) -> str:
        """`sglang-0.5.23.yaml, sglang-0.5.20.yaml (inherited)`, or `none`."""
        if not self.files:
            return "none"
        return ", ".join(f.name + ("" if self.own and i == 0 else " (inherited)")
                         for i, f in enumerate(self.files))


def parity_files(parity_dir: Path = PARITY_DIR) -> dict[str, Path]:
    """Every `sglang-<version>.yaml` in `parity_dir`, by version (files not named so are left out)."""
    out = {}
    for path in sorted(parity_dir.glob("sglang-*.yaml")) if parity_dir.is_dir() else []:
        match = _FILE_RE.match(path.name)
        if match and _is_version(match[1]):
            out[match[1]] = path
    return out

def _own_file(version: str, files: dict[str, Path]) -> tuple[str, Path] | None:
    key = version_key(version)
    return next(((v, p) for v, p in files.items() if version_key(v) == key), None)


def _load(version: str, path: Path, files: dict[str, Path], seen: tuple[str, ...]) -> tuple[dict[str, dict], list[Path]]:
    """The entries of `path` (the file of `version`) with everything it inherits, each entry's
    `inherited_from` set when it comes from another release; and the files read."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping with `divergences:`")
    own = doc.get("divergences") or {}
    if not isinstance(own, dict):
        raise ValueError(f"{path}: divergences: a mapping of scenario -> {{verdict, reason}}")
    for name, entry in own.items():
        if not isinstance(entry, dict) or not entry.get("verdict") or not entry.get("reason"):
            raise ValueError(f"{path}: divergence {name!r} needs a verdict and a reason")
    resolved = doc.get("resolved") or []
    if not isinstance(resolved, list) or not all(isinstance(n, str) for n in resolved):
        raise ValueError(f"{path}: resolved: a list of scenario names")
    entries: dict[str, dict] = {}
    read = [path]
    parent = doc.get("inherits")
    if parent is not None:
        parent = str(parent)
        found = _own_file(parent, files) if _is_version(parent) else None
        if found is None:
            raise ValueError(f"{path}: inherits {parent}, which has no sglang-{parent}.yaml")
        if found[0] in seen:
            raise ValueError(f"{path}: inherits {parent}, a cycle ({' -> '.join((*seen, found[0]))})")
        inherited, parent_files = _load(found[0], found[1], files, (*seen, found[0]))
        entries = {name: {**entry, "inherited_from": entry.get("inherited_from", found[0])}
                   for name, entry in inherited.items()}
        read += parent_files
    elif resolved:
        raise ValueError(f"{path}: resolved: needs `inherits:` (there is nothing to resolve)")
    for name in resolved:
        if name not in entries:
            raise ValueError(f"{path}: resolved: {name} is not a divergence it inherits")
        if name in own:
            raise ValueError(f"{path}: {name} is both resolved and a divergence")
        del entries[name]
    entries.update({name: dict(entry) for name, entry in own.items()})
    return entries, read


def _is_version(text: str) -> bool:
    try:
        version_key(text)
    except ValueError:
        return False
    return True


def known_divergences(version: str, parity_dir: Path = PARITY_DIR) -> KnownDivergences:
    """The divergences SGLang `version` is held to (see the module docstring). ValueError for a
    malformed file, an `inherits:` naming no file, or a `resolved:` naming nothing inherited."""
    files = parity_files(parity_dir)
    if not _is_version(version):
        return KnownDivergences(version)
    found = _own_file(version, files)
    own = found is not None
    if found is None:
        key = version_key(version)
        older = sorted((v for v in files if version_key(v) < key), key=version_key)
        found = (older[-1], files[older[-1]]) if older else None
    if found is None:
        return KnownDivergences(version)
    entries, read = _load(found[0], found[1], files, (found[0],))
    if not own:
        entries = {name: {**entry, "inherited_from": entry.get("inherited_from", found[0])}
                   for name, entry in entries.items()}
    for entry in entries.values():
        if entry.get("inherited_from"):
            entry["reason"] = f"inherited from {entry['inherited_from']}: {str(entry['reason']).strip()}"
    return KnownDivergences(version, entries, tuple(read), own)
