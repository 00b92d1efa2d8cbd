"""SGLang version strings, PEP 440-ish: which text is a version, its canonical spelling, and
its order (`0.5.24.dev0 < 0.5.24rc1 < 0.5.24 < 0.5.24.post1`).

SGLang releases have at least three release numbers (`0.5.23`); `0.5` is not taken for one.
A local label (`+g1a2b3c`) is allowed only where `local=True` (a wheel's or a tree's own
version): in a column's text `+` introduces a patch.
"""

from __future__ import annotations

import re

__all__ = ["canonical_version", "same_version", "version_key"]

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
