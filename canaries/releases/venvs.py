"""One pinned venv per SGLang release, built once by scripts/make-sglang-venv.sh and reused.

`.venv-sglang-<version>` in the repo root (0.5.23 may also be the historical `.venv-sglang`).
A venv counts only if the sglang it imports is the release asked for.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from canaries.releases.spec import ReleaseError

__all__ = ["installed_version", "release_python", "venv_candidates"]

REPO = Path(__file__).resolve().parents[2]
MAKE_VENV = REPO / "scripts" / "make-sglang-venv.sh"


def venv_candidates(version: str, root: Path = REPO) -> list[Path]:
    """Where the venv of `version` may be, in order of preference."""
    return [root / f".venv-sglang-{version}", root / ".venv-sglang"]


def installed_version(python: Path) -> str | None:
    """The sglang version `python`'s environment has installed (no import of sglang), or None."""
    if not python.is_file():
        return None
    proc = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def release_python(version: str, *, build: bool = True, root: Path = REPO,
                   log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                   build_log: Path | None = None) -> Path:
    """The interpreter of `version`'s venv, built first when there is none and `build` allows.

    Raises ReleaseError when it cannot be had (the message says how to build it)."""
    for venv in venv_candidates(version, root):
        python = venv / "bin" / "python"
        if installed_version(python) == version:
            return python
    target = root / f".venv-sglang-{version}"
    command = f"bash scripts/make-sglang-venv.sh --version {version}"
    if not build:
        raise ReleaseError(f"release {version}: no venv ({target}); build it with `{command}`")
    log(f"matrix: building the venv of SGLang {version} ({target}; one time, a few minutes)")
    t0 = time.monotonic()
    out = open(build_log, "ab") if build_log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.run(["bash", str(MAKE_VENV), "--version", version, str(target)],
                              stdout=out, stderr=subprocess.PIPE, check=False)
    finally:
        if build_log is not None:
            out.close()
    for line in proc.stderr.decode("utf-8", "replace").splitlines()[-20:]:
        log(f"  {line}")
    python = target / "bin" / "python"
    if proc.returncode != 0 or installed_version(python) != version:
        raise ReleaseError(f"release {version}: `{command}` failed (exit {proc.returncode}); "
                           "its last lines are above")
    log(f"matrix: SGLang {version} venv ready in {time.monotonic() - t0:.0f}s")
    return python

