"""Run scenarios end to end: spec, engine, workload, idle check, stop, oracle, verdict.

`run_scenario` runs one scenario into a run directory (spec.json, engine.log, events.jsonl,
responses.jsonl, verdict.json) and returns its `VerdictRecord`. `run_many` runs a list of them
with a pool of `jobs` workers, appends each verdict to `<report>/verdicts.jsonl` as it completes,
and writes `junit.xml` and the kill matrix at the end.

An interrupted run (SIGINT, SIGTERM, `cancel_all`) still reports every selected scenario: those
running are INCONCLUSIVE with reason "interrupted", those never started NOT_RUN, and every report
says the run was interrupted. `run_many` then raises `RunInterrupted`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from canaries.driver import Planned, make_plan
from canaries.driver import drive as drive_workload
from canaries.watchdog import Patience

if TYPE_CHECKING:
    from canaries.runtime.safety import SignalLatch

__all__ = ["run_scenario", "run_many", "patience_for", "new_run_id", "default_report_dir", "cancel_all", "cancelled",
           "repo_root", "spec_for", "RunInterrupted", "INTERRUPTED", "NOT_RUN"]

# An engine that exits before it is ready is seen at once (its ready pipe closes): this bounds
# only a live engine that is slow to start, e.g. on a loaded runner or a shared GPU.
READY_TIMEOUT_S = 120.0
IDLE_WAIT_S = 5.0
STOP_TIMEOUT_S = 30.0
HUNG_STOP_TIMEOUT_S = 5.0  # an engine the watchdog found stalled cannot drain: no long wait
# A hang is no engine progress for STALL_S with requests outstanding (canaries.watchdog); the
# hard cap bounds a workload that keeps progressing: HARD_CAP_PER_REQUEST_S each, at least
# MIN_HARD_CAP_S.
STALL_S = 30.0
MIN_HARD_CAP_S = 300.0
HARD_CAP_PER_REQUEST_S = 10.0
POLL_S = 0.1  # how often the run loop looks for a signal
HARNESS_RETRIES = 2  # a scenario whose run the harness failed runs again this often at most
WIND_DOWN_S = 15.0  # how long the scenarios running at an interrupt get to finish stopping

INTERRUPTED = "interrupted"  # the reason of a scenario that was running when the run stopped
NOT_RUN = "NOT_RUN"  # the verdict of a scenario an interrupted run never started

_CANCEL = threading.Event()


class RunInterrupted(KeyboardInterrupt):
    """`run_many` was interrupted; every report is written, and says so.

    `signum` is the signal (None when `cancel_all` or an error stopped the run), `records`
    one per selected scenario, `interruption` the run-level record.
    """

    def __init__(self, signum: int | None, records: list, interruption: Any) -> None:
        super().__init__(interruption.summary())
        self.signum = signum
        self.records = records
        self.interruption = interruption


class _Cancelled(Exception):
    """Raised inside `run_scenario` to skip what is left of a scenario once the run stops."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def new_run_id() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def default_report_dir(run_id: str | None = None) -> Path:
    """`reports/<run-id>/` at the repo root when running from a checkout, else under the cwd."""
    root = repo_root()
    base = root if (root / "pyproject.toml").exists() and os.access(root, os.W_OK) else Path.cwd()
    return base / "reports" / (run_id or new_run_id())


def cancelled() -> bool:
    """Whether the run is stopping (`cancel_all`, a signal): start no engine."""
    return _CANCEL.is_set()


def cancel_all() -> None:
    """Ctrl-C: start no new scenario or engine, stop every engine still running."""
    from canaries.runtime.safety import set_stopping, stop_all

    _CANCEL.set()
    set_stopping(True)
    stop_all(timeout=3.0)


def spec_for(scenario: Any, device: str | None = None, memory: str | None = None) -> dict:
    """The engine's spec: `engine_spec(scenario)` plus the lockstep gate, and the run's device
    and memory backend overrides."""
    from canaries.scenario import engine_spec

    spec = engine_spec(scenario)  # a fresh dict, its "engine" a fresh copy of the knobs
    engine = spec["engine"]
    engine["gate_requests"] = scenario.workload.served_requests  # a refused one is never received
    engine["gate_concurrency"] = scenario.workload.concurrency
    if device:
        engine["device"] = device
    if memory:
        engine["memory"] = memory
    return spec


# ---- the output oracle ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _oracle_model(layer_pattern: str, window: int, hidden_size: int, num_heads: int, seed: int):
    import torch

    from engine_stub.model import ModelConfig, TinyHybridModel

    # One thread, as each engine runs: the oracle shares the cores with the engines it judges, and
    # at these sizes a second thread only spins.
    torch.set_num_threads(1)

    return TinyHybridModel(ModelConfig(layer_pattern=layer_pattern, window=window,
                                       hidden_size=hidden_size, num_heads=num_heads, seed=seed))


_ORACLE_LOCK = threading.Lock()


def _reference(model_key: tuple, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """The greedy continuation, recomputed step by step (the engine's own oracle)."""
    return tuple(_oracle_model(*model_key).reference_generate(list(prompt), max_new_tokens))


@functools.lru_cache(maxsize=4096)
def _teacher_forced(model_key: tuple, tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The model's greedy next token after every prefix of `tokens`. Memoised: the same answer
    (a matrix's columns, a mutant's baseline) is checked once per process."""
    with _ORACLE_LOCK:
        return tuple(_oracle_model(*model_key).reference_next_tokens(list(tokens)))


def oracle_mismatches(config: dict, plan: list[Planned], responses: list[dict]) -> list[dict]:
    """Greedy responses that differ from the from-scratch reference of the config in force."""
    key = (str(config["layer_pattern"]), int(config["window"]), int(config.get("hidden_size", 32)),
           int(config.get("num_heads", 2)), int(config.get("seed", 0)))
    mismatches = []
    for planned, resp in zip(plan, responses, strict=True):
        # What was sent (a follow-up's prompt is made at send time).
        prompt, max_new_tokens = resp.get("prompt") or planned.prompt, planned.max_new_tokens
        got = resp.get("output_ids")
        if got is None:
            continue  # a failed request is the verdict's business, not the oracle's
        got = list(got)
        first = None
        if got:
            preds = list(_teacher_forced(key, tuple(prompt) + tuple(got[:-1])))[len(prompt) - 1:]
            first = next((i for i, (a, b) in enumerate(zip(got, preds, strict=True)) if a != b),
                         None)
        if first is None and len(got) != max_new_tokens:
            first = min(len(got), max_new_tokens)
        if first is not None:
            if len(mismatches) < 3:  # the full reference only for the first few: it is slow
                with _ORACLE_LOCK:
                    want = list(_reference(key, tuple(prompt), max_new_tokens))
            else:
                want = None
            mismatches.append({"rid": resp["rid"], "first_diff": first, "expected": want,
                               "got": got})
    return mismatches


class _Oracle:
    """The output oracle of a clean greedy scenario, computed on a thread of its own."""

    def __init__(self, scenario: Any, spec: dict, plan: list[Planned], events_path: Path) -> None:
        self._wanted = scenario.expect.clean and scenario.workload.temperature == 0
        self._spec, self._plan, self._events_path = spec, plan, events_path
        self._thread: threading.Thread | None = None
        self._mismatches: list[dict] = []
        self._error: str | None = None
        self.no_oracle: str | None = None  # our engine's oracle always has a reference

    def start(self, responses: list[dict]) -> None:
        if self._wanted and responses:
            self._thread = threading.Thread(target=self._run, args=(responses,), daemon=True,
                                            name="canary-oracle")
            self._thread.start()

    def _run(self, responses: list[dict]) -> None:
        # The config in force is the engine's own record of it (its first event).
        start_ev = next((e for e in _read_events(self._events_path)[:1] if e.get("kind") == "engine_start"),
                        None)
        config = (start_ev or {}).get("config") or self._spec.get("engine", {})
        try:
            self._mismatches = oracle_mismatches(config, self._plan, responses)
        except Exception as exc:  # noqa: BLE001 - an oracle failure must not pass silently
            self._error = f"the output oracle failed: {type(exc).__name__}: {exc}"

    def result(self) -> tuple[list[dict], str | None]:
        if self._thread is not None:
            self._thread.join()
        return self._mismatches, self._error


# ---- one scenario ----------------------------------------------------------------------------------


def _engine_cpu(runtime: Any) -> tuple[float, float] | None:
    """The running engine's process group's CPU time (`canaries.schedstat.group_cpu`), or None."""
    from canaries.schedstat import group_cpu

    proc = getattr(runtime, "proc", None) or getattr(getattr(runtime, "server", None), "proc", None)
    pid = getattr(proc, "pid", None)
    return group_cpu(pid) if isinstance(pid, int) else None


def _wait_idle_check(base_url: str, runtime: Any, timeout: float) -> dict | None:
    """Poll /state until the idle check ran after the last step; the state, or None."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline and runtime.running:
        with contextlib.suppress(requests.RequestException, ValueError):
            state = requests.get(f"{base_url}/state", timeout=2).json()
            idle = state.get("last_idle_check") or {}
            if idle.get("after_step") == state.get("step") and not state.get("running") \
                    and not state.get("waiting"):
                return state
        time.sleep(0.05)
    return state


def patience_for(workload: Any, runtime: Any = None) -> Patience:
    """How long a scenario's workload waits on its engine: STALL_S without progress (or what the
    runtime asks for: SGLang's server on a CPU can spend minutes in its first forward), and a hard
    cap that grows with the number of requests."""
    stall_s = max(STALL_S, float(getattr(runtime, "stall_s", STALL_S)))
    return Patience(stall_s=stall_s, poll_s=min(stall_s, float(getattr(runtime, "poll_s", 1.0))),
                    hard_cap_s=max(MIN_HARD_CAP_S, stall_s, HARD_CAP_PER_REQUEST_S * workload.total_requests))


def _read_events(path: Path) -> list[dict]:
    from engine_stub.events import read_events

    try:
        return read_events(path)
    except OSError:
        return []


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def _refuse_sglang_knobs(spec: dict, runtime: str, run_dir: Path) -> None:
    """A perturbation `via: sglang_knob` is SGLang's own knob: only its server has it. Elsewhere
    the run is refused up front (INCONCLUSIVE, counted unsupported by `canary parity`)."""
    from canaries.sglang.parity import UNSUPPORTED_NOTE

    if runtime == "sglang-server":
        return
    for index, item in enumerate(spec.get("perturbations") or []):
        if isinstance(item, dict) and item.get("via", "engine") != "engine":
            reason = (f"perturbations[{index}].via: {item['via']}: SGLang's own perturbation knob; only "
                      "SGLang's server runs it (--runtime sglang-server)")
            with contextlib.suppress(OSError):
                (run_dir / UNSUPPORTED_NOTE).write_text(reason + "\n", encoding="utf-8")
            raise RuntimeError(reason)


def run_scenario(scenario: Any, run_dir: str | os.PathLike, runtime: str = "local",
                 device: str | None = None, *, on_started: Callable[[Any], None] | None = None,
                 patience: Patience | None = None, engine_root: str | os.PathLike | None = None,
                 memory: str | None = None, engine_python: str | None = None, reference: Any = None):
    """Run one scenario into `run_dir`; its VerdictRecord (never raises for an engine failure).

    `on_started(rt)` is called once the engine serves (tests use it to kill the engine).
    `patience`: how long the workload waits on the engine (default `patience_for(workload)`).
    A harness failure inside the scenario (the engine's spawn, the fork server, an unreadable
    log) is this scenario's INCONCLUSIVE verdict, with the error as its reason.
    `engine_root`: a directory holding the `engine_stub/` to run instead of this checkout's
    (a mutant, another commit). `memory` overrides the scenario's memory backend (native|sglang)
    and `engine_python` the interpreter the engine runs under (a venv with sglang; local runtime).
    `reference` (sglang-server): whose clean answers judge the run (`canaries.sglang.oracle.
    ServerReference`; default: the plain server of the release under test).
    The run dir keeps a copy of the scenario file as it ran
    (`scenario.yaml`), so `canary repro` can rerun exactly that.
    """
    from canaries.runtime import get_runtime
    from canaries.sglang.parity import UNSUPPORTED_NOTE, unsupported_reason
    from canaries.verdict import Observation, judge

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    spec = spec_for(scenario, device, memory)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2, default=str) + "\n", encoding="utf-8")
    with contextlib.suppress(OSError):
        shutil.copyfile(scenario.path, run_dir / "scenario.yaml")
    workload = scenario.workload
    seed = scenario.seed
    plan = make_plan(workload, seed)
    responses: list[dict] = []
    error: str | None = None
    timed_out = False
    hang: str | None = None
    exit_code: int | None = None
    unsupported = False
    regressions = tuple(scenario.regressions)
    if regressions:
        # A negative test: the engine runs from a copy with these catalogue entries applied.
        from canaries.regressions import catalogue, materialize

        entries = catalogue()
        if engine_root is not None:
            raise ValueError(f"{scenario.name}: a scenario with regressions cannot run on another engine_root")
        engine_root = run_dir / "engine-src"
        (run_dir / "regressions.diff").write_text(
            materialize(engine_root, [entries[n] for n in regressions]), encoding="utf-8")
    options: dict[str, Any] = {"engine_root": engine_root}
    if engine_python:
        options["python"] = engine_python
    rt = get_runtime(runtime, ready_timeout=READY_TIMEOUT_S, **options)
    phases: dict[str, float] = {}
    oracle: Any = _Oracle(scenario, spec, plan, run_dir / "events.jsonl")

    def mark(name: str, since: list[float] = [started]) -> None:  # noqa: B006 - a running clock
        now = time.monotonic()
        phases[name] = round(now - since[0], 3)
        since[0] = now

    try:
        if _CANCEL.is_set():
            raise _Cancelled
        _refuse_sglang_knobs(spec, runtime, run_dir)
        if runtime == "sglang-server":
            from canaries.sglang.oracle import ServerAnswerOracle, ServerReference

            oracle = ServerAnswerOracle(scenario, spec, plan, run_dir, patience or patience_for(workload, rt),
                                        reference or ServerReference.default(getattr(rt, "python", None)))
        base_url = rt.start(spec_path, run_dir)
        mark("start")
        if _CANCEL.is_set():  # an engine that started as the run stopped
            raise _Cancelled
        if on_started is not None:
            on_started(rt)
        # A runtime that knows its engine's progress its own way (SGLang's server) says so.
        responses = drive_workload(base_url, workload, seed, patience or patience_for(workload, rt), plan=plan,
                                   progress=getattr(rt, "progress", None),
                                   hang_up_by=getattr(rt, "hang_up_by", "gate"),
                                   lockstep=getattr(rt, "lockstep", None), cpu=lambda: _engine_cpu(rt))
        mark("drive")
        oracle.start(responses)  # ours computed while the engine idles and stops; a server's once it stopped
        hang = next((r["hang"] for r in responses if r.get("hang")), None) if rt.running else None
        timed_out = hang is not None
        # A stalled engine runs no idle check; SGLang's server has no /state (its own idle check
        # runs as its scheduler idles).
        if rt.running and hang is None and runtime != "sglang-server":
            state = _wait_idle_check(base_url, rt, IDLE_WAIT_S)
            if state is not None:
                _write_jsonl(run_dir / "state.json", [state])
            mark("idle_wait")
    except _Cancelled:
        pass
    except RuntimeError as exc:  # the engine never became ready (or its fork server failed)
        error = str(exc)
        timed_out = "not ready within" in error
        # A refusal, not a failure (never retried as the harness's): the runtime's note, or the
        # release's own (an engine that stopped at start with ReleaseUnsupported: no CPU path).
        unsupported = (run_dir / UNSUPPORTED_NOTE).is_file()
        if not unsupported and (refused := unsupported_reason(run_dir)):
            unsupported, error = True, f"ReleaseUnsupported: {refused}"
    except Exception as exc:  # noqa: BLE001 - a harness failure is this scenario's verdict, not the run's end
        error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            exit_code = rt.stop(timeout=HUNG_STOP_TIMEOUT_S if hang else STOP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - as above; the safety net still stops the engine
            error = error or f"stopping the engine: {type(exc).__name__}: {exc}"
        mark("stop")
        if regressions:
            from canaries.runtime.warm import close_fork_server

            close_fork_server(engine_root=engine_root)
            shutil.rmtree(engine_root, ignore_errors=True)
    # Checked once the engine is down: if the run stopped before, the engine may have been
    # stopped under the scenario, and whatever it left is no verdict.
    cancelled = _CANCEL.is_set()
    try:
        events = _read_events(run_dir / "events.jsonl")
    except ValueError as exc:  # not UTF-8: no verdict can be read from it
        events, error = [], error or f"the event log is unreadable: {exc}"
    mismatches, oracle_error = oracle.result()
    if cancelled:
        mismatches = []
    error = error or oracle_error
    _write_jsonl(run_dir / "responses.jsonl", responses)
    mark("oracle")
    if mismatches:
        _write_jsonl(run_dir / "oracle_mismatches.jsonl", mismatches)
    starved = next((r["starved"] for r in responses if r.get("starved")), None)
    obs = Observation(events=events, responses=responses, exit_code=exit_code,
                      timed_out=timed_out, oracle_mismatches=[m["rid"] for m in mismatches],
                      error=error, hang=hang, unsupported=unsupported, starved=starved,
                      no_oracle=None if cancelled else oracle.no_oracle)
    record = judge(scenario, obs)
    differs = (getattr(oracle, "record", lambda: None)() or {}).get("differs")
    if differs and record.verdict in ("MISSED", "NOT_REACHED"):
        # On SGLang's server nothing else follows the damage: an answer it changed was read.
        rids = ", ".join(m["rid"] for m in differs[:5])
        record = dataclasses.replace(record, reason=f"{record.reason}; answers differ from the reference "
                                     f"for {rids}: the damage was read")
    # Whose each part of the memory path was (ours, or an SGLang release's), as the engine said.
    start = next((e for e in events if e.get("kind") == "engine_start"), None) or {}
    record.extra["memory_parts"] = start.get("memory_parts")
    if cancelled:
        record = _interrupted(record)
    duration = round(time.monotonic() - started, 3)
    record.extra.update({"duration_s": duration, "run_dir": str(run_dir), "runtime": runtime,
                         "start_mode": getattr(rt, "start_mode", None), "device": device,
                         "memory": spec["engine"].get("memory", "native"),
                         "engine_python": engine_python,
                         "exit_code": exit_code, "phases_s": phases,
                         "server": getattr(rt, "server_record", lambda: None)(),
                         "oracle": getattr(oracle, "record", lambda: None)(),
                         "repro": f"canary run {scenario.path} --runtime {runtime}"
                                  + (f" --device {device}" if device else "")})
    with contextlib.suppress(OSError):
        (run_dir / "verdict.json").write_text(json.dumps(record.to_dict(), indent=2, default=str)
                                              + "\n")
    return record


# ---- many scenarios ----------------------------------------------------------------------------


def _interrupted(record: Any) -> Any:
    """A scenario's record once the run stopped while it ran: INCONCLUSIVE, "interrupted";
    what it would have been judged stays in `extra`."""
    extra = dict(record.extra)
    extra["interrupted"] = {"state": "running", "judged": f"{record.verdict}: {record.reason}"}
    rest = record.signature.split("|", 1)[1] if "|" in record.signature else ""
    return dataclasses.replace(record, verdict="INCONCLUSIVE", passed=False, reason=INTERRUPTED,
                               signature=f"INCONCLUSIVE|{rest}", extra=extra, cause=None)


def _unjudged(scenario: Any, verdict: str, reason: str, state: str) -> Any:
    """The record of a scenario with no run to judge: never started, or never finished."""
    from canaries.verdict import VerdictRecord

    first_kind = scenario.perturbations[0].kind if scenario.perturbations else "control"
    return VerdictRecord(
        scenario=scenario.name, verdict=verdict, passed=False, reason=reason,
        signature=f"{verdict}||{first_kind}", landed=[], firings=[], latency={},
        engine_outcome="not_started" if verdict == NOT_RUN else "unknown", ledgers=None,
        seed=scenario.seed, engine=scenario.engine_knobs,
        expect=dataclasses.asdict(scenario.expect), extra={"interrupted": {"state": state}})


def _harness_failed(scenario: Any, exc: Exception) -> Any:
    """The record of a scenario whose harness raised outside the engine's run: INCONCLUSIVE,
    the error as its reason and its traceback in `extra`; the rest of the run goes on."""
    import traceback

    from canaries.verdict.record import HARNESS

    # A runtime that refuses the scenario (ServerUnsupported: it cannot run it) did not fail.
    refusal = type(exc).__name__ == "ServerUnsupported"
    said = "not run on this runtime" if refusal else "harness error"
    record = _unjudged(scenario, "INCONCLUSIVE", f"{said}: {type(exc).__name__}: {exc}", "failed")
    extra = {k: v for k, v in record.extra.items() if k != "interrupted"}
    extra["harness_error"] = "".join(traceback.format_exception(exc))[-4000:]
    return dataclasses.replace(record, extra=extra, cause=None if refusal else HARNESS)


def _run_retried(scenario: Any, run_dir: Path, retries: int, **options: Any) -> Any:
    """`run_scenario`, again (up to `retries` times) while the harness is what failed (the
    record's `cause`); each failed attempt's run dir is kept beside it (`<name>.harness-N`) and
    its reason in the final record's `extra["harness_retries"]`."""
    from canaries.verdict.record import HARNESS

    failures: list[str] = []
    while True:
        try:
            record = run_scenario(scenario, run_dir, **options)
        except Exception as exc:  # noqa: BLE001 - this scenario's harness failed; the run goes on
            record = _harness_failed(scenario, exc)
        if record.cause != HARNESS or len(failures) >= retries or _CANCEL.is_set():
            break
        failures.append(record.reason)
        aside = run_dir.with_name(f"{run_dir.name}.harness-{len(failures)}")
        shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(OSError):
            run_dir.rename(aside)
    if failures:
        record.extra["harness_retries"] = failures
    return record


def _cause(signum: int | None, error: BaseException | None) -> str:
    if signum is not None:
        return signal.Signals(signum).name
    if error is not None and not isinstance(error, KeyboardInterrupt):
        return f"{type(error).__name__}: {error}"
    return "KeyboardInterrupt" if error is not None else "cancel_all"


def run_many(scenarios: Sequence[Any], report_dir: str | os.PathLike, jobs: int = 1,
             runtime: str = "local", device: str | None = None, progress: Any = True,
             latch: SignalLatch | None = None, baseline: str | os.PathLike | None = None,
             engine_root: str | os.PathLike | None = None, memory: str | None = None,
             engine_python: str | None = None, reference: Any = None,
             harness_retries: int = HARNESS_RETRIES) -> list:
    """Run every scenario; verdicts.jsonl grows as they finish; junit.xml and the kill matrix
    at the end. Returns one record per scenario, in order. A scenario whose run the harness
    failed (the record's `cause: harness`) runs again, up to `harness_retries` times.

    SIGINT or SIGTERM (in the main thread; or `cancel_all` from anywhere) interrupts the run:
    no scenario starts after it, the running ones' engines are stopped, every selected
    scenario gets a line in verdicts.jsonl (INCONCLUSIVE "interrupted" or NOT_RUN), every
    report says the run was interrupted, and RunInterrupted is raised. Until then further
    signals are ignored, so that no second Ctrl-C can cut the reports short. A harness error
    out of one scenario (an Exception) makes that scenario INCONCLUSIVE with the error as its
    reason, and the run goes on; anything else out of a worker is handled as an interrupt,
    then re-raised.

    `latch`: the caller's entered `SignalLatch`, to watch instead of entering one here (so
    that signals stay latched beyond the run, until the caller lets go).
    """
    from canaries.report import Interruption, append_verdict
    from canaries.runtime.safety import SignalLatch, set_stopping, stop_all

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    verdicts_path = report_dir / "verdicts.jsonl"
    records: dict[int, Any] = {}
    durations: dict[str, float] = {}
    n = len(scenarios)
    _CANCEL.clear()
    set_stopping(False)

    if runtime != "sglang-server":
        # Our engine's oracle needs torch in this process: imported beside the first engines'
        # start (a warm parent's import, on the other core), not after the first scenario's drive.
        # Not a daemon: an interpreter that exits mid-import of torch can crash in its finalizer.
        threading.Thread(target=importlib.import_module, args=("engine_stub.model",), daemon=False,
                         name="oracle-import").start()

    from canaries.progress import progress_for

    # True: this run's own display; an object with started/finished: the caller's (a matrix
    # shows its columns in one display); False: none.
    shown = progress_for(n, jobs) if progress is True else (progress or None)

    def one(i: int, sc: Any):
        if _CANCEL.is_set():  # taken off the queue after the run stopped: never started
            return i, None, 0.0
        if shown is not None:
            shown.started(sc.name)
        t0 = time.monotonic()
        record = _run_retried(sc, report_dir / sc.name, harness_retries, runtime=runtime, device=device,
                              engine_root=engine_root, memory=memory, engine_python=engine_python,
                              reference=reference)
        return i, record, time.monotonic() - t0

    def append(record: Any, *, tolerant: bool) -> None:
        try:
            append_verdict(verdicts_path, record)
        except OSError as exc:
            if not tolerant:
                raise
            # Winding down: junit.xml and the kill matrix still carry the record.
            print(f"canary: could not append to {verdicts_path}: {exc}", file=sys.stderr)

    def keep(i: int, record: Any, dt: float) -> None:
        records[i] = record
        durations[scenarios[i].name] = round(dt, 3)
        append(record, tolerant=_CANCEL.is_set())
        if shown is not None:
            shown.finished(scenarios[i].name, record, dt)

    failed: dict[int, BaseException] = {}  # scenarios whose worker raised

    def collect(done: set[Future]) -> None:
        for fut in sorted(done, key=futures.__getitem__):
            try:
                i, record, dt = fut.result()
            except BaseException as exc:  # noqa: BLE001 - a harness bug: re-raised after the reports
                failed[futures[fut]] = exc
                continue
            if record is not None:
                keep(i, record, dt)

    with (SignalLatch() if latch is None else contextlib.nullcontext(latch)) as latch, \
            (shown or contextlib.nullcontext()):
        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="canary-run")
        futures: dict[Future, int] = {pool.submit(one, i, sc): i for i, sc in enumerate(scenarios)}
        pending = set(futures)
        error: BaseException | None = None
        try:
            while pending and not failed and not latch.tripped and not _CANCEL.is_set():
                done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                collect(done)
        except BaseException as exc:  # noqa: BLE001 - reported below, then re-raised
            error = exc
        if error is None and failed:
            error = failed[min(failed)]
        if len(records) == n and error is None and not latch.tripped and not _CANCEL.is_set():
            pool.shutdown(wait=True)
            ordered = [records[i] for i in range(n)]
            _finish(report_dir, ordered, durations, baseline=baseline)
            return ordered

        # Interrupted: start nothing more, stop every engine, let the running scenarios record
        # themselves (as interrupted), then write every report saying the run was interrupted.
        _CANCEL.set()
        set_stopping(True)  # an engine (an oracle's clean server) whose start is under way stops too
        pool.shutdown(wait=False, cancel_futures=True)
        if progress:
            print(f"canary: {_cause(latch.signum, error)}: stopping every engine, then writing "
                  f"the reports (further signals are ignored)", file=sys.stderr, flush=True)
        stop_all(timeout=3.0)
        # A future cancelled off the queue never counts as done for wait(): leave those out.
        pending = {f for f in pending if not f.cancelled()}
        deadline = time.monotonic() + WIND_DOWN_S
        while pending and time.monotonic() < deadline:
            done, pending = wait(pending, timeout=0.5)
            collect(done)
            stop_all(timeout=3.0)  # an engine that registered after the first sweep
        for fut, i in sorted(futures.items(), key=lambda item: item[1]):
            if i in records:
                continue
            sc = scenarios[i]
            if i in failed:
                exc = failed[i]
                keep(i, _unjudged(sc, "INCONCLUSIVE", f"harness error: {type(exc).__name__}: "
                                  f"{exc}", "failed"), 0.0)
            elif fut.cancelled() or fut.done():  # never dequeued, or dequeued after the stop
                keep(i, _unjudged(sc, NOT_RUN, "not run: the run was interrupted before it "
                                  "started", "not_run"), 0.0)
            else:  # still winding down after WIND_DOWN_S
                keep(i, _unjudged(sc, "INCONCLUSIVE", INTERRUPTED, "running"), 0.0)
        ordered = [records[i] for i in range(n)]
        cut_off = [r.scenario for r in ordered
                   if (r.extra.get("interrupted") or {}).get("state") in ("running", "failed")]
        not_run = [r.scenario for r in ordered if r.verdict == NOT_RUN]
        interruption = Interruption(
            cause=_cause(latch.signum, error), selected=tuple(s.name for s in scenarios),
            judged=tuple(r.scenario for r in ordered
                         if r.scenario not in cut_off and r.scenario not in not_run),
            interrupted=tuple(cut_off), not_run=tuple(not_run))
        append(interruption.to_dict(), tolerant=True)
        _finish(report_dir, ordered, durations, interruption, baseline=baseline)
    if error is not None and not isinstance(error, KeyboardInterrupt):
        raise error
    raise RunInterrupted(latch.signum if latch.signum is not None else
                         (signal.SIGINT if isinstance(error, KeyboardInterrupt) else None),
                         ordered, interruption) from error


def _finish(report_dir: Path, records: list, durations: dict, interruption: Any = None,
            baseline: str | os.PathLike | None = None) -> None:
    """The end-of-run files. A failure here is reported, never allowed to lose verdicts.jsonl."""
    from canaries.report import write_junit, write_kill_matrix
    from canaries.scenario import known_detectors

    try:
        write_junit(records, report_dir / "junit.xml", durations=durations,
                    interruption=interruption)
        write_kill_matrix(records, report_dir, known_detectors(), interruption)
    except Exception as exc:  # noqa: BLE001 - the verdicts are already on disk
        print(f"canary: could not write the run summary files in {report_dir}: {exc}", file=sys.stderr)
    # On its own: a page that cannot be drawn must not cost the CI files above.
    try:
        from canaries.report.html import write_html

        diff = None
        if baseline is not None:
            from canaries.report.diff import diff_runs

            diff = diff_runs(Path(baseline), report_dir)
        write_html(report_dir, diff=diff)
    except Exception as exc:  # noqa: BLE001 - the verdicts are already on disk
        print(f"canary: could not write {report_dir / 'index.html'}: {exc}", file=sys.stderr)
