"""The matrix's native column reused across runs by content hash (canaries/native_cache.py): what
is stored, what is found again, and what makes a run miss. A recording `run` stands in for
`run_many`: no engine starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from canaries.native_cache import NativeCache, code_digest, run_native, scenario_key, store_run
from canaries.verdict.record import VerdictRecord


@dataclass(frozen=True)
class _Scenario:
    name: str
    path: str
    seed: int = 1


def _record(name: str, verdict: str = "DETECTED", **extra) -> VerdictRecord:
    return VerdictRecord(scenario=name, verdict=verdict, passed=True, reason="", signature=f"{verdict}||x",
                         landed=[], firings=[{"detector": "swa.peer_mapped"}], latency={}, engine_outcome="ok",
                         ledgers=None, seed=1, engine={}, expect={}, extra={"duration_s": 1.5, **extra})


class _Run:
    """Stands in for the matrix's `run_many`: records what it was asked to run and writes a run dir each."""

    def __init__(self, verdicts: dict[str, VerdictRecord] | None = None) -> None:
        self.asked: list[list[str]] = []
        self.verdicts = verdicts or {}

    def __call__(self, scenarios, into: Path) -> list:
        self.asked.append([sc.name for sc in scenarios])
        out = []
        for sc in scenarios:
            (into / sc.name).mkdir(parents=True, exist_ok=True)
            (into / sc.name / "events.jsonl").write_text(f'{{"kind": "engine_start", "name": "{sc.name}"}}\n')
            out.append(self.verdicts.get(sc.name) or _record(sc.name, run_dir=str(into / sc.name)))
        return out


def _scenarios(tmp_path: Path, *names: str) -> list[_Scenario]:
    out = []
    for name in names:
        path = tmp_path / "scenarios" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"name: {name}\n")
        out.append(_Scenario(name, str(path)))
    return out


def test_second_run_takes_every_scenario_from_the_cache_with_its_run_dir(tmp_path: Path) -> None:
    scenarios = _scenarios(tmp_path, "a", "b")
    cache = NativeCache(tmp_path / "cache", digest="d" * 64)
    first = _Run()
    records, cached = run_native(scenarios, tmp_path / "r1", first, cache, log=lambda _: None)
    assert cached == 0 and first.asked == [["a", "b"]] and [r.scenario for r in records] == ["a", "b"]
    second = _Run()
    records, cached = run_native(scenarios, tmp_path / "r2", second, cache, log=lambda _: None)
    assert cached == 2 and second.asked == []
    assert [r.verdict for r in records] == ["DETECTED", "DETECTED"]
    assert records[0].firings == [{"detector": "swa.peer_mapped"}]
    assert records[0].extra["run_dir"] == str(tmp_path / "r2" / "a")
    assert (tmp_path / "r2" / "a" / "events.jsonl").read_text().count('"name": "a"') == 1
    rows = [json.loads(line) for line in (tmp_path / "r2" / "verdicts.jsonl").read_text().splitlines()]
    assert [r["scenario"] for r in rows] == ["a", "b"]
    assert (tmp_path / "r2" / "junit.xml").is_file()


def test_only_scenarios_missing_from_the_cache_run_and_the_order_is_kept(tmp_path: Path) -> None:
    cache = NativeCache(tmp_path / "cache", digest="d" * 64)
    run_native(_scenarios(tmp_path, "b"), tmp_path / "r1", _Run(), cache, log=lambda _: None)
    later = _Run()
    records, cached = run_native(_scenarios(tmp_path, "a", "b", "c"), tmp_path / "r2", later, cache,
                                 log=lambda _: None)
    assert cached == 1 and later.asked == [["a", "c"]]
    assert [r.scenario for r in records] == ["a", "b", "c"]
    rows = [json.loads(line) for line in (tmp_path / "r2" / "verdicts.jsonl").read_text().splitlines()]
    assert [r["scenario"] for r in rows] == ["a", "b", "c"]


def test_other_code_or_an_edited_scenario_misses(tmp_path: Path) -> None:
    scenarios = _scenarios(tmp_path, "a")
    run_native(scenarios, tmp_path / "r1", _Run(), NativeCache(tmp_path / "cache", digest="d" * 64),
               log=lambda _: None)
    assert NativeCache(tmp_path / "cache", digest="e" * 64).kept(scenarios) == {}
    key = scenario_key(scenarios[0], "d" * 64)
    Path(scenarios[0].path).write_text("name: a\nseed: 2\n")
    assert scenario_key(scenarios[0], "d" * 64) != key
    assert NativeCache(tmp_path / "cache", digest="d" * 64).kept(scenarios) == {}
    assert scenario_key(_Scenario("a", scenarios[0].path, seed=3), "d" * 64) != scenario_key(scenarios[0], "d" * 64)


def test_harness_failures_and_interrupted_scenarios_are_never_stored(tmp_path: Path) -> None:
    scenarios = _scenarios(tmp_path, "a", "b", "c")
    cache = NativeCache(tmp_path / "cache", digest="d" * 64)
    run = _Run({"a": _record("a", "INCONCLUSIVE", harness_error="Traceback ..."),
                "b": _record("b", "INCONCLUSIVE", interrupted={"state": "running"})})
    run_native(scenarios, tmp_path / "r1", run, cache, log=lambda _: None)
    assert sorted(cache.kept(scenarios)) == ["c"]


def test_code_digest_follows_every_engine_and_harness_source(tmp_path: Path) -> None:
    for part in ("engine_stub", "canaries"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "x.py").write_text("A = 1\n")
    before = code_digest(tmp_path)
    assert code_digest(tmp_path) == before
    (tmp_path / "canaries" / "x.py").write_text("A = 2\n")
    assert code_digest(tmp_path) != before
    (tmp_path / "canaries" / "x.py").write_text("A = 1\n")
    (tmp_path / "engine_stub" / "y.py").write_text("")
    assert code_digest(tmp_path) != before


def test_a_library_run_stores_what_the_next_matrix_reuses(tmp_path: Path) -> None:
    scenarios = _scenarios(tmp_path, "a", "b")
    cache = NativeCache(tmp_path / "cache", digest="d" * 64)
    records = _Run()(scenarios, tmp_path / "run")
    assert store_run(scenarios, records, tmp_path / "run", cache) == 2
    later = _Run()
    _, cached = run_native(scenarios, tmp_path / "matrix", later, cache, log=lambda _: None)
    assert cached == 2 and later.asked == []


def test_store_run_never_raises_on_an_unwritable_cache(tmp_path: Path) -> None:
    scenarios = _scenarios(tmp_path, "a")
    (tmp_path / "cache").write_text("a file, not a directory")
    cache = NativeCache(tmp_path / "cache", digest="d" * 64)
    assert store_run(scenarios, _Run()(scenarios, tmp_path / "run"), tmp_path / "run", cache) == 0


def test_one_scenario_file_has_one_key_however_its_path_is_spelled(tmp_path: Path, monkeypatch) -> None:
    (scenario,) = _scenarios(tmp_path, "a")
    monkeypatch.chdir(tmp_path)
    relative = _Scenario("a", "scenarios/a.yaml")
    assert scenario_key(relative, "d" * 64) == scenario_key(scenario, "d" * 64)
