"""Verdicts: events + responses + expectations -> one verdict with reason and latencies.

    record.py  Observation (what a run left) and VerdictRecord (what the suite concluded)
    facts.py   the run's facts, read once from its event log (firings, latencies, outcome)
    rules.py   one function per rule, composed in order by `judge` (rules in its docstring)

The suite's vocabulary of verdicts is the scenario format's (`expect.verdict` names one): it
lives in canaries/scenario, which never imports this package.
"""

from canaries.scenario.fields import PASSING, VERDICTS
from canaries.verdict.facts import Facts, facts_of
from canaries.verdict.record import Observation, VerdictRecord, detector_of
from canaries.verdict.rules import RULES, judge, steps_after

__all__ = ["PASSING", "RULES", "VERDICTS", "Facts", "Observation", "VerdictRecord", "detector_of",
           "facts_of", "judge", "steps_after"]
