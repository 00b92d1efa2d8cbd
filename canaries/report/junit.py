"""junit.xml: one testcase per scenario, for CI test-report widgets.

Failing verdicts become <failure>, except INCONCLUSIVE (the run told us nothing), which becomes
<error>; a negative test that got its expected verdict passes.
"""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from canaries.report.jsonl import as_dict

__all__ = ["write_junit"]


def write_junit(
    records: Iterable[Any],
    path: str | os.PathLike,
    suite_name: str = "serving-canary",
    durations: dict[str, float] | None = None,
) -> None:
    """Write the JUnit XML for `records` (VerdictRecords or their dicts) atomically to `path`."""
    durations = durations or {}
    rows = [as_dict(r) for r in records]
    suite = ET.Element("testsuite", name=suite_name)
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
        if not r.get("passed", False):
            verdict = str(r.get("verdict", "?"))
            message = f"{verdict}: {r.get('reason', '')}"
            tag = "error" if verdict == "INCONCLUSIVE" else "failure"
            if tag == "error":
                errors += 1
            else:
                failures += 1
            el = ET.SubElement(case, tag, message=message, type=verdict)
            el.text = message
    suite.set("tests", str(len(rows)))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", "0")
    suite.set("time", f"{total_time:.3f}")
    tree = ET.ElementTree(suite)
    ET.indent(tree)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            tree.write(f, encoding="utf-8", xml_declaration=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
