"""Planted regressions of an installed SGLang release, applied to a throwaway copy.

Like the engine's regression catalogue (`canaries/regressions/`), each entry names a file of
the `sglang` package, an exact snippet that must occur once, and its replacement. A column may
also carry unified diffs (a PR, a local change: canaries/sglang/releases/diffs.py), applied after the
catalogue's patches. A patched release runs from a mirror of the installed package: the
directories on the patched files' paths are real, the patched files real copies, everything else
a symlink to the venv's own files, so the venv itself is never touched. A small wrapper
interpreter puts the mirror first on PYTHONPATH.
"""

from __future__ import annotations

import difflib
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from canaries.sglang.releases.diffs import DiffSection, apply_section, diff_sections, read_diff
from canaries.sglang.releases.errors import ReleaseError

__all__ = ["SGLangPatch", "package_dir", "patch_catalogue", "patch_mirror", "patched_interpreter"]


@dataclass(frozen=True)
class SGLangPatch:
    """One named edit of SGLang's sources.

    Args:
        name: what `VERSION+name` calls it.
        file: path inside the `sglang` package (e.g. `srt/mem_cache/allocator/swa.py`).
        old: exact text, occurring once in that release's file.
        new: its replacement.
        models: the regression it stands for.
    """

    name: str
    file: str
    old: str
    new: str
    models: str

    def __post_init__(self) -> None:
        if not self.old or self.old == self.new:
            raise ReleaseError(f"patch {self.name}: old must be non-empty and differ from new")
        if not self.file.endswith(".py") or self.file.startswith("/"):
            raise ReleaseError(f"patch {self.name}: file must be a .py path inside the sglang package")

    def apply(self, package_dir: Path, version: str) -> str:
        """Edit `package_dir/file` (a real file in a mirror); return the unified diff."""
        path = package_dir / self.file
        text = path.read_text(encoding="utf-8")
        count = text.count(self.old)
        if count != 1:
            raise ReleaseError(f"patch {self.name}: its snippet occurs {count} times in SGLang {version}'s "
                               f"{self.file} (it must occur exactly once)")
        edited = text.replace(self.old, self.new)
        path.write_text(edited, encoding="utf-8")
        return "".join(difflib.unified_diff(text.splitlines(True), edited.splitlines(True),
                                            f"a/sglang/{self.file}", f"b/sglang/{self.file}"))


_CATALOGUE = (
    SGLangPatch(
        name="identity",
        file="srt/mem_cache/allocator/swa.py",
        old="class SWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):\n",
        new="# canary: a comment only; the code is the release's own (the gate's null control).\n"
            "class SWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):\n",
        models="no change at all: the same release run from a patched copy must gate as identical",
    ),
    SGLangPatch(
        name="free-swa-contract-removed",
        file="srt/mem_cache/allocator/swa.py",
        old=("        swa_tokens = self.full_to_swa_index_mapping[full_page_representatives]\n"
             "        expect(_SWA_PEER_MAPPED, swa_tokens > 0, msg=\"caller wants free_full\")\n"),
        new="        swa_tokens = self.full_to_swa_index_mapping[full_page_representatives]\n",
        models="PR #36723's free_swa contract (a peer must be mapped) dropped from the CPU path of "
               "free_swa: a stripped or padding mapping is released unchecked",
    ),
    SGLangPatch(
        name="release-leaks-last-slot",
        file="srt/mem_cache/common.py",
        old="    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])\n",
        new="    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len - 1)])\n",
        models="the request-level release (mem_cache/common.py release_kv_cache, called by SGLang's "
               "scheduler as a request finishes, never by `memory: sglang`) frees its row one slot "
               "short: every finished request leaks its last KV slot",
    ),
    # The state goes wrong and no answer changes: SGLang's idle check (a sum: a locked node counts
    # as protected instead of evictable) balances, its canary reads only what a forward reads. The
    # suite's census on the server sees each (canaries/sglang/server/census.py); docs/sglang-server.md
    # says which scenario kills which, with and without the census.
    SGLangPatch(
        name="unlock-only-when-checkpointed",
        file="srt/mem_cache/common.py",
        old="    tree_cache.unlock(req.lock)\n    req.lock = None\n",
        new="    if checkpoint:\n        tree_cache.unlock(req.lock)\n    req.lock = None\n",
        models="release_kv_cache drops a request's tree lock only when it checkpoints the request into "
               "the tree: a retracted or aborted request (`release_kv_cache(checkpoint=False)`) keeps the "
               "lock its prefill's checkpoint took on its prompt, a lock that outlives its request",
    ),
    SGLangPatch(
        name="relock-same-node-leaks",
        file="srt/mem_cache/unified_radix_cache.py",
        old="        self.unlock(req.lock)\n        # Opt-in: leave the matched-prefix mamba evictable",
        new="        if req.lock is None or req.lock.node != new_last_node:\n"
            "            self.unlock(req.lock)\n"
            "        # Opt-in: leave the matched-prefix mamba evictable",
        models="checkpoint_into_tree keeps the request's lock when its insert ends on the node that lock "
               "holds, then locks that node again: the request releases one of the two at its finish and "
               "the node stays locked for good (an insert that adds no page: a short answer on page 16)",
    ),
    SGLangPatch(
        name="chunk-checkpoint-keeps-lock",
        file="srt/mem_cache/unified_radix_cache.py",
        old="        self.unlock(req.lock)\n        # Opt-in: leave the matched-prefix mamba evictable",
        new="        if up_to >= len(req.origin_input_ids):\n"
            "            self.unlock(req.lock)\n"
            "        # Opt-in: leave the matched-prefix mamba evictable",
        models="checkpoint_into_tree moves the request's lock only once its prompt is whole: at a chunk "
               "boundary of a chunked prefill it locks the chunk's node and keeps the lock it had, so the "
               "admission's lock and every chunk's but the last outlive the request",
    ),
    SGLangPatch(
        name="abort-unlock-skips-swa",
        file="srt/mem_cache/common.py",
        old="    tree_cache.unlock(req.lock)\n    req.lock = None\n",
        new=("    if req.lock is not None and type(req.finished_reason).__name__ == \"FINISH_ABORT\":\n"
             "        req.lock.swa_released = True\n"
             "    tree_cache.unlock(req.lock)\n    req.lock = None\n"),
        models="release_kv_cache of an aborted request (a client hang-up) treats its lock's SWA part as "
               "released early and drops only the full part: the SWA lock on the prompt's last window "
               "outlives the request",
    ),
    SGLangPatch(
        name="abort-release-drops-only-swa",
        file="srt/mem_cache/common.py",
        old="    tree_cache.unlock(req.lock)\n    req.lock = None\n",
        new=("    if req.lock is not None and type(req.finished_reason).__name__ == \"FINISH_ABORT\":\n"
             "        tree_cache.release_swa(req.lock)\n"
             "    else:\n"
             "        tree_cache.unlock(req.lock)\n    req.lock = None\n"),
        models="release_kv_cache of an aborted request (a client hang-up) releases its lock the way the "
               "decode's early SWA release does, the SWA part only: the full part of the lock on the "
               "prompt outlives the request",
    ),
    SGLangPatch(
        name="admission-pin-kept",
        file="srt/managers/schedule_policy.py",
        old="            finally:\n                self.tree_cache.unlock(lock)\n",
        new="            finally:\n                pass  # canary: the pin is never taken out\n",
        models="the prefill adder's temporary pin of a waiting request's matched prefix (`_lock_node`, "
               "taken while it checks whether the request fits) is never released: every admission probe "
               "of a request with a cache hit leaves a lock on the matched node that no request holds",
    ),
    SGLangPatch(
        name="early-swa-release-keeps-lock",
        file="srt/mem_cache/unified_radix_cache.py",
        old=("        result = self.tree_core.dec_swa_lock_only(lock.node, lock.receipt)\n"
             "        self._apply_eviction_result(result)\n        lock.swa_released = True\n"),
        new="        lock.swa_released = True\n",
        models="release_swa (the decode's early release of a cached prefix's SWA lock once the window has "
               "moved past it) marks the lock released without releasing it: the unlock at the request's "
               "finish skips SWA, and the prefix's SWA stays locked after its request is gone",
    ),
    SGLangPatch(
        name="insert-forgets-swa-evicted-prefix",
        file="srt/mem_cache/unified_cache/components/swa.py",
        old=("        # that boundary so insertion creates a tombstone instead of live SWA KV.\n"
             "        insert_params.set_evicted_seqlen(\n"
             "            self.component_type, req.kv.get_evicted_seqlen(self.component_type)\n"),
        new=("        # that boundary so insertion creates a tombstone instead of live SWA KV.\n"
             "        insert_params.set_evicted_seqlen(\n"
             "            self.component_type, req.kv.cache_protected_len\n"),
        models="the SWA component's insert of a request into the tree forgets how far window eviction has "
               "freed the request's SWA: the range already freed is inserted as live SWA instead of a "
               "tombstone, so a tree node holds SWA slots the free list holds too (no answer reads them: "
               "they are out of every later request's window)",
    ),
)


def patch_catalogue() -> dict[str, SGLangPatch]:
    """Every planted SGLang patch, by name."""
    return {p.name: p for p in _CATALOGUE}


def package_dir(python: Path) -> Path:
    """The `sglang` package directory `python` imports (a patched mirror where it runs one)."""
    proc = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ReleaseError(f"{python}: cannot locate its sglang package")
    return Path(proc.stdout.strip()).parent


def _mirror(source: Path, target: Path, real_paths: set[Path]) -> None:
    """`target` mirrors `source`: real directories on `real_paths`, copies of the files to edit,
    symlinks for everything else (never `__pycache__`: bytecode of an edited file must not land
    in the venv's own cache)."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(source):
        rel = Path(entry.path)
        dest = target / entry.name
        if entry.name == "__pycache__":
            continue
        if rel in real_paths and entry.is_dir(follow_symlinks=False):
            _mirror(rel, dest, real_paths)
        elif rel in real_paths:
            dest.write_bytes(rel.read_bytes())
        else:
            dest.symlink_to(entry.path)


def patch_mirror(package: Path, site: Path, version: str, patch_names: tuple[str, ...] = (),
                 diffs: tuple[str, ...] = ()) -> str:
    """Mirror the installed `package` (a `sglang` directory) as `site/sglang`, then apply the
    catalogue's `patch_names` and the unified `diffs` (paths) to the mirror, in that order;
    return the combined diff. `package` itself is never written."""
    catalogue = patch_catalogue()
    unknown = [n for n in patch_names if n not in catalogue]
    if unknown:
        raise ReleaseError(f"unknown SGLang patch {', '.join(unknown)}; known: {', '.join(sorted(catalogue))}")
    patches = [catalogue[n] for n in patch_names]
    texts = {diff: read_diff(diff) for diff in diffs}
    sections: list[tuple[str, DiffSection]] = [
        (Path(diff).name, section) for diff, text in texts.items() for section in diff_sections(text, Path(diff).name)]
    real: set[Path] = set()
    for patch in patches:
        path = package / patch.file
        if not path.is_file():
            raise ReleaseError(f"patch {patch.name}: SGLang {version} has no {patch.file}")
        real.update([path, *path.parents])
    for _, section in sections:
        for name in section.files:
            path = package / name
            real.update([path, *path.parents])  # a new file: its existing parents become real
    _mirror(package, site / "sglang", real)
    combined = "".join(p.apply(site / "sglang", version) for p in patches)
    for name, section in sections:
        apply_section(site, section, name, version)
    for text in texts.values():
        combined += text if not text or text.endswith("\n") else text + "\n"
    return combined


def patched_interpreter(python: Path, version: str, patch_names: tuple[str, ...], workdir: Path,
                        diffs: tuple[str, ...] = ()) -> tuple[Path, str]:
    """A wrapper interpreter running `python` with its sglang patched by `patch_names` and then
    the unified `diffs` (paths), under `workdir`; returns it and the combined diff. An empty
    diff applies nothing: the wrapper then runs the release as it is."""
    site = workdir / "site"
    diff = patch_mirror(package_dir(python), site, version, patch_names, diffs)
    wrapper = workdir / "bin" / "python"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{python}" "$@"\n',
                       encoding="utf-8")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper, diff
