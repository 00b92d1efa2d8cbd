"""The window-eviction frontier (`Scheduler._evict_windows`: SGLang's `maybe_evict_swa`)."""

from canaries.regressions import regression

SCHED = "engine_stub/scheduler.py"
FRONTIER = "            new_frontier = _page_floor(max(frontier, req.kv_len - keep), page)\n"

regression(
    name="window.frontier-off-by-one", area="window", file=SCHED,
    old=FRONTIER,
    new="            new_frontier = _page_floor(max(frontier, req.kv_len - keep + 1), page)\n",
    models="the frontier rises one position too far: the oldest position of the window the KV "
           "canary verifies (kv_len - window) loses its SWA peer",
    caught_by=("clean-page1-noradix", "clean-page1-radix"),
)
regression(
    name="window.frontier-off-by-a-page", area="window", file=SCHED,
    old=FRONTIER,
    new="            new_frontier = -(-max(frontier, req.kv_len - keep) // page) * page\n",
    models="the frontier is rounded up to a page instead of down: on page_size > 1 up to a page "
           "of in-window SWA KV is released",
    caught_by=("clean-page16-noradix", "clean-page16-radix"),
)
regression(
    name="window.frontier-too-far", area="window", file=SCHED,
    old=FRONTIER,
    new="            new_frontier = _page_floor(max(frontier, req.kv_len - keep // 2), page)\n",
    models="the eviction keeps half a window: SWA KV the next forwards still read is released",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="window.never-evicts", area="window", file=SCHED,
    old="            if new_frontier <= frontier:\n                continue\n",
    new="            if new_frontier <= frontier or True:  # the window never slides\n                continue\n",
    models="window eviction never releases anything: the SWA pool fills with out-of-window KV "
           "until decode runs dry",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="window.noradix-keeps-no-page", area="window", file=SCHED,
    old="        keep = max(self.window, page) if self.tree_cache is not None else self.window\n",
    new="        keep = max(self.window, page) if self.tree_cache is not None else self.window - page\n",
    models="without a radix cache the kept window is a page short: on page_size 1 the frontier "
           "reaches the position the canary's window starts at, on larger pages a page of "
           "in-window KV goes",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="window.protected-prefix-unguarded", area="window", file=SCHED,
    old="            frontier = req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, req.cache_protected_len)\n",
    new="            frontier = req.swa_evicted_seqlen\n",
    models="the frontier is not raised to cache_protected_len first: a request with a cache hit "
           "would release the SWA KV of the prefix the radix cache owns",
    equivalent=(
        "`_admit` sets `req.swa_evicted_seqlen = prefix_len` together with `req.cache_protected_len "
        "= prefix_len`, nothing else ever writes cache_protected_len, and swa_evicted_seqlen only "
        "rises afterwards (here to new_frontier > frontier, or to a kind's EvictionEffect."
        "new_frontier, which never_evict_swa keeps at frontier and evict_inside_window raises; "
        "the other kinds leave it as planned). So at every eviction swa_evicted_seqlen >= "
        "cache_protected_len and the max is swa_evicted_seqlen itself: the same frontier, the "
        "same frees, the same ReqState a kind sees"),
)
regression(
    name="window.swa-lock-released-at-first-decode", area="window", file=SCHED,
    old="                    and decode_batch_idx >= self.window):\n",
    new="                    and decode_batch_idx >= 1):\n",
    models="the SWA part of a cache hit's tree lock goes back at the request's first decode "
           "instead of once it has decoded a window past its prefix: its window still reads the "
           "prefix's SWA KV, which the tree may now tombstone under it (SGLang's "
           "`release_swa_prefix_lock` called too early). Nothing reads wrong KV unless the tree "
           "tombstones that prefix first, so only census.lock_count sees it",
    caught_by=("clean-radix-lock-split", "clean-radix-lock-leaf-evict", "clean-pressure-tombstone-hits"),
)
