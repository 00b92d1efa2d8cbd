"""`canary fuzz`: the generator emits valid scenarios over the whole space, the oracle judges
planted cases right, and a campaign keeps and shrinks what it finds."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from canaries.cli import main
from canaries.fuzz.generate import Draw, generate, scenario_for, write_scenario
from canaries.fuzz.oracle import judge_run
from canaries.regressions import catalogue, materialize
from canaries.runner import run_scenario
from canaries.scenario import SCENARIO_DIR, load_scenario
from canaries.triage.shrink import shrink
from engine_stub.perturb.kinds import KINDS
from engine_stub.perturb.spec import TRIGGER

DRAWS = [Draw(seed, index) for seed in range(4) for index in range(100)]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[tuple[dict, object]]:
    """400 first-attempt draws over four seeds, each written and loaded."""
    directory = tmp_path_factory.mktemp("generated")
    out = []
    for draw in DRAWS:
        doc = generate(draw)
        out.append((doc, load_scenario(write_scenario(doc, directory / f"{draw.name}.yaml"))))
    return out


def test_generate_emits_only_scenarios_the_loader_accepts_without_warnings(generated) -> None:
    warned = [(doc["name"], [str(w) for w in sc.warnings]) for doc, sc in generated if sc.warnings]
    assert not warned


def test_generate_gives_the_same_scenario_for_the_same_seed_and_index() -> None:
    assert generate(Draw(7, 3)) == generate(Draw(7, 3))
    assert generate(Draw(7, 3)) != generate(Draw(8, 3))


def test_generate_covers_the_scenario_space(generated) -> None:
    engines = [sc.engine for _, sc in generated]
    pages = {e.page_size for e in engines}
    windows = {e.window for e in engines}
    assert {1, 3, 5, 32} <= pages and any(p & (p - 1) for p in pages)  # non-powers of two
    assert 1 in windows and any(w % p for w, p in ((e.window, e.page_size) for e in engines))
    assert {e.radix_cache for e in engines} == {True, False}
    assert {e.invariant_check for e in engines} == {"off", "warn", "strict"}
    assert {e.kv_canary for e in engines} == {"off", "log", "raise"}
    assert {-1, 0} <= {e.chunked_prefill_size for e in engines}
    assert any(e.chunked_prefill_size > 0 for e in engines)
    # The smallest SWA pool the engine accepts is drawn.
    assert any(e.swa_pool_tokens == e.swa_headroom + e.page_size for e in engines)
    kinds = Counter(p.kind for _, sc in generated for p in sc.perturbations)
    assert set(kinds) == set(KINDS)
    events = {p.trigger.event for _, sc in generated for p in sc.perturbations}
    assert set(TRIGGER["event"].type.choices) <= events
    assert any(not sc.perturbations for _, sc in generated)  # controls
    assert any(len(sc.perturbations) > 1 for _, sc in generated)
    extras = [x for _, sc in generated for x in sc.workload.extra_requests]
    assert any(x.with_answer for x in extras) and any(x.keep_tokens for x in extras)
    assert any(sc.workload.shared_prefix_tokens for _, sc in generated)


def test_scenario_for_writes_a_file_a_person_can_rerun(tmp_path) -> None:
    scenario, draw = scenario_for(3, 11, tmp_path)
    assert Path(scenario.path) == tmp_path / f"{draw.name}.yaml"
    assert load_scenario(scenario.path).name == draw.name
    assert yaml.safe_load(Path(scenario.path).read_text())["expect"]


def _library(name: str):
    return load_scenario(SCENARIO_DIR / f"{name}.yaml")


def test_oracle_judges_a_control_clean_and_a_caught_perturbation_detected(tmp_path) -> None:
    control = _library("clean-page1-radix")
    record = run_scenario(control, tmp_path / "control")
    assert judge_run(control, record, tmp_path / "control").outcome == "clean"
    perturbed = _library("skip-free-swa-radix")
    record = run_scenario(perturbed, tmp_path / "perturbed")
    judgement = judge_run(perturbed, record, tmp_path / "perturbed")
    assert judgement.outcome == "detected" and not judgement.finding


@pytest.fixture(scope="module")
def blinded(tmp_path_factory) -> Path:
    """An engine whose SWA idle ledger, radix sanity check and memory census are computed but
    never fail (disabled detectors: those that see skip-free-swa-radix's leak)."""
    root = tmp_path_factory.mktemp("blinded")
    entries = catalogue()
    materialize(root, [entries["ledgers.swa-never-fails"], entries["ledgers.radix-sanity-ignored"],
                       entries["ledgers.census-never-judged"]])
    return root


def test_oracle_finds_the_blind_spot_a_disabled_detector_leaves(tmp_path, blinded) -> None:
    scenario = _library("skip-free-swa-radix")
    record = run_scenario(scenario, tmp_path / "run", engine_root=blinded)
    judgement = judge_run(scenario, record, tmp_path / "run")
    assert judgement.outcome == "blind_spot" and judgement.finding
    assert "ledger:swa" in judgement.signature


def test_shrink_keeps_the_blind_spot_and_makes_it_smaller(tmp_path, blinded) -> None:
    from canaries.fuzz.campaign import _oracle_target

    out = tmp_path / "shrunk.yaml"
    result = shrink(SCENARIO_DIR / "skip-free-swa-radix.yaml", out, work_dir=tmp_path / "work",
                    max_steps=8, target_of=_oracle_target, engine_root=blinded)
    assert result.target[0] == "blind_spot"
    assert result.size_after < result.size_before
    shrunk = load_scenario(out)
    record = run_scenario(shrunk, tmp_path / "again", engine_root=blinded)
    assert judge_run(shrunk, record, tmp_path / "again").signature == result.target[1]


def test_fuzz_campaign_writes_findings_and_a_report(tmp_path) -> None:
    report = tmp_path / "report"
    code = main(["fuzz", "--count", "4", "--seed", "5", "--report-dir", str(report),
                 "--shrink-steps", "0"])
    lines = [json.loads(line) for line in (report / "fuzz.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3]
    summary = json.loads((report / "findings.json").read_text())
    assert summary["runs"] == 4
    assert code == (1 if summary["findings"] else 0)
    assert (report / "index.html").read_text().startswith("<!doctype html>")
    for finding in summary["findings"]:
        text = Path(finding["path"]).read_text()
        assert text.startswith("# canary fuzz finding:") and "repro: canary fuzz --replay" in text


@pytest.mark.parametrize("argv, message", [
    (["fuzz"], "--budget"),
    (["fuzz", "--budget", "soon"], "--budget 'soon'"),
    (["fuzz", "--count", "0"], "--count 0"),
    (["fuzz", "--count", "1", "--jobs", "0"], "--jobs 0"),
    (["fuzz", "--replay", "no/such.yaml"], "no/such.yaml"),
])
def test_fuzz_with_bad_arguments_exits_2_naming_the_parameter(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_oracle_calls_a_silence_disabled_when_the_kinds_detectors_are_off(tmp_path) -> None:
    text = (SCENARIO_DIR / "swap-next-token.yaml").read_text()
    doc = yaml.safe_load(text)
    doc["engine"]["kv_canary"] = "off"  # the only detector of a swapped token
    path = tmp_path / "swap-canary-off.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    scenario = load_scenario(path)
    record = run_scenario(scenario, tmp_path / "run")
    judgement = judge_run(scenario, record, tmp_path / "run")
    assert judgement.outcome == "disabled" and not judgement.finding
    assert "answers" in judgement.reason  # what the silence cost is still said


FOLLOW_UP_OF_AN_ABORTED_REQUEST = """\
name: follow-up-of-an-aborted-request
seed: 938296
engine: {profile: cpu-tiny, page_size: 6, window: 33, swa_pool_tokens: 168, full_pool_tokens: 468,
         max_context_len: 468, max_running_requests: 1, radix_cache: true, invariant_check: warn,
         kv_canary: 'off'}
workload:
  requests: 5
  concurrency: 2
  prompt_tokens: 193
  max_new_tokens: 8
  extra_requests:
    - {prompt_of: 1, with_answer: true, keep_tokens: 91}
perturbations:
  - kind: double_free_swa
    trigger: {event: first_swa_eviction, times: 1}
  - kind: skip_free_swa
    trigger: {at_step: 11}
    target: {request: all}
expect: {fires: [swa.peer_released], any: true}
"""


def test_follow_up_the_driver_cannot_send_does_not_stall_the_gate(tmp_path) -> None:
    # r0001 is aborted by the admission-stall guard (warn), so its follow-up is never sent; the
    # driver tells the lockstep gate, which used to wait its timeout at every step (a hang).
    path = tmp_path / "follow-up.yaml"
    path.write_text(FOLLOW_UP_OF_AN_ABORTED_REQUEST)
    scenario = load_scenario(path)
    record = run_scenario(scenario, tmp_path / "run")
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    responses = [json.loads(line) for line in (tmp_path / "run" / "responses.jsonl").read_text().splitlines()]
    assert any("has no answer to follow" in str(r.get("error")) for r in responses)
    assert not [e for e in events if e["kind"] == "gate_timeout"]
    assert judge_run(scenario, record, tmp_path / "run").outcome == "detected"


def test_accepted_findings_load_and_match_by_pattern(tmp_path) -> None:
    from canaries.fuzz.accepted import load_accepted

    accepted = load_accepted()  # the project's own file
    assert accepted and all(a.reason.strip() for a in accepted)
    path = tmp_path / "accepted.yaml"
    path.write_text("accepted:\n  - {signature: 'blind_spot|flip_kv_byte|*', reason: content damage}\n")
    (only,) = load_accepted(path)
    assert only.matches("blind_spot|flip_kv_byte|-|answers|inv=off,canary=off,page=1,radix=on")
    assert not only.matches("blind_spot|strip_swa_mapping|-|answers|inv=off,canary=off,page=1,radix=on")


def test_accepted_file_without_a_reason_is_an_error_naming_the_entry(tmp_path) -> None:
    from canaries.fuzz.accepted import load_accepted

    path = tmp_path / "accepted.yaml"
    path.write_text("accepted:\n  - {signature: 'blind_spot|x|*', reason: ''}\n")
    with pytest.raises(ValueError, match=r"accepted\[0\]"):
        load_accepted(path)


def test_fuzz_with_sglang_runs_every_scenario_on_both_memory_paths(tmp_path) -> None:
    from test_sglang_backend import SGLANG_PYTHON

    if SGLANG_PYTHON is None:
        pytest.skip("no interpreter with sglang: run scripts/make-sglang-venv.sh")
    from canaries.fuzz.campaign import fuzz

    result = fuzz(5, tmp_path / "report", count=3, shrink_steps=0, keep_runs=True,
                  sglang_python=SGLANG_PYTHON, progress=None)
    assert result.runs == 3
    lines = [json.loads(line) for line in (tmp_path / "report" / "fuzz.jsonl").read_text().splitlines()]
    ran_on_sglang = [line for line in lines if not line["finding"] or line["outcome"] == "parity"]
    for line in ran_on_sglang:
        run = tmp_path / "report" / "runs" / line["scenario"] / "sglang" / "verdict.json"
        assert json.loads(run.read_text())["extra"]["memory"] == "sglang"
