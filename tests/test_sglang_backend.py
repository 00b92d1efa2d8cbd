"""The `sglang` memory backend: SGLang's own allocator behind our engine, and the parity run.

These need an interpreter with sglang (scripts/make-sglang-venv.sh; CI makes .venv-sglang).
They skip, saying so, where none exists; the suite-side checks run everywhere.
"""

from __future__ import annotations

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
