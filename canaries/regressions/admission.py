"""Admission: which waiting requests a prefill batch takes, under the prefill token budget and
the pools' reservations (`Scheduler._admit`), and the submit-time refusal of what no empty
engine could admit (`admission.refusal`)."""

from canaries.regressions import regression

SCHED = "engine_stub/scheduler.py"
ADMISSION = "engine_stub/admission.py"

regression(
    name="admission.budget-exact-fit-refused", area="admission", file=SCHED,
    old="        elif admitted and extend_len > budget:\n",
    new="        elif admitted and extend_len == budget:\n",
    models="the prefill token budget compares with == instead of >: a request that fits the budget "
           "exactly waits for the next batch, and one past it is crammed in (a cosmic-ray survivor, "
           "promoted)",
    caught_by=("swap-next-token-prefill-budget-exact-fit",),
)
regression(
    name="admission.swa-fit-ignores-headroom", area="admission", file=ADMISSION,
    old="        if extend_tokens + config.swa_headroom > config.swa_pool_tokens:\n",
    new="        if extend_tokens > config.swa_pool_tokens:\n",
    models="the submit-time check forgets the SWA headroom a running request needs beside its "
           "prompt: a prompt that fits the pool only without it is queued, and no empty engine "
           "can ever admit it (the same check as the cosmic-ray survivor `+` to `|`)",
    caught_by=("clean-admission-refuses-unservable",),
)
regression(
    name="admission.swa-reserve-forgets-prompt", area="admission", file=SCHED,
    old="        need_swa = extend_tokens + self._swa_headroom() + swa_outstanding\n",
    new="        need_swa = self._swa_headroom() + swa_outstanding\n",
    models="admission reserves the SWA headroom of the running requests but not the prompt it is "
           "about to prefill: a prompt that fits only if the others' headroom is spent gets in, "
           "and the next decode finds the pool dry (its cosmic-ray form, `extend % headroom`, "
           "survived the library)",
    caught_by=("clean-pressure-swa-reserve-noradix",),
)
