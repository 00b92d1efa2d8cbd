"""Runtimes: where an engine under test runs (a local subprocess, or a container)."""

from __future__ import annotations

from canaries.runtime.local import LocalRuntime

__all__ = ["LocalRuntime", "RUNTIMES", "get_runtime"]

RUNTIMES = ("local", "docker", "sglang-server")


def get_runtime(name: str, **kwargs):
    """A new runtime instance by name; raises ValueError naming the valid runtimes."""
    if name == "local":
        return LocalRuntime(**kwargs)
    if name == "docker":
        from canaries.runtime.docker import DockerRuntime

        return DockerRuntime(**kwargs)
    if name == "sglang-server":
        from canaries.sglang.runtime import SGLangServerRuntime

        return SGLangServerRuntime(**kwargs)
    raise ValueError(f"unknown runtime {name!r}; valid runtimes: {', '.join(RUNTIMES)}")
