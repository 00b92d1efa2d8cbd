"""How the suite launches SGLang's server for one engine configuration: its argv and environment.

Every knob of a scenario's engine section either maps onto a flag or variable of
`sglang.launch_server`, or is refused by `refusals` with the field named (what SGLang's server
cannot express; `canary validate` reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine_stub.config import EngineConfig

__all__ = ["INVARIANT_LEVELS", "ServerLaunch", "import_env", "plugin_pythonpath", "refusals"]

# SGLANG_INVARIANT_CHECK: 0 off, 1 warn (count and log), 2 strict (raise).
INVARIANT_LEVELS = {"off": "0", "warn": "1", "strict": "2"}


def refusals(config: EngineConfig) -> list[tuple[str, str]]:
    """(field, why) for each knob of `config` SGLang's server cannot take as the scenario means it."""
    found = []
    if config.memory != "native":
        found.append(("memory", "the server runs its own memory path: `memory` does not apply"))
    if config.full_pool_tokens % config.page_size or config.swa_pool_tokens % config.page_size:
        found.append(("full_pool_tokens", "pool sizes must be whole pages for SGLang's paged allocator"))
    return found


@dataclass(frozen=True)
class ServerLaunch:
    """The command line and environment of one server (one engine configuration)."""

    config: EngineConfig
    model_dir: Path
    port: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        problems = refusals(self.config)
        if problems:
            raise ValueError("; ".join(f"{field}: {why}" for field, why in problems))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    def argv(self, python: str) -> list[str]:
        """The command line of a fresh server."""
        return [python, "-m", "sglang.launch_server", *self.args()]

    def args(self) -> list[str]:
        """`sglang.launch_server`'s arguments (what a warm parent's fork runs with)."""
        c = self.config
        ratio = c.swa_pool_tokens / c.full_pool_tokens
        args = ["--model-path", str(self.model_dir), "--load-format", "dummy", "--skip-tokenizer-init",
                "--device", self.device, "--dtype", "float32",
                "--context-length", str(c.max_context_len),
                "--max-total-tokens", str(c.full_pool_tokens),
                "--swa-full-tokens-ratio", f"{ratio:.6f}",
                "--page-size", str(c.page_size),
                "--max-running-requests", str(c.max_running_requests),
                "--max-prefill-tokens", str(c.max_prefill_tokens),
                "--random-seed", str(c.seed),
                # The scenario's requests are the first the server sees: no warm-up request of its
                # own runs its memory path (or trips its idle check) before the workload.
                "--skip-server-warmup",
                "--host", "127.0.0.1", "--port", str(self.port)]
        # The chunk our engine would use (auto resolved against the SWA pool), -1: never chunk.
        chunk = c.prefill_chunk_tokens
        args += ["--chunked-prefill-size", str(chunk if chunk is not None else -1)]
        if not c.radix_cache:
            args.append("--disable-radix-cache")
        if c.kv_canary != "off":
            # Our canary hashes the real K/V of every slot it verifies (kv_canary.verify_real_kv_hash):
            # SGLang's does so only with --kv-canary-real-data.
            args += ["--kv-canary", c.kv_canary, "--kv-canary-sweep-interval", str(c.kv_canary_sweep_interval),
                     "--kv-canary-real-data", "all"]
        if self.device == "cpu":
            # The only attention and sampling backends SGLang has for a CPU without AMX; CUDA
            # graphs do not exist there.
            args += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                     "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
        return args

    def env(self, plugin_dir: Path, repo_root: Path) -> dict[str, str]:
        """What the server's processes get on top of the caller's environment."""
        env = {
            "SGLANG_INVARIANT_CHECK": INVARIANT_LEVELS[self.config.invariant_check],
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1" if self.config.strict_mem_check_during_idle else "0",
            "PYTHONPATH": plugin_pythonpath(plugin_dir, repo_root),
            "PYTHONUNBUFFERED": "1",
            # The engine's window-eviction cadence (a request evicts once a window past its last
            # eviction, engine_stub/scheduler.py `swa_eviction_interval`): SGLang's default of 128
            # tokens would never slide the window of a library request (about 40 decoded).
            "SGLANG_SWA_EVICTION_INTERVAL": str(self.config.window),
        }
        env.update(import_env(self.device))
        return env


def plugin_pythonpath(plugin_dir: Path, repo_root: Path) -> str:
    """PYTHONPATH of every server process (and of the warm parent they fork from): the plugin
    directory first, so its sitecustomize runs in every SGLang process, then the suite."""
    return f"{plugin_dir}:{repo_root}"


def import_env(device: str) -> dict[str, str]:
    """The variables SGLang (and torch, Triton) read when their modules are imported: the same
    for a fresh server and for the warm parent its forked servers share (`fork_parent`)."""
    if device != "cpu":
        return {}
    return {
        # Without it SGLang takes the CUDA path for its CPU tensors (the rotary embedding then
        # imports vllm's ops); one intra-op thread, as every engine of the suite gets.
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        # The canary's phase checker and token scatter exist only as Triton kernels
        # (utils/phase_checker.py, kv_canary): Triton's interpreter runs them on a CPU. Read when
        # a kernel is defined, so set whether or not this server's canary is on.
        "TRITON_INTERPRET": "1",
        # The model's LayerNorm is torch.compile'd (models/commandr.py): on a CPU, inductor builds
        # and probes C++ kernels for 16-18 s at the first forward of every server. Eager runs the
        # same float32 ops on the memory path under test.
        "TORCHDYNAMO_DISABLE": "1",
    }
