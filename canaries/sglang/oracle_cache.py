"""Where a server reference's clean answers are kept beyond one report: across runs, when
everything that could change them has a fingerprint.

A reference's answers (canaries/sglang/oracle.py) depend on the SGLang install its interpreter
runs, on what the suite loads into that server (the CPU stand-ins, the plugin, the model config:
all in `canaries/`), on the engine section and on the plan. The last two are the answers' key
(`ServerOracle`); the first two name the directory:

    $CANARY_CACHE_DIR/server-oracle/<sha256 of the suite's code digest (native_cache.code_digest),
        the interpreter's real path, every distribution installed in its venv (name and
        version) and the RECORD of its sglang (a hash of every installed file)>/

Only an interpreter that is a venv's own, with a non-editable sglang, has such a fingerprint: a
patched mirror's wrapper, an editable checkout or anything else keeps its answers in the report
(`<report>/.server-oracle/`) as before. `CANARY_SERVER_ORACLE_CACHE=off` keeps every reference
in its report; `CANARY_SERVER_ORACLE_CACHE=DIR` keeps them under DIR instead (the bench's cold
run: a fresh one). Digests not used for `native_cache.KEEP_DAYS` are removed when one is made.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

__all__ = ["ORACLE_CACHE_ENV", "install_fingerprint", "kept_dir"]

ORACLE_CACHE_ENV = "CANARY_SERVER_ORACLE_CACHE"


def _site_packages(python: Path) -> Path | None:
    venv = python.parent.parent
    if not (venv / "pyvenv.cfg").is_file():
        return None
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if len(found) == 1 else None


@functools.lru_cache(maxsize=16)
def install_fingerprint(python: str | os.PathLike) -> str | None:
    """A digest of what `python`'s venv has installed (every distribution's name and version,
    and sglang's RECORD), or None where that cannot say what sglang runs."""
    path = Path(python)
    site = _site_packages(path)
    if site is None:
        return None
    # The venv's own path, not its interpreter's target: every venv links the same python.
    digest = hashlib.sha256(f"{os.path.abspath(path)}\0".encode())
    sglang_record = None
    for info in sorted(site.glob("*.dist-info")):
        digest.update(info.name.encode() + b"\0")
        if info.name.lower().startswith("sglang-"):
            with contextlib.suppress(OSError, ValueError):
                direct = json.loads((info / "direct_url.json").read_text(encoding="utf-8"))
                if (direct.get("dir_info") or {}).get("editable"):
                    return None  # its files are a checkout's, which the RECORD does not hash
            with contextlib.suppress(OSError):
                sglang_record = (info / "RECORD").read_bytes()
    if sglang_record is None:
        return None
    digest.update(sglang_record)
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    from canaries.native_cache import code_digest

    return code_digest()


def kept_dir(python: str | os.PathLike, report_dir: Path) -> Path:
    """The directory a reference run by `python` keeps its answers in (see the module docstring)."""
    local = Path(report_dir) / ".server-oracle"
    chosen = os.environ.get(ORACLE_CACHE_ENV, "")
    if chosen.lower() in ("off", "0", "no", "false"):
        return local
    fingerprint = install_fingerprint(python)
    if fingerprint is None:
        return local
    from canaries.native_cache import CACHE_ENV, KEEP_DAYS

    base = Path(chosen) if chosen else \
        Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "serving-canary") / "server-oracle"
    key = hashlib.sha256(f"{_code_digest()}\0{fingerprint}".encode()).hexdigest()[:24]
    kept = base / key
    if not kept.is_dir():
        cutoff = time.time() - KEEP_DAYS * 86400
        with contextlib.suppress(OSError):
            for other in base.iterdir():
                if other.is_dir() and other.stat().st_mtime < cutoff:
                    shutil.rmtree(other, ignore_errors=True)
    return kept
