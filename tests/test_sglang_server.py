"""SGLang's own server launched by the suite on this machine's CPU (SGLang 0.5.23, from the venv
`bash scripts/make-sglang-venv.sh --server` builds): it serves `/generate` with input ids on its
hybrid SWA pool, and stopping it leaves no process of its group behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import requests

from canaries.releases.venvs import find_python
from canaries.runtime.sglang_server import SGLangServer
from engine_stub.config import EngineConfig

pytestmark = pytest.mark.timeout(900)


def _server_python() -> Path:
    python = find_python("0.5.23", server=True)
    if python is None:
        pytest.skip("no server venv with sglang 0.5.23: run bash scripts/make-sglang-venv.sh --server")
    return python


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_serves_input_ids_on_its_swa_pool_and_stops_its_whole_group(tmp_path: Path) -> None:
    config = EngineConfig(window=8, full_pool_tokens=256, swa_pool_tokens=128, max_context_len=128,
                          max_running_requests=4, invariant_check="strict")
    server = SGLangServer(_server_python(), config)
    try:
        url = server.start(tmp_path)
        body = {"input_ids": list(range(3, 23)), "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        first = requests.post(url + "/generate", json=body, timeout=120)
        second = requests.post(url + "/generate", json=body, timeout=120)
    finally:
        server.stop()
    assert first.status_code == 200, first.text
    assert len(first.json()["output_ids"]) == 12
    assert first.json()["output_ids"] == second.json()["output_ids"]  # greedy, float32
    log = server.log_path.read_text(encoding="utf-8", errors="replace")
    sizes = re.search(r"swa size: (\d+), full size: (\d+)", log)
    assert sizes is not None, log[-3000:]
    assert (int(sizes.group(1)), int(sizes.group(2))) == (128, 256)
    assert not _group_alive(server.proc.pid)
