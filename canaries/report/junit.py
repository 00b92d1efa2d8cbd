"""junit.xml: one testcase per scenario, for CI test-report widgets.

Failing verdicts become <failure>, except INCONCLUSIVE (the run told us nothing) and NOT_RUN (an
interrupted run never started the scenario), which become <error>; a negative test that got its
expected verdict passes. Nothing is ever <skipped>: a scenario that did not run must not look
green. An interrupted run also gets an `interrupted` suite property and one more testcase,
`canary.run` / `interrupted`, in error, so the file fails CI whatever the scenarios did.
"""

from __future__ import annotations

import io
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

from canaries.report.atomic import write_atomic
from canaries.report.interruption import Interruption
from canaries.report.jsonl import as_dict

__all__ = ["write_junit"]

_ERROR_VERDICTS = frozenset({"INCONCLUSIVE", "NOT_RUN"})


def write_junit(
    records: Iterable[Any],
    path: str | os.PathLike,
    suite_name: str = "serving-canary",
    durations: dict[str, float] | None = None,
    interruption: Interruption | None = None,
) -> None:
    """Write the JUnit XML for `records` (VerdictRecords or their dicts) atomically to `path`;
    with `interruption`, the file says the run was interrupted and fails."""
    durations = durations or {}
    rows = [as_dict(r) for r in records]
    suite = ET.Element("testsuite", name=suite_name)
    if interruption is not None:
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="interrupted", value=interruption.cause)
        ET.SubElement(props, "property", name="interrupted_summary", value=interruption.summary())
    failures = errors = 0
    total_time = 0.0
    for r in rows:
        name = str(r.get("scenario", "?"))
        t = float(durations.get(name, 0.0))
        total_time += t
        case = ET.SubElement(suite, "testcase", classname="canary", name=name, time=f"{t:.3f}")
        props = ET.SubElement(case, "properties")
        for key in ("verdict", "signature", "seed"):
            ET.SubElement(props, "property", name=key, value=str(r.get(key, "")))
        if r.get("cause"):  # the harness failed, not the engine: no verdict on it
            ET.SubElement(props, "property", name="cause", value=str(r["cause"]))
        if not r.get("passed", False):
            verdict = str(r.get("verdict", "?"))
            message = f"{verdict}: {r.get('reason', '')}"
            tag = "error" if verdict in _ERROR_VERDICTS else "failure"
            if tag == "error":
                errors += 1
            else:
                failures += 1
            el = ET.SubElement(case, tag, message=message,
                               type=f"{verdict} ({r['cause']})" if r.get("cause") else verdict)
            el.text = message
    tests = len(rows)
    if interruption is not None:
        case = ET.SubElement(suite, "testcase", classname="canary.run", name="interrupted",
                             time="0.000")
        el = ET.SubElement(case, "error", message=interruption.summary(), type="INTERRUPTED")
        el.text = interruption.summary()
        tests += 1
        errors += 1
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", "0")
    suite.set("time", f"{total_time:.3f}")
    tree = ET.ElementTree(suite)
    ET.indent(tree)
    buf = io.BytesIO()
    tree.write(buf, encoding="utf-8", xml_declaration=True)
    write_atomic(path, buf.getvalue())
