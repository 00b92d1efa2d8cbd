"""`installed_version`: the sglang a venv has installed, asked of its interpreter once per install."""

from __future__ import annotations

import os
from pathlib import Path

from canaries.sglang.releases.venvs import installed_version


def _fake_venv(tmp_path: Path, version: str) -> tuple[Path, Path]:
    """A venv whose interpreter counts its starts and answers `version`."""
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (venv / "bin").mkdir()
    starts = tmp_path / "starts"
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho x >> {starts}\necho {version}\n")
    python.chmod(0o755)
    return python, starts


def test_installed_version_asks_an_unchanged_venv_once_and_again_after_an_install(tmp_path: Path) -> None:
    python, starts = _fake_venv(tmp_path, "0.5.23")
    assert installed_version(python) == installed_version(python) == "0.5.23"
    assert starts.read_text().count("x") == 1
    python.write_text(python.read_text().replace("0.5.23", "0.5.24"))
    site = python.parent.parent / "lib" / "python3.11" / "site-packages"
    (site / "sglang-0.5.24.dist-info").mkdir()  # what an install changes
    os.utime(site, ns=(site.stat().st_atime_ns, site.stat().st_mtime_ns + 1_000_000))
    assert installed_version(python) == "0.5.24"
    assert starts.read_text().count("x") == 2


def test_installed_version_of_an_interpreter_outside_a_venv_is_asked_every_time(tmp_path: Path) -> None:
    python = tmp_path / "python"
    starts = tmp_path / "starts"
    python.write_text(f"#!/bin/sh\necho x >> {starts}\necho 0.5.23\n")
    python.chmod(0o755)
    assert installed_version(python) == installed_version(python) == "0.5.23"
    assert starts.read_text().count("x") == 2
