"""The warm parent SGLang's CPU servers fork from (`canaries.sglang.server.fork_parent`), and its
start in the background, so that its imports (about 10 s of SGLang) overlap the harness's own.

Torch-free to import: `canary run --runtime sglang-server` starts the parent before it imports
the server runtime.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from canaries.runtime.warm import fork_server, start_mode
from canaries.sglang.server.launch import import_env, plugin_pythonpath

__all__ = ["FORK_PARENT", "PLUGIN_DIR", "REPO_ROOT", "prestart_default_parent", "prestart_parent", "warm_parent"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO_ROOT / "canaries" / "sglang" / "server" / "plugin"
FORK_PARENT = "canaries.sglang.server.fork_parent"


def warm_parent(python: str, device: str):
    """The warm parent the CPU servers of `python` fork from (started on first use)."""
    return fork_server(python, module=FORK_PARENT,
                       env={**import_env(device), "PYTHONPATH": plugin_pythonpath(PLUGIN_DIR, REPO_ROOT)})


def _starts_warm(device: str | None) -> bool:
    device = "cuda" if device and device.startswith("cuda") else device
    return start_mode(os.environ.get("CANARY_ENGINE_START") or "auto", device) == "warm"


def prestart_parent(python: str | os.PathLike, device: str = "cpu") -> None:
    """Start the warm parent of `python`'s servers in the background, so that its imports (7-10 s)
    overlap other work (`canary matrix` starts every column's at once); a failure is left for the
    first server's start to raise. Nothing on a device that forks no server (CUDA)."""
    if not _starts_warm(device):
        return

    def start() -> None:
        with contextlib.suppress(Exception):
            warm_parent(str(python), device)

    threading.Thread(target=start, name="canary-server-parent-start", daemon=True).start()


def prestart_default_parent(device: str | None) -> None:
    """`prestart_parent` for the server venv `canary run --runtime sglang-server` runs by default
    (found on the thread: asking a venv its version starts an interpreter); nothing where there
    is none, or where its servers start fresh (CUDA, `CANARY_ENGINE_START=fresh`)."""
    if not _starts_warm(device):
        return

    def start() -> None:
        from canaries.sglang.releases.venvs import find_python

        with contextlib.suppress(Exception):
            python = find_python("0.5.23", server=True)
            if python is not None:
                warm_parent(str(python), "cpu")

    threading.Thread(target=start, name="canary-server-parent-start", daemon=True).start()
