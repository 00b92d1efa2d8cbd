"""Run reports: the per-scenario JSONL record, the JUnit XML for CI, the kill matrix, the HTML
page and the diff of two runs (`canaries.report.html`, `canaries.report.diff`: imported on use)."""

from canaries.report.atomic import write_atomic
from canaries.report.interruption import Interruption
from canaries.report.jsonl import append_verdict, read_run, read_verdicts
from canaries.report.junit import write_junit
from canaries.report.kill_matrix import kill_matrix, write_kill_matrix

__all__ = ["Interruption", "append_verdict", "kill_matrix", "read_run", "read_verdicts",
           "write_atomic", "write_junit", "write_kill_matrix"]
