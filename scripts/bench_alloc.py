"""Micro-benchmark of the SWA allocator's hot path.

    python scripts/bench_alloc.py [--iters N] [--batch B] [--device cpu|cuda] [--threads T]

(a) `free_swa` on page_size 1, at levels OFF and STRICT, against the bare work it has to do: a
    gather of the peers from a mapping (`torch.take`, the cheapest gather with the same values
    and errors as `mapping[idx]`), an `index_fill_` of the mapping to 0, an `index_fill_` of an
    allocated bitmap and an append to a free list, on tensors of the same sizes; at STRICT also
    the one async assert PR #36723 puts there (`swa.peer_mapped`: every peer > 0), as SGLang's
    free_swa makes it (`(peers > 0).all()`). The ratio against the bare ops without that assert
    is printed as well ("no check").
(b) alloc+free throughput through the SWA allocator on page sizes 1 and 16.

Each free_swa variant runs in its own loop, alternated call by call with the bare ops it is
compared to, so that drift (frequency scaling, a noisy neighbour) lands on both sides alike;
each figure is a median. The slots a repetition
frees are allocated before its clock starts; after its clock stops, the allocator gets the
engine's per-step read-back (drop counters and invariant counters in one copy,
`note_drop_totals`, `drain_firings`, as `Scheduler._read_back`/`_end_of_step` make them), so
that it runs in the state a step leaves. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine_stub import invariants
from engine_stub.invariants import InvariantCheckLevel, override_level
from engine_stub.mem import SWATokenToKVPoolAllocator

LEVELS = (InvariantCheckLevel.OFF, InvariantCheckLevel.STRICT)
THROUGHPUT_PAGE_SIZES = (1, 16)
PAIRS_PER_SAMPLE = 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BareFreeSwa:
    """The minimal ops `free_swa` must do on page_size 1, with no invariant and no bookkeeping."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.batch = batch
        size, size_swa = 4 * batch, 2 * batch
        self.mapping = torch.zeros(size + 2, dtype=torch.int64, device=device)
        self.allocated = torch.zeros(size_swa + 1, dtype=torch.bool, device=device)
        self.full_ids = torch.randperm(size, device=device)[:batch] + 1
        self.swa_ids = torch.randperm(size_swa, device=device)[:batch] + 1
        self.free_list: list[torch.Tensor] = []

    def setup(self) -> torch.Tensor:
        self.mapping.index_copy_(0, self.full_ids, self.swa_ids)
        self.allocated.index_fill_(0, self.swa_ids, True)
        self.free_list.clear()
        # A fresh tensor each repetition, as alloc hands out, so both sides index alike.
        return self.full_ids.clone()

    def run(self, idx: torch.Tensor) -> None:
        peers = torch.take(self.mapping, idx)
        self.mapping.index_fill_(0, idx, 0)
        self.allocated.index_fill_(0, peers, False)
        self.free_list.append(peers)

    def run_deferred(self, idx: torch.Tensor) -> None:
        """What free_swa must do inside a free group: resolve the peers, clear, queue them."""
        peers = torch.take(self.mapping, idx)
        self.mapping.index_fill_(0, idx, 0)
        self.free_list.append(peers)

    def run_checked(self, idx: torch.Tensor) -> None:
        """`run` plus the STRICT check free_swa must make (SGLang's async assert, as is)."""
        peers = torch.take(self.mapping, idx)
        torch._assert_async((peers > 0).all(), "swa.peer_mapped")
        self.mapping.index_fill_(0, idx, 0)
        self.allocated.index_fill_(0, peers, False)
        self.free_list.append(peers)

    def run_deferred_checked(self, idx: torch.Tensor) -> None:
        """`run_deferred` plus the STRICT check free_swa must make."""
        peers = torch.take(self.mapping, idx)
        torch._assert_async((peers > 0).all(), "swa.peer_mapped")
        self.mapping.index_fill_(0, idx, 0)
        self.free_list.append(peers)


class _FreeSwa:
    """`SWATokenToKVPoolAllocator.free_swa` on page_size 1; the full side is freed off the clock.

    `grouped`: the call sits inside a free group, as every free_swa of the engine does; the
    group's one release (free_group_end) runs off the clock, like the full side.
    """

    def __init__(self, batch: int, device: torch.device, *, grouped: bool = False) -> None:
        self.allocator = SWATokenToKVPoolAllocator(4 * batch, 2 * batch, 1, device)
        self.batch = batch
        self.grouped = grouped

    def setup(self) -> torch.Tensor:
        idx = self.allocator.alloc(self.batch)
        assert idx is not None
        if self.grouped:
            self.allocator.free_group_begin()
        return idx

    def run(self, idx: torch.Tensor) -> None:
        self.allocator.free_swa(idx)

    def teardown(self, idx: torch.Tensor) -> None:
        if self.grouped:
            self.allocator.free_group_end()
        self.allocator.free_full(idx)
        _read_back(self.allocator)


def _read_back(allocator: SWATokenToKVPoolAllocator) -> None:
    """The engine's per-step read-back of the allocator's and the invariants' counters."""
    names, counters = invariants.counter_snapshot()
    parts = [allocator.drop_counter()] + ([counters] if counters is not None else [])
    host = torch.cat(parts).tolist()
    allocator.note_drop_totals(host[:2])
    totals: dict[str, int] = {}
    for name, value in zip(names, host[2:], strict=True):
        totals[name] = totals.get(name, 0) + int(value)
    if invariants.drain_firings(totals):
        raise SystemExit("bench_alloc: a clean free_swa fired an invariant")


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _paired(iters: int, device: torch.device, run_bare, case: _FreeSwa, level: str,
            bare: _BareFreeSwa) -> tuple[float, float]:
    """Median seconds of the bare ops and of `case`, alternated call by call in one loop."""
    bare_s, case_s = [], []
    with override_level(level):
        for rep in range(iters + 1):  # repetition 0 warms up and is discarded
            for side in ("bare", "case") if rep % 2 else ("case", "bare"):
                if side == "bare":
                    idx = bare.setup()
                    seconds = _time_once(lambda idx=idx: run_bare(idx), device)
                else:
                    idx = case.setup()
                    seconds = _time_once(lambda idx=idx: case.run(idx), device)
                    case.teardown(idx)
                if rep:
                    (bare_s if side == "bare" else case_s).append(seconds)
    return statistics.median(bare_s), statistics.median(case_s)


def bench_free_swa(iters: int, batch: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of free_swa at each level, each measured in a loop that alternates
    it with the bare ops it must do (so both sides see the same machine state)."""
    bare = _BareFreeSwa(batch, device)
    out: dict[str, float] = {}
    for level in LEVELS:
        name = level.name
        strict = level == InvariantCheckLevel.STRICT
        run = bare.run_checked if strict else bare.run
        run_deferred = bare.run_deferred_checked if strict else bare.run_deferred
        out[f"bare@{name}"], out[name] = _paired(iters, device, run, _FreeSwa(batch, device),
                                                 name, bare)
        out[f"bare_deferred@{name}"], out[f"grouped_{name}"] = _paired(
            iters, device, run_deferred, _FreeSwa(batch, device, grouped=True), name, bare)
        if strict:
            # The same case against the bare ops without the check, for comparison.
            out[f"bare_unchecked@{name}"], out[f"{name}_vs_unchecked"] = _paired(
                iters, device, bare.run, _FreeSwa(batch, device), name, bare)
            out[f"bare_deferred_unchecked@{name}"], out[f"grouped_{name}_vs_unchecked"] = _paired(
                iters, device, bare.run_deferred, _FreeSwa(batch, device, grouped=True), name, bare)
    return out


def bench_throughput(iters: int, batch: int, device: torch.device) -> dict[int, float]:
    """Median alloc+free pairs per second through the SWA allocator, per page size (level OFF)."""
    allocators = {
        page: SWATokenToKVPoolAllocator(
            8 * _round_up(batch, page), 4 * _round_up(batch, page), page, device
        )
        for page in THROUGHPUT_PAGE_SIZES
    }
    samples: dict[int, list[float]] = {page: [] for page in allocators}
    pages = list(allocators)
    rounds = max(iters // 10, 5)
    for rep in range(rounds + 1):
        shift = rep % len(pages)
        for page in pages[shift:] + pages[:shift]:
            allocator, need = allocators[page], _round_up(batch, page)

            def pairs(allocator: SWATokenToKVPoolAllocator = allocator, need: int = need) -> None:
                for _ in range(PAIRS_PER_SAMPLE):
                    idx = allocator.alloc(need)
                    assert idx is not None
                    allocator.free(idx)

            with override_level(InvariantCheckLevel.OFF):
                seconds = _time_once(pairs, device)
            if rep:
                samples[page].append(PAIRS_PER_SAMPLE / seconds)
    return {page: statistics.median(values) for page, values in samples.items()}


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=400, help="timed repetitions per variant")
    parser.add_argument("--batch", type=int, default=64, help="slots freed per free_swa call")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a loaded 2-core machine more threads make small "
        "ops wait on each other, as in bench_vs_sglang.py; 0 keeps torch's default)",
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.batch < 1:
        parser.error("--iters and --batch must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)

    free_swa = bench_free_swa(args.iters, args.batch, device)
    throughput = bench_throughput(args.iters, args.batch, device)
    ratios = {lv.name: free_swa[lv.name] / free_swa[f"bare@{lv.name}"] for lv in LEVELS}
    grouped = {lv.name: free_swa[f"grouped_{lv.name}"] / free_swa[f"bare_deferred@{lv.name}"] for lv in LEVELS}
    unchecked = {
        "free": free_swa["STRICT_vs_unchecked"] / free_swa["bare_unchecked@STRICT"],
        "grouped": free_swa["grouped_STRICT_vs_unchecked"] / free_swa["bare_deferred_unchecked@STRICT"],
    }

    head = (f"free_swa, page_size 1, batch {args.batch}, {args.iters} reps, {device.type}, "
            f"{torch.get_num_threads()} threads")
    print(f"{head}, median us/call")
    print(f"{'':<16}" + "".join(f"{level.name:>10}" for level in LEVELS))
    print(f"{'bare ops':<16}" + "".join(f"{free_swa['bare@' + lv.name] * 1e6:>10.1f}" for lv in LEVELS))
    print(f"{'free_swa':<16}" + "".join(f"{free_swa[level.name] * 1e6:>10.1f}" for level in LEVELS))
    print(f"{'free_swa/bare':<16}" + "".join(f"{ratios[level.name]:>9.2f}x" for level in LEVELS))
    print(f"{'  (no check)':<16}{'':>10}{unchecked['free']:>9.2f}x   (STRICT vs bare ops without the assert)")
    print()
    print("inside a free group (the engine's path: the release is batched at free_group_end)")
    print(f"{'bare deferred':<16}" + "".join(f"{free_swa['bare_deferred@' + lv.name] * 1e6:>10.1f}" for lv in LEVELS))
    print(f"{'free_swa':<16}" + "".join(f"{free_swa['grouped_' + level.name] * 1e6:>10.1f}" for level in LEVELS))
    print(f"{'free_swa/bare':<16}" + "".join(f"{grouped[level.name]:>9.2f}x" for level in LEVELS))
    print(f"{'  (no check)':<16}{'':>10}{unchecked['grouped']:>9.2f}x   (STRICT vs bare ops without the assert)")
    print()
    print(f"alloc+free through the SWA allocator, batch {args.batch} (whole pages), level OFF")
    print(f"{'page_size':<16}{'pairs/s':>10}{'tokens/s':>12}")
    for page, rate in throughput.items():
        print(f"{page:<16}{rate:>10.0f}{rate * _round_up(args.batch, page):>12.0f}")
    print(
        json.dumps(
            {
                "bench": "alloc",
                "device": device.type,
                "torch": torch.__version__,
                "batch": args.batch,
                "iters": args.iters,
                "threads": torch.get_num_threads(),
                "free_swa_us": {k.lower(): v * 1e6 for k, v in free_swa.items()},
                "free_swa_over_bare": {level.name.lower(): ratios[level.name] for level in LEVELS},
                "grouped_free_swa_over_bare": {level.name.lower(): grouped[level.name] for level in LEVELS},
                "strict_over_bare_without_check": unchecked,
                "alloc_free_pairs_per_s": {str(page): rate for page, rate in throughput.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
