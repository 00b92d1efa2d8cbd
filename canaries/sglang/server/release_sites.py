"""Which of the engine's hook sites an SGLang release's server has a place for.

The server runtime places each site by wrapping a named function of SGLang's (the plugin's
`run_batch` hook, `site_hooks`), and the kinds read requests through `Req.kv` (`ReqKvInfo`,
`sglang_view`). A release whose sources lack one of those cannot take a kind acting there:
`missing_sites` reads the release's own files (parsed, never imported, so the harness needs no
SGLang) and names, per site, what is missing. Checked against 0.5.22 and 0.5.23: every hook
point is there, the same function at the same place.
"""

from __future__ import annotations

import ast
import functools
import threading
from pathlib import Path

__all__ = ["HOOK_POINTS", "READ_BY_EVERY_SITE", "missing_sites"]

# site -> the (file in the sglang package, qualified name) each of its hooks wraps.
HOOK_POINTS: dict[str, tuple[tuple[str, str], ...]] = {
    "before_step": (("srt/managers/scheduler.py", "Scheduler.run_batch"),),
    "on_window_eviction": (("srt/mem_cache/common.py", "free_swa_out_of_window_slots"),),
    "on_request_finish": (("srt/mem_cache/common.py", "release_kv_cache"),),
    "on_sampling": (("srt/managers/scheduler.py", "Scheduler._relay_forward_payload"),),
    "on_chunk_boundary": (("srt/managers/scheduler.py", "Scheduler.stash_chunked_request"),
                          ("srt/mem_cache/unified_cache/components/swa.py", "SWAComponent.free_out_of_window_slots")),
}
# What every site reads of a request (`site_hooks.req_state`: `req.kv`, 0.5.23's `ReqKvInfo`).
READ_BY_EVERY_SITE: tuple[tuple[str, str], ...] = (("srt/managers/schedule_batch.py", "ReqKvInfo"),)


# CPython 3.11's AST constructor is not safe from two threads at once ("AST constructor recursion
# depth mismatch"): a matrix's columns, and a scenario's reference server, start side by side.
_PARSE_LOCK = threading.Lock()


@functools.cache
def _names(path: Path) -> frozenset[str]:
    """The qualified names of `path`'s top-level classes and functions and of the classes'
    methods (`Scheduler.run_batch`); empty where the file is absent or does not parse."""
    try:
        source = path.read_text(encoding="utf-8")
        with _PARSE_LOCK:
            tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    names = set()
    for node in tree.body:
        if isinstance(node, defs):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body if isinstance(item, defs))
    return frozenset(names)


def missing_sites(package_dir: Path) -> dict[str, str]:
    """site -> why the release at `package_dir` (its `sglang` directory) has no place for it;
    empty when every site has one."""
    def lacks(points: tuple[tuple[str, str], ...]) -> list[str]:
        return [f"{file} {name}" for file, name in points if name not in _names(package_dir / file)]

    common = lacks(READ_BY_EVERY_SITE)
    out = {}
    for site, points in HOOK_POINTS.items():
        absent = common + lacks(points)
        if absent:
            out[site] = "its sources have no " + ", no ".join(absent)
    return out
