"""Finish and release: a finished request's KV back to the pools or into the radix cache."""

from canaries.regressions import regression

SCHED = "engine_stub/scheduler.py"

regression(
    name="finish.row-never-freed", area="finish", file=SCHED,
    old="            self._release_kv(req)\n            self.req_to_token_pool.free(req)\n",
    new="            self._release_kv(req)\n",
    models="a finished request's req_to_token row is never returned (a request-row leak)",
    caught_by=("leak-request",),
)
regression(
    name="finish.noradix-release-skips-swa", area="finish", file=SCHED,
    old="            self.allocator.free_full(slots[:frontier])\n            self.allocator.free(slots[frontier:])\n",
    new="            self.allocator.free_full(slots[:frontier])\n            self.allocator.free_full(slots[frontier:])\n",
    models="without a radix cache, finishing frees the in-window tail on the full side only, "
           "stranding its SWA peers",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="finish.noradix-refrees-evicted-swa", area="finish", file=SCHED,
    old="            self.allocator.free_full(slots[:frontier])\n            self.allocator.free(slots[frontier:])\n",
    new="            self.allocator.free(slots[:frontier])\n            self.allocator.free(slots[frontier:])\n",
    models="finishing frees the window-evicted head through free (its SWA peers again) instead of "
           "free_full: free_swa meets released peers",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="finish.lock-never-released", area="finish", file=SCHED,
    old="        self.tree_cache.dec_lock_ref(req.lock)\n        req.lock = None\n",
    new="        req.lock = None\n",
    models="a finished request never unlocks the radix path it matched: the prefix stays "
           "protected forever",
    caught_by=("clean-cache-hits",),
)
regression(
    name="finish.insert-claims-evicted-swa-live", area="finish", file=SCHED,
    old="            swa_evicted_seqlen=min(req.swa_evicted_seqlen, aligned),\n",
    new="            swa_evicted_seqlen=min(req.cache_protected_len, aligned),\n",
    models="the radix insert is told nothing was window-evicted: released SWA ranges are cached "
           "as live nodes",
    caught_by=("clean-page1-radix",),
)
regression(
    name="finish.radix-tail-page-leaked", area="finish", file=SCHED,
    old="        aligned = _page_floor(kv_len, page)\n        self.allocator.free(slots[aligned:])\n",
    new="        aligned = _page_floor(kv_len, page)\n",
    models="with a radix cache, finishing inserts the page-aligned part and forgets to free the "
           "partial last page (page_size > 1): both pools leak a page per request",
    caught_by=("clean-page16-radix",),
)
regression(
    name="finish.abort-waiting-unanswered", area="finish", file=SCHED,
    old="                          finish_reason=\"abort\")\n        if req.on_finish is not None:\n            req.on_finish(req)\n",
    new="                          finish_reason=\"abort\")\n",
    models="a request taken off the queue as aborted (its client gone, or starved by a leak) is "
           "finished without its answer: the client waits until its own timeout (a cosmic-ray "
           "survivor, promoted)",
    caught_by=("leak-every-row-warn",),
)
regression(
    name="finish.client-abort-drops-running", area="finish", file=SCHED,
    old='                    req.finish_reason = "abort"\n                    self._finish(req)\n',
    new='                    req.finish_reason = "abort"\n                    self.running.remove(req)\n',
    models="a running request whose client hung up is dropped from the batch without being "
           "finished: its KV, its row and its answer are never released (reached only by a "
           "client hang-up mid-decode)",
    caught_by=("clean-hang-up-radix", "clean-hang-up-page16-noradix"),
)
regression(
    name="finish.radix-keeps-partial-page", area="finish", file=SCHED,
    old="        self.allocator.free(slots[aligned:])\n        self.tree_cache.insert(\n",
    new="        self.tree_cache.insert(\n",
    models="with a radix cache, finishing caches the page-aligned part and forgets the partial last "
           "page (page_size > 1): its full and SWA slots are owned by no one",
    caught_by=("clean-page16-radix",),
)
