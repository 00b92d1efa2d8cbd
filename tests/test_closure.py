"""The import closure resolver and its lock files (canaries/sglang/releases/closure.py, locks.py).

Unit tests drive the resolver's decisions with a recording pip (no venv, no network); the
end-to-end resolution of a real release without its lock runs in a release venv and is in
test_closure_venv below (skipped where no release venv exists)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from canaries.sglang.releases.closure import ClosureError, Resolver
from canaries.sglang.releases.locks import Lock, LockPin, nearest_lock, read_lock

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "configs" / "sglang"


class RecordingPip:
    """Stands in for the venv's pip: records every install, offers fixed versions."""

    def __init__(self, versions: dict[str, list[str]] | None = None, fail: set[str] = frozenset()) -> None:
        self.calls: list[tuple[tuple[str, ...], bool]] = []
        self.available = versions or {}
        self.fail = fail

    def install(self, requirements, *, deps, reinstall=False, extra_constraints=()):
        self.calls.append((tuple(requirements), deps))
        failed = [r for r in requirements if r in self.fail]
        return (not failed), (f"ERROR: No matching distribution found for {failed[0]}" if failed else "")

    def versions(self, dist):
        return self.available.get(dist, [])


def _failure(**fields) -> dict:
    return {"type": "ModuleNotFoundError", "message": "", "missing": None, "importer": "sglang.srt.utils.common",
            "target": "sglang.srt.mem_cache.allocator.swa", "dists": [], **fields}


def _seed() -> Lock:
    return Lock("0.5.20", (LockPin("sglang", "0.5.20", ("sglang",)), LockPin("pyzmq", "27.3.0", ("zmq",)),
                           LockPin("transformers", "5.19.0", ("transformers",)),
                           LockPin("numpy", "2.4.6", ("numpy",))))


def test_wanted_prefers_sglang_pin_then_seed_then_range():
    resolver = Resolver(RecordingPip(), _seed(), log=lambda _: None,
                        requirements={"transformers": SpecifierSet("==5.12.1"), "numpy": SpecifierSet(),
                                      "pyzmq": SpecifierSet(">=28"), "tqdm": SpecifierSet(">=4")})
    assert resolver.wanted("transformers") == "transformers==5.12.1"  # the release's own pin wins
    assert resolver.wanted("numpy") == "numpy==2.4.6"                # the seed where sglang allows it
    assert resolver.wanted("pyzmq") == "pyzmq>=28"                   # the seed breaks sglang's range
    assert resolver.wanted("tqdm") == "tqdm>=4"                      # unknown to the seed


def test_missing_module_installs_its_distribution_with_dependencies():
    pip = RecordingPip()
    resolver = Resolver(pip, _seed(), log=lambda _: None, requirements={})
    resolver.step(_failure(missing="zmq"))      # the seed's lock says zmq is pyzmq
    resolver.step(_failure(missing="yaml"))     # a known irregular name
    resolver.step(_failure(missing="orjson"))   # its own name
    assert pip.calls == [(("pyzmq==27.3.0",), True), (("pyyaml",), True), (("orjson",), True)]


def test_missing_module_twice_fails_in_one_line():
    resolver = Resolver(RecordingPip(), None, log=lambda _: None, requirements={})
    resolver.step(_failure(missing="orjson"))
    with pytest.raises(ClosureError) as caught:
        resolver.step(_failure(missing="orjson", message="No module named 'orjson'"))
    assert "\n" not in str(caught.value)
    assert "import sglang.srt.mem_cache.allocator.swa" in str(caught.value)
    assert "installing orjson did not provide it" in str(caught.value)


def test_named_version_conflict_installs_what_the_message_asks_for():
    pip = RecordingPip()
    resolver = Resolver(pip, None, log=lambda _: None, requirements={})
    resolver.step(_failure(type="ImportError", message="huggingface-hub>=1.3.0,<2.0 is required for a normal "
                           "functioning of this module, but found huggingface-hub==2.4.0.",
                           dists=["transformers"]))
    assert pip.calls == [(("huggingface-hub>=1.3.0,<2.0",), True)]


def test_package_asking_for_another_by_name_installs_it_not_another_version_of_itself():
    pip = RecordingPip(versions={"fastapi": ["0.165.0", "0.164.0"]})
    resolver = Resolver(pip, None, log=lambda _: None, requirements={})
    resolver.step(_failure(type="RuntimeError", message='Form data requires "python-multipart" to be installed.',
                           dists=["sglang", "fastapi"]))
    assert pip.calls == [(("python-multipart",), True)]


def test_failure_inside_a_distribution_tries_its_other_versions_then_gives_up():
    pip = RecordingPip(versions={"triton": ["3.6.0", "3.5.1", "3.4.0", "3.3.1"]})
    resolver = Resolver(pip, None, log=lambda _: None, requirements={})
    failure = _failure(type="RuntimeError", message="0 active drivers ([]). There should only be one.",
                       dists=["sglang", "triton"])
    tried = []
    with pytest.raises(ClosureError) as caught:
        for _ in range(10):
            resolver.step(failure)
            tried.append(pip.calls[-1][0][0])
    assert tried[:3] == ["triton==3.6.0", "triton==3.5.1", "triton==3.4.0"]
    assert "failed in triton" in str(caught.value) and "\n" not in str(caught.value)


def test_failure_inside_sglang_itself_is_not_retried():
    resolver = Resolver(RecordingPip(), None, log=lambda _: None, requirements={})
    with pytest.raises(ClosureError, match="inside sglang or torch"):
        resolver.step(_failure(type="AttributeError", message="boom", dists=["sglang"]))


def test_failure_in_a_distribution_sglang_pins_is_not_moved():
    pip = RecordingPip(versions={"xgrammar": ["0.2.9", "0.2.7"]})
    resolver = Resolver(pip, None, log=lambda _: None, requirements={"xgrammar": SpecifierSet("==0.2.7")})
    with pytest.raises(ClosureError, match="failed in xgrammar"):
        resolver.step(_failure(type="ImportError", message="cannot import name x", dists=["xgrammar"]))
    assert pip.calls == []


def test_read_lock_round_trips_pins_modules_and_importers(tmp_path):
    lock = Lock("0.5.22", (LockPin("sglang", "0.5.22", ("sglang",), "the candidate itself"),
                           LockPin("pyzmq", "27.3.0", ("zmq",), "sglang.srt.utils.network")), ("a header",))
    path = tmp_path / "0.5.22.lock"
    lock.write(path)
    again = read_lock(path)
    assert again == lock
    assert again.module_owners() == {"sglang": "sglang", "zmq": "pyzmq"}


def test_read_lock_names_file_and_line_of_a_bad_pin(tmp_path):
    path = tmp_path / "0.5.22.lock"
    path.write_text("# header\nsglang==0.5.22\npyzmq>=27\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"0\.5\.22\.lock:3: not `name==version"):
        read_lock(path)


def test_nearest_lock_prefers_own_then_closest_then_older(tmp_path):
    for version in ("0.5.18", "0.5.20", "0.5.23"):
        (tmp_path / f"{version}.lock").write_text(f"sglang=={version}\n", encoding="utf-8")
    assert nearest_lock("0.5.20", tmp_path).stem == "0.5.20"
    assert nearest_lock("0.5.20", tmp_path, exclude_self=True).stem == "0.5.18"  # tie: the older
    assert nearest_lock("0.5.21", tmp_path).stem == "0.5.20"
    assert nearest_lock("0.5.22", tmp_path).stem == "0.5.23"
    assert nearest_lock("0.5.24.dev0", tmp_path).stem == "0.5.23"
    assert nearest_lock("0.5.20", tmp_path / "none") is None


def test_repo_locks_are_generated_and_pin_their_release():
    locks = sorted(LOCKS.glob("*.lock"))
    assert locks, "configs/sglang/ keeps a lock per release CI runs"
    assert not list(LOCKS.glob("*.pins")), "hand-written pins files are gone"
    for path in locks:
        lock = read_lock(path)
        assert lock.version == path.stem
        assert any("do not edit" in line for line in lock.header), path
        names = [p.dist for p in lock.pins]
        assert "torch" not in names and len(names) == len(set(names)), path


def test_make_venv_refuses_version_and_source_together():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "make-sglang-venv.sh"), "--version", "0.5.23",
                           "--source", str(REPO)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "--version or --source, not both" in proc.stderr
