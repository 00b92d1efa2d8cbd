"""The import closure resolver: what an SGLang candidate needs installed for the project to import
it on a CPU torch, found by the tool instead of by hand.

Runs inside the target venv (torch 2.13.0+cpu already there; scripts/make-sglang-venv.sh calls
`python -m canaries.sglang.releases.closure`), stdlib only. Steps:

1. install sglang itself with `--no-deps` (its metadata asks for the whole GPU stack): from the
   index, a wheel, or a source tree linked in place;
2. with a lock for this exact candidate: install it `--no-deps`, run the import check, done;
3. otherwise resolve: install the nearest release's lock as a first guess (each pin replaced by
   the version sglang's own metadata pins, and dropped where it breaks sglang's requirement),
   then loop on the import check (import_check.py): a missing module installs its
   distribution (the version sglang pins, else the guess's, else the newest that satisfies
   sglang and what is installed) with its dependencies; a version conflict named in an error
   (`X>=a is required ... but found X==b`) installs what it names; any other failure inside a
   distribution tries that distribution's other versions, newest first, a few at most;
4. the closure the check imported becomes the lock: every distribution whose modules were
   imported, pinned at what is installed, with the modules it provides and its first importer.

torch never moves: every pip call carries `torch==2.13.0` as a constraint, and a venv whose
torch changed anyway is refused. A candidate whose closure cannot be found fails with one line
saying which import failed and why.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.locks import Lock, LockPin, nearest_lock, normalize, read_lock
from canaries.sglang.releases.provenance import file_sha256
from canaries.sglang.releases.source import SGLangSource

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
except ImportError:  # a venv where nothing brought packaging yet: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import InvalidVersion, Version

__all__ = ["ClosureError", "Resolution", "main", "resolve"]

TORCH_PIN = "torch==2.13.0"
# Distributions the resolver never installs: the torch build is fixed, and these are the GPU
# stack a CPU venv must not pull in.
NEVER = re.compile(r"^(torch|torchaudio|nvidia-.*|cuda-.*|flashinfer.*|sglang-kernel|sgl-.*|triton-.*)$")
# Top-level modules whose distribution is not named like them.
MODULE_DISTS = {
    "yaml": "pyyaml", "zmq": "pyzmq", "PIL": "pillow", "IPython": "ipython", "attr": "attrs",
    "tvm_ffi": "apache-tvm-ffi", "dateutil": "python-dateutil", "google": "protobuf",
    "cv2": "opencv-python-headless", "sklearn": "scikit-learn", "jwt": "pyjwt",
    "multipart": "python-multipart", "dotenv": "python-dotenv", "pkg_resources": "setuptools",
    "setuptools": "setuptools", "_cffi_backend": "cffi", "charset_normalizer": "charset-normalizer",
    "typing_extensions": "typing-extensions", "huggingface_hub": "huggingface-hub",
}
MAX_STEPS = 80
VERSION_TRIES = 4
_REQUIRED_RE = re.compile(
    r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*((?:[<>=!~]=?\s*[\w.*+]+\s*,?\s*)+)\s+is required")
# A package that checks for an optional one by name, e.g. fastapi's `Form data requires
# "python-multipart" to be installed.`
_NAMED_DIST_RE = re.compile(r'requires "([A-Za-z0-9][A-Za-z0-9._-]*)" to be installed')


class ClosureError(RuntimeError):
    """The closure cannot be found; the message is one line: which import failed and why."""


@dataclass
class Resolution:
    """What a resolution did: the lock, the pip installs it made, the import checks it ran."""

    lock: Lock
    installs: list[str] = field(default_factory=list)
    checks: int = 0
    seconds: float = 0.0
    seed: str = ""


# ---- the candidate itself -----------------------------------------------------------------------

def identity(source: SGLangSource) -> str:
    """What a venv's lock must name to be reused for `source`: the release, the wheel's hash,
    the tree's place."""
    if source.kind == "wheel":
        return f"wheel sha256:{file_sha256(source.path)}"
    if source.kind == "tree":
        return f"tree {source.path}"
    return f"index sglang=={source.version}"


def candidate_of(version: str | None, source: str | None) -> SGLangSource:
    """The candidate the builder was asked for (`--version` or `--source`)."""
    if not source:
        if not version:
            raise ClosureError("name a release (--version) or a wheel or source tree (--source)")
        return SGLangSource.parse(version)
    candidate = SGLangSource.parse(source)
    if candidate.kind == "index":
        raise ClosureError(f"--source {source}: a wheel file or a source directory (a release is --version)")
    return candidate


def _tree_requirements(root: Path) -> list[str]:
    import tomllib  # Python 3.11+: the venvs the project builds

    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return []
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    return [str(r) for r in project.get("dependencies", [])]


def install_candidate(candidate: SGLangSource, pip: Pip) -> None:
    """Put sglang itself into the venv, `--no-deps`."""
    if candidate.kind == "index":
        pip.install([f"sglang=={candidate.version}"], deps=False)
    elif candidate.kind == "wheel":
        pip.install([candidate.path], deps=False, reinstall=True)
    else:
        _link_tree(Path(candidate.path), candidate.version)  # the directory holding sglang/


def _link_tree(root: Path, version: str) -> None:
    """A source tree as the venv's sglang, in place: a .pth line and a dist-info that names
    its version and its pyproject's requirements (so the version checks and `pip uninstall`
    see it as installed)."""
    site = Path(sysconfig.get_paths()["purelib"])
    if any(site.glob("sglang-*.dist-info")):
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "sglang"], check=False)
    info = site / f"sglang-{version}.dist-info"
    info.mkdir(exist_ok=True)
    requires = "".join(f"Requires-Dist: {r}\n" for r in _tree_requirements(root))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n{requires}",
                                   encoding="utf-8")
    (info / "INSTALLER").write_text("serving-canary\n", encoding="utf-8")
    (info / "direct_url.json").write_text(json.dumps({"url": root.as_uri(), "dir_info": {"editable": True}}),
                                          encoding="utf-8")
    (site / "sglang-tree.pth").write_text(f"{root}\n", encoding="utf-8")
    record = [f"{info.name}/{n}" for n in ("METADATA", "INSTALLER", "direct_url.json", "RECORD")]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in [*record, "sglang-tree.pth"]), encoding="utf-8")


# ---- pip and the import check ------------------------------------------------------------------

class Pip:
    """pip of this venv, every call constrained to the fixed torch."""

    def __init__(self, constraints: Path, log) -> None:
        self.constraints = constraints
        self.log = log
        self.installs: list[str] = []

    def install(self, requirements: list[str], *, deps: bool, reinstall: bool = False,
                extra_constraints: list[str] = ()) -> tuple[bool, str]:
        if not requirements:
            return True, ""
        constraints = self.constraints
        if extra_constraints:
            constraints = self.constraints.with_name("closure-constraints.txt")
            constraints.write_text("\n".join([TORCH_PIN, *extra_constraints]) + "\n", encoding="utf-8")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "-c", str(constraints), *([] if deps else ["--no-deps"]),
               *(["--force-reinstall"] if reinstall else []), *requirements]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        self.installs.append(" ".join(requirements) + ("" if deps else " (--no-deps)"))
        errors = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)
        return proc.returncode == 0, errors.strip()

    def versions(self, dist: str) -> list[str]:
        """Every version the index offers, newest first."""
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist, "--disable-pip-version-check"],
                              capture_output=True, text=True, check=False)
        match = re.search(r"Available versions:\s*(.+)", proc.stdout)
        return [v.strip() for v in match.group(1).split(",")] if match else []


PROFILES = ("memory", "server")  # what the venv must import: the memory path, or the server too


def import_check(profile: str = "memory") -> dict:
    """Run import_check.py in a fresh interpreter of this venv, for `profile`."""
    script = Path(__file__).with_name("import_check.py")
    repo = str(Path(__file__).resolve().parents[3])  # so the check imports the engine's modules too
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CANARY_CLOSURE_PROFILE": profile}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, env=env)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"ok": False, "error": {"type": "crash", "message": tail[:500], "missing": None,
                                       "importer": "", "target": "", "dists": []}}


# ---- resolution --------------------------------------------------------------------------------

def sglang_requirements() -> dict[str, SpecifierSet]:
    """What the installed sglang's metadata asks for in this environment (no extras)."""
    wanted: dict[str, SpecifierSet] = {}
    for text in metadata.requires("sglang") or []:
        try:
            req = Requirement(text)
        except ValueError:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        wanted[normalize(req.name)] = req.specifier
    return wanted


def _exact(spec: SpecifierSet | None) -> str | None:
    items = list(spec or ())
    if len(items) == 1 and items[0].operator in ("==", "===") and "*" not in items[0].version:
        return items[0].version
    return None


def _satisfies(spec: SpecifierSet | None, version: str) -> bool:
    try:
        return spec is None or spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


class Resolver:
    """Turns one failed import check at a time into an install (see the module docstring)."""

    def __init__(self, pip: Pip, seed: Lock | None, log,
                 requirements: dict[str, SpecifierSet] | None = None) -> None:
        self.pip, self.seed, self.log = pip, seed, log
        self.sglang = sglang_requirements() if requirements is None else requirements
        self.owners = dict(seed.module_owners()) if seed else {}
        self.tried: dict[str, set[str]] = {}
        self.added: list[str] = []

    def wanted(self, dist: str) -> str:
        """The requirement to install `dist` by: sglang's pin, else the seed's version where
        sglang allows it, else sglang's range (pip takes the newest)."""
        spec = self.sglang.get(dist)
        pinned = _exact(spec)
        if pinned:
            return f"{dist}=={pinned}"
        seeded = self.seed.versions().get(dist) if self.seed else None
        if seeded and _satisfies(spec, seeded):
            return f"{dist}=={seeded}"
        return f"{dist}{spec or ''}"

    def sglang_pins(self) -> list[str]:
        return [f"{d}=={v}" for d, spec in self.sglang.items()
                if (v := _exact(spec)) and not NEVER.match(d)]

    def first_guess(self) -> None:
        if not self.seed:
            return
        guess = [self.wanted(normalize(p.dist)) for p in self.seed.pins
                 if normalize(p.dist) not in ("sglang",) and not NEVER.match(normalize(p.dist))]
        self.log(f"first guess: {len(guess)} pins from {self.seed.version}'s lock, sglang's own pins first")
        ok, err = self.pip.install(guess, deps=False)
        if not ok:  # one by one, keeping what installs
            for requirement in guess:
                ok, err = self.pip.install([requirement], deps=False)
                if not ok:
                    self.log(f"  skipped {requirement}: {_last_line(err)}")

    def dist_for(self, module: str) -> str:
        """The distribution that provides top-level `module`: as a lock recorded it, as the
        known irregular names say, else the module's own name."""
        top = module.partition(".")[0]
        if top in self.owners:
            return self.owners[top]
        if top in MODULE_DISTS:
            return MODULE_DISTS[top]
        name = normalize(top)
        # Only an exact name: sentence-transformers is not transformers.
        return name

    def step(self, failure: dict) -> None:
        """Act on one failed import check; ClosureError when nothing is left to try."""
        where = f"import {failure['target']}" + (f" (in {failure['importer']})" if failure["importer"] else "")
        why = f"{failure['type']}: {failure['message']}"
        if failure["missing"]:
            dist = self.dist_for(failure["missing"])
            if dist in self.added or NEVER.match(dist):
                raise ClosureError(f"{where} failed: {why}; installing {dist} did not provide it")
            self.added.append(dist)
            requirement = self.wanted(dist)
            self.log(f"missing {failure['missing']} ({where}): installing {requirement}")
            self._install_with_deps(requirement, where, why)
            return
        named = _REQUIRED_RE.search(failure["message"])
        if named:
            requirement = f"{normalize(named.group(1))}{named.group(2).replace(' ', '')}"
            if requirement not in self.added:
                self.added.append(requirement)
                self.log(f"{where} asks for {requirement}: installing it")
                self._install_with_deps(requirement, where, why)
                return
        asked = _NAMED_DIST_RE.search(failure["message"])
        if asked and normalize(asked.group(1)) not in self.added:
            dist = normalize(asked.group(1))
            self.added.append(dist)
            requirement = self.wanted(dist)
            self.log(f"{where} asks for {dist} by name: installing {requirement}")
            self._install_with_deps(requirement, where, why)
            return
        culprits = [d for d in failure["dists"] if d not in ("sglang", "torch") and not NEVER.match(d)]
        if not culprits:
            raise ClosureError(f"{where} failed inside sglang or torch: {why}")
        dist = culprits[-1]
        version = self._next_version(dist)
        if version is None:
            raise ClosureError(f"{where} failed in {dist}: {why} (tried {dist} "
                               f"{', '.join(sorted(self.tried.get(dist, ()))) or 'only as installed'})")
        self.log(f"{where} failed in {dist} ({_last_line(why)}): trying {dist}=={version}")
        self.pip.install([f"{dist}=={version}"], deps=False)

    def _install_with_deps(self, requirement: str, where: str, why: str) -> None:
        ok, err = self.pip.install([requirement], deps=True, extra_constraints=self.sglang_pins())
        if not ok:
            ok, err = self.pip.install([requirement], deps=False)
        if not ok:
            raise ClosureError(f"{where} failed: {why}; `pip install {requirement}` failed: {_last_line(err)}")

    def _next_version(self, dist: str) -> str | None:
        installed = _installed(dist)
        tried = self.tried.setdefault(dist, set())
        if installed:
            tried.add(installed)
        if _exact(self.sglang.get(dist)) or len(tried) > VERSION_TRIES:
            return None
        for version in self.pip.versions(dist):
            if version not in tried and _satisfies(self.sglang.get(dist), version) and not _prerelease(version):
                tried.add(version)
                return version
        return None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _prerelease(version: str) -> bool:
    try:
        return Version(version).is_prerelease
    except InvalidVersion:
        return True


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _lock_from(check: dict, candidate: SGLangSource, header: list[str]) -> Lock:
    pins = [LockPin("sglang", candidate.version, ("sglang",), "the candidate itself")]
    owners: dict[str, list[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for dist in dists:
            owners.setdefault(normalize(dist), []).append(top)
    for dist, (version, importer) in sorted(check["closure"].items()):
        if dist in ("sglang", "torch"):
            continue
        modules = tuple(sorted({m for m in owners.get(dist, []) if m.isidentifier() and not m.startswith("_")}))
        pins.append(LockPin(dist, version, modules[:4], importer))
    return Lock(candidate.version, tuple(pins), tuple(header))


def _check_torch() -> None:
    torch_version = _installed("torch")
    if torch_version != "2.13.0+cpu":
        raise ClosureError(f"torch is {torch_version}, not the CPU build 2.13.0+cpu: something moved it")


def resolve(candidate: SGLangSource, seed: Lock | None, pip: Pip, log, profile: str = "memory") -> Resolution:
    """Resolve the closure of the installed candidate from scratch (or from `seed`'s guess)."""
    started = time.monotonic()
    resolver = Resolver(pip, seed, log)
    resolver.first_guess()
    checks = 0
    for _ in range(MAX_STEPS):
        check = import_check(profile)
        checks += 1
        _check_torch()
        if check["ok"]:
            break
        resolver.step(check["error"])
    else:
        raise ClosureError(f"no closure after {MAX_STEPS} steps; last failure: {check['error']}")
    what = "imports" if profile == "memory" else "imports and its server (launch_server, CPU engine)"
    header = [f"SGLang {candidate.version}: the import closure (--no-deps) of what the project {what}",
              "from it on CPU torch 2.13.0, resolved by scripts/make-sglang-venv.sh "
              "(canaries/sglang/releases/closure.py).",
              f"Generated {dt.date.today().isoformat()} from {identity(candidate)}"
              + (f", first guess {seed.version}'s lock" if seed else ", from nothing") + ": do not edit;",
              f"regenerate with `bash scripts/make-sglang-venv.sh{' --server' if profile == 'server' else ''} "
              f"--version {candidate.version} --relock`.",
              "Each pin: the modules it provides <- the module that first imported it."]
    lock = _lock_from(check, candidate, header)
    return Resolution(lock, pip.installs, checks, time.monotonic() - started, seed.version if seed else "")


# What a venv holds besides the candidate's lock when built from nothing: pip's own tools.
VENV_TOOLS = ("pip", "setuptools", "wheel")


def _requirement_closure(root: str) -> set[str]:
    """`root` and every installed distribution its metadata requires, transitively (no extras)."""
    seen, todo = set(), [root]
    while todo:
        dist = normalize(todo.pop())
        if dist in seen or _installed(dist) is None:
            continue
        seen.add(dist)
        for text in metadata.requires(dist) or []:
            try:
                req = Requirement(text)
            except ValueError:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def prune(lock: Lock, log) -> list[str]:
    """Uninstall what a cloned venv (clone.py) kept of its base that neither `lock` nor torch's
    own requirements name: the venv then holds what one built from nothing with this lock
    would. Returns the distributions removed."""
    keep = set(lock.versions()) | _requirement_closure("torch") | set(VENV_TOOLS)
    site = sysconfig.get_paths()["purelib"]  # the venv's own: not the project on PYTHONPATH
    extra = sorted({normalize(d.metadata["Name"]) for d in metadata.distributions(path=[site])} - keep)
    if extra:
        log(f"removing {len(extra)} distribution(s) of the base venv the lock does not name: {' '.join(extra)}")
        proc = subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "--disable-pip-version-check",
                               *extra], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ClosureError(f"could not remove {' '.join(extra)}: {_last_line(proc.stderr)}")
    return extra


def _cloned() -> bool:
    from canaries.sglang.releases.clone import CLONED_FROM

    return (Path(sys.prefix) / CLONED_FROM).is_file()


def build(candidate: SGLangSource, lock_dir: Path, venv_lock: Path, *, relock: bool, log,
          profile: str = "memory") -> Resolution:
    """Install the candidate and its closure into this venv; reuse a lock that fits.

    The `server` profile keeps its locks in `lock_dir/server/`; with none near, its first guess
    is the nearest memory-path lock."""
    if profile == "server":
        memory_dir, lock_dir = lock_dir, lock_dir / "server"
        lock_dir.mkdir(exist_ok=True)
    started = time.monotonic()
    constraints = venv_lock.with_name(".sglang-venv-constraints.txt")
    constraints.write_text(TORCH_PIN + "\n", encoding="utf-8")
    pip = Pip(constraints, log)
    _check_torch()
    install_candidate(candidate, pip)
    if _installed("sglang") != candidate.version:
        raise ClosureError(f"installing {identity(candidate)} left sglang {_installed('sglang')} in the venv")
    own = lock_dir / f"{candidate.version}.lock"
    reusable = None
    if not relock:
        if venv_lock.is_file() and identity(candidate) in venv_lock.read_text(encoding="utf-8"):
            reusable = venv_lock
        elif candidate.kind == "index" and own.is_file():
            reusable = own
    if reusable is not None:
        lock = read_lock(reusable)
        log(f"installing the lock {reusable.name} ({len(lock.pins)} pins, --no-deps)")
        ok, err = pip.install([r for r in lock.requirements() if not r.startswith("sglang==")], deps=False)
        if ok and _cloned():
            prune(lock, log)
        check = import_check(profile) if ok else {"ok": False, "error": {"message": _last_line(err)}}
        _check_torch()
        if check["ok"]:
            venv_lock.write_text(lock.text() + f"# built from {identity(candidate)}\n", encoding="utf-8")
            return Resolution(lock, pip.installs, 1, time.monotonic() - started, "lock")
        log(f"the lock {reusable} does not import ({check['error'].get('message', '')}); resolving anew")
    seed_path = nearest_lock(candidate.version, lock_dir, exclude_self=relock)
    if seed_path is None and profile == "server":
        seed_path = nearest_lock(candidate.version, memory_dir)
    seed = read_lock(seed_path) if seed_path else None
    log(f"resolving the closure of {identity(candidate)}"
        + (f" (first guess: {seed_path.name})" if seed_path else " (no lock to start from)"))
    resolution = resolve(candidate, seed, pip, log, profile)
    if _cloned() and prune(resolution.lock, log):
        check = import_check(profile)
        if not check["ok"]:
            error = check["error"]
            raise ClosureError(f"after removing what the lock does not name, import {error.get('target', '?')} "
                               f"fails: {error.get('type', '')}: {error.get('message', '')}")
    venv_lock.write_text(resolution.lock.text() + f"# built from {identity(candidate)}\n", encoding="utf-8")
    if candidate.kind == "index" and (relock or not own.is_file()):
        resolution.lock.write(own)
        log(f"wrote {own}")
    return resolution


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canaries.sglang.releases.closure", description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="a release on the index")
    parser.add_argument("--source", help="a wheel file or a source checkout instead")
    parser.add_argument("--lock-dir", required=True, help="where the repo keeps locks (configs/sglang)")
    parser.add_argument("--relock", action="store_true", help="resolve even where a lock exists, and rewrite it")
    parser.add_argument("--profile", choices=PROFILES, default="memory",
                        help="memory: what the memory-path adapters import (default); server: SGLang's server too")
    args = parser.parse_args(argv)
    log = lambda line: print(f"make-sglang-venv: {line}", file=sys.stderr, flush=True)  # noqa: E731
    venv_lock = Path(sys.prefix) / ("sglang-closure.lock" if args.profile == "memory" else "sglang-server-closure.lock")
    try:
        candidate = candidate_of(args.version, args.source)
        result = build(candidate, Path(args.lock_dir), venv_lock, relock=args.relock, log=log,
                       profile=args.profile)
    except (ClosureError, ReleaseError) as exc:
        log(f"sglang {args.version or args.source}: {exc}")
        return 1
    log(f"closure of sglang {candidate.version}: {len(result.lock.pins)} pins, {result.checks} import "
        f"check(s), {len(result.installs)} pip call(s), {result.seconds:.0f}s"
        + (f" (from {result.seed}'s lock)" if result.seed and result.seed != "lock" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
