"""Run reports: the per-scenario JSONL record, the JUnit XML for CI, and the kill matrix."""

from canaries.report.jsonl import append_verdict, read_verdicts
from canaries.report.junit import write_junit
from canaries.report.kill_matrix import kill_matrix, write_kill_matrix

__all__ = ["append_verdict", "kill_matrix", "read_verdicts", "write_junit", "write_kill_matrix"]
