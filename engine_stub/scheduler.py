"""Scheduler: continuous batching over the hybrid SWA memory path.

One `step()` is a prefill batch (when waiting requests can be admitted, or a chunked prefill goes
on) or else a decode batch. Decode first slides the requests' windows (`free_swa` below the
`swa_evicted_seqlen` frontier, rate-limited per request as in SGLang), then allocates one slot per
request. A finished request goes into the radix cache (its window-evicted range as tombstones) or
is freed.

Chunked prefill (SGLang's `chunked_prefill_size`, without its mixed chunks): a prompt longer than
the chunk is prefilled a chunk per step, one chunked request at a time, ahead of new prefills and
of decodes. At each chunk boundary its window frontier moves (the SWA peers no later chunk reads
are freed), and with a radix cache the processed part is cached as SGLang's
`cache_unfinished_req` does (the evicted head as a tombstone, the lock moved to the new last
node, `cache_protected_len` raised), so a prompt of any length runs on an SWA pool of a few
windows.

Free groups follow SGLang's scheduler: the frees of finishing requests (its
`process_batch_result`) run inside one group, and whatever an allocation needs freed first
(window eviction, radix eviction) is released before the allocation runs, never deferred past it:
a slot queued in an open group is not available until the group ends.
The KV canary brackets each forward; invariant counters and canary masks are read once, at the
end of the step, where the engine synchronizes anyway to learn the sampled tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from engine_stub.admission import full_reserve, refusal
from engine_stub.census import MemoryCensus
from engine_stub.config import EngineConfig
from engine_stub.events import EventLog
from engine_stub.idle_check import IdleChecker
from engine_stub.invariants import (
    Bucket,
    Invariant,
    InvariantCheckLevel,
    IsTrue,
    counter_snapshot,
    drain_firings,
    expect,
    hit_counts,
    override_level,
    resolve_level,
)
from engine_stub.kv_canary import CanaryRequest, CanaryViolation, KVCanary
from engine_stub.mem import ReqToTokenPool, SWATokenToKVPoolAllocator
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.mem.radix import SWARadixCache
from engine_stub.model import ForwardBatch, ModelConfig, TinyHybridModel, sample
from engine_stub.perturb.sites import (
    NO_FINISH_EFFECT,
    AfterForward,
    BeforeStep,
    CacheHit,
    ChunkBoundary,
    ReqState,
    RequestFinish,
    Sampling,
    SiteContext,
    WindowEviction,
)
from engine_stub.req import Req, RequestRejected

__all__ = ["Scheduler", "CanaryRaised"]

DECODE_STALL = Invariant(
    "sched.decode_stall", Bucket.GUARD, IsTrue(), site="Scheduler._schedule_decode",
    description="decode could not allocate one slot per running request (a pool ran dry)",
)
ADMISSION_STALL = Invariant(
    "sched.admission_stall", Bucket.GUARD, IsTrue(), site="Scheduler.step",
    description="nothing runs and neither the next waiting request nor the next prefill chunk can "
                "be allocated (something leaked)",
)

PREFIX_ROW = Invariant(
    "sched.prefix_row", Bucket.GUARD, IsTrue(), site="Scheduler._cache_unfinished, Scheduler._release_kv",
    description="below cache_protected_len a request's row holds the radix cache's slots of the "
                "prefix it locked",
)


class CanaryRaised(RuntimeError):
    """kv_canary=raise saw violations; the engine dies after logging them."""

    def __init__(self, violations: list[CanaryViolation]) -> None:
        super().__init__("\n".join(v.log_line() for v in violations[:8]))
        self.violations = violations


def _memory_backend(name: str):
    """The hybrid allocator class of a `memory` knob value: ours, or SGLang's own behind an
    adapter (`sglang`, `sglang-allocator`; imported only when chosen: it needs an installed
    sglang)."""
    if name in ("sglang", "sglang-allocator"):
        from engine_stub.mem.sglang_backend import SGLangSWAAllocator, set_level_from

        set_level_from()
        return SGLangSWAAllocator
    return SWATokenToKVPoolAllocator


def _req_to_token_backend(name: str):
    """The request-row table of a `memory` knob value: SGLang's own only for `sglang`."""
    if name == "sglang":
        from engine_stub.mem.sglang_req_to_token import SGLangReqToTokenPool

        return SGLangReqToTokenPool
    return ReqToTokenPool


def _tree_cache(config: EngineConfig, allocator: Any, req_to_token_pool: Any) -> Any:
    """The radix cache of a config with one: SGLang's own tree for `memory: sglang`, else ours."""
    if config.memory == "sglang":
        from engine_stub.mem.sglang_tree import SGLangRadixCache

        return SGLangRadixCache(allocator, req_to_token_pool, config.page_size, config.window,
                                chunked_prefill_size=config.prefill_chunk_tokens)
    return SWARadixCache(allocator, config.page_size, config.window)


def memory_parts(config: EngineConfig) -> dict[str, str | None]:
    """Whose each part of the memory path is: `native` or `sglang-<version>` (the installed
    release), per part (`allocator`, `radix_cache`: None without one, `req_to_token`).

    `memory: sglang` is every part the release has; `sglang-allocator` its allocator only."""
    sglang = None
    if config.memory != "native":
        from engine_stub.mem.sglang_backend import sglang_version

        sglang = f"sglang-{sglang_version()}"
    every = sglang if config.memory == "sglang" else "native"
    return {"allocator": sglang or "native",
            "radix_cache": every if config.radix_cache else None,
            "req_to_token": every}


def _page_floor(n: int, page: int) -> int:
    return n - n % page


def _page_ceil(n: int, page: int) -> int:
    return -(-n // page) * page


class Scheduler:
    """Owns the pools, the model, the canary and the request queues; `step()` advances them."""

    def __init__(self, config: EngineConfig, events: EventLog, perturber: Any = None) -> None:
        self.config = config
        self.events = events
        self.device = torch.device(config.resolved_device())
        self.page_size = config.page_size
        self.window = config.window
        # Decode batches between two window evictions of a request (SGLang's older cadence,
        # `decode_batch_idx % sliding_window_size == 1`; see `_evict_windows`).
        self.swa_eviction_interval = config.window
        self.kv_pool = HybridKVPool(
            layer_pattern=config.layer_pattern,
            full_size=config.full_pool_tokens,
            swa_size=config.swa_pool_tokens,
            page_size=config.page_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            device=self.device,
        )
        # need_sort=False: SGLang's value outside PD disaggregation. The allocator registers its
        # mapping with the KV pool.
        self.allocator = _memory_backend(config.memory)(
            config.full_pool_tokens, config.swa_pool_tokens, config.page_size, self.device,
            dtype=self.kv_pool.dtype, kvcache=self.kv_pool, need_sort=False,
        )
        # SGLang's own invariant counters, read back with ours (the sglang backend only).
        self._extra_counters = getattr(self.allocator, "invariant_counters", None)
        # With a scenario loaded, every landing's damage is followed until read or dead; the
        # allocator then reports its reads and frees (perturb/reach.py). Without one: nothing.
        self.reach = perturber.attach(self) if perturber is not None else None
        if self.reach is not None:
            self.allocator = perturber.tracking(self.allocator)
        self.req_to_token_pool = _req_to_token_backend(config.memory)(
            config.max_running_requests, config.max_context_len, self.device)
        self.model = TinyHybridModel(
            ModelConfig(config.layer_pattern, config.window, config.hidden_size, config.num_heads, config.seed),
            self.device,
        )
        self.tree_cache = (
            _tree_cache(config, self.allocator, self.req_to_token_pool) if config.radix_cache else None
        )
        # Whose each part of the memory path is (native, or sglang-<version>).
        self.memory_parts = memory_parts(config)
        self.canary = KVCanary(config.kv_canary, self.kv_pool, config.window, config.kv_canary_sweep_interval)
        self.census = MemoryCensus(self)
        self.idle = IdleChecker(self, self.census, strict=config.strict_mem_check_during_idle)
        self.perturber = perturber
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # Tokens of one prefill chunk (None: chunking off), and the request being prefilled in
        # chunks (at most one, as in SGLang): admitted, holding a row, in neither list above.
        self.chunk_tokens = config.prefill_chunk_tokens
        self.chunked_req: Req | None = None
        self.step_no = 0
        self.order_by_rid = config.gate_requests > 0
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0, "generated_tokens": 0,
                      "cached_tokens": 0, "swa_evicted_tokens": 0, "finished_requests": 0,
                      "aborted_requests": 0, "prefill_chunks": 0, "chunked_requests": 0}
        self._swa_ever_used = torch.zeros(self.kv_pool.swa_rows, dtype=torch.bool, device=self.device)
        self._swa_reused = torch.zeros((), dtype=torch.int64, device=self.device)
        self._divergent_allocs = torch.zeros((), dtype=torch.int64, device=self.device)
        # Host copies read back with the step's tokens (None: read them at the end of the step).
        self._read_totals: dict[str, int] | None = None
        self._read_canary: list[int] | None = None

    # ---- requests --------------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise RequestRejected when a request could never be served by this config (the rule:
        `admission.refusal`, torch-free, which `canary validate` asks too)."""
        refused = refusal(self.config, prompt_len, max_new_tokens)
        if refused is not None:
            message, param = refused
            raise RequestRejected(message, param=param)

    def add_request(self, req: Req) -> None:
        self.check_fits(req.prompt_len, req.max_new_tokens)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req is not None)

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> None:
        """Run one prefill or decode batch, then read back firings and violations."""
        self.step_no += 1
        self.events.step = self.step_no
        moves = self._ownership_moves()
        if self.perturber is not None:
            self._hook(BeforeStep())
        self._drop_aborted()
        batch_reqs = self._schedule_prefill()
        kind = "prefill"
        if not batch_reqs:
            kind = "decode"
            batch_reqs = self._schedule_decode()
        if batch_reqs:
            self._run_batch(kind, batch_reqs)
        elif not self.running and (self.waiting or self.chunked_req is not None):
            self._admission_stalled()
        self._end_of_step(kind if batch_reqs else "stall")
        if moves != self._ownership_moves() and resolve_level() == InvariantCheckLevel.STRICT:
            # Slots changed hands between the requests, the tree and the free list: the census,
            # count-only (engine_stub/census.py says why), read back with the next step.
            with override_level(InvariantCheckLevel.WARN):
                self.census.check().expect_all()

    def _ownership_moves(self) -> tuple[int, ...]:
        """What moves slots between the requests, the tree and the free list, counted so far:
        finishes (aborts included), chunk boundaries, cache hits."""
        stats = self.stats
        return stats["finished_requests"], stats["prefill_chunks"], stats["cached_tokens"]

    def _admission_stalled(self) -> None:
        """Nothing runs, yet the head of the queue cannot be admitted.

        A request no empty engine could admit is refused at `add_request`, so an engine with
        nothing running must admit its next request (or allocate the next chunk of the one it
        prefills in chunks, which admission reserved): whatever blocks it (pool slots, request
        rows, radix locks) is held by no running request, i.e. leaked. SGLang would wait here
        forever (its idle checks wait for a fully idle engine); we run the idle ledgers first,
        which name what leaked, then fire the guard. Where neither crashes the engine, the
        chunked request or else the head request is aborted (the client gets a 503), so a
        leaking engine cannot spin.
        """
        self.events.write("admission_stall", waiting=len(self.waiting),
                          chunked=self.chunked_req.rid if self.chunked_req is not None else None,
                          full_available=self.allocator.full_available_size(),
                          swa_available=self.allocator.swa_available_size(),
                          free_rows=self.req_to_token_pool.available_size())
        if self.chunked_req is None:
            self.idle_tick()  # at STRICT the guard's crash path drains the ledgers' firings first
        expect(ADMISSION_STALL, torch.tensor(False), "an idle engine cannot admit its next request")
        if self.chunked_req is not None:
            req = self.chunked_req
            self.stats["aborted_requests"] += 1
            req.finish_reason = "abort"
            with self._free_group():
                self._finish(req)
        else:
            self._abort_waiting(self.waiting[0])

    def _run_batch(self, kind: str, reqs: list[Req]) -> None:
        batch, canary_reqs = self._forward_batch(kind, reqs)
        token_table = self.req_to_token_pool.req_to_token
        self.canary.verify("HEAD", canary_reqs, token_table, self.step_no)
        reach = self.reach if self.reach is not None and self.reach.open else None
        if reach is not None:
            self._observe(reach, "head", reqs, batch)
        logits = self.model.forward(batch, self.kv_pool, token_table)
        if reach is not None:
            self._observe(reach, "forward", reqs, batch)
        for req, seq_len in zip(reqs, batch.seq_lens, strict=True):
            req.kv_len = seq_len
        if self.perturber is not None:
            self._hook(AfterForward(tuple(map(ReqState.of, reqs))))
        # The new records, then the TAIL verify (one read of req_to_token, mapping and KV for both).
        self.canary.write_and_verify_tail(canary_reqs, token_table, self.step_no)
        if self.reach is not None and self.reach.open:
            self._observe(self.reach, "tail", reqs, batch)
        self._maybe_sweep()
        # A chunk that does not end the prompt samples nothing (SGLang discards its logits).
        sampling = [r for r in reqs if r.prefill_done]
        if len(sampling) < len(reqs):
            keep = [i for i, r in enumerate(reqs) if r.prefill_done]
            logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
        sampled = sample(logits, [r.temperature for r in sampling], [r.generator for r in sampling])
        next_ids = self._read_back(sampled)
        for req, token in zip(sampling, next_ids, strict=True):
            self.canary.note_sampled(req.rid, token)
        if self.perturber is not None and sampling:
            next_ids = self._hook(Sampling(tuple(map(ReqState.of, sampling)), tuple(next_ids))).next_ids
        self.stats[f"{kind}_steps"] += 1
        self.stats["generated_tokens"] += len(sampling)
        finished = []
        for req, token in zip(sampling, next_ids, strict=True):
            req.output_ids.append(int(token))
            if req.remaining_new_tokens == 0:
                req.finish_reason = "length"
                finished.append(req)
        if kind == "prefill":
            self.running.extend(sampling)
        if finished:
            with self._free_group():
                for req in finished:
                    self._finish(req)
        for req in reqs:
            if not req.prefill_done:
                self._chunk_boundary(req)

    def _observe(self, reach: Any, phase: str, reqs: list[Req], batch: ForwardBatch) -> None:
        """What this batch's reader (`phase`: head, forward, tail) touches, for reachability."""
        reach.batch(phase, batch.req_pool_indices, batch.prefix_lens, batch.seq_lens,
                    self.req_to_token_pool.req_to_token, self.allocator.full_to_swa_index_mapping,
                    [r.rid for r in reqs], out_slots=batch.out_cache_loc if phase == "forward" else None)

    def close_tracking(self) -> None:
        """The engine stops: whatever damage nothing read died unread (reachability)."""
        if self.reach is not None:
            self.reach.close()

    @contextlib.contextmanager
    def _free_group(self) -> Iterator[None]:
        """Batch the frees of a block into one release at its end (nothing to allocate inside)."""
        self.allocator.free_group_begin()
        try:
            yield
        except BaseException:
            # The block's own error is the crash's cause: a release that fails after it (on CUDA
            # every call does once a device assert has fired) must not replace it.
            with contextlib.suppress(Exception):
                self.allocator.free_group_end()
            raise
        self.allocator.free_group_end()

    def _abort_waiting(self, req: Req) -> None:
        """Take a request that holds nothing yet off the queue, finished as aborted."""
        self.waiting.remove(req)
        self.stats["aborted_requests"] += 1
        req.finish_reason = "abort"
        req.finished_step = self.step_no
        self.events.write("request_finished", rid=req.rid, output_len=0, admitted_step=-1,
                          finish_reason="abort")
        if req.on_finish is not None:
            req.on_finish(req)

    def _drop_aborted(self) -> None:
        """Finish every request whose client gave up (`Req.abort_requested`), freeing its KV."""
        for req in [r for r in self.waiting if r.abort_requested]:
            self._abort_waiting(req)
        holders = self.running if self.chunked_req is None else [self.chunked_req, *self.running]
        aborted = [r for r in holders if r.abort_requested and not r.finished]
        if aborted:
            with self._free_group():
                for req in aborted:
                    self.stats["aborted_requests"] += 1
                    req.finish_reason = "abort"
                    self._finish(req)

    def _forward_batch(self, kind: str, reqs: list[Req]) -> tuple[ForwardBatch, list[CanaryRequest]]:
        if kind == "prefill":
            # A new request extends from its cached prefix, a chunked one from its last chunk.
            prefix_lens = [max(r.kv_len, r.cache_protected_len) for r in reqs]
            seq_lens = [r.prefill_end for r in reqs]
            new_ids = [r.origin_input_ids[lo:hi] for r, lo, hi in zip(reqs, prefix_lens, seq_lens, strict=True)]
        else:
            prefix_lens = [r.kv_len for r in reqs]
            seq_lens = [r.kv_len + 1 for r in reqs]
            new_ids = [[r.output_ids[-1]] for r in reqs]
        rows = [r.row for r in reqs]
        positions = [p for lo, hi in zip(prefix_lens, seq_lens, strict=True) for p in range(lo, hi)]
        flat_ids = [t for ids in new_ids for t in ids]
        table = self.req_to_token_pool.req_to_token
        row_idx = torch.tensor([r for r, lo, hi in zip(rows, prefix_lens, seq_lens, strict=True) for _ in range(lo, hi)],
                               dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        out_cache_loc = table[row_idx, pos_t].to(torch.int64)
        batch = ForwardBatch(rows, prefix_lens, seq_lens,
                             torch.tensor(flat_ids, dtype=torch.int64, device=self.device), pos_t, out_cache_loc)
        canary_reqs = [CanaryRequest(r.rid, r.row, lo, hi, ids)
                       for r, lo, hi, ids in zip(reqs, prefix_lens, seq_lens, new_ids, strict=True)]
        return batch, canary_reqs

    # ---- prefill admission --------------------------------------------------------------------

    def _swa_headroom(self) -> int:
        """SWA slots one running request may hold between two window evictions: the kept window
        (at least a page), the tokens of one eviction interval, and two pages of rounding."""
        assert self.swa_eviction_interval == self.config.window, "config.swa_headroom assumes it"
        return self.config.swa_headroom

    def _full_reserve(self, new_tokens: int) -> int:
        """Full slots a request keeps in reserve for `new_tokens` more tokens (plus one page)."""
        return full_reserve(self.page_size, new_tokens)

    def _outstanding(self, reqs: list[Req]) -> tuple[int, int]:
        """Full and SWA slots `reqs` may still need (their reservations).

        Never asked while a request is between two chunks: its chunks take the whole chunk
        budget of their steps (as in SGLang), so new requests join only the batch of its last
        chunk, when it reserves what a running request does."""
        full = sum(self._full_reserve(r.remaining_new_tokens) for r in reqs)
        return full, len(reqs) * self._swa_headroom()

    def _schedule_prefill(self) -> list[Req]:
        admitted: list[Req] = []
        budget = self.config.max_prefill_tokens
        chunk_room = self.chunk_tokens  # None: chunking is off
        chunked = self.chunked_req
        if chunked is not None:
            # Its next chunk goes first (SGLang's `add_chunked_req`); admission reserved it, so
            # only a leak can leave it short, and then it waits (is parked) as in SGLang.
            if not self._next_chunk(chunked):
                return []
            admitted.append(chunked)
            budget -= chunked.prefill_end - chunked.kv_len
            chunk_room -= chunked.prefill_end - chunked.kv_len
            if chunked.prefill_done:
                self.chunked_req = None
        if not self.waiting or self.chunked_req is not None:
            return admitted
        if self.order_by_rid:
            self.waiting.sort(key=lambda r: r.rid)
        for req in list(self.waiting):
            if len(self.running) + len(admitted) >= self.config.max_running_requests:
                break
            if self.req_to_token_pool.available_size() == 0:
                break
            if not self._admit(req, budget, chunk_room, admitted):
                break
            budget -= req.prefill_end - req.cache_protected_len
            self.waiting.remove(req)
            admitted.append(req)
            if not req.prefill_done:
                self.chunked_req = req  # the chunk budget is spent
                self.stats["chunked_requests"] += 1
                break
            if chunk_room is not None:
                chunk_room -= req.prompt_len - req.cache_protected_len
        return admitted

    def _admit(self, req: Req, budget: int, chunk_room: int | None, admitted: list[Req]) -> bool:
        """Match the prefix, reserve and allocate both pools; False (nothing held) to wait.

        A prompt whose extend exceeds what is left of the chunk budget is admitted with its
        first chunk only (whole pages), when no other request is being chunked. On an idle
        engine the chunk also shrinks to the SWA room a cache hit's locked window leaves (as
        SGLang shrinks a chunk to the SWA room left), and where not even a page is left the
        prompt is served without the hit: an idle engine always admits its next request."""
        match = None
        if self.tree_cache is not None:
            # Leave at least one token to extend, so the prefill produces logits.
            match = self.tree_cache.match_prefix(req.origin_input_ids[:-1])
        idle = not admitted and not self.running and self.chunked_req is None
        if self._reserve_and_allocate(req, budget, chunk_room, admitted, match, idle):
            return True
        if idle and chunk_room is not None and match is not None and match.matched_len:
            return self._reserve_and_allocate(req, budget, chunk_room, admitted, None, idle)
        return False

    def _reserve_and_allocate(self, req: Req, budget: int, chunk_room: int | None, admitted: list[Req],
                              match: Any, idle: bool) -> bool:
        page = self.page_size
        prefix_len = match.matched_len if match is not None else 0
        lock = self.tree_cache.inc_lock_ref(match.last_node) if match is not None else None
        extend_len = req.prompt_len - prefix_len
        chunk_end = req.prompt_len
        # Whole pages: what the step's earlier prompts left of the chunk budget need not be, and
        # every later chunk of this prompt is this size (a chunk boundary off a page would leave
        # cache_unfinished a part-page to insert).
        req.chunk_size = None if chunk_room is None else _page_floor(chunk_room, page)
        if chunk_room is not None and idle:
            swa_room = self.allocator.swa_available_size() - self._swa_headroom()
            if self.tree_cache is not None:
                swa_room += self.tree_cache.swa_evictable_size()
            req.chunk_size = min(chunk_room, _page_floor(swa_room, page))
        if req.chunk_size is not None and extend_len > req.chunk_size:
            room = req.chunk_size if not admitted else min(req.chunk_size, budget)
            chunk_end = prefix_len + _page_floor(room, page)
            if self.chunked_req is not None or chunk_end <= prefix_len:
                if lock is not None:
                    self.tree_cache.dec_lock_ref(lock)
                return False
        elif admitted and extend_len > budget:
            if lock is not None:
                self.tree_cache.dec_lock_ref(lock)
            return False
        # This step's allocation (both pools); a chunked prompt's later chunks need full slots
        # too, and SWA slots a chunk at a time (its reservation, `_outstanding`).
        extend_tokens = _page_ceil(chunk_end, page) - prefix_len
        later_tokens = _page_ceil(req.prompt_len, page) - prefix_len - extend_tokens
        full_outstanding, swa_outstanding = self._outstanding(self.running + admitted)
        need_full = extend_tokens + later_tokens + self._full_reserve(req.max_new_tokens) + full_outstanding
        # A chunked prompt never holds more SWA than a chunk and a headroom (it frees what the
        # next chunk's window does not read before that chunk is allocated).
        need_swa = extend_tokens + self._swa_headroom() + swa_outstanding
        evictable_full = self.tree_cache.full_evictable_size() if self.tree_cache else 0
        evictable_swa = self.tree_cache.swa_evictable_size() if self.tree_cache else 0
        full_avail = self.allocator.full_available_size()
        swa_avail = self.allocator.swa_available_size()
        if need_full > full_avail + evictable_full or need_swa > swa_avail + evictable_swa:
            if lock is not None:
                self.tree_cache.dec_lock_ref(lock)
            return False
        self._evict_tree(extend_tokens)
        slots = self._alloc_extend(req, prefix_len, chunk_end, match)
        if slots is None:
            if lock is not None:
                self.tree_cache.dec_lock_ref(lock)
            return False
        self.req_to_token_pool.alloc([req])
        if prefix_len:
            self.req_to_token_pool.write(req.row, 0, match.slots)
        self.req_to_token_pool.write(req.row, prefix_len, slots)
        if self.reach is not None:
            self.reach.table_written(req.row, 0, chunk_end)
        req.lock = lock
        req.cache_protected_len = prefix_len
        req.swa_evicted_seqlen = prefix_len
        req.prefill_end = chunk_end
        req.admitted_step = self.step_no
        self.stats["prompt_tokens"] += req.prompt_len
        self.stats["cached_tokens"] += prefix_len
        self._note_swa_use(slots)
        self.events.write("request_admitted", rid=req.rid, prompt_len=req.prompt_len,
                          cached_len=prefix_len, row=req.row, chunk_end=chunk_end)
        if prefix_len and self.perturber is not None:
            self._hook(CacheHit(ReqState.of(req), prefix_len))
        return True

    def _alloc_extend(self, req: Req, prefix_len: int, end: int, match) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.allocator.alloc(end - prefix_len)
        last_loc = match.slots[-1:] if prefix_len else torch.tensor([-1], device=self.device)
        return self.allocator.alloc_extend([prefix_len], [end], last_loc.to(torch.int64), end - prefix_len)

    # ---- chunked prefill -----------------------------------------------------------------------

    def _next_chunk(self, req: Req) -> bool:
        """Allocate and map the next chunk of the request being prefilled in chunks; False if a
        pool is short (the chunk waits)."""
        page, lo = self.page_size, req.kv_len
        end = min(req.prompt_len, lo + req.chunk_size)
        extend_tokens = _page_ceil(end, page) - lo
        self._evict_tree(extend_tokens)
        if page == 1:
            slots = self.allocator.alloc(end - lo)
        else:
            last_loc = self.req_to_token_pool.req_to_token[req.row, lo - 1:lo].to(torch.int64)
            slots = self.allocator.alloc_extend([lo], [end], last_loc, end - lo)
        if slots is None:
            self.events.write("chunk_parked", rid=req.rid, kv_len=lo, chunk_end=end,
                              full_available=self.allocator.full_available_size(),
                              swa_available=self.allocator.swa_available_size())
            return False
        self.req_to_token_pool.write(req.row, lo, slots)
        if self.reach is not None:
            self.reach.table_written(req.row, lo, end, "written by the next prefill chunk")
        req.prefill_end = end
        self._note_swa_use(slots)
        return True

    def _chunk_boundary(self, req: Req) -> None:
        """A chunk that does not end the prompt ran: slide the window, cache the processed part.

        The frontier moves as at a decode eviction (`_evict_windows`) with `pre_len` the
        processed length: the next chunk's first query reads no key below
        `kv_len - window + 1`. With a radix cache the processed part then goes into the tree as
        SGLang's `cache_unfinished_req` puts it (`SWARadixCache.cache_unfinished`): positions
        below the frontier as a tombstone, the request's lock moved to the new last node, the
        row rewritten with the tree's slots, `cache_protected_len` raised.
        """
        self.stats["prefill_chunks"] += 1
        with self._free_group():
            self._evict_windows([req], chunk_boundary=True)
        effect = None
        if self.perturber is not None:
            effect = self._hook(ChunkBoundary(ReqState.of(req), req.cache_protected_len))
        if self.tree_cache is not None:
            self._cache_unfinished(req, effect)
        self.events.write("prefill_chunk", rid=req.rid, kv_len=req.kv_len, prompt_len=req.prompt_len,
                          frontier=req.swa_evicted_seqlen, protected=req.cache_protected_len)

    def _cache_unfinished(self, req: Req, effect: Any) -> None:
        """SGLang's `cache_unfinished_req` for a chunked request (see `_chunk_boundary`)."""
        kv_len, protected = req.kv_len, req.cache_protected_len
        evicted = req.swa_evicted_seqlen if effect is None or effect.swa_evicted_seqlen is None \
            else effect.swa_evicted_seqlen
        table = self.req_to_token_pool.req_to_token
        if self.reach is not None:
            self.reach.table_read(req.row, req.rid, 0, kv_len, "the cache of a chunked request's processed part")
        row = table[req.row, :kv_len].to(torch.int64)
        self._check_prefix_row(req, row)
        result = self.tree_cache.cache_unfinished(
            req.origin_input_ids[:kv_len], row,
            prev_prefix_len=protected, swa_evicted_seqlen=evicted, lock=req.lock,
        )
        req.lock = result.lock
        new_len = result.protected_len
        self.req_to_token_pool.write(req.row, protected, result.slots[protected:new_len])
        if self.reach is not None:
            self.reach.table_written(req.row, protected, new_len, "rewritten with the radix cache's slots")
        req.cache_protected_len = new_len
        req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, new_len)

    def _check_prefix_row(self, req: Req, row: torch.Tensor) -> None:
        """The row's part below `cache_protected_len` names the tree's slots of the prefix the
        request locked (it was written from them, and nothing but a corruption changes it). The
        tree reads only its own slots there, so a damaged entry is otherwise seen only by the
        forwards that read it (the KV canary) and never freed."""
        protected = req.cache_protected_len
        if req.lock is None or protected == 0:
            return
        held = self.tree_cache.locked_slots(req.lock)
        assert held.numel() >= protected, "the locked prefix is shorter than cache_protected_len"
        expect(PREFIX_ROW, row[:protected] == held[:protected], "row disagrees with the cached prefix",
               slots=row[:protected])

    def _evict_tree(self, num_tokens: int) -> None:
        """Evict the radix cache until both pools have `num_tokens` free (SGLang's
        `evict_from_tree_cache`). Its frees are released before this returns, so the allocation
        that follows can use them."""
        if self.tree_cache is None:
            return
        full_deficit = num_tokens - self.allocator.full_available_size()
        swa_deficit = num_tokens - self.allocator.swa_available_size()
        if full_deficit > 0 or swa_deficit > 0:
            with self._free_group():
                self.tree_cache.evict(max(full_deficit, 0), max(swa_deficit, 0))

    def _note_swa_use(self, full_slots: torch.Tensor) -> None:
        # Proof of exercise: SWA slots handed out a second time (sync-free counter).
        swa = self.allocator.translate_loc_from_full_to_swa(full_slots)
        self._swa_reused.add_(self._swa_ever_used[swa].sum())
        self._divergent_allocs.add_((swa != full_slots).sum())
        self._swa_ever_used.index_fill_(0, swa, True)

    # ---- decode -----------------------------------------------------------------------------

    def _schedule_decode(self) -> list[Req]:
        reqs = [r for r in self.running if not r.finished]
        if not reqs:
            return []
        # The window's frees are batched into one release, and released before the allocation.
        with self._free_group():
            self._evict_windows(reqs)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=self.device)
        self._evict_tree(len(reqs) * self.page_size)
        slots = self._alloc_decode(reqs, rows)
        if slots is None:
            if self.reach is not None:
                self.reach.read([("count", "full"), ("count", "swa")], "a decode allocation that found a pool dry")
            self.events.write("decode_stall", running=len(reqs),
                              full_available=self.allocator.full_available_size(),
                              swa_available=self.allocator.swa_available_size())
            # Admission reserved room for every running request: a stall means slots leaked.
            expect(DECODE_STALL, torch.tensor(False), "decode cannot allocate: a pool ran dry")
            # Where the stall does not crash the engine, abort the youngest request so the
            # others can go on: a stalled engine must not spin forever.
            youngest = max(reqs, key=lambda r: (r.admitted_step, r.rid))
            youngest.finish_reason = "abort"
            self._finish(youngest)
            return []
        table = self.req_to_token_pool.req_to_token
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=self.device)
        table[rows, cols] = slots.to(torch.int32)
        self._note_swa_use(slots)
        return reqs

    def _alloc_decode(self, reqs: list[Req], rows: torch.Tensor) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.allocator.alloc(len(reqs))
        table = self.req_to_token_pool.req_to_token
        cols = torch.tensor([r.kv_len - 1 for r in reqs], dtype=torch.int64, device=self.device)
        return self.allocator.alloc_decode([r.kv_len + 1 for r in reqs], table[rows, cols].to(torch.int64))

    def _evict_windows(self, reqs: list[Req], *, chunk_boundary: bool = False) -> None:
        """Release the SWA peers that slid out of each request's window (SGLang's
        `maybe_evict_swa` and `free_swa_out_of_window_slots`).

        At a chunk boundary (`chunk_boundary`) the frontier moves at once, as SGLang moves it
        before every chunk of a chunked prefill (no rate limit), with `pre_len` the processed
        length; SGLang does so for its chunk cache only and leaves a radix-cached chain's SWA to
        the tree's eviction, where ours frees it here and caches it as a tombstone.

        Rate-limited per request: decode batch `idx` of a request (0 for its first decode)
        evicts when `idx % swa_eviction_interval == 1`, never at 0 (SGLang skips it: under overlap
        scheduling the prefill may still be in flight). The frontier first rises to
        `cache_protected_len` (the tree owns that prefix), then to `pre_len - keep` floored to a
        page, with `pre_len = kv_len` and `keep = max(window, page)` when a radix cache holds the
        request (so the frontier stays below the insert boundary and the last inserted leaf is
        never all tombstone), or `keep = window` without one.

        One `free_swa` per request, as SGLang does: a slot two rows share (a corrupted row) is
        then freed twice in two calls, and the second call sees its peer already released.
        """
        table = self.req_to_token_pool.req_to_token
        page, interval = self.page_size, max(self.swa_eviction_interval, 1)
        keep = max(self.window, page) if self.tree_cache is not None else self.window
        for req in reqs:
            decode_batch_idx = len(req.output_ids) - 1
            if (not chunk_boundary and req.lock is not None and not req.lock.swa_released
                    and decode_batch_idx >= self.window):
                # Past the window the request no longer reads its prefix's SWA KV: the tree
                # lock's SWA part goes back (SGLang's release_swa_prefix_lock), else a prefix the
                # request cached chunk by chunk, or hit, stays locked beside the request's own
                # window until it finishes, more SWA than admission reserved for it.
                self.tree_cache.dec_swa_lock_only(req.lock)
            if not chunk_boundary and (decode_batch_idx < 1 or (decode_batch_idx - 1) % interval):
                continue
            frontier = req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, req.cache_protected_len)
            new_frontier = _page_floor(max(frontier, req.kv_len - keep), page)
            if new_frontier <= frontier:
                continue
            slots = table[req.row, frontier:new_frontier].to(torch.int64)
            if self.reach is not None:
                self.reach.table_read(req.row, req.rid, frontier, new_frontier, "window eviction")
            if self.perturber is None:
                self.allocator.free_swa(slots)
            else:
                effect = self._hook(WindowEviction(ReqState.of(req), slots, frontier, new_frontier))
                self.allocator.free_swa(effect.free)
                if effect.free_again is not None:  # a caller's second free_swa of the same slots
                    self.allocator.free_swa(effect.free_again)
                new_frontier = effect.new_frontier
            self.stats["swa_evicted_tokens"] += new_frontier - frontier
            req.swa_evicted_seqlen = new_frontier

    # ---- finish ------------------------------------------------------------------------------

    def _finish(self, req: Req) -> None:
        req.finished_step = self.step_no
        if req is self.chunked_req:  # aborted between two chunks
            self.chunked_req = None
        else:
            self.running.remove(req)
        last = req.output_ids[-1] if req.output_ids else None
        self.canary.forget(req.rid, last, req.prompt_len + len(req.output_ids) - 1, self.step_no)
        effect = NO_FINISH_EFFECT if self.perturber is None else self._hook(RequestFinish(ReqState.of(req)))
        if not effect.leak:
            self._release_kv(req)
            self.req_to_token_pool.free(req)
        if effect.free_full_again is not None:
            self.allocator.free_full(effect.free_full_again)
        self.stats["finished_requests"] += 1
        if self.reach is not None:
            self.reach.finished(req.rid)
        self.events.write("request_finished", rid=req.rid, output_len=len(req.output_ids),
                          admitted_step=req.admitted_step, finish_reason=req.finish_reason)
        if req.on_finish is not None:
            req.on_finish(req)

    def _release_kv(self, req: Req) -> None:
        page = self.page_size
        kv_len = req.kv_len
        slots = self.req_to_token_pool.req_to_token[req.row, :kv_len].to(torch.int64)
        if self.reach is not None:
            self.reach.table_read(req.row, req.rid, 0, kv_len, "the release of a finished request")
        frontier = req.swa_evicted_seqlen
        if self.tree_cache is None:
            self.allocator.free_full(slots[:frontier])
            self.allocator.free(slots[frontier:])
            return
        self._check_prefix_row(req, slots)
        aligned = _page_floor(kv_len, page)
        self.allocator.free(slots[aligned:])
        self.tree_cache.insert(
            req.all_ids[:aligned],
            slots[:aligned],
            prev_prefix_len=req.cache_protected_len,
            swa_evicted_seqlen=min(req.swa_evicted_seqlen, aligned),
        )
        self.tree_cache.dec_lock_ref(req.lock)
        req.lock = None

    # ---- end of step ---------------------------------------------------------------------------

    def _maybe_sweep(self) -> None:
        cfg = self.config
        if cfg.kv_canary != "off" and self.tree_cache is not None and cfg.kv_canary_sweep_interval:
            if self.step_no % cfg.kv_canary_sweep_interval == 0:
                paths = self.tree_cache.cached_paths()
                self.canary.sweep(paths, self.step_no)
                if self.reach is not None:
                    self.reach.sweep(paths, self.allocator.full_to_swa_index_mapping)

    def _read_back(self, sampled: torch.Tensor) -> list[int]:
        """The step's one device-to-host copy: sampled tokens, invariant counters, canary counts.

        Invariants, the allocator's drop counters and the canary keep their results on the
        device; riding along with the tokens (which the host needs anyway) means they add no
        synchronization to the step.
        """
        names, counters = counter_snapshot()
        if self._extra_counters is not None:
            extra_names, extra = self._extra_counters()
            if extra is not None:
                names = [*names, *extra_names]
                counters = extra if counters is None else torch.cat([counters, extra.to(counters.device)])
        canary_counts = self.canary.pending_counts()
        parts = [sampled.to(torch.int64), self.allocator.drop_counter().to(sampled.device)]
        parts += [t.to(sampled.device) for t in (counters, canary_counts) if t is not None]
        host = torch.cat(parts).tolist()
        n_tokens, n_counters = sampled.numel(), len(names)
        tokens, drops, rest = host[:n_tokens], host[n_tokens:n_tokens + 2], host[n_tokens + 2:]
        # The allocator's bad-free drops (both sides): no new drop, no hole in its free lists.
        self.allocator.note_drop_totals(drops)
        totals: dict[str, int] = {}
        for name, value in zip(names, rest[:n_counters], strict=True):
            totals[name] = totals.get(name, 0) + int(value)
        self._read_totals = totals
        self._read_canary = rest[n_counters:] if canary_counts is not None else None
        return tokens

    def _end_of_step(self, kind: str) -> None:
        totals, self._read_totals = self._read_totals, None
        canary_counts, self._read_canary = self._read_canary, None
        firings = drain_firings(totals)  # the sink has already logged them
        violations = self.canary.collect(self.step_no, canary_counts)
        # Durable before a `raise` crash: the last one syncs the step's lot (one fsync a step; one
        # each made a log-mode canary over a damaged cache crawl, dozens of violations a step).
        for n, violation in enumerate(violations, 1):
            self.events.write("canary_violation", durable=n == len(violations), **violation.to_dict(),
                              line=violation.log_line())
        self.events.write("step", batch=kind, running=len(self.running), waiting=len(self.waiting),
                          full_available=self.allocator.full_available_size(),
                          swa_available=self.allocator.swa_available_size(),
                          firings=len(firings), violations=len(violations))
        if violations and self.canary.mode == "raise":
            raise CanaryRaised(violations)

    def invariant_hit_totals(self) -> dict[str, int]:
        """Every invariant's hit total, ours and the memory backend's (SGLang counts its own), by
        name: a host read, for idle ticks, shutdown, crashes and `/state`."""
        totals = hit_counts()
        if self._extra_counters is not None:
            names, extra = self._extra_counters()
            if extra is not None:
                for name, value in zip(names, extra.tolist(), strict=True):
                    totals[name] = totals.get(name, 0) + int(value)
        return totals

    def drain_all_firings(self) -> list:
        """Drain every counter increase not yet drained, the backend's included.

        The step drains what its one read-back brought; a hit counted after that read (SGLang's
        checks in a finish's frees, the last step before idle) would otherwise wait for a next
        step that may never come. The engine calls this at every idle tick and at shutdown.
        """
        return drain_firings(self.invariant_hit_totals())

    def idle_tick(self) -> dict:
        """Check the conservation ledgers and the radix cache; returns the results.

        The backend's hits still pending are drained first: they happened before this tick,
        and a ledger check that crashes the engine must not take them with it."""
        self.drain_all_firings()
        if self.reach is not None and self.reach.open:
            held = self.tree_cache.held_slots().tolist() if self.tree_cache is not None else []
            self.reach.idle(held)
        return self.idle.check()

    # ---- perturbation hooks --------------------------------------------------------------------

    def _hook(self, hook: SiteContext) -> Any:
        """Hand a hook site's typed context to the perturber; returns the site's typed effect
        (perturb/sites.py). Called only when a perturber is loaded: without one no context is
        even built."""
        return self.perturber.at(hook, self)

    # ---- state ---------------------------------------------------------------------------------

    def exercise_stats(self) -> dict[str, int]:
        """Proof that the SWA path really ran: divergence, window eviction, slot reuse."""
        mapping = self.allocator.full_to_swa_index_mapping[: self.config.full_pool_tokens + self.page_size]
        ids = torch.arange(mapping.numel(), device=mapping.device)
        nonidentity = int(((mapping > 0) & (mapping != ids)).sum())
        return {
            "mapping_nonidentity": nonidentity,
            "swa_evicted_tokens": self.stats["swa_evicted_tokens"],
            "swa_slots_reused": int(self._swa_reused),
            "divergent_allocs": int(self._divergent_allocs),
            "verify_full": self.canary.stats["verify_full"],
            "verify_swa": self.canary.stats["verify_swa"],
        }

