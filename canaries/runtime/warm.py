"""Warm starts for the local runtime: engines forked from one pre-warmed parent.

A harness process starts at most one fork server (`python -m engine_stub.forkserver`), which has
torch and the engine imported, and asks it for each scenario's engine. The engine it forks is a
session leader like a fresh `python -m engine_stub` started with `start_new_session=True`, so
`LocalRuntime` signals it the same way; `WarmProcess` gives it the `subprocess.Popen` interface
the runtime uses (`pid`, `poll`, `wait`, `returncode`), its exit code reported by the server.

The server reads its stdin from a pipe only this process holds: if the harness dies, however it
dies, the server kills every engine it forked and exits.

Forking is unsafe once a process has a CUDA context; the server never makes one, but a CUDA
engine still starts fresh (`start_mode`), and so does any engine on a platform without fork.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from canaries.runtime import safety
from engine_stub.forkproto import SERVER_READY_LINE, ForkProtocolError, LineReader, parse_message

__all__ = ["ForkProtocolError", "ForkServer", "ForkServerMismatch", "PatchedForkServer", "PatchedParentRefused",
           "START_MODES", "WarmProcess", "close_fork_server", "engine_pythonpath", "fork_server", "has_cuda_device",
           "prestart", "register_patched_python", "start_mode"]

START_MODES = ("auto", "warm", "fresh")
PRELOAD_ENV = "ENGINE_STUB_FORKSERVER_PRELOAD"  # modules the fork server imports before forking
SERVER_READY_TIMEOUT_S = 300.0  # torch imports slowly on a loaded runner; a dead server is seen at once (EOF)
# How long a fork request may wait for its pid: the server forks one engine at a time, and a
# fork is slow on a loaded machine (each copies the page tables of a process with torch in it).
FORK_ANSWER_TIMEOUT_S = 60.0
ENGINE_FORK_SERVER = "engine_stub.forkserver"


def start_mode(requested: str, device: str | None) -> str:
    """"warm" or "fresh" for an engine on `device` ("auto" picks warm where it is safe)."""
    if requested not in START_MODES:
        raise ValueError(f"start mode {requested!r}: valid modes: {', '.join(START_MODES)}")
    forkable = hasattr(os, "fork") and sys.platform.startswith("linux")
    cuda = device == "cuda" or (device in (None, "auto") and has_cuda_device())
    if requested == "fresh" or not forkable or cuda:
        return "fresh"
    return "warm"


def has_cuda_device() -> bool:
    # Without importing torch (which a CUDA query would initialise): the driver's device nodes.
    return any(Path("/dev").glob("nvidia[0-9]*"))


class ForkServerMismatch(RuntimeError):
    """The engine tree's fork server speaks another protocol version (an older commit's): its
    engines start fresh instead."""


class WarmProcess:
    """One engine forked by the server: the parts of `subprocess.Popen` the runtime uses.

    It reads the server's typed messages (`engine_stub.forkproto`) after the pid: the engine's
    ready line, then its exit code. Anything else is a `ForkProtocolError` naming what came."""

    def __init__(self, conn: socket.socket, pid: int, reader: LineReader, lines: list[bytes],
                 on_exit: Callable[[WarmProcess], None] | None = None) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self.ready_line: str | None = None
        self._reader = reader
        self._lock = threading.Lock()
        self._on_exit = on_exit  # the server's: it counts its live engines
        self._take(lines)

    def __del__(self) -> None:
        self._conn.close()

    def _take(self, lines: list[bytes]) -> None:
        for raw in lines:
            kind, value = parse_message(raw)
            if self.returncode is not None:
                raise ForkProtocolError(f"engine pid {self.pid}: a {kind!r} message after its exit: {raw!r}")
            if kind == "ready":
                if self.ready_line is None:
                    self.ready_line = str(value).strip()
            elif kind == "exit":
                self.returncode = int(value)  # type: ignore[arg-type]
                self._conn.close()  # the server sends nothing after the exit code
                self._exited()
            else:
                raise ForkProtocolError(f"engine pid {self.pid}: unexpected {kind!r} message after "
                                        f"its pid: {raw!r}")

    def _read(self, timeout: float | None) -> bool:
        """Read what the server sent within `timeout`; False once the connection is closed."""
        if self._conn.fileno() < 0:
            return False
        readable, _, _ = select.select([self._conn], [], [], timeout)
        if not readable:
            return True
        try:
            chunk = self._conn.recv(65536)
        except ConnectionError:  # reset: the server died mid-message, as EOF below
            chunk = b""
        if not chunk:
            self._conn.close()
            if self.returncode is None:
                self.returncode = -9  # the server itself died: its engines died with it
                self._exited()
            return False
        self._take(self._reader.feed(chunk))
        return True

    def _exited(self) -> None:
        on_exit, self._on_exit = self._on_exit, None
        if on_exit is not None:
            on_exit(self)

    def hang_up(self) -> None:
        """Close our side of the connection for writing (the child's lifeline, if it is a
        patched parent, reads EOF); the server's answers, its exit code among them, still come."""
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_WR)

    def wait_ready(self, timeout: float) -> str | None:
        """The engine's ready line, or None if it exited or `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.ready_line is None and self.returncode is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._read(left):
                    break
        return self.ready_line

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.returncode is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout or 0)
                if not self._read(left):
                    break
        assert self.returncode is not None
        return self.returncode


class _RetiringServer:
    """What both kinds of fork parent share: the engines forked and not yet seen exit, and
    retirement (fork nothing more; close once the last of them has exited), so that closing a
    parent never kills an engine another part of the harness still uses."""

    def _track_children(self) -> None:
        self._children: set[WarmProcess] = set()
        self._children_lock = threading.Lock()
        self._retired = False

    def _tracked(self, proc: WarmProcess) -> WarmProcess:
        with self._children_lock:
            if proc.returncode is None:
                self._children.add(proc)
        return proc

    def _child_exited(self, proc: WarmProcess) -> None:
        with self._children_lock:
            self._children.discard(proc)
            last = self._retired and not self._children
        if last:
            self.close()

    def retire(self) -> None:
        """Fork nothing more; close once every engine forked so far has exited (at once if none
        is alive). An engine another part of the harness started from this server (a clean server
        of the oracle, beside another column's) lives until its own stop."""
        with self._children_lock:
            self._retired = True
            idle = not self._children
            if not idle:
                with _RETIRED_LOCK:
                    _RETIRED.add(self)
        if idle:
            self.close()

    def _forget_children(self) -> None:
        """On close: its engines die with it; dropping them breaks the engine <-> server cycle
        (their exit callback is ours), so an engine's socket is closed by its own finalizer
        rather than left to the garbage collector's order."""
        with self._children_lock:
            self._children.clear()

    def close(self, keep_log: bool = False) -> None:
        raise NotImplementedError


class ForkServer(_RetiringServer):
    """The harness's handle on one running fork server."""

    def __init__(self, python: str | None = None, engine_root: str | os.PathLike | None = None,
                 preload: tuple[str, ...] = (), module: str = ENGINE_FORK_SERVER,
                 env: tuple[tuple[str, str], ...] = ()) -> None:
        """Start `python -m MODULE SOCKET` (a fork server speaking `engine_stub.forkproto`),
        with `env` over this process's environment."""
        self.python = python or sys.executable
        self.engine_root = str(engine_root) if engine_root is not None else None
        self.preload = tuple(preload)
        self.module = module
        self._dir = Path(tempfile.mkdtemp(prefix="canary-forkserver-"))
        self.socket_path = str(self._dir / "sock")
        env_overrides, env = env, dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = engine_pythonpath(self.engine_root, env.get("PYTHONPATH"))
        env[PRELOAD_ENV] = ",".join(self.preload)
        env.update(dict(env_overrides))
        self.env = env  # what its children see unless a request says otherwise (a patched parent's)
        self.dependents: set[PatchedForkServer] = set()  # patched parents forked from it, still serving
        self.close_requested = False  # closed by its column while a patched parent still serves
        self._track_children()
        self.log_path = self._dir / "forkserver.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", self.module, self.socket_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True, cwd=self._dir,  # see LocalRuntime.start: no shadowing
            )
        line = self._ready_line()
        if line != SERVER_READY_LINE:
            self.close(keep_log=True)
            if line.startswith("engine_stub forkserver ready"):
                raise ForkServerMismatch(f"the engine fork server under {self.engine_root or 'this checkout'} "
                                         f"speaks another protocol ({line!r}; this harness: "
                                         f"{SERVER_READY_LINE!r})")
            raise RuntimeError(f"the engine fork server did not start (got {line!r}); "
                               f"its log: {self.log_path}")

    def _ready_line(self) -> str:
        """The server's first line (its imports take seconds); given up at once when the run is
        stopping (Ctrl-C): then the half-started server is closed and `safety.Stopping` raised."""
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if safety.stopping():  # it holds no engine yet: killed, not waited for
                self.proc.kill()
                self.close()
                raise safety.Stopping("the run is stopping: a fork server being started was killed")
            readable, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if readable:
                return self.proc.stdout.readline().decode("utf-8", "replace").strip()
        return ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str | os.PathLike,
              cwd: str | os.PathLike | None = None, patched_site: str | None = None) -> WarmProcess:
        """Fork one engine running `python -m engine_stub ARGV`; its process handle.

        RuntimeError if the server refuses or does not answer within FORK_ANSWER_TIMEOUT_S
        (ForkProtocolError, a RuntimeError, if it answers out of protocol). `patched_site`: fork
        a parent for that patched mirror instead (`PatchedForkServer`)."""
        return self._tracked(_request_fork(self.socket_path, argv, env, log_path, cwd, patched_site,
                                           on_exit=self._child_exited))

    def close(self, keep_log: bool = False) -> None:
        """Stop the server; it kills whatever engines it still has."""
        with _RETIRED_LOCK:
            _RETIRED.discard(self)
        self._forget_children()
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        with contextlib.suppress(OSError):
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if not keep_log:
            shutil.rmtree(self._dir, ignore_errors=True)


class PatchedParentRefused(RuntimeError):
    """A patched copy could not be loaded into a fork of its base's parent; the message says why."""


class PatchedForkServer(_RetiringServer):
    """A fork parent for a patched copy of a release: a fork of the release's own warm parent
    (`base`) with the patched files loaded in place (`engine_stub.hotpatch`), nothing imported
    again. It speaks the same protocol on a socket of its own and lives until `close` (or until
    the harness dies: its lifeline is our connection to `base`)."""

    def __init__(self, base: ForkServer, python: str, site: str) -> None:
        self.base = base
        self.python = python  # the patched interpreter it stands for
        self._dir = Path(tempfile.mkdtemp(prefix="canary-forkserver-"))
        self.socket_path = str(self._dir / "sock")
        self.log_path = self._dir / "forkserver.log"
        self._track_children()
        try:
            self.proc = base.spawn([self.socket_path], base.env, self.log_path, cwd=self._dir, patched_site=site)
        except RuntimeError as exc:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise PatchedParentRefused(str(exc)) from None
        line = self.proc.wait_ready(SERVER_READY_TIMEOUT_S)
        if (line or "").strip() != SERVER_READY_LINE:
            self.close(keep_log=True)
            why = [ln for ln in _log_lines(self.log_path) if "cannot be loaded in place" in ln]
            shutil.rmtree(self._dir, ignore_errors=True)
            raise PatchedParentRefused((why or [f"no ready line (got {line!r})"])[-1])
        base.dependents.add(self)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str | os.PathLike,
              cwd: str | os.PathLike | None = None) -> WarmProcess:
        """As `ForkServer.spawn`, from the patched copy."""
        return self._tracked(_request_fork(self.socket_path, argv, env, log_path, cwd, on_exit=self._child_exited))

    def close(self, keep_log: bool = False) -> None:
        """Stop this parent (it kills whatever engines it still has); the base's parent goes too
        if its own column asked it to close meanwhile."""
        with _RETIRED_LOCK:
            _RETIRED.discard(self)
        self._forget_children()
        self.proc.hang_up()  # its lifeline: it kills its engines and exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.base.dependents.discard(self)
        if self.base.close_requested and not self.base.dependents:
            _drop(self.base)
            self.base.retire()
        if not keep_log:
            shutil.rmtree(self._dir, ignore_errors=True)


def _log_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _request_fork(socket_path: str, argv: list[str], env: dict[str, str], log_path: str | os.PathLike,
                  cwd: str | os.PathLike | None, patched_site: str | None = None,
                  on_exit: Callable[[WarmProcess], None] | None = None) -> WarmProcess:
    """Ask the fork server listening on `socket_path` for one child (see `ForkServer.spawn`)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
        request = {"argv": list(argv), "env": dict(env), "log": str(log_path),
                   "cwd": str(cwd or os.getcwd())}
        if patched_site is not None:
            request["patched_site"] = str(patched_site)
        conn.sendall((json.dumps(request) + "\n").encode())
        reader = LineReader()
        lines: list[bytes] = []
        deadline = time.monotonic() + FORK_ANSWER_TIMEOUT_S
        while not lines:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([conn], [], [], max(left, 0))
            chunk = conn.recv(65536) if readable else b""
            if not chunk:
                raise RuntimeError("the engine fork server did not answer a fork request "
                                   + ("(it closed the connection)" if readable else
                                      f"within {FORK_ANSWER_TIMEOUT_S:.0f}s"))
            lines = reader.feed(chunk)
        kind, value = parse_message(lines[0])
        if kind == "error":
            raise RuntimeError(f"the engine fork server refused: {value}")
        if kind != "pid":
            raise ForkProtocolError(f"the fork server's first answer must be its 'pid' "
                                    f"message, got: {lines[0]!r}")
    except BaseException:
        conn.close()
        raise
    return WarmProcess(conn, int(value), reader, lines[1:], on_exit=on_exit)  # type: ignore[arg-type]


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def engine_pythonpath(engine_root: str | os.PathLike | None, existing: str | None) -> str:
    """PYTHONPATH for an engine process: `engine_root` (a directory holding another copy of
    `engine_stub/`, e.g. a mutated one) first, then this checkout, then what was there."""
    parts = [str(engine_root)] if engine_root is not None else []
    parts += [str(_repo_root()), *(existing.split(os.pathsep) if existing else [])]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


_ServerKey = tuple[str, "str | None", tuple[str, ...], str, tuple[tuple[str, str], ...]]
_SERVERS: dict[_ServerKey, ForkServer | PatchedForkServer] = {}
_SERVER_LOCK = threading.Lock()  # guards _SERVERS and _STARTING only, never held over a start
_STARTING: dict[_ServerKey, threading.Lock] = {}  # one start at a time per key, others in parallel
_RETIRED: set[_RetiringServer] = set()  # closed by `close_fork_server` while engines of theirs still ran
_RETIRED_LOCK = threading.Lock()
# A patched interpreter (canaries.sglang.releases.patches.patched_interpreter) -> the release's own
# interpreter and the patched mirror it puts first on the path.
_PATCHED: dict[str, tuple[str, str]] = {}


def register_patched_python(python: str | os.PathLike, base: str | os.PathLike, site: str | os.PathLike) -> None:
    """Say that interpreter `python` is `base` with the patched mirror `site` first on its path:
    its warm parent is then a fork of `base`'s with the patch loaded in place
    (`PatchedForkServer`), not a parent importing everything again; one that cannot load the
    patch in place falls back to a parent of its own, saying why on stderr."""
    with _SERVER_LOCK:
        _PATCHED[str(python)] = (str(base), str(site))


def _key(python: str | None, engine_root: str | os.PathLike | None, preload: tuple[str, ...] = (),
         module: str = ENGINE_FORK_SERVER, env: dict[str, str] | None = None) -> _ServerKey:
    return (python or sys.executable, str(engine_root) if engine_root is not None else None, tuple(preload),
            module, tuple(sorted((env or {}).items())))


def _drop(server: ForkServer | PatchedForkServer) -> None:
    with _SERVER_LOCK:
        for key in [k for k, v in _SERVERS.items() if v is server]:
            del _SERVERS[key]


def fork_server(python: str | None = None, engine_root: str | os.PathLike | None = None,
                preload: tuple[str, ...] = (), module: str = ENGINE_FORK_SERVER,
                env: dict[str, str] | None = None) -> ForkServer | PatchedForkServer:
    """This process's fork server for `python`, the engine sources under `engine_root` (None:
    this checkout's), the extra modules to `preload`, the server `module` and its `env`, started
    on first use (and again if it died). A patched interpreter (`register_patched_python`), or
    another copy of the engine's sources (`engine_root`), gets a fork of the release's (this
    checkout's) server with the changes loaded in place where that can be done."""
    key = _key(python, engine_root, preload, module, env)
    with _SERVER_LOCK:
        starting = _STARTING.setdefault(key, threading.Lock())
    with starting:  # a start takes seconds: other keys' servers stay usable meanwhile
        with _SERVER_LOCK:
            server = _SERVERS.get(key)
        if server is not None and server.alive:
            if isinstance(server, ForkServer):
                server.close_requested = False  # wanted again before its patched parents finished
            return server
        if server is not None:
            _drop(server)
            server.close()
        if safety.stopping():  # a Ctrl-C: no new fork server (seconds of imports) for nothing
            raise safety.Stopping("the run is stopping: no fork server is started")
        server = _start(key)
        with _SERVER_LOCK:
            _SERVERS[key] = server
        return server


def _start(key: _ServerKey) -> ForkServer | PatchedForkServer:
    python, engine_root, preload, module, env = key
    patched = _PATCHED.get(python)
    if patched is None and engine_root is not None and Path(engine_root, "engine_stub").is_dir():
        # Another copy of the engine's sources (a planted regression, a mutant): loaded into a
        # fork of this checkout's parent where only function bodies differ.
        patched = (python, engine_root)
        engine_root = None
    if patched is not None:
        base_python, site = patched
        base = fork_server(base_python, engine_root, preload, module, dict(env))
        try:
            return PatchedForkServer(base, python, site)  # type: ignore[arg-type]
        except PatchedParentRefused as exc:
            print(f"canary: {python} gets a warm parent of its own (its patch cannot be loaded into a fork "
                  f"of {base_python}'s: {exc})", file=sys.stderr, flush=True)
    return ForkServer(*key)


def close_fork_server(python: str | None = None, engine_root: str | os.PathLike | None = None) -> None:
    """Retire the fork servers of (`python`, `engine_root`), if any run (e.g. a mutant's, when
    its scenarios are done, or a matrix column's): the next `fork_server` call starts a new one,
    and each retired server stops once the engines it forked have exited. Engines of it that
    others still use are never killed under them (a column that ends while another column's
    oracle has a reference server of the same release running). A release's server that patched
    parents still fork from retires when the last of them closes."""
    want = _key(python, engine_root)[:2]
    with _SERVER_LOCK:
        servers = [server for key, server in _SERVERS.items() if key[:2] == want]
    for server in servers:
        if isinstance(server, ForkServer) and server.dependents:
            server.close_requested = True
            continue
        _drop(server)
        server.retire()


def prestart(python: str | None = None, engine_root: str | os.PathLike | None = None,
             preload: tuple[str, ...] = ()) -> None:
    """Start a fork server in the background (its imports overlap other work).

    A failure here is left for the first `fork_server()` call to raise."""
    def start() -> None:
        with contextlib.suppress(Exception):
            fork_server(python, engine_root, preload)

    threading.Thread(target=start, name="canary-forkserver-start", daemon=True).start()


@atexit.register
def _close_servers() -> None:
    with _SERVER_LOCK, _RETIRED_LOCK:
        servers = [*_SERVERS.values(), *_RETIRED]
        _SERVERS.clear()
    # Patched parents first: each may close its base on the way.
    for server in sorted(servers, key=lambda s: not isinstance(s, PatchedForkServer)):
        server.close()
