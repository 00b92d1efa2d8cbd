"""Two of SGLang's servers side by side, as a matrix runs them: a column's scenario server (forked
from the column's interpreter, here the release with the empty `identity` patch) and the clean
server of the oracle (forked from the release's own venv). The release's column ends (its fork
parent is retired) and the scenario's server is stopped while the oracle's clean server is
answering: every one of its answers still arrives (issue 32: a column's end killed the fork parent
the oracle's clean server came from, and its in-flight requests read `RemoteDisconnected`)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import requests

from canaries.runtime.warm import close_fork_server
from canaries.scenario import load_scenario
from canaries.sglang.releases import patched_interpreter
from canaries.sglang.releases.venvs import find_python
from canaries.sglang.runtime import SGLangServer
from engine_stub.config import config_from_sources

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _wait_for_steps(server: SGLangServer, steps: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if int(server.progress_path.read_text().strip() or 0) >= steps:
                return
        time.sleep(0.05)
    raise AssertionError(f"the server ran no {steps} steps within {timeout:.0f} s")


def test_oracle_server_answers_through_the_stop_of_the_scenarios_server_and_its_columns_end(tmp_path: Path) -> None:
    base = find_python("0.5.23", server=True)
    if base is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    column, _ = patched_interpreter(base, "0.5.23", ("identity",), tmp_path / "column")
    scenario = load_scenario(REPO / "configs" / "scenarios" / "clean-page1-radix.yaml")
    config = config_from_sources(overrides=scenario.engine_knobs, environ={})
    scenario_server, oracle_server = SGLangServer(str(column), config), SGLangServer(str(base), config)
    answers: list[object] = []
    try:
        scenario_url = scenario_server.start(tmp_path / "run")
        oracle_url = oracle_server.start(tmp_path / "oracle")
        requests.post(f"{scenario_url}/generate", timeout=120,
                      json={"input_ids": list(range(40, 70)), "sampling_params": {"max_new_tokens": 4}})

        def ask(i: int) -> None:
            try:
                answers.append(requests.post(f"{oracle_url}/generate", timeout=300, json={
                    "input_ids": list(range(40 + i, 70)), "rid": f"r{i}",
                    "sampling_params": {"max_new_tokens": 96, "temperature": 0}}).status_code)
            except requests.RequestException as exc:
                answers.append(repr(exc))

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for asker in askers:
            asker.start()
        _wait_for_steps(oracle_server, 2)  # it is answering: its scheduler is running batches
        # The scenario's server stops, and its column and the release's own column end, while
        # the oracle's clean server answers.
        scenario_server.stop()
        close_fork_server(str(column))
        close_fork_server(str(base))
        for asker in askers:
            asker.join(300)
        assert answers == [200] * 4
        assert oracle_server.proc.poll() is None
    finally:
        scenario_server.stop()
        oracle_server.stop()
