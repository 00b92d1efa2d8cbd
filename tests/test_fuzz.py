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


# --- the steered fuzzer, shards and merging -------------------------------------------------

def _fed(sequence, count: int, directory: Path, features_of) -> list[dict]:
    """Draw `count` scenarios of `sequence`, feeding each `features_of(k)`; their documents."""
    docs = []
    for k in range(count):
        scenario, origin = sequence.scenario(k, directory)
        docs.append((yaml.safe_load(Path(scenario.path).read_text()), origin))
        sequence.feed(k, scenario.name, features_of(k))
    return docs


def test_mutate_emits_scenarios_the_loader_accepts(tmp_path) -> None:
    import random

    from canaries.fuzz.mutate import mutate
    from canaries.fuzz.steer import library_seeds

    rng = random.Random(5)
    parents = [doc for _, doc in library_seeds()] + [generate(Draw(9, i)) for i in range(20)]
    refused = []
    for i in range(300):
        child, ops = mutate(rng.choice(parents), rng)
        assert ops and child["expect"]
        child["name"] = f"mutant-{i}"
        try:
            scenario = load_scenario(write_scenario(child, tmp_path / "m.yaml"))
        except Exception as exc:  # noqa: BLE001 - counted, the sequence draws again
            refused.append(str(exc))
            continue
        if scenario.warnings:
            refused.append(str(scenario.warnings[0]))
    assert len(refused) <= 6, refused  # the sequence retries these; nearly all must load


def test_steered_sequence_gives_the_same_scenarios_for_the_same_seed_and_feedback(tmp_path) -> None:
    from canaries.fuzz.sequence import make_sequence

    def features(k: int) -> frozenset[str]:
        return frozenset({f"f{k % 5}"})

    first = _fed(make_sequence(7, "on", jobs=2), 12, tmp_path / "a", features)
    again = _fed(make_sequence(7, "on", jobs=2), 12, tmp_path / "b", features)
    other = _fed(make_sequence(7, "on", jobs=2), 12, tmp_path / "c", lambda k: frozenset({f"g{k}"}))
    assert first == again
    assert first != other  # the feedback steers: new features everywhere changes the picks
    assert any("parent" in origin for _, origin in first)
    assert all(set(origin["mutation"]) <= set(__import__("canaries.fuzz.mutate").fuzz.mutate.MUTATIONS)
               for _, origin in first if "parent" in origin)


def test_steered_sequence_is_not_ready_before_the_feedback_it_depends_on(tmp_path) -> None:
    from canaries.fuzz.sequence import MIN_LAG, make_sequence

    sequence = make_sequence(3, "on", jobs=1)
    assert all(sequence.ready(k) for k in range(MIN_LAG + 1))
    assert not sequence.ready(MIN_LAG + 1)
    scenario, _ = sequence.scenario(0, tmp_path)
    sequence.feed(0, scenario.name, frozenset())
    assert sequence.ready(MIN_LAG + 1)


def test_corpus_keeps_only_scenarios_that_reached_new_features() -> None:
    from canaries.fuzz.steer import Corpus

    corpus = Corpus()
    assert corpus.feed(1, "b", {"n": 1}, frozenset({"x", "y"})) == []  # waits for index 0
    assert corpus.feed(0, "a", {"n": 0}, frozenset({"x"})) == ["x", "y"]
    assert [e.name for e in corpus.entries] == ["a", "b"]
    assert corpus.feed(2, "c", {"n": 2}, frozenset({"y"})) == []
    assert [e.name for e in corpus.entries] == ["a", "b"]
    assert corpus.seen == Counter({"x": 2, "y": 2})


def test_corpus_pick_favours_entries_with_rare_features() -> None:
    import random

    from canaries.fuzz.steer import Corpus

    corpus = Corpus()
    corpus.feed(0, "common", {}, frozenset({"c"}))
    for k in range(1, 20):
        corpus.feed(k, f"again-{k}", {}, frozenset({"c"}))
    corpus.feed(20, "rare", {}, frozenset({"c", "r1", "r2", "r3"}))
    rng = random.Random(0)
    picks = Counter(corpus.pick(rng).name for _ in range(200))
    assert picks["rare"] > picks["common"]


def test_run_features_name_the_landing_the_firing_and_the_unbalanced_ledger(tmp_path) -> None:
    from canaries.fuzz.features import run_features

    scenario = _library("skip-free-swa-radix")
    record = run_scenario(scenario, tmp_path / "run")
    judgement = judge_run(scenario, record, tmp_path / "run")
    features = run_features(tmp_path / "run", judgement.outcome)
    assert {"landed:skip_free_swa@on_window_eviction", "fired:idle.swa_ledger", "ledger:swa:-",
            "radix_problems", "outcome:detected"} <= features
    assert any(f.startswith("swa_low:") for f in features)
    control = _library("clean-page1-radix")
    record = run_scenario(control, tmp_path / "control")
    clean = run_features(tmp_path / "control", "clean")
    assert not any(f.startswith(("fired:", "ledger:", "landed:")) for f in clean)


def test_unsteered_shards_are_disjoint_and_together_the_sequence(tmp_path) -> None:
    from canaries.fuzz.sequence import make_sequence
    from canaries.fuzz.shard import Shard

    whole = [make_sequence(4, "off").scenario(k, tmp_path / "w")[1]["index"] for k in range(9)]
    parts = [[make_sequence(4, "off", Shard(i, 3)).scenario(k, tmp_path / f"p{i}")[1]["index"]
              for k in range(3)] for i in (1, 2, 3)]
    assert sorted(sum(parts, [])) == whole == list(range(9))


def test_steered_shards_are_campaigns_of_their_own(tmp_path) -> None:
    from canaries.fuzz.sequence import make_sequence
    from canaries.fuzz.shard import Shard

    a = _fed(make_sequence(4, "on", Shard(1, 2)), 4, tmp_path / "a", lambda k: frozenset())
    b = _fed(make_sequence(4, "on", Shard(2, 2)), 4, tmp_path / "b", lambda k: frozenset())
    assert [d["name"] for d, _ in a] == [f"fuzz-s4-p1of2-{k:05d}" for k in range(4)]
    assert [d for d, _ in a] != [d for d, _ in b]


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--count", "1", "--shard", "0/2"], "--shard 0/2"),
    (["fuzz", "--count", "1", "--shard", "3/2"], "--shard 3/2"),
    (["fuzz", "--count", "1", "--shard", "two"], "--shard 'two'"),
    (["fuzz", "--count", "1", "--steer", "maybe"], "--steer"),
    (["fuzz", "--merge", "a"], "--report-dir"),
])
def test_fuzz_with_a_bad_shard_steer_or_merge_exits_2_naming_the_parameter(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _shard_report(directory: Path, shard: str, findings: list[tuple[str, int]]) -> Path:
    """A campaign's report dir as `fuzz` writes it, with these (signature, seen) findings."""
    (directory / "findings").mkdir(parents=True)
    rows = []
    for signature, seen in findings:
        name = f"{signature.split('|')[0]}-{abs(hash(signature)) % 10**8:08d}.yaml"
        (directory / "findings" / name).write_text(f"# canary fuzz finding: {signature}\nname: x\n")
        rows.append({"signature": signature, "outcome": signature.split("|")[0], "reason": "r",
                     "first": "fuzz-s9-00001", "path": str(directory / "findings" / name), "seen": seen})
    summary = {"seed": 9, "steer": "off", "shard": shard, "runs": 10, "jobs": 2, "wall_s": 5.0,
               "generate_s": 5.0, "outcomes": {"clean": 10 - len(findings), "blind_spot": len(findings)},
               "findings": rows}
    (directory / "findings.json").write_text(json.dumps(summary))
    (directory / "fuzz.jsonl").write_text(json.dumps({"index": 0, "scenario": "fuzz-s9-00001"}) + "\n")
    return directory


def test_merge_unions_the_shards_findings_by_signature(tmp_path) -> None:
    one = _shard_report(tmp_path / "one", "1/2", [("blind_spot|a|-", 2), ("hang|b|-", 1)])
    two = _shard_report(tmp_path / "two", "2/2", [("blind_spot|a|-", 3), ("cut_short|c|-", 1)])
    out = tmp_path / "merged"
    assert main(["fuzz", "--merge", str(one), str(two), "--report-dir", str(out)]) == 1
    summary = json.loads((out / "findings.json").read_text())
    seen = {f["signature"]: f["seen"] for f in summary["findings"]}
    assert seen == {"blind_spot|a|-": 5, "hang|b|-": 1, "cut_short|c|-": 1}
    assert summary["runs"] == 20 and summary["outcomes"]["clean"] == 16
    assert all(Path(f["path"]).is_file() and Path(f["path"]).parent == out / "findings"
               for f in summary["findings"])
    shards = [json.loads(line)["shard"] for line in (out / "fuzz.jsonl").read_text().splitlines()]
    assert shards == ["1/2", "2/2"]


def test_merge_of_a_dir_without_a_report_exits_2_naming_it(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["fuzz", "--merge", str(tmp_path / "empty"), "--report-dir", str(tmp_path / "o")]) == 2
    assert str(tmp_path / "empty" / "findings.json") in capsys.readouterr().err


def test_steered_campaign_records_each_scenarios_origin_and_replays(tmp_path) -> None:
    report = tmp_path / "report"
    main(["fuzz", "--count", "4", "--seed", "5", "--jobs", "2", "--steer", "on",
          "--report-dir", str(report), "--shrink-steps", "0"])
    lines = [json.loads(line) for line in (report / "fuzz.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3]
    for line in lines:
        origin = line["origin"]
        assert "index" in origin or (origin["parent"] and origin["mutation"])
    assert any(line["new_features"] for line in lines)
    summary = json.loads((report / "findings.json").read_text())
    assert summary["steer"] == "on" and summary["features"] > 0 and summary["corpus"] > 0
    generated = sorted((report / "generated").glob("*.yaml"))
    assert main(["fuzz", "--replay", str(generated[0]), "--report-dir", str(tmp_path / "replay")]) in (0, 1)


def test_the_command_offers_exactly_the_steer_modes_the_sequence_knows() -> None:
    from canaries.commands.fuzz import DEFAULT_STEER, STEER_MODES
    from canaries.fuzz.sequence import STEER_MODES as KNOWN
    from canaries.fuzz.sequence import make_sequence

    assert STEER_MODES == KNOWN and DEFAULT_STEER in KNOWN
    with pytest.raises(ValueError, match="--steer 'sideways'"):
        make_sequence(1, "sideways")
