"""A warm parent for SGLang's server: its modules imported once, each server a fork of it.

    python -m canaries.sglang.server.fork_parent SOCKET

runs in the server venv, with the plugin directory first on PYTHONPATH and the environment SGLang
reads at import (`launch.IMPORT_ENV`). It imports what `sglang.launch_server` and the processes it
starts need, then serves `engine_stub.forkserver`'s protocol: each request forks a child (a session
of its own, the request's environment, stdout and stderr to its log) that runs the launch with the
request's arguments.

SGLang starts its scheduler and detokenizer with multiprocessing's "spawn", which imports
everything again in each (most of a fresh start on a CPU); in a forked server they are forked
too, already warm. Only on a CPU: a process that forks after CUDA is initialised is unsafe, and
this parent never touches a device.
"""

from __future__ import annotations

import importlib
import os
import sys

# What the launcher, its scheduler and detokenizer import before they serve (the model's module
# and the attention backend the CPU launch names among them).
PRELOAD = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.commandr",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.models.registry",  # imports every model module SGLang has, at each start
)

# What every server imported on its own after the fork (`py-spy record --subprocesses` over a
# library run: uvicorn's HTTP protocol alone was ~0.1 s of each start), where the release has it:
# its uvicorn protocol and loop, the distributed communicators its scheduler's parallel set-up
# imports, its tree core's Rust adapter, and the suite's census over SGLang's objects (with the tree reader
# and the component types its first census imports).
PRELOAD_IF_PRESENT = (
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.websockets.auto",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "anyio._backends._asyncio",
    "torch.profiler._cupti_monitor",
    "sglang.srt.rust_extensions",
    "sglang.srt.dllm.algorithm",
    "sglang.srt.mem_cache.rust_tree_core.adapter",
    "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang.srt.distributed.device_communicators.shm_broadcast",
    "sglang.srt.distributed.device_communicators.pymscclpp",
    "sglang.srt.distributed.device_communicators.torch_symm_mem",
    "sglang.srt.distributed.device_communicators.hpu_communicator",
    "sglang.srt.mem_cache.unified_cache.component_type",
    "sglang.srt.arg_groups.pipeline",
    "sglang.srt.arg_groups.moe_hook",
    "canaries.sglang.server.census",
    "canaries.sglang.server.sglang_view",
    "engine_stub.mem.sglang_tree",
)


def launch(argv: list[str]) -> int:
    """In a forked child: `python -m sglang.launch_server ARGV`, its processes forked, not spawned."""
    import multiprocessing

    from sglang import launch_server
    from sglang.srt.utils import kill_process_tree

    spawn_or_fork = multiprocessing.set_start_method

    def fork_start_method(method: str | None = None, force: bool = False) -> None:
        # SGLang asks for "spawn" (entrypoints/engine.py); its children fork from this warm
        # process instead. Only this child's copy of the module is changed.
        spawn_or_fork("fork", force=True)

    multiprocessing.set_start_method = fork_start_method
    launch_server.load_plugins()
    server_args = launch_server.prepare_server_args(argv)
    try:
        launch_server.run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


def main(socket_path: str) -> int:
    from canaries.sglang.server import scheduler_plugin
    from engine_stub import forkserver

    # Every server forked from here builds its scheduler in a process of its own: the plugin
    # watches for it (each child's environment names its event log).
    scheduler_plugin.install(always=True)
    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_IF_PRESENT:
        try:
            importlib.import_module(name)
        except ImportError:  # another release's layout: its servers import what they have
            pass
    return forkserver.serve(socket_path, main=launch)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m canaries.sglang.server.fork_parent SOCKET", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
