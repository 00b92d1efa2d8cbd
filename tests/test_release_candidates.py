"""Release candidates for `canary matrix`: every form a column takes (an index release, a wheel,
a source checkout, `+PATCH`, `+FILE.diff`), what each records about itself, diffs applied to a
throwaway mirror, and known divergences inherited from older releases. No network, no venv."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from canaries.sglang.divergences import known_divergences
from canaries.sglang.matrix import Cell, Column, MatrixResult, describe_provenance
from canaries.sglang.matrix_html import matrix_html
from canaries.sglang.parity import load_expectations
from canaries.sglang.releases import (
    ReleaseError,
    ReleaseSpec,
    SGLangSource,
    match_release,
    parse_releases,
    patch_mirror,
    patched_interpreter,
)
from canaries.sglang.releases.diffs import diff_sections
from canaries.sglang.releases.patches import SGLangPatch
from canaries.sglang.releases.versions import scm_version

WHEEL = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"


def _wheel(directory: Path, name: str = WHEEL, metadata: str | None = "Name: sglang\nVersion: 0.5.23\n") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("sglang/__init__.py", "")
        if metadata is not None:
            wheel.writestr("sglang-0.5.23.dist-info/METADATA", "Metadata-Version: 2.1\n" + metadata + "\nA description.\n")
    return path


def _tree(root: Path, version: str = "0.5.24.dev0") -> Path:
    package = root / "python" / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "version.py").write_text(f'__version__ = "{version}"\n')
    (package / "srt" / "alloc.py").write_text("def free(x):\n    return x\n")
    return root


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


# Parsing every form.

@pytest.mark.parametrize(("text", "label"), [
    ("0.5.22", "0.5.22"), ("0.5.24.dev0", "0.5.24.dev0"), ("0.5.23.post1", "0.5.23.post1"),
    ("0.5.24rc1", "0.5.24rc1"), (" 0.5.24-RC1 ", "0.5.24rc1"), ("v0.5.23", "0.5.23"),
])
def test_parse_index_release_gives_canonical_label(text: str, label: str) -> None:
    spec = ReleaseSpec.parse(text)
    assert spec.base == SGLangSource("index", label) and spec.version == label and spec.label == label
    assert spec.provenance() == {"kind": "index", "version": label, "patches": [], "diffs": []}


def test_parse_wheel_reads_version_and_records_sha256(tmp_path: Path, monkeypatch) -> None:
    wheel = _wheel(tmp_path / "dist")
    monkeypatch.chdir(tmp_path)
    spec = ReleaseSpec.parse(f"./dist/{WHEEL}")
    assert spec.base == SGLangSource("wheel", "0.5.23", str(wheel)) and spec.version == "0.5.23"
    assert spec.label == f"wheel:{WHEEL}"
    prov = spec.provenance()
    assert prov["kind"] == "wheel" and prov["path"] == str(wheel)
    assert prov["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_parse_wheel_with_local_version_in_its_name_keeps_it_one_part(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "sglang-0.5.24.dev0+g1a2b-py3-none-any.whl",
                   "Name: SGLang\nVersion: 0.5.24.dev0+g1a2b\n")
    spec = ReleaseSpec.parse(f"{wheel}+identity")
    assert spec.base.version == "0.5.24.dev0+g1a2b" and spec.patches == ("identity",)
    assert spec.label == "wheel:sglang-0.5.24.dev0+g1a2b-py3-none-any.whl+identity"


def test_parse_tree_root_and_python_dir_give_one_source(tmp_path: Path) -> None:
    root = _tree(tmp_path / "sglang-src")
    from_root, from_python = ReleaseSpec.parse(str(root)), ReleaseSpec.parse(str(root / "python"))
    assert from_root == from_python
    assert from_root.base == SGLangSource("tree", "0.5.24.dev0", str(root / "python"))
    assert from_root.label == "tree:sglang-src"
    prov = from_root.provenance()
    assert "commit" not in prov and len(prov["py_sha256"]) == 64  # not a git tree: its .py files
    (root / "python" / "sglang" / "srt" / "alloc.py").write_text("def free(x):\n    return None\n")
    assert from_root.provenance()["py_sha256"] != prov["py_sha256"]


def test_parse_git_tree_records_commit_and_dirty(tmp_path: Path) -> None:
    root = _tree(tmp_path / "sglang")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "x")
    spec = ReleaseSpec.parse(str(root))
    prov = spec.provenance()
    assert prov["commit"] == _git(root, "rev-parse", "HEAD") and prov["dirty"] is False
    assert "py_sha256" not in prov
    (root / "python" / "sglang" / "srt" / "alloc.py").write_text("def free(x):\n    return None\n")
    dirty = spec.provenance()
    assert dirty["commit"] == prov["commit"] and dirty["dirty"] is True and len(dirty["py_sha256"]) == 64


# A raw checkout: SGLang's own version.py (no literal), no generated _version.py.
RAW_VERSION_PY = (
    "try:\n    from sglang._version import __version__\nexcept ImportError:\n"
    "    __version__ = \"0.0.0.dev0\"\n")


def _raw_checkout(root: Path) -> Path:
    _tree(root)
    (root / "python" / "sglang" / "version.py").write_text(RAW_VERSION_PY)
    (root / ".gitignore").write_text("__pycache__/\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "release")
    return root


def test_parse_raw_checkout_at_its_tag_takes_the_tag_version_and_records_it(tmp_path: Path) -> None:
    root = _raw_checkout(tmp_path / "sglang")
    _git(root, "tag", "v0.5.23")
    _git(root, "tag", "gateway-v9.9.9")  # another package's tag in SGLang's repository
    spec = ReleaseSpec.parse(str(root))
    assert spec.base == SGLangSource("tree", "0.5.23", str(root / "python")) and spec.version == "0.5.23"
    prov = spec.provenance()
    node = _git(root, "rev-parse", "--short=7", "HEAD")
    assert prov["version_from"] == f"git describe v0.5.23-0-g{node}" and prov["dirty"] is False
    assert f"version by git describe v0.5.23-0-g{node}" in describe_provenance(prov)


def test_parse_raw_checkout_past_its_tag_names_the_next_dev_version(tmp_path: Path) -> None:
    root = _raw_checkout(tmp_path / "sglang")
    _git(root, "tag", "v0.5.23")
    (root / "python" / "sglang" / "srt" / "alloc.py").write_text("def free(x):\n    return None\n")
    _git(root, "commit", "-qam", "a fix")
    node = _git(root, "rev-parse", "--short=7", "HEAD")
    assert SGLangSource.parse(str(root)).version == f"0.5.24.dev1+g{node}"
    (root / "python" / "sglang" / "srt" / "alloc.py").write_text("def free(x):\n    return 1\n")
    dirty = SGLangSource.parse(str(root / "python"))
    assert dirty.version.startswith(f"0.5.24.dev1+g{node}.d") and len(dirty.version.rsplit(".d", 1)[1]) == 8


def test_parse_raw_checkout_without_a_release_tag_says_so(tmp_path: Path) -> None:
    root = _raw_checkout(tmp_path / "sglang")
    with pytest.raises(ReleaseError, match="no sglang/_version.py .*`git describe` finds no release tag"):
        ReleaseSpec.parse(str(root))


@pytest.mark.parametrize(("tag", "distance", "dirty", "version"), [
    ("v0.5.23", 0, False, "0.5.23"),
    ("v0.5.23", 0, True, "0.5.23+d20260101"),
    ("v0.5.23", 3, False, "0.5.24.dev3+gabc1234"),
    ("0.5.24rc1", 2, True, "0.5.24rc2.dev2+gabc1234.d20260101"),
    ("v0.5.23.post1", 1, False, "0.5.23.post2.dev1+gabc1234"),
    ("gateway-v1.0", 1, False, None),
])
def test_scm_version_reads_a_description_as_setuptools_scm(tag, distance, dirty, version) -> None:
    assert scm_version(tag, distance, "abc1234", dirty, "20260101") == version


def test_parse_diffs_and_patches_on_any_base(tmp_path: Path, monkeypatch) -> None:
    _wheel(tmp_path / "dist")
    (tmp_path / "pr.diff").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = ReleaseSpec.parse("0.5.23+identity+./pr.diff")
    assert spec.patches == ("identity",) and spec.diffs == (str(tmp_path / "pr.diff"),)
    assert spec.label == "0.5.23+identity+pr.diff" and spec.version == "0.5.23"
    assert spec.provenance()["diffs"] == [{"path": str(tmp_path / "pr.diff"),
                                           "sha256": hashlib.sha256(b"").hexdigest()}]
    assert spec.provenance()["patches"] == ["identity"]
    on_wheel = ReleaseSpec.parse(f"dist/{WHEEL}+pr.diff")
    assert on_wheel.base.kind == "wheel" and on_wheel.label == f"wheel:{WHEEL}+pr.diff"


@pytest.mark.parametrize(("text", "message"), [
    ("0.5", "'0.5': not a version like 0.5.23"),
    ("./dist/missing.whl", "'./dist/missing.whl': no such file"),
    ("0.5.23+missing.diff", "diff missing.diff: no such file"),
    ("no-meta.whl", "has no \\*.dist-info/METADATA"),
    ("other.whl", "is not sglang \\(its METADATA names torch\\)"),
    ("notes.txt", "neither a wheel"),
    ("empty-dir", "no SGLang checkout"),
    ("bad-tree", "declares no valid __version__"),
    ("0.5.23+no-such-patch", "unknown SGLang patch no-such-patch"),
    ("0.5.23+", "empty patch name"),
])
def test_parse_bad_release_raises_naming_text_and_why(tmp_path: Path, monkeypatch, text: str, message: str) -> None:
    _wheel(tmp_path, "no-meta.whl", metadata=None)
    _wheel(tmp_path, "other.whl", "Name: torch\nVersion: 2.13.0\n")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "bad-tree" / "sglang").mkdir(parents=True)
    (tmp_path / "bad-tree" / "sglang" / "version.py").write_text("VERSION = 1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReleaseError, match=message) as info:
        parse_releases([text], where="matrix.yaml: sglang")
    assert str(info.value).startswith("matrix.yaml: sglang") and "\n" not in str(info.value)


@pytest.mark.parametrize(("kind", "version", "path", "message"), [
    ("pypi", "0.5.23", "", "one of index, wheel, tree"),
    ("index", "0.5.24-rc1", "", "canonical spelling"),
    ("wheel", "0.5.23", "relative.whl", "must be absolute"),
    ("tree", "0.5.23", "/nonexistent/python", "holds sglang/version.py"),
])
def test_construct_bad_source_raises(kind: str, version: str, path: str, message: str) -> None:
    with pytest.raises(ReleaseError, match=message):
        SGLangSource(kind, version, path)


def test_construct_wheel_source_with_wrong_version_raises(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match="is sglang 0.5.23, not 0.5.22"):
        SGLangSource("wheel", "0.5.22", str(_wheel(tmp_path)))


# --sglang and --candidate name the same column however it is spelled.

def test_match_candidate_spelled_differently_gives_the_same_column(tmp_path: Path, monkeypatch) -> None:
    _wheel(tmp_path / "dist")
    _tree(tmp_path / "sglang")
    (tmp_path / "pr.diff").write_text("")
    monkeypatch.chdir(tmp_path)
    specs = parse_releases(f"0.5.24-rc1,./dist/{WHEEL},sglang,0.5.23+./pr.diff")
    for text, index in [("0.5.24rc1", 0), (f"dist/{WHEEL}", 1), (f"wheel:{WHEEL}", 1),
                        (str(tmp_path / "dist" / WHEEL), 1), ("sglang/python", 2), ("./sglang", 2),
                        ("0.5.23+pr.diff", 3), (f"0.5.23+{tmp_path}/pr.diff", 3)]:
        assert match_release(text, specs, where="--candidate") is specs[index], text
    new = match_release("0.5.22", specs, where="--candidate")
    assert new not in specs and new.label == "0.5.22"


def test_match_candidate_with_a_taken_label_for_another_release_raises(tmp_path: Path) -> None:
    specs = parse_releases([str(_wheel(tmp_path / "a"))])
    other = _wheel(tmp_path / "b", metadata="Name: sglang\nVersion: 0.5.23\nSummary: rebuilt\n")
    with pytest.raises(ReleaseError, match=f"--candidate: .* is labelled wheel:{WHEEL}"):
        match_release(str(other), specs, where="--candidate")


# Diffs applied to a throwaway mirror.

ALLOC = "def free(x):\n    check(x)\n    return x\n"
OTHER = "-- 1\nLIMIT = 1\n"  # a line that, removed, reads like a diff header


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "venv-site" / "sglang"
    (package / "srt" / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "srt" / "__init__.py").write_text("")
    (package / "srt" / "alloc.py").write_text(ALLOC)
    (package / "srt" / "other.py").write_text(OTHER)
    (package / "kept.py").write_text("KEPT = 1\n")
    return package


def _snapshot(package: Path) -> dict[str, bytes]:
    return {str(p.relative_to(package)): p.read_bytes() for p in sorted(package.rglob("*")) if p.is_file()}


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


PR_DIFF = """\
A description before the diff, as `git format-patch` writes one.
---
diff --git a/python/sglang/srt/alloc.py b/python/sglang/srt/alloc.py
index 1111111..2222222 100644
--- a/python/sglang/srt/alloc.py
+++ b/python/sglang/srt/alloc.py
@@ -1,3 +1,2 @@
 def free(x):
-    check(x)
     return x
--- a/sglang/srt/other.py\t2026-01-01 00:00:00
+++ b/sglang/srt/other.py\t2026-01-01 00:00:00
@@ -1,2 +1,2 @@
--- 1
+++ 1
 LIMIT = 1
--- /dev/null
+++ b/python/sglang/srt/newpkg/helper.py
@@ -0,0 +1 @@
+HELPER = 2
diff --git a/python/sglang/srt/newpkg/__init__.py b/python/sglang/srt/newpkg/__init__.py
new file mode 100644
index 0000000..e69de29
"""


def test_apply_diff_edits_mirror_and_never_the_release(tmp_path: Path) -> None:
    package = _package(tmp_path)
    before = _snapshot(package)
    diff = _write(tmp_path, "pr.diff", PR_DIFF)
    assert [s.files for s in diff_sections(PR_DIFF, "pr.diff")] == [
        ("srt/alloc.py",), ("srt/other.py",), ("srt/newpkg/helper.py",), ("srt/newpkg/__init__.py",)]
    site = tmp_path / "mirror"
    combined = patch_mirror(package, site, "0.5.23", diffs=(diff,))
    mirror = site / "sglang"
    assert (mirror / "srt" / "alloc.py").read_text() == "def free(x):\n    return x\n"
    assert (mirror / "srt" / "other.py").read_text() == "++ 1\nLIMIT = 1\n"
    assert (mirror / "srt" / "newpkg" / "helper.py").read_text() == "HELPER = 2\n"
    assert (mirror / "srt" / "newpkg" / "__init__.py").read_text() == ""
    for edited in ("srt", "srt/alloc.py", "srt/other.py"):
        assert not (mirror / edited).is_symlink(), edited
    assert (mirror / "kept.py").is_symlink() and (mirror / "srt" / "__init__.py").is_symlink()
    assert not (mirror / "srt" / "__pycache__").exists()
    assert _snapshot(package) == before  # the release untouched, no new file in it
    assert combined == PR_DIFF and not list(site.rglob("*.orig")) and not list(site.rglob("*.rej"))


def test_apply_empty_diff_runs_the_release_unmodified(tmp_path: Path) -> None:
    package = _package(tmp_path)
    diff = _write(tmp_path, "empty.diff", "")
    assert patch_mirror(package, tmp_path / "mirror", "0.5.23", diffs=(diff,)) == ""
    mirror = tmp_path / "mirror" / "sglang"
    assert all(entry.is_symlink() for entry in mirror.iterdir())
    assert (mirror / "srt" / "alloc.py").read_text() == ALLOC


def test_apply_diff_whose_hunk_does_not_apply_raises_one_line(tmp_path: Path) -> None:
    package = _package(tmp_path)
    before = _snapshot(package)
    stale = _write(tmp_path, "stale.diff", "--- a/python/sglang/srt/alloc.py\n+++ b/python/sglang/srt/alloc.py\n"
                                         "@@ -1,3 +1,3 @@\n def free(y):\n-    verify(y)\n+    verify2(y)\n     return y\n")
    with pytest.raises(ReleaseError) as info:
        patch_mirror(package, tmp_path / "mirror", "0.5.23", diffs=(stale,))
    message = str(info.value)
    assert message.startswith("diff stale.diff: b/python/sglang/srt/alloc.py: Hunk #1 FAILED at 1")
    assert "SGLang 0.5.23" in message and "\n" not in message
    assert _snapshot(package) == before


def test_apply_diff_already_in_the_release_raises(tmp_path: Path) -> None:
    package = _package(tmp_path)
    reversed_ = _write(tmp_path, "applied.diff", "--- a/sglang/srt/alloc.py\n+++ b/sglang/srt/alloc.py\n"
                                               "@@ -1,2 +1,3 @@\n def free(x):\n+    check(x)\n     return x\n")
    with pytest.raises(ReleaseError, match="applied.diff: b/sglang/srt/alloc.py: Reversed"):
        patch_mirror(package, tmp_path / "mirror", "0.5.23", diffs=(reversed_,))


@pytest.mark.parametrize(("text", "message"), [
    ("--- a/docs/readme.md\n+++ b/docs/readme.md\n@@ -1 +1 @@\n-a\n+b\n", "b/docs/readme.md is outside the sglang package"),
    ("just some words\n", "not a unified diff"),
])
def test_apply_bad_diff_raises_naming_it(tmp_path: Path, text: str, message: str) -> None:
    diff = _write(tmp_path, "bad.diff", text)
    with pytest.raises(ReleaseError, match=f"diff bad.diff: {message}"):
        patch_mirror(_package(tmp_path), tmp_path / "mirror", "0.5.23", diffs=(diff,))


def test_patched_interpreter_runs_catalogue_patch_then_diff(tmp_path: Path, monkeypatch) -> None:
    package = _package(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setattr("canaries.sglang.releases.patches._CATALOGUE",
                        (SGLangPatch("drop-check", "srt/alloc.py", "    check(x)\n", "", "the check removed"),))
    diff = _write(tmp_path, "limit.diff", "--- sglang/srt/other.py\n+++ sglang/srt/other.py\n"
                                          "@@ -2 +2 @@\n-LIMIT = 1\n+LIMIT = 7\n")
    wrapper, combined = patched_interpreter(Path(sys.executable), "0.5.23", ("drop-check",), tmp_path / "w",
                                            (diff,))
    assert combined.index("-    check(x)") < combined.index("+LIMIT = 7\n")
    out = subprocess.run([str(wrapper), "-c", "import inspect, sglang.srt.alloc as a, sglang.srt.other as o; "
                          "print(o.LIMIT, 'check' in inspect.getsource(a))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["7", "False"]
    assert (package / "srt" / "other.py").read_text() == OTHER and (package / "srt" / "alloc.py").read_text() == ALLOC


# Known divergences, inherited.

def _parity(tmp_path: Path) -> Path:
    directory = tmp_path / "parity"
    directory.mkdir()
    (directory / "sglang-0.5.20.yaml").write_text(
        "divergences:\n"
        "  a: {verdict: MISSED, reason: filtered}\n"
        "  b: {verdict: FALSE_ALARM, reason: locks whole nodes}\n")
    (directory / "sglang-0.5.23.yaml").write_text(
        "inherits: 0.5.20\nresolved: [a]\n"
        "divergences:\n"
        "  c: {verdict: DETECTED, reason: strands full pages}\n")
    return directory


def test_load_inherits_overlays_parent_and_drops_resolved(tmp_path: Path) -> None:
    known = known_divergences("0.5.23", _parity(tmp_path))
    assert known.entries == {
        "b": {"verdict": "FALSE_ALARM", "reason": "inherited from 0.5.20: locks whole nodes",
              "inherited_from": "0.5.20"},
        "c": {"verdict": "DETECTED", "reason": "strands full pages"}}
    assert known.describe() == "sglang-0.5.23.yaml, sglang-0.5.20.yaml (inherited)"
    assert load_expectations("0.5.23", tmp_path / "parity") == known.entries


@pytest.mark.parametrize(("version", "parent"), [
    ("0.5.24.dev0", "0.5.23"), ("0.5.23.post1", "0.5.23"), ("0.5.24", "0.5.23"),
    ("0.5.23rc1", "0.5.20"), ("0.5.21", "0.5.20"),
])
def test_load_release_without_file_inherits_nearest_older(tmp_path: Path, version: str, parent: str) -> None:
    parity = _parity(tmp_path)
    known = known_divergences(version, parity)
    assert not known.own and known.files[0].name == f"sglang-{parent}.yaml"
    assert known.describe().startswith(f"sglang-{parent}.yaml (inherited)")
    parent_entries = known_divergences(parent, parity).entries
    assert set(known.entries) == set(parent_entries)
    for name, entry in known.entries.items():
        assert entry["verdict"] == parent_entries[name]["verdict"]
        assert entry["reason"].startswith("inherited from 0.5.2") and entry["reason"].count("inherited from") == 1


def test_load_release_older_than_every_file_has_none(tmp_path: Path) -> None:
    known = known_divergences("0.5.19", _parity(tmp_path))
    assert known.entries == {} and known.files == () and known.describe() == "none"


@pytest.mark.parametrize(("doc", "message"), [
    ("inherits: 0.5.20\nresolved: [c]\n", "resolved: c is not a divergence it inherits"),
    ("inherits: 0.5.21\n", "inherits 0.5.21, which has no sglang-0.5.21.yaml"),
    ("resolved: [a]\n", "needs `inherits:`"),
    ("inherits: 0.5.20\nresolved: [a]\ndivergences:\n  a: {verdict: MISSED, reason: x}\n", "both resolved"),
    ("inherits: 0.5.23\n", "a cycle"),
])
def test_load_bad_inheritance_raises_naming_the_file(tmp_path: Path, doc: str, message: str) -> None:
    parity = _parity(tmp_path)
    (parity / "sglang-0.5.23.yaml").write_text(doc)
    with pytest.raises(ValueError, match=message) as info:
        known_divergences("0.5.23", parity)
    assert "sglang-0.5.23.yaml" in str(info.value)


# What each column says about itself.

def test_matrix_reports_say_what_each_column_ran(tmp_path: Path) -> None:
    wheel = {"kind": "wheel", "version": "0.5.23", "path": f"/d/{WHEEL}", "sha256": "ab" * 32,
             "patches": [], "diffs": [{"path": "/d/pr.diff", "sha256": "cd" * 32}]}
    tree = {"kind": "tree", "version": "0.5.24.dev0", "path": "/src/sglang/python", "commit": "ef" * 20,
            "dirty": True, "py_sha256": "01" * 32, "patches": ["identity"], "diffs": []}
    columns = [Column(f"wheel:{WHEEL}+pr.diff", "0.5.23", "/py", 1.0, provenance=wheel,
                      divergences="sglang-0.5.23.yaml"),
               Column("tree:sglang+identity", "0.5.24.dev0", "/py2", 2.0, ("identity",), provenance=tree,
                      divergences="sglang-0.5.23.yaml (inherited)")]
    cells = {"s": {"native": Cell("CLEAN", (), True, "native"),
                   columns[0].label: Cell("CLEAN", (), True, "same"),
                   columns[1].label: Cell("CLEAN", (), True, "same")}}
    result = MatrixResult(columns, 1.0, cells, None, tmp_path)
    md = result.to_markdown()
    assert f"| wheel {WHEEL} sha256 {'ab' * 32}; diff pr.diff sha256 {'cd' * 32} | sglang-0.5.23.yaml |" in md
    assert (f"| tree /src/sglang/python at {'ef' * 20} (dirty), .py sha256 {'01' * 32}; patch identity "
            "| sglang-0.5.23.yaml (inherited) |") in md
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["columns"][0]["provenance"] == wheel and doc["columns"][1]["divergences"].endswith("(inherited)")
    page = matrix_html(result)
    assert "ef" * 20 in page and "divergences: sglang-0.5.23.yaml (inherited)" in page


def test_run_matrix_builds_one_venv_per_base_source(tmp_path: Path, monkeypatch) -> None:
    import canaries.sglang.matrix as matrix

    asked: list[object] = []

    def release_python(source, *, build, log, build_log, server=False):
        asked.append(source)
        return Path(sys.executable)

    def stop(python: str) -> str:
        raise ReleaseError("stop here")

    monkeypatch.setattr(matrix, "release_python", release_python)
    monkeypatch.setattr(matrix, "patched_interpreter", lambda *args: (Path(sys.executable), ""))
    monkeypatch.setattr(matrix, "engine_sglang_version", stop)
    with pytest.raises(ReleaseError, match="stop here"):
        matrix.run_matrix([], parse_releases("0.5.23,0.5.23+identity"), tmp_path, progress=False,
                          log=lambda line: None)
    assert asked == [SGLangSource("index", "0.5.23")]


def test_matrix_candidate_spelled_like_a_listed_release_adds_no_column(capsys) -> None:
    from canaries.cli import main as canary

    code = canary(["matrix", "--sglang", "0.0.1,0.0.2", "--last", "v0.0.1", "--candidate", "0.0.2",
                   "--no-build", "-k", "clean-page1-noradix"])
    err = capsys.readouterr().err
    assert code == 2 and "named twice" not in err and "make-sglang-venv.sh --version 0.0.1" in err


def test_run_matrix_starts_each_parent_shortly_before_its_column_and_closes_it_after(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """One column at a time: a column's parent is started as the column before it starts (no
    parent waits for long), is closed when the column is done, and a patched column's
    interpreter is registered to fork from its release's parent."""
    import canaries.runner as runner
    import canaries.runtime.warm as warm
    import canaries.sglang.matrix as matrix

    events: list[tuple[str, str]] = []
    python_of = {"0.5.20": "/venv-0.5.20/bin/python", "0.5.23": "/venv-0.5.23/bin/python"}
    monkeypatch.setattr(matrix, "release_python", lambda source, **_: Path(python_of[source.version]))
    monkeypatch.setattr(matrix, "patched_interpreter",
                        lambda python, version, patches, workdir, diffs: (workdir / "bin" / "python", ""))
    monkeypatch.setattr(matrix, "engine_sglang_version", lambda python: "0.5.20" if "0.5.20" in python else "0.5.23")

    def run_many(scenarios, report_dir, **kwargs):
        events.append(("run", kwargs.get("engine_python") or "native"))
        return []

    monkeypatch.setattr(runner, "run_many", run_many)
    monkeypatch.setattr(warm, "prestart", lambda python, root, preload: events.append(("prestart", python)))
    monkeypatch.setattr(warm, "close_fork_server", lambda python=None, root=None: events.append(("close", python)))
    registered: list[tuple[str, str]] = []
    monkeypatch.setattr(warm, "register_patched_python",
                        lambda python, base, site: registered.append((str(python), str(base))))
    matrix.run_matrix([], parse_releases("0.5.20,0.5.23,0.5.23+identity"), tmp_path / "m", columns_at_once=1,
                      progress=False, reuse_native=False, log=lambda line: None)
    patched = next(python for python, _ in registered)
    assert registered == [(patched, python_of["0.5.23"])]
    order = [python_of["0.5.23"], patched, python_of["0.5.20"]]  # newest first, the base before its patch
    runs = [python for kind, python in events if kind == "run"]
    assert runs == ["native", *order]
    for column in order:
        started = events.index(("prestart", column))
        ran = events.index(("run", column))
        closed = events.index(("close", column))
        position = runs.index(column)
        # started while the column before it runs (or, for the first, before anything runs), not earlier
        earliest = events.index(("run", runs[position - 2])) if position >= 2 else 0
        assert earliest <= started < ran < closed, events
        # nothing of the next column's runs before this column's parent is gone
        assert all(events.index(("run", later)) > closed for later in runs[runs.index(column) + 1:])
