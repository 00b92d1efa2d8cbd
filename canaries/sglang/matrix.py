"""`canary matrix`: the library on our memory path and on each SGLang release's own.

Runs the selection once on `memory: native` and once per release column on `memory: sglang`
(every part of the memory path the release has), in that release's pinned venv, and puts each
scenario x release cell beside the native verdict: `same`, `known` (the difference is recorded
with its reason in configs/parity/sglang-<version>.yaml, or inherited: canaries/sglang/divergences.py) or
`unexplained`. With `runtime="sglang-server"` each column is that release's own server instead
(its server venv, `make-sglang-venv.sh --server`), judged as `canary parity --runtime
sglang-server` judges it: against configs/parity/server/, detectors compared within those the
server has a line for. A column is a release on the index, a wheel or a source checkout, optionally with
patches and diffs (canaries/sglang/releases/spec.py); each column's report says exactly what ran.
Writes matrix.md, matrix.json and matrix.html; each column's run (verdicts, events, engine logs)
is kept under `runs/<column>/`.

As a pre-release gate (`last` and `candidate`), a scenario that passed on the last release and
does not on the candidate is a regression: the gate fails and names it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from canaries.confirm import DEFAULT_RERUNS, Confirmation, confirm, confirmation_from_dict
from canaries.native_cache import NativeCache, run_native
from canaries.sglang.divergences import known_divergences
from canaries.sglang.parity import (
    PARITY_DIR,
    SERVER_PARITY_DIR,
    compare,
    detectors_of,
    engine_sglang_version,
    lost_sglang_hits,
    refused_reason,
    unsupported_reason,
)
from canaries.sglang.releases import (
    ReleaseError,
    ReleaseSpec,
    SGLangSource,
    patched_interpreter,
    release_python,
)
from canaries.sglang.releases.spec import file_label
from canaries.sglang.releases.versions import same_version, version_key

__all__ = ["Cell", "GateResult", "MatrixResult", "Column", "describe_provenance", "gate", "rejudge_matrix",
           "run_matrix"]


@dataclass(frozen=True)
class Cell:
    """One scenario on one column: its verdict and detectors, whether it passed, and how it
    compares with the native verdict (`native` for the native column itself)."""

    verdict: str
    detectors: tuple[str, ...]
    passed: bool
    status: str  # native | same | known | unexplained | unsupported | harness
    reason: str = ""


@dataclass(frozen=True)
class Column:
    """A release column as it ran: its spec, the sglang version its interpreter reported, the
    interpreter, the memory parts that were SGLang's, its wall time, any planted diff, what
    exactly ran (`ReleaseSpec.provenance()`) and which parity file(s) explained its cells."""

    label: str
    version: str
    python: str
    seconds: float
    patches: tuple[str, ...] = ()
    diff: str = ""
    memory_parts: dict[str, str] = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    divergences: str = ""  # e.g. `sglang-0.5.20.yaml (inherited)`
    # Whose clean answers judged the column's runs (its server's: canaries/sglang/oracle.py).
    oracle: str = ""

    @property
    def source(self) -> str:
        """What ran, in one line: the source kind and its fingerprint, then patches and diffs."""
        return describe_provenance(self.provenance)


def describe_provenance(prov: dict) -> str:
    """`ReleaseSpec.provenance()` in one line (`wheel sha256 ...; diff pr.diff sha256 ...`)."""
    if not prov:
        return "?"
    kind = prov.get("kind", "?")
    if kind == "wheel":
        parts = [f"wheel {Path(prov['path']).name} sha256 {prov['sha256']}"]
    elif kind == "tree":
        head = f"tree {prov['path']}"
        if prov.get("commit"):
            head += f" at {prov['commit']}" + (" (dirty)" if prov.get("dirty") else "")
        if str(prov.get("version_from", "")).startswith("git describe"):
            head += f", version by {prov['version_from']}"
        if prov.get("py_sha256"):
            head += f", .py sha256 {prov['py_sha256']}"
        parts = [head]
    else:
        parts = [kind]
    parts += [f"patch {name}" for name in prov.get("patches") or ()]
    parts += [f"diff {Path(d['path']).name} sha256 {d['sha256']}" for d in prov.get("diffs") or ()]
    return "; ".join(parts)


@dataclass(frozen=True)
class GateResult:
    """The pre-release verdict: `regressions` passed on `last` and fail on `candidate`, and held
    on every rerun (`confirmations`); `flaky` ones disagreed with themselves on a rerun (they fail
    the gate only under the `fail` policy, `flaky_fails`)."""

    last: str
    candidate: str
    regressions: tuple[str, ...]
    fixed: tuple[str, ...]
    unjudged: tuple[str, ...] = ()  # one of the two releases cannot run it here
    flaky: tuple[str, ...] = ()  # passed on last, failed on candidate, and then not every time
    harness: tuple[str, ...] = ()  # the harness failed one of the two cells: no verdict on the release
    flaky_fails: bool = False
    confirmations: dict[str, Confirmation] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.regressions and not (self.flaky_fails and self.flaky)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "confirmations"},
                "confirmations": {name: c.to_dict() for name, c in self.confirmations.items()},
                "ok": self.ok}


def gate(last: str, candidate: str, cells: dict[str, dict[str, Cell]],
         confirmations: dict[str, Confirmation] | None = None, flaky: str = "warn") -> GateResult:
    """Compare two columns of `cells` (scenario -> column -> Cell). A scenario that passed on `last`
    and fails on `candidate` is a regression unless its `confirmations` (canaries/confirm.py) show
    a column disagreeing with itself: then it is flaky, failing the gate only when `flaky` is
    "fail"."""
    regressions, fixed, unjudged, flaky_cells, harness = [], [], [], [], []
    confirmations = confirmations or {}
    for name, row in cells.items():
        before, after = row.get(last), row.get(candidate)
        if before is None or after is None:
            continue
        if "unsupported" in (before.status, after.status):
            unjudged.append(name)
        elif "harness" in (before.status, after.status):
            harness.append(name)
        elif before.passed and not after.passed:
            (flaky_cells if name in confirmations and confirmations[name].flaky else regressions).append(name)
        elif after.passed and not before.passed:
            fixed.append(name)
    return GateResult(last, candidate, tuple(regressions), tuple(fixed), tuple(unjudged), tuple(flaky_cells),
                      tuple(harness), flaky == "fail",
                      {name: c for name, c in confirmations.items() if name in regressions + flaky_cells})


@dataclass
class MatrixResult:
    columns: list[Column]
    native_seconds: float
    cells: dict[str, dict[str, Cell]]  # scenario -> "native" | column label -> Cell
    gate: GateResult | None
    report_dir: Path
    wall_seconds: float = 0.0  # the whole matrix (columns overlap: theirs add up to more)
    runtime: str = "local"  # local: each release's memory path under our engine; sglang-server: its server
    native_cached: int = 0  # native scenarios taken from an earlier run of the same code (native_cache.py)

    @property
    def unexplained(self) -> list[tuple[str, str]]:
        return [(name, label) for name, row in self.cells.items() for label, cell in row.items()
                if cell.status == "unexplained"]

    @property
    def native_failures(self) -> list[str]:
        return [name for name, row in self.cells.items() if not row["native"].passed]

    @property
    def ok(self) -> bool:
        """The gate decides when there is one; else every cell explained and native green."""
        if self.gate is not None:
            return self.gate.ok
        return not self.unexplained and not self.native_failures

    def to_dict(self) -> dict:
        return {
            "runtime": self.runtime,
            "columns": [asdict(c) for c in self.columns],
            "native_seconds": round(self.native_seconds, 1),
            "wall_seconds": round(self.wall_seconds, 1),
            "native_cached": self.native_cached,
            "scenarios": {name: {label: asdict(cell) for label, cell in row.items()}
                          for name, row in self.cells.items()},
            "unexplained": [{"scenario": s, "release": r} for s, r in self.unexplained],
            "native_failures": self.native_failures,
            "gate": self.gate.to_dict() if self.gate else None,
            "ok": self.ok,
        }

    def to_markdown(self) -> str:
        labels = [c.label for c in self.columns]
        server = self.runtime == "sglang-server"
        lines = [f"# Release matrix: native vs SGLang's own {'server' if server else 'memory path'}", "",
                 f"Wall time {self.wall_seconds:.0f}s for the whole matrix (columns run side by side)."
                 + (f" Native: {self.native_cached} of {len(self.cells)} scenario(s) reused from an earlier "
                    "run of the same engine, harness and scenario (canaries/native_cache.py)."
                    if self.native_cached else ""), "",
                 "| column | sglang | what ran | divergences | parts from SGLang | wall time |",
                 "|---|---|---|---|---|---|",
                 f"| native | - | - | - | - | {self.native_seconds:.0f}s |"]
        for c in self.columns:
            parts = "all (its server)" if server else \
                ", ".join(k for k, v in c.memory_parts.items() if v.startswith("sglang")) or "?"
            lines.append(f"| {c.label} | {c.version} | {c.source} | {c.divergences or '-'} | {parts} "
                         f"| {c.seconds:.0f}s |")
        lines += [f"- {c.label}'s answers judged by {c.oracle}" for c in self.columns if c.oracle]
        lines += ["", "| scenario | native | " + " | ".join(labels) + " |",
                  "|---|---|" + "---|" * len(labels)]
        for name, row in self.cells.items():
            shown = [_cell_md(row[label]) if label in row else "-" for label in labels]
            lines.append(f"| {name} | {row['native'].verdict} | " + " | ".join(shown) + " |")
        lines += ["", f"`=` same as native, `k` a known divergence (configs/parity/{'server/' if server else ''}), "
                  "`!` unexplained, `h` the harness failed it (cause: harness: no verdict on the release), "
                  "`n/a` the release cannot run it on this device (reason below); a struck verdict did "
                  "not pass the scenario's expectation.", ""]
        for c in self.columns:
            counts = {s: sum(row[c.label].status == s for row in self.cells.values() if c.label in row)
                      for s in ("same", "known", "unexplained", "unsupported", "harness")}
            reasons = sorted({row[c.label].reason for row in self.cells.values()
                              if c.label in row and row[c.label].status == "unsupported"})
            lines.append(f"- {c.label}: {counts['same']} same, {counts['known']} known, "
                         f"{counts['unexplained']} unexplained, {counts['unsupported']} unsupported here"
                         + (f" ({'; '.join(reasons)})" if reasons else "")
                         + (f", {counts['harness']} not judged (the harness failed)" if counts["harness"] else ""))
        for name, label in self.unexplained:
            cell = self.cells[name][label]
            lines.append(f"- UNEXPLAINED {name} on {label}: native {self.cells[name]['native'].verdict} "
                         f"{list(self.cells[name]['native'].detectors)}, {label} {cell.verdict} "
                         f"{list(cell.detectors)} {cell.reason}".rstrip())
        if self.gate is not None:
            g = self.gate
            lines += ["", f"## Gate: {g.last} -> {g.candidate}: {'PASS' if g.ok else 'FAIL'}"]
            def confirmed(name: str) -> str:
                c = g.confirmations.get(name)
                return f"; {c.describe(g.last, g.candidate)}" if c is not None else ""

            lines += [f"- REGRESSION {name}: passed on {g.last}, fails on {g.candidate} "
                      f"({self.cells[name][g.candidate].verdict}{confirmed(name)})" for name in g.regressions]
            lines += [f"- FLAKY {name}: passed on {g.last}, failed on {g.candidate}, then disagreed with "
                      f"itself{confirmed(name)} ({'fails' if g.flaky_fails else 'does not fail'} the gate: "
                      f"--flaky {'fail' if g.flaky_fails else 'warn'})" for name in g.flaky]
            lines += [f"- fixed {name}: fails on {g.last}, passes on {g.candidate}" for name in g.fixed]
            if g.unjudged:
                lines.append(f"- not judged ({len(g.unjudged)}): one of the two releases cannot run it on "
                             f"this device: {', '.join(g.unjudged)}")
            if g.harness:
                lines.append(f"- not judged ({len(g.harness)}): the harness failed a cell (cause: harness, "
                             f"after retries; no verdict on the release): {', '.join(g.harness)}")
        return "\n".join(lines) + "\n"


def _cell_md(cell: Cell) -> str:
    mark = {"same": "=", "known": "k", "unexplained": "!", "unsupported": "", "harness": "h"}.get(cell.status, "")
    if cell.status == "unsupported":
        return "n/a"
    verdict = cell.verdict if cell.passed else f"~~{cell.verdict}~~"
    return f"{verdict} {mark}".strip()


def _cells(native: Sequence[Any], column: Sequence[Any], expected: dict, run_dir: Path,
           comparable: frozenset[str] | None = None) -> dict[str, Cell]:
    passed = {r.scenario: r.passed for r in column}
    lost = {r.scenario: lost_sglang_hits(run_dir / r.scenario) for r in column}
    unsupported = {r.scenario: unsupported_reason(run_dir / r.scenario) or refused_reason(r) for r in column}
    out = {}
    for row in compare(native, column, expected, lost, unsupported, comparable):
        verdict = "UNSUPPORTED" if row.status == "unsupported" else row.sglang
        out[row.scenario] = Cell(verdict, row.sglang_detectors, passed[row.scenario], row.status, row.reason)
    return out


def _memory_parts(records: Sequence[Any]) -> dict[str, str]:
    """Whose each part was over a column's runs (a part no scenario had, e.g. the radix cache
    of a column of radix-less scenarios, is absent)."""
    merged: dict[str, str] = {}
    for record in records:
        for part, owner in ((getattr(record, "extra", None) or {}).get("memory_parts") or {}).items():
            if owner and (part not in merged or owner.startswith("sglang")):
                merged[part] = owner
    return merged


def run_matrix(scenarios: Sequence[Any], releases: Sequence[ReleaseSpec], report_dir: str | Path, *,
               jobs: int = 1, columns_at_once: int = 3, progress: bool = True, build: bool = True,
               last: str | None = None, candidate: str | None = None, runtime: str = "local",
               log: Callable[[str], None] = print, reruns: int = DEFAULT_RERUNS,
               flaky: str = "warn", reuse_native: bool = True) -> MatrixResult:
    """Run the matrix into `report_dir`; see the module docstring.

    `columns_at_once` columns run side by side, each with `jobs` scenarios at once (one warm
    fork server per release); one display shows them all, each line naming its column.
    `runtime`: `local` (each release's memory path under our engine) or `sglang-server` (each
    release's own server; a patched column's server runs the patched copy).
    The gate confirms before it fails: a scenario that passed on `last` and fails on `candidate`
    runs `reruns` more times on both (`runs/<column>/rerun-N/`); one that disagrees with itself is
    flaky, failing the gate only when `flaky` is "fail" (canaries/confirm.py).
    A SIGINT or SIGTERM stops every column at once; the matrix of what ran is written (its
    unfinished cells NOT_RUN or interrupted) and RunInterrupted is raised.
    `reuse_native`: take each native scenario kept from an earlier run of the same code and
    scenario (canaries/native_cache.py), run only the others.
    """
    from concurrent.futures import ThreadPoolExecutor

    from canaries.progress import Prefixed, progress_for
    from canaries.report.atomic import write_atomic
    from canaries.runner import RunInterrupted, run_many
    from canaries.runtime.local import PRELOAD
    from canaries.runtime.safety import SignalLatch
    from canaries.runtime.warm import close_fork_server, prestart, register_patched_python
    from canaries.sglang.runtime import prestart_parent

    if runtime not in ("local", "sglang-server"):
        raise ReleaseError(f"runtime {runtime!r}: local or sglang-server")
    server = runtime == "sglang-server"
    labels = [r.label for r in releases]
    for name, value in (("--last", last), ("--candidate", candidate)):
        if value is not None and value not in labels:
            raise ReleaseError(f"{name} {value}: not one of the columns ({', '.join(labels)})")
    report_dir = Path(report_dir)
    made_report_dir = not report_dir.exists()
    report_dir.mkdir(parents=True, exist_ok=True)
    # What each column is, fingerprinted before anything runs (a wheel or tree changed during
    # the run would not match the report).
    provenance = {spec.label: spec.provenance() for spec in releases}
    # Venvs first: a release that cannot be had fails the run before anything runs (and leaves
    # no empty report directory behind).
    pythons: dict[SGLangSource, Path] = {}
    try:
        for spec in releases:
            if spec.base not in pythons:
                pythons[spec.base] = release_python(spec.base, build=build, log=log, server=server,
                                                    build_log=report_dir / f"venv-{file_label(spec.base.label)}.log")
    except BaseException:
        if made_report_dir and not any(report_dir.iterdir()):
            report_dir.rmdir()
        raise
    with tempfile.TemporaryDirectory(prefix="canary-matrix-") as scratch:
        interpreters: dict[str, tuple[Path, str]] = {}
        for spec in releases:
            python, diff = pythons[spec.base], ""
            if spec.patches or spec.diffs:
                workdir = Path(scratch) / file_label(spec.label)
                python, diff = patched_interpreter(python, spec.version, spec.patches, workdir, spec.diffs)
                # Its warm parent: a fork of the base's with the patch loaded in place.
                register_patched_python(python, pythons[spec.base], workdir / "site")
                write_atomic(report_dir / f"patch-{file_label(spec.label)}.diff", diff.encode())
            version = engine_sglang_version(str(python))
            if not same_version(version, spec.version):
                raise ReleaseError(f"release {spec.label}: {python} has sglang {version}")
            interpreters[spec.label] = (python, diff)
        # Whose answers judge each server column: never the code under test. The candidate's are
        # held to the last release's clean server, any other column's to its own plain server.
        references = {label: _reference(label, str(python), last, candidate, interpreters)
                      for label, (python, _) in interpreters.items()} if server else {}
        # Each release's warm fork server imports torch and sglang (seconds; a server's parent,
        # SGLang's server modules too): each starts as the column before it in the queue starts,
        # so that its imports overlap the columns running, and no parent waits long before its
        # column (a patched column's is a fork of its base's). Newest releases first: older ones
        # refuse more configurations here and finish sooner, so the last columns to start are the
        # short ones (no long tail on one column).
        newest = sorted(releases, key=lambda spec: version_key(spec.version), reverse=True)
        order = ["native", *(spec.label for spec in newest)]

        def prestart_column(index: int) -> None:
            if 0 < index < len(order):
                python = interpreters[order[index]][0]
                if server:
                    prestart_parent(python)
                else:
                    prestart(str(python), None, PRELOAD["sglang"])

        for index in range(1, columns_at_once + 1):
            prestart_column(index)
        started = time.monotonic()
        log(f"matrix: {len(scenarios)} scenarios x (native + {', '.join(labels)}), "
            f"{columns_at_once} column(s) at once, {jobs} scenario(s) each")
        cache = NativeCache() if reuse_native else None
        kept = cache.kept(scenarios) if cache is not None else {}
        shown = progress_for(len(scenarios) * (len(releases) + 1) - len(kept), jobs * columns_at_once) \
            if progress else None
        native_cached = 0

        def column(label: str, selection: Sequence[Any] = scenarios, into: str = "") -> tuple[list, float]:
            nonlocal native_cached
            python = None if label == "native" else str(interpreters[label][0])
            sglang_side = {"runtime": runtime} if server else {"memory": "sglang"}
            if server and python is not None:
                sglang_side["reference"] = references[label]
            prestart_column(order.index(label) + columns_at_once)  # queued `columns_at_once` behind it
            t0 = time.monotonic()

            def run(selected: Sequence[Any], into_dir: Path) -> list:
                return run_many(selected, into_dir, jobs=jobs, latch=latch,
                                progress=Prefixed(f"[{label}{into and ' ' + into}]", shown) if shown else False,
                                **({} if python is None else {**sglang_side, "engine_python": python}))

            try:
                if python is None:
                    records, native_cached = run_native(selection, report_dir / "runs" / "native", run, cache,
                                                        kept, log)
                else:
                    records = run(selection, report_dir / "runs" / file_label(label) / into)
            finally:
                if python is not None:
                    close_fork_server(python)
            return records, time.monotonic() - t0

        def rerun(label: str) -> Callable[[Sequence[str], int], dict[str, Any]]:
            def again(names: Sequence[str], attempt: int) -> dict[str, Any]:
                chosen = [sc for sc in scenarios if sc.name in names]
                return {r.scenario: r for r in column(label, chosen, f"rerun-{attempt}")[0]}

            return again

        confirmations: dict[str, Confirmation] = {}
        with SignalLatch() as latch, (shown or contextlib.nullcontext()), \
                ThreadPoolExecutor(max_workers=max(1, columns_at_once), thread_name_prefix="matrix") as pool:
            runs = {label: pool.submit(column, label) for label in order}
            done, interrupted = _collect(runs, latch)
            if interrupted is None and last and candidate and reruns > 0:
                first = {label: {r.scenario: r for r in done[label][0]} for label in (last, candidate)}
                suspects = gate(last, candidate, _cells_of(_columns(releases, done, interpreters, provenance, references),
                                                           done, report_dir, runtime)).regressions
                if suspects:
                    log(f"matrix: confirming {len(suspects)} suspect(s) with {reruns} rerun(s) on {last} and "
                        f"{candidate}: {', '.join(suspects)}")
                try:
                    confirmations = confirm(suspects, first[last], first[candidate], reruns,
                                            rerun_after=rerun(candidate), rerun_before=rerun(last))
                except RunInterrupted as exc:
                    interrupted = exc
        wall_seconds = time.monotonic() - started
    columns = _columns(releases, done, interpreters, provenance, references)
    result = _judge(columns, {label: records for label, (records, _) in done.items()}, done["native"][1],
                    report_dir, wall_seconds, runtime, last, candidate, confirmations, flaky, native_cached)
    if interrupted is not None:
        raise RunInterrupted(interrupted.signum, [], interrupted.interruption) from interrupted
    return result


def _collect(runs: dict[str, Future], latch: Any) -> tuple[dict[str, tuple[list, float]], Any]:
    """Each column's (records, seconds) as the columns finish, the main thread polling so that a
    signal is seen at once (a wait on one future would hold it off until that column ends): on
    one, every column stops (`cancel_all`) and keeps what it ran. The RunInterrupted of the first
    column that stopped, or None."""
    from canaries.runner import POLL_S, RunInterrupted, cancel_all

    pending, cancelled = set(runs.values()), False
    while pending:
        _, pending = wait(pending, timeout=POLL_S)
        if latch.tripped and not cancelled:
            cancel_all()
            cancelled = True
    done, interrupted = {}, None
    for label, future in runs.items():
        try:
            done[label] = future.result()
        except RunInterrupted as exc:
            done[label] = (exc.records, 0.0)
            interrupted = interrupted or exc
    return done, interrupted


def _columns(releases: Sequence[ReleaseSpec], done: dict[str, tuple[list, float]],
             interpreters: dict[str, tuple[Path, str]], provenance: dict[str, dict],
             references: dict[str, Any]) -> list[Column]:
    columns = []
    for spec in releases:
        records, seconds = done[spec.label]
        python, diff = interpreters[spec.label]
        columns.append(Column(spec.label, spec.version, str(python), seconds, spec.patches, diff,
                              _memory_parts(records), provenance[spec.label],
                              oracle=references[spec.label].describe() if spec.label in references else ""))
    return columns


def _reference(label: str, python: str, last: str | None, candidate: str | None,
               interpreters: dict[str, tuple[Path, str]]) -> Any:
    """The `ServerReference` of a server column (see `run_matrix`)."""
    from canaries.sglang.oracle import ServerReference

    if label == candidate and last is not None and last != candidate:
        return ServerReference(str(interpreters[last][0]), last, plain=False)
    return ServerReference.of_release(python, label)


def _cells_of(columns: list[Column], done: dict[str, Any], report_dir: Path,
              runtime: str) -> dict[str, dict[str, Cell]]:
    """Every column's cells against the native run and its release's known divergences
    (`done`: label -> records, or (records, seconds))."""
    from canaries.sglang.server.log_events import SERVER_DETECTORS

    server = runtime == "sglang-server"
    records = {label: value[0] if isinstance(value, tuple) else value for label, value in done.items()}
    native = records["native"]
    cells: dict[str, dict[str, Cell]] = {
        r.scenario: {"native": Cell(r.verdict, detectors_of(r), r.passed, "native")} for r in native}
    for column in columns:
        # A patched or diffed column is held to its base's divergences: the change is what is judged.
        known = known_divergences(column.version, SERVER_PARITY_DIR if server else PARITY_DIR)
        for name, cell in _cells(native, records[column.label], known.entries,
                                 report_dir / "runs" / file_label(column.label),
                                 SERVER_DETECTORS if server else None).items():
            cells.setdefault(name, {})[column.label] = cell
    return cells


def _judge(columns: list[Column], done: dict[str, Sequence[Any]], native_seconds: float, report_dir: Path,
           wall_seconds: float, runtime: str, last: str | None, candidate: str | None,
           confirmations: dict[str, Confirmation] | None = None, flaky: str = "warn",
           native_cached: int = 0) -> MatrixResult:
    """Every column's cells against the native run and its release's known divergences, the gate
    (with the reruns' `confirmations`), and the three reports written into `report_dir`."""
    from canaries.report.atomic import write_atomic
    from canaries.sglang.matrix_html import matrix_html

    server = runtime == "sglang-server"
    judged = [replace(column, divergences=known_divergences(
        column.version, SERVER_PARITY_DIR if server else PARITY_DIR).describe()) for column in columns]
    cells = _cells_of(columns, done, report_dir, runtime)
    verdict = gate(last, candidate, cells, confirmations, flaky) if last and candidate else None
    result = MatrixResult(judged, native_seconds, cells, verdict, report_dir, wall_seconds, runtime, native_cached)
    write_atomic(report_dir / "matrix.md", result.to_markdown().encode())
    write_atomic(report_dir / "matrix.json", json.dumps(result.to_dict(), indent=2).encode() + b"\n")
    write_atomic(report_dir / "matrix.html", matrix_html(result).encode())
    return result


def _records(path: Path) -> list[Any]:
    """A column's kept verdicts (`runs/<column>/verdicts.jsonl`) as the records the cells read."""
    from types import SimpleNamespace

    if not path.is_file():
        raise ValueError(f"{path}: no such file (not a matrix report, or that column never ran)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [SimpleNamespace(**{"firings": [], "latency": {}, "reason": "", "passed": False, "extra": {}, **r})
            for r in rows if "scenario" in r and "verdict" in r]


def rejudge_matrix(report_dir: str | Path) -> MatrixResult:
    """Judge a kept matrix report again against today's known divergences (configs/parity/):
    its columns, runtime and gate are its matrix.json's, its verdicts each column's kept run;
    nothing reruns. The reports are rewritten. ValueError for a directory that is no matrix report."""
    report_dir = Path(report_dir)
    try:
        doc = json.loads((report_dir / "matrix.json").read_text(encoding="utf-8"))
        columns = [Column(**{**c, "patches": tuple(c.get("patches") or ())}) for c in doc["columns"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{report_dir}: not a matrix report ({exc})") from None
    done = {label: _records(report_dir / "runs" / file_label(label) / "verdicts.jsonl")
            for label in ["native", *(c.label for c in columns)]}
    gate_doc = doc.get("gate") or {}
    confirmations = {name: confirmation_from_dict(c) for name, c in (gate_doc.get("confirmations") or {}).items()}
    return _judge(columns, done, float(doc.get("native_seconds", 0.0)), report_dir,
                  float(doc.get("wall_seconds", 0.0)), doc.get("runtime", "local"),
                  gate_doc.get("last"), gate_doc.get("candidate"), confirmations,
                  "fail" if gate_doc.get("flaky_fails") else "warn", int(doc.get("native_cached", 0)))
