"""The real-server runtime's building blocks: the CPU stand-ins SGLang's server needs here, the
tiny hybrid-SWA model it loads, and how a scenario's engine section becomes its command line.

The request-to-token writer is on the memory path under test, so it is checked against SGLang's
own Triton kernel (run in Triton's interpreter on the CPU, in SGLang 0.5.23's venv), not against
our reading of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canaries.sglang.releases.venvs import find_python
from canaries.sglang.server import cpu_standins
from canaries.sglang.server.launch import ServerLaunch, refusals
from canaries.sglang.server.model import ServerModel
from engine_stub.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]

KERNEL_SCRIPT = """
import torch
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.utils import next_power_of_2
from canaries.sglang.server.cpu_standins import assign_req_to_token_pool_cpu

generator = torch.Generator().manual_seed(2026)
for trial in range(12):
    batch = int(torch.randint(1, 6, (1,), generator=generator))
    rows, pool_len = 8, 64
    kernel_rows = torch.randint(0, 999, (rows, pool_len), generator=generator, dtype=torch.int32)
    standin_rows = kernel_rows.clone()
    req_pool_indices = torch.randperm(rows, generator=generator)[:batch]
    start = torch.randint(0, 40, (batch,), generator=generator)
    span = torch.randint(0, 24, (batch,), generator=generator)
    span[trial % batch] = 0  # an empty span among the others
    end = start + span
    out_cache_loc = torch.randint(1, 5000, (int(span.sum()),), generator=generator)
    assign_req_to_token_pool[(batch,)](req_pool_indices, kernel_rows, start, end, out_cache_loc,
                                       pool_len, next_power_of_2(batch))
    assign_req_to_token_pool_cpu(req_pool_indices, standin_rows, start, end, out_cache_loc, pool_len)
    assert not torch.equal(kernel_rows, standin_rows.new_zeros(standin_rows.shape))
    if not torch.equal(kernel_rows, standin_rows):
        raise SystemExit(f"trial {trial}: rows differ at {(kernel_rows != standin_rows).nonzero().tolist()}")
print("same")
"""


def test_assign_req_to_token_matches_sglang_triton_kernel() -> None:
    python = find_python("0.5.23")
    if python is None:
        pytest.skip("no venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # the Triton path, not the stand-in it would import
    proc = subprocess.run([str(python), "-W", "ignore", "-c", KERNEL_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "same"


def test_assign_req_to_token_writes_each_span_from_consecutive_slots() -> None:
    rows = torch.full((3, 8), -7, dtype=torch.int32)
    cpu_standins.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), rows, torch.tensor([1, 4]), torch.tensor([3, 7]),
        torch.tensor([10, 11, 20, 21, 22]), 8)
    assert rows[2].tolist() == [-7, 10, 11, -7, -7, -7, -7, -7]
    assert rows[0].tolist() == [-7, -7, -7, -7, 20, 21, 22, -7]
    assert rows[1].tolist() == [-7] * 8


def test_copy_all_layer_kv_cache_copies_rows_in_every_layer() -> None:
    layers = [torch.arange(40, dtype=torch.float32).reshape(10, 4) + 100 * i for i in range(2)]
    before = [layer.clone() for layer in layers]
    data_ptrs = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64)
    strides = torch.tensor([layer.stride(0) * layer.element_size() for layer in layers], dtype=torch.int64)
    # Row 1 takes row 2 and row 2 takes row 1: every source is read before any write.
    cpu_standins.copy_all_layer_kv_cache_cpu(data_ptrs, strides, torch.tensor([5, 1, 2]), torch.tensor([7, 2, 1]))
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[5], old[7])
        assert torch.equal(layer[1], old[2]) and torch.equal(layer[2], old[1])
        assert torch.equal(layer[[0, 3, 4, 6, 7, 8, 9]], old[[0, 3, 4, 6, 7, 8, 9]])


def test_install_provides_sgl_kernel_only_where_none_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    cpu_standins.install()
    module = sys.modules["sgl_kernel"]
    assert module.assign_req_to_token_pool_cpu is cpu_standins.assign_req_to_token_pool_cpu
    own = type(sys)("sgl_kernel")
    monkeypatch.setitem(sys.modules, "sgl_kernel", own)
    cpu_standins.install()
    assert sys.modules["sgl_kernel"] is own


def test_model_config_is_hybrid_swa_with_the_scenario_window(tmp_path: Path) -> None:
    config = EngineConfig(window=12, layer_pattern="SFSS", hidden_size=32, num_heads=2)
    written = json.loads((ServerModel.of(config).write(tmp_path / "m") / "config.json").read_text())
    assert written["sliding_window"] == 12
    assert written["hybrid_layer_pattern"] == [1, 0, 1, 1] and written["is_hybrid_swa"] is True
    assert written["layer_types"][1] == "full_attention"
    assert written["head_dim"] == 16 and written["num_hidden_layers"] == 4


def test_model_without_full_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="needs S and F"):
        ServerModel(window=8, layer_pattern="SSSS", hidden_size=32, num_heads=2, max_context_len=128)


def test_launch_maps_engine_knobs_to_server_flags_and_env(tmp_path: Path) -> None:
    config = EngineConfig(page_size=4, full_pool_tokens=256, swa_pool_tokens=64, max_context_len=128, radix_cache=False,
                          invariant_check="warn", strict_mem_check_during_idle=False, kv_canary="log",
                          kv_canary_sweep_interval=5, chunked_prefill_size=-1)
    launch = ServerLaunch(config, tmp_path, 31000)
    argv = launch.argv("python")
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag("--max-total-tokens") == "256" and float(flag("--swa-full-tokens-ratio")) == 0.25
    assert flag("--page-size") == "4" and flag("--chunked-prefill-size") == "-1"
    assert "--disable-radix-cache" in argv and flag("--kv-canary") == "log"
    assert flag("--kv-canary-sweep-interval") == "5"
    env = launch.env(tmp_path / "plugin", REPO)
    assert env["SGLANG_INVARIANT_CHECK"] == "1" and env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] == "0"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"].startswith(str(tmp_path / "plugin"))


def test_launch_refuses_knobs_the_server_cannot_express(tmp_path: Path) -> None:
    config = EngineConfig(memory="sglang")
    fields = [field for field, _ in refusals(config)]
    assert fields == ["memory"]
    with pytest.raises(ValueError, match="memory: the server runs its own memory path"):
        ServerLaunch(config, tmp_path, 31000)


def test_only_kinds_with_a_hook_in_sglangs_scheduler_are_placed_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from canaries.sglang import runtime as sglang_server
    from engine_stub.perturb.kinds import KINDS

    assert sglang_server.unsupported_kinds([{"kind": name} for name in KINDS]) == []
    monkeypatch.setattr(sglang_server, "HOOKED_SITES", ("before_step",))
    reasons = sglang_server.unsupported_kinds([{"kind": "skip_free_swa"}, {"kind": "no_such_kind"}])
    assert reasons[0].startswith("perturbations[0]: kind skip_free_swa acts at on_window_eviction")
    assert reasons[1] == "perturbations[1]: unknown kind 'no_such_kind'"


def test_server_oracle_reports_answers_that_differ_from_the_clean_servers(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from canaries.sglang.oracle import ServerOracle, mismatches

    plan = [SimpleNamespace(rid="r0", prompt=[1, 2], max_new_tokens=3), SimpleNamespace(rid="r1", prompt=[3], max_new_tokens=3)]
    oracle = ServerOracle(tmp_path, {"window": 8}, plan, reference="0.5.23 plain")
    calls = []

    def clean_run() -> list[dict]:
        calls.append(1)
        return [{"rid": "r0", "output_ids": [5, 6, 7]}, {"rid": "r1", "output_ids": [8, 9, 10]}]

    reference = oracle.reference(clean_run)
    assert oracle.reference(clean_run) == reference and len(calls) == 1  # computed once, then cached
    found = mismatches(reference, [{"rid": "r0", "output_ids": [5, 6, 7]}, {"rid": "r1", "output_ids": [8, 4, 10]},
                                   {"rid": "r2", "output_ids": None}])
    assert found == [{"rid": "r1", "first_diff": 1, "expected": [8, 9, 10], "got": [8, 4, 10]}]
    assert ServerOracle(tmp_path, {"window": 16}, plan, reference="0.5.23 plain").key != oracle.key


def test_swa_layers_read_through_the_mapping_and_full_layers_do_not() -> None:
    from types import SimpleNamespace

    class Pool:
        layers_mapping = {0: (0, False), 1: (0, True)}
        full_to_swa_index_mapping = torch.tensor([0, 5, 6, 7])

    class Backend:
        use_sliding_window_kv_pool = True

        def __init__(self) -> None:
            self.token_to_kv_pool = Pool()
            self.req_to_token_pool = SimpleNamespace(req_to_token=torch.tensor([[1, 2, 3]], dtype=torch.int32))

        def forward_extend(self, q, k, v, layer, forward_batch):
            return self.req_to_token_pool.req_to_token.tolist()

        def forward_decode(self, q, k, v, layer, forward_batch):
            return self.req_to_token_pool.req_to_token.tolist()

    cpu_standins.translate_swa_reads(Backend)
    cpu_standins.translate_swa_reads(Backend)  # idempotent
    backend = Backend()
    swa, full = SimpleNamespace(layer_id=1), SimpleNamespace(layer_id=0)
    assert backend.forward_extend(None, None, None, swa, None) == [[5, 6, 7]]
    assert backend.forward_decode(None, None, None, swa, None) == [[5, 6, 7]]
    assert backend.forward_decode(None, None, None, full, None) == [[1, 2, 3]]
    assert backend.req_to_token_pool.req_to_token.tolist() == [[1, 2, 3]]  # the pool's own rows, restored
