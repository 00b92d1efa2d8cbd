"""One end-to-end test per scenario file in configs/scenarios (`pytest canaries -k strip`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaries.runner import run_scenario
from canaries.scenario import discover, load_scenario

_FILES = discover()
_SCENARIOS = [load_scenario(f) for f in _FILES]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", _SCENARIOS, ids=[s.name for s in _SCENARIOS])
def test_scenario(scenario, tmp_path: Path, assert_no_engine_left, record_property) -> None:
    record = run_scenario(scenario, tmp_path / scenario.name)
    # In the JUnit XML (also under pytest-xdist): the verdict, comparable with `canary run`'s.
    record_property("verdict", record.verdict)
    record_property("signature", record.signature)
    assert_no_engine_left(tmp_path)
    assert record.passed, f"{scenario.name}: {record.verdict}: {record.reason} (run dir {tmp_path})"
    landed = {e.get("index") for e in record.landed}
    assert landed == set(range(len(scenario.perturbations))), \
        f"{scenario.name}: perturbations landed {sorted(landed)} of {len(scenario.perturbations)}"


def test_library_is_big_enough_and_valid() -> None:
    from canaries.scenario import validate_paths

    assert len(_FILES) >= 20
    assert validate_paths(_FILES) == []
    controls = [s for s in _SCENARIOS if s.expect.clean]
    assert {s.name for s in controls} >= {"clean-page1-radix", "clean-page1-noradix",
                                          "clean-page16-radix", "clean-page16-noradix"}
