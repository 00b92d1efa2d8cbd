"""The submit-time refusal rule (torch-free): which requests this engine config can never serve.

`Scheduler.check_fits` raises `RequestRejected` (an HTTP 400) from it; `canary validate` asks
it of the requests a scenario's workload must send, so a refusal is seen before a run.
"""

from __future__ import annotations

from engine_stub.config import EngineConfig

__all__ = ["full_reserve", "refusal"]


def full_reserve(page_size: int, new_tokens: int) -> int:
    """Full slots a request keeps in reserve for `new_tokens` more tokens (plus one page)."""
    return -(-new_tokens // page_size) * page_size + page_size


def refusal(config: EngineConfig, prompt_len: int, max_new_tokens: int) -> tuple[str, str] | None:
    """(message, the request field at fault) if `config` could never serve such a request;
    None if it can."""
    if prompt_len + max_new_tokens > config.max_context_len:
        return (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_context_len={config.max_context_len}",
                # The prompt is at fault only if it leaves no room for a single new token.
                "prompt" if prompt_len >= config.max_context_len else "max_new_tokens")
    # What admission reserves for this request alone: if even an empty engine cannot give it
    # that, it would wait forever. Chunked, the SWA pool holds a chunk at a time, and a chunk
    # always fits (config.prefill_chunk_tokens); the full pool holds the whole prompt.
    extend_tokens = -(-prompt_len // config.page_size) * config.page_size
    if config.prefill_chunk_tokens is None:
        if extend_tokens + config.swa_headroom > config.swa_pool_tokens:
            return (f"prompt ({prompt_len} tokens) cannot be prefilled: "
                    f"swa_pool_tokens={config.swa_pool_tokens} minus one window of headroom "
                    f"({config.swa_headroom}), and chunked_prefill_size is off", "prompt")
    full_need = extend_tokens + full_reserve(config.page_size, max_new_tokens)
    if full_need > config.full_pool_tokens:
        return (f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs {full_need} "
                f"slots of the full pool, which has full_pool_tokens={config.full_pool_tokens}",
                "max_new_tokens")
    return None
