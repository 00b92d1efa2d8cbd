"""Engine benchmark: cold start against a bare `import torch`, and what the checks cost in decode.

    python scripts/bench_engine.py [--only cold|decode|chunked] [--starts N] [--reps R] [--requests B]
                                   [--new-tokens T] [--chunked-reps C]

(`--starts 0` skips the cold start, `--chunked-reps 0` the chunked prefill; `--only` runs one figure.)

(a) Cold start: wall time until `python -c "import torch; print(...)"` prints its line, against
    `python -m engine_stub --port 0` until it prints `engine_stub ready on http://...` (printed
    once it listens), each in a fresh process (the server is then stopped with SIGTERM), N of
    each, interleaved; medians and their difference.
(b) Decode throughput of the in-process scheduler, driven by `scheduler.step()` on a fixed
    workload (B requests x T new tokens, prefilled together; only decode steps are timed), with
    invariant_check off and strict (kv_canary off), and kv_canary off and log (invariant_check
    off). Each repetition builds one engine per variant and decodes them in turns of `--segment`
    steps, in a rotating order, so that drift on a shared machine lands on all of them alike;
    figures are medians; ratios are medians of the per-repetition variant / baseline throughput.
    Each variant's timed run ends with the idle tick the engine runs once the work is done (the
    ledgers, radix sanity and the memory census); STRICT also runs the census, count-only, at the
    steps where slots change hands (here the last step's finishes).
(c) Would-be device syncs (engine_stub.synccheck) of the worst decode step per variant, and how
    many the checks add over the variant with every check off; and the memory census's own cost
    per call on a mid-run state (cache hits running), against a decode step of the same engine.
(d) Chunked prefill: prompt tokens/s of prefilling a 480-token prompt (max_new_tokens 1) chunked on
    a small SWA pool (page 1, swa_pool_tokens 64: chunk 30; page 16, swa_pool_tokens 128: chunk
    64), against the same chunk size on a large SWA pool (equal chunk work: the ratio is what a
    recycling pool costs at the chunk boundaries) and, informational only, against the prompt
    unchunked (chunked_prefill_size=-1) on the large pool, which is not equal work (the stub model
    gathers a key row per query: one long step gathers ~2x what the chunks do). Radix cache on and
    off, every check off and invariant_check=strict + kv_canary=log (as the suite runs). Per case
    and repetition, one fresh engine per side, the sides taking turns of one step in a rotating
    order; ratios are medians of per-repetition pairs. Also the share of the prefill time spent in
    the scheduler's chunk bookkeeping (`_next_chunk`, `_chunk_boundary`).

Then one line says whether each target is met (BRIEF §9, issue 11): STRICT/OFF >= 0.98,
kv_canary=log/OFF >= 0.75, 0 syncs added per decode step, cold start within 1.0 s, chunked /
equal-chunk-work >= 0.9 in every chunked case. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_PREFIX = "engine_stub ready on http://"
PROMPT_TOKENS = 32
DECODE_VARIANTS = {
    "off": {"invariant_check": "off", "kv_canary": "off"},
    "strict": {"invariant_check": "strict", "kv_canary": "off"},
    "canary_log": {"invariant_check": "off", "kv_canary": "log"},
    "strict_canary": {"invariant_check": "strict", "kv_canary": "log"},
}


# ---- (a) cold start ------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    # The repo first, then whatever the caller's path held (a lent GPU machine's wheelhouse).
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _time_import_torch() -> float:
    """Until a bare `import torch` prints a line: the same finish line as the engine's ready."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import torch; print('imported', flush=True)"],
                            stdout=subprocess.PIPE, text=True, env=_env(), cwd=REPO_ROOT)
    assert proc.stdout is not None
    proc.stdout.readline()
    elapsed = time.perf_counter() - start
    proc.wait()
    proc.stdout.close()
    return elapsed


def _time_engine_ready(workdir: Path, index: int) -> float:
    cmd = [sys.executable, "-m", "engine_stub", "--port", "0", "--device", "cpu",
           "--event-log", str(workdir / f"cold-{index}.events.jsonl")]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                elapsed = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"engine exited with {proc.wait()} before its ready line")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        return elapsed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def bench_cold_start(starts: int, workdir: Path) -> dict[str, float]:
    torch_s, engine_s = [], []
    for i in range(starts):
        # Alternate which goes first, so a warming page cache favours neither.
        if i % 2 == 0:
            torch_s.append(_time_import_torch())
            engine_s.append(_time_engine_ready(workdir, i))
        else:
            engine_s.append(_time_engine_ready(workdir, i))
            torch_s.append(_time_import_torch())
    t, e = statistics.median(torch_s), statistics.median(engine_s)
    return {"import_torch_s": t, "engine_ready_s": e, "delta_s": e - t}


# ---- (b) decode throughput -----------------------------------------------------------------------


def _decode_run(variant: str, requests: int, new_tokens: int, workdir: Path, rep: int,
                count_syncs_per_step: bool = False) -> float:
    """Decode tokens/s of one run, or (count_syncs_per_step) the most syncs any decode step made."""
    from engine_stub.config import EngineConfig
    from engine_stub.engine import Engine
    from engine_stub.req import Req
    from engine_stub.synccheck import count_syncs

    config = EngineConfig(device="cpu", max_running_requests=requests,
                          event_log=str(workdir / f"decode-{variant}-{rep}.events.jsonl"),
                          **DECODE_VARIANTS[variant])
    engine = Engine(config, exit_on_crash=False)
    try:
        sched = engine.scheduler
        rng = random.Random(0)  # the same prompts for every variant
        for i in range(requests):
            sched.add_request(Req(f"r{i}", [rng.randrange(256) for _ in range(PROMPT_TOKENS)], new_tokens))
        sched.step()  # the prefill of all requests, untimed
        assert sched.stats["prefill_steps"] == 1 and len(sched.running) == requests
        if count_syncs_per_step:
            most = 0
            while sched.has_work:
                most = max(most, count_syncs(sched.step).total)
            return float(most)
        start = time.perf_counter()
        while sched.has_work:
            sched.step()
        elapsed = time.perf_counter() - start
        decoded = sched.stats["generated_tokens"] - requests
        assert sched.stats["decode_steps"] == new_tokens - 1
        return decoded / elapsed
    finally:
        engine.stop(drain_timeout_s=0)


def bench_syncs(requests: int, new_tokens: int, workdir: Path) -> dict[str, int]:
    """Would-be device syncs of the worst decode step, per variant (synccheck, on CPU)."""
    return {name: int(_decode_run(name, requests, new_tokens, workdir, -2, count_syncs_per_step=True))
            for name in DECODE_VARIANTS}


class _DecodeRun:
    """One variant's engine, prefilled, that decodes a few steps at a time (timed)."""

    def __init__(self, variant: str, requests: int, new_tokens: int, workdir: Path, rep: int) -> None:
        from engine_stub.config import EngineConfig
        from engine_stub.engine import Engine
        from engine_stub.invariants import InvariantCheckLevel
        from engine_stub.req import Req

        self.requests, self.new_tokens = requests, new_tokens
        config = EngineConfig(device="cpu", max_running_requests=requests,
                              event_log=str(workdir / f"decode-{variant}-{rep}.events.jsonl"),
                              **DECODE_VARIANTS[variant])
        self.engine = Engine(config, exit_on_crash=False)
        self.level = InvariantCheckLevel.parse(config.invariant_check)
        self.sched = self.engine.scheduler
        rng = random.Random(0)  # the same prompts for every variant
        for i in range(requests):
            self.sched.add_request(Req(f"r{i}", [rng.randrange(256) for _ in range(PROMPT_TOKENS)], new_tokens))
        self._pin_level()
        self.sched.step()  # the prefill of all requests, untimed
        assert self.sched.stats["prefill_steps"] == 1 and len(self.sched.running) == requests
        self.elapsed = 0.0
        self.idled = False

    def _pin_level(self) -> None:
        # The invariant level is process-wide (each Engine pins its own): pin this one's.
        from engine_stub.invariants import set_default_level

        set_default_level(self.level)

    def run(self, steps: int) -> None:
        self._pin_level()
        sched = self.sched
        start = time.perf_counter()
        for _ in range(steps):
            if not sched.has_work:
                break
            sched.step()
        if not sched.has_work and not self.idled:
            # The idle tick the engine runs once the work is done (ledgers, radix sanity, the
            # memory census), timed with the decode: every variant pays it; STRICT also pays the
            # census at the steps where slots changed hands (the last step's finishes).
            sched.idle_tick()
            self.idled = True
        self.elapsed += time.perf_counter() - start

    def tok_s(self) -> float:
        assert self.sched.stats["decode_steps"] == self.new_tokens - 1
        return (self.sched.stats["generated_tokens"] - self.requests) / self.elapsed

    def close(self) -> None:
        self.engine.stop(drain_timeout_s=0)


def bench_decode(reps: int, requests: int, new_tokens: int, workdir: Path, segment: int) -> dict[str, list[float]]:
    """Per repetition, one engine per variant, all prefilled, then decoded `segment` steps at a
    time each, in a rotating order, until all are done: drift on this shared machine lands on
    every variant alike within ~a segment, and each repetition gives one paired sample."""
    names = list(DECODE_VARIANTS)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(-1, reps):  # rep -1: warm-up, first-call costs land on no variant
        runs = {name: _DecodeRun(name, requests, new_tokens if rep >= 0 else min(new_tokens, 8), workdir, rep)
                for name in names}
        try:
            turn = 0
            while any(run.sched.has_work for run in runs.values()):
                shift = turn % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[name].run(segment)
                turn += 1
            if rep >= 0:
                for name, run in runs.items():
                    samples[name].append(run.tok_s())
        finally:
            for run in runs.values():
                run.close()
    return samples


def bench_census(requests: int, workdir: Path, calls: int = 40) -> dict[str, float]:
    """The memory census's own cost per call (engine_stub/census.py: evaluated, then handed to
    `expect` at WARN), on a mid-run state (a finished wave in the radix cache, `requests` running
    with cache hits), against one decode step of the same engine (invariant_check=strict),
    medians of `calls` of each, taken in turns."""
    from engine_stub.config import EngineConfig
    from engine_stub.engine import Engine
    from engine_stub.invariants import InvariantCheckLevel, override_level
    from engine_stub.req import Req

    config = EngineConfig(device="cpu", max_running_requests=requests,
                          event_log=str(workdir / "census.events.jsonl"), **DECODE_VARIANTS["strict"])
    engine = Engine(config, exit_on_crash=False)
    try:
        sched = engine.scheduler
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
        for i, prompt in enumerate(prompts):
            sched.add_request(Req(f"w{i}", prompt, 2))
        while sched.has_work:
            sched.step()
        for i, prompt in enumerate(prompts):  # the same prompts again: cache hits, locks held
            sched.add_request(Req(f"r{i}", prompt[:-1] + [prompt[-1] ^ 1], calls + 8))
        sched.step()
        census, steps = [], []
        with override_level(InvariantCheckLevel.WARN):
            for _ in range(calls):
                start = time.perf_counter()
                sched.census.check().expect_all()
                census.append(time.perf_counter() - start)
                start = time.perf_counter()
                sched.step()
                steps.append(time.perf_counter() - start)
        assert sched.stats["cached_tokens"] > 0 and len(sched.running) == requests
        call, step = statistics.median(census), statistics.median(steps)
        return {"census_call_ms": call * 1e3, "decode_step_ms": step * 1e3, "census_over_step": call / step,
                "radix_nodes_tokens": float(sched.tree_cache.total_size())}
    finally:
        engine.stop(drain_timeout_s=0)


# ---- (d) chunked prefill -------------------------------------------------------------------------

CHUNKED_PROMPT_TOKENS = 480
CHUNKED_CONTEXT_LEN = 512
CHUNKED_WARMUP_PROMPT_TOKENS = 160  # the warm-up pass: every code path, a few chunks, cheap
# An SWA pool that holds the whole prompt beside one request's headroom, at page 1 and 16 alike.
CHUNKED_LARGE_SWA_POOL = 640
# Small SWA pools (window 16, the default): auto chunk = pool - headroom, page-floored.
CHUNKED_GEOMETRIES = {
    "page1": {"page_size": 1, "swa_pool_tokens": 64},  # headroom 34 -> chunk 30
    "page16": {"page_size": 16, "swa_pool_tokens": 128},  # headroom 64 -> chunk 64
}
CHUNKED_CHECKS = {"off": DECODE_VARIANTS["off"], "strict+log": DECODE_VARIANTS["strict_canary"]}
# small: chunked on the small pool (auto chunk); equal: the same chunk size on the large pool, i.e.
# the same chunks and forward work, and the same boundary bookkeeping (window eviction, radix
# cache_unfinished run at every boundary on either pool), so small/equal is what chunking on a pool
# that must recycle its SWA slots costs (slot reuse, any tree eviction); unchunked: the whole prompt
# in one step on the large pool.
CHUNKED_SIDES = ("small", "equal", "unchunked")
CHUNKED_TARGET = 0.9  # small / equal (issue: >= 0.9 of unchunked throughput at equal chunk work)
# The scheduler's chunk bookkeeping (timed apart, where the scheduler has them): the next chunk's
# allocation (with any tree eviction it needs), and the boundary (window eviction, cache_unfinished).
CHUNK_BOOKKEEPING = ("_next_chunk", "_chunk_boundary")


def chunked_cases() -> list[tuple[str, str, bool, str]]:
    """(key, geometry, radix_cache, checks) of every case of the chunked-prefill figure."""
    return [(f"{geo}/{'radix' if radix else 'noradix'}/{checks}", geo, radix, checks)
            for geo in CHUNKED_GEOMETRIES for radix in (True, False) for checks in CHUNKED_CHECKS]


def _chunked_knobs(geometry: str, radix: bool, checks: str) -> dict[str, dict]:
    """The engine knobs of each side of one case (the equal side gets the small side's chunk)."""
    from engine_stub.config import CHUNKED_PREFILL_OFF, EngineConfig

    common = {"device": "cpu", "max_context_len": CHUNKED_CONTEXT_LEN, "radix_cache": radix,
              "page_size": CHUNKED_GEOMETRIES[geometry]["page_size"], **CHUNKED_CHECKS[checks]}
    small = {**common, "swa_pool_tokens": CHUNKED_GEOMETRIES[geometry]["swa_pool_tokens"]}
    chunk = EngineConfig(**small).prefill_chunk_tokens
    assert chunk is not None and chunk < CHUNKED_PROMPT_TOKENS, (geometry, chunk)
    return {
        "small": small,
        "equal": {**common, "swa_pool_tokens": CHUNKED_LARGE_SWA_POOL, "chunked_prefill_size": chunk},
        "unchunked": {**common, "swa_pool_tokens": CHUNKED_LARGE_SWA_POOL,
                      "chunked_prefill_size": CHUNKED_PREFILL_OFF},
    }


class _PrefillRun:
    """One engine, one waiting prompt (max_new_tokens 1), prefilled a step at a time (timed)."""

    def __init__(self, knobs: dict, prompt: list[int], event_log: Path) -> None:
        from engine_stub.config import EngineConfig
        from engine_stub.engine import Engine
        from engine_stub.invariants import InvariantCheckLevel
        from engine_stub.req import Req

        config = EngineConfig(event_log=str(event_log), **knobs)
        self.engine = Engine(config, exit_on_crash=False)
        self.level = InvariantCheckLevel.parse(config.invariant_check)
        self.sched = self.engine.scheduler
        self.chunk_tokens = self.sched.chunk_tokens
        self.prompt_tokens = len(prompt)
        self.sched.add_request(Req("p0", prompt, 1))
        self.elapsed = 0.0
        self.bookkeeping: float | None = 0.0
        for name in CHUNK_BOOKKEEPING:
            if not callable(getattr(self.sched, name, None)):
                self.bookkeeping = None  # renamed or gone: no share reported
        if self.bookkeeping is not None:
            for name in CHUNK_BOOKKEEPING:
                setattr(self.sched, name, self._timed(getattr(self.sched, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.bookkeeping += time.perf_counter() - start
        return timed

    def step(self) -> None:
        from engine_stub.invariants import set_default_level

        set_default_level(self.level)  # process-wide; each Engine pinned its own
        start = time.perf_counter()
        self.sched.step()
        self.elapsed += time.perf_counter() - start

    def tok_s(self) -> float:
        stats = self.sched.stats
        # Prefill steps only, the prompt's token sampled, no decode (max_new_tokens 1).
        assert stats["decode_steps"] == 0 and stats["generated_tokens"] == 1, stats
        assert stats["prefill_steps"] == stats["prefill_chunks"] + 1, stats
        return self.prompt_tokens / self.elapsed

    def close(self) -> None:
        self.engine.stop(drain_timeout_s=0)


def bench_chunked(reps: int, workdir: Path) -> dict[str, dict]:
    """Per case and repetition, one fresh engine per side, the same prompt in each; the sides take
    turns of one scheduler step, in a rotating order, until all three are done, so drift on this
    shared machine lands on every side alike, and each repetition gives one paired sample.
    Repetition -1 is a short warm-up pass over every case (first-call costs land on no side); the
    cases' order rotates per repetition, so drift across a repetition favours no case."""
    cases = chunked_cases()
    samples: dict[str, dict] = {}
    for rep in range(-1, reps):
        prompt_len = CHUNKED_WARMUP_PROMPT_TOKENS if rep < 0 else CHUNKED_PROMPT_TOKENS
        rng = random.Random(rep)  # a new prompt per repetition, the same on every side
        prompt = [rng.randrange(256) for _ in range(prompt_len)]
        shift = max(rep, 0) % len(cases)
        for key, geometry, radix, checks in cases[shift:] + cases[:shift]:
            knobs = _chunked_knobs(geometry, radix, checks)
            tag = key.replace("/", "-").replace("+", "-")
            runs = {side: _PrefillRun(knobs[side], prompt, workdir / f"chunked-{tag}-{side}-{rep}.events.jsonl")
                    for side in CHUNKED_SIDES}
            try:
                turn = 0
                while any(run.sched.has_work for run in runs.values()):
                    shift = turn % len(CHUNKED_SIDES)
                    for side in CHUNKED_SIDES[shift:] + CHUNKED_SIDES[:shift]:
                        if runs[side].sched.has_work:
                            runs[side].step()
                    turn += 1
                small, equal, unchunked = (runs[side] for side in CHUNKED_SIDES)
                # Equal chunk work, checked: the same chunk size, hence the same chunks.
                assert small.chunk_tokens == equal.chunk_tokens and unchunked.chunk_tokens is None
                assert small.sched.stats["prefill_chunks"] == equal.sched.stats["prefill_chunks"] > 0
                assert unchunked.sched.stats["prefill_chunks"] == 0
                tok_s = {side: run.tok_s() for side, run in runs.items()}
                if rep >= 0:
                    case = samples.setdefault(key, {"chunk_tokens": small.chunk_tokens,
                                                    "chunks": small.sched.stats["prefill_chunks"] + 1,
                                                    **{side: [] for side in CHUNKED_SIDES},
                                                    "bookkeeping_share": {"small": [], "equal": []}})
                    for side in CHUNKED_SIDES:
                        case[side].append(tok_s[side])
                    for side, run in (("small", small), ("equal", equal)):
                        if run.bookkeeping is not None:
                            case["bookkeeping_share"][side].append(run.bookkeeping / run.elapsed)
            finally:
                for run in runs.values():
                    run.close()
    return samples


def summarize_chunked(samples: dict[str, dict]) -> dict[str, dict]:
    """Medians of tok/s per side, and medians of the per-repetition paired ratios."""
    out = {}
    for key in (case[0] for case in chunked_cases()):
        case = samples[key]
        equal_work = [s / e for s, e in zip(case["small"], case["equal"], strict=True)]
        shares = case["bookkeeping_share"]
        out[key] = {
            "chunk_tokens": case["chunk_tokens"],
            "chunks": case["chunks"],
            **{f"{side}_tok_s": statistics.median(case[side]) for side in CHUNKED_SIDES},
            "ratio_small_over_equal": statistics.median(equal_work),
            "ratio_small_over_equal_spread": max(equal_work) - min(equal_work),
            "ratio_equal_over_unchunked": statistics.median(
                e / u for e, u in zip(case["equal"], case["unchunked"], strict=True)),
            "ratio_small_over_unchunked": statistics.median(
                s / u for s, u in zip(case["small"], case["unchunked"], strict=True)),
            **{f"bookkeeping_share_{side}": statistics.median(shares[side]) if shares[side] else None
               for side in ("small", "equal")},
        }
    return out


def print_chunked(summary: dict[str, dict], reps: int) -> None:
    def pct(share: float | None) -> str:
        return "n/a" if share is None else f"{share:.1%}"

    print(f"chunked prefill: a {CHUNKED_PROMPT_TOKENS}-token prompt (max_context_len {CHUNKED_CONTEXT_LEN}, "
          f"max_new_tokens 1), window 16; prompt tok/s, median of {reps}")
    print("  small     chunked on the small SWA pool (its auto chunk)")
    print(f"  equal     the same chunk size on a {CHUNKED_LARGE_SWA_POOL}-slot SWA pool: equal chunk work; "
          "small/equal is what a pool that")
    print("            recycles costs at the chunk boundaries (the boundary bookkeeping itself runs on "
          "both sides: see book%)")
    print(f"  unchunked chunked_prefill_size=-1, the whole prompt in one step on the {CHUNKED_LARGE_SWA_POOL}-slot "
          "pool: NOT equal work (the stub")
    print("            model gathers a key row per query, so one long step gathers ~2x what the chunks do); "
          "informational")
    print("  book%     share of the prefill time in the chunk bookkeeping (" + ", ".join(CHUNK_BOOKKEEPING)
          + "), small / equal")
    print(f"{'case (pool/radix/checks)':<31}{'chunk':>6}{'small':>8}{'equal':>8}{'unchunked':>10}"
          f"{'small/equal':>12}{'spread':>8}{'':>6}{'small/unch':>11}{'book% small/equal':>19}")
    for key, row in summary.items():
        geometry = CHUNKED_GEOMETRIES[key.split("/")[0]]
        label = f"p{geometry['page_size']} swa{geometry['swa_pool_tokens']}/" + key.split("/", 1)[1]
        ok = row["ratio_small_over_equal"] >= CHUNKED_TARGET
        book = f"{pct(row['bookkeeping_share_small'])} / {pct(row['bookkeeping_share_equal'])}"
        print(f"{label:<31}{row['chunk_tokens']:>6}{row['small_tok_s']:>8.0f}{row['equal_tok_s']:>8.0f}"
              f"{row['unchunked_tok_s']:>10.0f}{row['ratio_small_over_equal']:>12.3f}"
              f"{row['ratio_small_over_equal_spread']:>8.3f}{'PASS' if ok else 'FAIL':>6}"
              f"{row['ratio_small_over_unchunked']:>11.3f}{book:>19}")
    worst = min(summary, key=lambda k: summary[k]["ratio_small_over_equal"])
    ratio = summary[worst]["ratio_small_over_equal"]
    print(f"chunked prefill at equal chunk work (small/equal): {'PASS' if ratio >= CHUNKED_TARGET else 'FAIL'} "
          f"(worst {ratio:.3f}, {worst}; target >= {CHUNKED_TARGET})")


# ---- report ----------------------------------------------------------------------------------------


def print_decode(samples: dict[str, list[float]], syncs: dict[str, int]) -> dict:
    """The decode and sync tables; returns their part of the summary (ratios, targets, JSON)."""
    decode = {name: statistics.median(values) for name, values in samples.items()}
    # Spread of the samples around the median: a ratio closer to 1 than this is noise.
    spread = {name: (max(values) - min(values)) / decode[name] for name, values in samples.items()}

    # Ratios are medians of per-repetition pairs: both sides of a pair ran back to back, so drift
    # on this noisy machine cancels out better than in a ratio of two medians.
    def paired(name: str) -> float:
        return statistics.median(v / o for v, o in zip(samples[name], samples["off"], strict=True))

    strict_ratio = paired("strict")
    canary_ratio = paired("canary_log")
    print(f"{'decode variant':<34}{'tok/s':>10}{'spread':>9}{'ratio':>9}")
    print(f"{'invariant_check=off, canary=off':<34}{decode['off']:>10.1f}{spread['off']:>9.1%}{1.0:>9.3f}")
    print(f"{'invariant_check=strict':<34}{decode['strict']:>10.1f}{spread['strict']:>9.1%}"
          f"{strict_ratio:>9.3f}   (target >= 0.98)")
    print(f"{'kv_canary=log':<34}{decode['canary_log']:>10.1f}{spread['canary_log']:>9.1%}{canary_ratio:>9.3f}"
          f"   (target >= 0.75)")
    print(f"{'strict + kv_canary=log':<34}{decode['strict_canary']:>10.1f}"
          f"{spread['strict_canary']:>9.1%}{paired('strict_canary'):>9.3f}")
    print()
    print(f"{'would-be syncs, worst decode step':<34}{'syncs':>10}{'added':>9}   (target: 0 added)")
    for name, count in syncs.items():
        print(f"{name:<34}{count:>10}{count - syncs['off']:>9}")
    added = max(count - syncs["off"] for count in syncs.values())
    return {
        "targets": {"strict_over_off>=0.98": strict_ratio >= 0.98, "canary_log_over_off>=0.75": canary_ratio >= 0.75,
                    "syncs_added==0": added == 0},
        "json": {
            "decode_tok_s": {k: round(v, 2) for k, v in decode.items()},
            "decode_spread": {k: round(v, 4) for k, v in spread.items()},
            "ratio_strict_over_off": round(strict_ratio, 4),
            "ratio_canary_log_over_off": round(canary_ratio, 4),
            "syncs_per_decode_step": syncs,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("cold", "decode", "chunked"), default=None,
                        help="run one figure only: cold start, decode (with its syncs), or chunked prefill "
                             "(default: all)")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of each kind (default 3; 0: skip)")
    parser.add_argument("--reps", type=int, default=5, help="decode repetitions per variant (default 5)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent decode requests (default 4)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--segment", type=int, default=8,
                        help="decode steps a variant runs before the next one takes its turn (default 8)")
    parser.add_argument("--chunked-reps", type=int, default=3,
                        help="chunked-prefill repetitions per case (default 3; 0: skip)")
    args = parser.parse_args(argv)
    run_cold = args.only in (None, "cold") and args.starts > 0
    run_decode = args.only in (None, "decode")
    run_chunked = args.only in (None, "chunked") and args.chunked_reps > 0

    with tempfile.TemporaryDirectory(prefix="bench_engine-") as tmp:
        workdir = Path(tmp)
        cold = bench_cold_start(args.starts, workdir) if run_cold else None
        samples = syncs = census = None
        if run_decode:
            samples = bench_decode(args.reps, args.requests, args.new_tokens, workdir, args.segment)
            syncs = bench_syncs(args.requests, min(args.new_tokens, 48), workdir)
            census = bench_census(args.requests, workdir)
        chunked = summarize_chunked(bench_chunked(args.chunked_reps, workdir)) if run_chunked else None

    parts = []
    if run_cold:
        parts.append(f"{args.starts} cold starts each")
    if run_decode:
        parts.append(f"decode: {args.requests} requests x {args.new_tokens} new tokens, median of {args.reps}")
    if run_chunked:
        parts.append(f"chunked prefill: median of {args.chunked_reps}")
    print(f"engine_stub benchmark ({'; '.join(parts)}, CPU)")
    print()
    targets: dict[str, bool] = {}
    out: dict = {"cold_start": None, "targets_met": targets}
    if cold is not None:
        print(f"{'cold start':<34}{'median s':>10}")
        label = 'python -c "import torch"'
        print(f"{label:<34}{cold['import_torch_s']:>10.3f}")
        print(f"{'python -m engine_stub (ready)':<34}{cold['engine_ready_s']:>10.3f}")
        print(f"{'difference (target <= 1.0 s)':<34}{cold['delta_s']:>10.3f}")
        print()
        out["cold_start"] = {k: round(v, 4) for k, v in cold.items()}
    if samples is not None and syncs is not None:
        decode = print_decode(samples, syncs)
        print()
        assert census is not None
        print(f"{'memory census, one call (WARN)':<34}{census['census_call_ms']:>10.3f} ms   "
              f"({census['census_over_step']:.2f} of a decode step, {census['decode_step_ms']:.3f} ms; "
              f"{args.requests} running, {census['radix_nodes_tokens']:.0f} tokens cached)")
        print()
        out["census"] = {k: round(v, 4) for k, v in census.items()}
        targets.update(decode["targets"])
        out.update(decode["json"])
    if chunked is not None:
        print_chunked(chunked, args.chunked_reps)
        print()
        worst = min(row["ratio_small_over_equal"] for row in chunked.values())
        targets[f"chunked_small_over_equal>={CHUNKED_TARGET}"] = worst >= CHUNKED_TARGET
        out["chunked_prefill"] = {key: {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                                  for key, row in chunked.items()}
    if cold is not None:
        targets["cold_start_delta<=1.0s"] = cold["delta_s"] <= 1.0
    print("targets: " + ", ".join(f"{name} {'met' if ok else 'NOT MET'}" for name, ok in targets.items()))
    out["config"] = {"only": args.only, "starts": args.starts if run_cold else 0, "reps": args.reps,
                     "segment": args.segment, "requests": args.requests, "new_tokens": args.new_tokens,
                     "prompt_tokens": PROMPT_TOKENS, "chunked_reps": args.chunked_reps if run_chunked else 0,
                     "chunked_prompt_tokens": CHUNKED_PROMPT_TOKENS}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
