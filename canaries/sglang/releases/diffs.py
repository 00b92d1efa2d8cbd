"""Unified diffs of SGLang's sources (a PR, a local change) applied to a throwaway mirror.

A diff's file names may carry any prefix before the package: `python/sglang/srt/x.py`,
`a/sglang/srt/x.py`, `sglang/srt/x.py` all name `srt/x.py` inside the `sglang` package. Each
file's part of the diff is applied on its own by GNU patch, with `-p` set so that its names land
relative to the mirror's site dir, and only once the files it writes are real copies there.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from canaries.sglang.releases.errors import ReleaseError

__all__ = ["DiffSection", "apply_section", "diff_sections", "read_diff"]

PATCH = "/usr/bin/patch"
_HUNK_RE = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_SAVING_RE = re.compile(r"\s*--\s*saving rejects.*$")


@dataclass(frozen=True)
class DiffSection:
    """One file's part of a unified diff.

    Args:
        header: the file's name as the diff writes it (the new name; the old for a deletion).
        files: the names it touches inside the `sglang` package (old and new), e.g. `srt/x.py`.
        strip: the `-p` that leaves `sglang/...` of its names.
        text: its lines, headers included.
    """

    header: str
    files: tuple[str, ...]
    strip: int
    text: str


def read_diff(path: str | Path) -> str:
    """The text of the diff file at `path` (bytes kept as they are, whatever the encoding)."""
    try:
        return Path(path).read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        raise ReleaseError(f"diff {path}: {exc.strerror}") from None


def _name(field: str) -> str | None:
    """A `---`/`+++` header's file name (no timestamp), None for /dev/null."""
    name = field.split("\t", 1)[0].strip()
    if len(name) > 1 and name[0] == name[-1] == '"':
        name = name[1:-1]
    return None if name == "/dev/null" else name


def _package_path(name: str, diff: str) -> tuple[int, str]:
    """`(strip, path inside the package)` of a diff's file name: the part after the component
    `sglang` (the one after `python/` when there is one: a checkout may itself be named sglang)."""
    parts = name.split("/")
    at = [i for i, part in enumerate(parts) if part == "sglang"]
    after_python = [i for i in at if i > 0 and parts[i - 1] == "python"]
    if not at:
        raise ReleaseError(f"diff {diff}: {name} is outside the sglang package")
    index = (after_python or at)[0]
    rest = parts[index + 1:]
    if not rest or any(part in ("", ".", "..") for part in rest):
        raise ReleaseError(f"diff {diff}: {name} is not a file inside the sglang package")
    return index, "/".join(rest)


def _skip_hunks(lines: list[str], i: int) -> int:
    """The index after the hunks starting at `lines[i]` (counted, so that a removed line that
    reads like a header is not taken for one)."""
    while i < len(lines) and (match := _HUNK_RE.match(lines[i])):
        old = 1 if match[1] is None else int(match[1])
        new = 1 if match[2] is None else int(match[2])
        i += 1
        while i < len(lines) and (old > 0 or new > 0):
            mark = lines[i][:1]
            if mark in (" ", "\n", "\r"):
                old, new = old - 1, new - 1
            elif mark == "-":
                old -= 1
            elif mark == "+":
                new -= 1
            elif mark != "\\":
                break  # a short hunk: patch itself says what is wrong with it
            i += 1
        while i < len(lines) and lines[i].startswith("\\"):
            i += 1
    return i


def _git_names(line: str) -> tuple[str, str] | None:
    names = line[len("diff --git "):].rstrip("\r\n").split(" ")
    return (names[0], names[1]) if len(names) == 2 else None


def diff_sections(text: str, diff: str) -> list[DiffSection]:
    """`text`'s file sections (none for an empty diff); `diff` names it in errors. ReleaseError
    for a file outside the sglang package and for text that has no file header at all."""
    lines = text.splitlines(keepends=True)
    starts: list[int] = []
    names: list[list[str | None]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            starts.append(i)
            names.append(list(_git_names(line) or (None, None)) + [None])  # git's names, then ours
            i += 1
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if not starts or names[-1][2] is not None:  # not the headers of a `diff --git` part
                starts.append(i)
                names.append([None, None, None])
            names[-1][:3] = [_name(line[4:]), _name(lines[i + 1][4:]), "headers"]
            i = _skip_hunks(lines, i + 2)
        else:
            i += 1
    if not starts:
        if text.strip():
            raise ReleaseError(f"diff {diff}: not a unified diff (no ---/+++ file headers)")
        return []
    sections = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        old, new, _ = names[n]
        present = [name for name in (new, old) if name is not None]
        if not present:
            raise ReleaseError(f"diff {diff}: cannot read the file names of {lines[start].strip()!r}")
        mapped = [_package_path(name, diff) for name in present]
        if len({strip for strip, _ in mapped}) > 1:
            raise ReleaseError(f"diff {diff}: {old} and {new} sit at different depths")
        files = tuple(dict.fromkeys(path for _, path in mapped))
        sections.append(DiffSection(new or old or "", files, mapped[0][0], "".join(lines[start:end])))
    return sections


def apply_section(site: Path, section: DiffSection, diff: str, version: str) -> None:
    """Apply `section` under `site` (which holds the mirror's `sglang/`). Every file it names
    must be a real file or absent, under real directories: patch never writes through a link."""
    for name in section.files:
        target = site / "sglang" / name
        for path in (target, *target.parents):
            if path == site:
                break
            if path.is_symlink():
                raise ReleaseError(f"diff {diff}: {section.header}: {path} is a link into the venv "
                                   "(not mirrored as a real copy)")
    proc = subprocess.run([PATCH, "--batch", "--forward", "--no-backup-if-mismatch", "--reject-file=-",
                           f"-p{section.strip}"], input=section.text.encode("utf-8", "surrogateescape"),
                          cwd=site, capture_output=True, check=False)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode("utf-8", "replace").splitlines()
        said = [_SAVING_RE.sub("", line).strip() for line in out
                if line.strip() and not line.startswith(("patching file", "checking file"))]
        raise ReleaseError(f"diff {diff}: {section.header}: {'; '.join(said) or f'patch exited {proc.returncode}'} "
                           f"(on SGLang {version})")
