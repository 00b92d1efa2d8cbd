"""The detector catalogue: declared once, and exactly what the engine constructs."""

from __future__ import annotations

import pytest

import engine_stub.idle_check  # noqa: F401 - the engine modules that construct invariants
import engine_stub.mem  # noqa: F401
import engine_stub.scheduler  # noqa: F401
from engine_stub.detectors import (
    CATALOGUE,
    SCRATCH_PREFIX,
    Detector,
    canary_reasons,
    detector,
    detector_names,
    invariant_entries,
)
from engine_stub.invariants import registered_invariants
from engine_stub.kv_canary import REASONS


def _engine_invariants() -> dict:
    return {inv.name: inv for inv in registered_invariants()
            if not inv.name.startswith(SCRATCH_PREFIX)}


def test_every_catalogued_invariant_is_constructed_by_the_engine() -> None:
    assert set(_engine_invariants()) == {d.name for d in invariant_entries()}


@pytest.mark.parametrize("entry", invariant_entries(), ids=lambda d: d.name)
def test_engine_invariant_agrees_with_its_entry(entry: Detector) -> None:
    inv = _engine_invariants()[entry.name]
    assert (inv.bucket.name, inv.site, inv.description) == \
        (entry.bucket, entry.site, entry.description)


def test_canary_reasons_are_the_kv_canarys() -> None:
    assert canary_reasons() == tuple(REASONS)


def test_names_list_invariants_then_canary_reasons() -> None:
    names = detector_names()
    assert len(names) == len(CATALOGUE) == len(set(names))
    assert names[-len(REASONS):] == tuple(f"kv_canary.{r}" for r in REASONS)


def test_unknown_detector_lists_the_catalogue() -> None:
    with pytest.raises(KeyError, match="swa.peer_mapped"):
        detector("swa.peer_mappd")


@pytest.mark.parametrize(("name", "bucket"), [("x.y", "LOUD"), ("x.y", "KV_CANARY"),
                                              ("kv_canary.z", "GUARD")])
def test_entry_with_a_wrong_bucket_is_refused(name: str, bucket: str) -> None:
    with pytest.raises(ValueError, match="bucket"):
        Detector(name, bucket, "site", "description")
