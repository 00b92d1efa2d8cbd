"""Warm starts: an engine forked from the pre-warmed parent behaves exactly as a fresh process
(verdicts, event traces, crash and kill codes), and nothing outlives the harness."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from canaries.conftest import engines_under
from canaries.runner import run_scenario
from canaries.runtime.warm import start_mode
from canaries.scenario import load_scenario
from engine_stub.events import read_events, trace_of

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "configs" / "scenarios"
# A control, an invariant crash (exit 3), a canary-raise crash (exit 4), a survived detection.
PARITY = ["clean-page1-radix", "corrupt-r2t-strict", "flip-kv-canary-raise", "leak-request"]


def _run(name: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario_dir: Path = SCENARIOS,
         **kw):
    monkeypatch.setenv("CANARY_ENGINE_START", mode)
    run_dir = tmp_path / mode / name
    record = run_scenario(load_scenario(scenario_dir / f"{name}.yaml"), run_dir, **kw)
    assert engines_under(run_dir) == []
    return record, trace_of(read_events(run_dir / "events.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY)
def test_warm_and_fresh_engines_give_the_same_verdict_and_trace(name, tmp_path, monkeypatch):
    fresh, fresh_trace = _run(name, "fresh", tmp_path, monkeypatch)
    warm, warm_trace = _run(name, "warm", tmp_path, monkeypatch)
    assert (fresh.extra["start_mode"], warm.extra["start_mode"]) == ("fresh", "warm")
    assert (warm.verdict, warm.signature) == (fresh.verdict, fresh.signature)
    assert warm.extra["exit_code"] == fresh.extra["exit_code"]
    assert warm_trace == fresh_trace


@pytest.mark.slow
def test_warm_engine_killed_from_outside_reads_as_the_signal(tmp_path, monkeypatch):
    # The library's control, each step 20 ms slower: the kill 0.2 s after the start lands inside
    # the workload however fast the machine (unslowed, a quiet run could finish first: CLEAN, 0).
    doc = yaml.safe_load((SCENARIOS / "clean-page1-radix.yaml").read_text(encoding="utf-8"))
    doc["engine"]["step_delay_s"] = 0.02
    (tmp_path / "clean-page1-radix.yaml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    codes = {}
    for mode in ("fresh", "warm"):
        def kill_soon(rt) -> None:
            threading.Timer(0.2, rt.kill, args=(signal.SIGKILL,)).start()

        record, _ = _run("clean-page1-radix", mode, tmp_path, monkeypatch, scenario_dir=tmp_path,
                         on_started=kill_soon)
        codes[mode] = (record.verdict, record.extra["exit_code"])
    assert codes["warm"] == codes["fresh"] == ("INCONCLUSIVE", -signal.SIGKILL)


HARNESS = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from canaries.runtime.warm import fork_server
    server = fork_server()
    proc = server.spawn(["--port", "0", "--event-log", {log!r}], {{}}, {out!r})
    assert proc.wait_ready(30), "engine not ready"
    print(server.proc.pid, proc.pid, flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.slow
def test_killed_harness_takes_its_fork_server_and_engines_along(tmp_path):
    script = HARNESS.format(repo=str(REPO), log=str(tmp_path / "events.jsonl"),
                            out=str(tmp_path / "engine.log"))
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as harness:
        server_pid, engine_pid = (int(p) for p in harness.stdout.readline().split())
        assert _alive(server_pid) and _alive(engine_pid)
        harness.kill()  # SIGKILL: no atexit, no handler runs in the harness
        harness.wait(10)
        deadline = time.monotonic() + 10
        while (_alive(server_pid) or _alive(engine_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine_pid), "the engine outlived its harness"
        assert not _alive(server_pid), "the fork server outlived its harness"


def test_cuda_engines_and_an_explicit_fresh_request_start_fresh():
    assert start_mode("auto", "cuda") == "fresh"
    assert start_mode("fresh", "cpu") == "fresh"
    assert start_mode("warm", "cpu") == "warm"
    with pytest.raises(ValueError, match="valid modes"):
        start_mode("lukewarm", "cpu")


@pytest.mark.slow
def test_retired_fork_server_keeps_its_engine_until_the_engine_stops(tmp_path):
    import os

    from canaries.runtime.warm import close_fork_server, fork_server

    server = fork_server(engine_root=REPO)  # a key of its own: no other test's server is retired
    proc = server.spawn(["--port", "0", "--event-log", str(tmp_path / "events.jsonl")], {},
                        tmp_path / "engine.log")
    try:
        assert proc.wait_ready(60), "engine not ready"
        close_fork_server(engine_root=REPO)  # as a matrix column's end retires its release's parent
        assert fork_server(engine_root=REPO) is not server  # nothing more is forked from it
        time.sleep(0.5)
        assert proc.poll() is None and _alive(proc.pid), "the retired server killed an engine still in use"
        assert server.alive
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine's own stop
        proc.wait(10)
    server.proc.wait(10)  # its last engine gone, the retired server closes
    close_fork_server(engine_root=REPO)
