"""The workload driver: deterministic prompts from a seed, sent with bounded concurrency.

Prompts are printable-ASCII token ids (32..126) so that they read well in logs. Requests carry
rids `r0000`, `r0001`, ... and are handed to a pool of `concurrency` workers in order, so request
`i + C` is sent only after one in flight has finished: together with the engine's lockstep gate
this makes a run's batches, and so its event trace, a function of the seed alone.

The plan is the generated requests, then `workload.extra_requests` in order: each has its own
prompt (fresh, or an earlier request's cut or extended), max_new_tokens and expected answer.
The extras draw their fresh tokens from a stream of their own, so adding one leaves the
generated prompts (and a scenario's trace up to it) unchanged.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import requests

from canaries.schedstat import CpuTime
from canaries.watchdog import Patience, Watchdog

if TYPE_CHECKING:
    from canaries.scenario import Workload

__all__ = ["FollowUp", "Lockstep", "Planned", "drive", "engine_progress", "make_plan", "prompt_range", "rid_of"]

TOKEN_LO, TOKEN_HI = 32, 126  # printable ASCII, inclusive
CLIENT_GONE_STATUS = 499  # what a client that hung up records (the engine's own code for it)
SALT_TOKENS = 2  # how many tokens of each prompt `unique_prompts` overwrites with its index
# A connection's own timeout is the hard cap plus this: the watchdog (which names the reason)
# always cuts it first.
SOCKET_GRACE_S = 10.0


def rid_of(i: int) -> str:
    return f"r{i:04d}"


def prompt_range(workload: Workload) -> tuple[int, int]:
    """(min, max) prompt length; `prompt_tokens` is a number or a [min, max] pair."""
    raw = workload.prompt_tokens
    if isinstance(raw, int):
        return raw, raw
    lo, hi = (int(v) for v in raw)
    return min(lo, hi), max(lo, hi)


@dataclass(frozen=True)
class FollowUp:
    """A prompt made at send time from what request `of` was sent (and, `with_answer`, what it
    answered): its first `keep_tokens` (None: all), then `append`."""

    of: int
    with_answer: bool
    keep_tokens: int | None
    append: tuple[int, ...]

    def prompt(self, earlier: dict) -> list[int] | None:
        """The prompt, from request `of`'s record; None if that request has no answer to follow."""
        source = list(earlier.get("prompt") or [])
        if self.with_answer:
            if earlier.get("output_ids") is None:
                return None
            source += list(earlier["output_ids"])
        return source[:self.keep_tokens] + list(self.append)


@dataclass(frozen=True)
class Planned:
    """One request of the plan: what is sent, and the answer the engine must give. A follow-up's
    prompt is made when it is sent (`prompt` is then empty)."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    status: int = 200
    follow_up: FollowUp | None = None
    min_cached_tokens: int | None = None
    hang_up_after: int | None = None


def make_plan(workload: Workload, seed: int) -> list[Planned]:
    """Every request the driver sends, in rid order: a pure function of (workload, seed) and,
    for follow-ups, of the answers they follow."""
    prompts = _generated_prompts(workload, seed)
    plan = [Planned(rid_of(i), p, workload.max_new_tokens) for i, p in enumerate(prompts)]
    for j, extra in enumerate(workload.extra_requests):
        rng = random.Random(f"canary-extra:{seed}:{j}")
        if extra.prompt_tokens is not None:
            prompt = prompts[0][:workload.shared_prefix_tokens]
            prompt += [rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(extra.prompt_tokens - len(prompt))]
        appended = [rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(extra.append_tokens)]
        follow_up = None
        if extra.prompt_of is not None:
            base = plan[extra.prompt_of]
            if extra.with_answer or base.follow_up is not None:
                follow_up = FollowUp(extra.prompt_of, extra.with_answer, extra.keep_tokens,
                                     tuple(appended))
                prompt, appended = [], []
            else:
                prompt = list(base.prompt[:extra.keep_tokens])
        plan.append(Planned(rid_of(len(plan)), prompt + appended,
                            extra.max_new_tokens or workload.max_new_tokens, extra.status, follow_up,
                            extra.min_cached_tokens, extra.hang_up_after_tokens))
    return plan


def _generated_prompts(workload: Workload, seed: int) -> list[list[int]]:
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


def engine_progress(base_url: str, timeout: float = 5.0) -> tuple[int, int, int] | None:
    """(steps, generated tokens, completed requests) from the engine's /progress; None if it
    did not answer."""
    try:
        progress = requests.get(f"{base_url}/progress", timeout=timeout).json()
        return int(progress["step"]), int(progress["generated_tokens"]), int(progress["completed"])
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None


class _Abortable:
    """One HTTP exchange on a connection of its own, which the watchdog can cut."""

    def __init__(self, base_url: str, timeout: float) -> None:
        from urllib.parse import urlsplit

        url = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout + SOCKET_GRACE_S)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True  # first: a request still connecting sees it once connected
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def connect(self) -> None:
        self.conn.connect()
        if self.aborted:
            raise ConnectionAbortedError("aborted by the watchdog")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def _hung(record: dict, watchdog: Watchdog) -> None:
    record["error"] = f"hung: {watchdog.reason}"
    record["hang"] = watchdog.reason
    if watchdog.starved:  # the machine, not the engine: the harness's failure
        record["starved"] = watchdog.starved


def _exchange_failed(record: dict, exchange: _Abortable, watchdog: Watchdog, exc: BaseException) -> None:
    """A failed exchange: the record's hang when the watchdog cut it, else its error."""
    if exchange.aborted:
        _hung(record, watchdog)
    else:
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]


def _send(session_factory, base_url: str, planned: Planned, prompt: list[int] | None,
          temperature: float, watchdog: Watchdog, deadline: float, hang_up_by: str = "gate",
          lockstep: Lockstep | None = None) -> dict:
    start = time.monotonic()
    rid, max_new_tokens = planned.rid, planned.max_new_tokens
    record: dict[str, Any] = {"rid": rid, "status": None, "output_ids": None, "error": None,
                              "latency_s": None, "prompt_len": len(prompt or ()), "prompt": prompt,
                              "max_new_tokens": max_new_tokens, "expect_status": planned.status}
    if planned.min_cached_tokens is not None:
        record["expect_cached_tokens"] = planned.min_cached_tokens
    if prompt is None:
        assert planned.follow_up is not None
        record["error"] = f"not sent: {rid_of(planned.follow_up.of)} has no answer to follow"
        if lockstep is not None:  # else the gate waits for it
            lockstep.skip(rid)
        else:
            with contextlib.suppress(requests.RequestException):
                session_factory().post(f"{base_url}/gate/skip", json={"rid": rid}, timeout=5.0)
        return record
    remaining = deadline - start
    if watchdog.fired or remaining <= 0:
        record["error"] = f"not sent: the workload was stopped ({watchdog.reason or 'hard cap'})"
        return record
    body = {"input_ids": prompt, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
    if planned.hang_up_after is not None:
        record["expect_status"] = CLIENT_GONE_STATUS
        if hang_up_by == "stream":
            hang_up_streaming(base_url, record, body, planned.hang_up_after, remaining, watchdog)
        else:
            hang_up(session_factory(), base_url, record, body, planned.hang_up_after, remaining, watchdog)
        record["latency_s"] = round(time.monotonic() - start, 4)
        return record
    exchange = _Abortable(base_url, remaining)
    token = watchdog.track(exchange.abort)
    try:
        exchange.connect()
        exchange.conn.request("POST", "/generate", body=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"})
        resp = exchange.conn.getresponse()
        record["status"] = resp.status
        raw = resp.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"raw": raw[:500].decode("utf-8", "replace")}
        if resp.status == 200:
            record["output_ids"] = payload.get("output_ids")
            record["meta_info"] = payload.get("meta_info")
        else:
            err = payload.get("error") if isinstance(payload, dict) else None
            record["error"] = (err or {}).get("message") if isinstance(err, dict) else str(payload)[:500]
    except (OSError, http.client.HTTPException) as exc:
        _exchange_failed(record, exchange, watchdog, exc)
    finally:
        watchdog.untrack(token)
        exchange.close()
    record["latency_s"] = round(time.monotonic() - start, 4)
    return record


def hang_up(session: requests.Session, base_url: str, record: dict, body: dict, after_tokens: int,
            remaining: float, watchdog: Watchdog) -> None:
    """Send `body` and hang up once the engine has `after_tokens` of its answer: tell the gate,
    send on a connection of our own, wait until the engine pauses for us, then close it. The
    record gets status 499 (the client's own: it left) and `hung_up`; if the engine answered
    first (it finished or crashed), the record holds that answer instead."""
    rid = record["rid"]
    try:
        session.post(f"{base_url}/gate/hang_up", json={"rid": rid, "after_tokens": after_tokens},
                     timeout=5.0).raise_for_status()
    except requests.RequestException as exc:
        record["error"] = f"hang-up not planned: {type(exc).__name__}: {exc}"[:500]
        return
    exchange = _Abortable(base_url, remaining)
    conn = exchange.conn
    token = watchdog.track(exchange.abort)
    try:
        exchange.connect()
        payload = json.dumps(body).encode()
        conn.request("POST", "/generate", body=payload, headers={"Content-Type": "application/json"})
        ready = session.post(f"{base_url}/gate/hang_up/wait",
                             json={"rid": rid, "timeout_s": float(max(1.0, min(remaining, 120.0)))},
                             timeout=remaining + 5.0).json().get("ready")
        if ready:
            record.update(status=CLIENT_GONE_STATUS, hung_up=True)
            return
        resp = conn.getresponse()  # the engine answered before the hang-up (finished, crashed)
        record["status"] = resp.status
        answer = json.loads(resp.read() or b"{}")
        if resp.status == 200:
            record["output_ids"] = answer.get("output_ids")
            record["meta_info"] = answer.get("meta_info")
        else:
            record["error"] = str((answer.get("error") or {}).get("message") or answer)[:500]
    except (OSError, ValueError, http.client.HTTPException, requests.RequestException) as exc:
        if exchange.aborted:
            _hung(record, watchdog)
        else:
            record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        watchdog.untrack(token)
        exchange.close()


def hang_up_streaming(base_url: str, record: dict, body: dict, after_tokens: int, remaining: float,
                      watchdog: Watchdog) -> None:
    """`hang_up` for an engine without our gate (SGLang's server): stream the answer and close
    the connection once it holds `after_tokens` tokens; the server sees the client gone and
    aborts the request. The record gets status 499 and `hung_up`, or, if the stream ended first
    (it finished or failed), that answer."""
    exchange = _Abortable(base_url, remaining)
    token = watchdog.track(exchange.abort)
    try:
        exchange.connect()
        exchange.conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}).encode(),
                              headers={"Content-Type": "application/json"})
        resp = exchange.conn.getresponse()
        record["status"] = resp.status
        if resp.status != 200:
            record["error"] = resp.read()[:500].decode("utf-8", "replace")
            return
        output_ids: list[int] = []
        while line := resp.readline():
            data = line.strip().removeprefix(b"data:").strip()
            if not data or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            output_ids = list(chunk.get("output_ids") or output_ids)  # cumulative, as SGLang streams them
            if len(output_ids) >= after_tokens:
                record.update(status=CLIENT_GONE_STATUS, hung_up=True)
                return
            record["meta_info"] = chunk.get("meta_info")
        record["output_ids"] = output_ids  # the whole answer came before the hang-up
    except (OSError, ValueError, http.client.HTTPException) as exc:
        _exchange_failed(record, exchange, watchdog, exc)
    finally:
        watchdog.untrack(token)
        exchange.close()


def _hold(session: requests.Session, base_url: str, rid: str, waits_for: str) -> None:
    """Tell the engine's lockstep gate that `rid` waits for `waits_for`'s answer, so the gate
    counts it as in flight meanwhile (else it would wait for a request that cannot come yet)."""
    try:
        session.post(f"{base_url}/gate/hold", json={"rid": rid, "waits_for": waits_for}, timeout=5.0)
    except requests.RequestException:
        pass  # the engine is gone: the follow-up's own request records that


class Lockstep(Protocol):
    """The driver's notes to an engine's lockstep gate kept outside HTTP (SGLang's server:
    `canaries.sglang.server.lockstep.GateNotes`): the plan first, then what only the driver knows."""

    def planned(self, plan: Sequence[Planned], concurrency: int) -> None: ...
    def hold(self, rid: str, waits_for: str) -> None: ...
    def skip(self, rid: str) -> None: ...
    def done(self, rid: str) -> None: ...


def drive(base_url: str, workload: Workload, seed: int, patience: Patience | None = None,
          plan: Sequence[Planned] | None = None,
          progress: Callable[[], Hashable | None] | None = None, hang_up_by: str = "gate",
          lockstep: Lockstep | None = None, cpu: Callable[[], CpuTime | None] | None = None) -> list[dict]:
    """Send the workload (its plan, unless given); one record per request, in rid order.

    Records: {rid, status, output_ids, error, latency_s, prompt, prompt_len, max_new_tokens,
    expect_status[, expect_cached_tokens][, meta_info][, hang]}. A connection error (the engine
    died) is recorded, never raised. A `Watchdog` with `patience` watches the engine's
    `progress` (default: `engine_progress`, its /progress): if it stalls with requests outstanding,
    or the workload reaches the hard cap, every outstanding request is cut and its record gets
    `hang`, the watchdog's reason (and `error` "hung: REASON"); what was not sent yet is not.
    `hang_up_by`: "gate" (our engine's lockstep gate leaves at an exact token) or "stream" (an
    engine without it: the answer streamed, the connection closed once it holds enough tokens).
    `lockstep`: where the gate's notes go when the engine's gate is not our engine's HTTP one
    (SGLang's server); the plan is noted before anything is sent, each request once done.
    `cpu`: the engine's CPU time (`canaries.schedstat.group_cpu`): a stall while the machine
    starved it is recorded as such (`starved` in the cut records).
    """
    plan = list(plan) if plan is not None else make_plan(workload, seed)
    concurrency = max(1, workload.concurrency)
    temperature = workload.temperature
    patience = patience or Patience()
    deadline = time.monotonic() + patience.hard_cap_s
    url = base_url.rstrip("/")
    watchdog = Watchdog(patience, progress or (lambda: engine_progress(url)), cpu=cpu)
    local = threading.local()
    sessions: list[requests.Session] = []
    lock = threading.Lock()

    def session() -> requests.Session:
        if not hasattr(local, "session"):
            local.session = requests.Session()
            with lock:
                sessions.append(local.session)
        return local.session

    futures: list[Future] = []

    def send(planned: Planned) -> dict:
        prompt: list[int] | None = planned.prompt
        if planned.follow_up is not None:
            # An earlier request: FIFO workers have taken it already, so this wait cannot deadlock.
            earlier_future = futures[planned.follow_up.of]
            if not earlier_future.done():
                if lockstep is not None:
                    lockstep.hold(planned.rid, rid_of(planned.follow_up.of))
                else:
                    _hold(session(), url, planned.rid, rid_of(planned.follow_up.of))
            try:
                earlier = earlier_future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                earlier = {}
            prompt = planned.follow_up.prompt(earlier)
        try:
            return _send(session, url, planned, prompt, temperature, watchdog, deadline, hang_up_by, lockstep)
        finally:
            if lockstep is not None:
                lockstep.done(planned.rid)

    if lockstep is not None:
        lockstep.planned(plan, concurrency)
    try:
        with watchdog, ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="canary-driver") as pool:
            for planned in plan:
                futures.append(pool.submit(send, planned))
            return [f.result() for f in futures]
    finally:
        for s in sessions:
            s.close()
