"""How a SGLang server's process group ends, without SGLang: a stand-in launcher with a child of
its own (as SGLang's launcher has its scheduler and detokenizer) and the event log its plugin
writes."""

from __future__ import annotations

import json
import subprocess
import sys

from canaries.sglang.runtime import SGLangServer
from engine_stub.config import EngineConfig

LAUNCHER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"


def _server_with_launcher(tmp_path) -> SGLangServer:
    server = SGLangServer(sys.executable, EngineConfig(device="cpu"), start="fresh")
    server.event_log = tmp_path / "events.jsonl"
    server.idle_path = tmp_path / "idle"
    server.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], start_new_session=True)
    return server


def _group_alive(pgid: int) -> bool:
    from canaries.sglang.runtime import _live_members

    return bool(_live_members(pgid))


def test_end_if_crashed_with_a_crash_event_kills_the_whole_group(tmp_path):
    server = _server_with_launcher(tmp_path)
    try:
        server.event_log.write_text(json.dumps({"kind": "kv_canary", "step": 3}) + "\n", encoding="utf-8")
        assert server.end_if_crashed() is False
        assert server.proc.poll() is None
        with open(server.event_log, "a", encoding="utf-8") as log:  # the scheduler's death, later
            log.write(json.dumps({"kind": "crash", "step": 4, "error": "RuntimeError: invariant"}) + "\n")
        assert server.end_if_crashed() is True
        assert server.proc.wait(10) == -9
        assert server.stop() == -9
        assert not _group_alive(server.proc.pid)
    finally:
        server.stop()


def test_crashed_with_a_half_written_line_waits_for_the_whole_line(tmp_path):
    server = _server_with_launcher(tmp_path)
    try:
        line = json.dumps({"kind": "crash", "step": 4})
        server.event_log.write_text(line[:10], encoding="utf-8")
        assert server.crashed() is False
        with open(server.event_log, "a", encoding="utf-8") as log:
            log.write(line[10:] + "\n")
        assert server.crashed() is True
    finally:
        server.stop()


def test_stop_of_a_server_that_never_idles_leaves_no_process_of_its_group(tmp_path):
    server = _server_with_launcher(tmp_path)
    server.stop(timeout=1.0)
    assert not _group_alive(server.proc.pid)
