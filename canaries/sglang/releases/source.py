"""Where a column's SGLang comes from: a release on the package index, a wheel file, or a source
checkout (SGLang's repo root, or its `python/` directory).

    0.5.22                                   a release on the index (any PEP 440 version)
    ./dist/sglang-0.5.23-cp311-...whl        a wheel: version from its METADATA, sha256 recorded
    ~/src/sglang  or  ~/src/sglang/python    a tree: version from sglang/version.py (or the
                                             _version.py a build generated, or `git describe`
                                             in a raw checkout), git commit recorded
"""

from __future__ import annotations

import datetime as dt
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.provenance import file_sha256, git_describe, git_state, py_sha256
from canaries.sglang.releases.versions import canonical_version, scm_version

__all__ = ["SGLangSource", "tree_root", "tree_version", "tree_version_origin", "wheel_version"]

KINDS = ("index", "wheel", "tree")
_VERSION_PY_RE = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:\w+\s*=\s*)?["']([^"']+)["']""",
                            re.MULTILINE)


def wheel_version(path: str | Path) -> str:
    """The version in the wheel's `*.dist-info/METADATA` (canonical); ReleaseError when the file
    is not a zip, has no METADATA, or is not sglang."""
    try:
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if not names:
                raise ReleaseError(f"wheel {path} has no *.dist-info/METADATA")
            text = wheel.read(names[0]).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile) as exc:
        raise ReleaseError(f"wheel {path}: not a readable zip ({exc})") from None
    headers = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep and key not in headers:
            headers[key.strip().lower()] = value.strip()
    name = re.sub(r"[-_.]+", "-", headers.get("name", "")).lower()
    if name != "sglang":
        raise ReleaseError(f"wheel {path} is not sglang (its METADATA names {headers.get('name') or 'nothing'})")
    version = canonical_version(headers.get("version", ""), local=True)
    if version is None:
        raise ReleaseError(f"wheel {path}: its METADATA has no valid Version ({headers.get('version')!r})")
    return version


def tree_root(directory: str | Path) -> Path | None:
    """The directory that holds the `sglang` package of a checkout: `DIR/python` for SGLang's
    repo root, `DIR` itself for its `python/` dir; None when neither has sglang/version.py."""
    directory = Path(directory)
    for root in (directory / "python", directory):
        if (root / "sglang" / "version.py").is_file():
            return root
    return None


def tree_version(root: str | Path) -> str:
    """The version of the checkout whose `sglang` package is in `root` (canonical); see
    `tree_version_origin`."""
    return tree_version_origin(root)[0]


def tree_version_origin(root: str | Path) -> tuple[str, str]:
    """(version, where it came from) for the checkout whose `sglang` package is in `root`: a
    literal in `sglang/version.py`, else the `sglang/_version.py` a build generated, else (a raw
    checkout, no build step run) `git describe` against the nearest release tag, read as
    setuptools_scm would (`versions.scm_version`). ReleaseError when none gives a version."""
    path = Path(root) / "sglang" / "version.py"
    try:
        match = _VERSION_PY_RE.search(path.read_text(encoding="utf-8"))
        origin = "sglang/version.py"
        # A release's version.py reads it from the sglang/_version.py its build generated.
        generated = Path(root) / "sglang" / "_version.py"
        if match is None and generated.is_file():
            match = _VERSION_PY_RE.search(generated.read_text(encoding="utf-8"))
            origin = "sglang/_version.py"
    except OSError as exc:
        raise ReleaseError(f"tree {root}: cannot read sglang/version.py ({exc.strerror})") from None
    if match is not None:
        version = canonical_version(match[1], local=True)
        if version is None:
            raise ReleaseError(f"tree {root}: {origin} declares {match[1]!r}, not a version like 0.5.23")
        return version, origin
    described = git_describe(root)
    if described is None:
        raise ReleaseError(f"tree {root}: {path} declares no valid __version__ = \"X.Y.Z\", there is no "
                           "sglang/_version.py (no build step ran) and `git describe` finds no release "
                           "tag (vX.Y.Z) behind its commit")
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    version = scm_version(described.tag, described.distance, described.node, described.dirty, date)
    if version is None:
        raise ReleaseError(f"tree {root}: `git describe` says {described.text!r}, whose tag is no version")
    return version, f"git describe {described.text}"


@dataclass(frozen=True)
class SGLangSource:
    """Where an SGLang comes from.

    Args:
        kind: `index` (a release pip installs from the package index), `wheel` (a wheel file) or
            `tree` (a source checkout).
        version: its version, canonical (the wheel's METADATA; the tree's sglang/version.py,
            its generated _version.py, or `git describe` for a raw checkout).
        path: `""` for the index; the wheel file's absolute path; for a tree the absolute path
            of the directory holding the `sglang` package (a repo root's `python/`).
    """

    kind: str
    version: str
    path: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ReleaseError(f"source kind {self.kind!r}: one of {', '.join(KINDS)}")
        if canonical_version(self.version, local=self.kind != "index") != self.version:
            raise ReleaseError(f"release {self.version!r}: not a version like 0.5.23 (canonical spelling)")
        if self.kind == "index":
            if self.path:
                raise ReleaseError(f"release {self.version}: an index release has no path")
            return
        if not os.path.isabs(self.path):
            raise ReleaseError(f"{self.kind} {self.path!r}: the path must be absolute")
        if self.kind == "wheel":
            if not self.path.endswith(".whl") or not os.path.isfile(self.path):
                raise ReleaseError(f"wheel {self.path}: no such .whl file")
            found = wheel_version(self.path)
        else:
            if tree_root(self.path) != Path(self.path):
                raise ReleaseError(f"tree {self.path}: not the directory that holds sglang/version.py")
            found = tree_version(self.path)
        if found != self.version:
            raise ReleaseError(f"{self.kind} {self.path} is sglang {found}, not {self.version}")

    @classmethod
    def parse(cls, text: str) -> SGLangSource:
        """The source `text` names: a version, a `.whl` file, or a checkout directory (`~` and
        relative paths resolved here). ReleaseError naming `text` and why otherwise."""
        text = text.strip()
        version = canonical_version(text)
        if version is not None:
            return cls("index", version)
        path = os.path.abspath(os.path.expanduser(text))
        looks_like_path = os.sep in text or text.startswith("~") or text.endswith(".whl")
        if not os.path.exists(path):
            why = "no such file or directory" if looks_like_path else \
                "not a version like 0.5.23, a wheel file or a source checkout"
            raise ReleaseError(f"release {text!r}: {why}")
        try:
            if os.path.isdir(path):
                root = tree_root(path)
                if root is None:
                    raise ReleaseError(f"{path} is no SGLang checkout (no python/sglang/version.py "
                                       "or sglang/version.py)")
                return cls("tree", tree_version(root), str(root))
            if not path.endswith(".whl"):
                raise ReleaseError(f"{path} is neither a wheel (.whl) nor a source checkout")
            return cls("wheel", wheel_version(path), path)
        except ReleaseError as exc:
            raise ReleaseError(f"release {text!r}: {exc}") from None

    @property
    def label(self) -> str:
        """How a column names it: the version, `wheel:<file name>`, `tree:<checkout name>` (the
        repo's directory, also when its `python/` dir was given)."""
        if self.kind == "index":
            return self.version
        path = Path(self.path)
        if self.kind == "wheel":
            return f"wheel:{path.name}"
        name = path.parent.name if path.name == "python" and path.parent.name else path.name
        return f"tree:{name}"

    def provenance(self) -> dict:
        """What exactly it is: kind, version, path; a wheel's sha256; a tree's git commit and
        `dirty`, where its version came from (`version_from`: `sglang/version.py`,
        `sglang/_version.py` or `git describe v0.5.23-0-g1a2b3c4`), and `py_sha256` over its
        .py files when it is not a git tree or is dirty."""
        out: dict = {"kind": self.kind, "version": self.version}
        if self.kind == "wheel":
            out |= {"path": self.path, "sha256": file_sha256(self.path)}
        elif self.kind == "tree":
            out["path"] = self.path
            out["version_from"] = tree_version_origin(self.path)[1]
            state = git_state(self.path)
            if state is not None:
                out |= {"commit": state[0], "dirty": state[1]}
            if state is None or state[1]:
                out["py_sha256"] = py_sha256(self.path)
        return out
