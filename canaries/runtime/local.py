"""The local runtime: the engine as a subprocess in its own process group.

`start` launches `python -m engine_stub` with the scenario's spec, waits for its ready line (the
engine writes it to a pipe of ours as well as to its log) and returns the base URL. The engine is
forked from a warm parent (`canaries.runtime.warm`) where that is safe, else started fresh;
either way it leads a process group of its own, and `start_mode` says which ran. `stop` sends SIGTERM to the whole group (the engine drains and exits 0),
then SIGKILL if it lingers. Every live runtime is also tracked so that an `atexit` hook and a
SIGTERM handler can stop engines the caller never got to stop: no orphan survives the harness.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from canaries.runtime import safety
from canaries.runtime.warm import (
    START_MODES,
    ForkServerMismatch,
    WarmProcess,
    engine_pythonpath,
    fork_server,
    start_mode,
)
from engine_stub.__main__ import READY_FD_ENV

START_ENV = "CANARY_ENGINE_START"

__all__ = ["LocalRuntime", "PRELOAD", "serves", "spec_knob", "tail_text"]

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


def _read_ready_line(fd: int, timeout: float) -> str | None:
    """The line the engine writes to its ready pipe; None on EOF (it exited) or timeout."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            data += chunk
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")


def _signal_engine(proc: subprocess.Popen | WarmProcess, sig: int) -> None:
    """`sig` to the engine's process group, or to the engine itself while it has no group yet
    (a warm engine forked a moment ago, before its setsid). Only for an engine not yet reaped:
    its pid cannot have been reused."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, sig)
    except PermissionError:
        pass


def spec_knob(name: str, spec_path: str | os.PathLike | None, flags: Sequence[str]) -> str | None:
    """The value the engine will be given for knob `name`: a `--name` flag, else the spec's
    engine section, else its ENGINE_STUB_ variable."""
    flags, flag = list(flags), "--" + name.replace("_", "-")
    if flag in flags[:-1]:
        return flags[flags.index(flag) + 1]
    engine = None
    if spec_path is not None:
        try:
            spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            spec = None  # a YAML scenario or an unreadable one: the engine reports it
        engine = spec.get("engine") if isinstance(spec, dict) else None
    if isinstance(engine, dict) and name in engine:
        return engine[name]
    return os.environ.get("ENGINE_STUB_" + name.upper())


# Imported by a warm parent ahead of the fork when the engine will need them (they are slow).
_SGLANG_ALLOCATOR = ("sglang.srt.mem_cache.allocator.swa",)
# A release ships one tree or both (swa_radix_cache up to 0.5.20): a module it lacks is skipped.
# Also what the engine's adapters and SGLang's constructors import on first use (0.5.23's tree
# core loads a Rust extension when the first cache is built): each engine paid 0.1-0.2 s for them.
_SGLANG_FIRST_USE = ("engine_stub.mem.sglang_backend", "engine_stub.mem.sglang_tree",
                     "engine_stub.mem.sglang_req_to_token", "sglang.srt.mem_cache.rust_tree_core.extension",
                     "sglang.srt.mem_cache.unified_memory_pool", "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
                     "sglang.srt.mem_cache.deepseek_v4_memory_pool", "sglang.srt.mem_cache.hisparse_memory_pool")
PRELOAD = {
    "sglang": (*_SGLANG_ALLOCATOR, "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.unified_radix_cache",
               "sglang.srt.mem_cache.swa_radix_cache", *_SGLANG_FIRST_USE),
    "sglang-allocator": _SGLANG_ALLOCATOR,
}


class LocalRuntime:
    """One engine subprocess. Use as a context manager; `stop()` is idempotent."""

    name = "local"

    def __init__(self, ready_timeout: float = 30.0, python: str | None = None,
                 start: str | None = None, engine_root: str | os.PathLike | None = None) -> None:
        self.ready_timeout = ready_timeout
        # Absolute: the engine (and a warm fork server) runs in a directory of its own.
        self.python = os.path.abspath(python) if python and os.sep in python else (python or sys.executable)
        # A directory holding the engine_stub/ to run (a mutant, a commit); None: this checkout.
        # Absolute too: a relative one on the engine's PYTHONPATH names nothing where the fork
        # server runs, and the checkout's own engine_stub would run in its place.
        self.engine_root = os.path.abspath(engine_root) if engine_root is not None else None
        # auto | warm | fresh (see canaries.runtime.warm); the mode that ran is `start_mode`.
        self.requested_start = start or os.environ.get(START_ENV) or "auto"
        if self.requested_start not in START_MODES:
            raise ValueError(f"{START_ENV}/start={self.requested_start!r}: valid: {', '.join(START_MODES)}")
        self.start_mode: str | None = None
        self.proc: subprocess.Popen | WarmProcess | None = None
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
        # Absolute: the engine runs in a directory of its own (see below).
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.log_path = run_dir / "engine.log"
        self.event_log = run_dir / "events.jsonl"
        cmd = [self.python, "-m", "engine_stub"]
        if spec_path is not None:
            cmd += ["--scenario", str(Path(spec_path).resolve())]
        cmd += ["--port", "0", "--event-log", str(self.event_log), *extra_flags]
        self.command = cmd
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # A tiny model: intra-op threads only fight the other engines for the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = engine_pythonpath(self.engine_root, env.get("PYTHONPATH"))
        safety.install_sigterm_handler()
        device = spec_knob("device", spec_path, extra_flags)
        if str(device or "").startswith("cuda"):
            # A strict invariant's device assert then raises at its own launch, inside the check
            # that knows its name; otherwise CUDA reports a nameless "device-side assert
            # triggered" at a later sync and the crash cannot be attributed.
            env.setdefault("CUDA_LAUNCH_BLOCKING", "1")
        self.start_mode = start_mode(self.requested_start, device)
        server = None
        if self.start_mode == "warm":
            preload = PRELOAD.get(str(spec_knob("memory", spec_path, extra_flags)), ())
            try:
                server = fork_server(self.python, self.engine_root, preload)
            except ForkServerMismatch:
                self.start_mode = "fresh"  # an engine tree of another era: no warm parent for it
        if server is not None:
            self.proc = server.spawn(cmd[3:], env, self.log_path)
            safety.register(self)
            ready = lambda: self.proc.wait_ready(self.ready_timeout)  # noqa: E731
        else:
            ready_r, ready_w = os.pipe()
            env[READY_FD_ENV] = str(ready_w)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            try:
                # cwd: `python -m` puts the working directory first on sys.path, where a
                # checkout's engine_stub/ would shadow the one `engine_root` names.
                self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                             pass_fds=(ready_w,), cwd=run_dir)
            finally:
                os.close(ready_w)
            safety.register(self)
            ready = lambda: _read_ready_line(ready_r, self.ready_timeout)  # noqa: E731
        try:
            self.base_url = self._wait_ready(ready)
        except BaseException:
            self.stop(timeout=2)
            raise
        return self.base_url

    def _wait_ready(self, ready_line) -> str:
        """The base URL from the engine's ready line (pushed to us, never polled for)."""
        assert self.proc is not None and self.log_path is not None
        line = ready_line()
        match = READY_RE.search(line or "")
        if match:
            return match.group(1)
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"the engine exited with code {code} before it was ready; "
                               f"log tail ({self.log_path}):\n{_tail(self.log_path)}")
        raise RuntimeError(f"the engine was not ready within {self.ready_timeout:.0f}s; "
                           f"log tail ({self.log_path}):\n{_tail(self.log_path)}")

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
            _signal_engine(self.proc, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL; return the exit code."""
        with self._lock:
            proc = self.proc
            if proc is None or self._stopped:
                return self._exit_code
            try:
                graceful = False
                if proc.poll() is None:
                    _signal_engine(proc, signal.SIGTERM)
                    try:
                        proc.wait(timeout)
                        graceful = True
                    except subprocess.TimeoutExpired:
                        _signal_engine(proc, signal.SIGKILL)
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
