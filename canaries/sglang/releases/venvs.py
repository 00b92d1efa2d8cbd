"""One venv per SGLang candidate, built once by scripts/make-sglang-venv.sh and reused.

A release from the index lives in `.venv-sglang-<version>` in the repo root (0.5.23 may also be
the historical `.venv-sglang`); a wheel in `.venv-sglang-wheel-<sha256[:12]>`; a source tree in
`.venv-sglang-tree-<sha256(path)[:12]>`. A venv that also runs SGLang's server
(`make-sglang-venv.sh --server`) has `-server` after `.venv-sglang` in each of those names. A venv counts only if the sglang it imports is the one
asked for: the release's version, the wheel's hash, the tree (a tree's venv is re-checked at
every use, since the tree may have changed what it imports). The closure each venv holds is
resolved by canaries/sglang/releases/closure.py and recorded in its `sglang-closure.lock`.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.provenance import file_sha256

__all__ = ["find_python", "installed_version", "release_python", "venv_candidates", "venv_for"]

REPO = Path(__file__).resolve().parents[3]
MAKE_VENV = REPO / "scripts" / "make-sglang-venv.sh"
VENV_LOCK = "sglang-closure.lock"


def venv_candidates(version: str, root: Path = REPO, *, server: bool = False) -> list[Path]:
    """Where the venv of release `version` may be, in order of preference (`server`: the venv
    that also runs SGLang's server, `make-sglang-venv.sh --server`)."""
    kind = "-server" if server else ""
    return [root / f".venv-sglang{kind}-{version}", root / f".venv-sglang{kind}"]


def find_python(version: str, root: Path = REPO, *, server: bool = False) -> Path | None:
    """The interpreter of release `version`'s venv if one is built here (nothing is built)."""
    for venv in venv_candidates(version, root, server=server):
        if installed_version(venv / "bin" / "python") == version:
            return venv / "bin" / "python"
    return None


def venv_for(source: Any, root: Path = REPO, *, server: bool = False) -> tuple[Path, str]:
    """The venv a non-index source builds into (`server`: the one that runs its server too), and
    the identity its lock must carry."""
    from canaries.sglang.releases.closure import identity

    kind = "-server" if server else ""
    if source.kind == "wheel":
        return root / f".venv-sglang{kind}-wheel-{file_sha256(source.path)[:12]}", identity(source)
    digest = hashlib.sha256(str(Path(source.path)).encode()).hexdigest()
    return root / f".venv-sglang{kind}-tree-{digest[:12]}", identity(source)


def installed_version(python: Path) -> str | None:
    """The sglang version `python`'s environment has installed (no import of sglang), or None.

    Asked again of a venv whose site-packages has not changed since (nothing installed or
    removed), the answer is the one found then: every server scenario asks, and each asking
    costs an interpreter's start."""
    if not python.is_file():
        return None
    state = _install_state(python)
    if state is not None and state in _VERSIONS:
        return _VERSIONS[state]
    proc = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, check=False)
    version = proc.stdout.strip() if proc.returncode == 0 else None
    if state is not None:
        _VERSIONS[state] = version
    return version


# (interpreter, its site-packages' mtimes) -> the sglang version found there.
_VERSIONS: dict[tuple, str | None] = {}


def _install_state(python: Path) -> tuple | None:
    """What changes when a distribution is installed into or removed from `python`'s venv (a
    dist-info directory added or removed), or None where it has no site-packages of its own."""
    sites = sorted((python.parent.parent / "lib").glob("python*/site-packages"))
    if not sites:
        return None
    return (str(python), *(site.stat().st_mtime_ns for site in sites))


def release_python(source: Any, *, build: bool = True, root: Path = REPO,
                   log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                   build_log: Path | None = None, server: bool = False) -> Path:
    """The interpreter of `source`'s venv, built first when there is none and `build` allows.

    `source` is a release version (`"0.5.22"`) or an `SGLangSource` (kind index, wheel or
    tree); `server`: the venv that runs SGLang's server too (`make-sglang-venv.sh --server`).
    Raises ReleaseError when it cannot be had (the message says how to build it, or the
    builder's own one-line reason)."""
    kind, version = getattr(source, "kind", "index"), getattr(source, "version", source)
    flags = ["--server"] if server else []
    if kind == "index":
        found = find_python(version, root, server=server)
        if found is not None:
            return found
        target = venv_candidates(version, root, server=server)[0]
        args, identity = [*flags, "--version", version], ""
    else:
        target, identity = venv_for(source, root, server=server)
        args = [*flags, "--source", str(source.path)]
        lock = target / VENV_LOCK
        if (kind == "wheel" and installed_version(target / "bin" / "python") == version and lock.is_file()
                and identity in lock.read_text(encoding="utf-8")):
            return target / "bin" / "python"
    command = f"bash scripts/make-sglang-venv.sh {' '.join(args)}"
    if not build:
        raise ReleaseError(f"sglang {version} ({kind}): no venv ({target}); build it with `{command}`")
    log(f"matrix: building the venv of SGLang {version} ({kind}; {target}; the first time, a few minutes)")
    t0 = time.monotonic()
    out = open(build_log, "ab") if build_log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.run(["bash", str(MAKE_VENV), *args, str(target)],
                              stdout=out, stderr=subprocess.PIPE, check=False)
    finally:
        if build_log is not None:
            out.close()
    lines = [line for line in proc.stderr.decode("utf-8", "replace").splitlines() if "is ignored" not in line]
    for line in lines[-20:]:
        log(f"  {line}")
    python = target / "bin" / "python"
    if proc.returncode != 0 or installed_version(python) != version:
        reason = next((line for line in reversed(lines) if line.startswith("make-sglang-venv: ")), "")
        raise ReleaseError(f"sglang {version} ({kind}): `{command}` failed (exit {proc.returncode})"
                           + (f": {reason.removeprefix('make-sglang-venv: ')}" if reason else ""))
    log(f"matrix: SGLang {version} venv ready in {time.monotonic() - t0:.0f}s")
    return python
