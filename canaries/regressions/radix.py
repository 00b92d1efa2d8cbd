"""The SWA radix cache: insert, match, locks, eviction and tombstones."""

from canaries.regressions import regression

RADIX = "engine_stub/mem/radix.py"

regression(
    name="radix.dec-lock-keeps-full-lock", area="radix", file=RADIX,
    old="        for n in self._up(handle.node):\n            n.full_lock_ref -= 1\n",
    new="        for n in self._up(handle.node):\n            pass\n",
    models="unlocking a matched path leaves its full lock refs up: nothing cached is ever evictable",
    caught_by=("clean-cache-hits",),
)
regression(
    name="radix.insert-keeps-duplicates", area="radix", file=RADIX,
    old="            self.allocator.free_full(slots[lo:cut])\n            self.allocator.free(slots[cut:hi])\n",
    new="            self.allocator.free_full(slots[lo:cut])\n",
    models="inserting an already cached range never frees the incoming duplicate slots (a leak)",
    caught_by=("clean-cache-hits",),
)
regression(
    name="radix.delete-tombstone-through-free", area="radix", file=RADIX,
    old=("        if node.swa_tombstone:  # its SWA side is gone already\n"
         "            self.allocator.free_full(node.value)\n"),
    new=("        if node.swa_tombstone:  # its SWA side is gone already\n"
         "            self.allocator.free(node.value)\n"),
    models="eviction deletes a tombstoned node through free instead of free_full: its mapping "
           "entries read as the padding slot, so free_swa meets unmapped peers (the bug PR "
           "#36723's comment names)",
    caught_by=("clean-pressure-full-evict", "clean-pressure-swa-tombstone", "clean-radix-full-evict"),
)
regression(
    name="radix.tombstone-keeps-swa", area="radix", file=RADIX,
    old=("                self.allocator.free_swa(victim.value)\n"
         "                self.swa_lru_list.remove_node(victim)\n"),
    new="                self.swa_lru_list.remove_node(victim)\n",
    models="the SWA phase of eviction marks a node tombstone without releasing its SWA slots: "
           "they leak, and the node's slots stay mapped",
    caught_by=("clean-radix-tombstone-churn",),
)
regression(
    name="radix.match-accepts-tombstoned-window", area="radix", file=RADIX,
    old=("        if since_tombstone >= self.window:\n"
         "            best_node, best_len = node, pos\n"
         "        self.full_lru_list"),
    new=("        best_node, best_len = node, pos  # however few live tokens follow a tombstone\n"
         "        self.full_lru_list"),
    models="a prefix match is accepted although fewer than `window` live tokens follow its last "
           "tombstone: the request's first forward reads SWA KV that was released",
    caught_by=("clean-radix-tombstone-churn",),
)
regression(
    name="radix.dup-frees-evicted-swa", area="radix", file=RADIX,
    old="            cut = min(max(evicted, lo), hi)\n",
    new="            cut = lo\n",
    models="inserting a copy of a live cached range frees all of it through free, including the "
           "part whose SWA peers the window already released",
    caught_by=("clean-radix-tombstone-churn",),
)
regression(
    name="radix.recover-leaks-old-full", area="radix", file=RADIX,
    old=("        else:\n"
         "            self.allocator.free_full(node.value)\n"
         "            node.value = incoming.clone()\n"),
    new=("        else:\n"
         "            node.value = incoming.clone()\n"),
    models="tombstone recovery adopts the incoming live copy and forgets to free the tombstone's "
           "own full slots (a full-pool leak)",
    caught_by=("clean-radix-tombstone-churn",),
)
regression(
    name="radix.split-drops-lock", area="radix", file=RADIX,
    old=("            full_lock_ref=child.full_lock_ref,\n"
         "            swa_lock_ref=child.swa_lock_ref,\n"),
    new=("            full_lock_ref=0,\n"
         "            swa_lock_ref=0,\n"),
    models="splitting a locked node gives the new parent no lock refs: a running request's "
           "prefix becomes evictable, and its unlock drives the counts negative",
    caught_by=("clean-radix-lock-split",),
)
regression(
    name="radix.lock-skips-swa", area="radix", file=RADIX,
    old="            if swa_open:\n                n.swa_lock_ref += 1\n",
    new="            if swa_open:\n                pass  # the SWA lock is never taken\n",
    models="inc_lock_ref takes the full lock but not the SWA lock of the matched window: the "
           "SWA phase may tombstone a prefix a running request reads, and the unlock underflows",
    caught_by=("clean-cache-hits",),
)
regression(
    name="radix.full-phase-ignores-lock", area="radix", file=RADIX,
    old="        return next((n for n in self._order.values() if self._lock(n) == 0 and n.is_leaf), None)\n",
    new="        return next((n for n in self._order.values() if n.is_leaf), None)\n",
    models="the full phase of eviction picks the least recently used leaf even when a running "
           "request holds it: its KV is freed under the request",
    caught_by=("clean-radix-lock-leaf-evict",),
)
regression(
    name="radix.swa-phase-deletes-locked-leaf", area="radix", file=RADIX,
    old="            if victim.is_leaf and victim.full_lock_ref == 0:\n",
    new="            if victim.is_leaf:\n",
    models="the SWA phase deletes (full side too) a leaf that a running request holds in full, "
           "instead of only tombstoning it",
    equivalent=(
        "The SWA phase's victim comes from swa_lru_list.lru_no_lock(): live, swa_lock_ref == 0. A "
        "leaf with full_lock_ref > 0 always has swa_lock_ref > 0: locks come only from "
        "inc_lock_ref(match.last_node), and match_prefix's last node is live (the root aside, which "
        "is never listed), so the lock's first node takes an SWA ref; a locked node's ancestors "
        "keep the locked child (neither eviction phase removes a node with full_lock_ref > 0, nor "
        "does the cascade), so the only leaf on a lock's path is its last node; the SWA phase never "
        "tombstones a node with an SWA ref; a split copies both refs to the new parent and leaves "
        "the leaf its own. So a leaf victim has full_lock_ref == 0 and both branches agree"),
)

regression(
    name="radix.match-walk-bitor", area="radix", file=RADIX,
    old="            node, pos = child, pos + common\n",
    new="            node, pos = child, pos | common\n",
    models="the prefix match adds each node's matched length with a bitwise or: a match through two "
           "nodes whose lengths share bits comes up short, and the request's prefill reads SWA KV "
           "inside a tombstone (a cosmic-ray survivor, promoted)",
    caught_by=("clean-radix-two-node-match-page16",),
)
regression(
    name="radix.swa-tombstone-uncounted", area="radix", file=RADIX,
    old="                victim.swa_tombstone = True\n                freed[1] += len(victim.key)\n",
    new="                victim.swa_tombstone = True\n                freed[0] += len(victim.key)\n",
    models="the SWA phase counts a tombstoned node's tokens on the full side: it goes on evicting "
           "past what was asked, deleting cached leaves whose prefixes it already freed enough "
           "for, so later turns miss the cache (a cosmic-ray survivor, promoted)",
    caught_by=("clean-radix-swa-tombstone-keeps-hits",),
)
regression(
    name="radix.full-phase-counts-swa", area="radix", file=RADIX,
    old="        while freed[0] < full_tokens:\n",
    new="        while freed[1] < full_tokens:\n",
    models="the full phase of eviction measures its progress in SWA tokens: a deleted sequence's "
           "tombstoned head counts for nothing, so it deletes far more of the cache than asked and "
           "later turns miss (a cosmic-ray survivor, promoted)",
    caught_by=("clean-radix-full-evict-keeps-hits",),
)
regression(
    name="radix.hit-prefix-row-page-short", area="radix", file="engine_stub/scheduler.py",
    old="            self.req_to_token_pool.write(req.row, 0, match.slots)\n",
    new="            self.req_to_token_pool.write(req.row, 0, match.slots[:-self.page_size])\n",
    models="a cache hit's prefix is written into the request's row one page short: the row's last "
           "prefix page still names whatever the row's previous owner left there, and the forwards "
           "read that KV",
    caught_by=("clean-cache-hits",),
)
regression(
    name="radix.swa-lock-whole-nodes", area="radix", file="engine_stub/mem/radix.py",
    old="                if at > 0:\n                    self._split(n, at)",
    new="                if at > 0 and False:\n                    self._split(n, at)",
    models="the SWA lock takes whole nodes back to the window, as SGLang's does: with small chunks "
           "a request holds up to a chunk more live SWA than admission reserved (a canary fuzz "
           "finding: a healthy engine stalled mid-decode)",
    caught_by=("clean-chunked-lock-one-window",),
)
regression(
    name="radix.tombstone-keeps-mapping", area="radix", file=RADIX,
    old="                self.allocator.free_swa(victim.value)\n",
    new=("                self.allocator.swa_attn_allocator.free(\n"
         "                    self.allocator.translate_loc_from_full_to_swa(victim.value))\n"),
    models="the SWA phase of eviction releases a node's SWA peers straight on the SWA side: the "
           "tombstone's full slots keep naming the released peers, which the next allocation "
           "hands to other slots",
    caught_by=("clean-radix-tombstone-churn",),
)
