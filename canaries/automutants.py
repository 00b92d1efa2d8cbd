"""Automatic mutants from a real mutation-testing tool: cosmic-ray.

cosmic-ray enumerates every mutation of the target modules (`cosmic-ray init`, then `dump`: one
work item per operator occurrence); a seeded sample of them becomes `AutoMutant`s, each applied
with `cosmic-ray apply` to a temporary copy of the engine's sources, so `canary mutate --auto N`
runs them through the same campaign as the catalogue, with the canary library as the test.
cosmic-ray's own runner would mutate the files of the tree it is given in place and run one test
command at a time; applying its mutations to copies keeps the checkout untouched and lets the
campaign share its baseline and scenario selection.

Targets: every module of `engine_stub/mem/` (the backend adapter aside), `admission.py` (the
submit-time refusal rule and the per-request full reserve the scheduler's admission uses) and, of
the scheduler, only the functions that call the memory path.
"""

from __future__ import annotations

import ast
import difflib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from canaries.regressions import RegressionError, engine_sources

__all__ = ["AutoMutant", "MEMORY_FUNCTIONS", "TARGETS", "enumerate_mutants", "sample_mutants"]

TARGETS = ("engine_stub/mem/allocator.py", "engine_stub/mem/swa.py", "engine_stub/mem/radix.py",
           "engine_stub/mem/req_to_token.py", "engine_stub/scheduler.py", "engine_stub/admission.py")
# The scheduler's functions on the memory path (its other code is batching and bookkeeping).
MEMORY_FUNCTIONS = frozenset({
    "check_fits", "_admit", "_alloc_extend", "_evict_tree", "_schedule_decode", "_alloc_decode",
    "_evict_windows", "_finish", "_release_kv", "_free_group", "_drop_aborted", "_full_reserve",
    "_swa_headroom", "_outstanding", "_abort_waiting", "_admission_stalled",
})


def _cosmic_ray() -> list[str]:
    exe = shutil.which("cosmic-ray")
    if exe:
        return [exe]
    probe = subprocess.run([sys.executable, "-c", "import cosmic_ray"], capture_output=True, check=False)
    if probe.returncode != 0:
        raise RegressionError("cosmic-ray is not installed: pip install 'cosmic-ray>=8.7' "
                              "(it is in the dev extras)")
    return [sys.executable, "-m", "cosmic_ray.cli"]


@dataclass(frozen=True)
class AutoMutant:
    """One cosmic-ray mutation (operator, occurrence) of one module, as a campaign mutant."""

    file: str
    operator: str
    occurrence: int
    function: str
    line: int

    @property
    def name(self) -> str:
        op = self.operator.split("/")[-1]
        return f"auto.{Path(self.file).stem}.{self.function.strip('_')}.{op}.{self.occurrence}"

    area = "auto"
    caught_by: tuple[str, ...] = ()
    equivalent: str | None = None

    @property
    def models(self) -> str:
        return f"{self.operator} #{self.occurrence} in {self.function} ({self.file}:{self.line})"

    def apply(self, root: str | Path) -> str:
        path = Path(root) / self.file
        before = path.read_text(encoding="utf-8")
        proc = subprocess.run([*_cosmic_ray(), "apply", self.file, self.operator, str(self.occurrence)],
                              cwd=root, capture_output=True, text=True, check=False)
        after = path.read_text(encoding="utf-8")
        if proc.returncode != 0 or after == before:
            raise RegressionError(f"{self.name}: cosmic-ray apply failed: {proc.stderr.strip()[-300:]}")
        return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                            f"a/{self.file}", f"b/{self.file}", n=2))


def _annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) (line, column) of every annotation in `path`: under `from __future__ import
    annotations` none is ever evaluated, so a mutation inside one is equivalent by construction."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                    and any(a.name == "annotations" for a in n.names) for n in tree.body)
    if not postponed:
        return []
    spans = []
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            notes = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                             args.vararg, args.kwarg) if a is not None]
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
                  for n in notes if n is not None and n.end_lineno is not None]
    return spans


def _in_annotation(spans: list, position: tuple[int, int]) -> bool:
    return any(start <= position < end for start, end in spans)


def enumerate_mutants(targets: tuple[str, ...] = TARGETS) -> list[AutoMutant]:
    """Every mutation cosmic-ray finds in `targets` (scheduler: its memory functions only),
    except those inside annotations (never evaluated)."""
    work = Path(tempfile.mkdtemp(prefix="canary-cosmic-ray-"))
    try:
        shutil.copytree(engine_sources(), work / "engine_stub",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        paths = ", ".join(json.dumps(t) for t in targets)
        (work / "cr.toml").write_text(
            "[cosmic-ray]\n"
            f"module-path = [{paths}]\n"
            "timeout = 60.0\nexcluded-modules = []\ntest-command = \"true\"\n\n"
            "[cosmic-ray.distributor]\nname = \"local\"\n", encoding="utf-8")
        cr = _cosmic_ray()
        for args in (["init", "cr.toml", "session.sqlite"], ["dump", "session.sqlite"]):
            proc = subprocess.run([*cr, *args], cwd=work, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RegressionError(f"cosmic-ray {args[0]} failed: {proc.stderr.strip()[-500:]}")
        mutants = []
        annotations = {t: _annotation_spans(work / t) for t in targets}
        for line in proc.stdout.splitlines():
            item, _result = json.loads(line)
            for m in item["mutations"]:
                function = m.get("definition_name") or "<module>"
                if m["module_path"].endswith("scheduler.py") and function not in MEMORY_FUNCTIONS:
                    continue
                if _in_annotation(annotations.get(m["module_path"], []), tuple(m["start_pos"])):
                    continue
                mutants.append(AutoMutant(m["module_path"], m["operator_name"], int(m["occurrence"]),
                                          function, int(m["start_pos"][0])))
        return sorted(mutants, key=lambda a: (a.file, a.line, a.operator, a.occurrence))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sample_mutants(n: int, seed: int = 0, targets: tuple[str, ...] = TARGETS) -> list[AutoMutant]:
    """A seeded sample of `n` mutants (all of them if there are fewer)."""
    everything = enumerate_mutants(targets)
    rng = random.Random(f"canary-automutants:{seed}")
    return sorted(rng.sample(everything, min(n, len(everything))),
                  key=lambda a: (a.file, a.line, a.operator, a.occurrence))
