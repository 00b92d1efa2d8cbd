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
