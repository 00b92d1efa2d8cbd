"""The lockstep gate on SGLang's server: requests enter SGLang's scheduler as the plan says.

Our engine holds each step until the driver's next requests have arrived (`engine_stub/engine.py`,
its lockstep gate), so a run's batches are a function of the scenario and its seed. SGLang's
scheduler takes requests as they arrive; this gate gives it the same discipline from inside its
process. The two sides share one file, the gate file (`CANARY_SERVER_GATE` names it), JSON lines:

- the driver (`GateNotes`, in the harness) writes the plan first (`plan`: the rids in order, the
  concurrency, the planned hang-ups), then what only it knows: a follow-up held back until an
  earlier answer (`hold`), one it will never send (`skip`), and each request it is done with
  (`done`: one the scheduler never saw, a refusal by SGLang's tokenizer, counts as gone by it);
- the scheduler (`LockstepGate`, through `install`'s hooks) reads it on every pass of its loop.

Before each pass the gate holds back the plan's requests until the driver has in flight as many
as it keeps (min(concurrency, requests not yet gone), a held follow-up counted while what it waits
for is not answered), then lets them in together, in plan order; a request is gone once the
scheduler's output finished it (an output or an abort it sent) or the driver noted it. A planned
hang-up pauses the scheduler, once the request's output has reached its token count, until the
disconnect's abort has arrived. What SGLang decides then (its prefill adder, retraction) it decides
on the same state every run. A gate that waits longer than the plan's timeout lets the pass go on
and writes a `gate_timeout` event: that run's batches may have depended on timing.

Runs in SGLang's scheduler process (standard library only) and, for `GateNotes`, in the harness.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["GATE_ENV", "GateNotes", "LockstepGate", "attach", "hook_receiver", "hook_sender"]

GATE_ENV = "CANARY_SERVER_GATE"
POLL_S = 0.002  # how often a holding gate looks for arrivals and notes
DEFAULT_TIMEOUT_S = 60.0
_GENERATE = "TokenizedGenerateReqInput"
_ABORT = "AbortReq"


class GateNotes:
    """The driver's side of the gate file: the plan, then its holds, skips and done requests."""

    def __init__(self, path: str | os.PathLike, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def _note(self, note: dict) -> None:
        with self._lock, open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(note) + "\n")

    def planned(self, plan: Sequence[Any], concurrency: int) -> None:
        """The plan (its `rid`s in order and their `hang_up_after`), before anything is sent."""
        self._note({"kind": "plan", "rids": [p.rid for p in plan], "concurrency": int(concurrency),
                    "hang_ups": {p.rid: int(p.hang_up_after) for p in plan if p.hang_up_after is not None},
                    "timeout_s": self.timeout_s})

    def hold(self, rid: str, waits_for: str) -> None:
        """`rid` is in flight but waits for `waits_for`'s answer before it is sent."""
        self._note({"kind": "hold", "rid": rid, "waits_for": waits_for})

    def skip(self, rid: str) -> None:
        """`rid` will never be sent."""
        self._note({"kind": "skip", "rid": rid})

    def done(self, rid: str) -> None:
        """The driver is done with `rid` (answered, refused, hung up on, or never sent)."""
        self._note({"kind": "done", "rid": rid})


class LockstepGate:
    """The scheduler's side: what it has seen arrive and finish, and what the driver noted."""

    def __init__(self, path: str | os.PathLike, write_event: Callable[[dict], None] | None = None,
                 step: Callable[[], int] | None = None) -> None:
        self._path = str(path)
        self._offset = 0
        self._partial = b""
        self._write_event = write_event or (lambda event: None)
        self._step = step or (lambda: 0)
        self.order: dict[str, int] = {}  # rid -> index in the plan; empty until the plan is read
        self.concurrency = 0
        self.hang_ups: dict[str, int] = {}
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.arrived: set[str] = set()
        self.finished: set[str] = set()  # the scheduler's own output finished them
        self.noted: set[str] = set()  # the driver is done with them (or skips them)
        self.held: dict[str, str] = {}
        self.tokens: dict[str, int] = {}  # output tokens sent out so far, by rid
        self.aborts: set[str] = set()  # rids whose abort reached the scheduler
        self.timeouts = 0
        self._held_back: list[Any] = []

    # ---- what the driver notes -----------------------------------------------------------

    def read_notes(self) -> None:
        """Take in what the driver appended to the gate file since the last read."""
        try:
            # A holding gate polls every POLL_S: a stat, not an open, while nothing was appended.
            if os.stat(self._path).st_size <= self._offset:
                return
            with open(self._path, "rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except OSError:
            return
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                note = json.loads(line)
            except ValueError:
                continue
            if isinstance(note, dict):
                self._take(note)

    def _take(self, note: dict) -> None:
        kind, rid = note.get("kind"), note.get("rid")
        if kind == "plan":
            self.order = {str(r): i for i, r in enumerate(note.get("rids") or [])}
            self.concurrency = int(note.get("concurrency") or 0)
            self.hang_ups = {str(r): int(n) for r, n in (note.get("hang_ups") or {}).items()}
            self.timeout_s = float(note.get("timeout_s") or DEFAULT_TIMEOUT_S)
        elif kind == "hold" and rid is not None:
            self.held[str(rid)] = str(note.get("waits_for"))
        elif kind in ("skip", "done") and rid is not None:
            self.noted.add(str(rid))

    # ---- what the scheduler sends out ----------------------------------------------------

    def observe_output(self, output: Any) -> None:
        """An output the scheduler sends (to the detokenizer or the tokenizer): its requests'
        token counts, and those it finishes (a finish reason, or an abort it reports)."""
        rids = getattr(output, "rids", None)
        if isinstance(rids, list | tuple):
            reasons = getattr(output, "finished_reasons", None) or ()
            counts = getattr(output, "completion_tokens", None) or ()
            for i, rid in enumerate(rids):
                if i < len(counts) and counts[i] is not None:
                    self.tokens[rid] = max(self.tokens.get(rid, 0), int(counts[i]))
                if i < len(reasons) and reasons[i] is not None:
                    self.finished.add(rid)
        elif type(output).__name__ == _ABORT and getattr(output, "rid", None):
            self.finished.add(output.rid)

    # ---- what the scheduler receives -----------------------------------------------------

    def _gone(self, rid: str) -> bool:
        return rid in self.finished or rid in self.noted

    def in_flight(self) -> tuple[int, int]:
        """(requests the driver has in flight as the gate counts them, requests it keeps in
        flight): arrived and not gone, plus held follow-ups whose earlier request is not."""
        owed = sum(1 for rid in self.order if not self._gone(rid))
        want = min(self.concurrency or owed, owed)
        present = sum(1 for rid in self.arrived if rid in self.order and not self._gone(rid))
        held = sum(1 for rid, waits_for in self.held.items()
                   if rid not in self.arrived and not self._gone(rid) and not self._gone(waits_for))
        return present + held, want

    def hang_up_pending(self) -> str | None:
        """A planned hang-up whose request has its tokens out and whose abort has not arrived."""
        for rid, after in self.hang_ups.items():
            if self.tokens.get(rid, 0) >= after and rid in self.arrived \
                    and rid not in self.finished and rid not in self.aborts:
                return rid
        return None

    def workload_over(self) -> bool:
        """Whether every request of the plan is gone (answered, aborted, refused, skipped): the
        driver sends nothing more to this server."""
        self.read_notes()
        return bool(self.order) and all(self._gone(rid) for rid in self.order)

    def ready(self) -> bool:
        """Whether the scheduler may run its next pass: every request the driver keeps in flight
        has arrived (or is held), and no hang-up is waiting for its client to go."""
        count, want = self.in_flight()
        return count >= want and self.hang_up_pending() is None

    def admit(self, pull: Callable[[bool], Iterable[Any]]) -> list[Any]:
        """What the scheduler receives this pass. `pull(first)` is SGLang's own receive (`first`:
        the pass's first call). The plan's requests are held back until the gate is ready, then
        let in together in plan order; anything else passes with them."""
        passing: list[Any] = []
        first, deadline = True, None
        while True:
            self.read_notes()
            arrivals = list(pull(first))
            if arrivals and not self.order:
                # The driver notes its plan before it sends anything, so a request pulled now
                # may have a plan written after the read above: read again before sorting, or
                # the request passes uncounted and every later pass waits for it in vain.
                self.read_notes()
            for obj in arrivals:
                self._sort(obj, passing)
            first = False
            if not self.order or self.ready():
                break
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now >= deadline:
                self.timeouts += 1
                count, want = self.in_flight()
                self._write_event({"kind": "gate_timeout", "step": self._step(), "in_flight": count,
                                   "want": want, "hang_up": self.hang_up_pending(),
                                   "timeout_s": self.timeout_s})
                break
            time.sleep(POLL_S)
        released = sorted(self._held_back, key=lambda obj: self.order.get(obj.rid, len(self.order)))
        self._held_back = []
        if released:  # the run's admissions, comparable run to run (`trace_of` keeps them)
            self._write_event({"kind": "admitted", "step": self._step(), "rids": [obj.rid for obj in released]})
        return passing + released

    def _sort(self, obj: Any, passing: list[Any]) -> None:
        kind, rid = type(obj).__name__, getattr(obj, "rid", None)
        if kind == _GENERATE and isinstance(rid, str):
            self.arrived.add(rid)  # one that passed before any plan still counts once the plan comes
            if rid in self.order:
                self._held_back.append(obj)
                return
        if kind == _ABORT and isinstance(rid, str):
            self.aborts.add(rid)
        passing.append(obj)


# ---- hooks into SGLang's scheduler process -------------------------------------------------

_gate: LockstepGate | None = None


def attach(write_event: Callable[[dict], None], step: Callable[[], int]) -> LockstepGate | None:
    """Arm the gate in this scheduler process when the server was started with a gate file; the
    receive and send hooks (`hook_receiver`, `hook_sender`) act only once it is armed."""
    global _gate
    path = os.environ.get(GATE_ENV)
    if not path:
        return None
    _gate = LockstepGate(path, write_event, step)
    return _gate


def workload_over() -> bool:
    """Whether this scheduler's gate has seen the whole plan gone (False without a gate)."""
    return _gate is not None and _gate.workload_over()


def hook_receiver(receiver_class: type) -> None:
    """SGLang's `SchedulerRequestReceiver.recv_requests`: through the gate once it is armed."""
    recv_requests = receiver_class.recv_requests
    if getattr(recv_requests, "__canary_gated__", False):
        return

    def recv_gated(self, local_reqs=None, *args, **kwargs):
        gate = _gate
        if gate is None:
            return recv_requests(self, local_reqs, *args, **kwargs)
        return gate.admit(lambda first: recv_requests(self, local_reqs if first else None, *args, **kwargs))

    recv_gated.__canary_gated__ = True
    recv_gated.__wrapped__ = recv_requests
    receiver_class.recv_requests = recv_gated


def hook_sender(sender_class: type) -> None:
    """SGLang's `SenderWrapper.send_output` (every output of the scheduler's): seen by the gate."""
    send_output = sender_class.send_output
    if getattr(send_output, "__canary_gated__", False):
        return

    def send_seen(self, output, *args, **kwargs):
        gate = _gate
        if gate is not None:
            gate.observe_output(output)
        return send_output(self, output, *args, **kwargs)

    send_seen.__canary_gated__ = True
    send_seen.__wrapped__ = send_output
    sender_class.send_output = send_seen
