"""`memory: sglang`'s radix tree and request-row table: SGLang's own, behind our interfaces.

Each release's tree is driven through the adapter (engine_stub/mem/sglang_tree.py) in that
release's own venv (.venv-sglang-X from `bash scripts/make-sglang-venv.sh --version X`; 0.5.23
also .venv-sglang from `bash scripts/make-sglang-venv.sh`), in one subprocess per release whose
observations the tests below read. They skip, naming the script, where the venv is missing or
cannot import the release's unified radix cache. The end-to-end tests run library scenarios
with `radix_cache: true` on `memory: sglang`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from canaries.cli import main as canary

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "configs" / "scenarios"
RELEASES = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
DEFAULT_RELEASE = "0.5.23"  # what scripts/make-sglang-venv.sh builds into .venv-sglang
WINDOW = 16


def _installed(python: str) -> str | None:
    proc = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, check=False, timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else None


@functools.cache
def release_python(version: str) -> str | None:
    """An interpreter holding sglang `version`: .venv-sglang-X, for the default release also
    .venv-sglang or $CANARY_SGLANG_PYTHON."""
    candidates = [REPO / f".venv-sglang-{version}" / "bin" / "python"]
    if version == DEFAULT_RELEASE:
        candidates.append(REPO / ".venv-sglang" / "bin" / "python")
        if os.environ.get("CANARY_SGLANG_PYTHON"):
            candidates.insert(0, Path(os.environ["CANARY_SGLANG_PYTHON"]))
    for python in candidates:
        if python.is_file() and _installed(str(python)) == version:
            return str(python)
    return None


def _skip_without(version: str) -> str:
    python = release_python(version)
    if python is None:
        made = "bash scripts/make-sglang-venv.sh (.venv-sglang) or " if version == DEFAULT_RELEASE else ""
        pytest.skip(f"no venv with sglang {version}: run {made}bash scripts/make-sglang-venv.sh --version {version}")
    return python


TREE_SCRIPT = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {repo!r})
import torch
try:
    from engine_stub.mem.sglang_tree import SGLangRadixCache
    from engine_stub.mem.sglang_req_to_token import SGLangReqToTokenPool
except ModuleNotFoundError as exc:
    print(json.dumps({{"missing": str(exc)}}))
    raise SystemExit(0)
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.mem.sglang_backend import SGLangSWAAllocator, sglang_version
from engine_stub.req import Req

W, FULL, SWA = {window}, 256, 96
pool = HybridKVPool(layer_pattern="SFSS", full_size=FULL, swa_size=SWA, page_size=1, num_heads=2, head_dim=4)
a = SGLangSWAAllocator(FULL, SWA, 1, "cpu", kvcache=pool)
rows = SGLangReqToTokenPool(4, 128)
t = SGLangRadixCache(a, rows, 1, W)
out = {{"version": sglang_version(), "tree_core": t.tree_core_name}}


def ledger():
    a.merge_and_sort_free()
    return [a.full_available_size() + t.full_evictable_size() + t.full_protected_size() - a.size_full,
            a.swa_available_size() + t.swa_evictable_size() + t.swa_protected_size() - a.size_swa]


def grouped(call, *args):
    a.free_group_begin()
    try:
        return call(*args)
    finally:
        a.free_group_end()


def live(path):
    return int(path.swa_live.sum())


def outcome(call, error):
    try:
        call()
    except error:
        return "refused"
    return "accepted"


A = list(range(100, 140))
slots_a = a.alloc(40)
out["insert_new"] = t.insert(A, slots_a, prev_prefix_len=0, swa_evicted_seqlen=0)
m = t.match_prefix(A[:39])
out["match"] = [m.matched_len, bool(torch.equal(m.slots, slots_a[:39]))]
out["ledger_after_insert"] = ledger()

lock = t.inc_lock_ref(m.last_node)
out["locked"] = [t.full_protected_size(), t.swa_protected_size(), t.locked_slots(lock).numel()]
out["evicted_while_locked"] = list(grouped(t.evict, 1000, 1000))
out["held_while_locked"] = t.held_slots().numel()
t.dec_lock_ref(lock)
out["released_twice"] = outcome(lambda: t.dec_lock_ref(lock), RuntimeError)
out["unlocked"] = [t.full_protected_size(), t.swa_protected_size()]

out["ledger_after_lock"] = ledger()

# Everything evicted: the pools get every slot back.
grouped(t.evict, 1000, 1000)
out["after_full_evict"] = [t.total_size(), a.full_available_size(), a.swa_available_size(), t.sanity_check()]

# A duplicate insert: the incoming copy is freed, the tree keeps its own slots.
slots_a = a.alloc(40)
t.insert(A, slots_a, prev_prefix_len=0, swa_evicted_seqlen=0)
before = a.full_available_size()
copy = a.alloc(40)
out["insert_duplicate"] = [grouped(lambda: t.insert(A, copy, prev_prefix_len=0, swa_evicted_seqlen=0)),
                           a.full_available_size() - before, ledger()]

# A window-evicted insert: the request freed the SWA of [0, 24) first; the head is a tombstone.
B = list(range(200, 240))
slots_b = a.alloc(40)
grouped(a.free_swa, slots_b[:24])
t.insert(B, slots_b, prev_prefix_len=0, swa_evicted_seqlen=24)
paths = {{tuple(p.slots[:1].tolist()): p for p in t.cached_paths()}}
pb = paths[(int(slots_b[0]),)]
out["tombstone_head"] = [pb.slots.numel(), live(pb), bool(pb.swa_live[:24].any()), t.sanity_check()]
out["match_short_of_window"] = t.match_prefix(B[:39]).matched_len
out["match_full_window"] = t.match_prefix(B + [7]).matched_len
out["ledger_after_tombstone"] = ledger()

# SWA eviction tombstones (or drops) what no lock holds; a new copy brings the SWA back.
grouped(t.evict, 0, SWA)
out["after_swa_evict"] = [a.swa_available_size(), t.match_prefix(A[:39]).matched_len, t.sanity_check(), ledger()]
fresh = a.alloc(40)
t.insert(A, fresh, prev_prefix_len=0, swa_evicted_seqlen=0)
m = t.match_prefix(A[:39])
out["after_recovery"] = [m.matched_len, t.sanity_check(), ledger()]

# A chunked prompt: two chunks cached as it goes, the lock moving along; then its finish.
C = list(range(300, 348))
first = a.alloc(16)
r1 = t.cache_unfinished(C[:16], first, prev_prefix_len=0, swa_evicted_seqlen=0, lock=None)
second = a.alloc(16)
r2 = t.cache_unfinished(C[:32], torch.cat([r1.slots, second]), prev_prefix_len=r1.protected_len,
                        swa_evicted_seqlen=0, lock=r1.lock)
out["chunks"] = [r1.protected_len, r2.protected_len, r1.lock.released, r2.lock.released,
                 t.full_protected_size() >= 32, bool(torch.equal(r2.slots[:16], r1.slots))]
third = a.alloc(16)
t.insert(C, torch.cat([r2.slots, third]), prev_prefix_len=r2.protected_len, swa_evicted_seqlen=0)
t.dec_lock_ref(r2.lock)
out["after_chunked_finish"] = [t.full_protected_size(), t.swa_protected_size(), t.match_prefix(C[:47]).matched_len,
                               t.sanity_check(), ledger()]

# The early SWA release: SGLang's opt-in, off by default.
m = t.match_prefix(A[:39])
lock = t.inc_lock_ref(m.last_node)
swa_locked = t.swa_protected_size()
t.dec_swa_lock_only(lock)
out["swa_release_default"] = [lock.swa_released, t.swa_protected_size() == swa_locked]
os.environ[t.release.early_swa_release_env] = "1"
t.dec_swa_lock_only(lock)
out["swa_release_opted_in"] = [lock.swa_released, t.swa_protected_size() < swa_locked]
del os.environ[t.release.early_swa_release_env]
out["idle_with_a_lock"] = t.sanity_check()
t.dec_lock_ref(lock)
out["idle_after_release"] = [t.full_protected_size(), t.swa_protected_size(), t.sanity_check(), ledger()]

# The request rows: SGLang's own pool.
r0, r1_ = Req("r0", [1, 2, 3], 1), Req("r1", [4, 5], 1)
got = rows.alloc([r0, r1_])
rows.write(r0.row, 0, torch.tensor([7, 8, 9]))
out["rows"] = [sorted(got), got == [r0.row, r1_.row], rows.available_size(),
               rows.req_to_token[r0.row, :3].tolist(), str(rows.req_to_token.dtype)]
rows.free(r0)
rows.free(r1_)
out["row_freed_twice"] = outcome(lambda: rows.free(r0), ValueError)
out["rows_after_free"] = [rows.available_size(), r0.row]
print(json.dumps(out))
"""


@functools.cache
def _observe(version: str) -> dict:
    python = _skip_without(version)
    proc = subprocess.run([python, "-c", TREE_SCRIPT.format(repo=str(REPO), window=WINDOW)],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    observed = json.loads(proc.stdout.strip().splitlines()[-1])
    if "missing" in observed:
        pytest.skip(f"the sglang {version} venv cannot import the radix cache ({observed['missing']}): "
                    f"rebuild it with bash scripts/make-sglang-venv.sh --version {version}")
    assert observed["version"] == version
    return observed


@pytest.mark.parametrize("version", RELEASES)
def test_match_after_insert_returns_the_inserted_slots(version: str) -> None:
    seen = _observe(version)
    assert seen["insert_new"] == 0
    assert seen["match"] == [39, True]
    assert seen["ledger_after_insert"] == [0, 0]
    # The release's default tree core: Python up to 0.5.20, the bundled Rust one from 0.5.21.
    python_core = version in ("0.5.18", "0.5.19", "0.5.20")
    assert seen["tree_core"] == ("UnifiedTreeCore" if python_core else "RustUnifiedTreeCore")


@pytest.mark.parametrize("version", RELEASES)
def test_lock_protects_the_prefix_from_eviction_until_released(version: str) -> None:
    seen = _observe(version)
    full_locked, swa_locked, locked_slots = seen["locked"]
    assert full_locked == locked_slots == 39
    assert swa_locked >= WINDOW  # SGLang locks whole nodes back to a window
    assert seen["held_while_locked"] >= 39
    assert seen["released_twice"] == "refused"
    assert seen["unlocked"] == [0, 0]
    assert seen["ledger_after_lock"] == [0, 0]


@pytest.mark.parametrize("version", RELEASES)
def test_evict_everything_returns_every_slot_to_both_pools(version: str) -> None:
    seen = _observe(version)
    assert seen["after_full_evict"] == [0, 256, 96, []]


@pytest.mark.parametrize("version", RELEASES)
def test_insert_of_a_cached_sequence_frees_the_incoming_copy(version: str) -> None:
    seen = _observe(version)
    cached, freed_back, ledger = seen["insert_duplicate"]
    assert cached == 40 and freed_back == 0 and ledger == [0, 0]


@pytest.mark.parametrize("version", RELEASES)
def test_insert_below_the_frontier_makes_a_tombstone_head(version: str) -> None:
    seen = _observe(version)
    n, live, head_live, problems = seen["tombstone_head"]
    assert (n, live, head_live, problems) == (40, 16, False, [])
    assert seen["ledger_after_tombstone"] == [0, 0]


@pytest.mark.parametrize("version", RELEASES)
def test_match_short_of_a_live_window_is_refused(version: str) -> None:
    seen = _observe(version)
    assert seen["match_short_of_window"] == 0
    assert seen["match_full_window"] == 40


@pytest.mark.parametrize("version", RELEASES)
def test_swa_eviction_then_a_new_copy_restores_the_match(version: str) -> None:
    seen = _observe(version)
    swa_available, match_len, problems, ledger = seen["after_swa_evict"]
    assert swa_available == 96 and match_len == 0 and problems == [] and ledger == [0, 0]
    assert seen["after_recovery"] == [39, [], [0, 0]]


@pytest.mark.parametrize("version", RELEASES)
def test_cache_unfinished_moves_the_lock_to_the_processed_part(version: str) -> None:
    seen = _observe(version)
    assert seen["chunks"] == [16, 32, True, False, True, True]
    assert seen["after_chunked_finish"] == [0, 0, 47, [], [0, 0]]


@pytest.mark.parametrize("version", RELEASES)
def test_early_swa_release_happens_only_when_opted_in(version: str) -> None:
    seen = _observe(version)
    assert seen["swa_release_default"] == [False, True]
    assert seen["swa_release_opted_in"] == [True, True]


@pytest.mark.parametrize("version", RELEASES)
def test_sanity_check_names_a_lock_left_at_idle(version: str) -> None:
    seen = _observe(version)
    assert any("protected at idle" in p for p in seen["idle_with_a_lock"])
    assert seen["idle_after_release"] == [0, 0, [], [0, 0]]


@pytest.mark.parametrize("version", RELEASES)
def test_request_rows_come_from_sglangs_pool_and_go_back(version: str) -> None:
    seen = _observe(version)
    got, in_order, available, written, dtype = seen["rows"]
    assert got == [3, 4] and in_order and available == 2  # SGLang pops rows from the tail
    assert written == [7, 8, 9] and dtype == "torch.int32"
    assert seen["row_freed_twice"] == "refused"
    assert seen["rows_after_free"] == [4, 0]


# Library scenarios with a radix cache that pass on SGLang's own tree in every release, as on
# ours (page size 1: only 0.5.23's paged allocator has a CPU path): evictions that must keep a
# later hit, a prompt cached chunk by chunk, cache hits, a lock leaked at idle, the canary's sweep
# of the cached paths.
E2E = ("clean-radix-full-evict-keeps-hits", "clean-chunked-page1-radix", "clean-cache-hits",
       "leak-cache-hit-locked-idle", "flip-kv-cached-sweep")


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_radix_scenarios_on_sglangs_tree_pass_end_to_end(version: str, tmp_path: Path, capsys) -> None:
    python = _skip_without(version)
    seen = _observe(version)  # skips where the venv cannot import the tree
    assert seen["version"] == version
    report = tmp_path / "run"
    code = canary(["run", *(str(LIBRARY / f"{name}.yaml") for name in E2E), "--memory", "sglang",
                   "--engine-python", python, "--jobs", "2", "--report-dir", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    start = next(line for line in (report / E2E[0] / "events.jsonl").read_text().splitlines()
                 if '"engine_start"' in line)
    assert '"memory": "sglang"' in start


def test_leaf_paths_read_a_stored_minus_one_slot_as_a_slot_not_as_the_root() -> None:
    """The walk's previous slot is -1 for a row that starts at the root and for a row after a
    stored -1 (a corrupted row inserted into the tree): positions tell them apart, so the slots
    past a stored -1 stay on their path (the census reads them)."""
    from engine_stub.mem.sglang_tree import _leaf_paths

    # root -> 5, 6, -1, 8 (one node); a branch 9 after 6; a second root child 20, 21.
    slots = [5, 6, -1, 8, 9, 20, 21]
    prev = [-1, 5, 6, -1, 6, -1, 20]
    positions = [0, 1, 2, 3, 2, 0, 1]
    assert _leaf_paths(slots, prev, positions) == [[5, 6, -1, 8], [5, 6, 9], [20, 21]]
    # An evicted node spans its key with no slots: the child's position jumps past it.
    assert _leaf_paths([5, 6, 7], [-1, 5, 6], [0, 1, 4]) == [[5, 6, 7]]
