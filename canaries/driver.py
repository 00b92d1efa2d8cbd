"""The workload driver: deterministic prompts from a seed, sent with bounded concurrency.

Prompts are printable-ASCII token ids (32..126) so that they read well in logs. Requests carry
rids `r0000`, `r0001`, ... and are handed to a pool of `concurrency` workers in order, so request
`i + C` is sent only after one in flight has finished: together with the engine's lockstep gate
this makes a run's batches, and so its event trace, a function of the seed alone.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import requests

if TYPE_CHECKING:
    from canaries.scenario import Workload

__all__ = ["make_prompts", "drive", "rid_of", "prompt_range"]

TOKEN_LO, TOKEN_HI = 32, 126  # printable ASCII, inclusive
SALT_TOKENS = 2  # how many tokens of each prompt `unique_prompts` overwrites with its index


def rid_of(i: int) -> str:
    return f"r{i:04d}"


def prompt_range(workload: Workload) -> tuple[int, int]:
    """(min, max) prompt length; `prompt_tokens` is a number or a [min, max] pair."""
    raw = workload.prompt_tokens
    if isinstance(raw, int):
        return raw, raw
    lo, hi = (int(v) for v in raw)
    return min(lo, hi), max(lo, hi)


def make_prompts(workload: Workload, seed: int) -> list[list[int]]:
    """The workload's prompts, a pure function of (workload, seed)."""
    lo, hi = prompt_range(workload)
    shared = workload.shared_prefix_tokens
    rng = random.Random(f"canary-prompts:{seed}")
    prefix = [rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(shared)]
    span = TOKEN_HI - TOKEN_LO + 1
    prompts: list[list[int]] = []
    for i in range(workload.requests):
        length = max(rng.randint(lo, hi), shared + 1)
        body = [rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(length - shared)]
        if workload.unique_prompts:
            # Salt the first tokens after the shared prefix with the prompt's index.
            salt = [TOKEN_LO + (i // span**k) % span for k in range(SALT_TOKENS)]
            body[: len(salt)] = salt[: len(body)]
        prompts.append(prefix + body)
    return prompts


def _send(session_factory, base_url: str, rid: str, prompt: list[int], max_new_tokens: int,
          temperature: float, deadline: float) -> dict:
    start = time.monotonic()
    record: dict[str, Any] = {"rid": rid, "status": None, "output_ids": None, "error": None,
                              "latency_s": None, "prompt_len": len(prompt)}
    remaining = deadline - start
    if remaining <= 0:
        record["error"] = "not sent: the workload deadline had passed"
        return record
    body = {"input_ids": prompt, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
    try:
        resp = session_factory().post(f"{base_url}/generate", json=body,
                                      timeout=(min(5.0, remaining), remaining))
        record["status"] = resp.status_code
        try:
            payload = resp.json()
        except ValueError:
            payload = {"raw": resp.text[:500]}
        if resp.ok:
            record["output_ids"] = payload.get("output_ids")
            record["meta_info"] = payload.get("meta_info")
        else:
            err = payload.get("error") if isinstance(payload, dict) else None
            record["error"] = (err or {}).get("message") if isinstance(err, dict) else str(payload)[:500]
    except requests.RequestException as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    record["latency_s"] = round(time.monotonic() - start, 4)
    return record


def drive(base_url: str, workload: Workload, seed: int, deadline_s: float = 60.0,
          prompts: Sequence[list[int]] | None = None) -> list[dict]:
    """Send the workload; one record per request, in rid order.

    Records: {rid, status, output_ids, error, latency_s, prompt_len[, meta_info]}. A connection
    error (the engine died) or a timeout is recorded, never raised.
    """
    prompts = list(prompts) if prompts is not None else make_prompts(workload, seed)
    concurrency = max(1, workload.concurrency)
    max_new = workload.max_new_tokens
    temperature = workload.temperature
    deadline = time.monotonic() + deadline_s
    local = threading.local()
    sessions: list[requests.Session] = []
    lock = threading.Lock()

    def session() -> requests.Session:
        if not hasattr(local, "session"):
            local.session = requests.Session()
            with lock:
                sessions.append(local.session)
        return local.session

    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="canary-driver") as pool:
            futures = [pool.submit(_send, session, base_url.rstrip("/"), rid_of(i), p, max_new,
                                   temperature, deadline) for i, p in enumerate(prompts)]
            return [f.result() for f in futures]
    finally:
        for s in sessions:
            s.close()
