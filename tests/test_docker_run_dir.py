"""The docker runtime's run directory on a root host: writable by the container's user during the
run, never by everyone, and handed back to its owner afterwards.

No Docker engine is needed: a stand-in client plays the container. Its "engine" writes the event
log as uid 10001 through a directory descriptor, which is what a bind mount amounts to (the
container never walks the host path above the run dir).
"""

from __future__ import annotations

import http.server
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from canaries.runtime.docker import RUN_DIR_MOUNT, DockerRuntime

CONTAINER_UID = 10001
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

pytestmark = pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None,
                                reason="needs root (the run dir is chowned) and /usr/bin/python3")

WRITE_EVENTS = """\
import os, sys
fd = os.open("events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644,
             dir_fd=int(sys.argv[1]))
os.write(fd, b'{"seq": 1, "kind": "engine_start"}\\n')
os.close(fd)
"""


def _write_as_container_user(run_dir: Path) -> subprocess.CompletedProcess:
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return subprocess.run([SYSTEM_PYTHON, "-I", "-c", WRITE_EVENTS, str(fd)],
                              user=CONTAINER_UID, group=CONTAINER_UID, extra_groups=[],
                              pass_fds=(fd,),
                              capture_output=True, text=True, timeout=30, check=False)
    finally:
        os.close(fd)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


class _Container:
    """Plays a container: on start it looks at the run dir and writes the event log."""

    def __init__(self, kwargs: dict, port: int) -> None:
        self.kwargs = kwargs
        self.name = kwargs["name"]
        self.port = port
        self.status = "created"
        self.attrs: dict = {"State": {"Status": "created"}}
        self.seen: dict = {}

    def start(self) -> None:
        run_dir = Path(next(src for src, m in self.kwargs["volumes"].items()
                            if m["bind"] == RUN_DIR_MOUNT))
        st = run_dir.stat()
        self.seen.update(mode=stat.S_IMODE(st.st_mode), uid=st.st_uid,
                         write=_write_as_container_user(run_dir))
        self.status = "running"
        self.attrs = {"State": {"Status": "running", "Pid": 0},
                      "NetworkSettings": {"Ports": {"30000/tcp": [{"HostPort": str(self.port)}]}}}

    def reload(self) -> None:
        pass

    def stop(self, timeout: int = 10) -> None:
        self.status = "exited"
        self.attrs["State"] = {"Status": "exited", "ExitCode": 0}

    def wait(self, timeout: float | None = None) -> dict:
        return {"StatusCode": 0}

    def logs(self, **kwargs) -> bytes:
        return b"engine_stub ready\n"

    def remove(self, force: bool = False) -> None:
        self.status = "removed"


class _Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.created: list[_Container] = []
        client = self

        class Images:
            def get(self, name: str):
                return type("Image", (), {"attrs": {"Config": {"User": f"{CONTAINER_UID}:"
                                                                        f"{CONTAINER_UID}"}}})()

        class Containers:
            def create(self, **kwargs) -> _Container:
                container = _Container(kwargs, client.port)
                client.created.append(container)
                return container

        self.images = Images()
        self.containers = Containers()


@pytest.fixture
def health_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_run_dir_is_writable_by_the_container_user_but_not_by_everyone(tmp_path, health_port):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    client = _Client(health_port)
    rt = DockerRuntime(image="serving-canary-engine:test")
    rt.client = client
    rt.start(spec, run_dir)
    try:
        (container,) = client.created
        assert container.seen["write"].returncode == 0, container.seen["write"].stderr
        assert container.seen["mode"] & 0o022 == 0, oct(container.seen["mode"])
    finally:
        assert rt.stop() == 0

    st = run_dir.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    events = run_dir / "events.jsonl"
    assert events.stat().st_uid == 0 and "engine_start" in events.read_text()
    assert (run_dir / "engine.log").read_text() == "engine_stub ready\n"
