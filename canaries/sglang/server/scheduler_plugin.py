"""The suite inside SGLang's scheduler process: SGLang's own log records become the suite's events,
each stamped with the scheduler's step.

`install()` runs in every process of a server the suite launches (the plugin's sitecustomize),
and acts only where SGLang builds its `Scheduler`: it keeps that object (its `forward_ct` is the
step) and adds a handler to the `sglang` logger that passes every record through
`log_events.events_of_line` (detectors) and `landing_of_line` (SGLang's own perturbations), and
appends what they report to the event log `CANARY_SERVER_EVENT_LOG` names, one JSON object a line,
flushed and fsynced before the record's own handlers run on (a crash that follows loses nothing).
Nothing here raises into SGLang: a handler that fails is logging's own error.

With a gate file (`CANARY_SERVER_GATE`) requests enter the scheduler as the driver's plan says
(canaries/sglang/server/lockstep.py). With a scenario's spec (`CANARY_SERVER_SPEC`) it also arms the perturbations: before each batch
the before_step site, and through `site_hooks` the other sites, wrapped into SGLang's
`mem_cache/common.py`, its unified cache's SWA component and its `Scheduler` as each is imported.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from types import ModuleType

from canaries.sglang.server import lockstep, site_hooks
from canaries.sglang.server import reach as server_reach
from canaries.sglang.server.import_hooks import after_import
from canaries.sglang.server.knobs import KNOB_INDEX_ENV, landing_of_line
from canaries.sglang.server.log_events import events_of_record

__all__ = ["EVENT_LOG_ENV", "IDLE_ENV", "PROGRESS_ENV", "EventLogHandler", "install"]

EVENT_LOG_ENV = "CANARY_SERVER_EVENT_LOG"
# The run's spec (spec.json: engine knobs, perturbations, seed): the project's own kinds, armed in
# the scheduler process at their triggers.
SPEC_ENV = "CANARY_SERVER_SPEC"
# Where the scheduler's step count goes after every batch (the harness's watchdog reads it: a
# hang is no progress, not a slow CPU).
PROGRESS_ENV = "CANARY_SERVER_PROGRESS"
# Where the count of the scheduler's completed fully-idle passes goes (its idle checks ran).
IDLE_ENV = "CANARY_SERVER_IDLE"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MEMORY_COMMON_MODULE = "sglang.srt.mem_cache.common"
SWA_COMPONENT_MODULE = "sglang.srt.mem_cache.unified_cache.components.swa"
RECEIVER_MODULE = "sglang.srt.managers.scheduler_components.request_receiver"
SENDER_MODULE = "sglang.srt.managers.scheduler_components.output_sender"
SWEEP_MODULE = "sglang.srt.kv_canary.runner.sweep"
TREE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
_LEVELS = {"0": "OFF", "1": "WARN", "2": "STRICT"}


class EventLogHandler(logging.Handler):
    """SGLang's log records as the suite's events, appended to one JSONL file."""

    def __init__(self, path: str, scheduler: object) -> None:
        super().__init__(level=logging.DEBUG)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        self._scheduler = weakref.ref(scheduler)
        self._seq = 0
        self._lock = threading.Lock()
        self._level = _LEVELS.get(os.environ.get("SGLANG_INVARIANT_CHECK", "0"), "OFF")
        # {SGLang knob: the scenario perturbation it carries out} (canaries/sglang/server/knobs.py)
        self._knob_index: dict[str, int] = json.loads(os.environ.get(KNOB_INDEX_ENV) or "{}")
        self._landings: dict[int, int] = {}

    def step(self) -> int:
        scheduler = self._scheduler()
        return int(getattr(scheduler, "forward_ct", 0)) if scheduler is not None else 0

    def write(self, event: dict) -> None:
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": time.time(), **event}
            # Flushed, not fsync'd: what reached the kernel outlives the SIGKILL that ends every
            # server and is read by the harness at once; an fsync (~90 us here) per event cost a
            # never-evict scenario seconds of its scheduler's time.
            self._file.write(json.dumps(event, default=str) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        step = self.step()
        if self._knob_index:
            for line in text.splitlines():
                landing = landing_of_line(line, step=step, indices=self._knob_index)
                if landing is not None:
                    count = self._landings[landing["index"]] = self._landings.get(landing["index"], 0) + 1
                    self.write({**landing, "landing": count})
        for event in events_of_record(text, step=step, level=self._level):
            self.write(event)


def _watch(scheduler_class: type) -> None:
    original = scheduler_class.__init__
    if getattr(original, "__canary_watched__", False):
        return

    def init(self, *args, **kwargs):
        if not os.environ.get(EVENT_LOG_ENV):
            original(self, *args, **kwargs)
            return
        # Attached first: what SGLang logs while it builds its pools and caches counts too.
        handler = EventLogHandler(os.environ[EVENT_LOG_ENV], self)
        logging.getLogger("sglang").addHandler(handler)
        handler.write({"kind": "engine_start", "step": 0, "runtime": "sglang-server",
                       "config": {"invariant_check": handler._level.lower()}})
        original(self, *args, **kwargs)
        _arm_census(self, handler)
        lockstep.attach(handler.write, handler.step)  # requests enter as the plan says (canaries/sglang/server/lockstep.py)
        if os.environ.get(SPEC_ENV):
            _arm(self, os.environ[SPEC_ENV], handler.write)

    init.__canary_watched__ = True
    scheduler_class.__init__ = init
    if hasattr(scheduler_class, "run_batch") and hasattr(scheduler_class, "process_batch_result"):
        _hook_steps(scheduler_class)
    for name, wrap in (("_relay_forward_payload", site_hooks.relay_sampled),
                       ("stash_chunked_request", site_hooks.stash_chunked_request)):
        if hasattr(scheduler_class, name):
            setattr(scheduler_class, name, wrap(getattr(scheduler_class, name)))


def _hook_memory_common(module: ModuleType) -> None:
    """Window eviction and request release, wrapped where SGLang defines them: every module that
    imports them by name afterwards (the scheduler, its batch-result processor, the unified
    cache's SWA component) gets the wrapper."""
    for name, wrap in (("free_swa_out_of_window_slots", site_hooks.window_eviction),
                       ("release_kv_cache", site_hooks.release_kv_cache)):
        function = getattr(module, name, None)
        if function is not None and not hasattr(function, "__wrapped__"):
            setattr(module, name, wrap(function))


def _hook_swa_component(module: ModuleType) -> None:
    """The unified cache's SWA component: its chunk-boundary insert (and, should it have bound
    the window eviction before the wrapper existed, that too)."""
    function = getattr(module, "free_swa_out_of_window_slots", None)
    if function is not None and not hasattr(function, "__wrapped__"):
        module.free_swa_out_of_window_slots = site_hooks.window_eviction(function)
    component = getattr(module, "SWAComponent", None)
    if component is not None and not hasattr(component.free_out_of_window_slots, "__wrapped__"):
        component.free_out_of_window_slots = site_hooks.chunk_boundary(component.free_out_of_window_slots)


def _hook_steps(scheduler_class: type) -> None:
    """Before each batch runs: the armed perturbations' before_step site; after its result:
    the finished requests the request_finish trigger counts."""
    run_batch = scheduler_class.run_batch
    process_batch_result = scheduler_class.process_batch_result

    def run_batch_perturbed(self, batch, *args, **kwargs):
        armed = getattr(self, "_canary_perturber", None)
        if armed is not None:
            from engine_stub.perturb.sites import BeforeStep

            perturber, facade = armed
            site_hooks.set_forward(batch)  # the kinds see the KV written so far, not this forward's
            try:
                perturber.at(BeforeStep(), facade)
                reach = server_reach.current()
                if reach is not None:  # the forward and its canary read what the batch covers
                    reach.batch(batch)
            finally:
                site_hooks.set_forward(None)
        result = run_batch(self, batch, *args, **kwargs)
        _note_progress(int(getattr(self, "forward_ct", 0)))
        return result

    def process_batch_result_counted(self, batch, *args, **kwargs):
        out = process_batch_result(self, batch, *args, **kwargs)
        armed = getattr(self, "_canary_perturber", None)
        if armed is not None and batch is not None:
            armed[1].finished_requests += sum(1 for r in batch.reqs if r.finished())
        census = getattr(self, "_canary_census", None)
        if census is not None and census.after_batch():
            reach = server_reach.current()
            if reach is not None:
                reach.census_pass("the census (after a batch)")
        return out

    scheduler_class.run_batch = run_batch_perturbed
    scheduler_class.process_batch_result = process_batch_result_counted
    if hasattr(scheduler_class, "on_idle") and hasattr(scheduler_class, "is_fully_idle"):
        on_idle = scheduler_class.on_idle

        def on_idle_counted(self, *args, **kwargs):
            fully_idle = self.is_fully_idle()
            reach = server_reach.current() if fully_idle else None
            if reach is not None:  # what SGLang's idle checks and the census are about to read
                reach.idle()
            out = on_idle(self, *args, **kwargs)
            if fully_idle:  # its leak and tree checks ran (managers/scheduler.py `on_idle`)
                census = getattr(self, "_canary_census", None)
                if census is not None:
                    census.at_idle()  # then the suite's own (strict: may stop the scheduler)
                if reach is not None:  # before the pass is counted: the harness stops at it
                    reach.close_if_over(lockstep.workload_over)
                _note_idle_pass()
                time.sleep(_IDLE_YIELD_S)
            return out

        scheduler_class.on_idle = on_idle_counted


def _hook_tree(module: ModuleType) -> None:
    """The unified radix cache's insert of a request's row (a reader, for reachability)."""
    tree_class = getattr(module, "UnifiedRadixCache", None)
    function = getattr(tree_class, "checkpoint_into_tree", None)
    if function is not None and not hasattr(function, "__wrapped__"):
        tree_class.checkpoint_into_tree = site_hooks.checkpoint_into_tree(function)


def _hook_sweep(module: ModuleType) -> None:
    """The KV canary's radix sweep: a pass that ran read every slot the tree holds."""
    orchestrator_class = getattr(module, "SweepOrchestrator", None)
    maybe_run_sweep = getattr(orchestrator_class, "maybe_run_sweep", None)
    if maybe_run_sweep is None or hasattr(maybe_run_sweep, "__wrapped__"):
        return

    def maybe_run_sweep_seen(self, *args, **kwargs):
        before = getattr(self, "sweep_passes", 0)
        out = maybe_run_sweep(self, *args, **kwargs)
        reach = server_reach.current()
        if reach is not None and getattr(self, "sweep_passes", 0) != before:
            reach.swept()
        return out

    maybe_run_sweep_seen.__wrapped__ = maybe_run_sweep
    orchestrator_class.maybe_run_sweep = maybe_run_sweep_seen


_idle_passes = 0
_idle_fd: int | None = None
# SGLang's scheduler loops without pause while fully idle (no `--sleep-on-idle`), its idle checks
# every pass: 60,000-70,000 passes over 17 library scenarios, a core taken from the server beside
# it on two cores. A millisecond after each fully idle pass leaves a few thousand (each still one
# of SGLang's idle checks on the final state, which the census reads once per step anyway) and
# the same verdicts: 17 scenarios 28.6 / 31.8 -> 26.2 / 27.3 s, alternated.
_IDLE_YIELD_S = 0.001


def _note_idle_pass() -> None:
    """Count a completed idle pass in the idle file (the harness stops a server once one has run
    after the workload: SGLang's own idle checks have then seen the final state)."""
    global _idle_passes, _idle_fd
    path = os.environ.get(IDLE_ENV)
    if not path:
        return
    _idle_passes += 1
    if _idle_fd is None:
        _idle_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(_idle_fd, f"{_idle_passes:>20}\n".encode(), 0)


_progress_fd: int | None = None


def _note_progress(step: int) -> None:
    """Overwrite the progress file with the step count (one fixed-width line, no reader sees a
    torn number)."""
    global _progress_fd
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    if _progress_fd is None:
        _progress_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(_progress_fd, f"{step:>20}\n".encode(), 0)


def _arm_census(scheduler: object, handler: EventLogHandler) -> None:
    """The suite's census of this scheduler's memory (canaries/sglang/server/census.py), unless
    `CANARY_SERVER_CENSUS=off`; a `census` event says whether it is armed, and if the release's
    objects lack what it reads, which attribute."""
    from canaries.sglang.server.census import CENSUS_ENV, ServerCensus, unreadable

    if os.environ.get(CENSUS_ENV, "on") == "off":
        handler.write({"kind": "census", "step": 0, "armed": False, "reason": f"{CENSUS_ENV}=off"})
        return
    reason = unreadable(scheduler)
    if reason is not None:
        handler.write({"kind": "census", "step": 0, "armed": False, "unreadable": True, "reason": reason})
        return
    window = int(getattr(scheduler, "sliding_window_size", None) or 0)
    scheduler._canary_census = ServerCensus(scheduler, window, handler.write, handler.step)
    handler.write({"kind": "census", "step": 0, "armed": True,
                   "strict_idle": scheduler._canary_census.strict_idle,
                   "after_batches": scheduler._canary_census.strict_steps})


def _arm(scheduler: object, spec_path: str, write) -> None:
    """The scenario's perturbations, on the engine's own Perturber, over SGLang's objects."""
    from canaries.sglang.server.sglang_view import SchedulerFacade, SGLangView
    from engine_stub.perturb.loader import load_engine_scenario

    knobs, perturber = load_engine_scenario(spec_path, sglang_knobs=True)
    if perturber is None:
        return
    window, page_size = int(knobs.get("window", 16)), int(knobs.get("page_size", 1))
    facade = SchedulerFacade(scheduler, window, page_size, write)
    perturber._view = SGLangView(scheduler, window, page_size)  # the kinds' view: SGLang's objects
    scheduler._canary_perturber = (perturber, facade)
    site_hooks.arm(perturber, facade)
    if json.loads(os.environ.get(KNOB_INDEX_ENV) or "{}"):
        # SGLang's knobs land inside its forward, where no read is reported around them: their
        # damage is not followed, so no damage of the run is called unread (it stays MISSED).
        return
    server_reach.arm(scheduler, perturber, facade.events.write, window=window,
                     canary=knobs.get("kv_canary", "log") != "off",
                     census=getattr(scheduler, "_canary_census", None) is not None)


def install(always: bool = False) -> None:
    """Watch SGLang's scheduler where an event log is asked for, or `always` (a warm parent whose
    forked servers each name theirs); idempotent."""
    if always or os.environ.get(EVENT_LOG_ENV):
        after_import(MEMORY_COMMON_MODULE, _hook_memory_common)
        after_import(SWA_COMPONENT_MODULE, _hook_swa_component)
        after_import(RECEIVER_MODULE, lambda module: lockstep.hook_receiver(module.SchedulerRequestReceiver))
        after_import(SENDER_MODULE, lambda module: lockstep.hook_sender(module.SenderWrapper))
        after_import(SCHEDULER_MODULE, lambda module: _watch(module.Scheduler))
        after_import(SWEEP_MODULE, _hook_sweep)
        after_import(TREE_MODULE, _hook_tree)
