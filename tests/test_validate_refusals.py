"""`canary validate` warns where the scenario's engine would refuse (HTTP 400) a request its
workload must send, with the engine's own rule (`engine_stub.admission.refusal`, which
`Scheduler.check_fits` raises from)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from canaries.scenario import check_paths, load_scenario
from engine_stub.admission import refusal
from engine_stub.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]

# cpu-tiny: swa_pool_tokens 320, window 16 (headroom 34), max_context_len 512, page_size 1.
SCENARIO = """\
name: refusal-check
seed: 3
engine: {profile: cpu-tiny, chunked_prefill_size: 'off'}
workload:
  requests: 4
  prompt_tokens: [24, 296]
  max_new_tokens: 24
expect: {clean: true}
"""
SWA_REASON = ("prompt (296 tokens) cannot be prefilled: swa_pool_tokens=320 minus one window of "
              "headroom (34), and chunked_prefill_size is off")


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def validate_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "canaries.cli", "validate", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def test_validate_prompt_too_long_for_the_swa_pool_unchunked_warns_and_exits_zero(tmp_path: Path) -> None:
    path = write(tmp_path, SCENARIO)
    proc = validate_cli(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{path}:6: workload.prompt_tokens: warning: requests of up to 296 prompt tokens would be "
        f"refused by this engine: {SWA_REASON}",
        "1 scenarios OK (1 warning(s))"]
    assert load_scenario(path).warnings[0].warning


def test_validate_same_prompt_with_chunked_prefill_on_does_not_warn(tmp_path: Path) -> None:
    path = write(tmp_path, SCENARIO.replace(", chunked_prefill_size: 'off'", ""))
    assert check_paths([path]) == ([], [])


def test_validate_request_past_the_full_pool_reserve_warns_at_max_new_tokens(tmp_path: Path) -> None:
    # prompt + max_new_tokens = max_context_len = full_pool_tokens: it fits the context, not the
    # page of slack admission reserves beside it.
    path = write(tmp_path, """\
        name: refusal-check
        engine: {profile: cpu-tiny, full_pool_tokens: 512, max_context_len: 512}
        workload:
          requests: 2
          prompt_tokens: 256
          max_new_tokens: 256
        expect: {clean: true}
        """)
    problems, warnings = check_paths([path])
    assert problems == []
    (warning,) = warnings
    assert (warning.line, warning.field) == (6, "workload.max_new_tokens")
    assert warning.message == (
        "requests of up to 256 prompt tokens would be refused by this engine: prompt (256 tokens) "
        "+ max_new_tokens (256) needs 513 slots of the full pool, which has full_pool_tokens=512")


def test_validate_prompt_plus_max_new_tokens_past_max_context_len_stays_an_error(tmp_path: Path) -> None:
    # The loader refused this before the refusal warnings existed: it stays an error (exit 1),
    # stronger than a warning, and names the same limit as the engine's refusal.
    path = write(tmp_path, SCENARIO.replace("[24, 296]", "[24, 500]"))
    proc = validate_cli(path)
    assert proc.returncode == 1
    assert f"{path}:7: workload.max_new_tokens: longest prompt (500) + max_new_tokens (24) " \
           "exceeds the engine's max_context_len=512" in proc.stdout
    assert refusal(load_scenario(write(tmp_path, SCENARIO, "ok.yaml")).engine, 500, 24) == (
        "prompt (500 tokens) + max_new_tokens (24) exceeds max_context_len=512", "max_new_tokens")


def test_validate_extra_request_planned_400_that_is_refused_does_not_warn(tmp_path: Path) -> None:
    path = write(tmp_path, SCENARIO.replace("[24, 296]", "[24, 48]").replace(
        "  max_new_tokens: 24\n", "  max_new_tokens: 24\n  extra_requests:\n"
        "    - {prompt_tokens: 296, max_new_tokens: 8, status: 400}\n"))
    assert check_paths([path]) == ([], [])


def test_validate_extra_request_planned_400_the_engine_would_serve_warns(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        name: refusal-check
        engine: {profile: cpu-tiny}
        workload:
          prompt_tokens: [24, 48]
          max_new_tokens: 24
          extra_requests:
            - {prompt_tokens: 296, max_new_tokens: 8, status: 400}
        expect: {clean: true}
        """)
    problems, warnings = check_paths([path])
    assert problems == []
    (warning,) = warnings
    assert (warning.line, warning.field) == (7, "workload.extra_requests[0].status")
    assert warning.message == ("planned as refused (status: 400), but this engine would serve a "
                               "prompt of 296 tokens with max_new_tokens 8")


def test_validate_follow_up_turn_refused_by_the_engine_warns_at_its_entry(tmp_path: Path) -> None:
    # Request 0's prompt (48) and answer (its max_new_tokens, 24), then 250 new tokens: 322
    # tokens, past the SWA pool's 320 - 34 unchunked. Cut to its first 30 tokens: served.
    extras = ("    - {prompt_of: 0, with_answer: true, append_tokens: 250}\n"
              "    - {prompt_of: 0, with_answer: true, keep_tokens: 30, append_tokens: 250}\n")
    path = write(tmp_path, SCENARIO.replace("[24, 296]", "48").replace(
        "  max_new_tokens: 24\n", "  max_new_tokens: 24\n  extra_requests:\n" + extras))
    problems, warnings = check_paths([path])
    assert problems == []
    (warning,) = warnings
    assert (warning.line, warning.field) == (9, "workload.extra_requests[0]")
    assert warning.message == (
        "a prompt of 322 tokens with max_new_tokens 24 would be refused by this engine: prompt "
        "(322 tokens) cannot be prefilled: swa_pool_tokens=320 minus one window of headroom (34), "
        "and chunked_prefill_size is off; give status: 400 if the engine must refuse it")


# ---- the rule agrees with the engine -----------------------------------------------------------

CONFIGS = [
    EngineConfig(device="cpu", chunked_prefill_size=-1),
    EngineConfig(device="cpu"),
    EngineConfig(device="cpu", page_size=16, window=16, swa_pool_tokens=320, full_pool_tokens=512,
                 max_context_len=512, chunked_prefill_size=-1),
    EngineConfig(device="cpu", page_size=4, window=8, swa_pool_tokens=64, full_pool_tokens=256,
                 max_context_len=256, chunked_prefill_size=32),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"page{c.page_size}-chunk{c.chunked_prefill_size}")
def test_refusal_is_none_exactly_when_check_fits_accepts(config: EngineConfig, tmp_path: Path) -> None:
    from engine_stub.events import EventLog
    from engine_stub.req import RequestRejected
    from engine_stub.scheduler import Scheduler

    sched = Scheduler(config, EventLog(tmp_path / "events.jsonl"))
    seen = set()
    for prompt_len in range(1, config.max_context_len + 2, 5):
        for max_new in (1, 7, 64, config.max_context_len - prompt_len, config.full_pool_tokens):
            if max_new < 1:
                continue
            expected = refusal(config, prompt_len, max_new)
            try:
                sched.check_fits(prompt_len, max_new)
            except RequestRejected as exc:
                assert expected == (str(exc), exc.param), (prompt_len, max_new)
            else:
                assert expected is None, (prompt_len, max_new)
            seen.add(expected is None if expected is None else expected[1])
    assert seen >= {True, "max_new_tokens"}  # both answers occur for every config
    sched.events.close()


def test_largest_prompt_refusal_accepts_is_admitted_by_an_empty_engine(tmp_path: Path) -> None:
    # The rule is not stricter than admission: unchunked, the longest prompt it accepts is
    # prefilled at the first step of an empty engine; one token more is refused.
    from engine_stub.events import EventLog
    from engine_stub.req import Req
    from engine_stub.scheduler import Scheduler

    config = CONFIGS[0]
    longest = max(n for n in range(1, config.max_context_len) if refusal(config, n, 8) is None)
    assert longest == config.swa_pool_tokens - config.swa_headroom
    assert refusal(config, longest + 1, 8)[1] == "prompt"
    sched = Scheduler(config, EventLog(tmp_path / "events.jsonl"))
    sched.add_request(Req("r0", [40 + i % 80 for i in range(longest)], 8))
    sched.step()
    assert not sched.waiting and [r.rid for r in sched.running] == ["r0"]
    sched.events.close()
