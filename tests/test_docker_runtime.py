"""The docker runtime against a real Docker engine (scripts/ci-docker.sh provides one in CI).

Every test is marked `docker`; those that need an engine skip, with the reason, only when none can
be reached. The first one builds the engine image when its sources changed (about a minute cold).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests

import docker  # the [dev] extra has the SDK: a missing one is a failure, not a skip
from canaries.runtime import docker as dr
from canaries.runtime import get_runtime
from canaries.runtime.docker import DockerRuntime, DockerUnavailable

pytestmark = pytest.mark.docker

CRASH_SPEC = {
    "name": "x",
    "seed": 7,
    "engine": {"invariant_check": "strict", "kv_canary": "log", "page_size": 1, "window": 16,
               "radix_cache": True},
    "perturbations": [{"kind": "strip_swa_mapping",
                       "trigger": {"event": "window_cross", "times": 1},
                       "target": {"request": 0, "positions": "in_window"}}],
}


@pytest.fixture(scope="module")
def client():
    try:
        return dr.get_client()
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker engine can be reached: {exc}")


@pytest.fixture(scope="module")
def image(client):
    return dr.ensure_image(client)


@pytest.fixture(autouse=True)
def _no_orphans(request):
    """After every test, no container this process started may survive."""
    yield
    if "client" not in request.fixturenames:
        return
    c = request.getfixturevalue("client")
    mine = c.containers.list(all=True, filters={"label": f"{dr.OWNER_LABEL}={dr._owner()}"})
    assert mine == [], f"containers left behind: {[x.name for x in mine]}"


def _gone(client, container_id: str) -> bool:
    try:
        client.containers.get(container_id)
    except docker.errors.NotFound:
        return True
    return False


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_image_builds_then_is_reused(client, image):
    assert image == dr.image_tag() and image.startswith(f"{dr.IMAGE_REPO}:")
    t0 = time.monotonic()
    again = dr.ensure_image(client)
    assert again == image
    assert time.monotonic() - t0 < 5, "a second ensure_image must reuse the image, not rebuild"
    config = client.images.get(image).attrs["Config"]
    assert config["User"] and config["User"].split(":")[0] not in ("", "0", "root")
    assert "30000/tcp" in config["ExposedPorts"]
    assert config["Healthcheck"]["Test"][0] == "CMD"


def test_start_health_generate_stop(client, image, tmp_path):
    run_dir = tmp_path / "run"
    rt = get_runtime("docker", ready_timeout=30)
    assert isinstance(rt, DockerRuntime) and rt.name == "docker"
    with rt:
        base_url = rt.start(None, run_dir)
        assert base_url == f"http://127.0.0.1:{rt.host_port}"
        assert rt.running and rt.exit_code is None and rt.poll() is None
        container_id = rt.container.id
        attrs = client.api.inspect_container(container_id)
        # Published on loopback only.
        bindings = attrs["NetworkSettings"]["Ports"]["30000/tcp"]
        assert bindings and all(b["HostIp"] == "127.0.0.1" for b in bindings)
        assert all(b["HostIp"] == "127.0.0.1"
                   for b in attrs["HostConfig"]["PortBindings"]["30000/tcp"])
        host = attrs["HostConfig"]
        assert host["Init"] is True
        assert host["Memory"] == 2 * 1024**3 and host["NanoCpus"] == 10**9
        assert host["PidsLimit"] and host["PidsLimit"] > 0
        assert attrs["Config"]["Labels"][dr.LABEL] == "1"
        assert attrs["Config"]["Labels"][dr.RUN_LABEL] == "run"
        user = attrs["Config"]["User"] or client.images.get(image).attrs["Config"]["User"]
        assert user.split(":")[0] not in ("", "0", "root"), "the engine must not run as root"

        health = requests.get(f"{base_url}/health", timeout=5)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        resp = requests.post(f"{base_url}/generate", timeout=30,
                             json={"text": "hello", "sampling_params": {"max_new_tokens": 8}})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["output_ids"]) == 8

        # A live runtime's container is not a leftover.
        assert dr.gc(client) == 0
        assert not _gone(client, container_id)

        code = rt.stop()
    assert code == 0, f"a SIGTERM drain must exit 0 (raw {rt.raw_exit_code})"
    assert rt.stop() == 0 and rt.exit_code == 0 and not rt.running
    assert _gone(client, container_id)
    log = (run_dir / "engine.log").read_text()
    assert "engine_stub ready on http://0.0.0.0:30000" in log
    events = _events(run_dir)
    kinds = [e.get("kind") for e in events]
    assert "engine_start" in kinds
    # The host user owns what the engine wrote.
    assert (run_dir / "events.jsonl").stat().st_uid == os.getuid()


def test_crashed_engine_keeps_its_event_log(client, image, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(CRASH_SPEC))
    run_dir = tmp_path / "crash"
    rt = DockerRuntime()
    try:
        base_url = rt.start(spec, run_dir)
        container_id = rt.container.id
        prompts = [[(7 * i + 13 * j) % 256 for j in range(52)] for i in range(4)]

        def send(ids):
            try:
                return requests.post(f"{base_url}/generate", timeout=60, json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 40}}).status_code
            except requests.RequestException as exc:
                return type(exc).__name__

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(send, prompts))
        assert rt.wait(timeout=30) == 3, f"statuses {statuses}, log:\n{rt.log_tail()}"
        assert not rt.running
    finally:
        code = rt.stop()
    assert code == 3 and rt.raw_exit_code == 3
    assert _gone(client, container_id)
    crash = [e for e in _events(run_dir) if e.get("kind") == "crash"]
    assert crash, "the crashed engine's event log must be kept in the run dir"
    assert (run_dir / "engine.log").exists()


def test_kill_from_outside_reads_as_a_signal(client, image, tmp_path):
    rt = DockerRuntime()
    try:
        rt.start(None, tmp_path / "killed")
        container_id = rt.container.id
        rt.kill(signal.SIGKILL)
        assert rt.wait(timeout=20) == -signal.SIGKILL  # as LocalRuntime reports it
    finally:
        assert rt.stop() == -signal.SIGKILL
    assert _gone(client, container_id)


def test_engine_that_cannot_start_is_reported_and_removed(client, image, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "engine": {"page_size": 0}}))
    rt = DockerRuntime(ready_timeout=30)
    with pytest.raises(RuntimeError, match="exited with code 2 before it was ready"):
        rt.start(bad, tmp_path / "bad")
    assert rt.exit_code == 2
    assert _gone(client, rt.container.id)


def test_gc_removes_leftover_containers(client, image):
    leftover = client.containers.create(
        image, command=["--help"], labels={dr.LABEL: "1", dr.RUN_LABEL: "leftover-test"})
    try:
        assert dr.gc(client) >= 1
        assert _gone(client, leftover.id)
    finally:
        if not _gone(client, leftover.id):
            leftover.remove(force=True)


def test_canary_gc_command_removes_leftover_containers(client, image, capsys):
    from canaries.cli import main

    leftover = client.containers.create(
        image, command=["--help"], labels={dr.LABEL: "1", dr.RUN_LABEL: "leftover-cli"})
    try:
        assert main(["gc"]) == 0
        assert "removed" in capsys.readouterr().out
        assert _gone(client, leftover.id)
    finally:
        if not _gone(client, leftover.id):
            leftover.remove(force=True)


HARNESS = """
import sys, time
from canaries.runtime.docker import DockerRuntime
rt = DockerRuntime()
rt.start(None, sys.argv[1])
print("started", rt.container.id, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_harness_interrupted_leaves_no_container(client, image, tmp_path, sig, terminal_sigint):
    """Ctrl-C or SIGTERM to a harness that never calls stop: the safety net removes it."""
    import subprocess
    import sys

    repo = Path(dr.__file__).resolve().parents[2]
    with subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path / "h")], cwd=repo,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=terminal_sigint) as proc:
        try:
            line = proc.stdout.readline()
            assert line.startswith("started"), proc.stderr.read() if proc.poll() else line
            container_id = line.split()[1]
            assert not _gone(client, container_id)
            proc.send_signal(sig)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert _gone(client, container_id)
    assert (tmp_path / "h" / "engine.log").exists()


def test_unreachable_engine_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such-docker.sock")
    with pytest.raises(DockerUnavailable, match="no Docker engine is reachable at unix://") as ei:
        dr.get_client()
    assert "dockerd" in str(ei.value) and isinstance(ei.value, RuntimeError)
    rt = DockerRuntime()
    with pytest.raises(DockerUnavailable):
        rt.start(None, tmp_path / "run")
    assert rt.stop() is None


PARITY_SCENARIOS = ["clean-page1-radix", "strip-mapping-page1", "leak-request",
                    "double-free-swa-page1", "flip-kv-swa-in-use"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY_SCENARIOS)
def test_same_verdict_and_event_trace_as_the_local_runtime(client, image, tmp_path, name):
    from canaries.runner import run_scenario
    from canaries.scenario import SCENARIO_DIR, load_scenario
    from engine_stub.events import read_events, trace_of

    scenario = load_scenario(SCENARIO_DIR / f"{name}.yaml")
    local = run_scenario(scenario, tmp_path / "local", runtime="local")
    in_docker = run_scenario(scenario, tmp_path / "docker", runtime="docker")
    assert (in_docker.verdict, in_docker.passed, in_docker.signature) == \
        (local.verdict, local.passed, local.signature), (
        f"{name}: local {local.verdict} ({local.reason}) vs docker {in_docker.verdict} "
        f"({in_docker.reason})")
    local_trace = trace_of(read_events(tmp_path / "local" / "events.jsonl"))
    docker_trace = trace_of(read_events(tmp_path / "docker" / "events.jsonl"))
    # The engine_start record names the device and torch build it found: both are CPU 2.13.
    assert [e for e in docker_trace if e["kind"] != "engine_start"] == \
        [e for e in local_trace if e["kind"] != "engine_start"]
