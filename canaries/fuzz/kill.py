"""The fuzzer's strength: the catalogue's mutants against generated scenarios instead of the
library (`canary fuzz --mutants`).

The generated scenarios of one seed are a fixed sequence (index 0, 1, ...). Each runs once on
the real engine, the baseline; each mutant then runs the same sequence from its own copy of the
engine until its budget is spent, and is killed by the first scenario whose oracle outcome or
signature differs from the baseline's (a detector that stops firing, a false alarm, a blind
spot, a hang). Differential, like `canary mutate`: a mutant cannot be "killed" by a finding the
real engine has as well.

Steered (`steer="on"`), the sequence is the one the real engine's runs steer: the baseline
feeds the corpus, so every mutant runs the same steered sequence and the comparison stays
differential.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canaries.fuzz.features import run_features
from canaries.fuzz.oracle import judge_run
from canaries.fuzz.sequence import make_sequence

__all__ = ["MutantResult", "fuzz_mutants"]


@dataclass
class MutantResult:
    mutant: str
    status: str  # killed | survived | equivalent | stale
    killed_by: str | None = None
    baseline: str | None = None
    got: str | None = None
    scenarios_run: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class _Baseline:
    """The sequence's scenarios and their keys on the real engine, extended on demand (in index
    order, `jobs` at a time: what a steered sequence needs to be the same for every mutant)."""

    sequence: Any
    directory: Path
    runtime: str
    keys: dict[int, tuple[str, str]] = field(default_factory=dict)
    scenarios: dict[int, Any] = field(default_factory=dict)

    def extend(self, n: int, pool: ThreadPoolExecutor, jobs: int) -> None:
        """Baseline every index below `n`."""
        while len(self.keys) < n:
            batch = []
            for k in range(len(self.keys), min(n, len(self.keys) + jobs)):
                if not self.sequence.ready(k):
                    break
                self.scenarios[k], _ = self.sequence.scenario(k, self.directory / "generated")
                batch.append(k)
            assert batch, "a sequence that is never ready"
            runs = pool.map(lambda k: _key(self.scenarios[k], self.directory / "baseline" / str(k),
                                           self.runtime, None), batch)
            for k, (key, features) in zip(batch, list(runs), strict=True):
                self.keys[k] = key
                self.sequence.feed(k, self.scenarios[k].name, features)


def _key(scenario: Any, run_dir: Path, runtime: str,
         engine_root: Path | None) -> tuple[tuple[str, str], frozenset[str]]:
    from canaries.runner import run_scenario

    record = run_scenario(scenario, run_dir, runtime=runtime, engine_root=engine_root)
    judgement = judge_run(scenario, record, run_dir)
    features = run_features(run_dir, judgement.outcome)
    shutil.rmtree(run_dir, ignore_errors=True)
    return (judgement.outcome, judgement.signature), features


def fuzz_mutants(mutants: Sequence[Any], seed: int, report_dir: str | Path, *, budget_s: float = 60.0,
                 jobs: int = 1, runtime: str = "local", warm_indices: int = 0, steer: str = "off",
                 progress: Callable[[str], None] | None = print) -> list[MutantResult]:
    """Run each mutant on the generated sequence of `seed` (steered or not) for `budget_s`
    seconds (wall, `jobs` scenarios at once); `warm_indices` baselines that many scenarios
    first. Writes `fuzz_mutants.jsonl` under `report_dir`."""
    from canaries.regressions import RegressionError, materialize
    from canaries.runtime.warm import close_fork_server

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _: None)
    base = _Baseline(make_sequence(seed, steer, jobs=jobs), report_dir, runtime)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        base.extend(warm_indices, pool, jobs)
    results: list[MutantResult] = []
    work = Path(tempfile.mkdtemp(prefix="canary-fuzz-mutants-"))
    out = open(report_dir / "fuzz_mutants.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        for n, mutant in enumerate(mutants, 1):
            result = MutantResult(mutant.name, "survived")
            started = time.monotonic()
            root = work / mutant.name
            try:
                materialize(root, [mutant])
            except RegressionError as exc:
                result.status, result.error = "stale", str(exc)
            else:
                if mutant.equivalent:
                    result.status = "equivalent"
                else:
                    try:
                        _hunt(result, base, root, runtime, jobs, started + budget_s)
                    finally:
                        close_fork_server(engine_root=root)
            shutil.rmtree(root, ignore_errors=True)
            result.seconds = round(time.monotonic() - started, 1)
            results.append(result)
            out.write(json.dumps(asdict(result)) + "\n")
            out.flush()
            say(f"[{n}/{len(mutants)}] {mutant.name}: {result.status}"
                + (f" by {result.killed_by} ({result.baseline} -> {result.got})" if result.killed_by else "")
                + f" after {result.scenarios_run} scenario(s), {result.seconds:.0f}s")
    finally:
        out.close()
        shutil.rmtree(work, ignore_errors=True)
    return results


def _hunt(result: MutantResult, base: _Baseline, root: Path, runtime: str, jobs: int,
          deadline: float) -> None:
    """Run the sequence on the mutant in batches of `jobs` until a difference or the deadline."""
    index = 0

    def one(i: int) -> tuple[int, tuple[str, str]]:
        got, _ = _key(base.scenarios[i], base.directory / "mutant" / result.mutant / str(i), runtime, root)
        return i, got

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while time.monotonic() < deadline:
            base.extend(index + jobs, pool, jobs)
            batch = list(pool.map(one, range(index, index + jobs)))
            index += jobs
            result.scenarios_run += len(batch)
            for i, got in batch:
                if base.keys[i] != got:
                    result.status = "killed"
                    result.killed_by = base.scenarios[i].name
                    result.baseline, result.got = base.keys[i][1], got[1]
                    return
