"""The safety net every runtime shares: no engine or container outlives the harness.

Each runtime registers itself while its engine runs. `stop_all` stops whatever is still
registered; it runs at exit, on SIGTERM to the harness (the handler then dies as the previous
one would), and on Ctrl-C (the runner calls it).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from typing import Protocol

__all__ = ["install_sigterm_handler", "register", "registered", "stop_all", "unregister"]


class _Stoppable(Protocol):
    def stop(self, timeout: float = ...) -> int | None: ...


_LIVE: set[_Stoppable] = set()
_LIVE_LOCK = threading.Lock()


def register(runtime: _Stoppable) -> None:
    with _LIVE_LOCK:
        _LIVE.add(runtime)


def unregister(runtime: _Stoppable) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(runtime)


def registered() -> list[_Stoppable]:
    with _LIVE_LOCK:
        return list(_LIVE)


def stop_all(timeout: float = 5.0) -> None:
    """Stop every engine and container still running."""
    for runtime in registered():
        with contextlib.suppress(Exception):
            runtime.stop(timeout=timeout)


atexit.register(stop_all)


def install_sigterm_handler() -> None:
    """On SIGTERM to the harness, stop every runtime, then die as the previous handler would.

    Only the main thread may install a handler; a second call changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_canary_safety_net", False):
        return

    def handler(signum, frame):
        stop_all()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    handler._canary_safety_net = True  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, handler)
