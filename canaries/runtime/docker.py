"""The docker runtime: the engine in a container built from `docker/Dockerfile`.

Same interface as `LocalRuntime`. `start` makes sure the engine image exists (built once per
content hash of the engine's sources, from a wheelhouse in `docker/wheels`, with no network),
runs a container with `init=True`, its port published on 127.0.0.1 only, memory/CPU/PID limits,
the scenario spec bind-mounted read-only and the run directory read-write at /run-dir (so the
event log of a crashed engine stays on the host), waits until /health answers and returns the
base URL. `stop` sends SIGTERM (the engine drains), reads the exit code, writes the container's
output to `<run_dir>/engine.log` and always removes the container. Live containers are tracked,
and an `atexit` hook and a SIGTERM handler stop those the caller never got to stop; `gc()`
removes the leftovers of harnesses that died harder than that.

Command line (used by scripts/ci-docker.sh):
    python -m canaries.runtime.docker wheelhouse|build|tag|gc
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from canaries.runtime import safety
from canaries.runtime.docker_image import (
    DOCKERFILE,
    DOCKERFILE_CUDA,
    IMAGE_REPO,
    DockerUnavailable,
    ImageBuildError,
    _docker,
    build_wheelhouse,
    ensure_image,
    get_client,
    image_tag,
)
from canaries.runtime.local import serves, spec_knob, tail_text

__all__ = [
    "DockerRuntime",
    "DockerUnavailable",
    "ImageBuildError",
    "build_wheelhouse",
    "ensure_image",
    "gc",
    "get_client",
    "image_tag",
    "IMAGE_REPO",
    "LABEL",
    "RUN_LABEL",
]

LABEL = "serving-canary"              # on every container this runtime starts
RUN_LABEL = "serving-canary.run"      # the run directory's name
OWNER_LABEL = "serving-canary.owner"  # "<host>:<pid>" of the harness that started it
CONTAINER_PORT = 30000
RUN_DIR_MOUNT = "/run-dir"
ENGINE_SRC_MOUNT = "/engine-src"  # where an engine_root copy of engine_stub/ is mounted
SPEC_MOUNT_DIR = "/scenario"
# Engine knobs the runtime sets itself; the others pass through from the host's environment.
_OWN_KNOBS = {"ENGINE_STUB_HOST", "ENGINE_STUB_PORT", "ENGINE_STUB_EVENT_LOG",
              "ENGINE_STUB_SCENARIO"}


# ---- the safety net --------------------------------------------------------------------------

def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _is_leftover(container: Any) -> bool:
    """Started by a harness that is gone (or by this one, and no runtime tracks it)."""
    owner = (container.labels or {}).get(OWNER_LABEL, "")
    host, _, pid_text = owner.rpartition(":")
    if not owner or not pid_text.isdigit():
        return True
    if host != socket.gethostname():
        return False  # another machine's harness: we cannot tell whether it still runs
    pid = int(pid_text)
    if pid == os.getpid():
        live_ids = {rt.container.id for rt in safety.registered()
                    if isinstance(rt, DockerRuntime) and rt.container is not None}
        return container.id not in live_ids
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def gc(client: Any = None, *, include_live: bool = False, images: bool = False) -> int:
    """Remove containers labelled `serving-canary` that are leftovers; how many were removed.

    A leftover is a container whose harness process is gone (or that this process started and no
    runtime tracks any more). `include_live=True` removes every labelled container, in use or
    not. `images=True` also removes engine images other than the current tag.
    """
    docker = _docker()
    client = client or get_client()
    removed = 0
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        if not include_live and not _is_leftover(container):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
            removed += 1
    if images:
        keep = image_tag()
        for image in client.images.list(name=IMAGE_REPO):
            for tag in image.tags:
                if tag != keep:
                    with contextlib.suppress(docker.errors.APIError):
                        client.images.remove(tag)
    return removed


# ---- the runtime -----------------------------------------------------------------------------


def _map_exit(raw: int | None, stopped_by_us: bool) -> int | None:
    """The container's status as the local runtime reports a process's.

    With init=True the container's status is tini's: 128+N when the engine died of signal N,
    which maps to -N as for a subprocess. SIGTERM sent by `stop` and answered by the engine's
    drain-and-re-raise is a clean stop: 0 (as LocalRuntime reports it).
    """
    if raw is None:
        return None
    if stopped_by_us and raw == 128 + signal.SIGTERM:
        return 0
    if 128 < raw <= 128 + 64:
        return -(raw - 128)
    return raw


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", text).strip("-.")[:40] or "run"


class DockerRuntime:
    """One engine container. Use as a context manager; `stop()` is idempotent."""

    name = "docker"

    def __init__(self, ready_timeout: float = 30.0, *, image: str | None = None,
                 dockerfile: str = DOCKERFILE, mem_limit: str = "2g", cpus: float = 1.0,
                 pids_limit: int = 512, user: str | None = None, gpus: bool = False,
                 network: str | None = None, engine_root: str | os.PathLike | None = None) -> None:
        self.ready_timeout = ready_timeout
        # A directory holding another engine_stub/ (a mutant, a commit): bind-mounted read-only
        # over the image's on PYTHONPATH, so no image is built per copy.
        self.engine_root = Path(engine_root).resolve() if engine_root is not None else None
        self.image = image
        self.dockerfile = dockerfile
        self.mem_limit = mem_limit
        self.cpus = cpus
        self.pids_limit = pids_limit
        self.user = user
        self.gpus = gpus
        self.network = network
        self.client: Any = None
        self.container: Any = None
        self.base_url: str | None = None
        self.host_port: int | None = None
        self.run_dir: Path | None = None
        self.log_path: Path | None = None
        self.event_log: Path | None = None
        self.command: list[str] | None = None
        self.raw_exit_code: int | None = None
        self._exit_code: int | None = None
        self._stopped = False
        self._restore: tuple[int, int, int, int] | None = None  # mode, uid, gid, container uid
        self._lock = threading.Lock()

    # ---- image ---------------------------------------------------------------------------------

    def ensure_image(self, verbose: bool = False) -> str:
        """Build the engine image unless it exists (by content hash); its tag."""
        if self.client is None:
            self.client = get_client()
        self.image = ensure_image(self.client, self.dockerfile, verbose=verbose)
        return self.image

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self, spec_path: str | os.PathLike | None, run_dir: str | os.PathLike,
              extra_flags: list[str] | tuple[str, ...] = ()) -> str:
        """Run the engine's container and return its base URL once /health answers.

        Raises DockerUnavailable when no engine is reachable, ImageBuildError when the image
        cannot be built, RuntimeError with the engine output's tail if it exits or is not ready
        in time.
        """
        if self.container is not None:
            raise RuntimeError("this runtime already started an engine")
        docker = _docker()
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.log_path = run_dir / "engine.log"
        self.event_log = run_dir / "events.jsonl"
        if self.client is None:
            self.client = get_client()
        if spec_knob("device", spec_path, extra_flags) == "cuda":
            # A CUDA engine: the CUDA image, and the host's GPUs handed to the container.
            if self.dockerfile == DOCKERFILE:
                self.dockerfile = DOCKERFILE_CUDA
            self.gpus = True
        if self.image is None:
            self.ensure_image()
        assert self.image is not None

        volumes = {str(run_dir): {"bind": RUN_DIR_MOUNT, "mode": "rw"}}
        cmd: list[str] = []
        if spec_path is not None:
            spec = Path(spec_path).resolve()
            if not spec.is_file():  # docker would bind-mount a fresh empty directory instead
                raise RuntimeError(f"the scenario spec {spec} does not exist")
            target = f"{SPEC_MOUNT_DIR}/{spec.name}"
            volumes[str(spec)] = {"bind": target, "mode": "ro"}
            cmd += ["--scenario", target]
        cmd += ["--host", "0.0.0.0", "--port", str(CONTAINER_PORT),
                "--event-log", f"{RUN_DIR_MOUNT}/events.jsonl", *extra_flags]
        self.command = cmd

        user = self.user
        if user is None and os.getuid() != 0:
            user = f"{os.getuid()}:{os.getgid()}"  # files in the run dir belong to the host user
        if user is None:
            # A root host: the engine runs as the image's non-root user, which needs to write to
            # the run dir and read the spec; `stop` hands the files back to the run dir's owner.
            self._open_run_dir(run_dir, spec_path)

        env = {k: v for k, v in os.environ.items()
               if k.startswith("ENGINE_STUB_") and k not in _OWN_KNOBS}
        threads = str(max(1, math.ceil(self.cpus)))
        env.update({"PYTHONUNBUFFERED": "1", "HOME": "/tmp", "OMP_NUM_THREADS": threads})
        if self.engine_root is not None:
            source = self.engine_root / "engine_stub"
            if not source.is_dir():
                raise RuntimeError(f"engine_root {self.engine_root} holds no engine_stub/ package")
            volumes[str(source)] = {"bind": f"{ENGINE_SRC_MOUNT}/engine_stub", "mode": "ro"}
            env["PYTHONPATH"] = ENGINE_SRC_MOUNT
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        kwargs: dict[str, Any] = {
            "image": self.image, "command": cmd, "detach": True, "init": True,
            "name": f"serving-canary-{_slug(run_dir.name)}-{secrets.token_hex(3)}",
            "labels": {LABEL: "1", RUN_LABEL: run_dir.name, OWNER_LABEL: _owner()},
            "ports": {f"{CONTAINER_PORT}/tcp": ("127.0.0.1", None)},
            "volumes": volumes, "environment": env,
            "mem_limit": self.mem_limit, "memswap_limit": self.mem_limit,
            "nano_cpus": int(self.cpus * 1e9), "pids_limit": self.pids_limit,
            "read_only": True, "tmpfs": {"/tmp": "rw,size=256m,mode=1777"},
            "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"],
        }
        if user is not None:
            kwargs["user"] = user
        if self.network:
            kwargs["network"] = self.network
        if self.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1,
                                                                    capabilities=[["gpu"]])]
        safety.install_sigterm_handler()
        try:
            self.container = self.client.containers.create(**kwargs)
        except BaseException:
            self._restore_run_dir()
            raise
        safety.register(self)
        try:
            self.container.start()
            self.host_port = self._published_port()
            self.base_url = f"http://127.0.0.1:{self.host_port}"
            self._wait_healthy()
        except BaseException:
            self.stop(timeout=2)
            raise
        return self.base_url

    def _open_run_dir(self, run_dir: Path, spec_path: str | os.PathLike | None) -> None:
        """Lend the run dir to the container's user for the run: that user owns it and no one
        else may write to it (root on the host still reads it and cleans up);
        `_restore_run_dir` hands it back."""
        st = run_dir.stat()
        container_uid = 10001
        with contextlib.suppress(Exception):
            user = self.client.images.get(self.image).attrs["Config"].get("User") or ""
            if user.split(":")[0].isdigit():
                container_uid = int(user.split(":")[0])
        self._restore = (st.st_mode & 0o7777, st.st_uid, st.st_gid, container_uid)
        try:
            os.chown(run_dir, container_uid, -1)
            os.chmod(run_dir, (st.st_mode & 0o755) | 0o700)  # never group- or world-writable
        except OSError as exc:
            self._restore_run_dir()
            raise RuntimeError(f"cannot lend the run dir {run_dir} to the container's user "
                               f"{container_uid}: {exc}") from exc
        if spec_path is not None:
            spec = Path(spec_path)
            with contextlib.suppress(OSError):
                if not spec.stat().st_mode & 0o004:
                    os.chmod(spec, spec.stat().st_mode | 0o444)

    def _restore_run_dir(self) -> None:
        """The run dir's owner and mode as before the run; what the container wrote in it
        belongs to the run dir's owner."""
        if self._restore is None or self.run_dir is None:
            return
        mode, uid, gid, container_uid = self._restore
        self._restore = None
        with contextlib.suppress(OSError):
            os.chown(self.run_dir, uid, gid)
            os.chmod(self.run_dir, mode)
        try:
            paths = list(self.run_dir.rglob("*"))
        except OSError:
            paths = []
        for path in paths:
            with contextlib.suppress(OSError):
                if path.lstat().st_uid == container_uid:
                    os.lchown(path, uid, gid)

    def _published_port(self) -> int:
        deadline = time.monotonic() + 10
        while True:
            self.container.reload()
            bindings = (self.container.attrs.get("NetworkSettings", {}).get("Ports") or {}) \
                .get(f"{CONTAINER_PORT}/tcp")
            if bindings:
                return int(bindings[0]["HostPort"])
            if self.container.status in ("exited", "dead") or time.monotonic() > deadline:
                raise RuntimeError(self._exited_message("before its port was published"))
            time.sleep(0.02)

    def _exited_message(self, when: str) -> str:
        state = (self.container.attrs or {}).get("State", {})
        code = _map_exit(state.get("ExitCode"), False) if state.get("Status") == "exited" \
            else None
        what = f"the engine exited with code {code}" if code is not None \
            else f"the engine's container is {state.get('Status', 'gone')}"
        return f"{what} {when}; log tail (container {self.container.name}):\n{self.log_tail()}"

    def _wait_healthy(self) -> None:
        assert self.base_url is not None
        deadline = time.monotonic() + self.ready_timeout
        while not serves(self.base_url):
            self.container.reload()
            if self.container.status in ("exited", "dead"):
                raise RuntimeError(self._exited_message("before it was ready"))
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the engine was not ready within {self.ready_timeout:.0f}s; "
                                   f"log tail (container {self.container.name}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    # ---- state ---------------------------------------------------------------------------------

    def poll(self) -> int | None:
        """The exit code if the engine has exited, else None."""
        container = self.container
        if container is None or self._stopped:
            return self._exit_code
        try:
            container.reload()
        except Exception:  # noqa: BLE001 - gone, or the engine went away
            return self._exit_code
        if container.status in ("exited", "dead"):
            self.raw_exit_code = container.attrs.get("State", {}).get("ExitCode")
            self._exit_code = _map_exit(self.raw_exit_code, False)
            return self._exit_code
        return None

    @property
    def running(self) -> bool:
        return self.container is not None and not self._stopped and self.poll() is None

    @property
    def pid(self) -> int | None:
        """The host PID of the container's init (tini), or None."""
        if self.container is None or self._stopped:
            return None
        with contextlib.suppress(Exception):
            self.container.reload()
        pid = (self.container.attrs or {}).get("State", {}).get("Pid")
        return pid or None

    @property
    def exit_code(self) -> int | None:
        """The engine's exit status (negative: killed by that signal); None while it runs."""
        return self.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the engine to exit by itself; its code, or None on timeout."""
        container = self.container
        if container is None or self._stopped:
            return self._exit_code
        import requests

        try:
            result = container.wait(timeout=timeout)
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
            return None
        except Exception:  # noqa: BLE001 - removed meanwhile
            return self._exit_code
        self.raw_exit_code = result.get("StatusCode")
        self._exit_code = _map_exit(self.raw_exit_code, False)
        return self._exit_code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the container's init (it forwards all but SIGKILL to the engine)."""
        if self.container is not None and not self._stopped:
            with contextlib.suppress(Exception):
                self.container.kill(signal=int(sig))

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; save the log, remove the container;
        return the exit code. Idempotent."""
        with self._lock:
            container = self.container
            if container is None or self._stopped:
                return self._exit_code
            try:
                raw = None
                stopped_by_us = False
                try:
                    container.reload()
                    if container.status in ("running", "paused", "restarting"):
                        stopped_by_us = True
                        container.stop(timeout=max(1, math.ceil(timeout)))
                    if container.status != "created":
                        raw = container.wait(timeout=timeout + 30).get("StatusCode")
                except Exception:  # noqa: BLE001 - gone or unresponsive: removal below
                    raw = self.raw_exit_code
                self.raw_exit_code = raw
                self._exit_code = _map_exit(raw, stopped_by_us)
                self._save_log()
            finally:
                self._stopped = True
                with contextlib.suppress(Exception):
                    container.remove(force=True)
                safety.unregister(self)
                self._restore_run_dir()
            return self._exit_code

    def _save_log(self) -> None:
        if self.log_path is None:
            return
        with contextlib.suppress(Exception):
            data = self.container.logs(stdout=True, stderr=True)
            self.log_path.write_bytes(data)

    def log_tail(self, lines: int = 30) -> str:
        if self.container is not None and not self._stopped:
            with contextlib.suppress(Exception):
                return tail_text(self.container.logs(tail=lines).decode("utf-8", "replace"),
                                 lines)
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                return tail_text(self.log_path.read_text(encoding="utf-8", errors="replace"),
                                 lines)
        return "(no engine log)"

    def __enter__(self) -> DockerRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m canaries.runtime.docker",
                                     description="The docker runtime's set-up steps.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheelhouse", help="make docker/wheels (torch CPU + runtime deps)")
    build = sub.add_parser("build", help="build the engine image unless it exists; print its tag")
    build.add_argument("--force", action="store_true", help="build even if the tag exists")
    build.add_argument("--dockerfile", default=DOCKERFILE)
    sub.add_parser("tag", help="print the engine image's tag for the current sources")
    clean = sub.add_parser("gc", help="remove leftover serving-canary containers")
    clean.add_argument("--all", action="store_true", help="also containers of live harnesses")
    clean.add_argument("--images", action="store_true", help="also stale engine images")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.cmd == "wheelhouse":
            path = build_wheelhouse()
            size = sum(p.stat().st_size for p in path.glob("*.whl")) / 1e6
            print(f"wheelhouse {path}: {len(list(path.glob('*.whl')))} wheels, {size:.0f} MB "
                  f"({time.monotonic() - t0:.1f}s)", file=sys.stderr)
        elif args.cmd == "build":
            tag = ensure_image(dockerfile=args.dockerfile, verbose=True, force=args.force)
            print(f"image {tag} ready ({time.monotonic() - t0:.1f}s)", file=sys.stderr)
            print(tag)
        elif args.cmd == "tag":
            print(image_tag())
        elif args.cmd == "gc":
            print(f"removed {gc(include_live=args.all, images=args.images)} container(s)")
    except (DockerUnavailable, ImageBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
