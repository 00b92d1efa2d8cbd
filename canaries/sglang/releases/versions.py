"""SGLang version strings, PEP 440-ish: which text is a version, its canonical spelling, and
its order (`0.5.24.dev0 < 0.5.24rc1 < 0.5.24 < 0.5.24.post1`).

SGLang releases have at least three release numbers (`0.5.23`); `0.5` is not taken for one.
A local label (`+g1a2b3c`) is allowed only where `local=True` (a wheel's or a tree's own
version): in a column's text `+` introduces a patch.
"""

from __future__ import annotations

import re

__all__ = ["canonical_version", "next_version", "same_version", "scm_version", "version_key"]

_VERSION_RE = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+){2,})"
    r"(?:[._-]?(?P<pre>a|alpha|b|beta|c|rc|pre|preview)[._-]?(?P<pre_n>\d*))?"
    r"(?:[._-]?(?:post|rev|r)[._-]?(?P<post>\d*))?"
    r"(?:[._-]?dev[._-]?(?P<dev>\d*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[._-][a-z0-9]+)*))?$",
    re.IGNORECASE)
_PRE = {"a": "a", "alpha": "a", "b": "b", "beta": "b", "c": "rc", "rc": "rc", "pre": "rc", "preview": "rc"}
_PRE_RANK = {"a": 0, "b": 1, "rc": 2}


def _match(text: str, local: bool) -> re.Match[str] | None:
    match = _VERSION_RE.match(text.strip())
    if match is None or (match["local"] and not local):
        return None
    return match


def canonical_version(text: str, *, local: bool = False) -> str | None:
    """`text` spelled the canonical way (`0.5.24-RC1` -> `0.5.24rc1`), or None if not a version."""
    match = _match(text, local)
    if match is None:
        return None
    out = match["release"]
    if match["pre"]:
        out += f"{_PRE[match['pre'].lower()]}{int(match['pre_n'] or 0)}"
    if match["post"] is not None:
        out += f".post{int(match['post'] or 0)}"
    if match["dev"] is not None:
        out += f".dev{int(match['dev'] or 0)}"
    if match["local"]:
        out += "+" + re.sub(r"[_-]", ".", match["local"].lower())
    return out


def version_key(text: str) -> tuple:
    """A sort key in PEP 440 order (the local label does not count). Raises ValueError for a
    text that is not a version."""
    match = _match(text, local=True)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    release = [int(part) for part in match["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    post = None if match["post"] is None else int(match["post"] or 0)
    dev = None if match["dev"] is None else int(match["dev"] or 0)
    if match["pre"]:
        pre: tuple[int, int] = (_PRE_RANK[_PRE[match["pre"].lower()]], int(match["pre_n"] or 0))
    elif dev is not None and post is None:
        pre = (-1, 0)  # X.devN comes before every pre-release of X
    else:
        pre = (3, 0)  # a final release comes after its pre-releases
    return (tuple(release), pre, -1 if post is None else post, (1, 0) if dev is None else (0, dev))


def same_version(a: str, b: str) -> bool:
    """Whether `a` and `b` are the same version (spelling and local label aside)."""
    try:
        return version_key(a) == version_key(b)
    except ValueError:
        return a.strip() == b.strip()


def next_version(text: str) -> str | None:
    """The release after `text`, as setuptools_scm's `guess-next-dev` scheme guesses it: a
    pre-release's number goes up (`0.5.24rc1` -> `0.5.24rc2`), a post-release's too, else the
    last release number (`0.5.23` -> `0.5.24`); None for a text that is not a version."""
    match = _match(text, local=True)
    if match is None:
        return None
    release = match["release"]
    if match["pre"]:
        return f"{release}{_PRE[match['pre'].lower()]}{int(match['pre_n'] or 0) + 1}"
    if match["post"] is not None:
        return f"{release}.post{int(match['post'] or 0) + 1}"
    head, _, last = release.rpartition(".")
    return f"{head}.{int(last) + 1}"


def scm_version(tag: str, distance: int, node: str, dirty: bool, date: str) -> str | None:
    """The version setuptools_scm's default schemes (`guess-next-dev`, `node-and-date`) give a
    checkout `distance` commits past release tag `tag` at commit `node` (its short hash), with
    uncommitted changes when `dirty` (`date`: YYYYMMDD), as a build of that checkout would name
    itself; None when `tag` is no version:

        at the tag, clean           0.5.23
        at the tag, dirty           0.5.23+d20260101
        3 commits on, clean         0.5.24.dev3+gabc1234
        3 commits on, dirty         0.5.24.dev3+gabc1234.d20260101
    """
    base = canonical_version(tag)
    if base is None or distance < 0:
        return None
    if distance == 0:
        return base + (f"+d{date}" if dirty else "")
    after = next_version(base)
    if after is None:
        return None
    return canonical_version(f"{after}.dev{distance}+g{node}" + (f".d{date}" if dirty else ""), local=True)
