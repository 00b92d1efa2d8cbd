"""Our SWA allocator against SGLang's own, side by side in one process, on the CPU.

    .venv-sglang/bin/python scripts/bench_vs_sglang.py [--iters N] [--runs 5] [--batches 64,1024]
        [--levels off,warn,strict] [--page-sizes 1,16] [--threads 1] [--need-sort]
        [--full-size N --swa-size N]

Needs an interpreter that imports both `sglang` (0.5.23; see scripts/make-sglang-venv.sh) and
this repository's `engine_stub` (the repo root is put on sys.path; engine_stub.mem needs only
torch). Where `sglang` does not import, it says so in one line and exits 0.

Paths, each timed as one call (alloc and its frees together), per page size, batch and level:

  group: alloc(N), then free_group_begin; free_swa(idx); free_full(idx); free_group_end
  free:  alloc(N), then free(idx)

On page_size 1, alloc is `alloc(N)`. On larger pages SGLang's SWA `alloc` is for page_size 1
only, so both sides use `alloc_extend` of N tokens: fresh prefills of one page each (the last
one partial when N is not a multiple of the page), with each side's own argument shapes built
once, off the clock. Each iteration runs ours once and SGLang's once, the order swapped every
iteration, so that machine noise lands on both alike; each figure is the median per call, and
each cell is measured `--runs` times (fresh allocators each time): the cell shows the run whose
ratio is the median of them, and `run_ratios` in the JSON lists them all.
Both allocators get the same sizes and need_sort, and the same invariant level: ours through
`engine_stub.invariants.set_default_level`, SGLang's through its `SGLANG_INVARIANT_CHECK`
(an integer there: 0 off, 1 warn, 2 strict; a word reads as invalid and falls back to off),
which `sglang.srt.utils.invariants.resolve_level` re-reads on every `expect`.

Once per iteration, after both sides' calls (so each side follows it equally often) and off
both clocks, ours gets the engine's per-step read-back (`Scheduler._read_back` and
`_end_of_step`, allocator and invariant parts; it also checks that nothing fired): the drop
counters and
the invariant counters in one device-to-host copy, `note_drop_totals`, `drain_firings`. The engine
makes it once per step, riding on the copy of the sampled tokens it makes anyway, and one call
here is one step's worth of allocator work (an alloc and the frees of it); without it our free
lists never learn that their freed entries are real pages, and an alloc that reaches them pays
`_drop_holes` (a read of the kept masks: a sync on a GPU), which the engine pays only when a pool
runs short before the read-back. SGLang has no such read-back (its page_size 1 free keeps no
drop decision to verify; its count path reads its counters back on every record, on its clock).
With checks on, the read-back is also where the drop invariants' counts of our frees are folded
(with the drop counters, one fold per step). Its cost is not hidden: `rb_us` is its median,
measured in the same loop, and `ratio_rb` the ratio with it added to ours (a per-step cost
charged to a single call: an upper bound). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LEVEL_NAMES = ("off", "warn", "strict")
PATHS = ("group", "free")


def _csv(kind):
    def parse(text: str):
        return [kind(part) for part in text.split(",") if part.strip()]

    return parse


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iters", type=int, default=300, help="timed calls per side and cell (default 300)"
    )
    parser.add_argument(
        "--runs", type=int, default=5,
        help="independent measurements per cell; the cell shows the median ratio's (default 5)",
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed calls per side first (default 20)"
    )
    parser.add_argument(
        "--batches", type=_csv(int), default=[64, 1024], help="tokens per alloc (default 64,1024)"
    )
    parser.add_argument(
        "--levels", type=_csv(str), default=list(LEVEL_NAMES), help="off,warn,strict"
    )
    parser.add_argument("--page-sizes", type=_csv(int), default=[1, 16], help="default 1,16")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both (default 1: on a loaded 2-core machine more threads make "
        "small ops wait on each other; 0 keeps torch's default)",
    )
    parser.add_argument(
        "--need-sort", action="store_true", help="need_sort=True on both (SGLang serves with False)"
    )
    parser.add_argument(
        "--full-size", type=int, default=None, help="full-pool slots (default 4 x batch)"
    )
    parser.add_argument(
        "--swa-size", type=int, default=None, help="SWA-pool slots (default 2 x batch)"
    )
    args = parser.parse_args(argv)
    bad = [name for name in args.levels if name.lower() not in LEVEL_NAMES]
    if bad:
        parser.error(f"--levels: {bad} not in {LEVEL_NAMES}")
    args.levels = [name.lower() for name in args.levels]
    return args


def _import_sglang():
    """SGLang's allocator modules, or the reason they do not import (one line)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            try:
                import sglang
                from sglang.srt.environ import envs
                from sglang.srt.mem_cache.allocator import swa as sgl_swa
                from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
                from sglang.srt.utils import invariants as sgl_invariants
            finally:
                logging.disable(logging.NOTSET)
    except Exception as exc:  # ImportError, or a broken install (e.g. torchvision's nms)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return (sglang, envs, sgl_swa, BaseSWAKVPool, sgl_invariants), None


# --------------------------------------------------------------------------------------------
# The two allocators behind one small interface.


def _make_fake_kvpool(base_cls, torch):
    class FakeSWAKVPool(base_cls):
        """The least BaseSWAKVPool the allocator needs: it holds the mapping, nothing else."""

        swa_req_ring_size = None

        def __init__(self, size: int, size_swa: int, page_size: int, device: str) -> None:
            # KVCache.__init__ would allocate buffers and a memory saver; none are needed here.
            self.size, self.size_swa, self.page_size, self.device = (
                size,
                size_swa,
                page_size,
                device,
            )
            self.dtype = self.store_dtype = torch.bfloat16
            self.full_kv_pool = None
            self.swa_kv_pool = None
            self.full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            # As SGLang's SWAKVPool: -1 maps to -1 through the mapping's trailing entry.
            return self.full_to_swa_index_mapping[kv_indices]

        def get_key_buffer(self, layer_id):
            raise NotImplementedError

        def get_value_buffer(self, layer_id):
            raise NotImplementedError

        def get_kv_buffer(self, layer_id):
            raise NotImplementedError

        def set_kv_buffer(self, *args, **kwargs):
            raise NotImplementedError

        def get_state_buf_infos(self):
            return [], [], []

    return FakeSWAKVPool


def _extend_shape(batch: int, page: int) -> tuple[list[int], list[int]]:
    """Fresh prefills of one page each, the last one partial: prefix and seq lengths."""
    seq = [page] * (batch // page) + ([batch % page] if batch % page else [])
    return [0] * len(seq), seq


class _Side:
    """One allocator, its alloc for this cell, and its two paths."""

    name: str

    def __init__(self, allocator, torch, batch: int, page: int) -> None:
        self.a = allocator
        self.batch = batch
        self.page = page
        self.prefix, self.seq = _extend_shape(batch, page)
        self.last_loc = torch.full((len(self.seq),), -1, dtype=torch.int64)

    def alloc(self):
        raise NotImplementedError

    def path_group(self) -> None:
        a = self.a
        idx = self.alloc()
        a.free_group_begin()
        a.free_swa(idx)
        a.free_full(idx)
        a.free_group_end()

    def path_free(self) -> None:
        self.a.free(self.alloc())

    def available(self) -> tuple[int, int]:
        return self.a.full_available_size(), self.a.swa_available_size()


class _Ours(_Side):
    name = "ours"

    def __init__(self, torch, batch, page, size, size_swa, need_sort) -> None:
        from engine_stub.mem import SWATokenToKVPoolAllocator

        params = inspect.signature(SWATokenToKVPoolAllocator).parameters
        kwargs = {}
        if "need_sort" in params:
            kwargs["need_sort"] = need_sort
        elif need_sort:
            raise SystemExit("bench_vs_sglang: our allocator takes no need_sort; drop --need-sort")
        super().__init__(
            SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", **kwargs), torch, batch, page
        )
        self.kwargs = kwargs
        extend = inspect.signature(self.a.alloc_extend).parameters
        # Tolerate our alloc_extend taking SGLang's argument list (device + host tensors).
        self.sglang_style_extend = "prefix_lens_cpu" in extend
        if self.sglang_style_extend:
            self.extend_args = _sglang_extend_args(
                torch, self.prefix, self.seq, self.last_loc, batch
            )
        else:
            self.extend_args = (self.prefix, self.seq, self.last_loc, batch)

    def alloc(self):
        if self.page == 1:
            return self.a.alloc(self.batch)
        return self.a.alloc_extend(*self.extend_args)

    def readback(self) -> None:
        """The engine's per-step read-back, as `Scheduler._read_back` and `_end_of_step` make it
        (the allocator's and the invariants' parts; the engine's copy also carries the tokens)."""
        import torch

        from engine_stub import invariants

        names, counters = invariants.counter_snapshot()
        parts = [self.a.drop_counter()] + ([counters] if counters is not None else [])
        host = torch.cat(parts).tolist()
        self.a.note_drop_totals(host[:2])
        totals: dict[str, int] = {}
        for name, value in zip(names, host[2:], strict=True):
            totals[name] = totals.get(name, 0) + int(value)
        firings = invariants.drain_firings(totals)
        if firings:  # the paths free what they allocated: nothing may fire
            raise SystemExit(f"bench_vs_sglang: ours fired {[f.name for f in firings]}")


def _sglang_extend_args(torch, prefix, seq, last_loc, batch):
    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    seq_t = torch.tensor(seq, dtype=torch.int64)
    return (prefix_t, prefix_t.clone(), seq_t, seq_t.clone(), last_loc, batch)


class _SGLang(_Side):
    name = "sglang"

    def __init__(
        self, torch, sgl_swa, fake_pool_cls, batch, page, size, size_swa, need_sort
    ) -> None:
        kvcache = fake_pool_cls(size, size_swa, page, "cpu")
        allocator = sgl_swa.SWATokenToKVPoolAllocator(
            size, size_swa, page, torch.bfloat16, "cpu", kvcache, need_sort
        )
        super().__init__(allocator, torch, batch, page)
        self.extend_args = _sglang_extend_args(torch, self.prefix, self.seq, self.last_loc, batch)

    def alloc(self):
        if self.page == 1:
            return self.a.alloc(self.batch)
        return self.a.alloc_extend(*self.extend_args)


# --------------------------------------------------------------------------------------------
# Levels.


def _set_levels(name: str, envs, sgl_invariants) -> tuple[str, str]:
    """Put both sides at `name`; returns the level each side reports back."""
    from engine_stub import invariants as ours

    level = ours.InvariantCheckLevel[name.upper()]
    ours.set_default_level(level)
    envs.SGLANG_INVARIANT_CHECK.set(int(level))  # an EnvInt: "0"/"1"/"2"
    return ours.resolve_level().name.lower(), sgl_invariants.resolve_level().name.lower()


# --------------------------------------------------------------------------------------------
# Timing.


def _check_path(side: _Side, path: str) -> None:
    """One untimed call: the alloc succeeds with N slots and the path gives every slot back."""
    before = side.available()
    idx = side.alloc()
    if idx is None or int(idx.numel()) != side.batch:
        got = None if idx is None else int(idx.numel())
        raise SystemExit(
            f"bench_vs_sglang: {side.name} alloc returned {got} slots, wanted {side.batch}"
        )
    side.a.free(idx)
    getattr(side, f"path_{path}")()
    # Ours may stage frees until an alloc runs short; count staged ones as free, as it does.
    after = side.available()
    if after != before:
        raise SystemExit(
            f"bench_vs_sglang: {side.name} {path} path leaked: available {before} -> {after}"
        )


def _time_pair(
    ours: _Ours, theirs: _Side, path: str, iters: int, warmup: int
) -> tuple[float, float, float]:
    """Median us per call of ours, of theirs, and of our read-back (off our clock)."""
    run_ours = getattr(ours, f"path_{path}")
    run_theirs = getattr(theirs, f"path_{path}")
    readback = ours.readback
    for _ in range(warmup):
        run_ours()
        readback()
        run_theirs()
    t_ours: list[int] = []
    t_theirs: list[int] = []
    t_readback: list[int] = []
    clock = time.perf_counter_ns

    def timed(fn, sink: list[int]) -> None:
        start = clock()
        fn()
        sink.append(clock() - start)

    gc.collect()
    gc.disable()
    try:
        for i in range(iters):
            order = ((run_ours, t_ours), (run_theirs, t_theirs))
            for fn, sink in order if i % 2 == 0 else order[::-1]:
                timed(fn, sink)
            # After both, so that each side follows it (and the other side) equally often.
            timed(readback, t_readback)
    finally:
        gc.enable()
    return (
        statistics.median(t_ours) / 1e3,
        statistics.median(t_theirs) / 1e3,
        statistics.median(t_readback) / 1e3,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    modules, why = _import_sglang()
    if modules is None:
        print(
            f"bench_vs_sglang: skipped, sglang does not import here ({why}); run it with the python of a venv made by scripts/make-sglang-venv.sh"
        )
        return 0
    sglang, envs, sgl_swa, base_pool_cls, sgl_invariants = modules
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    fake_pool_cls = _make_fake_kvpool(base_pool_cls, torch)
    print(
        f"bench_vs_sglang: sglang {sglang.__version__} vs engine_stub ({REPO_ROOT}), torch {torch.__version__}, "
        f"cpu, {torch.get_num_threads()} threads, need_sort={args.need_sort}, iters={args.iters}, median us per call"
    )
    rows = []
    header = (
        f"{'page':>4} {'batch':>5} {'level':>6} {'path':>5} {'full/swa':>11} {'ours_us':>9} "
        f"{'sglang_us':>9} {'ratio':>6} {'rb_us':>6} {'ratio_rb':>8}"
    )
    print(header)
    print("-" * len(header))
    for page in args.page_sizes:
        for batch in args.batches:
            size = args.full_size or 4 * batch
            size_swa = args.swa_size or 2 * batch
            size, size_swa = (-(-size // page) * page, -(-size_swa // page) * page)
            for level in args.levels:
                ours_level, sgl_level = _set_levels(level, envs, sgl_invariants)
                if ours_level != level or sgl_level != level:
                    raise SystemExit(
                        f"bench_vs_sglang: level {level}: ours reads {ours_level}, sglang {sgl_level}"
                    )
                for path in PATHS:
                    runs = []
                    for _ in range(args.runs):
                        # Fresh allocators per cell and run: no state carries over.
                        ours = _Ours(torch, batch, page, size, size_swa, args.need_sort)
                        theirs = _SGLang(
                            torch, sgl_swa, fake_pool_cls, batch, page, size, size_swa, args.need_sort
                        )
                        for side in (ours, theirs):
                            _check_path(side, path)
                        runs.append(_time_pair(ours, theirs, path, args.iters, args.warmup))
                    # The cell's figures: the run with the median ratio (all three from one run).
                    us_ours, us_theirs, us_rb = sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]
                    ratio = us_ours / us_theirs
                    ratio_rb = (us_ours + us_rb) / us_theirs
                    rows.append(
                        {
                            "page_size": page,
                            "batch": batch,
                            "level": level,
                            "path": path,
                            "size": size,
                            "size_swa": size_swa,
                            "ours_us": round(us_ours, 1),
                            "sglang_us": round(us_theirs, 1),
                            "ratio": round(ratio, 3),
                            "readback_us": round(us_rb, 1),
                            "ratio_with_readback": round(ratio_rb, 3),
                            "run_ratios": [round(r[0] / r[1], 3) for r in runs],
                        }
                    )
                    print(
                        f"{page:>4} {batch:>5} {level:>6} {path:>5} {f'{size}/{size_swa}':>11} "
                        f"{us_ours:>9.1f} {us_theirs:>9.1f} {ratio:>5.2f}x {us_rb:>6.1f} {ratio_rb:>7.2f}x",
                        flush=True,
                    )
    worst = max(rows, key=lambda row: row["ratio"]) if rows else None
    if worst:
        print(
            f"worst ratio {worst['ratio']:.2f}x (target <= 1.0x): page {worst['page_size']}, "
            f"batch {worst['batch']}, {worst['level']}, {worst['path']}"
        )
    print(
        json.dumps(
            {
                "bench": "vs_sglang",
                "sglang": sglang.__version__,
                "torch": torch.__version__,
                "need_sort": args.need_sort,
                "iters": args.iters,
                "threads": torch.get_num_threads(),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
