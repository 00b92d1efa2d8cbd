"""The idle ledgers: conservation of the full pool, the SWA pool and the request rows."""

from canaries.regressions import regression

IDLE = "engine_stub/idle_check.py"

regression(
    name="ledgers.full-never-fails", area="ledgers", file=IDLE,
    old='(FULL_LEDGER, ledgers["full"]["delta"] == 0,',
    new="(FULL_LEDGER, True,",
    models="the full-pool idle ledger is computed but its verdict ignored",
    caught_by=("leak-request-strict-idle",),
)
regression(
    name="ledgers.swa-never-fails", area="ledgers", file=IDLE,
    old='(SWA_LEDGER, ledgers["swa"]["delta"] == 0,',
    new="(SWA_LEDGER, True,",
    models="the SWA-pool idle ledger is computed but its verdict ignored",
    caught_by=("skip-free-swa-radix",),
)
regression(
    name="ledgers.req-rows-never-fails", area="ledgers", file=IDLE,
    old='(REQ_ROWS_LEDGER, ledgers["req_rows"]["delta"] == 0,',
    new="(REQ_ROWS_LEDGER, True,",
    models="the request-row idle ledger is computed but its verdict ignored",
    caught_by=("leak-request",),
)
regression(
    name="ledgers.radix-sanity-ignored", area="ledgers", file=IDLE,
    old="                (RADIX_SANITY, not problems,",
    new="                (RADIX_SANITY, True,",
    models="the radix sanity check at idle lists its problems but never fails",
    caught_by=("corrupt-r2t-freed-slot-idle",),
)
regression(
    name="ledgers.swa-counts-tombstones", area="ledgers", file=IDLE,
    old='               "evictable": tree.swa_evictable_size() if tree else 0,\n',
    new='               "evictable": tree.full_evictable_size() if tree else 0,\n',
    models="the SWA ledger counts the tree's full-side evictable tokens, tombstones included, as "
           "SWA-evictable: a healthy engine with tombstones looks over-full",
    caught_by=("clean-page1-radix",),
)
regression(
    name="ledgers.strict-switch-inverted", area="ledgers", file=IDLE,
    old="        level = InvariantCheckLevel.STRICT if self.strict else InvariantCheckLevel.WARN\n",
    new="        level = InvariantCheckLevel.WARN if self.strict else InvariantCheckLevel.STRICT\n",
    models="strict_mem_check_during_idle is read backwards: a leak crashes the engine only when "
           "the switch says to count and log",
    caught_by=("leak-request-strict-idle", "leak-request"),
)
regression(
    name="ledgers.swa-available-reads-full", area="ledgers", file="engine_stub/mem/swa.py",
    old=("    def swa_available_size(self) -> int:\n"
         "        return self.swa_attn_allocator.available_size()\n"),
    new=("    def swa_available_size(self) -> int:\n"
         "        return self.full_attn_allocator.available_size()\n"),
    models="the hybrid allocator answers the SWA pool's free size with the full pool's (a "
           "copy-paste slip): admission and tree eviction plan on a pool that is not there",
    caught_by=("clean-page1-noradix",),
)
regression(
    name="ledgers.census-never-judged", area="ledgers", file="engine_stub/census.py",
    old="                    expect(inv, ok, msg, slots=slots)\n",
    new="                    pass  # evaluated and summarised, never judged\n",
    models="the memory census is computed (and summarised in the idle event) but its rules are "
           "never handed to expect: a slot with no owner or two, a stale peer, a lock no request "
           "holds, a wrong ledger term fire nothing, at idle or mid-run",
    caught_by=("leak-request-census-idle",),
)
