"""Free groups: deferred batch frees, SWA ownership resolved at enqueue (`mem/swa.py`)."""

from canaries.regressions import regression

SWA = "engine_stub/mem/swa.py"

regression(
    name="free_group.swa-resolved-at-group-end", area="free_group", file=SWA,
    old=("        mapping = self.full_to_swa_index_mapping\n"
         "        if self.page_size == 1:\n"),
    new=("        mapping = self.full_to_swa_index_mapping\n"
         "        if self.free_group is not None:\n"
         "            # Resolved at group end: the peers are read, and the mapping cleared, then.\n"
         "            self.free_group.append(free_index.clone())\n"
         "            return\n"
         "        if self.page_size == 1:\n"),
    also=((
        "            swa_indices = swa_group[0] if len(swa_group) == 1 else torch.cat(swa_group)\n",
        "            full = swa_group[0] if len(swa_group) == 1 else torch.cat(swa_group)\n"
        "            if self.page_size > 1:\n"
        "                full = self._expand_to_full_pages(full)\n"
        "            swa_indices = torch.take(self.full_to_swa_index_mapping, full)\n"
        "            self.full_to_swa_index_mapping.index_fill_(0, full, 0)\n",
    ),),
    models="inside a free group, free_swa queues the full slots and resolves their SWA peers only "
           "at group end: until then the mapping still names the peers, so a free (free_swa then "
           "free_full) in the group trips free_full's GUARD, and a peer re-paired meanwhile is "
           "freed instead of the released one",
    caught_by=("clean-page1-noradix", "clean-page16-radix"),
)
regression(
    name="free_group.end-skips-swa", area="free_group", file=SWA,
    old="        if swa_group:\n",
    new="        if False:  # the deferred SWA frees are forgotten\n",
    models="free_group_end forgets the group's deferred SWA frees: every SWA slot released inside "
           "a group (window eviction, finish) leaks",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="free_group.end-skips-full", area="free_group", file=SWA,
    old="        if self.full_free_group:\n            full_group, self.full_free_group",
    new="        if False:  # the deferred full frees are forgotten\n            full_group, self.full_free_group",
    models="free_group_end forgets the group's deferred full frees: every full slot freed inside a "
           "group (finish, tree eviction) leaks",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="free_group.swa-last-batch-only", area="free_group", file=SWA,
    old="            swa_indices = swa_group[0] if len(swa_group) == 1 else torch.cat(swa_group)\n",
    new="            swa_indices = swa_group[-1]  # only the last batch enqueued\n",
    models="free_group_end releases only the last SWA batch enqueued in the group (a lost "
           "concatenation): when two requests evict or finish in one step, the first one's SWA "
           "slots leak",
    caught_by=("clean-page1-noradix", "clean-page1-radix"),
)
regression(
    name="free_group.full-enqueue-no-copy", area="free_group", file=SWA,
    old="            self.full_free_group.append(free_index.clone())\n",
    new="            self.full_free_group.append(free_index)\n",
    models="free_full enqueues the caller's tensor instead of a copy: a caller that reuses its "
           "buffer before the group ends changes what the group frees",
    equivalent=(
        "No caller of free_full in this engine writes the tensor it passed while the group is "
        "open: the scheduler passes slices of `req_to_token[row, :kv_len].to(int64)` (a fresh copy, "
        "the table is int32) and a perturbation's `free_full_again` (a fresh gather); the radix "
        "cache passes slices of that same copy (insert's `slots.to(int64)` is it), and node.value, "
        "which it only ever rebinds (split and recovery assign clones), never writes in place; "
        "free() hands free_full its own argument after free_swa, which only reads it; an int32 "
        "argument is converted (copied) on entry. The queued tensor therefore holds the same ids "
        "at group end as the copy would, and the sub-allocator's folds read the same values"),
)
