"""The sub-allocators (`mem/allocator.py`): free lists, the per-page state row that drops bad
frees, and the idle merge."""

from canaries.regressions import regression

ALLOC = "engine_stub/mem/allocator.py"
PAGED_ALLOCATED = "        allocated = rows.index_select(0, shifted) == _ALLOCATED\n"

regression(
    name="suballoc.double-free-recycled", area="suballoc", file=ALLOC,
    old="        kept = state.index_select(0, pages).eq_(offers)\n",
    new=("        kept = state.index_select(0, pages).eq_(offers) | torch.take(self._kind, pages).eq(_DOUBLE)\n"),
    models="page_size 1: a free of a slot of the pool that is not allocated (a double free) is "
           "recycled instead of dropped, so the slot sits in the free list twice",
    caught_by=("double-free-full-noradix",),
)
regression(
    name="suballoc.out-of-pool-not-dropped", area="suballoc", file=ALLOC,
    old=PAGED_ALLOCATED,
    new=("        allocated = (rows.index_select(0, shifted) == _ALLOCATED) | "
         "(self._kind_rows.index_select(0, shifted) == _OUTSIDE)\n"),
    models="larger pages: an id outside the pool (a -1 entry, an id past the end) is taken for an "
           "allocated page: not dropped, not counted (past the end it is even recycled)",
    caught_by=("corrupt-r2t-minus-one-page16",),
)
regression(
    name="suballoc.reserved-page-recycled", area="suballoc", file=ALLOC,
    old=PAGED_ALLOCATED,
    new=("        allocated = (rows.index_select(0, shifted) == _ALLOCATED) | "
         "(self._kind_rows.index_select(0, shifted) == _RESERVED)\n"),
    models="larger pages: a free of the padding page is recycled: page 0, the sink every padded "
           "read goes to, is handed out to a request",
    caught_by=("corrupt-r2t-zero-page16",),
)
regression(
    name="suballoc.alloc-not-marked", area="suballoc", file=ALLOC,
    old="        self._free_count -= count\n        self._state.index_fill_(0, pages, _ALLOCATED)\n",
    new="        self._free_count -= count\n",
    models="taking pages off the free list does not mark them allocated in the state row: every "
           "later free of them reads as a double free and is dropped (the slots leak)",
    caught_by=("clean-page1-noradix", "clean-page16-noradix"),
)
regression(
    name="suballoc.idle-merge-keeps-holes", area="suballoc", file=ALLOC,
    old="        self._drop_holes()\n        if self.release_pages:\n",
    new="        if self.release_pages:\n",
    models="the idle merge no longer drops the holes a bad free left in the free list (page 0 "
           "entries the step's read-back has not seen yet): the idle ledger counts them as free",
    caught_by=("double-free-full-pool-bound",),
)
regression(
    name="suballoc.merge-drops-staged", area="suballoc", file=ALLOC,
    old="            self.free_pages = torch.sort(torch.cat([self.free_pages, *self.release_pages])).values\n",
    new="            self.free_pages = torch.sort(self.free_pages).values\n",
    models="with need_sort, merging the staged frees into the sorted free list drops them: every "
           "page freed since the last merge leaks",
    equivalent=(
        "Dead code for the engine: release_pages is only ever filled with need_sort=True (frees "
        "and _give_back stage only then; restore_state restores what backup_state took, and "
        "nothing in the engine calls either), and the scheduler builds its allocator with "
        "need_sort=False, hard-wired (SGLang's value outside PD disaggregation; it is no knob). "
        "The branch never runs in any engine run; tests/test_allocator.py covers need_sort=True"),
)

regression(
    name="suballoc.fold-first-free-only", area="suballoc", file=ALLOC,
    old="        if len(pending) == 1:\n            ids, kept, counted, _checked = pending[0]\n",
    new="        if not len(pending) == 1:\n            ids, kept, counted, _checked = pending[0]\n",
    models="folding a step's pending frees reads only the first of several: the drops of a later bad "
           "free in the same step are never counted (a cosmic-ray survivor, promoted)",
    caught_by=("corrupt-r2t-zero-freed-after-finish-page16",),
)
regression(
    name="suballoc.hole-filter-drops-slot-one", area="suballoc", file=ALLOC,
    old="                self.free_pages = pages[pages > 0]\n",
    new="                self.free_pages = pages[pages > 1]\n",
    models="the filter that takes a dropped free's holes (page 0) out of the free list also takes "
           "page 1: every bad free, though dropped and counted, leaks a slot (a cosmic-ray "
           "survivor, promoted)",
    caught_by=("double-free-full-warn-harmless",),
)
