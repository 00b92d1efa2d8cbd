"""The regression catalogue and `canary mutate`: entries apply exactly once to copies of the
engine, name real scenarios, and a campaign kills what it should."""

from __future__ import annotations

import hashlib
import py_compile
from pathlib import Path

import pytest

from canaries.regressions import Regression, RegressionError, catalogue, engine_sources, materialize
from canaries.scenario import discover, load_scenario

ENTRIES = sorted(catalogue().values(), key=lambda r: r.name)
LIBRARY = {load_scenario(p).name for p in discover()}


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda r: r.name)
def test_catalogue_entry_applies_once_to_a_copy_and_compiles(entry: Regression, tmp_path: Path) -> None:
    diff = materialize(tmp_path, [entry])
    assert diff.startswith(f"--- a/{entry.file}")
    py_compile.compile(str(tmp_path / entry.file), doraise=True)
    assert set(entry.caught_by) <= LIBRARY, f"unknown scenarios in caught_by: {set(entry.caught_by) - LIBRARY}"


def test_materialize_never_touches_the_checkout(tmp_path: Path) -> None:
    before = _tree_digest(engine_sources())
    materialize(tmp_path, ENTRIES[:3])
    assert _tree_digest(engine_sources()) == before
    assert _tree_digest(tmp_path / "engine_stub") != before


def test_entry_whose_snippet_is_gone_is_stale_not_silent(tmp_path: Path) -> None:
    stale = Regression(name="test.gone", area="radix", file="engine_stub/mem/radix.py",
                       old="this text is not in the file", new="x", models="nothing",
                       caught_by=("clean-cache-hits",))
    with pytest.raises(RegressionError, match="occurs 0 times"):
        materialize(tmp_path, [stale])


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "Bad Name"}, "lower-case"),
    ({"area": "nowhere"}, "area"),
    ({"file": "canaries/cli.py"}, "under engine_stub"),
    ({"new": "same"}, "differ"),
    ({"equivalent": "it changes nothing"}, "exactly one of"),
    ({"caught_by": ()}, "exactly one of"),
])
def test_malformed_entry_is_refused(fields: dict, message: str) -> None:
    good = {"name": "test.ok", "area": "radix", "file": "engine_stub/mem/radix.py", "old": "same",
            "new": "other", "models": "a bug", "caught_by": ("clean-cache-hits",)}
    with pytest.raises(RegressionError, match=message):
        Regression(**{**good, **fields})


@pytest.mark.slow
def test_mutate_kills_a_catalogued_regression_and_exits_0(tmp_path: Path, capsys) -> None:
    from canaries.cli import main as canary

    report = tmp_path / "mutate"
    assert canary(["mutate", "-k", "ledgers.full-never-fails", "--report-dir", str(report)]) == 0
    out = capsys.readouterr().out
    assert "1/1 killed" in out
    lines = (report / "mutants.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"status": "killed"' in lines[0]
    assert (report / "mutant_matrix.md").is_file()


@pytest.mark.slow
def test_mutate_exits_1_when_a_catalogued_regression_survives(tmp_path: Path, monkeypatch, capsys) -> None:
    import canaries.regressions as regs
    from canaries.cli import main as canary

    # An entry naming a scenario that cannot see it: the gate must fail.
    weak = Regression(name="test.weak", area="ledgers", file="engine_stub/idle_check.py",
                      old='(FULL_LEDGER, ledgers["full"]["delta"] == 0,', new="(FULL_LEDGER, True,",
                      models="the full ledger ignored", caught_by=("clean-page1-noradix",))
    # The real entries stay registered: a library scenario names some of them (`regressions:`).
    real = regs.catalogue()
    monkeypatch.setattr(regs, "catalogue", lambda: {**real, weak.name: weak})
    assert canary(["mutate", "-k", "test.weak", "--report-dir", str(tmp_path / "m")]) == 1
    assert "survived" in capsys.readouterr().out


@pytest.mark.slow
def test_auto_mutants_are_a_seeded_sample_that_applies_to_copies(tmp_path: Path) -> None:
    from canaries.automutants import TARGETS, sample_mutants

    before = _tree_digest(engine_sources())
    first = sample_mutants(4, seed=3, targets=TARGETS[3:4])  # req_to_token.py: quick to enumerate
    again = sample_mutants(4, seed=3, targets=TARGETS[3:4])
    assert first == again and len(first) == 4
    for mutant in first:
        diff = materialize(tmp_path / mutant.name, [mutant])
        assert diff.startswith("--- a/engine_stub/mem/req_to_token.py")
    assert _tree_digest(engine_sources()) == before, "cosmic-ray touched the checkout"


def test_mutations_inside_postponed_annotations_are_skipped(tmp_path: Path) -> None:
    from canaries.automutants import _annotation_spans, _in_annotation

    source = ("from __future__ import annotations\n"
              "def f(x: int | None = 1) -> int | None:\n"
              "    y: list[int] = [x | 2]\n"
              "    return y\n")
    (tmp_path / "m.py").write_text(source)
    spans = _annotation_spans(tmp_path / "m.py")
    assert _in_annotation(spans, (2, 13)) and _in_annotation(spans, (2, 30))  # the two `|`
    assert _in_annotation(spans, (3, 7))  # list[int]
    assert not _in_annotation(spans, (3, 22))  # `x | 2` is evaluated
    (tmp_path / "eager.py").write_text(source.split("\n", 1)[1])
    assert _annotation_spans(tmp_path / "eager.py") == []  # evaluated annotations stay mutable


@pytest.mark.slow
def test_a_scenario_naming_a_regression_judges_the_broken_engine(tmp_path: Path) -> None:
    import json

    import yaml

    from canaries.cli import main as canary
    from canaries.scenario.yamldoc import read_doc

    doc = read_doc(Path(__file__).resolve().parents[1] / "configs" / "scenarios"
                   / "leak-request-strict-idle.yaml").data
    doc.update(name="leak-under-a-blind-ledger", regressions=["ledgers.full-never-fails"])
    doc["expect"]["verdict"] = "WRONG_DETECTOR"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert canary(["run", str(path), "--report-dir", str(tmp_path / "r")]) == 0
    run_dir = tmp_path / "r" / "leak-under-a-blind-ledger"
    assert "FULL_LEDGER, True" in (run_dir / "regressions.diff").read_text()
    assert json.loads((run_dir / "verdict.json").read_text())["verdict"] == "WRONG_DETECTOR"
    assert not (run_dir / "engine-src").exists(), "the mutated copy outlived the run"


def test_planted_scenario_in_a_relative_report_dir_runs_its_planted_engine(tmp_path: Path, monkeypatch) -> None:
    """A relative report dir (`--report-dir reports/x`) once put a relative engine copy on the
    warm parent's PYTHONPATH, where it named nothing: the checkout's own engine ran, and the
    negative test revert-pr-36723 read DETECTED instead of MISSED."""
    from canaries.runner import run_scenario

    monkeypatch.chdir(tmp_path)
    scenario = load_scenario(next(p for p in discover() if p.stem == "revert-pr-36723"))
    record = run_scenario(scenario, Path("reports") / scenario.name)
    assert record.verdict == "MISSED" and record.passed, record.reason
