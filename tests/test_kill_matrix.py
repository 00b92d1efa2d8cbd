"""The kill matrix over a run's verdict records."""

from __future__ import annotations

import json
from pathlib import Path

from canaries.report import Interruption, kill_matrix, write_kill_matrix


def _record(name: str, kinds: list[str], firings: list[tuple[str, int | None]]) -> dict:
    return {
        "scenario": name,
        "landed": [{"perturbation": kind} for kind in kinds],
        "firings": [{"detector": d, "latency": latency} for d, latency in firings],
    }


def test_matrix_counts_detections_after_landing_and_lists_the_gaps(tmp_path: Path) -> None:
    records = [
        _record("strip-a", ["strip_swa_mapping"], [("swa.peer_mapped", 1), ("idle.swa_ledger", 40)]),
        _record("strip-b", ["strip_swa_mapping"], [("swa.peer_mapped", 0)]),
        _record("flip-early", ["flip_kv_byte"], [("kv_canary.verify_real_kv_hash", None)]),
        _record("control", [], [("swa.peer_mapped", None)]),
    ]
    matrix = write_kill_matrix(records, tmp_path, known_detectors=["swa.peer_mapped", "alloc.double_free"])
    assert matrix["cells"]["strip_swa_mapping"] == {
        "swa.peer_mapped": ["strip-a", "strip-b"], "idle.swa_ledger": ["strip-a"]}
    # A firing before the landing (no latency) is no detection of it.
    assert matrix["scenarios_killing_nothing"] == ["flip-early"]
    assert matrix["detectors_never_fired"] == ["alloc.double_free"]
    assert json.loads((tmp_path / "kill_matrix.json").read_text()) == matrix
    table = (tmp_path / "kill_matrix.md").read_text()
    assert "| strip_swa_mapping | 1 | 2 |" in table
    assert kill_matrix([]) == {"kinds": [], "detectors": [], "cells": {}, "detectors_never_fired": [],
                               "scenarios_killing_nothing": [], "scenarios_not_reached": [],
                               "interrupted": None}


def test_matrix_of_an_interrupted_run_says_so_and_blames_no_cut_off_scenario(tmp_path: Path) -> None:
    records = [_record("done", ["strip_swa_mapping"], [("swa.peer_mapped", 1)]),
               _record("cut", ["flip_kv_byte"], []),
               {"scenario": "later", "verdict": "NOT_RUN", "landed": [], "firings": []}]
    interruption = Interruption("SIGINT", ("done", "cut", "later"), ("done",), ("cut",),
                                ("later",))
    matrix = write_kill_matrix(records, tmp_path, interruption=interruption)
    assert matrix["interrupted"]["cause"] == "SIGINT"
    assert matrix["interrupted"]["not_run"] == ["later"]
    assert matrix["scenarios_killing_nothing"] == []  # "cut" never got the chance
    assert json.loads((tmp_path / "kill_matrix.json").read_text()) == matrix
    first = (tmp_path / "kill_matrix.md").read_text().splitlines()[0]
    assert "INCOMPLETE" in first and "interrupted (SIGINT)" in first and "later" in first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kill_matrix.json", "kill_matrix.md"]


def test_matrix_tells_a_not_reached_scenario_from_a_detector_gap() -> None:
    landed = [{"perturbation": "flip_kv_byte", "index": 0, "step": 3}]
    records = [{"scenario": "vacuous", "verdict": "NOT_REACHED", "landed": landed, "firings": []},
               {"scenario": "blind", "verdict": "MISSED", "landed": landed, "firings": []}]
    matrix = kill_matrix(records)
    assert matrix["scenarios_not_reached"] == ["vacuous"]
    assert matrix["scenarios_killing_nothing"] == ["blind"]
