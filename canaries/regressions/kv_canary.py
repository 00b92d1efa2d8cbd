"""The KV canary (`kv_canary.py`): its verification windows, hashes and sweep."""

from canaries.regressions import regression

CANARY = "engine_stub/kv_canary.py"
SCHED = "engine_stub/scheduler.py"
SWA_WINDOW = "                lo = [u - window if u > window else 0 for u in upto]\n"

regression(
    name="kv_canary.swa-window-short", area="kv_canary", file=CANARY,
    old=SWA_WINDOW,
    new="                lo = [u - (window - 3) if u > window - 3 else 0 for u in upto]\n",
    models="the SWA group verifies a window 3 positions too short: damage to the oldest SWA KV "
           "the next forward reads goes unseen",
    caught_by=("flip-kv-swa-in-window",),
)
regression(
    name="kv_canary.swa-window-long", area="kv_canary", file=CANARY,
    old=SWA_WINDOW,
    new="                lo = [u - window - 1 if u > window + 1 else 0 for u in upto]\n",
    models="the SWA group verifies a window one position too long: it checks a position the "
           "window eviction already released (a false alarm on a healthy engine)",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="kv_canary.kv-hash-even-weights", area="kv_canary", file=CANARY,
    old="(torch.arange(self._kv_words[g].shape[1], dtype=torch.int64, device=device) * 2 + 1) * _M3",
    new="(torch.arange(self._kv_words[g].shape[1], dtype=torch.int64, device=device) * 2) * _M3",
    models="the real-KV fold uses even weights: the first word of a slot's KV (the first layer's K) "
           "weighs 0 and every word's top bit is lost, so a flipped byte there is never seen",
    caught_by=("flip-kv-full-in-use", "flip-kv-swa-in-use"),
)
regression(
    name="kv_canary.chain-never-checked", area="kv_canary", file=CANARY,
    old="        fails = stored[:, _POSITION:_POSITION + len(columns)] != expected\n",
    new=("        fails = stored[:, _POSITION:_POSITION + len(columns)] != expected\n"
         "        fails[:, 1] = False  # the chain column is compared and then discarded\n"),
    models="verification discards the chain-hash comparison: a slot holding another token's KV "
           "at the right position passes",
    caught_by=("corrupt-r2t-freed-slot-canary", "corrupt-r2t-invariants-off"),
)
regression(
    name="kv_canary.sweep-skips-full", area="kv_canary", file=CANARY,
    old="        active = [torch.ones(n, dtype=torch.bool)]\n",
    new="        active = [torch.zeros(n, dtype=torch.bool)]\n",
    models="the sweep of the radix cache's slots verifies the SWA group only: a cached full slot "
           "that changed is never seen",
    caught_by=("flip-kv-cached-sweep",),
)
regression(
    name="kv_canary.sweep-never-runs", area="kv_canary", file=SCHED,
    old="            if self.step_no % cfg.kv_canary_sweep_interval == 0:\n",
    new="            if self.step_no % cfg.kv_canary_sweep_interval == cfg.kv_canary_sweep_interval:\n",
    models="the sweep's cadence test can never be true: cached slots are never verified",
    caught_by=("flip-kv-cached-sweep",),
)
regression(
    name="kv_canary.token-oracle-blind", area="kv_canary", file=CANARY,
    old="            if expected is not None and req.new_token_ids and req.new_token_ids[0] != expected:\n",
    new="            if expected is not None and req.new_token_ids and False:\n",
    models="the token oracle compares nothing: a token swapped after the sampler is written "
           "unseen",
    caught_by=("swap-next-token",),
)
regression(
    name="kv_canary.finish-token-unchecked", area="kv_canary", file="engine_stub/kv_canary.py",
    old="        if expected is not None and last_token is not None and last_token != expected:\n",
    new="        if False:\n",
    models="the token oracle drops a request's last sampled token at its finish unchecked: a "
           "token changed after the sampler on a request's last step reaches the client unseen "
           "(a canary fuzz finding)",
    caught_by=("swap-next-token-last-step",),
)
regression(
    name="kv_canary.padding-slot-skipped", area="kv_canary", file=CANARY,
    old="        stored[:, _POSITION].masked_fill_(slots <= 0, _NO_POSITION)\n",
    new="        valid = valid & (slots > 0)\n",
    models="verification skips every position that maps to the padding slot, as SGLang's canary "
           "does: a row entry zeroed before its token's write sends the token's KV to slot 0, the "
           "forwards read it there, and with invariants off nothing sees it (a canary fuzz finding)",
    caught_by=("corrupt-r2t-zero-before-write-canary",),
)
