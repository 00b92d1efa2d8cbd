"""A new candidate's venv as a hard-linked copy of the nearest release's venv, so that torch (and
most of the closure, which releases share) is never installed again.

    python -m canaries.sglang.releases.clone (--version X | --source WHEEL_OR_TREE) [--server] --root REPO TARGET

scripts/make-sglang-venv.sh runs it before it creates a venv that does not exist yet. It picks
the nearest venv in REPO (`.venv-sglang*`, symlinks followed) that holds an SGLang release on the
CPU torch 2.13.0, the same kind first (a server venv for a server venv), then the nearest
version (as `locks.nearest_lock` does), and copies it to TARGET: every directory real, every
file of its site-packages a hard link, except the files anything writes in place (the venv's
top level, `bin/`, `.pth` files and the CPU shim the builder rewrites), which are real copies with
the base's path replaced by TARGET's; the base's sglang (the files its RECORD lists) is left
out. The builder then goes on as in an empty venv with torch: the
candidate `--no-deps`, its lock `--no-deps` (only what differs is installed), and
`closure.prune` removes what the base had that the candidate's lock does not name.

Nothing is written to the base venv: pip replaces a file by unlinking it first, and Python
writes bytecode to a new file it renames into place. Prints the base's path on success and
nothing (exit 0) when no venv fits or TARGET's filesystem cannot hold links to it. Stdlib only.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
import time
from pathlib import Path

from canaries.sglang.releases.errors import ReleaseError
from canaries.sglang.releases.source import SGLangSource
from canaries.sglang.releases.versions import version_key

__all__ = ["CLONED_FROM", "clone_venv", "nearest_venv", "venv_release"]

CLONED_FROM = ".sglang-venv-cloned-from"  # in a cloned venv's top level: the base it came from
TORCH_CPU = "2.13.0+cpu"
_DIST_INFO_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)\.dist-info$")
# Files the builder (re)writes in place, with `>`: a link would carry the write into the base.
_REWRITTEN = ("_sglang_cpu_shim", "_sglang_cpu_shim.pth")


def _site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def _installed(site: Path) -> dict[str, str]:
    """Normalized distribution name -> version, read from the dist-info directories (no import)."""
    out = {}
    for entry in os.scandir(site):
        match = _DIST_INFO_RE.match(entry.name)
        if match and entry.is_dir():
            out[re.sub(r"[-_.]+", "-", match["name"]).lower()] = match["version"]
    return out


def venv_release(venv: Path) -> tuple[str, bool] | None:
    """(the SGLang release `venv` holds, whether it runs the server too) where it is a venv a
    new one may start from: a release from the index or a wheel (not a linked source tree) over
    the CPU torch 2.13.0, its closure recorded; None otherwise."""
    site = _site_packages(venv)
    if site is None or not (venv / "bin" / "python").exists() or (site / "sglang-tree.pth").exists():
        return None
    installed = _installed(site)
    if installed.get("torch") != TORCH_CPU or "sglang" not in installed:
        return None
    server = (venv / "sglang-server-closure.lock").is_file()
    if not server and not (venv / "sglang-closure.lock").is_file():
        return None
    return installed["sglang"], server


def _distance(version: str, target: str) -> tuple:
    a, b = version_key(version)[0], version_key(target)[0]
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    # Releases differ in their last number: distance there, then prefer the older one.
    return tuple(abs(x - y) for x, y in zip(a, b, strict=True)), version_key(version) > version_key(target)


def nearest_venv(version: str, root: Path, *, server: bool, exclude: Path | None = None) -> Path | None:
    """The venv in `root` a venv for `version` is best cloned from (see the module docstring)."""
    found = []
    for path in sorted(root.glob(".venv-sglang*")):
        venv = path.resolve()
        if not venv.is_dir() or (exclude is not None and venv == exclude.resolve()):
            continue
        release = venv_release(venv)
        if release is not None:
            found.append((release[1] != server, _distance(release[0], version), str(venv)))
    return Path(min(found)[2]) if found else None


def _rewrite(path: Path, old: str, new: str) -> None:
    """A real copy of `path` with `old` (the base venv's path) replaced by `new`."""
    data = path.read_bytes()
    tmp = path.with_name(path.name + ".clone-tmp")
    tmp.write_bytes(data.replace(old.encode(), new.encode()))
    shutil.copymode(path, tmp)
    tmp.replace(path)


def _sglang_files(site: Path) -> set[Path]:
    """Every file the installed sglang owns (its dist-info's RECORD, resolved), its dist-info too."""
    info = next((p for p in site.glob("sglang-*.dist-info") if _DIST_INFO_RE.match(p.name)), None)
    if info is None:
        return set()
    owned = {info / "RECORD"}
    for row in (info / "RECORD").read_text(encoding="utf-8").splitlines():
        name = row.rsplit(",", 2)[0] if row.count(",") >= 2 else row
        if name:
            owned.add(Path(os.path.normpath(site / name)))
    return owned


def _copy_tree(base: Path, target: Path, linked: Path, leave_out: set[Path]) -> int:
    """Copy `base` into `target` (a new directory): files under `linked` hard links, the rest
    real copies, symlinks as they are, the files in `leave_out` (and directories left empty by
    them) not at all. Returns how many files were linked."""
    links = 0
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        dest = target / here.relative_to(base)
        inside = here == linked or linked in here.parents
        for name in list(dirnames):
            if (here / name).is_symlink():
                dirnames.remove(name)
                dest.mkdir(parents=True, exist_ok=True)
                os.symlink(os.readlink(here / name), dest / name)
        for name in filenames:
            src = here / name
            if src in leave_out:
                continue
            dest.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dest / name)
            elif inside and src.relative_to(linked).parts[0] not in _REWRITTEN and not name.endswith(".pth"):
                os.link(src, dest / name)
                links += 1
            else:
                shutil.copy2(src, dest / name)
        if not filenames and not dirnames:
            dest.mkdir(parents=True, exist_ok=True)
    return links


def clone_venv(base: Path, target: Path) -> int:
    """Make `target` (absent) a copy of venv `base` without its sglang: site-packages
    hard-linked, the rest copied with `base`'s path replaced by `target`'s. Returns how many
    files are shared. OSError (EXDEV and the like) leaves no `target` behind."""
    base, target = base.resolve(), target.absolute()
    site = _site_packages(base)
    if site is None:
        raise ReleaseError(f"{base}: no site-packages")
    tmp = target.with_name(f"{target.name}.clone-{os.getpid()}")
    try:
        # The base's sglang stays behind, as `pip uninstall` would leave it: the candidate's own
        # is installed next, `--no-deps`.
        links = _copy_tree(base, tmp, site, _sglang_files(site))
        # What names the venv's own path: its scripts' shebangs, activate, pyvenv.cfg, .pth lines.
        tmp_site = tmp / site.relative_to(base)
        for path in [*(tmp / "bin").iterdir(), tmp / "pyvenv.cfg", *tmp_site.glob("*.pth")]:
            if path.is_file() and not path.is_symlink() and str(base).encode() in path.read_bytes():
                _rewrite(path, str(base), str(target))
        for lock in ("sglang-closure.lock", "sglang-server-closure.lock"):
            (tmp / lock).unlink(missing_ok=True)  # the candidate's own is written by its build
        (tmp / CLONED_FROM).write_text(f"{base}\n", encoding="utf-8")
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canaries.sglang.releases.clone", description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="a release on the index")
    parser.add_argument("--source", help="a wheel file or a source checkout instead")
    parser.add_argument("--server", action="store_true", help="a venv that runs SGLang's server too")
    parser.add_argument("--root", required=True, type=Path, help="where the venvs are (the repo root)")
    parser.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    log = lambda line: print(f"make-sglang-venv: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if args.target.exists():
        return 0
    try:
        version = SGLangSource.parse(args.source or args.version or "").version
    except ReleaseError as exc:
        log(f"no clone: {exc}")
        return 0
    base = nearest_venv(version, args.root, server=args.server, exclude=args.target)
    if base is None:
        return 0
    started = time.monotonic()
    try:
        links = clone_venv(base, args.target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        log(f"no clone of {base}: {exc.strerror} (another filesystem?); building from nothing")
        return 0
    log(f"cloned {base} ({links} files hard-linked, its sglang left out) in {time.monotonic() - started:.1f}s")
    print(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
