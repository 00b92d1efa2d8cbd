"""A warm parent for engines: torch and the engine imported once, each engine a fork of it.

    python -m engine_stub.forkserver SOCKET

imports what `python -m engine_stub` needs (it never touches a CUDA device), listens on the Unix
socket SOCKET and prints `engine_stub forkserver ready (protocol N)`. Each connection asks for one engine with
one JSON line `{"argv": [...], "env": {...}, "cwd": ..., "log": ...}`. The server forks a child
that starts a session of its own (its pid is its process group, so a harness signals it exactly
as it would a fresh process), reads stdin from /dev/null, writes stdout and stderr to `log`, and
runs `engine_stub.__main__.main(argv)` under `env`.

The connection's answers are `engine_stub.forkproto`'s typed lines, all written by the server:
`pid` at once, `ready` when the engine writes its ready line (to a pipe only it holds, which the
server reads and forwards), `exit` once the child is reaped (after any ready line the pipe still
held), or `error` in place of a pid when the request is malformed or the fork fails. The child
closes the connection first thing, so it can never write on it, and closes every other
connection and pipe of the server's.

The server lives as long as its stdin: when the harness that started it exits, however it dies,
the pipe closes and the server SIGKILLs every child's group before it exits, so no engine
outlives its harness.

A request with `patched_site` forks a parent for a patched copy of the release instead of an
engine (`engine_stub.forkproto`): the child loads the patched files into itself in place
(`engine_stub.hotpatch`), nothing imported again, and serves the same protocol on a socket of its
own for as long as the requesting connection stays open.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch  # noqa: F401 - imported once here, so that every forked engine starts warm

import engine_stub.engine  # noqa: F401
import engine_stub.perturb.loader  # noqa: F401
import engine_stub.server  # noqa: F401
from engine_stub.__main__ import READY_FD_ENV
from engine_stub.__main__ import main as engine_main
from engine_stub.forkproto import (
    SERVER_READY_LINE,
    ForkProtocolError,
    LineReader,
    encode,
    parse_request,
)

__all__ = ["READY_LINE", "serve"]

READY_LINE = SERVER_READY_LINE
PRELOAD_ENV = "ENGINE_STUB_FORKSERVER_PRELOAD"
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_PR_SET_PDEATHSIG = 1


@dataclass
class _Child:
    """A forked engine as the server tracks it: its connection and the read end of its ready pipe."""

    pid: int
    conn: socket.socket
    ready_fd: int | None
    ready: LineReader = field(default_factory=LineReader)


def _child(request: dict, ready_w: int, closing: list[socket.socket], fds: list[int],
           main: Callable[[list[str]], int], conn: socket.socket, parent: int | None = None) -> None:
    """In the forked child: become a fresh-looking engine process, run `main(argv)` (or, for a
    `patched_site` request, serve as the patched copy's fork parent), never return. `parent`: die
    with that process (a patched parent's engines: its own parent's close cannot reach them)."""
    code = 1
    patched = request.get("patched_site")
    try:
        if parent is not None:
            _die_with_parent(parent)
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        for sock in closing:  # its own connection among them: only the server writes there
            if not (patched and sock is conn):  # a patched parent only reads it: its lifeline
                sock.close()
        for fd in fds:
            os.close(fd)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null_fd)
        os.close(log_fd)
        os.chdir(request.get("cwd") or "/")
        os.environ.clear()
        os.environ.update(request["env"])
        # The engine writes its ready line to this pipe; the server forwards it at once.
        os.environ[READY_FD_ENV] = str(ready_w)
        os.set_inheritable(ready_w, False)
        if patched:
            code = _serve_patched(request["argv"], patched, conn, ready_w, main)
        else:
            code = main(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must end in os._exit, whatever happened
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` (its parent) dies (Linux), or now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _serve_patched(argv: list[str], site: str, lifeline: socket.socket, ready_w: int,
                   main: Callable[[list[str]], int]) -> int:
    """In a forked child: load the patched mirror `site` into this process (`hotpatch.apply`) and
    serve fork requests on the socket `argv[0]` until `lifeline` (the requesting connection)
    closes; 3 when the mirror cannot be loaded in place (the reason on stderr, the log)."""
    from engine_stub.hotpatch import HotPatchRefused
    from engine_stub.hotpatch import apply as load_patched

    if len(argv) != 1:
        print(f"engine_stub forkserver: a patched parent takes one argument, its socket; got {argv!r}",
              file=sys.stderr)
        return 2
    try:
        loaded = load_patched(site)
    except HotPatchRefused as exc:
        print(f"engine_stub forkserver: the patched copy at {site} cannot be loaded in place: {exc}", file=sys.stderr)
        return 3
    for module, how in sorted(loaded.items()):
        print(f"engine_stub forkserver: {module}: {how}", file=sys.stderr)
    os.environ.pop(READY_FD_ENV, None)

    def announce(line: str) -> None:
        os.write(ready_w, (line + "\n").encode())
        os.close(ready_w)  # its engines must not hold it

    return serve(argv[0], main, lifeline=lifeline.fileno(), announce=announce, keep=[lifeline],
                 children_die_with_it=True)


def _send(conn: socket.socket, message: bytes) -> None:
    """Write one encoded message; a harness that hung up is no concern of the server's."""
    with contextlib.suppress(OSError):
        conn.sendall(message)


# What every engine imports between the fork and its ready line unless its parent has (85 modules:
# uvicorn's server and the protocol classes its Config.load() picks, fastapi's check for pydantic
# v1 models as routes are declared, the perturbation reach tracker).
ENGINE_START_MODULES = (
    "uvicorn", "uvicorn.config", "uvicorn.server", "uvicorn.main", "uvicorn.lifespan.on",
    "uvicorn.loops.auto", "uvicorn.protocols.http.auto", "uvicorn.protocols.websockets.auto",
    "uvicorn.middleware.proxy_headers", "uvicorn.middleware.message_logger",
    "uvicorn.loops.asyncio", "pydantic.v1", "logging.config", "fastapi.telemetry._runtime",
    "engine_stub.perturb.reach",
)


def _warm_engine_start() -> None:
    """Import what an engine would import after the fork (see ENGINE_START_MODULES) and what
    uvicorn's automatic choices pick, so that no engine imports it again. An engine tree or a
    venv without one of them imports nothing instead."""
    for name in ENGINE_START_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with contextlib.suppress(Exception):
        from uvicorn import config as uvicorn_config
        from uvicorn.importer import import_from_string

        # The "auto" entries of uvicorn's tables (their names differ between its versions).
        for table in ("HTTP_PROTOCOLS", "WS_PROTOCOLS", "LIFESPAN", "LOOP_SETUPS", "LOOP_FACTORIES"):
            target = getattr(uvicorn_config, table, {}).get("auto")
            if target:
                picked = import_from_string(target)
                with contextlib.suppress(Exception):
                    importlib.import_module(picked.__module__)


def _preload() -> None:
    """Import the extra modules the harness named (e.g. SGLang's allocator: seconds to import)."""
    for name in filter(None, os.environ.pop(PRELOAD_ENV, "").split(",")):
        try:
            try:
                spec = importlib.util.find_spec(name)
            except ModuleNotFoundError:  # its package is not in this release either
                spec = None
            if spec is None:  # not in this release: nothing to warm
                continue
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the engine reports it where it needs the module
            print(f"engine_stub forkserver: could not preload {name}: {exc}", file=sys.stderr)


class _Server:
    """The server's state: the listener, connections still sending their request, children."""

    def __init__(self, socket_path: str, main: Callable[[list[str]], int], lifeline: int,
                 keep: list[socket.socket], children_die_with_it: bool = False) -> None:
        self.main = main
        self.parent_of_children = os.getpid() if children_die_with_it else None
        self.lifeline = lifeline
        self.keep = keep  # sockets of its own every child closes (a patched parent's lifeline)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_path)
        self.listener.listen(64)
        self.pending: dict[socket.socket, LineReader] = {}  # request line not complete yet
        self.children: dict[int, _Child] = {}
        self.by_ready_fd: dict[int, _Child] = {}

    def watched(self) -> list:
        return [self.lifeline, self.listener, self.wake_r, *self.pending, *self.by_ready_fd]

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        self.pending[conn] = LineReader()

    def receive(self, conn: socket.socket) -> None:
        """Read a connection's request; fork once it is whole."""
        reader = self.pending[conn]
        try:
            chunk = conn.recv(65536)
            lines = reader.feed(chunk) if chunk else []
            if not chunk:
                del self.pending[conn]
                conn.close()  # the harness gave up before asking
                return
            if not lines:
                return
            del self.pending[conn]
            if reader.pending or len(lines) > 1:
                raise ForkProtocolError("the fork request must be one line, then nothing")
            request = parse_request(lines[0])
        except (ForkProtocolError, OSError) as exc:
            self.pending.pop(conn, None)
            _send(conn, encode("error", f"bad request: {exc}"))
            conn.close()
            return
        self.fork(conn, request)

    def fork(self, conn: socket.socket, request: dict) -> None:
        try:
            ready_r, ready_w = os.pipe()
        except OSError as exc:
            _send(conn, encode("error", f"cannot make the ready pipe: {exc}"))
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM on a loaded machine: this request fails, not the server
            os.close(ready_r)
            os.close(ready_w)
            _send(conn, encode("error", f"fork failed: {exc}"))
            conn.close()
            return
        if pid == 0:
            _child(request, ready_w, [self.listener, conn, *self.pending, *self.keep,
                                      *(c.conn for c in self.children.values())],
                   [self.wake_r, self.wake_w, ready_r, *self.by_ready_fd], self.main, conn,
                   self.parent_of_children)
        os.close(ready_w)  # the child holds the only write end: EOF once it wrote or died
        child = self.children[pid] = _Child(pid, conn, ready_r)
        self.by_ready_fd[ready_r] = child
        _send(conn, encode("pid", pid))  # before anything of this child's is read: always first

    def forward_ready(self, child: _Child, *, final: bool = False) -> None:
        """Forward what the child wrote on its ready pipe; close the pipe at EOF (or `final`)."""
        fd = child.ready_fd
        if fd is None:
            return
        eof = False
        try:
            while True:
                chunk = os.read(fd, 4096)
                if not chunk:
                    eof = True
                    break
                for line in child.ready.feed(chunk):
                    _send(child.conn, encode("ready", line.decode("utf-8", "replace")))
                if not final:
                    break  # the rest on the next select: one read per wake-up
        except OSError:
            eof = True  # a pipe that cannot be read says nothing more
        except ForkProtocolError:  # an endless line: not a ready line, and nothing after it is
            child.ready.pending = b""
            eof = True
        if eof or final:
            if child.ready.pending:  # a last line without its newline
                _send(child.conn, encode("ready", child.ready.pending.decode("utf-8", "replace")))
                child.ready.pending = b""
            del self.by_ready_fd[fd]
            os.close(fd)
            child.ready_fd = None

    def reap(self) -> None:
        while True:  # adopted orphans too (`_become_subreaper`), tracked or not
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.ready_fd is not None:
                os.set_blocking(child.ready_fd, False)
                self.forward_ready(child, final=True)  # its ready line goes before its exit
            _send(child.conn, encode("exit", os.waitstatus_to_exitcode(status)))
            child.conn.close()

    def close(self, socket_path: str) -> None:
        for pid in self.children:
            # The group for what the engine started; the pid itself for a child forked so
            # recently that it has no group of its own yet (setsid): it would outlive us.
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)


def _become_subreaper() -> None:
    """Adopt the orphans of our children's groups (Linux): a SIGKILLed engine's own children
    (SGLang's scheduler and detokenizer) then go to us, reaped at once, not to init, which on
    these machines reaps every two seconds or so and so holds each stop that long."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def serve(socket_path: str, main: Callable[[list[str]], int] = engine_main, *, lifeline: int | None = None,
          announce: Callable[[str], None] | None = None, keep: list[socket.socket] = (),
          children_die_with_it: bool = False) -> int:
    """Serve fork requests on `socket_path` until `lifeline` (a file descriptor; stdin by
    default) reads EOF; 0 on a clean exit.

    Each child runs `main(argv)` (the engine's by default; SGLang's server for
    `canaries.sglang.server.fork_parent`) and exits with what it returns. `announce` says the server is
    ready (default: the ready line on stdout); `keep`: sockets every child must close;
    `children_die_with_it`: each child is SIGKILLed if this server dies (a patched parent, which its
    own parent may SIGKILL before it can stop its children)."""
    if main is engine_main:
        _warm_engine_start()
    _preload()
    # Everything imported so far is shared with every child: frozen out of the collector's
    # reach, a child's collections do not touch (and so copy) the parent's pages.
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's Ctrl-C is the harness's business
    _become_subreaper()
    lifeline = sys.stdin.fileno() if lifeline is None else lifeline
    server = _Server(socket_path, main, lifeline, list(keep), children_die_with_it)
    signal.set_wakeup_fd(server.wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    if announce is None:
        print(READY_LINE, flush=True)
    else:
        announce(READY_LINE)
    try:
        while True:
            readable, _, _ = select.select(server.watched(), [], [])
            if lifeline in readable and not os.read(lifeline, 4096):
                return 0  # the harness is gone
            if server.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(server.wake_r, 4096)
            for fd in [fd for fd in server.by_ready_fd if fd in readable]:
                server.forward_ready(server.by_ready_fd[fd])
            if server.listener in readable:
                server.accept()
            for conn in [c for c in server.pending if c in readable]:
                server.receive(conn)
            server.reap()
    finally:
        server.close(socket_path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m engine_stub.forkserver SOCKET", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
