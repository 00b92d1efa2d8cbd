"""PR #36723's hunks, each reverted on its own (the PR's allocator change, `mem/swa.py`).

Together they are the pre-PR allocator; `configs/scenarios/revert-pr-36723.yaml` plants all three
to prove the suite reports the double free the old filter swallows as MISSED.
"""

from canaries.regressions import regression

SWA = "engine_stub/mem/swa.py"

regression(
    name="pr36723.page1-filter-no-expect", area="pr36723", file=SWA,
    old=("            # No `> 0` filter here: its data-dependent shape would cost a device-to-host sync.\n"
         "            expect(SWA_PEER_MAPPED, swa_indices, \"caller wants free_full\", slots=free_index)\n"),
    new=("            # Pre-PR-36723: unmapped peers are filtered out silently (a sync), nothing expected.\n"
         "            swa_indices = swa_indices[swa_indices > 0]\n"),
    also=((
        "            if checks:\n"
        "                # No `> 0` filter here: its data-dependent shape would cost a device-to-host sync.\n"
        "                expect(SWA_PEER_MAPPED, swa_indices, \"caller wants free_full\", slots=free_index)\n",
        "            swa_indices = swa_indices[swa_indices > 0]  # pre-PR-36723: the silent filter\n",
    ),),
    models="free_swa on page_size 1 goes back to filtering `swa_indices > 0` with no expect: a peer "
           "already released (a double free_swa, a stripped mapping) is dropped silently instead of "
           "firing swa.peer_mapped",
    caught_by=("double-free-swa-page1", "strip-mapping-page1"),
)
regression(
    name="pr36723.free-full-no-guard", area="pr36723", file=SWA,
    old=("        if checks:\n"
         "            expect(\n"
         "                SWA_PEER_RELEASED,\n"
         "                torch.take(self.full_to_swa_index_mapping, free_index),\n"
         "                \"caller wants free\",\n"
         "                slots=free_index,\n"
         "            )\n"),
    new="        # Pre-PR-36723: free_full checks nothing.\n",
    models="free_full without the GUARD at enqueue: a full slot freed while its SWA peer is still "
           "mapped strands the peer silently (swa.peer_released never fires)",
    caught_by=("skip-free-swa-noradix", "skip-free-swa-page16"),
)
regression(
    name="pr36723.group-end-through-free-full", area="pr36723", file=SWA,
    old="            full_report = self.full_attn_allocator._free(full_indices, owned=True, checks=checks)\n",
    new="            self.free_full(full_indices)  # pre-PR-36723: through free_full, its GUARD once more\n",
    models="free_group_end frees the deferred full indices through free_full instead of the full "
           "sub-allocator, so swa.peer_released is evaluated a second time, at group end, against "
           "peers a cache action paired inside the group",
    equivalent=(
        "Only the GUARD's second evaluation at group end changes (plus the order of one group's drop "
        "reports: full before SWA). It can only fire on a queued full slot whose mapping is nonzero "
        "at group end, and in this engine nothing writes a nonzero mapping entry for a slot queued "
        "in an open group: no allocation (_pair) ever runs inside a free group (scheduler: the "
        "finish, abort, window-eviction and tree-eviction groups only free), the one mapping writer "
        "that can run inside one, a locked tombstone recovery, writes node.value, slots the tree "
        "holds and that no release queues while the node exists, and no perturbation kind writes "
        "the mapping at a site inside a group (leak_request and double_free_full at request finish, "
        "the window-eviction kinds, write none). A slot mapped at enqueue already fired the GUARD "
        "there (a crash at STRICT; at WARN the mutant counts a second firing of the same detector, "
        "which no verdict reads). Reaching it needs SGLang's wider free group (one that spans a "
        "step's allocation): an engine change, not a scenario"),
)
regression(
    name="pr36723.paged-filter-dropped", area="pr36723", file=SWA,
    old="            report = side._free(swa_indices, owned=True, checks=checks, skip_nonpositive=True)\n",
    new="            report = side._free(swa_indices, owned=True, checks=checks)\n",
    models="the PR's sync-free free_swa applied to larger pages too: a page's unmapped slots "
           "(its unused tail, a tombstoned range) are freed as the padding page instead of skipped",
    caught_by=("clean-page16-noradix", "clean-page16-radix"),
)
