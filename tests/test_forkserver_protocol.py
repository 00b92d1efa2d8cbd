"""The fork server's protocol: every message reaches the harness whole, typed and in order.

The race of issue 25: the forked engine used to write its ready line on the connection the
server answers on, so a server descheduled between fork and its pid line let the ready line
arrive first, and the harness failed with a JSONDecodeError. These tests delay the server's pid
line on purpose (a wrapper around the real server) so that ordering is exercised every time.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from canaries.runtime.warm import ForkServer, ForkServerMismatch
from engine_stub.forkproto import ForkProtocolError, LineReader, parse_message

REPO = Path(__file__).resolve().parents[1]

DELAYED_SERVER = textwrap.dedent("""
    import json, sys, time
    import engine_stub.forkserver as server

    send = server._send

    def send_pid_late(conn, message):
        # a dict before the protocol had types, its encoded line since
        text = message.decode() if isinstance(message, bytes) else json.dumps(message)
        if '"pid"' in text:
            time.sleep({delay})  # the forked engine is ready long before this
        send(conn, message)

    server._send = send_pid_late
    sys.exit(server.serve(sys.argv[-1]))
""")


def _python_running(tmp_path: Path, script: str) -> str:
    """An executable standing in for `python` that runs `script` whatever module it is asked for."""
    source = tmp_path / "server.py"
    source.write_text(script, encoding="utf-8")
    shim = tmp_path / "python"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {source} \"$@\"\n", encoding="utf-8")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return str(shim)


def _engine_argv(tmp_path: Path) -> list[str]:
    return ["--port", "0", "--event-log", str(tmp_path / "events.jsonl")]


@pytest.mark.slow
def test_spawn_with_a_late_pid_line_gets_the_pid_then_the_ready_line(tmp_path):
    server = ForkServer(python=_python_running(tmp_path, DELAYED_SERVER.format(delay=2.0)))
    try:
        proc = server.spawn(_engine_argv(tmp_path), dict(os.environ), tmp_path / "engine.log")
        ready = proc.wait_ready(30)
        assert ready is not None and ready.startswith("engine_stub ready on http://"), ready
        assert proc.pid > 0 and Path(f"/proc/{proc.pid}").exists()
        os.killpg(proc.pid, 15)
        assert proc.wait(30) in (0, -15)
    finally:
        server.close()


@pytest.mark.slow
def test_engine_that_dies_before_its_pid_line_reads_as_its_exit_code(tmp_path):
    server = ForkServer(python=_python_running(tmp_path, DELAYED_SERVER.format(delay=1.0)))
    try:
        proc = server.spawn(["--no-such-flag"], dict(os.environ), tmp_path / "engine.log")
        assert proc.wait_ready(30) is None  # it exited (argparse: 2) long before its pid was sent
        assert proc.wait(30) == 2
        assert "--no-such-flag" in (tmp_path / "engine.log").read_text(encoding="utf-8")
    finally:
        server.close()


@pytest.mark.slow
def test_spawn_with_a_malformed_request_is_refused_naming_the_field(tmp_path):
    server = ForkServer()
    try:
        with pytest.raises(RuntimeError, match="'env' must map strings to strings"):
            server.spawn(_engine_argv(tmp_path), {"OMP_NUM_THREADS": 1}, tmp_path / "engine.log")  # type: ignore[dict-item]
        assert server.alive  # one bad request costs that request only
        proc = server.spawn(_engine_argv(tmp_path), dict(os.environ), tmp_path / "engine.log")
        assert proc.wait_ready(30) is not None
        os.killpg(proc.pid, 9)
        assert proc.wait(30) == -9
    finally:
        server.close()


def test_fork_server_of_another_protocol_is_refused_as_a_mismatch(tmp_path):
    old = _python_running(tmp_path, "import sys\nprint('engine_stub forkserver ready', flush=True)\n"
                                    "sys.stdin.read()\n")
    with pytest.raises(ForkServerMismatch, match="speaks another protocol"):
        ForkServer(python=old)


SLOW_SETSID_SERVER = textwrap.dedent("""
    import os, sys, time
    import engine_stub.__main__ as engine_main
    import engine_stub.forkserver as server

    # Its ready line would go to a pipe nobody reads once the server is gone (SIGPIPE kills
    # it there): without it, only the server's own cleanup can take the child along.
    engine_main._notify_ready = lambda line: None
    setsid = os.setsid

    def setsid_late():
        time.sleep({delay})  # the child is still in the server's process group meanwhile
        setsid()

    os.setsid = setsid_late  # only a forked child calls it
    sys.exit(server.serve(sys.argv[-1]))
""")


@pytest.mark.slow
def test_server_that_exits_right_after_a_fork_takes_the_child_along(tmp_path):
    server = ForkServer(python=_python_running(tmp_path, SLOW_SETSID_SERVER.format(delay=1.5)))
    proc = server.spawn(_engine_argv(tmp_path), dict(os.environ), tmp_path / "engine.log")
    server.close()  # before the child has a process group of its own
    deadline = time.monotonic() + 10
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(proc.pid), "a child forked just before the server exited outlived it"


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_line_reader_joins_partial_reads_into_whole_lines():
    reader = LineReader()
    assert reader.feed(b'{"type": "pi') == []
    assert reader.feed(b'd", "pid": 7}\n{"type": "ready", "line": "x"}\n{"ty') == [
        b'{"type": "pid", "pid": 7}', b'{"type": "ready", "line": "x"}']
    assert reader.feed(b'pe": "exit", "code": 0}\n') == [b'{"type": "exit", "code": 0}']
    assert reader.pending == b""


@pytest.mark.parametrize("raw, named", [
    (b"engine_stub ready on http://127.0.0.1:1", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"pid": 3}', "no 'type'"),
    (b'{"type": "hello"}', "unknown message type 'hello'"),
    (b'{"type": "pid", "pid": "3"}', "'pid' must be of type int"),
    (b'{"type": "exit"}', "'code' must be of type int"),
    (b'{"type": "ready", "line": 5}', "'line' must be of type str"),
])
def test_parse_message_refuses_a_malformed_line_naming_what_came(raw, named):
    with pytest.raises(ForkProtocolError) as caught:
        parse_message(raw)
    assert named in str(caught.value)
    assert repr(raw.decode())[:40] in str(caught.value)


def test_line_reader_refuses_an_endless_line():
    reader = LineReader(max_line=16)
    with pytest.raises(ForkProtocolError, match="longer than 16 bytes"):
        reader.feed(b"x" * 17)


ORPHANING_SERVER = textwrap.dedent("""
    import os, sys, time
    import engine_stub.forkserver as server

    def main(argv):
        # an engine with a child of its own (as SGLang's launcher has its scheduler)
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        with open(argv[0], "w") as f:
            f.write(str(pid))
        time.sleep(120)
        return 0

    sys.exit(server.serve(sys.argv[-1], main=main))
""")


@pytest.mark.slow
def test_engine_killed_before_its_child_leaves_the_child_to_the_fork_server(tmp_path):
    """The orphan goes to the fork server, which reaps it as soon as it dies, not to init (which
    on these machines reaps every two seconds or so, and so held every SGLang server's stop)."""
    server = ForkServer(python=_python_running(tmp_path, ORPHANING_SERVER))
    try:
        pid_file = tmp_path / "grandchild"
        proc = server.spawn([str(pid_file)], dict(os.environ), tmp_path / "engine.log")
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text(encoding="ascii").strip()):
            assert time.monotonic() < deadline, "the engine never forked its child"
            time.sleep(0.05)
        grandchild = int(pid_file.read_text(encoding="ascii"))
        os.kill(proc.pid, 9)
        assert proc.wait(30) == -9
        parent = int(Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == server.proc.pid
        os.kill(grandchild, 9)
        while Path(f"/proc/{grandchild}").exists():  # reaped by the fork server, never a zombie left
            assert time.monotonic() < deadline, "the fork server did not reap its adopted orphan"
            time.sleep(0.05)
    finally:
        server.close()
