"""A fuzz campaign: generated scenarios run until the budget is spent, judged by the oracle,
each new finding written at once and then shrunk.

Writes, under the report dir: `generated/` (every scenario run, as run), `runs/` (their run
dirs; a run without a finding is deleted unless `keep_runs`), `fuzz.jsonl` (one line per run:
index, name, outcome, signature, verdict, seconds), `findings/` (one scenario file per distinct
finding, shrunk, its header naming the outcome, the signature, the reason and the repro
command), `findings.json` and `index.html` (the summary). A finding's file is written when it
is found and rewritten when shrunk, so an interrupted campaign keeps every finding so far.
"""

from __future__ import annotations

import hashlib
import html
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canaries.fuzz.accepted import load_accepted
from canaries.fuzz.features import run_features
from canaries.fuzz.oracle import Judgement, judge_run
from canaries.fuzz.sequence import make_sequence
from canaries.fuzz.shard import WHOLE, Shard

__all__ = ["Finding", "FuzzResult", "fuzz", "replay"]


@dataclass
class Finding:
    """One distinct finding: its first scenario, how often it was seen, and its file."""

    signature: str
    outcome: str
    reason: str
    first: str
    path: str
    seen: int = 1
    origin: dict = field(default_factory=dict)  # the seed's index, or the corpus parent and mutation
    shrunk: bool = False
    size_before: int | None = None
    size_after: int | None = None

    @property
    def slug(self) -> str:
        return f"{self.outcome}-{hashlib.sha256(self.signature.encode()).hexdigest()[:8]}"


@dataclass
class FuzzResult:
    seed: int
    report_dir: Path
    runs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    findings: dict[str, Finding] = field(default_factory=dict)
    wall_s: float = 0.0
    generate_s: float = 0.0
    jobs: int = 1
    interrupted: bool = False
    steer: str = "off"
    shard: str = "1/1"
    features: int = 0  # distinct features the runs reached
    corpus: int = 0  # corpus entries at the end (steered: seeds plus scenarios that reached new features)
    merged_from: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        cpu_hours = self.generate_s * self.jobs / 3600 or 1e-9  # the generating phase, all jobs
        return {"seed": self.seed, "steer": self.steer, "shard": self.shard, "runs": self.runs,
                "jobs": self.jobs, "wall_s": round(self.wall_s, 1),
                "features": self.features, "corpus": self.corpus,
                **({"merged_from": self.merged_from} if self.merged_from else {}),
                "generate_s": round(self.generate_s, 1), "interrupted": self.interrupted,
                "outcomes": dict(sorted(self.outcomes.items())),
                "findings": [asdict(f) for f in self.findings.values()],
                "findings_per_cpu_hour": round(len(self.findings) / cpu_hours, 2)}


def _header(finding: Finding, seed: int) -> str:
    return "\n".join((
        f"canary fuzz finding: {finding.outcome}",
        f"signature: {finding.signature}",
        f"reason: {finding.reason}",
        f"found by: canary fuzz --seed {seed} ({finding.first}); seen {finding.seen} time(s)",
        f"origin: {json.dumps(finding.origin, sort_keys=True)}",
        f"repro: canary fuzz --replay {finding.path}",
    ))


def _write_finding(finding: Finding, source: Path, seed: int) -> None:
    text = source.read_text(encoding="utf-8")
    comment = "".join(f"# {line}\n" for line in _header(finding, seed).splitlines())
    lines = [ln for ln in text.splitlines(keepends=True) if not ln.startswith("#")]
    Path(finding.path).write_text(comment + "".join(lines), encoding="utf-8")


def _oracle_target(scenario: Any, record: Any, run_dir: Path) -> tuple[str, str]:
    judgement = judge_run(scenario, record, run_dir)
    return judgement.outcome, judgement.signature


def _parity(scenario: Any, native: Judgement, run_dir: Path, sglang_python: str,
            device: str | None) -> Judgement:
    """The same scenario on SGLang's allocator: its outcome must be the native one."""
    from canaries.runner import run_scenario

    sglang_dir = run_dir / "sglang"
    record = run_scenario(scenario, sglang_dir, device=device, memory="sglang",
                          engine_python=sglang_python)
    other = judge_run(scenario, record, sglang_dir)
    if other.outcome == native.outcome:
        return native
    return Judgement("parity", f"parity|{native.signature}|sglang:{other.outcome}",
                     f"native {native.outcome} ({native.reason[:120]}); on SGLang's allocator "
                     f"{other.outcome} ({other.reason[:120]})")


def _write_reports(result: FuzzResult) -> None:
    from canaries.report.atomic import write_atomic

    summary = result.summary()
    write_atomic(result.report_dir / "findings.json", (json.dumps(summary, indent=2) + "\n").encode())
    rows = "".join(
        f"<tr><td>{html.escape(f.outcome)}</td><td><code>{html.escape(f.signature)}</code></td>"
        f"<td>{f.seen}</td><td>{html.escape(f.reason)}</td>"
        f"<td><a href=\"findings/{html.escape(Path(f.path).name)}\">{html.escape(Path(f.path).name)}</a>"
        f"{' (shrunk)' if f.shrunk else ''}</td></tr>"
        for f in result.findings.values())
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(result.outcomes.items()))
    page = (
        "<!doctype html><meta charset=utf-8><title>canary fuzz</title>"
        "<style>body{font:14px sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px;"
        "vertical-align:top}table{border-collapse:collapse}</style>"
        f"<h1>canary fuzz: seed {result.seed}</h1>"
        f"<p>steer {html.escape(result.steer)}, shard {html.escape(result.shard)}"
        f"{', merged from ' + html.escape(', '.join(result.merged_from)) if result.merged_from else ''}; "
        f"{result.features} distinct feature(s) reached</p>"
        f"<p>{result.runs} generated scenario(s) in {result.wall_s:.0f} s"
        f"{' (interrupted)' if result.interrupted else ''}; outcomes: {html.escape(outcomes)}</p>"
        f"<h2>{len(result.findings)} distinct finding(s)</h2>"
        "<table><tr><th>outcome</th><th>signature</th><th>seen</th><th>reason</th><th>scenario</th></tr>"
        f"{rows}</table>"
        "<p>Rerun one: <code>canary fuzz --replay FILE</code>. Outcomes that are not findings: clean, "
        "detected, absorbed (nothing fired, and the engine provably absorbed the damage), "
        "disabled (the kind's detectors are off in that engine), accepted (a signature "
        "configs/fuzz/accepted.yaml accepts, with its reason), not_injected and not_reached (the "
        "generated perturbation never landed, or nothing read its damage).</p>")
    write_atomic(result.report_dir / "index.html", page.encode())


def fuzz(seed: int, report_dir: str | Path, *, budget_s: float | None = None,
         count: int | None = None, jobs: int = 1, runtime: str = "local", device: str | None = None,
         engine_root: str | Path | None = None, shrink_steps: int = 16, keep_runs: bool = False,
         sglang_python: str | None = None, steer: str = "off", shard: Shard = WHOLE,
         progress: Callable[[str], None] | None = print) -> FuzzResult:
    """Run generated scenarios of `seed` (index 0, 1, ...) until `budget_s` seconds have gone
    or `count` scenarios have run; then shrink each new finding (at most `shrink_steps` runs
    each). SIGINT/SIGTERM stops it early: the running scenarios' engines are stopped, shrinking
    is skipped, every finding so far is kept and the reports are written.

    `steer`: "off" runs the seed's generated draws in order (this shard's part of them); "on"
    runs a corpus-guided sequence (`sequence.SteeredSequence`) fed with what each run reached.
    Each run's origin (the seed's index, or the corpus parent and the mutation) is in fuzz.jsonl.

    `sglang_python`: an interpreter with sglang; every scenario then runs a second time on
    SGLang's allocator (`memory: sglang`), and a different outcome from the oracle is a finding
    `parity` (shrunk as the native run)."""
    from canaries.runner import cancel_all, run_scenario
    from canaries.runtime.safety import SignalLatch
    from canaries.runtime.warm import close_fork_server

    if budget_s is None and count is None:
        raise ValueError("fuzz needs a budget or a count")
    report_dir = Path(report_dir)
    for sub in ("generated", "runs", "findings"):
        (report_dir / sub).mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _: None)
    result = FuzzResult(seed, report_dir, jobs=jobs, steer=steer, shard=str(shard))
    sequence = make_sequence(seed, steer, shard, jobs)
    reached: set[str] = set()
    accepted = load_accepted()
    t0 = time.monotonic()
    deadline = t0 + budget_s if budget_s is not None else float("inf")
    log = open(report_dir / "fuzz.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed below
    sources: dict[str, Path] = {}

    def one(index: int, scenario: Any, origin: dict) -> tuple:
        started = time.monotonic()
        run_dir = report_dir / "runs" / scenario.name
        record = run_scenario(scenario, run_dir, runtime=runtime, device=device, engine_root=engine_root)
        judgement = judge_run(scenario, record, run_dir)
        features = run_features(run_dir, judgement.outcome)
        if sglang_python is not None and not judgement.finding:
            judgement = _parity(scenario, judgement, run_dir, sglang_python, device)
        return index, scenario, origin, run_dir, judgement, features, time.monotonic() - started

    def take(index: int, scenario: Any, origin: dict, run_dir: Path, judgement: Judgement,
             features: frozenset[str], seconds: float) -> None:
        result.runs += 1
        new = sequence.feed(index, scenario.name, features)
        reached.update(features)
        result.features = len(reached)
        result.corpus = sequence.corpus_size
        known = next((a for a in accepted if judgement.finding and a.matches(judgement.signature)), None)
        outcome = "accepted" if known else judgement.outcome
        result.outcomes[outcome] += 1
        log.write(json.dumps({"index": index, "scenario": scenario.name, **judgement.to_dict(),
                              **({"accepted": known.signature} if known else {}),
                              "origin": origin, "new_features": new,
                              "seconds": round(seconds, 2)}) + "\n")
        log.flush()
        line = f"[{result.runs}] {scenario.name} {outcome} ({seconds:.1f}s)"
        if judgement.finding and not known:
            known = result.findings.get(judgement.signature)
            if known is not None:
                known.seen += 1
            else:
                finding = Finding(judgement.signature, judgement.outcome, judgement.reason,
                                  scenario.name, "", origin=origin)
                finding.path = str(report_dir / "findings" / f"{finding.slug}.yaml")
                sources[judgement.signature] = Path(scenario.path)
                _write_finding(finding, Path(scenario.path), seed)
                result.findings[judgement.signature] = finding
                line += f" NEW FINDING {finding.slug}: {judgement.reason}"
        elif not keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        say(line)

    say(f"canary fuzz: seed {seed}, steer {steer}, shard {shard}, "
        + (f"budget {budget_s:.0f}s" if budget_s is not None else f"{count} scenario(s)")
        + f", {jobs} job(s); reports in {report_dir}")
    next_index = 0
    with SignalLatch() as latch:
        try:
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="canary-fuzz") as pool:
                running: set[Future] = set()
                while True:
                    while (len(running) < jobs and not latch.tripped and time.monotonic() < deadline
                           and (count is None or next_index < count) and sequence.ready(next_index)):
                        scenario, origin = sequence.scenario(next_index, report_dir / "generated")
                        running.add(pool.submit(one, next_index, scenario, origin))
                        next_index += 1
                    if not running:
                        break
                    done, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        take(*future.result())
                    if latch.tripped and running:
                        cancel_all()
            result.generate_s = time.monotonic() - t0
            result.interrupted = latch.tripped
            _write_reports(result)
            if not latch.tripped:
                _shrink_all(result, sources, seed, (runtime, device, engine_root), shrink_steps, latch, say)
        finally:
            log.close()
            close_fork_server(engine_root=engine_root)
            result.wall_s = time.monotonic() - t0
            result.generate_s = result.generate_s or result.wall_s  # a campaign that died generating
            result.interrupted = result.interrupted or latch.tripped
            _write_reports(result)
    found = len(result.findings)
    say(f"canary fuzz: {result.runs} scenario(s) in {result.wall_s:.0f}s; {found} distinct finding(s)"
        + (f" in {report_dir / 'findings'}" if found else "")
        + (" (interrupted)" if result.interrupted else ""))
    return result


class _Interrupted(Exception):
    """SIGINT/SIGTERM during shrinking: stop, keep the finding as found."""


def _shrink_all(result: FuzzResult, sources: dict[str, Path], seed: int, where: tuple,
                shrink_steps: int, latch: Any, say: Callable[[str], None]) -> None:
    """Shrink each finding in place; `where` is (runtime, device, engine_root) as it ran."""
    from canaries.scenario import ScenarioError
    from canaries.triage.shrink import shrink

    runtime, device, engine_root = where
    for signature, finding in result.findings.items():
        if latch.tripped or shrink_steps <= 0:
            return
        if finding.outcome == "parity":
            continue  # shrinking judges the native run alone: kept as found
        say(f"canary fuzz: shrinking {finding.slug} ({finding.outcome})")
        work = result.report_dir / "shrink" / finding.slug
        def stop_if_interrupted(step: Any) -> None:
            if latch.tripped:
                raise _Interrupted

        try:
            shrunk = shrink(sources[signature], Path(finding.path), runtime=runtime, work_dir=work,
                            max_steps=shrink_steps, target_of=_oracle_target,
                            progress=stop_if_interrupted,
                            name=finding.slug, header=_header(finding, seed),
                            engine_root=engine_root, device=device)
        except _Interrupted:
            say("  interrupted: kept as found")
            return
        except (ScenarioError, OSError, RuntimeError) as exc:
            say(f"  shrink failed: {exc}")
            continue
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if shrunk.target != (finding.outcome, signature):
            # The rerun did not reproduce the finding: keep the unshrunk file, say so.
            say(f"  not reproduced on rerun ({shrunk.target[0]}); kept as found")
            _write_finding(finding, sources[signature], seed)
            continue
        finding.shrunk = True
        finding.size_before, finding.size_after = shrunk.size_before, shrunk.size_after
        say(f"  size {shrunk.size_before} -> {shrunk.size_after} in {len(shrunk.steps)} step(s)")


def replay(paths: list[Path], report_dir: Path, runtime: str = "local", device: str | None = None,
           engine_root: str | Path | None = None) -> list[tuple[Path, Judgement]]:
    """Run each scenario file and judge it as the fuzzer does."""
    from canaries.runner import run_scenario
    from canaries.scenario import load_scenario

    out = []
    for i, path in enumerate(paths):
        scenario = load_scenario(path)
        run_dir = report_dir / f"{i:03d}-{scenario.name}"
        record = run_scenario(scenario, run_dir, runtime=runtime, device=device, engine_root=engine_root)
        out.append((path, judge_run(scenario, record, run_dir)))
    return out
