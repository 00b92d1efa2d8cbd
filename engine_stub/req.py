"""Req: one generation request and its place in the KV memory path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Req", "RequestRejected"]


class RequestRejected(ValueError):
    """The request can never be served with this engine config (the reason says why).

    `param` names the request field at fault (for the HTTP error body).
    """

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class Req:
    """A request. Lengths are in tokens; positions `[0, kv_len)` have KV in the pools.

    `cache_protected_len` positions came from the radix cache and stay the tree's;
    `swa_evicted_seqlen` is the window-eviction frontier: SWA peers below it are released (or, below
    `cache_protected_len`, the tree's business); admission starts it at `cache_protected_len`, and
    it only moves up.
    """

    rid: str
    origin_input_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    on_finish: Callable[[Req], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    row: int = 0
    kv_len: int = 0
    cache_protected_len: int = 0
    swa_evicted_seqlen: int = 0
    lock: Any = None
    # Positions whose KV slots are allocated (the current prefill chunk's end): the prompt's
    # length once its last chunk is scheduled. Below it and at or above kv_len: this step's chunk.
    prefill_end: int = 0
    # Tokens per prefill chunk, fixed at admission (None: not chunked): the engine's chunk size,
    # or less where a cache hit's locked window leaves less SWA room.
    chunk_size: int | None = None
    admitted_step: int = -1
    finished_step: int = -1
    finish_reason: str | None = None
    # Set by the engine when the client gave up; the scheduler finishes the request at its next
    # step. A plain bool: written from the server's thread, read from the engine's.
    abort_requested: bool = False

    def __post_init__(self) -> None:
        if not self.origin_input_ids:
            raise ValueError("a request needs at least one input token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        """Every prompt position has been scheduled (the request decodes from now on)."""
        return self.prefill_end >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
