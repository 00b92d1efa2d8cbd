"""The local runtime: the engine as a subprocess in its own process group.

`start` launches `python -m engine_stub` with the scenario's spec, waits for its ready line and
returns the base URL; `stop` sends SIGTERM to the whole group (the engine drains and exits 0),
then SIGKILL if it lingers. Every live runtime is also tracked so that an `atexit` hook and a
SIGTERM handler can stop engines the caller never got to stop: no orphan survives the harness.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from canaries.runtime import safety

__all__ = ["LocalRuntime", "serves", "tail_text"]

READY_RE = re.compile(r"engine_stub ready on (http://\S+)")


def tail_text(text: str, lines: int = 30) -> str:
    """The last `lines` lines of an engine's output (both runtimes' log tails)."""
    return "\n".join(text.splitlines()[-lines:]) or "(engine log is empty)"


def serves(base_url: str) -> bool:
    """Whether the engine answers HTTP at all (a crashed engine answers /health with 503)."""
    import requests

    try:
        requests.get(f"{base_url}/health", timeout=2).close()
    except requests.RequestException:
        return False
    return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no engine log)"
    return tail_text(text, lines)


class LocalRuntime:
    """One engine subprocess. Use as a context manager; `stop()` is idempotent."""

    name = "local"

    def __init__(self, ready_timeout: float = 30.0, python: str | None = None) -> None:
        self.ready_timeout = ready_timeout
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self.base_url: str | None = None
        self.run_dir: Path | None = None
        self.log_path: Path | None = None
        self.event_log: Path | None = None
        self._exit_code: int | None = None
        self._log_file = None
        self._stopped = False
        self.raw_exit_code: int | None = None
        self._lock = threading.Lock()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, spec_path: str | os.PathLike | None, run_dir: str | os.PathLike,
              extra_flags: list[str] | tuple[str, ...] = ()) -> str:
        """Launch the engine and return its base URL once it serves.

        Raises RuntimeError with the engine log's tail if it exits or is not ready in time.
        """
        if self.proc is not None:
            raise RuntimeError("this runtime already started an engine")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.log_path = run_dir / "engine.log"
        self.event_log = run_dir / "events.jsonl"
        cmd = [self.python, "-m", "engine_stub"]
        if spec_path is not None:
            cmd += ["--scenario", str(spec_path)]
        cmd += ["--port", "0", "--event-log", str(self.event_log), *extra_flags]
        self.command = cmd
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # A tiny model: intra-op threads only fight the other engines for the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        safety.install_sigterm_handler()
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        safety.register(self)
        try:
            self.base_url = self._wait_ready()
        except BaseException:
            self.stop(timeout=2)
            raise
        return self.base_url

    def _wait_ready(self) -> str:
        assert self.proc is not None and self.log_path is not None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                text = self.log_path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            match = READY_RE.search(text)
            if match and serves(match.group(1)):
                return match.group(1)
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the engine exited with code {code} before it was ready; "
                                   f"log tail ({self.log_path}):\n{_tail(self.log_path)}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the engine was not ready within {self.ready_timeout:.0f}s; "
                                   f"log tail ({self.log_path}):\n{_tail(self.log_path)}")
            time.sleep(0.05)

    def poll(self) -> int | None:
        """The exit code if the engine has exited, else None."""
        if self.proc is None or self._stopped:
            return self._exit_code
        code = self.proc.poll()
        if code is not None:
            self._exit_code = code
        return code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def exit_code(self) -> int | None:
        """The engine's exit status (negative: killed by that signal); None while it runs."""
        return self.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the engine to exit by itself; its code, or None on timeout."""
        if self.proc is None:
            return self._exit_code
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the engine's process group (tests: an engine killed from outside)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL; return the exit code."""
        with self._lock:
            proc = self.proc
            if proc is None or self._stopped:
                return self._exit_code
            try:
                graceful = False
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout)
                        graceful = True
                    except subprocess.TimeoutExpired:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(5)
                # Whatever the leader did, leave nothing of its group behind.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                self.raw_exit_code = proc.returncode
                # uvicorn re-raises the SIGTERM it handled once it has drained: our own SIGTERM,
                # answered by a graceful exit, is a clean stop (0), as the engine documents.
                self._exit_code = 0 if graceful and proc.returncode == -signal.SIGTERM \
                    else proc.returncode
            finally:
                self._stopped = True
                if self._log_file is not None:
                    with contextlib.suppress(OSError):
                        self._log_file.close()
                    self._log_file = None
                safety.unregister(self)
            return self._exit_code

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines) if self.log_path else ""

    def __enter__(self) -> LocalRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
