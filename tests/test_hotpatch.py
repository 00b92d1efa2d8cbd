"""A patched copy loaded into a process that imported the original (engine_stub/hotpatch.py), and the
fork parent built on it (a patched column's engines forked from its release's warm parent).

Each test imports a package of its own, under a name no other test uses, from tmp_path."""

from __future__ import annotations

import itertools
import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from engine_stub import hotpatch

_NAMES = itertools.count()

ORIGINAL = textwrap.dedent("""
    import functools

    LIMIT = 3


    def free(slots):
        return [s for s in slots if s > 0]


    class Allocator:
        def release(self, n):
            return n - 1

        @property
        def size(self):
            return 10

        @staticmethod
        def page():
            return 1

        @classmethod
        def kind(cls):
            return "swa"


    @functools.lru_cache(maxsize=None)
    def window():
        return 16


    def _logged(fn):
        def wrapper(*args):  # no functools.wraps: the original is only in its closure
            return fn(*args)
        return wrapper


    @_logged
    def hidden(x):
        return x
""")


def _package(tmp_path: Path, files: dict[str, str]) -> tuple[str, Path]:
    """A package (a fresh name) written under tmp_path/src, importable; (its name, the src dir)."""
    name = f"hp_pkg_{next(_NAMES)}"
    src = tmp_path / "src"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text("")
    for rel, text in files.items():
        (src / name / rel).write_text(text)
    sys.path.insert(0, str(src))
    return name, src


def _mirror(tmp_path: Path, name: str, src: Path, patched: dict[str, str]) -> Path:
    """A mirror of the package as patch_mirror makes one: patched files real, the rest symlinks."""
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    for entry in (src / name).iterdir():
        if entry.name == "__pycache__":
            continue
        if entry.name in patched:
            (site / name / entry.name).write_text(patched[entry.name])
        else:
            (site / name / entry.name).symlink_to(entry)
    for rel, text in patched.items():
        if not (site / name / rel).exists():
            (site / name / rel).write_text(text)
    return site


@pytest.fixture(autouse=True)
def _restore_import_state():
    path, meta = list(sys.path), list(sys.meta_path)
    yield
    sys.path[:] = path
    sys.meta_path[:] = meta


def test_changed_bodies_run_patched_through_every_reference(tmp_path: Path) -> None:
    import importlib

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL})
    module = importlib.import_module(f"{name}.alloc")
    free, allocator = module.free, module.Allocator()
    bound = allocator.release
    patched = (ORIGINAL.replace("if s > 0", "if s >= 0").replace("return n - 1", "return n - 2")
               .replace("return 10", "return 20").replace("return 1\n", "return 2\n")
               .replace('return "swa"', 'return "full"').replace("return 16", "return 32")
               .replace("    return x\n", "    return -x\n"))
    done = hotpatch.apply(_mirror(tmp_path, name, src, {"alloc.py": patched}), package=name)
    assert done == {f"{name}.alloc": "in place (8 function(s) changed)"}  # free's listcomp is one
    assert free([0, 1]) == [0, 1] and bound(5) == 3 and allocator.size == 20
    assert module.Allocator.page() == 2 and module.Allocator.kind() == "full"
    assert module.window() == 32 and module.hidden(4) == -4
    assert module.LIMIT == 3


def test_a_module_not_imported_yet_is_imported_from_the_mirror(tmp_path: Path) -> None:
    import importlib

    name, src = _package(tmp_path, {"later.py": "def answer():\n    return 1\n"})
    site = _mirror(tmp_path, name, src, {"later.py": "def answer():\n    return 2\n", "new.py": "X = 7\n"})
    importlib.import_module(name)
    assert hotpatch.apply(site, package=name) == {f"{name}.later": "from the mirror when imported",
                                                  f"{name}.new": "from the mirror when imported"}
    assert importlib.import_module(f"{name}.later").answer() == 2
    assert importlib.import_module(f"{name}.new").X == 7


def test_a_comment_that_moves_lines_changes_no_behaviour_and_is_loaded(tmp_path: Path) -> None:
    import importlib

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL})
    module = importlib.import_module(f"{name}.alloc")
    site = _mirror(tmp_path, name, src, {"alloc.py": "# canary: a comment only\n" + ORIGINAL})
    assert hotpatch.apply(site, package=name) == {f"{name}.alloc": "in place (0 function(s) changed)"}
    assert module.free.__code__.co_filename == str(site / name / "alloc.py")
    assert module.free([0, 1]) == [1]


@pytest.mark.parametrize(("edit", "why"), [
    (("LIMIT = 3", "LIMIT = 4"), "changes more than function bodies"),
    (("    def release(self, n):", "    def release(self, n, m=0):"), "changes more than function bodies"),
    (("    return [s for s in slots if s > 0]\n", "    return [s for s in slots if s > 1]\n\n\nFREED = free([1, 2])\n"),
     "changes more than function bodies"),
])
def test_a_patch_beyond_function_bodies_is_refused_naming_the_module(tmp_path: Path, edit, why) -> None:
    import importlib

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL})
    importlib.import_module(f"{name}.alloc")
    site = _mirror(tmp_path, name, src, {"alloc.py": ORIGINAL.replace(*edit)})
    with pytest.raises(hotpatch.HotPatchRefused, match=f"{name}.alloc: .*{why}"):
        hotpatch.apply(site, package=name)


def test_a_changed_function_that_runs_at_import_is_refused(tmp_path: Path) -> None:
    import importlib

    source = ORIGINAL + "\nFREED = free([0, 1])\n"
    name, src = _package(tmp_path, {"alloc.py": source})
    importlib.import_module(f"{name}.alloc")
    site = _mirror(tmp_path, name, src, {"alloc.py": source.replace("if s > 0", "if s >= 0")})
    with pytest.raises(hotpatch.HotPatchRefused, match=r"a changed function \(free\) is named where"):
        hotpatch.apply(site, package=name)


# ---- the patched fork parent ----------------------------------------------------------------------

PARENT = textwrap.dedent("""
    # A fork parent whose "engine" imports the package and writes what a patched function returns.
    import importlib, json, sys
    from engine_stub import forkserver

    package = importlib.import_module("{name}.alloc")  # imported before serving: patched in place

    def main(argv):
        if argv[0] == "sleep":  # an engine that runs until it is stopped
            import time
            time.sleep(120)
            return 0
        import {name}.later as later
        with open(argv[0], "w") as out:
            json.dump({{"free": package.free([0, 1]), "later": later.answer(), "pid": __import__("os").getpid()}}, out)
        return 0

    sys.exit(forkserver.serve(sys.argv[-1], main=main))
""")


def _python_running(tmp_path: Path, script: str, src: Path) -> str:
    source = tmp_path / "parent.py"
    source.write_text(script, encoding="utf-8")
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{src}:$PYTHONPATH" exec {sys.executable} {source} "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return str(shim)


def _wait_exit(proc, timeout: float = 30.0) -> int:
    return proc.wait(timeout)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_patched_interpreter_forks_from_its_release_parent_and_runs_the_patch(tmp_path: Path) -> None:
    from canaries.runtime import warm

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL, "later.py": "def answer():\n    return 1\n"})
    base = _python_running(tmp_path, PARENT.format(name=name), src)
    site = _mirror(tmp_path, name, src, {"alloc.py": ORIGINAL.replace("if s > 0", "if s >= 0"),
                                         "later.py": "def answer():\n    return 2\n"})
    patched = str(tmp_path / "patched-python")  # stands for the wrapper; never run itself
    warm.register_patched_python(patched, base, site)
    try:
        server = warm.fork_server(patched)
        assert isinstance(server, warm.PatchedForkServer) and server.base is warm.fork_server(base)
        for label in ("patched", "base"):
            out = tmp_path / f"{label}.json"
            proc = (server if label == "patched" else server.base).spawn([str(out)], dict(os.environ),
                                                                           tmp_path / f"{label}.log")
            assert _wait_exit(proc) == 0, (tmp_path / f"{label}.log").read_text()
            seen = json.loads(out.read_text())
            assert (seen["free"], seen["later"]) == (([0, 1], 2) if label == "patched" else ([1], 1))
        # The base's column ends first: its parent stays for the patched one, then both go.
        warm.close_fork_server(base)
        assert server.base.alive and server.alive and server.base.close_requested
        warm.close_fork_server(patched)
        assert not server.alive and not server.base.alive
    finally:
        warm._close_servers()
        warm._PATCHED.pop(patched, None)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_patch_that_cannot_load_in_place_gets_a_parent_of_its_own(tmp_path: Path, capfd) -> None:
    from canaries.runtime import warm

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL, "later.py": "def answer():\n    return 1\n"})
    base = _python_running(tmp_path, PARENT.format(name=name), src)
    site = _mirror(tmp_path, name, src, {"alloc.py": ORIGINAL.replace("LIMIT = 3", "LIMIT = 4")})
    # The patched interpreter as patched_interpreter writes one: the mirror first on the path.
    wrapper = tmp_path / "wrapper-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec {base} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    warm.register_patched_python(str(wrapper), base, site)
    try:
        server = warm.fork_server(str(wrapper))
        assert isinstance(server, warm.ForkServer) and server.python == str(wrapper)
        assert f"{name}.alloc: the patch changes more than function bodies" in capfd.readouterr().err
        out = tmp_path / "own.json"
        proc = server.spawn([str(out)], dict(os.environ), tmp_path / "own.log")
        assert _wait_exit(proc) == 0, (tmp_path / "own.log").read_text()
        assert json.loads(out.read_text())["free"] == [1]  # LIMIT aside, the release's own code
    finally:
        warm._close_servers()
        warm._PATCHED.pop(str(wrapper), None)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_engines_of_a_patched_parent_killed_outright_die_with_it(tmp_path: Path) -> None:
    import signal
    import time

    from canaries.runtime import warm

    name, src = _package(tmp_path, {"alloc.py": ORIGINAL, "later.py": "def answer():\n    return 1\n"})
    base = _python_running(tmp_path, PARENT.format(name=name), src)
    site = _mirror(tmp_path, name, src, {"alloc.py": ORIGINAL.replace("if s > 0", "if s >= 0")})
    patched = str(tmp_path / "patched-python")
    warm.register_patched_python(patched, base, site)
    try:
        server = warm.fork_server(patched)
        engine = server.spawn(["sleep"], dict(os.environ), tmp_path / "sleep.log")
        os.kill(server.proc.pid, signal.SIGKILL)  # as its own parent's close would, with no warning
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(engine.pid):
            time.sleep(0.1)
        assert not _alive(engine.pid), "the patched parent's engine outlived it"
    finally:
        warm._close_servers()
        warm._PATCHED.pop(patched, None)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
