"""A warm parent for engines: torch and the engine imported once, each engine a fork of it.

    python -m engine_stub.forkserver SOCKET

imports what `python -m engine_stub` needs (it never touches a CUDA device), listens on the Unix
socket SOCKET and prints `engine_stub forkserver ready`. Each connection asks for one engine with
one JSON line `{"argv": [...], "env": {...}, "cwd": ..., "log": ...}`. The server forks a child
that starts a session of its own (its pid is its process group, so a harness signals it exactly
as it would a fresh process), reads stdin from /dev/null, writes stdout and stderr to `log`, and
runs `engine_stub.__main__.main(argv)` under `env`. On the connection the server answers
`{"pid": N}` at once and `{"exit": CODE}` when the child exits (negative: killed by that
signal, as `subprocess` reports it); the child itself writes its ready line there.

The server lives as long as its stdin: when the harness that started it exits, however it dies,
the pipe closes and the server SIGKILLs every child's group before it exits, so no engine
outlives its harness.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import traceback

import torch  # noqa: F401 - imported once here, so that every forked engine starts warm

import engine_stub.engine  # noqa: F401
import engine_stub.perturb.loader  # noqa: F401
import engine_stub.server  # noqa: F401
from engine_stub.__main__ import READY_FD_ENV
from engine_stub.__main__ import main as engine_main

__all__ = ["READY_LINE", "serve"]

READY_LINE = "engine_stub forkserver ready"
PRELOAD_ENV = "ENGINE_STUB_FORKSERVER_PRELOAD"


def _child(request: dict, conn: socket.socket, closing: list, fds: tuple[int, ...]) -> None:
    """In the forked child: become a fresh-looking engine process, run it, never return."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        for sock in closing:
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
        os.environ.update(request.get("env") or {})
        # The engine writes its ready line to this fd too: the harness learns of it at once.
        os.environ[READY_FD_ENV] = str(conn.fileno())
        os.set_inheritable(conn.fileno(), False)
        code = engine_main(list(request["argv"]))
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


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(message) + "\n").encode())


def _preload() -> None:
    """Import the extra modules the harness named (e.g. SGLang's allocator: seconds to import)."""
    for name in filter(None, os.environ.pop(PRELOAD_ENV, "").split(",")):
        try:
            if importlib.util.find_spec(name) is None:  # not in this release: nothing to warm
                continue
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the engine reports it where it needs the module
            print(f"engine_stub forkserver: could not preload {name}: {exc}", file=sys.stderr)


def serve(socket_path: str) -> int:
    """Serve fork requests on `socket_path` until stdin closes; 0 on a clean exit."""
    _preload()
    # Everything imported so far is shared with every child: frozen out of the collector's
    # reach, a child's collections do not touch (and so copy) the parent's pages.
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's Ctrl-C is the harness's business
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> its connection
    pending: dict[socket.socket, bytes] = {}  # connections whose request line is incomplete
    print(READY_LINE, flush=True)
    try:
        while True:
            readable, _, _ = select.select([sys.stdin, listener, wake_r, *pending], [], [])
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
                return 0  # the harness is gone
            if wake_r in readable:
                os.read(wake_r, 4096)
            if listener in readable:
                conn, _ = listener.accept()
                pending[conn] = b""
            for conn in [c for c in pending if c in readable]:
                chunk = conn.recv(65536)
                if not chunk:
                    pending.pop(conn).close()
                    continue
                pending[conn] += chunk
                if b"\n" not in pending[conn]:
                    continue
                line = pending.pop(conn).split(b"\n", 1)[0]
                try:
                    request = json.loads(line)
                except ValueError as exc:
                    _send(conn, {"error": f"bad request: {exc}"})
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, conn, [listener, *pending, *children.values()], (wake_r, wake_w))
                children[pid] = conn
                _send(conn, {"pid": pid})
            _reap(children)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m engine_stub.forkserver SOCKET", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
