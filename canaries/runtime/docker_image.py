"""The engine image for the docker runtime: the Docker client, the wheelhouse, and the image
built once per content hash of the engine's sources (`docker/Dockerfile`, no network).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "DOCKERFILE",
    "DOCKERFILE_CUDA",
    "DockerUnavailable",
    "ImageBuildError",
    "IMAGE_REPO",
    "build_wheelhouse",
    "ensure_image",
    "get_client",
    "image_tag",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = "docker/Dockerfile"
DOCKERFILE_CUDA = "docker/Dockerfile.cuda"
WHEELHOUSE = REPO_ROOT / "docker" / "wheels"
IMAGE_REPO = "serving-canary-engine"
# The torch build the image carries: the CPU build on these machines' disk. Never a bare `torch`
# (PyPI's is a multi-GB CUDA build).
TORCH_VERSION = "2.13.0"
TORCH_CPU_PIN = f"torch=={TORCH_VERSION}+cpu"
BUILD_REQUIRES = ("setuptools>=68",)
# The target of the wheelhouse: the base image's CPython 3.11 on x86_64 glibc.
WHEEL_TARGET = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64")

_START_HINT = ("start one: as root run scripts/ci-docker.sh (it installs docker.io if needed "
               "and starts dockerd), or `dockerd &`; or point DOCKER_HOST at a running engine")


class DockerUnavailable(RuntimeError):
    """No Docker engine can be reached (or the docker SDK is missing); the message says why."""


class ImageBuildError(RuntimeError):
    """The engine image could not be built; the message carries the build output's tail."""


# ---- the engine (daemon) ---------------------------------------------------------------------


def _docker():
    try:
        import docker
    except ImportError:
        raise DockerUnavailable("the docker SDK is not installed: pip install 'docker>=7.0' "
                                "(or the project's [docker] extra)") from None
    return docker


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def get_client(timeout: float = 120.0):
    """A docker client whose engine answers `ping`, else `DockerUnavailable` with the reason."""
    docker = _docker()
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if where.startswith("unix://"):
        # Check the socket first: the SDK leaks its socket when the connection fails.
        path = where[len("unix://"):]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            try:
                sock.connect(path)
            except OSError as exc:
                raise DockerUnavailable(
                    f"no Docker engine is reachable at {where}: cannot connect to {path}: "
                    f"{exc.strerror or exc}; {_START_HINT}") from None
    try:
        client = docker.from_env(timeout=int(timeout))
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure here means "no engine"
        raise DockerUnavailable(f"no Docker engine is reachable at {where}: {_reason(exc)}; "
                                f"{_START_HINT}") from None
    return client


# ---- the image -------------------------------------------------------------------------------


def _hashed_files(dockerfile: str = DOCKERFILE) -> list[Path]:
    files = [p for p in (REPO_ROOT / "engine_stub").rglob("*.py") if "__pycache__" not in p.parts]
    files += [REPO_ROOT / "pyproject.toml", REPO_ROOT / dockerfile, REPO_ROOT / ".dockerignore"]
    return sorted(files)


def image_tag(dockerfile: str = DOCKERFILE) -> str:
    """`serving-canary-engine:<hash>`: a content hash of what goes into the image.

    Hashed: engine_stub/**/*.py, pyproject.toml, the Dockerfile and .dockerignore (a change in
    any of them makes a new tag, hence a rebuild; anything else reuses the image).
    """
    digest = hashlib.sha256()
    for path in _hashed_files(dockerfile):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
        digest.update(b"\0")
    return f"{IMAGE_REPO}:{digest.hexdigest()[:16]}"


def _runtime_requirements() -> list[str]:
    """The project's runtime deps but torch, pinned to the versions this host runs when it has
    them (so the engine in the image runs what the tests run), else as pyproject states them."""
    from importlib import metadata

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None  # type: ignore[assignment]
    specs = ["fastapi>=0.110", "uvicorn>=0.29", "pydantic>=2.6", "PyYAML>=6.0", "requests>=2.31"]
    if tomllib is not None:
        with open(REPO_ROOT / "pyproject.toml", "rb") as f:
            specs = list(tomllib.load(f)["project"]["dependencies"])
    pinned = []
    for spec in specs:
        name = re.match(r"[A-Za-z0-9_.-]+", spec.strip()).group(0)  # type: ignore[union-attr]
        if name.lower() == "torch":
            continue
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(spec.strip())
    return pinned


def build_wheelhouse(dest: str | os.PathLike = WHEELHOUSE, quiet: bool = True) -> Path:
    """Fill `dest` (docker/wheels) with cp311/manylinux wheels of torch 2.13.0 (CPU), the
    runtime deps and the build backend, and write `dest/requirements.txt` for the Dockerfile.

    Runs `pip download` on the host, which takes the torch CPU build from its local wheel folder.
    Only `torch==2.13.0+cpu` is asked for: where no CPU build is available it fails instead of
    fetching a CUDA build.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    runtime = _runtime_requirements()
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
           "--dest", str(dest), "--only-binary=:all:", *WHEEL_TARGET,
           TORCH_CPU_PIN, *runtime, *BUILD_REQUIRES]
    if quiet:
        cmd.insert(4, "--quiet")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise ImageBuildError(
            f"the wheelhouse step failed (exit {proc.returncode}): {' '.join(cmd[3:])}\n{tail}\n"
            f"It needs the torch {TORCH_VERSION} CPU wheel where pip finds it (a find-links "
            f"folder) and the package registry for the other deps.")
    torch_wheels = sorted(dest.glob(f"torch-{TORCH_VERSION}*.whl"))
    if not torch_wheels or any("+cpu" not in w.name for w in torch_wheels):
        raise ImageBuildError(f"the wheelhouse {dest} must hold only the torch {TORCH_VERSION} "
                              f"CPU build, found: {[w.name for w in torch_wheels]}")
    reqs = dest / "requirements.txt"
    tmp = reqs.with_suffix(".tmp")
    tmp.write_text("# written by canaries.runtime.docker.build_wheelhouse; do not edit\n"
                   + "\n".join([f"torch=={TORCH_VERSION}", *runtime]) + "\n", encoding="utf-8")
    tmp.replace(reqs)
    return dest


_BUILD_LOCK = threading.Lock()


def _base_image(dockerfile: str) -> str | None:
    try:
        text = (REPO_ROOT / dockerfile).read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"^ARG\s+BASE_IMAGE=(\S+)", text, re.M)
    return match.group(1) if match else None


def ensure_image(client: Any = None, dockerfile: str = DOCKERFILE, *, verbose: bool = False,
                 force: bool = False) -> str:
    """The engine image's tag; builds it first unless an image with that tag exists.

    The build uses the repository root as its context (see .dockerignore), `pull=False` and
    `network_mode="none"`; the wheelhouse is made first when docker/wheels lacks it.
    """
    docker = _docker()
    with _BUILD_LOCK:
        client = client or get_client()
        tag = image_tag(dockerfile)
        if not force:
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.get(tag)
                return tag
        base = _base_image(dockerfile)
        hint = ""
        if base:
            try:
                client.images.get(base)
            except docker.errors.ImageNotFound:
                # The build will try to pull it; where no registry is reachable that fails.
                hint = (f"\nThe base image {base} is not here and the build could not pull it: "
                        f"make the local stand-in with docker/make-base-image.sh (as root), or "
                        f"run scripts/ci-docker.sh")
        if not (WHEELHOUSE / "requirements.txt").exists():
            print(f"canary: making the wheelhouse in {WHEELHOUSE} ...", file=sys.stderr,
                  flush=True)
            build_wheelhouse()
        print(f"canary: building the engine image {tag} (once per engine source change) ...",
              file=sys.stderr, flush=True)
        lines: list[str] = []
        try:
            for chunk in client.api.build(path=str(REPO_ROOT), dockerfile=dockerfile, tag=tag,
                                          pull=False, network_mode="none", rm=True,
                                          forcerm=True, decode=True,
                                          labels={"serving-canary.image": "1"}):
                if "error" in chunk:
                    lines.append(str(chunk["error"]).rstrip())
                    raise ImageBuildError(f"building {tag} failed:\n" + "\n".join(lines[-30:])
                                          + hint)
                text = chunk.get("stream")
                if text:
                    lines.extend(text.rstrip("\n").splitlines())
                    if verbose:
                        sys.stderr.write(text)
        except docker.errors.APIError as exc:
            raise ImageBuildError(f"building {tag} failed: {_reason(exc)}\n"
                                  + "\n".join(lines[-30:]) + hint) from None
        try:
            client.images.get(tag)
        except docker.errors.ImageNotFound:
            raise ImageBuildError(f"the build reported no error but {tag} does not exist:\n"
                                  + "\n".join(lines[-30:])) from None
        return tag
