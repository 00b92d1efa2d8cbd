"""Chunked prefill (`Scheduler._next_chunk`, `_chunk_boundary`, `_cache_unfinished`, and the
tree's `cache_unfinished`: SGLang's chunked prefill and `cache_unfinished_req`)."""

from canaries.regressions import regression

SCHED = "engine_stub/scheduler.py"
RADIX = "engine_stub/mem/radix.py"

regression(
    name="chunk.unfinished-insert-claims-evicted-head", area="chunk", file=SCHED,
    old="            prev_prefix_len=protected, swa_evicted_seqlen=evicted, lock=req.lock,\n",
    new="            prev_prefix_len=protected, swa_evicted_seqlen=protected, lock=req.lock,\n",
    models="cache_unfinished_req inserts the processed part without its window-evicted head: the "
           "tree claims live SWA KV for positions whose peers the chunk boundary already freed "
           "(what SGLang's TestCacheUnfinishedReqEvictedPrefix pins)",
    caught_by=("clean-chunked-page1-radix", "clean-chunked-page16-radix"),
)
regression(
    name="chunk.unfinished-lock-not-released", area="chunk", file=RADIX,
    old="        if lock is not None:\n            self.dec_lock_ref(lock)\n        return UnfinishedResult(",
    new="        return UnfinishedResult(",
    models="cache_unfinished_req takes the lock on the new last node without releasing the old "
           "one: every chunk boundary leaks a lock on the chain, which stays protected forever",
    caught_by=("clean-chunked-page1-radix",),
)
regression(
    name="chunk.frontier-frozen-during-prefill", area="chunk", file=SCHED,
    old="            if not chunk_boundary and (decode_batch_idx < 1 or (decode_batch_idx - 1) % interval):\n",
    new="            if chunk_boundary or (decode_batch_idx < 1 or (decode_batch_idx - 1) % interval):\n",
    models="the window frontier does not move between chunks: without a radix cache a chunked "
           "prompt keeps every SWA slot it prefilled and the next chunk finds the pool dry",
    caught_by=("clean-chunked-page1-noradix", "clean-chunked-page16-noradix"),
)
regression(
    name="chunk.slots-shifted", area="chunk", file=SCHED,
    old="        self.req_to_token_pool.write(req.row, lo, slots)\n",
    new="        self.req_to_token_pool.write(req.row, lo + 1, slots)\n",
    models="a later chunk's slots are written one position shifted in req_to_token: its first "
           "position keeps a stale entry and the rest point one place off",
    caught_by=("clean-chunked-page1-noradix", "clean-chunked-page1-radix"),
)
regression(
    name="chunk.prefix-swa-lock-held-to-finish", area="chunk", file=SCHED,
    old="                self.tree_cache.dec_swa_lock_only(req.lock)\n",
    new="                pass\n",
    models="the SWA part of a request's tree lock is held until it finishes: a prompt cached chunk "
           "by chunk keeps its last window locked beside the request's own window, and a small SWA "
           "pool stalls mid-decode on a healthy engine (a canary fuzz finding)",
    caught_by=("clean-chunked-prefix-lock-release",),
)
regression(
    name="chunk.leftover-budget-off-page", area="chunk", file=SCHED,
    old="        req.chunk_size = None if chunk_room is None else _page_floor(chunk_room, page)\n",
    new="        req.chunk_size = chunk_room\n",
    models="a prompt chunked with what earlier prompts left of the step's chunk budget keeps that "
           "size for every chunk, part-pages included: its second chunk boundary ends mid-page "
           "(a canary fuzz finding: cache_unfinished raised)",
    caught_by=("clean-chunked-budget-leftover-page16",),
)
regression(
    name="chunk.unfinished-row-not-rewritten", area="chunk", file=SCHED,
    old=("        self.req_to_token_pool.write(req.row, protected, result.slots[protected:new_len])\n"
         "        if self.reach is not None:\n"
         "            self.reach.table_written(req.row, protected, new_len, "
         "\"rewritten with the radix cache's slots\")\n"),
    new="",
    models="cache_unfinished_req leaves the request's row naming its own copy of the processed "
           "part: where the tree already held those tokens it freed that copy, and the next chunks "
           "read slots nobody owns",
    caught_by=("clean-chunked-mid-chain-hit",),
)
