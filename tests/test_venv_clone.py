"""A new candidate's venv as a hard-linked copy of the nearest release's (canaries/sglang/releases/clone.py):
which venv is picked, what is linked, copied, rewritten and left out, and that the base is never
written. Fake venvs on disk: no pip, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from canaries.sglang.releases.clone import CLONED_FROM, clone_venv, main, nearest_venv, venv_release

SITE = "lib/python3.11/site-packages"


def _venv(root: Path, name: str, sglang: str | None = "0.5.23", *, server: bool = False,
          torch: str = "2.13.0+cpu", tree: bool = False) -> Path:
    venv = root / name
    site = venv / SITE
    (venv / "bin").mkdir(parents=True)
    site.mkdir(parents=True)
    os.symlink("/usr/bin/python3", venv / "bin" / "python")
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {venv}\n")
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{venv}"\n')
    (venv / "bin" / "fastapi").write_text(f"#!{venv}/bin/python\nimport fastapi\n")
    (venv / ("sglang-server-closure.lock" if server else "sglang-closure.lock")).write_text(f"sglang=={sglang}\n")
    (site / f"torch-{torch}.dist-info").mkdir()
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("# torch\n")
    (site / "_sglang_cpu_shim").mkdir()
    (site / "_sglang_cpu_shim" / "__init__.py").write_text("# shim\n")
    (site / "_sglang_cpu_shim.pth").write_text("import _sglang_cpu_shim\n")
    if tree:
        (site / "sglang-tree.pth").write_text("/src/sglang/python\n")
    if sglang is not None:
        info = site / f"sglang-{sglang}.dist-info"
        info.mkdir()
        (site / "sglang" / "srt").mkdir(parents=True)
        (site / "sglang" / "__init__.py").write_text("")
        (site / "sglang" / "srt" / "swa.py").write_text("# swa\n")
        (venv / "bin" / "sglang").write_text(f"#!{venv}/bin/python\n")
        (info / "METADATA").write_text(f"Name: sglang\nVersion: {sglang}\n")
        (info / "RECORD").write_text("sglang/__init__.py,,\nsglang/srt/swa.py,sha256=x,6\n"
                                     f"sglang-{sglang}.dist-info/METADATA,,\n../../../bin/sglang,,\n"
                                     f"sglang-{sglang}.dist-info/RECORD,,\n")
    return venv


def test_venv_release_reads_the_release_and_its_kind_and_refuses_unfit_venvs(tmp_path: Path) -> None:
    assert venv_release(_venv(tmp_path, ".venv-sglang-0.5.20", "0.5.20")) == ("0.5.20", False)
    assert venv_release(_venv(tmp_path, ".venv-sglang-server", server=True)) == ("0.5.23", True)
    assert venv_release(_venv(tmp_path, "cuda", torch="2.13.0")) is None
    assert venv_release(_venv(tmp_path, "tree", tree=True)) is None
    assert venv_release(_venv(tmp_path, "empty", None)) is None


def test_nearest_venv_prefers_its_kind_then_the_nearest_older_release(tmp_path: Path) -> None:
    _venv(tmp_path, ".venv-sglang-0.5.18", "0.5.18")
    _venv(tmp_path, ".venv-sglang-0.5.20", "0.5.20")
    _venv(tmp_path, ".venv-sglang", "0.5.23")
    _venv(tmp_path, ".venv-sglang-server", "0.5.23", server=True)
    _venv(tmp_path, ".venv-sglang-tree-abc", "0.5.19", tree=True)
    assert nearest_venv("0.5.19", tmp_path, server=False) == (tmp_path / ".venv-sglang-0.5.18").resolve()
    assert nearest_venv("0.5.22", tmp_path, server=False) == (tmp_path / ".venv-sglang").resolve()
    assert nearest_venv("0.5.19", tmp_path, server=True) == (tmp_path / ".venv-sglang-server").resolve()
    assert nearest_venv("0.5.20", tmp_path, server=False,
                        exclude=tmp_path / ".venv-sglang-0.5.20") == (tmp_path / ".venv-sglang-0.5.18").resolve()
    assert nearest_venv("0.5.20", tmp_path / "nothing-here", server=False) is None


def test_clone_links_site_packages_copies_what_is_rewritten_and_leaves_the_base_sglang_out(tmp_path: Path) -> None:
    base = _venv(tmp_path, ".venv-sglang", "0.5.23")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file()}
    target = tmp_path / ".venv-sglang-0.5.19"
    links = clone_venv(base, target)
    site, base_site = target / SITE, base / SITE
    assert links == 1  # torch/__init__.py; the shim and its .pth are copies
    assert (site / "torch" / "__init__.py").stat().st_ino == (base_site / "torch" / "__init__.py").stat().st_ino
    for copied in ("_sglang_cpu_shim/__init__.py", "_sglang_cpu_shim.pth"):
        assert (site / copied).stat().st_ino != (base_site / copied).stat().st_ino
    assert (site / "torch-2.13.0+cpu.dist-info").is_dir()
    assert not (site / "sglang").exists() and not list(site.glob("sglang-*.dist-info"))
    assert not (target / "bin" / "sglang").exists()  # the base sglang's own script
    assert (target / "bin" / "fastapi").read_text().startswith(f"#!{target}/bin/python\n")
    assert str(target) in (target / "bin" / "activate").read_text()
    assert (target / "pyvenv.cfg").read_text().endswith(f"-m venv {target}\n")
    assert os.readlink(target / "bin" / "python") == "/usr/bin/python3"
    assert not (target / "sglang-closure.lock").exists()
    assert (target / CLONED_FROM).read_text().strip() == str(base.resolve())
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file()} == before


def test_clone_that_fails_leaves_no_target(tmp_path: Path, monkeypatch) -> None:
    base = _venv(tmp_path, ".venv-sglang", "0.5.23")
    target = tmp_path / ".venv-sglang-0.5.19"

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(OSError):
        clone_venv(base, target)
    assert not target.exists() and not list(tmp_path.glob(".venv-sglang-0.5.19.clone-*"))
    assert main(["--version", "0.5.19", "--root", str(tmp_path), str(target)]) == 0  # builds from nothing
    assert not target.exists()


def test_main_clones_the_nearest_and_leaves_an_existing_target_alone(tmp_path: Path, capsys) -> None:
    base = _venv(tmp_path, ".venv-sglang-0.5.20", "0.5.20")
    target = tmp_path / ".venv-sglang-0.5.19"
    assert main(["--version", "0.5.19", "--root", str(tmp_path), str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(base.resolve()) and (target / CLONED_FROM).is_file()
    (target / "marker").write_text("mine")
    assert main(["--version", "0.5.19", "--root", str(tmp_path), str(target)]) == 0
    assert capsys.readouterr().out == "" and (target / "marker").read_text() == "mine"
