"""SGLang's own server (`python -m sglang.launch_server`) as a process group the suite owns.

`SGLangServer.start` writes the tiny hybrid-SWA model for the engine configuration, launches the
server from an SGLang venv in a session of its own (the tokenizer manager, the scheduler and the
detokenizer it spawns share that process group), and returns once `/ready` answers 200 (not
`/health`, which runs a generation of its own through the memory path under test). `stop`
ends the whole group, however the run ends (the shared safety net calls it at exit, on SIGTERM
and on Ctrl-C): no orphans.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import requests

from canaries.runtime import safety
from canaries.runtime.warm import WarmProcess, start_mode
from canaries.sglang.server.knobs import knob_env, knob_refusals
from canaries.sglang.server.launch import ServerLaunch
from canaries.sglang.server.lockstep import GATE_ENV, GateNotes
from canaries.sglang.server.model import ServerModel
from canaries.sglang.server.scheduler_plugin import EVENT_LOG_ENV, IDLE_ENV, PROGRESS_ENV
from canaries.sglang.warm_parent import PLUGIN_DIR, REPO_ROOT, prestart_parent, warm_parent
from engine_stub.config import EngineConfig

__all__ = ["PLUGIN_DIR", "SGLangServer", "ServerStartError", "prestart_parent"]

READY_TIMEOUT_S = 600.0  # almost all of a start is imports: 65-80 s on two idle cores
PORT_ATTEMPTS = 3  # a port taken under the server before it binds: start again on another
# How long a stop waits for the scheduler's next fully-idle pass (its leak and tree checks) before
# it falls back to SIGTERM: a pass runs every loop of an idle scheduler, well under a second.
IDLE_PASS_WAIT_S = 3.0
GATE_FILE = "gate.jsonl"  # a run's lockstep gate file (the driver's plan and notes)
READY_POLL_S = 0.05  # a warm server is ready in 1-2 s: a coarser poll is a large share of that


class ServerStartError(RuntimeError):
    """The server exited or did not answer /ready in time; the message ends with its log tail."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _live_members(pgid: int) -> int | None:
    """How many processes of group `pgid` are alive (zombies hold nothing and are not counted);
    None where /proc cannot say."""
    live = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            live += 1
    return live


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group `pgid` is alive (a SIGKILLed scheduler takes a moment to
    go; once a zombie it holds no memory, port or file, whoever reaps it and whenever); False if
    some still is after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if _live_members(pgid) == 0:
            return True
        time.sleep(0.05)
    return False


class SGLangServer:
    """One SGLang server for one engine configuration."""

    def __init__(self, python: str | os.PathLike, config: EngineConfig, *, device: str = "cpu",
                 ready_timeout: float = READY_TIMEOUT_S, start: str = "auto") -> None:
        self.python = str(python)
        self.config = config
        self.device = device
        self.ready_timeout = ready_timeout
        # warm: forked from the warm parent (`canaries.sglang.server.fork_parent`); fresh: its own
        # `python -m sglang.launch_server`. auto: warm on a CPU, fresh where CUDA could be touched.
        self.start_mode = start_mode(start, device)
        self.proc: subprocess.Popen | WarmProcess | None = None
        self.log_path: Path | None = None
        self.event_log: Path | None = None
        self.progress_path: Path | None = None
        self.idle_path: Path | None = None
        self.stopped_at_idle = False
        self.base_url = ""
        self.launch: ServerLaunch | None = None
        self.started_s = 0.0
        self._log_file = None
        self._lock = threading.Lock()
        self._exit_code: int | None = None
        self.extra_env: dict[str, str] = {}  # what `start` added (SGLang's knobs among them)
        self._events_read = 0  # how far `crashed` has read the event log
        self._crash_seen = False
        self._stopped = False  # its group was stopped and is gone

    def start(self, run_dir: str | os.PathLike, extra_env: dict[str, str] | None = None) -> str:
        """Launch the server and return its base URL once /ready answers 200.

        Its scheduler writes the suite's events to `run_dir/events.jsonl` (the plugin);
        `extra_env` adds variables (SGLang's own perturbation knobs)."""
        self.extra_env = dict(extra_env or {})
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once(run_dir, extra_env)
            except ServerStartError as exc:
                # Another process took the port between our probe and the server's bind (its
                # imports take a minute), or the launcher gave up on its own start-up request on
                # a loaded machine (`_freeze_gc_after_server_warmup`'s 10-second POST, then exit
                # 3) with its scheduler alive: a new start, not a failed run. A scheduler that
                # died by a check of its own is the engine's verdict and is not retried.
                retry = not safety.stopping() and ("address already in use" in str(exc) or (
                    "exited with" in str(exc) and not self.crashed()))
                if attempt == PORT_ATTEMPTS or not retry:
                    raise
                self.stop()
                self.proc = None
                self._set_aside(attempt)
        raise AssertionError("unreachable")

    def _set_aside(self, attempt: int) -> None:
        """Keep a failed start's log and events beside the run (`*.attempt-N`), out of the
        verdict's way: the next start writes them afresh."""
        for path in (self.log_path, self.event_log, self.progress_path, self.idle_path):
            if path is not None and path.exists():
                path.replace(path.with_name(f"{path.name}.attempt-{attempt}"))

    def _start_once(self, run_dir: str | os.PathLike, extra_env: dict[str, str] | None) -> str:
        if self.proc is not None:
            raise RuntimeError("this server was already started")
        self._stopped = False
        run_dir = Path(run_dir).resolve()
        model_dir = ServerModel.of(self.config).write(run_dir / "model")
        self.launch = ServerLaunch(self.config, model_dir, _free_port(), self.device)
        self.log_path = run_dir / "server.log"
        self.event_log = run_dir / "events.jsonl"
        self.progress_path = run_dir / "progress"
        self.idle_path = run_dir / "idle"
        self._events_read, self._crash_seen = 0, False  # a new event log (an earlier one set aside)
        env = {**os.environ, **self.launch.env(PLUGIN_DIR, REPO_ROOT), **(extra_env or {}),
               EVENT_LOG_ENV: str(self.event_log), PROGRESS_ENV: str(self.progress_path),
               IDLE_ENV: str(self.idle_path)}
        safety.install_sigterm_handler()
        started = time.monotonic()
        if self.start_mode == "warm":
            parent = warm_parent(self.python, self.device)
            self.proc = parent.spawn(self.launch.args(), env, self.log_path, cwd=run_dir)
        else:
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(self.launch.argv(self.python), stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                         cwd=run_dir, start_new_session=True)
        safety.register(self)
        self.base_url = f"http://127.0.0.1:{self.launch.port}"
        deadline = started + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"sglang.launch_server exited with {self.proc.returncode} before "
                                       f"it served:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException, ValueError):
                if requests.get(self.base_url + "/ready", timeout=2).status_code == 200 \
                        and self._serves(model_dir):
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"sglang.launch_server did not answer /ready within "
                                       f"{self.ready_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(READY_POLL_S)
        self.started_s = time.monotonic() - started
        return self.base_url

    def _serves(self, model_dir: Path) -> bool:
        """Whether the server on our port is ours (its model is our model directory), not another
        one that took the port first."""
        info = requests.get(self.base_url + "/model_info", timeout=2).json()
        return Path(str(info.get("model_path", ""))) == model_dir

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the launcher, wait up to `timeout`, then SIGKILL its whole group; the exit code."""
        with self._lock:
            proc = self.proc
            if proc is None:
                return None
            if self._stopped:  # its group is gone, and its pid may be another's by now
                return self._exit_code
            try:
                # A run being stopped (Ctrl-C) judges nothing: no wait for the idle checks.
                self.stopped_at_idle = (proc.poll() is None and not self.crashed() and not safety.stopping()
                                        and self._idle_pass_after(IDLE_PASS_WAIT_S))
                # A dead scheduler (the launcher's SIGQUIT handler then sleeps 5 s before its
                # diagnostics), or one whose idle checks ran after the workload, goes by SIGKILL
                # at once: nothing is left to see, and SGLang's SIGTERM watchdog polls every 5 s.
                if proc.poll() is None and not (self.stopped_at_idle or self.crashed()):
                    # The launcher alone: it drains and stops its scheduler and detokenizer
                    # (a SIGTERM to them too reads to SGLang as a crashed scheduler).
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout)
                    except subprocess.TimeoutExpired:
                        pass
                # The scheduler and detokenizer may outlive the launcher: the group goes too.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                _wait_group_gone(proc.pid, 10.0)
                self._exit_code = 0 if self.stopped_at_idle else proc.returncode
                self._stopped = True
            finally:
                if self._log_file is not None:
                    with contextlib.suppress(OSError):
                        self._log_file.close()
                    self._log_file = None
                safety.unregister(self)
            return self._exit_code

    def crashed(self) -> bool:
        """Whether the event log holds the scheduler's death (a `crash` event); read on from
        where the last call stopped, each complete line once."""
        import json

        log = self.event_log
        if self._crash_seen or log is None:
            return self._crash_seen
        try:
            with open(log, "rb") as f:
                f.seek(self._events_read)
                chunk = f.read()
        except OSError:
            return False
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._events_read += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                if json.loads(line).get("kind") == "crash":
                    self._crash_seen = True
                    break
        return self._crash_seen

    def end_if_crashed(self) -> bool:
        """SIGKILL the whole group once the scheduler has died (its death is in the event log):
        SGLang's launcher would sleep 5 s in its SIGQUIT handler before it exits, and every request
        in flight waits on it. True if the server was crashed."""
        if not self.crashed():
            return False
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        return True

    def _idle_passes(self) -> int:
        try:
            return int(self.idle_path.read_text(encoding="ascii").strip() or 0) if self.idle_path else 0
        except (OSError, ValueError):
            return 0

    def _idle_pass_after(self, timeout: float) -> bool:
        """Whether the scheduler completes a fully-idle pass (its idle checks) within `timeout`
        from now: the workload is over, so that pass saw the final state. False as soon as the
        scheduler is seen dead."""
        before = self._idle_passes()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle_passes() > before:
                return True
            if self.proc is None or self.proc.poll() is not None or self.crashed():
                return False
            time.sleep(0.05)
        return False

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@functools.cache
def _release_of(python: str) -> str | None:
    from canaries.sglang.releases.venvs import installed_version

    return installed_version(Path(python))


@functools.cache
def _sites_missing(python: str) -> dict[str, str]:
    """The hook sites the sglang `python` imports (a patched copy's included) has no place for."""
    from canaries.sglang.releases.patches import package_dir
    from canaries.sglang.server.release_sites import missing_sites

    return missing_sites(package_dir(Path(python)))


class ServerUnsupported(RuntimeError):
    """The scenario asks for something this runtime cannot do on SGLang's server; the message
    names it (the run is then INCONCLUSIVE with that reason, never silently skipped)."""


# Engine knobs of a spec the server does not take: our engine's lockstep gate (the server's is the
# plugin's, fed by the driver's notes), the device (the runtime's own), the memory backend.
_HARNESS_KNOBS = ("gate_requests", "gate_concurrency", "gate_timeout_s", "device", "memory")


# The engine's hook sites placed in SGLang's scheduler process: before_step by the plugin's
# run_batch hook, the others by canaries/sglang/server/site_hooks.py (after_forward and cache_hit have no
# kind yet, so no hook).
HOOKED_SITES = ("before_step", "on_window_eviction", "on_request_finish", "on_sampling", "on_chunk_boundary")


def unsupported_kinds(perturbations: list[dict], missing: dict[str, str] | None = None,
                      release: str = "") -> list[str]:
    """Why each perturbation of a spec cannot be placed in SGLang's scheduler (empty: all can).
    `missing` (`release_sites.missing_sites`): the sites `release` has no place for."""
    from engine_stub.perturb.kinds import KINDS

    reasons = []
    for index, spec in enumerate(perturbations):
        kind = KINDS.get(spec.get("kind"))
        if kind is None:
            reasons.append(f"perturbations[{index}]: unknown kind {spec.get('kind')!r}")
        elif kind.site.value not in HOOKED_SITES:
            reasons.append(f"perturbations[{index}]: kind {kind.name} acts at {kind.site.value}, "
                           "a site with no hook in SGLang's scheduler yet (hooked: "
                           f"{', '.join(HOOKED_SITES)})")
        elif kind.site.value in (missing or {}):
            reasons.append(f"perturbations[{index}]: kind {kind.name} acts at {kind.site.value}, which "
                           f"SGLang {release or '?'}'s server cannot hook: {missing[kind.site.value]}")
    return reasons


def spec_refusals(spec: dict, missing: dict[str, str] | None = None, release: str = "") -> list[tuple[str, str]]:
    """(field path, why) for each part of an engine spec (`runner.spec_for`, `engine_spec`) that
    SGLang's server cannot run as the scenario means it; empty: it can. `canary validate
    --runtime sglang-server` reports them with their lines; a run refuses the scenario.
    `missing`/`release`: the sites that release has no place for (`unsupported_kinds`)."""
    from canaries.sglang.server.launch import refusals
    from engine_stub.config import ConfigError, config_from_sources

    found = []
    knobs = {k: v for k, v in (spec.get("engine") or {}).items() if k not in _HARNESS_KNOBS}
    try:
        config = config_from_sources(overrides=knobs, environ={})
    except ConfigError as exc:
        return [("engine", str(exc))]
    found += [(f"engine.{field}", why) for field, why in refusals(config)]
    for reason in unsupported_kinds(list(spec.get("perturbations") or []), missing, release):
        where, _, why = reason.partition(": ")
        found.append((f"{where}.kind", why))
    specs = _perturbation_specs(spec)
    if isinstance(specs, tuple):
        return [*found, specs]
    return found + knob_refusals(specs, spec.get("engine") or {})


def _perturbation_specs(spec: dict) -> list | tuple[str, str]:
    """The spec's perturbations parsed, or (field path, why) for the first bad one."""
    from engine_stub.perturb.spec import SpecError, parse_perturbations

    try:
        return parse_perturbations(spec.get("perturbations"))
    except SpecError as exc:
        return (exc.path, exc.message)


class SGLangServerRuntime:
    """`canary run --runtime sglang-server`: one SGLang server per scenario, from the server venv
    (`make-sglang-venv.sh --server`), its engine section as flags, the scenario's perturbations
    armed in its scheduler process, its events from its own log (canaries/sglang/server/)."""

    # No step for this long with requests outstanding is a hang: a fresh server's first forward on
    # a loaded two-core CPU (lazy initialisation, the canary's kernels in Triton's interpreter) has
    # taken over a minute here.
    stall_s = 240.0
    poll_s = 0.25  # a dead scheduler is seen (and its launcher ended) within this
    # A planned hang-up streams and closes the connection (the lockstep gate in SGLang's scheduler
    # waits for the disconnect's abort before the next pass).
    hang_up_by = "stream"

    def __init__(self, *, ready_timeout: float = READY_TIMEOUT_S, python: str | os.PathLike | None = None,
                 engine_root: str | os.PathLike | None = None, device: str = "cpu", start: str | None = None,
                 extra_env: dict[str, str] | None = None, **_: object) -> None:
        if engine_root is not None:
            raise ServerUnsupported("the sglang-server runtime runs SGLang's code: another engine_stub "
                                    "(a catalogue mutant, another commit) does not apply")
        if python is None:
            from canaries.sglang.releases.venvs import find_python

            python = find_python("0.5.23", server=True)
        if python is None:
            raise ServerUnsupported("no venv runs SGLang's server here: bash scripts/make-sglang-venv.sh --server")
        self.python = str(python)
        self.device = device
        # The runner's timeout is sized for our engine (seconds); a server start is mostly imports.
        self.ready_timeout = max(ready_timeout, READY_TIMEOUT_S)
        self.server: SGLangServer | None = None
        self.exit_code: int | None = None
        # auto | warm | fresh, as the local runtime's (CANARY_ENGINE_START); the mode that ran is
        # `start_mode`.
        self.requested_start = start or os.environ.get("CANARY_ENGINE_START") or "auto"
        self.start_mode: str | None = None
        # What every server of this runtime adds to its launch (a plain reference: no eviction).
        self.extra_env = dict(extra_env or {})
        self.lockstep: GateNotes | None = None  # the driver's notes to the server's gate, once started

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.proc is not None and self.server.proc.poll() is None

    def start(self, spec_path: str | os.PathLike, run_dir: str | os.PathLike) -> str:
        import json

        from engine_stub.config import config_from_sources

        spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        reasons = spec_refusals(spec, _sites_missing(self.python), _release_of(self.python) or "")
        if reasons:
            self._unsupported(run_dir, "; ".join(f"{where}: {why}" for where, why in reasons))
        knobs = {k: v for k, v in (spec.get("engine") or {}).items() if k not in _HARNESS_KNOBS}
        config = config_from_sources(overrides=knobs, environ={})
        self.server = SGLangServer(self.python, config, device=self._device_of(spec),
                                   ready_timeout=self.ready_timeout, start=self.requested_start)
        self.start_mode = self.server.start_mode
        extra = dict(self.extra_env)
        if spec.get("perturbations"):
            extra["CANARY_SERVER_SPEC"] = str(Path(spec_path).resolve())
        extra.update(knob_env(_perturbation_specs(spec)))  # SGLang's own knobs (`via: sglang_knob`)
        # The lockstep gate: the driver notes its plan in this file, the plugin in SGLang's
        # scheduler lets requests in as it says (canaries/sglang/server/lockstep.py).
        gate = Path(run_dir).resolve() / GATE_FILE
        gate.write_bytes(b"")
        extra[GATE_ENV] = str(gate)
        self.lockstep = GateNotes(gate)
        try:
            return self.server.start(run_dir, extra)
        except ServerStartError:
            if not self._crashed():
                raise
            # Its scheduler died by one of its own checks before it served: that is the engine's
            # verdict (its events say which), not the harness's; every request will find it dead.
            return self.server.base_url

    def _device_of(self, spec: dict) -> str:
        """The scenario's device (`--device` lands in its spec), else the runtime's: cpu or cuda."""
        from canaries.runtime.warm import has_cuda_device

        device = str((spec.get("engine") or {}).get("device") or self.device)
        if device == "auto":
            return "cuda" if has_cuda_device() else "cpu"
        return "cuda" if device.startswith("cuda") else "cpu"

    @staticmethod
    def _unsupported(run_dir: str | os.PathLike, reason: str) -> None:
        """Refuse the scenario: the reason is its INCONCLUSIVE verdict's, and the run dir's note
        (`canary parity` counts it unsupported, not unexplained)."""
        from canaries.sglang.parity import UNSUPPORTED_NOTE

        with contextlib.suppress(OSError):
            Path(run_dir, UNSUPPORTED_NOTE).write_text(reason + "\n", encoding="utf-8")
        raise ServerUnsupported(reason)

    def server_record(self) -> dict | None:
        """What a verdict records of the server: SGLang's release, its command line and the
        variables the launch set (None before a start)."""
        server = self.server
        if server is None or server.launch is None:
            return None
        return {"sglang_version": _release_of(self.python), "python": self.python,
                "args": server.launch.args(),
                "env": {**server.launch.env(PLUGIN_DIR, REPO_ROOT),
                        **{k: v for k, v in server.extra_env.items() if k.startswith("SGLANG_")}},
                "start_mode": server.start_mode, "started_s": round(server.started_s, 3)}

    def _crashed(self) -> bool:
        return self.server is not None and self.server.crashed()

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.server is None:
            return None
        graceful = self.running
        self.exit_code = self.server.stop(timeout)
        if graceful and self.exit_code == 0 and self.server.event_log is not None:
            # It served until asked to stop and stopped cleanly: the engine's own shutdown record.
            with open(self.server.event_log, "a", encoding="utf-8") as log:
                log.write('{"kind": "shutdown", "step": -1, "by": "harness"}\n')
        return self.exit_code

    def progress(self) -> tuple[int, bool] | None:
        """(the scheduler's step count, whether the server is alive): the watchdog's probe. A
        dead server answers nothing (None); one that has run no batch yet is at step 0."""
        if not self.running or self.server.end_if_crashed():
            return None
        path = self.server.progress_path
        try:
            return int(path.read_text(encoding="ascii").strip() or 0), True
        except (OSError, ValueError):
            return 0, True

    def log_tail(self, lines: int = 30) -> str:
        return self.server.log_tail(lines) if self.server is not None else ""
