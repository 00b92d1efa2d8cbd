"""The safety net every runtime shares: no engine or container outlives the harness.

Each runtime registers itself while its engine runs. `stop_all` stops whatever is still
registered; it runs at exit, on SIGTERM to the harness (the handler then dies as the previous
one would), and on Ctrl-C (the runner calls it).

`SignalLatch` is for the stretch where a signal must not break off what the harness does (a run,
then its reports): SIGINT and SIGTERM are only noted, and the caller acts on the first.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from types import FrameType
from typing import Any, Protocol

__all__ = ["SignalLatch", "Stopping", "install_sigterm_handler", "register", "registered", "set_stopping",
           "stop_all", "stopping", "unregister"]


class _Stoppable(Protocol):
    def stop(self, timeout: float = ...) -> int | None: ...


_LIVE: set[_Stoppable] = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()


class Stopping(RuntimeError):
    """The run is being stopped (Ctrl-C, SIGTERM): an engine that registers now was stopped at once."""


def set_stopping(on: bool) -> None:
    """Mark the run as stopping (an interrupt), or as running again (a new run begins)."""
    if on:
        _STOPPING.set()
    else:
        _STOPPING.clear()


def stopping() -> bool:
    """Whether the run is being stopped: whatever starts now is stopped at once."""
    return _STOPPING.is_set()


def register(runtime: _Stoppable) -> None:
    """A runtime whose engine runs. While the run is stopping (`set_stopping`), an engine that
    registers (one whose start was under way at the interrupt) is stopped at once and `Stopping`
    is raised into its start: nothing started after a Ctrl-C runs on."""
    with _LIVE_LOCK:
        _LIVE.add(runtime)
    if _STOPPING.is_set():
        with contextlib.suppress(Exception):
            runtime.stop(timeout=1.0)
        raise Stopping("the run is stopping: an engine that started meanwhile was stopped at once")


def unregister(runtime: _Stoppable) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(runtime)


def registered() -> list[_Stoppable]:
    with _LIVE_LOCK:
        return list(_LIVE)


def stop_all(timeout: float = 5.0) -> None:
    """Stop every engine and container still running, all at once (one thread each: a matrix's
    columns and their oracles' clean servers are many, and each stop waits a little)."""
    def stop(runtime: _Stoppable) -> None:
        with contextlib.suppress(Exception):
            runtime.stop(timeout=timeout)

    threads = [threading.Thread(target=stop, args=(runtime,), name="canary-stop", daemon=True)
               for runtime in registered()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


atexit.register(stop_all)


def install_sigterm_handler() -> None:
    """On SIGTERM to the harness, stop every runtime, then die as the previous handler would.

    Only the main thread may install a handler; a second call changes nothing. A SIGTERM that
    arrives while the first is being handled is ignored: Python would run the handler again
    inside the first one, and its stop_all would wait forever on a runtime's lock that the
    first one holds.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_canary_safety_net", False):
        return
    handling: list[int] = []

    def handler(signum, frame):
        if handling:
            return
        handling.append(signum)
        stop_all()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    handler._canary_safety_net = True  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, handler)


class SignalLatch:
    """While entered, SIGINT and SIGTERM only set `signum` (the first one) and `count`.

    Python runs a handler in the main thread between any two bytecodes, and runs it again if
    another signal arrives meanwhile, so the handler does nothing but note the signal: raising
    there (KeyboardInterrupt, SystemExit) could abort whatever the main thread was doing,
    report writing included, and a second signal would abort the clean-up of the first. The
    caller polls `tripped` and acts on the first signal with every later one ignored.
    A signal ignored when the latch is entered (SIG_IGN: e.g. SIGINT of a background job)
    stays ignored. Leaving restores the previous handlers (or, after `ignore_on_exit`, leaves
    both signals ignored). Outside the main thread no handler can be installed, and the latch
    never trips. Latches nest, but an inner one's signals are not seen by the outer one: to
    watch the same signals over a longer stretch, share one latch.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        self._ignore_on_exit = False

    @property
    def tripped(self) -> bool:
        """Whether a signal arrived while the latch was entered."""
        return self.signum is not None

    @property
    def signal_name(self) -> str | None:
        """The first signal's name (`SIGINT`), or None."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    def ignore_on_exit(self) -> None:
        """Leave SIGINT and SIGTERM ignored when the latch is left: for a process that is only
        exiting now, whose reports a late signal must not turn into a traceback or a kill."""
        self._ignore_on_exit = True

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> SignalLatch:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            if self._ignore_on_exit:
                previous = signal.SIG_IGN
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
