"""Where a server reference's answers are kept (canaries/sglang/oracle_cache.py): across runs only
for an interpreter whose whole SGLang install has a fingerprint, and never under a fingerprint
that stays the same when what the server runs changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canaries.sglang import oracle_cache
from canaries.sglang.oracle import ServerOracle


def _venv(root: Path, record: str = "sglang/__init__.py,sha256=abc,10\n", editable: bool = False) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    site = root / "lib" / "python3.11" / "site-packages"
    info = site / "sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    (info / "RECORD").write_text(record)
    if editable:
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    (site / "torch-2.9.1.dist-info").mkdir()
    python = root / "bin" / "python"
    python.write_text("")
    return python


@pytest.fixture(autouse=True)
def _fresh_fingerprints() -> None:
    oracle_cache.install_fingerprint.cache_clear()


def test_fingerprint_changes_with_any_installed_file_or_distribution(tmp_path: Path) -> None:
    python = _venv(tmp_path / "a")
    first = oracle_cache.install_fingerprint(python)
    assert first is not None
    (python.parent.parent / "lib/python3.11/site-packages/sglang-0.5.23.dist-info/RECORD").write_text(
        "sglang/__init__.py,sha256=abd,10\n")
    oracle_cache.install_fingerprint.cache_clear()
    second = oracle_cache.install_fingerprint(python)
    (python.parent.parent / "lib/python3.11/site-packages/triton-3.9.0.dist-info").mkdir()
    oracle_cache.install_fingerprint.cache_clear()
    third = oracle_cache.install_fingerprint(python)
    assert len({first, second, third}) == 3
    assert oracle_cache.install_fingerprint(_venv(tmp_path / "b")) not in (first, None)  # another venv


def test_fingerprint_refuses_what_it_cannot_hash(tmp_path: Path) -> None:
    wrapper = tmp_path / "patched" / "bin" / "python"  # a patched mirror's wrapper: no venv of its own
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\n")
    assert oracle_cache.install_fingerprint(wrapper) is None
    assert oracle_cache.install_fingerprint(_venv(tmp_path / "editable", editable=True)) is None
    no_sglang = _venv(tmp_path / "none")
    (no_sglang.parent.parent / "lib/python3.11/site-packages/sglang-0.5.23.dist-info/RECORD").unlink()
    assert oracle_cache.install_fingerprint(no_sglang) is None


def test_answers_outlive_the_report_only_where_fingerprinted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CANARY_CACHE_DIR", str(tmp_path / "cache"))
    python = _venv(tmp_path / "venv")
    computed = []

    def answers(report: str, interpreter: Path) -> dict:
        oracle = ServerOracle(oracle_cache.kept_dir(interpreter, tmp_path / report), {"window": 16}, [], "ref")
        return oracle.reference(lambda: computed.append(report) or [{"rid": "r0", "output_ids": [1, 2]}])

    assert answers("run1", python) == answers("run2", python) == {"r0": [1, 2]}
    assert computed == ["run1"]  # the second report reused the first's
    assert (tmp_path / "cache" / "server-oracle").is_dir() and not (tmp_path / "run1" / ".server-oracle").exists()

    monkeypatch.setenv(oracle_cache.ORACLE_CACHE_ENV, "off")
    answers("run3", python)
    assert computed == ["run1", "run3"] and (tmp_path / "run3" / ".server-oracle").is_dir()
    monkeypatch.delenv(oracle_cache.ORACLE_CACHE_ENV)
    wrapper = tmp_path / "w" / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("")
    answers("run4", wrapper)
    assert computed[-1] == "run4" and (tmp_path / "run4" / ".server-oracle").is_dir()
