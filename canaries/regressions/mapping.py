"""The full-to-SWA mapping: cleared when a peer is released, paired when slots are allocated."""

from canaries.regressions import regression

SWA = "engine_stub/mem/swa.py"

regression(
    name="mapping.free-swa-keeps-mapping", area="mapping", file=SWA,
    old=("blocking H2D copy.\n"
         "            mapping.index_fill_(0, free_index, 0)\n"),
    new="blocking H2D copy.\n",
    models="free_swa (page_size 1) releases the SWA peers but leaves the mapping naming them: the "
           "full slot still looks paired, so free_full at finish sees a live peer and the SWA slot "
           "is reachable through a stale entry after it is handed out again",
    caught_by=("clean-page1-noradix", "clean-page1-radix"),
)
regression(
    name="mapping.paged-free-swa-keeps-mapping", area="mapping", file=SWA,
    old=("            mapping.index_fill_(0, mapping_indices, 0)\n"
         "        group = self.free_group\n"),
    new="        group = self.free_group\n",
    models="free_swa on larger pages releases the pages' SWA peers without clearing their mapping "
           "entries",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="mapping.decode-pairs-full-last-loc", area="mapping", file=SWA,
    old="        swa = swa_side.alloc_decode(seq_lens, swa_last_loc)\n",
    new="        swa = swa_side.alloc_decode(seq_lens, last_loc)\n",
    models="paged decode continues the SWA side from the FULL slot of the last token instead of "
           "its SWA peer: a decode token inside a page is paired with a slot of some other SWA page",
    caught_by=("clean-page16-noradix",),
)
regression(
    name="mapping.alloc-not-paired", area="mapping", file=SWA,
    old=("            swa = swa_side._take_ready(need_size)\n"
         "        else:\n"
         "            full = full_side.alloc(need_size)\n"
         "            swa = swa_side.alloc(need_size)\n"
         "        return self._pair(full, swa)\n"),
    new=("            swa = swa_side._take_ready(need_size)\n"
         "        else:\n"
         "            full = full_side.alloc(need_size)\n"
         "            swa = swa_side.alloc(need_size)\n"
         "        return full  # both sides taken, never paired\n"),
    models="alloc (page_size 1) takes slots on both sides but never writes the mapping: the new "
           "full slots keep whatever peer (or none) their entry last named",
    caught_by=("clean-page1-noradix",),
)
