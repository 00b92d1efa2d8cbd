"""SGLang's own server (`python -m sglang.launch_server`) as a process group the suite owns.

`SGLangServer.start` writes the tiny hybrid-SWA model for the engine configuration, launches the
server from an SGLang venv in a session of its own (the tokenizer manager, the scheduler and the
detokenizer it spawns share that process group), and returns once `/health` answers 200. `stop`
ends the whole group, however the run ends (the shared safety net calls it at exit, on SIGTERM
and on Ctrl-C): no orphans.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import requests

from canaries.runtime import safety
from canaries.server.launch import ServerLaunch
from canaries.server.model import ServerModel
from canaries.server.scheduler_plugin import EVENT_LOG_ENV
from engine_stub.config import EngineConfig

__all__ = ["PLUGIN_DIR", "SGLangServer", "ServerStartError"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO_ROOT / "canaries" / "server" / "plugin"
READY_TIMEOUT_S = 600.0  # almost all of a start is imports: 65-80 s on two idle cores


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log tail."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group `pgid` is left (a SIGKILLed scheduler takes a moment to go,
    and only its new parent reaps it); False if some still is after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.05)
    return False


class SGLangServer:
    """One SGLang server for one engine configuration."""

    def __init__(self, python: str | os.PathLike, config: EngineConfig, *, device: str = "cpu",
                 ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.python = str(python)
        self.config = config
        self.device = device
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.event_log: Path | None = None
        self.base_url = ""
        self.launch: ServerLaunch | None = None
        self.started_s = 0.0
        self._log_file = None
        self._lock = threading.Lock()
        self._exit_code: int | None = None

    def start(self, run_dir: str | os.PathLike, extra_env: dict[str, str] | None = None) -> str:
        """Launch the server and return its base URL once /health answers 200.

        Its scheduler writes the suite's events to `run_dir/events.jsonl` (the plugin);
        `extra_env` adds variables (SGLang's own perturbation knobs)."""
        if self.proc is not None:
            raise RuntimeError("this server was already started")
        run_dir = Path(run_dir).resolve()
        model_dir = ServerModel.of(self.config).write(run_dir / "model")
        self.launch = ServerLaunch(self.config, model_dir, _free_port(), self.device)
        self.log_path = run_dir / "server.log"
        self.event_log = run_dir / "events.jsonl"
        env = {**os.environ, **self.launch.env(PLUGIN_DIR, REPO_ROOT), **(extra_env or {}),
               EVENT_LOG_ENV: str(self.event_log)}
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        safety.install_sigterm_handler()
        started = time.monotonic()
        self.proc = subprocess.Popen(self.launch.argv(self.python), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                                     start_new_session=True)
        safety.register(self)
        self.base_url = f"http://127.0.0.1:{self.launch.port}"
        deadline = started + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"sglang.launch_server exited with {self.proc.returncode} before "
                                       f"it served:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"sglang.launch_server did not answer /health within "
                                       f"{self.ready_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.started_s = time.monotonic() - started
        return self.base_url

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the launcher, wait up to `timeout`, then SIGKILL its whole group; the exit code."""
        with self._lock:
            proc = self.proc
            if proc is None:
                return None
            try:
                if proc.poll() is None:
                    # The launcher alone: it drains and stops its scheduler and detokenizer
                    # (a SIGTERM to them too reads to SGLang as a crashed scheduler).
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout)
                    except subprocess.TimeoutExpired:
                        pass
                # The scheduler and detokenizer may outlive the launcher: the group goes too.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                _wait_group_gone(proc.pid, 10.0)
                self._exit_code = proc.returncode
            finally:
                if self._log_file is not None:
                    with contextlib.suppress(OSError):
                        self._log_file.close()
                    self._log_file = None
                safety.unregister(self)
            return self._exit_code

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
