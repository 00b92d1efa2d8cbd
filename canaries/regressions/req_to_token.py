"""The req_to_token table: rows handed out, prompt and decode slots written."""

from canaries.regressions import regression

R2T = "engine_stub/mem/req_to_token.py"
SCHED = "engine_stub/scheduler.py"

regression(
    name="req_to_token.decode-write-wrong-column", area="req_to_token", file=SCHED,
    old=("        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=self.device)\n"
         "        table[rows, cols] = slots.to(torch.int32)\n"),
    new=("        cols = torch.tensor([r.kv_len - 1 for r in reqs], dtype=torch.int64, device=self.device)\n"
         "        table[rows, cols] = slots.to(torch.int32)\n"),
    models="decode writes the new slot over the row's last written position instead of the next "
           "one: the previous token's slot is lost from the row",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="req_to_token.write-shifted", area="req_to_token", file=R2T,
    old="        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)\n",
    new="        self.req_to_token[row, start + 1 : start + 1 + slots.numel()] = slots.to(torch.int32)\n",
    models="writing a run of slots into a row starts one column late: every prompt position reads "
           "its neighbour's slot",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="req_to_token.prefix-not-written", area="req_to_token", file=SCHED,
    old="        if prefix_len:\n            self.req_to_token_pool.write(req.row, 0, match.slots)\n",
    new="",
    models="a cache hit does not write the matched prefix's slots into the row: its positions "
           "read whatever the row's last owner left there",
    caught_by=("clean-cache-hits",),
)
regression(
    name="req_to_token.alloc-keeps-rows-free", area="req_to_token", file=R2T,
    old="        rows, self.free_slots = self.free_slots[: len(new)], self.free_slots[len(new) :]\n",
    new="        rows = self.free_slots[: len(new)]\n",
    models="alloc hands out rows without taking them off the free list: two running requests "
           "share one row",
    caught_by=("clean-page1-noradix",),
)
