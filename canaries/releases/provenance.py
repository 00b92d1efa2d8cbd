"""Fingerprints of what a column runs: a file's sha256, a source tree's git commit (and whether
its sglang sources differ from it), a sha256 over a tree's `.py` files."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

__all__ = ["file_sha256", "git_state", "py_sha256"]


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
