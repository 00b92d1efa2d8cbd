"""Fingerprints of what a column runs: a file's sha256, a source tree's git commit (and whether
its sglang sources differ from it) and `git describe`, a sha256 over a tree's `.py` files."""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GitDescription", "file_sha256", "git_describe", "git_state", "py_sha256"]


# SGLang tags its releases `v0.5.23`; its other tags (`gateway-v0.1.0`, `sgl-kernel-v0.3.9`) name
# other packages of the repository and are never the Python package's version.
_DESCRIBE_MATCH = ("v[0-9]*", "[0-9]*")
_DESCRIBE_RE = re.compile(r"^(?P<tag>.+)-(?P<distance>\d+)-g(?P<node>[0-9a-f]+)(?P<dirty>-dirty)?$")


@dataclass(frozen=True)
class GitDescription:
    """`git describe --tags --long --dirty` of a checkout: the release tag it is `distance`
    commits past, its commit's short hash `node`, and whether tracked files are changed."""

    text: str
    tag: str
    distance: int
    node: str
    dirty: bool


def file_sha256(path: str | Path) -> str:
    """The sha256 of the file at `path`, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def py_sha256(root: str | Path) -> str:
    """One sha256 over every `.py` file under `root/sglang`: relative paths and contents, in
    path order (so a renamed file changes it too)."""
    base = Path(root)
    digest = hashlib.sha256()
    for path in sorted((base / "sglang").rglob("*.py")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        digest.update(path.relative_to(base).as_posix().encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(root: str | Path) -> tuple[str, bool] | None:
    """`(commit, dirty)` of the git tree `root` belongs to, or None when `root/sglang` is not
    tracked by git. `dirty`: `git status --porcelain` lists a change under `root` (the sources
    that run: elsewhere in the repository nothing is imported)."""
    root = Path(root)
    if _git(root, "ls-files", "--error-unmatch", "sglang/version.py") is None:
        return None
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", ".")
    if not commit or status is None:
        return None
    return commit.strip(), bool(status.strip())


def git_describe(root: str | Path) -> GitDescription | None:
    """How git describes the checkout `root` belongs to against its nearest release tag
    (`v0.5.23`, or a bare `0.5.23`); None when `root` is in no git repository or no release tag
    reaches its commit."""
    matches = [arg for pattern in _DESCRIBE_MATCH for arg in ("--match", pattern)]
    out = _git(Path(root), "describe", "--tags", "--long", "--dirty", "--abbrev=7", *matches)
    match = _DESCRIBE_RE.match(out.strip()) if out else None
    if match is None:
        return None
    return GitDescription(out.strip(), match["tag"], int(match["distance"]), match["node"], bool(match["dirty"]))
