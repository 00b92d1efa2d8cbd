"""The kill matrix: perturbation kind x detector, over one run's verdicts.

A cell lists the scenarios in which that kind landed and that detector fired after the landing.
Beside it: detectors nothing fired (an invariant no scenario can kill) and scenarios whose
perturbation landed but killed nothing. An interrupted run's matrix says so (`interrupted`), and
a scenario cut off while running is not counted as one that killed nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from canaries.report.atomic import write_atomic
from canaries.report.interruption import Interruption
from canaries.report.jsonl import as_dict

__all__ = ["kill_matrix", "write_kill_matrix"]


def kill_matrix(records: Iterable[Any], known_detectors: Iterable[str] = (),
                interruption: Interruption | None = None) -> dict:
    """The matrix as a JSON-able dict: kinds, detectors, cells, the two gap lists, and
    `interrupted` (the run-level record of an interrupted run, else None)."""
    cut_off = set(interruption.interrupted) if interruption is not None else set()
    cells: dict[str, dict[str, list[str]]] = {}
    killed_nothing: list[str] = []
    not_reached: list[str] = []
    fired: set[str] = set()
    for record in map(as_dict, records):
        kinds = sorted({landed.get("perturbation") for landed in record.get("landed", [])} - {None})
        detectors = sorted({f["detector"] for f in record.get("firings", [])
                            if f.get("latency") is not None and f["latency"] >= 0})
        fired.update(detectors)
        if kinds and not detectors and record["scenario"] not in cut_off:
            # Killing nothing is a detector gap only if the damage was read (else NOT_REACHED:
            # the scenario's fault).
            (not_reached if record.get("verdict") == "NOT_REACHED" else killed_nothing).append(record["scenario"])
        for kind in kinds:
            row = cells.setdefault(kind, {})
            for detector in detectors:
                row.setdefault(detector, []).append(record["scenario"])
    all_detectors = sorted(fired | set(known_detectors))
    return {
        "kinds": sorted(cells),
        "detectors": all_detectors,
        "cells": cells,
        "detectors_never_fired": sorted(set(known_detectors) - fired),
        "scenarios_killing_nothing": killed_nothing,
        "scenarios_not_reached": not_reached,
        "interrupted": interruption.to_dict() if interruption is not None else None,
    }


def _markdown(matrix: dict) -> str:
    detectors = [d for d in matrix["detectors"] if d not in matrix["detectors_never_fired"]]
    lines = []
    if matrix.get("interrupted"):
        lines += [f"**INCOMPLETE: {matrix['interrupted']['summary']}**", ""]
    lines += ["| kind | " + " | ".join(detectors) + " |", "|---" * (len(detectors) + 1) + "|"]
    for kind in matrix["kinds"]:
        row = matrix["cells"][kind]
        lines.append(f"| {kind} | " + " | ".join(str(len(row.get(d, []))) if d in row else "."
                                                 for d in detectors) + " |")
    lines.append("")
    lines.append(f"detectors nothing fired: {', '.join(matrix['detectors_never_fired']) or 'none'}")
    lines.append(f"scenarios whose perturbation killed nothing: "
                 f"{', '.join(matrix['scenarios_killing_nothing']) or 'none'}")
    lines.append(f"scenarios whose damage nothing read (NOT_REACHED): "
                 f"{', '.join(matrix.get('scenarios_not_reached', [])) or 'none'}")
    return "\n".join(lines) + "\n"


def write_kill_matrix(records: Iterable[Any], report_dir: str | os.PathLike,
                      known_detectors: Iterable[str] = (),
                      interruption: Interruption | None = None) -> dict:
    """Write `kill_matrix.json` and `kill_matrix.md` (cells count scenarios) into `report_dir`,
    each atomically."""
    matrix = kill_matrix(records, known_detectors, interruption)
    report_dir = Path(report_dir)
    write_atomic(report_dir / "kill_matrix.json", (json.dumps(matrix, indent=2) + "\n").encode())
    write_atomic(report_dir / "kill_matrix.md", _markdown(matrix).encode())
    return matrix
