"""Engine: the scheduler's thread, its inbox, the lockstep gate, idle ticks and the crash path.

The HTTP server submits requests from its own thread; the engine thread admits them, steps the
scheduler while there is work, and runs one idle tick each time it falls idle. Any error that
escapes a step is logged (durably) as a `crash` event before the process exits with a code that
says why: 3 for an invariant, 4 for the KV canary in raise mode, 1 for anything else.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_stub.config import EngineConfig
from engine_stub.events import EventLog
from engine_stub.invariants import (
    Bucket,
    Firing,
    Invariant,
    InvariantCheckLevel,
    InvariantViolation,
    IsTrue,
    expect,
    firing_from_device_assert,
    reset_counters,
    set_default_level,
    set_firing_sink,
)
from engine_stub.req import Req, RequestRejected
from engine_stub.scheduler import CanaryRaised, Scheduler

__all__ = ["Engine", "EXIT_CODES"]

EXIT_CODES = {"invariant": 3, "kv_canary": 4, "error": 1}

ANSWER_LEDGER = Invariant(
    "idle.answer_ledger", Bucket.GUARD, IsTrue(), site="idle_tick",
    description="an idle engine owes no answer: every request it took was answered",
)


def default_event_log_path() -> Path:
    """A fresh private directory (mode 0700) holding `events.jsonl`.

    A predictable name in the shared temp dir could be planted (a symlink) by another user
    before the engine opens it; a directory made by `mkdtemp` cannot.
    """
    return Path(tempfile.mkdtemp(prefix=f"engine_stub-{os.getpid()}-")) / "events.jsonl"


class Engine:
    """Runs a `Scheduler` on a background thread.

    Args:
        config: the config in force.
        perturber: a loaded perturbation set, or None (every hook site is then skipped).
        exit_on_crash: kill the process after logging a crash (the server); False keeps the
            process alive and fails pending requests (in-process tests).
    """

    def __init__(self, config: EngineConfig, *, perturber: Any = None, exit_on_crash: bool = True) -> None:
        self.config = config
        self.exit_on_crash = exit_on_crash
        if config.event_log:
            self.events = EventLog(config.event_log)
        else:
            self.events = EventLog(default_event_log_path(), exclusive=True)
        torch.manual_seed(config.seed)
        if config.resolved_device() == "cpu":
            # The model is tiny: intra-op threads only add OpenMP hand-offs, and on a loaded
            # 2-core runner their spin-waits made each step 10-20x slower.
            torch.set_num_threads(1)
        reset_counters()
        set_default_level(InvariantCheckLevel.parse(config.invariant_check, source="invariant_check"))
        set_firing_sink(self._on_firing)
        self.scheduler = Scheduler(config, self.events, perturber)
        self._cond = threading.Condition()
        self._inbox: list[Req] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.step_lock = threading.Lock()  # held during a step; /state reads under it
        self.received = 0
        self.completed = 0
        self.crash: dict | None = None
        self.last_idle: dict | None = None
        self._pending: dict[str, Req] = {}  # taken, not yet answered
        self._callbacks: dict[str, Callable[[Req], None]] = {}  # the clients' own, by rid
        # The lockstep gate's held requests: rid -> the rid whose answer the driver waits for
        # before it sends it (a follow-up turn). Cleared when the rid arrives.
        self._holds: dict[str, str] = {}
        self._answered: set[str] = set()
        # Planned client hang-ups (harness only): rid -> output tokens after which the engine
        # pauses until that client has gone; `_hung_up_ready` holds the rids paused for.
        self._skipped: set[str] = set()  # rids the driver will never send (gate/skip)
        self._hang_ups: dict[str, int] = {}
        self._hang_up_ready: set[str] = set()
        self.events.write("engine_start", config=config.knobs(),
                          config_sources=dict(config.sources), torch=torch.__version__,
                          device=str(self.scheduler.device), pid=os.getpid(),
                          memory_parts=self.scheduler.memory_parts)

    # ---- submission ---------------------------------------------------------------------------

    def submit(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        rid: str | None = None,
        on_finish: Callable[[Req], None] | None = None,
    ) -> Req:
        """Queue a request. Raises RequestRejected when it could never be served."""
        self.scheduler.check_fits(len(input_ids), max_new_tokens)
        with self._cond:
            if self.crash is not None:
                raise RuntimeError(f"engine crashed: {self.crash['error']}")
            if rid is not None and rid in self._pending:
                # Two live requests with one rid would share the canary's token oracle.
                raise RequestRejected(f"rid {rid!r} is already in flight", param="rid")
            self.received += 1
            rid = rid or f"req-{self.received:06d}"
            gen = None
            if temperature > 0:
                gen = torch.Generator().manual_seed(zlib.crc32(f"{self.config.seed}:{rid}".encode()))
            self._holds.pop(rid, None)
            req = Req(rid, list(input_ids), max_new_tokens, temperature, generator=gen,
                      on_finish=self._answer)
            self._pending[rid] = req
            if on_finish is not None:
                self._callbacks[rid] = on_finish
            self._inbox.append(req)
            self._cond.notify_all()
        return req

    def hold(self, rid: str, waits_for: str) -> None:
        """Lockstep gate: the driver holds request `rid` back until `waits_for` is answered.

        While `waits_for` is unanswered the gate counts `rid` as in flight (the driver's worker
        is busy with it); once it is answered the gate waits for `rid` to arrive. No effect
        when the engine is not gated or `rid` already arrived.
        """
        with self._cond:
            if self.config.gate_requests > 0 and rid not in self._pending and rid not in self._answered:
                self._holds[rid] = waits_for
                self._cond.notify_all()

    def skip(self, rid: str) -> None:
        """Lockstep gate: the driver will never send `rid` (a follow-up whose earlier request
        has no answer to follow), so the gate stops counting it as owed."""
        with self._cond:
            if self.config.gate_requests > 0 and rid not in self._pending and rid not in self._answered:
                self._holds.pop(rid, None)
                self._skipped.add(rid)
                self._cond.notify_all()

    def hang_up_at(self, rid: str, after_tokens: int) -> None:
        """Lockstep gate: the driver's client for `rid` will hang up once `rid` has
        `after_tokens` output tokens. The engine pauses before the step after that until the
        disconnect has aborted `rid`, so the abort lands at the same step on every run."""
        with self._cond:
            self._hang_ups[rid] = after_tokens
            self._cond.notify_all()

    def wait_hang_up(self, rid: str, timeout_s: float) -> bool:
        """Block until the engine pauses for `rid`'s hang-up (True), or `rid` finished first
        (or never arrived within the gate's timeout), the engine crashed or stopped, or the
        timeout passed (False)."""
        deadline = time.monotonic() + timeout_s
        # The driver sends the request right after planning its hang-up: one that has not
        # arrived within the gate's timeout never will.
        arrival = time.monotonic() + self.config.gate_timeout_s
        with self._cond:
            if rid not in self._hang_ups and rid not in self._hang_up_ready:
                return False  # no hang-up planned for it (the driver plans one before it sends)
            while rid not in self._hang_up_ready:
                now = time.monotonic()
                if self.crash is not None or self._stopping or rid in self._answered \
                        or now >= deadline or (rid not in self._pending and now >= arrival):
                    return False
                self._cond.wait(0.01)
            return True

    def _pause_for_hang_ups(self) -> None:
        """Before a step: for each planned hang-up whose request has its tokens, wait (up to the
        gate timeout) until its client has gone (`abort`)."""
        with self._cond:
            due = [rid for rid, n in self._hang_ups.items()
                   if (req := self._pending.get(rid)) is not None and len(req.output_ids) >= n]
            if not due:
                return
            deadline = time.monotonic() + self.config.gate_timeout_s
            for rid in due:
                del self._hang_ups[rid]
                self._hang_up_ready.add(rid)
                self._cond.notify_all()
                req = self._pending.get(rid)
                while req is not None and not req.abort_requested and not self._stopping:
                    if time.monotonic() >= deadline:
                        self.events.write("gate_timeout", received=self.received, completed=self.completed,
                                          hang_up=rid)
                        break
                    self._cond.wait(0.01)

    def _in_flight(self) -> int:
        """Requests the driver has in flight, as the gate counts them (under `_cond`). A request
        whose client hung up is no longer in flight for the driver (its worker moved on)."""
        held = sum(1 for waits_for in self._holds.values() if waits_for not in self._answered)
        return self.received - self.completed - self._hung_up() + held

    def _hung_up(self) -> int:
        """Requests aborted by their client and not yet finished (under `_cond`)."""
        return sum(1 for r in self._pending.values() if r.abort_requested and not r.finished)

    def abort(self, rid: str) -> bool:
        """Give up on request `rid` (its client went away): it is finished with finish_reason
        "abort" at the scheduler's next step, and its slots are freed. False when `rid` is not
        in flight."""
        with self._cond:
            req = self._pending.get(rid)
            if req is None or req.finished:
                return False
            req.abort_requested = True
            self._cond.notify_all()
            return True

    def _answer(self, req: Req) -> None:
        """Deliver `req`'s answer to its client (once: a second call finds nothing owed)."""
        with self._cond:
            if self._pending.pop(req.rid, None) is None:
                return
            callback = self._callbacks.pop(req.rid, None)
            self.completed += 1
            if self.config.gate_requests > 0:
                self._answered.add(req.rid)
            self._cond.notify_all()
        if callback is not None:
            callback(req)

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Let running and waiting requests finish (up to the timeout), then stop the thread."""
        deadline = time.monotonic() + drain_timeout_s
        with self._cond:
            while (self._inbox or self.scheduler.has_work) and self.crash is None and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.crash is None:
            with self.step_lock:
                self.scheduler.drain_all_firings()  # nothing counted is lost at shutdown either
        self.scheduler.close_tracking()
        self.events.write("shutdown", durable=True, completed=self.completed, received=self.received)
        self.events.close()
        set_firing_sink(None)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until nothing is queued or running and the idle tick has run (tests, drivers)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while time.monotonic() < deadline and self.crash is None:
                if not self._inbox and not self.scheduler.has_work and self.last_idle is not None \
                        and self.last_idle.get("after_step") == self.scheduler.step_no:
                    return True
                self._cond.wait(0.05)
        return False

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        idle_due = True
        idle_deadline: float | None = None  # gated: how long the idle tick may wait for the driver
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    self._admit_inbox()
                    if not self.scheduler.has_work:
                        if not idle_due:
                            self._cond.wait(0.05)
                            continue
                        if self._gate_defers_idle(idle_deadline := idle_deadline or self._gate_deadline()):
                            self._cond.wait(0.01)
                            continue
                if self.scheduler.has_work:
                    self._pause_for_hang_ups()
                    self._wait_for_gate()
                    if self._delay_step():
                        return
                    with self.step_lock:
                        self.scheduler.step()
                    idle_due = True
                    idle_deadline = None
                elif idle_due:
                    with self.step_lock:
                        result = self.scheduler.idle_tick()
                        self._answer_orphans()
                        # The ledgers' firings, the answer ledger's, and the backend's hits
                        # counted after the last step's read-back.
                        self.scheduler.drain_all_firings()
                    with self._cond:
                        self.last_idle = {**result, "after_step": self.scheduler.step_no}
                        self._cond.notify_all()
                    idle_due = False
        except BaseException as exc:  # noqa: BLE001 - every death must be logged first
            self._on_crash(exc)

    def _delay_step(self) -> bool:
        """Wait `step_delay_s` before a step (test-only: a slow or, with a huge delay, stalled
        engine); True if the engine is stopping meanwhile."""
        delay = self.config.step_delay_s
        if delay <= 0:
            return False
        with self._cond:
            return self._cond.wait_for(lambda: self._stopping, timeout=delay)

    def _answer_orphans(self) -> None:
        """At an idle tick, every request still owed an answer is queued in the inbox.

        One that is not was finished (or dropped) by the scheduler without its answer: its
        client would wait until its timeout. Fire the ledger (STRICT crashes, and the crash path
        answers every pending request); below STRICT deliver the answer now, late but whole
        (the caller's drain puts the firing on record).
        """
        with self._cond:
            queued = {id(r) for r in self._inbox}
            orphans = [r for r in self._pending.values() if id(r) not in queued]
        if not orphans:
            return
        rids = [r.rid for r in orphans]
        self.events.write("unanswered_requests", durable=True, rids=rids)
        expect(ANSWER_LEDGER, torch.tensor(False),
               f"{len(rids)} request(s) finished without an answer: {', '.join(rids[:8])}")
        for req in orphans:
            if req.finish_reason is None:  # dropped without being finished
                req.finish_reason = "abort"
            self._answer(req)

    def _admit_inbox(self) -> None:
        for req in self._inbox:
            self.scheduler.add_request(req)
        self._inbox.clear()

    def _gate_deadline(self) -> float:
        return time.monotonic() + self.config.gate_timeout_s

    def _gate_defers_idle(self, deadline: float) -> bool:
        """Gated and the driver still owes requests: hold the idle tick (up to the gate timeout).

        Between two waves the engine can run dry before the driver's next requests arrive; an
        idle tick there (an `idle_check` event) would make the trace depend on HTTP timing. Once
        every planned request has arrived nothing more can: an idle engine that still owes an
        answer has lost it, and the idle tick that says so runs at once.
        """
        cfg = self.config
        if cfg.gate_requests <= 0 or self.completed + len(self._skipped) >= cfg.gate_requests:
            return False
        if self.received + len(self._skipped) >= cfg.gate_requests:
            return False
        if time.monotonic() < deadline:
            return True
        self.events.write("gate_timeout", received=self.received, completed=self.completed)
        return False

    def _wait_for_gate(self) -> None:
        """Lockstep gate: hold the step until the driver's next requests have arrived.

        With `gate_requests` N and `gate_concurrency` C, the driver keeps min(C, N - completed)
        requests in flight; stepping before they arrive would make batch composition (and so the
        event trace) depend on HTTP timing.
        """
        cfg = self.config
        if cfg.gate_requests <= 0:
            return
        deadline = time.monotonic() + cfg.gate_timeout_s
        with self._cond:
            while True:
                owed = cfg.gate_requests - self.completed - self._hung_up() - len(self._skipped)
                want = min(cfg.gate_concurrency or cfg.gate_requests, owed)
                if self._in_flight() >= want or self._stopping:
                    break
                if time.monotonic() >= deadline:
                    self.events.write("gate_timeout", received=self.received, completed=self.completed)
                    break
                self._cond.wait(0.01)
            self._admit_inbox()

    # ---- firings and crashes ---------------------------------------------------------------------

    def _on_firing(self, firing: Firing) -> None:
        self.events.write("invariant_firing", durable=True, **firing.to_dict())

    def _on_crash(self, exc: BaseException) -> None:
        if isinstance(exc, InvariantViolation):
            cause, detail = "invariant", exc.firing.to_dict()
        elif isinstance(exc, CanaryRaised):
            cause, detail = "kv_canary", {"violations": len(exc.violations)}
        elif (firing := firing_from_device_assert(exc)) is not None:
            self._on_firing(firing)
            cause, detail = "invariant", firing.to_dict()
        else:
            cause, detail = "error", {}
        code = EXIT_CODES[cause]
        self.crash = {"cause": cause, "error": str(exc)[:2000], "exit_code": code, **detail}
        self.events.write("crash", durable=True, cause=cause, error=str(exc)[:2000], exit_code=code,
                          traceback=traceback.format_exc(limit=12), detail=detail)
        print(f"engine_stub: crashed ({cause}): {exc}", file=sys.stderr, flush=True)
        if self.exit_on_crash:
            self.events.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        with self._cond:
            pending = list(self._pending.values())
        for req in pending:
            req.finish_reason = "engine_crashed"
            self._answer(req)

    # ---- state -----------------------------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        """Counters that only grow while the engine works, read without the step lock (a stuck
        step cannot hide them) and without touching a device."""
        sched = self.scheduler
        return {"step": sched.step_no, "generated_tokens": sched.stats["generated_tokens"],
                "received": self.received, "completed": self.completed}

    def state(self) -> dict:
        """Pools, ledgers, hit counts, canary counters and exercise stats (a consistent snapshot)."""
        with self.step_lock:
            sched = self.scheduler
            alloc = sched.allocator
            return {
                "step": sched.step_no,
                "running": len(sched.running),
                "waiting": len(sched.waiting) + len(self._inbox),
                "received": self.received,
                "completed": self.completed,
                "pools": {
                    "full": {"size": alloc.size_full, "available": alloc.full_available_size()},
                    "swa": {"size": alloc.size_swa, "available": alloc.swa_available_size()},
                    "req_rows": {"size": sched.req_to_token_pool.size,
                                 "available": sched.req_to_token_pool.available_size()},
                    "radix_tokens": sched.tree_cache.total_size() if sched.tree_cache else 0,
                },
                "last_idle_check": self.last_idle,
                "invariant_hits": sched.invariant_hit_totals(),
                "drops": alloc.drop_counts(),
                "kv_canary": {"mode": sched.canary.mode, **sched.canary.stats},
                "exercise": {**sched.exercise_stats(),
                             "max_mapping_nonidentity": sched.idle.max_mapping_nonidentity},
                "stats": dict(sched.stats),
                "config": self.config.knobs(),
                "crash": self.crash,
                "event_log": str(self.events.path),
            }
