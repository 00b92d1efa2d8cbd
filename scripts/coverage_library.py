"""Branch coverage of the engine's memory path (engine_stub/mem/, the scheduler's memory calls)
under the canary library.

Runs `canary run --jobs J` with coverage.py in every engine process, combines the data, and
prints the branch coverage of each mem/ module and of the scheduler's memory functions, the
uncovered branches (file:line->line, with the reason where one is known), and the code the engine
never runs, which is reported apart from the figure instead of silently excluded. Exits 1 when
the mem/ figure is under --fail-under, or when the library itself did not pass.

How the engines are measured: `COVERAGE_PROCESS_START` names pyproject.toml, whose
`[tool.coverage.run]` has `patch = ["subprocess", "fork", "_exit"]`. Every Python process the run
starts (the harness, its fork server, a `--start fresh` engine) starts coverage from the .pth file
coverage installs; `fork` restarts it in each engine the fork server forks; `_exit` saves the data
before an engine ends in os._exit (as every engine does, a crash included). `parallel = true`
gives each process a data file of its own, combined here.

    python scripts/coverage_library.py                       # the library (configs/scenarios)
    python scripts/coverage_library.py configs/scenarios/clean-pressure-swa-tombstone.yaml \\
        --show SWARadixCache.evict --fail-under 0              # one scenario, one function's arcs
    python scripts/coverage_library.py --data DIR --no-run    # re-report a kept run's data

What the figure leaves out, each listed in the output with its reason:
- engine_stub/mem/sglang_backend.py: the `memory: sglang` adapter, which needs an sglang venv
  (`canary parity` measures that side, not the library);
- `NOT_RUN`: code the engine never executes, whatever the workload or damage: classes and
  functions it never calls (PureSWATokenToKVPoolAllocator, the tree's `reset`, the sub-allocators'
  public `free` and paged `alloc`), values it never passes (`need_sort=True`, non-int64 indices,
  several requests or an unaligned prefix in one `alloc_extend`), and limits it never reaches;
- guards that only raise (argument validation, "cannot happen" checks): an uncovered branch whose
  target is a `raise`.
A NOT_RUN branch that did run is counted in the figure and flagged: the rule is wrong.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
MEM = "engine_stub/mem/"
SCHEDULER = "engine_stub/scheduler.py"
EXCLUDED_FILES = {
    "engine_stub/mem/sglang_backend.py": "the memory: sglang adapter; needs an sglang venv "
                                         "(scripts/make-sglang-venv.sh), never run by the library",
}
# The scheduler's memory calls (what cosmic-ray's automatic mutants target too).
SCHEDULER_FUNCTIONS = ("_admit", "_alloc_extend", "_evict_tree", "_schedule_decode", "_alloc_decode",
                       "_evict_windows", "_finish", "_release_kv", "_drop_aborted", "_free_group")


@dataclass(frozen=True)
class Rule:
    """Branches of `function` (a qualname in `file`; "Class.*": every method) from a line
    containing `line` (None: every branch of the function; a trailing "$": the line ends with it)
    going `way` ("true": into the body, "false": past it, "any")."""

    file: str
    function: str
    line: str | None
    way: str
    reason: str


def _rules(file: str, function: str, *specs: tuple[str | None, str], reason: str) -> list[Rule]:
    return [Rule(file, function, line, way, reason) for line, way in specs]


A, R, S, Q = (f"engine_stub/mem/{n}.py" for n in ("allocator", "radix", "swa", "req_to_token"))
NEED_SORT = "need_sort=True: the scheduler always builds the allocator with need_sort=False (SGLang's value outside PD disaggregation)"
INT64 = "a non-int64 index: every engine caller passes int64 (the tree's values, slots read with .to(torch.int64))"

# Code the engine never executes, whatever the workload or damage (reported, not in the figure).
NOT_RUN: list[Rule] = [
    Rule(S, "PureSWATokenToKVPoolAllocator.*", None, "any",
         "the engine never builds it: every config has a full pool, and the radix cache edits the "
         "mapping, which it refuses (docs/architecture.md, 'Not taken')"),
    *_rules(S, "SWATokenToKVPoolAllocator.__init__", ("if kvcache is not None", "false"),
            reason="the scheduler always passes its KV pool"),
    *_rules(S, "SWATokenToKVPoolAllocator.alloc", ("if self.page_size == 1", "false"),
            reason="the engine's paged path is alloc_extend/alloc_decode; alloc is page_size 1 only"),
    *_rules(S, "SWATokenToKVPoolAllocator.set_full_to_swa_mapping", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(S, "SWATokenToKVPoolAllocator.clear_full_to_swa_mapping", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(S, "SWATokenToKVPoolAllocator.free", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(S, "SWATokenToKVPoolAllocator.free_swa", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(S, "SWATokenToKVPoolAllocator.free_full", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(S, "SWATokenToKVPoolAllocator.free_swa", ("if group is not None", "false"),
            reason="every engine call is inside a free group: window eviction, the tree's SWA phase "
                   "(in _evict_tree's group), and free, which calls it only inside one"),
    *_rules(A, "_host_ints", ("if not values", "true"),
            reason="callers pass one entry per run or request, never none"),
    *_rules(A, "BaseTokenToKVPoolAllocator.merge_and_sort_free", ("if self.release_pages", "true"), reason=NEED_SORT),
    *_rules(A, "BaseTokenToKVPoolAllocator._ready", ("if self.need_sort", "true"),
            ("if count > self._free_count:$", "any"), reason=NEED_SORT),
    *_rules(A, "BaseTokenToKVPoolAllocator._give_back", ("if self.need_sort", "true"),
            ("if at_head", "false"), ("if may_hold_holes", "true"),
            reason="its one caller (the paged free) passes at_head=True, may_hold_holes=False, and "
                   "need_sort is never True"),
    *_rules(A, "TokenToKVPoolAllocator._free", ("if self.need_sort", "true"), reason=NEED_SORT),
    *_rules(A, "TokenToKVPoolAllocator._free", ("if low < _OFFER_FLOOR", "true"),
            reason="the offers start over after 2**62 freed entries"),
    *_rules(A, "TokenToKVPoolAllocator._free", ("_FOLD_EVERY", "true"),
            reason="the step's read-back folds the pending frees; a step makes a handful per "
                   "sub-allocator (one per free group), never 64"),
    *_rules(A, "BaseTokenToKVPoolAllocator._keep_pending", ("_FOLD_EVERY", "true"),
            reason="the step's read-back folds the pending frees; a step makes a handful per "
                   "sub-allocator (one per free group), never 64"),
    *_rules(A, "BaseTokenToKVPoolAllocator._fold", ("if checked in (0, len(pending))", "false"),
            reason="the check level changes between two frees only in tests; the engine sets it once"),
    *_rules(A, "BaseTokenToKVPoolAllocator._take_pages", ("if not self._ready(count)", "true"),
            reason="every caller asked _ready/new_pages_available first"),
    Rule(A, "BaseTokenToKVPoolAllocator.free", None, "any",
         "the public sub-allocator free: the hybrid allocator frees its sides through _free "
         "(PureSWATokenToKVPoolAllocator and tests call it)"),
    Rule(A, "PagedTokenToKVPoolAllocator.alloc", None, "any",
         "the engine's paged path is alloc_extend/alloc_decode (SWATokenToKVPoolAllocator.alloc "
         "uses it for page_size > 1 only)"),
    *_rules(A, "PagedTokenToKVPoolAllocator.alloc_extend", ("if carried > 0", "true"),
            ("if fresh > 0", "false"), ("if pages is None", "true"),
            ("if not carried_runs and run_sources == run_starts", "false"), ("if carried_runs", "any"),
            ("for run in carried_runs", "any"), ("dtype != torch.int64", "any"),
            ("for start, end, first in zip", "any"),
            reason="the scheduler extends one request per call from a page-aligned prefix (the "
                   "tree matches whole pages), after new_pages_available: no carried partial page, "
                   "always the fast path"),
    *_rules(A, "PagedTokenToKVPoolAllocator.alloc_decode", ("if pages is None", "true"),
            reason="the hybrid alloc_decode asked new_pages_available first"),
    *_rules(A, "PagedTokenToKVPoolAllocator.alloc_decode", ("dtype != torch.int64", "true"), reason=INT64),
    *_rules(R, "SWARadixCache.insert", ("if pos < prev_prefix_len", "true"),
            reason="defensive: a request's locked prefix always ends on a node boundary (the match "
                   "splits there, nodes never merge, locked nodes are never deleted)"),
    *_rules(R, "SWARadixCache._delete_leaf", (" " * 12 + "if freed is not None", "false"),
            reason="freed is None only for the cascade's parents, which are tombstones"),
    Rule(R, "SWARadixCache.reset", None, "any", "the engine never resets its tree"),
    *_rules(Q, "ReqToTokenPool.alloc", ("if req.row", "true"),
            reason="a request that keeps its row is a continuation (chunked prefill); the engine "
                   "admits each request once"),
    *_rules(Q, "ReqToTokenPool.alloc", ("if len(new) > len(self.free_slots)", "true"),
            reason="the scheduler checks available_size() before it admits"),
]

# Why an uncovered branch in the figure is not reached by the library (printed with it).
DECODE_STALL = ("only on a decode stall (a pool ran dry: slots leaked; at STRICT it crashes, below it the "
                "youngest request is aborted): a stall scenario at WARN reaches it")
DAMAGE = "a detector's failing path: only damage reaches it"
REASONS: list[Rule] = [
    *_rules(S, "SWATokenToKVPoolAllocator.free", ("if self.free_group is not None", "false"),
            ("if self.page_size == 1", "any"), ("if checks", "any"), ("dtype != torch.int64", "false"),
            reason=DECODE_STALL + " with the radix cache off (its release frees outside a free group; "
            "every other free of both sides runs inside one)"),
    *_rules(S, "SWATokenToKVPoolAllocator.free_swa", ("if free_index.numel() == 0", "true"),
            reason="callers free non-empty ranges (a perturbation's effect may not)"),
    *_rules(S, "SWATokenToKVPoolAllocator._release_swa_unreported", ("if side.available_size() > side.size", "true"),
            reason=DAMAGE + " (an SWA over-free: alloc.pool_bound)"),
    *_rules(S, "SWATokenToKVPoolAllocator._expect_within_bound", ("if not 0 <= fraction <= 1", "true"),
            reason=DAMAGE + " (an over-free: alloc.pool_bound)"),
    *_rules(S, "SWATokenToKVPoolAllocator.free_full", ("if self.free_group is None", "true"),
            reason=DECODE_STALL + " (the aborted request's release runs outside a free group)"),
    *_rules(S, "SWATokenToKVPoolAllocator.alloc_extend", ("if not self.new_pages_available", "true"),
            reason="admission's reservation check and its tree eviction leave the pages an extend "
                   "needs; only wrong accounting could fail it"),
    *_rules(S, "SWATokenToKVPoolAllocator.alloc_decode", ("if not self.new_pages_available", "true"),
            reason=DECODE_STALL + " on page_size > 1"),
    *_rules(S, "SWATokenToKVPoolAllocator.free_full", ("if checks", "false"),
            reason="invariant_check off with a free_full: a run with the checks off"),
    *_rules(S, "SWATokenToKVPoolAllocator._expand_to_full_pages", ("if page & (page - 1) == 0", "false"),
            reason="a page size that is not a power of two"),
    *_rules(A, "PagedTokenToKVPoolAllocator._shifted_pages", ("if page & (page - 1) == 0", "false"),
            reason="a page size that is not a power of two"),
    *_rules(A, "PagedTokenToKVPoolAllocator._free", ("if not checks", "true"),
            reason="invariant_check off on page_size > 1: a run with the checks off"),
    *_rules(A, "BaseTokenToKVPoolAllocator.free_pages", ("if not chunks", "true"),
            reason="the free list read while empty: hole dropping (damage) or a perturbation's view"),
    *_rules(A, "BaseTokenToKVPoolAllocator._give_back", ("elif n", "false"),
            reason=DAMAGE + " (a paged free in which every page was a bad free)"),
    *_rules(A, "BaseTokenToKVPoolAllocator._drop_holes", (None, "any"),
            reason=DAMAGE + " (a bad free's hole in the free list)"),
    *_rules(A, "BaseTokenToKVPoolAllocator.note_drop_totals", (None, "any"),
            reason=DAMAGE + " (a new bad-free drop)"),
    *_rules(R, "SWARadixCache._recover_tombstone", ("if node.full_lock_ref > 0", "true"),
            reason="a running request holds a tombstone's full KV (its match went through it) while "
                   "another, whose own copy of those tokens is still live, finishes: with the "
                   "driver's workloads (one shared prefix, one max_new_tokens) the finisher's window "
                   "has always slid past the tombstone; needs continuation prompts or mixed "
                   "max_new_tokens (see the note in configs/scenarios/clean-pressure-tombstone-hits.yaml)"),
    *_rules(S, "SWATokenToKVPoolAllocator.set_full_to_swa_mapping", ("dtype != torch.int64", "false"),
            reason="only the locked tombstone recovery re-pairs a mapping"),
    *_rules(S, "SWATokenToKVPoolAllocator.clear_full_to_swa_mapping", ("dtype != torch.int64", "false"),
            reason="only the locked tombstone recovery clears a mapping"),
    *_rules(R, "SWARadixCache.evict", ("if leaf is None", "true"),
            reason="the full phase runs out of unlocked leaves: admission reserved the room, so "
                   + DECODE_STALL),
    *_rules(R, "SWARadixCache.sanity_check", (None, "true"), reason=DAMAGE + " (the idle check's tree audit)"),
    *_rules(R, "SWARadixCache._lru_problems", (None, "true"), reason=DAMAGE + " (the idle check's LRU audit)"),
    *_rules(SCHEDULER, "Scheduler._drop_aborted", (None, "any"),
            reason="a client that hung up: the driver waits for every answer"),
    *_rules(SCHEDULER, "Scheduler._schedule_decode", ("if not reqs", "true"),
            reason="decode with nothing running: waiting requests that cannot be admitted into an "
                   "idle engine are refused at submit"),
    *_rules(SCHEDULER, "Scheduler._schedule_decode", ("if self.reach is not None", "false"),
            reason=DECODE_STALL + " without a scenario (every canary run loads one)"),
    *_rules(SCHEDULER, "Scheduler._admit", ("if slots is None", "true"), ("if lock is not None", "any"),
            reason="an allocation failing after the reservation check passed and the tree was "
                   "evicted for it"),
    *_rules(SCHEDULER, "Scheduler._finish", ("if req.on_finish is not None", "false"),
            reason="the engine gives every request an on_finish"),
]


# ---- running the library ---------------------------------------------------------------------


def run_library(data: Path, paths: list[str], k: str | None, jobs: int, start: str | None) -> int:
    env = dict(os.environ)
    env["COVERAGE_PROCESS_START"] = str(CONFIG)
    env["COVERAGE_FILE"] = str(data / ".coverage")
    cmd = [sys.executable, "-m", "canaries.cli", "run", "--jobs", str(jobs), *paths]
    if k:
        cmd += ["-k", k]
    if start:
        cmd += ["--start", start]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = [ln for ln in lines if "passed" in ln or ln.startswith("report:")]
    print(f"canary run --jobs {jobs} {' '.join(paths)}{' -k ' + k if k else ''} under coverage: "
          f"exit {proc.returncode}, {time.perf_counter() - t0:.1f}s")
    for ln in summary[-2:]:
        print("  " + ln)
    if proc.returncode != 0:
        failed = [ln for ln in lines if any(v in ln for v in (
            "MISSED", "WRONG_DETECTOR", "LATE", "FALSE_ALARM", "NOT_INJECTED", "NOT_REACHED",
            "INCONCLUSIVE", "NOT_RUN"))]
        for ln in failed[:20]:
            print("  " + ln)
        if proc.stderr.strip():
            print("  " + proc.stderr.strip().splitlines()[-1])
    return proc.returncode


def combine(data: Path) -> dict:
    import coverage

    cov = coverage.Coverage(data_file=str(data / ".coverage"), config_file=str(CONFIG))
    parts = list(data.glob(".coverage.*"))
    if parts:
        cov.combine([str(data)], keep=False)
        cov.save()
    cov.load()
    out = data / "coverage.json"
    cov.json_report(outfile=str(out), include=[str(ROOT / "engine_stub" / "*")],
                    show_contexts=False)
    return json.loads(out.read_text())


# ---- branch bookkeeping ----------------------------------------------------------------------


class Source:
    """A file's lines, the qualname of each line's innermost function, and the lines a branch
    line's body starts on (its "true" way)."""

    def __init__(self, path: Path) -> None:
        self.text = path.read_text().splitlines()
        tree = ast.parse("\n".join(self.text))
        self.function_of: dict[int, str] = {}
        self.true_targets: dict[int, set[int]] = {}
        self._walk(tree, [])

    def _walk(self, node: ast.AST, names: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*names, child.name]
                if not isinstance(child, ast.ClassDef):
                    for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                        self.function_of[line] = ".".join(inner)
                self._walk(child, inner)
                continue
            if isinstance(child, (ast.If, ast.While, ast.For, ast.AsyncFor)) and child.body:
                self.true_targets.setdefault(child.lineno, set()).add(child.body[0].lineno)
            self._walk(child, names)

    def line(self, n: int) -> str:
        return self.text[n - 1] if 0 < n <= len(self.text) else ""

    def way(self, a: int, b: int) -> str:
        return "true" if b in self.true_targets.get(a, ()) else "false"

    def is_raise(self, b: int) -> bool:
        return b > 0 and self.line(b).strip().startswith("raise ")


def _matches(rule: Rule, rel: str, src: Source, a: int, b: int) -> bool:
    if rule.file != rel:
        return False
    fn = src.function_of.get(a, "")
    if rule.function.endswith(".*"):
        if not fn.startswith(rule.function[:-1]):
            return False
    elif fn != rule.function:
        return False
    if rule.line is not None:
        # A trailing "$": the line ends with the text (no comment after it).
        text, want = src.line(a).rstrip(), rule.line
        if not (text.endswith(want[:-1]) if want.endswith("$") else want in text):
            return False
    return rule.way == "any" or src.way(a, b) == rule.way


@dataclass
class Branch:
    file: str
    a: int
    b: int
    covered: bool
    function: str
    text: str
    way: str

    def where(self) -> str:
        dest = "exit" if self.b < 0 else str(self.b)
        return f"{self.file}:{self.a}->{dest}"


@dataclass
class Tally:
    covered: int = 0
    total: int = 0

    def add(self, br: Branch) -> None:
        self.total += 1
        self.covered += br.covered

    def pct(self) -> float:
        return 100.0 * self.covered / self.total if self.total else 100.0

    def __str__(self) -> str:
        return f"{self.covered:4d}/{self.total:<4d} {self.pct():6.1f}%"


def branches(report: dict) -> dict[str, list[Branch]]:
    out: dict[str, list[Branch]] = {}
    for path, entry in report["files"].items():
        rel = Path(path).resolve().relative_to(ROOT).as_posix() if Path(path).is_absolute() else path
        if not (rel.startswith(MEM) or rel == SCHEDULER):
            continue
        src = Source(ROOT / rel)
        rows = []
        for arcs, covered in ((entry["executed_branches"], True), (entry["missing_branches"], False)):
            for a, b in arcs:
                rows.append(Branch(rel, a, b, covered, src.function_of.get(a, ""), src.line(a).strip(),
                                   src.way(a, b)))
        out[rel] = sorted(rows, key=lambda r: (r.a, r.b))
        out[rel + "#src"] = src  # type: ignore[assignment]
    return out


def classify(rel: str, src: Source, br: Branch) -> tuple[str, str]:
    """(category, reason): "figure" (counted), "not_run", "raise" (both reported apart)."""
    for rule in NOT_RUN:
        if _matches(rule, rel, src, br.a, br.b):
            return ("figure", f"NOT_RUN rule says never run, yet it ran: {rule.reason}") if br.covered \
                else ("not_run", rule.reason)
    if not br.covered and src.is_raise(br.b):
        return "raise", "a guard that only raises"
    return "figure", ""


def _rule_of(rel: str, src: Source, br: Branch) -> str:
    return next(r.function for r in NOT_RUN if _matches(r, rel, src, br.a, br.b))


def reason_for(rel: str, src: Source, br: Branch) -> str:
    for rule in REASONS:
        if _matches(rule, rel, src, br.a, br.b):
            return rule.reason
    return "no reason recorded: a gap in the library"


# ---- the report ------------------------------------------------------------------------------


def report(data: dict, fail_under: float, show: list[str]) -> tuple[float, list[str]]:
    files = branches(data)
    stale: list[str] = []
    mem_total, mem_raw = Tally(), Tally()
    per_file: dict[str, tuple[Tally, Tally]] = {}
    uncovered: list[tuple[Branch, str]] = []
    sched_uncovered: list[tuple[Branch, str]] = []
    not_run: dict[str, list[Branch]] = {}
    raises: list[Branch] = []
    sched: dict[str, Tally] = {f"Scheduler.{n}": Tally() for n in SCHEDULER_FUNCTIONS}
    for rel in sorted(k for k in files if not k.endswith("#src")):
        src: Source = files[rel + "#src"]  # type: ignore[assignment]
        if rel == SCHEDULER:
            for br in files[rel]:
                if br.function in sched:
                    sched[br.function].add(br)
                    if not br.covered:
                        sched_uncovered.append((br, reason_for(rel, src, br)))
            continue
        if rel in EXCLUDED_FILES:
            continue
        raw, fig = Tally(), Tally()
        for br in files[rel]:
            raw.add(br)
            mem_raw.add(br)
            category, why = classify(rel, src, br)
            if category == "not_run":
                not_run.setdefault(f"{rel.removeprefix('engine_stub/')} {_rule_of(rel, src, br)}\n"
                                   f"      {why}", []).append(br)
                continue
            if category == "raise":
                raises.append(br)
                continue
            if why:
                stale.append(f"{br.where()} {why}")
            fig.add(br)
            mem_total.add(br)
            if not br.covered:
                uncovered.append((br, reason_for(rel, src, br)))
        per_file[rel] = (raw, fig)

    print("\nBranch coverage of engine_stub/mem/ under the library (covered/total):")
    print(f"  {'module':<36} {'all branches':>18}   {'in the figure':>18}")
    for rel, (raw, fig) in per_file.items():
        print(f"  {rel.removeprefix('engine_stub/'):<36} {raw!s:>18}   {fig!s:>18}")
    print(f"  {'mem/ (the figure)':<36} {mem_raw!s:>18}   {mem_total!s:>18}")
    for rel, why in EXCLUDED_FILES.items():
        print(f"  not in either: {rel.removeprefix('engine_stub/')} ({why})")
    print("\nThe scheduler's memory functions:")
    sched_total = Tally()
    for name, tally in sched.items():
        sched_total.covered += tally.covered
        sched_total.total += tally.total
        print(f"  {name:<36} {tally!s:>18}")
    print(f"  {'together':<36} {sched_total!s:>18}")

    for title, rows in ((f"Uncovered branches of mem/ in the figure ({len(uncovered)})", uncovered),
                        (f"Uncovered branches of the scheduler's memory functions ({len(sched_uncovered)})",
                         sched_uncovered)):
        print(f"\n{title}:")
        for br, why in rows:
            print(f"  {br.where():<44} ({br.way}) {br.text[:60]}\n      {why}")
    print(f"\nNot run by the engine, so not in the figure ({sum(len(v) for v in not_run.values())} branches):")
    for head, brs in not_run.items():
        where = ", ".join(f"{b.a}->{'exit' if b.b < 0 else b.b}" for b in brs)
        name, why = head.split("\n", 1)
        print(f"  {name}: {where}\n{why}")
    print(f"\nGuards that only raise, not taken ({len(raises)} branches, not in the figure):")
    for br in raises:
        print(f"  {br.where():<44} {br.text[:70]}")
    if stale:
        print(f"\nNOT_RUN rules contradicted by this run ({len(stale)}; counted in the figure):")
        for s in stale:
            print("  " + s)
    for name in show:
        _show(files, name)
    problems = []
    if mem_total.pct() < fail_under:
        problems.append(f"mem/ branch coverage {mem_total.pct():.1f}% is under --fail-under {fail_under}")
    return mem_total.pct(), problems


def _show(files: dict, name: str) -> None:
    found = False
    for rel, rows in files.items():
        if rel.endswith("#src"):
            continue
        picked = [br for br in rows if br.function == name or br.function.endswith("." + name)]
        if not picked:
            continue
        found = True
        tally = Tally()
        for br in picked:
            tally.add(br)
        print(f"\n{rel} {picked[0].function}: {tally}")
        for br in picked:
            mark = "ran   " if br.covered else "MISSED"
            print(f"  {mark} {br.a}->{'exit' if br.b < 0 else br.b} ({br.way}) {br.text[:70]}")
    if not found:
        print(f"\n--show {name}: no branches of that function in mem/ or the scheduler")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="scenario files or folders (default: the library)")
    parser.add_argument("-k", dest="k", metavar="EXPR", help="select scenarios as canary run -k does")
    parser.add_argument("--jobs", "-j", type=int, default=2)
    parser.add_argument("--start", choices=("auto", "warm", "fresh"), default=None,
                        help="engine start mode (default: canary run's; warm forks are measured too)")
    parser.add_argument("--fail-under", type=float, default=95.0,
                        help="exit 1 when mem/'s branch coverage (the figure) is under this (default 95)")
    parser.add_argument("--data", metavar="DIR", help="keep the coverage data here (default: a temp dir)")
    parser.add_argument("--no-run", action="store_true", help="report the data already in --data")
    parser.add_argument("--show", action="append", default=[], metavar="FUNC",
                        help="also list every branch of FUNC (a qualname, e.g. SWARadixCache.evict)")
    args = parser.parse_args(argv)
    if args.no_run and not args.data:
        parser.error("--no-run needs --data")
    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="canary-coverage-"))
    data.mkdir(parents=True, exist_ok=True)
    try:
        code = 0
        if not args.no_run:
            for stale in data.glob(".coverage*"):
                stale.unlink()
            code = run_library(data, args.paths, args.k, args.jobs, args.start)
        _, problems = report(combine(data), args.fail_under, args.show)
        if code != 0:
            problems.append(f"the library did not pass (canary run exit {code}): coverage of a failing run")
        for p in problems:
            print("FAIL: " + p)
        return 1 if problems else 0
    finally:
        if not args.data:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
