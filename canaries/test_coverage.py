"""The kill matrix's coverage: every detector has a scenario that fires it, every kind lands somewhere.

Static over the library (no engine runs): the scenarios themselves prove, when they run, that
the detectors they name really fire.
"""

from __future__ import annotations

import pytest

from canaries.scenario import discover, known_detectors, known_kinds, load_scenario

SCENARIOS = [load_scenario(path) for path in discover()]


def _expected_detectors() -> set[str]:
    named: set[str] = set()
    for scenario in SCENARIOS:
        if scenario.expect.verdict is None:  # a negative test proves a miss, not a detection
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


def test_library_has_a_control_per_page_size_and_cache_mode() -> None:
    controls = {(s.engine["page_size"], s.engine["radix_cache"]) for s in SCENARIOS if s.expect.clean}
    assert {(1, True), (1, False), (16, True), (16, False)} <= controls
