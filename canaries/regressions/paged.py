"""Paged allocation (page_size > 1): alloc_extend / alloc_decode and their capacity math."""

from canaries.regressions import regression

ALLOC = "engine_stub/mem/allocator.py"
SWA = "engine_stub/mem/swa.py"

regression(
    name="paged.decode-capacity-off-by-one", area="paged", file=SWA,
    old="        pages = sum((seq - 1) % self.page_size == 0 for seq in seq_lens)\n",
    new="        pages = sum(seq % self.page_size == 0 for seq in seq_lens)\n",
    models="the paged decode capacity check counts the requests that start a page one token "
           "early: near exhaustion it lets a decode through that a side then cannot serve",
    caught_by=("never-evict-swa-exact-fit-page16",),
)
regression(
    name="paged.decode-offset-off-by-one", area="paged", file=ALLOC,
    old="        offsets = [(seq - 1) % page for seq in seq_lens]\n",
    new="        offsets = [seq % page for seq in seq_lens]\n",
    models="paged decode places the new token one slot too far into its page (and opens a new "
           "page one token early): slots are skipped, and a page's last slot aliases the next",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="paged.extend-overdraws-a-page", area="paged", file=ALLOC,
    old="            need_pages += -(-seq // page) - first_new_page\n",
    new="            need_pages += -(-seq // page) - first_new_page + 1\n",
    models="alloc_extend draws one page more per request than the extend covers; the extra page "
           "is never handed out nor freed",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="paged.expand-shift-off-by-one", area="paged", file=SWA,
    old="            first_pages = free_index >> (page.bit_length() - 1)\n",
    new="            first_pages = free_index >> page.bit_length()\n",
    models="free_swa's page expansion divides by twice the page size: it clears and releases "
           "another page's SWA peers",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="paged.decode-new-page-as-page-id", area="paged", file=ALLOC,
    old="        if new_pages == reqs:\n            return pages * page\n",
    new="        if new_pages == reqs:\n            return pages\n",
    models="a decode batch whose every request opens a new page hands out the page ids as slots: "
           "slots of the padding page and of other pages, cached by the radix tree at finish",
    caught_by=("corrupt-r2t-minus-one-last-loc-page5",),
)
