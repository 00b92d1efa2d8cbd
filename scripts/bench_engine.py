"""Engine benchmark: cold start against a bare `import torch`, and what the checks cost in decode.

    python scripts/bench_engine.py [--starts N] [--reps R] [--requests B] [--new-tokens T]

(`--starts 0` skips the cold start.)

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
(c) Would-be device syncs (engine_stub.synccheck) of the worst decode step per variant, and how
    many the checks add over the variant with every check off.

Then one line says whether each target is met (BRIEF §9, issue 11): STRICT/OFF >= 0.98,
kv_canary=log/OFF >= 0.75, 0 syncs added per decode step, cold start within 1.0 s. The last line
printed is one JSON object.
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
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


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


# ---- report ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="cold starts of each kind (default 3; 0: skip)")
    parser.add_argument("--reps", type=int, default=5, help="decode repetitions per variant (default 5)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent decode requests (default 4)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--segment", type=int, default=8,
                        help="decode steps a variant runs before the next one takes its turn (default 8)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_engine-") as tmp:
        workdir = Path(tmp)
        cold = bench_cold_start(args.starts, workdir) if args.starts > 0 else None
        samples = bench_decode(args.reps, args.requests, args.new_tokens, workdir, args.segment)
        syncs = bench_syncs(args.requests, min(args.new_tokens, 48), workdir)
    decode = {name: statistics.median(values) for name, values in samples.items()}
    # Spread of the samples around the median: a ratio closer to 1 than this is noise.
    spread = {name: (max(values) - min(values)) / decode[name] for name, values in samples.items()}

    # Ratios are medians of per-repetition pairs: both sides of a pair ran back to back, so drift
    # on this noisy machine cancels out better than in a ratio of two medians.
    def paired(name: str) -> float:
        return statistics.median(v / o for v, o in zip(samples[name], samples["off"], strict=True))

    strict_ratio = paired("strict")
    canary_ratio = paired("canary_log")
    print(f"engine_stub benchmark ({args.starts} cold starts each; decode: {args.requests} requests x "
          f"{args.new_tokens} new tokens, median of {args.reps}, CPU)")
    print()
    if cold is not None:
        print(f"{'cold start':<34}{'median s':>10}")
        label = 'python -c "import torch"'
        print(f"{label:<34}{cold['import_torch_s']:>10.3f}")
        print(f"{'python -m engine_stub (ready)':<34}{cold['engine_ready_s']:>10.3f}")
        print(f"{'difference (target <= 1.0 s)':<34}{cold['delta_s']:>10.3f}")
        print()
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
    targets = {"strict_over_off>=0.98": strict_ratio >= 0.98, "canary_log_over_off>=0.75": canary_ratio >= 0.75,
               "syncs_added==0": added == 0}
    if cold is not None:
        targets["cold_start_delta<=1.0s"] = cold["delta_s"] <= 1.0
    print()
    print("targets: " + ", ".join(f"{name} {'met' if ok else 'NOT MET'}" for name, ok in targets.items()))
    print(json.dumps({
        "cold_start": None if cold is None else {k: round(v, 4) for k, v in cold.items()},
        "targets_met": targets,
        "decode_tok_s": {k: round(v, 2) for k, v in decode.items()},
        "decode_spread": {k: round(v, 4) for k, v in spread.items()},
        "ratio_strict_over_off": round(strict_ratio, 4),
        "ratio_canary_log_over_off": round(canary_ratio, 4),
        "syncs_per_decode_step": syncs,
        "config": {"starts": args.starts, "reps": args.reps, "segment": args.segment, "requests": args.requests,
                   "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
