"""The `sglang` memory backend: SGLang's own allocator behind our engine, and the parity run.

These need an interpreter with sglang (scripts/make-sglang-venv.sh; CI makes .venv-sglang).
They skip, saying so, where none exists; the suite-side checks run everywhere. The per-release
tests run the adapter in each release's own venv (.venv-sglang-X, from
`bash scripts/make-sglang-venv.sh --version X`) and check what that release's source does.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaries.cli import main as canary

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "configs" / "scenarios"


def _sglang_python() -> str | None:
    for candidate in (os.environ.get("CANARY_SGLANG_PYTHON"), str(REPO / ".venv-sglang" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


SGLANG_PYTHON = _sglang_python()
needs_sglang = pytest.mark.skipif(SGLANG_PYTHON is None, reason="no interpreter with sglang: run "
                                  "scripts/make-sglang-venv.sh (or set CANARY_SGLANG_PYTHON)")

RELEASES = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
DEFAULT_RELEASE = "0.5.23"  # what scripts/make-sglang-venv.sh builds into .venv-sglang


def _installed_sglang(venv: Path) -> str | None:
    """The sglang version a venv holds (from its dist-info), or None."""
    found = sorted(venv.glob("lib/python*/site-packages/sglang-*.dist-info"))
    return found[0].name[len("sglang-"):-len(".dist-info")] if found else None


def release_python(version: str) -> str | None:
    """The interpreter of a venv holding sglang `version`: .venv-sglang-X (or, for the default
    release, .venv-sglang), its installed version checked."""
    venvs = [REPO / f".venv-sglang-{version}"]
    if version == DEFAULT_RELEASE:
        venvs.append(REPO / ".venv-sglang")
    for venv in venvs:
        python = venv / "bin" / "python"
        if python.is_file() and _installed_sglang(venv) == version:
            return str(python)
    return None


RELEASE_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {repo!r})
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.mem.sglang_backend import (SGLangSWAAllocator, set_sglang_level, sglang_crash_invariant,
                                            sglang_version)


def make(page_size=1, full=64, swa=32):
    pool = HybridKVPool(layer_pattern="SFSS", full_size=full, swa_size=swa, page_size=page_size,
                        num_heads=2, head_dim=4)
    return SGLangSWAAllocator(full, swa, page_size, "cpu", kvcache=pool), pool


def sizes(a):
    return [a.full_available_size(), a.swa_available_size()]


def counted(name):
    names, values = SGLangSWAAllocator.invariant_counters()
    return 0 if values is None else sum(v for n, v in zip(names, values.tolist()) if n == name)


set_sglang_level("warn")
out = {{"version": sglang_version()}}
a, pool = make()
out["mapping_shared"] = pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
slots = a.alloc(8)
out["paired"] = bool((a.translate_loc_from_full_to_swa(slots) > 0).all())
out["after_alloc"] = sizes(a)
out["group_outside"] = a.free_group is None
a.free_group_begin()
out["group_inside"] = a.free_group is not None
a.free(slots)
a.free_group_end()
out["after_free"] = sizes(a)
try:
    a.backup_state()
    out["backup_state"] = "native"
except NotImplementedError:
    out["backup_state"] = "refused"

# A request whose window slid past 4 of its 6 slots, then finished: free_swa, free_full + free.
slots = a.alloc(6)
a.free_swa(slots[:4])
out["after_slide"] = sizes(a)
a.free_group_begin()
a.free_full(slots[:4])
a.free(slots[4:])
a.free_group_end()
out["after_finish"] = sizes(a)
out["finish_mapping"] = int(a.full_to_swa_index_mapping[slots].abs().sum())
out["finish_peer_released"] = counted("swa.peer_released")

# free_full of slots whose SWA peers are still mapped (a caller that wanted free).
slots = a.alloc(3)
a.free_full(slots)
out["live_peers"] = sizes(a)
out["live_peers_peer_released"] = counted("swa.peer_released")

# free_swa over a stripped mapping entry (a caller that wanted free_full).
b, _ = make()
slots = b.alloc(2)
b.clear_full_to_swa_mapping(slots[:1])
try:
    b.free_swa(slots)
    out["stripped"] = {{"raised": None, "sizes": sizes(b), "peer_mapped": counted("swa.peer_mapped")}}
except RuntimeError as exc:
    out["stripped"] = {{"raised": sglang_crash_invariant(exc)}}
out["buckets"] = {{n: SGLangSWAAllocator.invariant_bucket(n) for n in ("swa.peer_mapped", "swa.peer_released")}}

try:
    c, _ = make(16, 128, 64)
    got = c.alloc_extend([0], [20], torch.tensor([-1]), 20)
    out["page16"] = "allocated" if got is not None and got.numel() == 20 else "failed"
except NotImplementedError:
    out["page16"] = "refused"
print(json.dumps(out))
"""

# What each release's own source does (see the table in engine_stub/mem/sglang_backend.py).
# live_peers: free_full of slots still paired. 0.5.18 has no free_full: its `free` takes the peers
# too; 0.5.19's free_full strands them; 0.5.20 on strands them and counts swa.peer_released.
LIVE_PEERS = {"0.5.18": ([64, 32], 0), "0.5.19": ([64, 29], 0), "0.5.20": ([64, 29], 3),
              "0.5.21": ([64, 29], 3), "0.5.22": ([64, 29], 3), "0.5.23": ([64, 29], 3)}
# swa.peer_mapped is registered from 0.5.20 (FATAL_UNCONTAINABLE: at warn it crashes); before,
# free_swa filters the zero entry out and the stripped slot's peer leaks.
PEER_MAPPED_FROM = "0.5.20"
# Pages on a CPU device: from 0.5.22 the paged allocator has a torch path beside its Triton kernels
# (allocator/paged.py `use_triton_kernels`).
PAGES_ON_CPU_FROM = "0.5.22"


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@functools.cache
def _observe(version: str) -> dict:
    python = release_python(version)
    if python is None:
        made = ("bash scripts/make-sglang-venv.sh (.venv-sglang) or " if version == DEFAULT_RELEASE else "")
        pytest.skip(f"no venv with sglang {version}: run {made}"
                    f"bash scripts/make-sglang-venv.sh --version {version}")
    proc = subprocess.run([python, "-c", RELEASE_SCRIPT.format(repo=str(REPO))],
                          capture_output=True, text=True, check=False, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    observed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert observed["version"] == version
    return observed


@pytest.mark.parametrize("version", RELEASES)
def test_alloc_then_free_returns_every_slot_to_both_pools(version: str) -> None:
    seen = _observe(version)
    assert seen["mapping_shared"] and seen["paired"]
    assert seen["after_alloc"] == [56, 24] and seen["after_free"] == [64, 32]
    assert seen["group_outside"] and seen["group_inside"]


@pytest.mark.parametrize("version", RELEASES)
def test_backup_state_where_the_release_has_none_raises_not_implemented(version: str) -> None:
    assert _observe(version)["backup_state"] == "refused"  # none of the four has one


@pytest.mark.parametrize("version", RELEASES)
def test_free_full_after_the_window_slid_releases_only_the_full_side(version: str) -> None:
    seen = _observe(version)
    assert seen["after_slide"] == [58, 30]
    assert seen["after_finish"] == [64, 32] and seen["finish_mapping"] == 0
    assert seen["finish_peer_released"] == 0


@pytest.mark.parametrize("version", RELEASES)
def test_free_full_of_live_peers_frees_or_strands_them_as_the_release_does(version: str) -> None:
    seen = _observe(version)
    assert (seen["live_peers"], seen["live_peers_peer_released"]) == LIVE_PEERS[version]


@pytest.mark.parametrize("version", RELEASES)
def test_free_swa_of_a_stripped_mapping_fires_peer_mapped_only_from_0_5_20(version: str) -> None:
    seen = _observe(version)
    if _release_key(version) >= _release_key(PEER_MAPPED_FROM):
        assert seen["stripped"] == {"raised": "swa.peer_mapped"}
        assert seen["buckets"] == {"swa.peer_mapped": "FATAL_UNCONTAINABLE", "swa.peer_released": "GUARD"}
    else:  # the zero entry is filtered out: one peer back, the stripped one leaked, nothing counted
        assert seen["stripped"] == {"raised": None, "sizes": [62, 31], "peer_mapped": 0}
        assert seen["buckets"] == {"swa.peer_mapped": None, "swa.peer_released": None}


@pytest.mark.parametrize("version", RELEASES)
def test_alloc_extend_of_pages_on_cpu_is_refused_without_a_cpu_path(version: str) -> None:
    seen = _observe(version)
    expected = "allocated" if _release_key(version) >= _release_key(PAGES_ON_CPU_FROM) else "refused"
    assert seen["page16"] == expected


ADAPTER_SCRIPT = """
import sys, torch
sys.path.insert(0, {repo!r})
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.mem.sglang_backend import SGLangSWAAllocator, sglang_version
pool = HybridKVPool(layer_pattern="SFSS", full_size=64, swa_size=32, page_size=1, num_heads=2, head_dim=4)
a = SGLangSWAAllocator(64, 32, 1, "cpu", kvcache=pool)
assert pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
slots = a.alloc(8)
peers = a.translate_loc_from_full_to_swa(slots)
assert (peers > 0).all() and a.full_available_size() == 56 and a.swa_available_size() == 24
a.free_group_begin(); a.free(slots); a.free_group_end()
assert a.full_available_size() == 64 and a.swa_available_size() == 32
print(sglang_version())
"""


def test_memory_sglang_without_sglang_is_a_usage_error(capsys) -> None:
    code = canary(["run", str(LIBRARY / "clean-page1-radix.yaml"), "--memory", "sglang",
                   "--engine-python", sys.executable])
    if code == 2:
        assert "cannot import SGLang's allocator" in capsys.readouterr().err
    else:  # this interpreter has sglang itself: the run went through
        assert code in (0, 1)


@needs_sglang
def test_adapter_pairs_and_frees_through_sglangs_allocator() -> None:
    proc = subprocess.run([SGLANG_PYTHON, "-c", ADAPTER_SCRIPT.format(repo=str(REPO))],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("0.5")


@needs_sglang
@pytest.mark.slow
def test_sglangs_own_invariant_fires_into_our_event_log(tmp_path) -> None:
    report = tmp_path / "run"
    code = canary(["run", str(LIBRARY / "strip-mapping-page1.yaml"), "--memory", "sglang",
                   "--engine-python", SGLANG_PYTHON, "--report-dir", str(report)])
    assert code == 0
    events = (report / "strip-mapping-page1" / "events.jsonl").read_text()
    assert '"swa.peer_mapped"' in events and '"memory": "sglang"' in events


@needs_sglang
@pytest.mark.slow
def test_parity_of_a_selection_has_no_unexplained_difference(tmp_path, capsys) -> None:
    code = canary(["parity", "--engine-python", SGLANG_PYTHON, "-k",
                   "clean-page1 or strip-mapping-page1 or double-free-full-noradix or revert",
                   "--jobs", "2", "--report-dir", str(tmp_path / "parity")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 unexplained" in out
    assert "| double-free-full-noradix | DETECTED | WRONG_DETECTOR |" in out
