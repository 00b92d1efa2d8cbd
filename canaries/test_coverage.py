"""The kill matrix's coverage: every detector has a scenario that fires it, every kind lands
somewhere, and every kind's `caught_by` is what the scenarios using it expect.

Static over the library (no engine runs): the scenarios themselves prove, when they run, that
the detectors they name really fire. Given a run's kill matrix (`CANARY_KILL_MATRIX`: a report
dir or its kill_matrix.json), each kind's `caught_by` is also checked against what fired.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from canaries.scenario import discover, known_detectors, known_kinds, load_scenario
from engine_stub.perturb.kinds import KINDS

SCENARIOS = [load_scenario(path) for path in discover()]


def _expected_detectors(kind: str | None = None) -> set[str]:
    """What the library's scenarios (those using `kind`, if given) expect to fire. A scenario
    whose engine runs a catalogued regression proves its detectors fire, not that a kind does."""
    named: set[str] = set()
    for scenario in SCENARIOS:
        if scenario.expect.verdict is not None:  # a negative test proves a miss, not a detection
            continue
        if kind is not None and (scenario.regressions
                                 or kind not in {spec.kind for spec in scenario.perturbations}):
            continue
        named.update(scenario.expect.fires)
        named.update(scenario.expect.detected_by)
    return named


@pytest.mark.parametrize("detector", known_detectors())
def test_every_detector_has_a_scenario_that_fires_it(detector: str) -> None:
    assert detector in _expected_detectors(), f"no scenario expects {detector} to fire: add one"


@pytest.mark.parametrize("kind", sorted(known_kinds()))
def test_every_kind_has_a_scenario(kind: str) -> None:
    used = {spec.kind for scenario in SCENARIOS for spec in scenario.perturbations}
    assert kind in used, f"no scenario uses the perturbation kind {kind}: add one that proves it lands"


@pytest.mark.parametrize("kind", sorted(known_kinds()))
def test_every_detector_a_kind_claims_is_expected_by_a_scenario_using_it(kind: str) -> None:
    unproven = set(KINDS[kind].caught_by) - _expected_detectors(kind)
    assert not unproven, (f"{kind} claims caught_by {sorted(unproven)}, but no scenario using it "
                          "expects them: add one, or drop the claim")


@pytest.mark.parametrize("kind", sorted(known_kinds()))
def test_every_detector_a_scenario_expects_of_a_kind_is_claimed_by_it(kind: str) -> None:
    # A scenario with several kinds (one sets up what the other damages) credits its detectors
    # to whichever of its kinds claims them.
    unclaimed: set[str] = set()
    for scenario in SCENARIOS:
        kinds = {spec.kind for spec in scenario.perturbations}
        if scenario.expect.verdict is not None or kind not in kinds:
            continue
        if scenario.regressions:  # what fires there is the regressed engine's doing, not the kind's
            continue
        claimed = set().union(*(KINDS[k].caught_by for k in kinds))
        unclaimed |= (set(scenario.expect.fires) | set(scenario.expect.detected_by)) - claimed
    assert not unclaimed, (f"scenarios using {kind} expect {sorted(unclaimed)}, which its "
                           "caught_by does not name: declare them where the kind registers")


@pytest.fixture(scope="module")
def kill_matrix(tmp_path_factory) -> dict:
    """The kill matrix of a run: `CANARY_KILL_MATRIX` (a report dir or its kill_matrix.json)
    when set, else a run of the library's perturbation scenarios made here (about 20 s)."""
    where = os.environ.get("CANARY_KILL_MATRIX")
    if where:
        path = Path(where)
    else:
        from canaries.runner import run_many

        report = tmp_path_factory.mktemp("kill-matrix")
        perturbed = [s for s in SCENARIOS if s.perturbations and not s.regressions]
        run_many(perturbed, report, jobs=2, progress=False)
        path = report
    return json.loads((path / "kill_matrix.json" if path.is_dir() else path).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(known_kinds()))
def test_every_detector_a_kind_claims_killed_it_in_the_run(kind: str, kill_matrix: dict) -> None:
    fired = set(kill_matrix["cells"].get(kind, {}))
    missing = set(KINDS[kind].caught_by) - fired
    assert not missing, f"{kind} claims caught_by {sorted(missing)}, which never fired after it landed"


def test_library_has_a_control_per_page_size_and_cache_mode() -> None:
    controls = {(s.engine.page_size, s.engine.radix_cache) for s in SCENARIOS if s.expect.clean}
    assert {(1, True), (1, False), (16, True), (16, False)} <= controls
