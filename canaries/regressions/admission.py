"""Admission: which waiting requests a prefill batch takes, under the prefill token budget and
the pools' reservations (`Scheduler._admit`)."""

from canaries.regressions import regression

SCHED = "engine_stub/scheduler.py"

regression(
    name="admission.budget-exact-fit-refused", area="admission", file=SCHED,
    old="        if admitted and extend_len > budget:\n",
    new="        if admitted and extend_len == budget:\n",
    models="the prefill token budget compares with == instead of >: a request that fits the budget "
           "exactly waits for the next batch, and one past it is crammed in (a cosmic-ray survivor, "
           "promoted)",
    caught_by=("swap-next-token-prefill-budget-exact-fit",),
)
