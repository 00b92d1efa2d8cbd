"""The import check of an SGLang venv, run inside that venv (stdlib only; `python -m` or a path).

Imports what the project's SGLang code needs from the release (the memory-path adapters' modules,
the radix caches the release ships, the engine's HTTP stack) and proves torchvision's CPU ops
load. Prints one JSON object on stdout:

- success: `{"ok": true, "seconds": ..., "closure": {dist: [version, first_importer]}}`, the
  distributions whose modules the check imported, each with the module that first imported it;
- failure: `{"ok": false, "error": {...}}`: the exception's type and message, the missing module
  (ModuleNotFoundError), the module whose import statement failed, and the distributions that own
  the traceback's frames, innermost last.

The closure resolver (closure.py) reads it to decide what to install next, and records a
success's closure as the release's lock.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import sys
import time
import traceback
import warnings

# What the project imports from a release: engine_stub/mem/sglang_*.py and the local runtime's
# preload (canaries/runtime/local.py PRELOAD); each must import wherever the release ships it.
REQUIRED = (
    "torch",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.base_swa_memory_pool",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.utils.invariants",
    "sglang.srt.environ",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.unified_cache",
    "sglang.srt.mem_cache.unified_radix_cache",
    "fastapi",
    "uvicorn",
    "yaml",
)
# The engine's own modules, where the project is on the path (the resolver puts it there): their
# third-party imports are the engine's HTTP stack.
ENGINE = ("engine_stub.server", "engine_stub.forkserver", "engine_stub.mem.sglang_backend",
          "engine_stub.mem.sglang_tree", "engine_stub.mem.sglang_req_to_token")
# Imported where the release has them (0.5.23 has no swa_radix_cache).
OPTIONAL = ("sglang.srt.mem_cache.swa_radix_cache",)
# The `server` profile (CANARY_CLOSURE_PROFILE=server): what `python -m sglang.launch_server`
# imports as it starts, in its three processes, with SGLang's CPU engine on (as the suite
# launches it on a CPU: SGLANG_USE_CPU_ENGINE=1 and the project's stand-ins for sgl_kernel).
SERVER = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.commandr",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.common",
)
PROFILE_ENV = "CANARY_CLOSURE_PROFILE"


PROJECT = {"engine_stub", "canaries"}  # the project's own packages, on the path, never in a closure


class _FirstImporter:
    """A meta-path observer: for each top-level package, the module whose import first asked
    for it. It finds nothing itself."""

    seen: dict[str, str] = {}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in cls.seen:
            cls.seen[top] = _importer() or "(the check)"
        return None


def _importer() -> str:
    """The module whose code is running an import statement right now (frames of importlib
    and of this file skipped)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("importlib", "_frozen_importlib")) and frame.f_code.co_filename != __file__:
            return module
        frame = frame.f_back
    return ""


def _owners() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _closure(owners: dict[str, list[str]]) -> dict[str, list[str]]:
    closure: dict[str, list[str]] = {}
    for top in sorted({name.partition(".")[0] for name in list(sys.modules)} - PROJECT):
        for dist in owners.get(top, ()):
            key = dist.lower().replace("_", "-")
            if key not in closure:
                closure[key] = [metadata.version(dist), _FirstImporter.seen.get(top, "(the check)")]
    return closure


def _module_of(filename: str) -> str:
    """The dotted module a source file is, by its place under a sys.path entry ("" if none):
    modules that failed to import are gone from sys.modules, so their files are all there is."""
    path = os.path.abspath(filename)
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or ".") + os.sep
        if path.startswith(root) and len(root) > len(best):
            best = root
    if not best or not path.endswith(".py"):
        return ""
    parts = path[len(best):-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _failure(exc: BaseException, target: str, owners: dict[str, list[str]]) -> dict:
    dists, importer = [], ""
    for frame in traceback.extract_tb(exc.__traceback__):
        name = _module_of(frame.filename)
        if not name or name.startswith("importlib") or frame.filename == __file__:
            continue
        importer = name
        for dist in owners.get(name.partition(".")[0], ()):
            dists.append(dist.lower().replace("_", "-"))
    return {
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0][:500] if str(exc) else "",
        "missing": getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None,
        "importer": importer,
        "target": target,
        "dists": dists,
    }


def _uvicorn_startup() -> None:
    """What uvicorn imports as a server starts (its HTTP, websocket and lifespan protocols, the
    event loop), not at `import uvicorn`."""
    import uvicorn

    async def app(scope, receive, send):  # pragma: no cover - never called
        return None

    config = uvicorn.Config(app, log_level="warning")
    config.load()
    factory = getattr(config, "get_loop_factory", None)
    if factory is not None:
        factory()
    elif hasattr(config, "setup_event_loop"):
        config.setup_event_loop()


def _torchvision_ops() -> None:
    import torch
    import torchvision  # noqa: F401  (loads through the venv's CPU shim)
    from torchvision.ops import nms

    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float)
    kept = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
    assert kept == [0, 2], f"torchvision.ops.nms gave {kept}"


def main() -> int:
    warnings.filterwarnings("ignore")
    sys.meta_path.insert(0, _FirstImporter)
    started = time.perf_counter()
    target = ""
    server = os.environ.get(PROFILE_ENV) == "server"
    try:
        if server:
            target = "canaries.sglang.server.cpu_standins"
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            importlib.import_module(target).install()
        for target in REQUIRED + (SERVER if server else ()):
            importlib.import_module(target)
        # Asked only now: find_spec of a submodule imports its parents, and a parent that fails
        # there leaves importlib in a state that hides the real error.
        for target in [name for name in OPTIONAL if _ships(name)]:
            importlib.import_module(target)
        for target in ENGINE if _ships("engine_stub") else ():
            importlib.import_module(target)
        target = "uvicorn.Config.load"
        _uvicorn_startup()
        target = "torchvision.ops"
        _torchvision_ops()
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, none escapes
        print(json.dumps({"ok": False, "error": _failure(exc, target, _owners())}))
        return 1
    seconds = time.perf_counter() - started
    print(json.dumps({"ok": True, "seconds": round(seconds, 2), "closure": _closure(_owners())}))
    return 0


def _ships(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
