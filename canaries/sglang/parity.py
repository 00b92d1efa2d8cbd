"""`canary parity`: the same scenarios on our copy of the memory path and on SGLang's own.

Runs the selection twice, `memory: native` and `memory: sglang` (the engine under an interpreter
that has sglang), and compares each scenario's verdict, detectors and detection latency. Every
difference must be a known divergence of that SGLang version, recorded with its reason in
`configs/parity/sglang-<version>.yaml` (or inherited: canaries/sglang/divergences.py; the recorded
verdict must be the one seen): anything else is unexplained and fails the run. Writes `parity.md`
and `parity.json` beside the two runs.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from canaries.sglang.divergences import PARITY_DIR, known_divergences

SERVER_PARITY_DIR = PARITY_DIR / "server"  # the real server's known divergences, release by release
UNSUPPORTED_NOTE = "unsupported"  # a run dir's note: why the runtime could not run the scenario

__all__ = ["PARITY_DIR", "SERVER_PARITY_DIR", "UNSUPPORTED_NOTE", "ParityResult", "judge_parity", "rejudge", "ParityRow", "detectors_of", "expectations_path", "load_expectations",
           "harness_failed", "lost_sglang_hits", "recorded_verdicts", "refused_reason", "run_parity", "unsupported_reason"]


@dataclass(frozen=True)
class ParityRow:
    scenario: str
    native: str
    sglang: str
    native_detectors: tuple[str, ...]
    sglang_detectors: tuple[str, ...]
    native_latency: int | None
    sglang_latency: int | None
    status: str  # same | known | unexplained | unsupported | harness (the harness failed a side)
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParityResult:
    version: str
    rows: list[ParityRow]
    native_failures: list[str]
    report_dir: Path
    divergences: str = ""  # which configs/parity/ file(s) the known divergences came from
    side: str = "memory path"  # what of SGLang ran: its memory path under our scheduler, or its server

    @property
    def unexplained(self) -> list[ParityRow]:
        return [r for r in self.rows if r.status == "unexplained"]

    @property
    def ok(self) -> bool:
        return not self.unexplained and not self.native_failures

    def to_markdown(self) -> str:
        lines = [f"# Parity: native vs SGLang {self.version} ({self.side})", "",
                 *([f"Known divergences: {self.divergences}", ""] if self.divergences else []),
                 "| scenario | native | sglang | detectors (native / sglang) | latency | status |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows:
            dets = f"{', '.join(r.native_detectors) or '-'} / {', '.join(r.sglang_detectors) or '-'}"
            lat = f"{r.native_latency if r.native_latency is not None else '-'} / " \
                  f"{r.sglang_latency if r.sglang_latency is not None else '-'}"
            status = r.status + (f": {r.reason}" if r.reason else "")
            lines.append(f"| {r.scenario} | {r.native} | {r.sglang} | {dets} | {lat} | {status} |")
        same = sum(r.status == "same" for r in self.rows)
        known = sum(r.status == "known" for r in self.rows)
        unsupported = sum(r.status == "unsupported" for r in self.rows)
        harness = [r.scenario for r in self.rows if r.status == "harness"]
        lines += ["", f"{same} same, {known} known divergences, {len(self.unexplained)} unexplained"
                  + (f", {unsupported} unsupported by this release here" if unsupported else "")
                  + (f", {len(harness)} not compared: the harness failed a side (cause: harness): "
                     f"{', '.join(harness)}" if harness else "")]
        if self.native_failures:
            lines.append(f"native failures (fix them first): {', '.join(self.native_failures)}")
        return "\n".join(lines) + "\n"


def expectations_path(version: str, parity_dir: Path = PARITY_DIR) -> Path:
    """Where SGLang `version`'s own parity file is (it may not exist: see load_expectations)."""
    return parity_dir / f"sglang-{version}.yaml"


def load_expectations(version: str, parity_dir: Path = PARITY_DIR) -> dict[str, dict]:
    """Known divergences of SGLang `version`: scenario -> {verdict, reason}, its own file's and
    what that inherits, or the nearest older release's (canaries/sglang/divergences.py); the files
    they came from: `known_divergences(version).files`."""
    return known_divergences(version, parity_dir).entries


def engine_sglang_version(engine_python: str) -> str:
    proc = subprocess.run([engine_python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine_python} has no sglang: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip()


_SGLANG_HIT_RE = re.compile(r"invariant-check \[([^@\]]+)@rank\d+\]: \+\d+ hit\(s\), (\d+) total")


def lost_sglang_hits(run_dir: Path) -> str:
    """What SGLang's own log says it counted that the engine never reported, or "".

    SGLang logs `invariant-check [name@rankN]: +k hit(s), T total` on an invariant's first hit
    and on a cadence after; every such total must be matched by the run's firings of `name`.
    """
    log, events = run_dir / "engine.log", run_dir / "events.jsonl"
    if not log.is_file():
        return ""
    logged: dict[str, int] = {}
    for match in _SGLANG_HIT_RE.finditer(log.read_text(encoding="utf-8", errors="replace")):
        logged[match.group(1)] = max(logged.get(match.group(1), 0), int(match.group(2)))
    if not logged:
        return ""
    fired: dict[str, int] = {}
    if events.is_file():
        for line in events.read_text(encoding="utf-8").splitlines():
            if '"invariant_firing"' in line:
                event = json.loads(line)
                fired[event["invariant"]] = max(fired.get(event["invariant"], 0), int(event["total_hits"]))
    lost = [f"{name} (SGLang logged {total}, the engine reported {fired.get(name, 0)})"
            for name, total in sorted(logged.items()) if fired.get(name, 0) < total]
    return "hits lost: " + "; ".join(lost) if lost else ""


_UNSUPPORTED_RE = re.compile(r"ReleaseUnsupported: (.+)")


def unsupported_reason(run_dir: Path) -> str:
    """Why the release refused this scenario's engine here (its engine log says so, or the
    sglang-server runtime's `unsupported` note), or ""."""
    note = run_dir / UNSUPPORTED_NOTE
    if note.is_file():
        return note.read_text(encoding="utf-8", errors="replace").strip()
    log = run_dir / "engine.log"
    if not log.is_file():
        return ""
    match = _UNSUPPORTED_RE.search(log.read_text(encoding="utf-8", errors="replace"))
    return match.group(1).strip() if match else ""


def recorded_verdicts(entry: dict) -> tuple[str, ...]:
    """The verdicts a known divergence allows: one, or a list where the run's timing decides
    between them (SGLang's server batches requests as they arrive)."""
    verdict = entry.get("verdict")
    return tuple(verdict) if isinstance(verdict, list) else (verdict,)


def refused_reason(record: Any) -> str:
    """A runtime's refusal of the scenario (`ServerUnsupported: why` in its reason), or ""."""
    _, found, why = str(record.reason).partition("ServerUnsupported: ")
    return why.strip() if found else ""


def detectors_of(record: Any) -> tuple[str, ...]:
    return tuple(sorted({f.get("detector") or f.get("name") for f in (record.firings or [])
                         if isinstance(f, dict)} - {None}))


def _first_latency(record: Any) -> int | None:
    values = [v for v in (record.latency or {}).values() if isinstance(v, int)]
    return min(values) if values else None


def harness_failed(record: Any) -> bool:
    """Whether the harness, not the engine, left this record without a verdict (`cause: harness`):
    such a cell is kept apart from the release's verdicts (never same, known or unexplained)."""
    cause = getattr(record, "cause", None)
    if cause is None and isinstance(getattr(record, "extra", None), dict):
        cause = record.extra.get("cause")
    return cause == "harness"


def compare(native: list[Any], sglang: list[Any], expected: dict[str, dict],
            lost: dict[str, str] | None = None, unsupported: dict[str, str] | None = None,
            comparable: frozenset[str] | None = None,
            native_unsupported: dict[str, str] | None = None) -> list[ParityRow]:
    """One row per scenario; `lost` (scenario -> `lost_sglang_hits`) makes a row unexplained
    whatever its verdict: a hit SGLang counted and the engine never reported; `unsupported`
    (scenario -> `unsupported_reason`) makes an INCONCLUSIVE row `unsupported`: the release
    cannot run that configuration here; a side the harness failed (`harness_failed`) makes the
    row `harness`, no comparison. `comparable`: the detectors both sides can report (the
    server's set); None: all of them. `native_unsupported`: the same for our side (a scenario
    only SGLang's server can run: its own knobs)."""
    def compared(record: Any) -> tuple[str, ...]:
        found = detectors_of(record)
        return found if comparable is None else tuple(d for d in found if d in comparable)

    by_name = {r.scenario: r for r in sglang}
    rows = []
    for n in native:
        s = by_name.get(n.scenario)
        if s is None:
            continue
        same = (n.verdict, compared(n)) == (s.verdict, compared(s))
        known = expected.get(n.scenario)
        if (lost or {}).get(n.scenario):
            status, reason = "unexplained", lost[n.scenario]
        elif n.verdict == "INCONCLUSIVE" and (native_unsupported or {}).get(n.scenario):
            status, reason = "unsupported", f"ours: {native_unsupported[n.scenario]}"
        elif s.verdict == "INCONCLUSIVE" and (unsupported or {}).get(n.scenario):
            status, reason = "unsupported", unsupported[n.scenario]
        elif failed := next((r for r in (n, s) if harness_failed(r)), None):
            status, reason = "harness", f"{'ours' if failed is n else 'sglang'}: {failed.reason}"
        elif same:
            status, reason = "same", ""
        elif known and s.verdict in recorded_verdicts(known):
            status, reason = "known", str(known["reason"]).strip()
        else:
            status = "unexplained"
            reason = (f"recorded as {' or '.join(recorded_verdicts(known))}, got {s.verdict}" if known else "")
        rows.append(ParityRow(n.scenario, n.verdict, s.verdict, detectors_of(n), detectors_of(s),
                              _first_latency(n), _first_latency(s), status, reason))
    return rows


def run_parity(scenarios: list[Any], report_dir: str | Path, engine_python: str, *, jobs: int = 1,
               memory: str = "sglang", runtime: str = "local", device: str | None = None) -> ParityResult:
    """Run `scenarios` on both sides into `report_dir/{native,sglang}`; the comparison.

    `memory`: SGLang's side, `sglang` (every part the release has; what configs/parity/
    records) or `sglang-allocator` (its allocator under our tree and row table).
    `runtime="sglang-server"`: SGLang's side is its real server (`engine_python` the server
    venv's interpreter), held to configs/parity/server/. `device`: SGLang's side's (ours runs
    where the harness is: its verdicts are the same on either)."""
    from canaries.runner import run_many

    report_dir = Path(report_dir)
    version = engine_sglang_version(engine_python)
    native = run_many(scenarios, report_dir / "native", jobs=jobs, progress=False)
    if runtime == "sglang-server":
        sglang = run_many(scenarios, report_dir / "sglang", jobs=jobs, progress=False, runtime=runtime,
                          engine_python=engine_python, device=device)
    else:
        sglang = run_many(scenarios, report_dir / "sglang", jobs=jobs, progress=False, memory=memory,
                          engine_python=engine_python, device=device)
    return judge_parity(report_dir, version, native, sglang, runtime)


def judge_parity(report_dir: Path, version: str, native: list[Any], sglang: list[Any],
                 runtime: str = "local") -> ParityResult:
    """Compare the two sides' records (run now, or read back by `rejudge`) against the known
    divergences; write parity.md and parity.json into `report_dir`."""
    from canaries.report.atomic import write_atomic

    lost = {r.scenario: lost_sglang_hits(report_dir / "sglang" / r.scenario) for r in sglang}
    unsupported = {r.scenario: unsupported_reason(report_dir / "sglang" / r.scenario) or refused_reason(r)
                   for r in sglang}
    known = known_divergences(version, SERVER_PARITY_DIR if runtime == "sglang-server" else PARITY_DIR)
    comparable = None
    if runtime == "sglang-server":
        from canaries.sglang.server.log_events import SERVER_DETECTORS

        comparable = SERVER_DETECTORS
    native_unsupported = {r.scenario: unsupported_reason(report_dir / "native" / r.scenario) for r in native}
    rows = compare(native, sglang, known.entries, lost, unsupported, comparable, native_unsupported)
    result = ParityResult(version, rows,
                          [r.scenario for r in native if not r.passed and not native_unsupported[r.scenario]],
                          report_dir,
                          known.describe(), "server" if runtime == "sglang-server" else "memory path")
    write_atomic(report_dir / "parity.md", result.to_markdown().encode())
    write_atomic(report_dir / "parity.json", json.dumps(
        {"sglang_version": version, "runtime": runtime, "divergences": known.describe(),
         "divergence_files": [str(f) for f in known.files], "rows": [r.to_dict() for r in rows],
         "native_failures": result.native_failures, "ok": result.ok}, indent=2).encode() + b"\n")
    return result


def rejudge(report_dir: str | Path, engine_python: str | None = None, runtime: str | None = None) -> ParityResult:
    """Judge an existing parity report again (its runs are kept: after a known-divergence file
    changed, nothing reruns). The release and runtime are the report's (parity.json), else
    `engine_python`'s release and `runtime` (default local)."""
    from types import SimpleNamespace

    report_dir = Path(report_dir)
    sides = []
    for side in ("native", "sglang"):
        path = report_dir / side / "verdicts.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: no such file (not a parity report, or its {side} run never started)")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        sides.append([SimpleNamespace(**{"firings": [], "latency": {}, "reason": "", "passed": False, **r})
                      for r in rows if "scenario" in r and "verdict" in r])
    previous = report_dir / "parity.json"
    before = json.loads(previous.read_text(encoding="utf-8")) if previous.is_file() else {}
    version, runtime = before.get("sglang_version"), runtime or before.get("runtime") or "local"
    if version is None:
        if engine_python is None:
            raise ValueError(f"{report_dir}: no parity.json to name the release: give --engine-python")
        version = engine_sglang_version(engine_python)
    return judge_parity(report_dir, version, *sides, runtime)
