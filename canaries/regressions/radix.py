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
