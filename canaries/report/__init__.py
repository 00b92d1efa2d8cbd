"""Run reports: the per-scenario JSONL record and the JUnit XML for CI."""

from canaries.report.jsonl import append_verdict, read_verdicts
from canaries.report.junit import write_junit

__all__ = ["append_verdict", "read_verdicts", "write_junit"]
