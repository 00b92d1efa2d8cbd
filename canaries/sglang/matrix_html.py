"""The release matrix as one self-contained HTML page: scenario x release, each cell coloured
by how it compares with the native verdict, the reason on hover and below; each column's header
says what ran (source, fingerprints, patches, diffs) and where its known divergences came from."""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["matrix_html"]

_STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}
th{background:#f3f3f3;position:sticky;top:0}
td.same{background:#eef8ee}td.known{background:#fff6d9}td.unexplained{background:#fbd5d5;font-weight:bold}
td.native{background:#f6f6f6}td.harness{background:#e8e8f8;font-style:italic}li.flaky{color:#a60}.fail{text-decoration:line-through}.gate-fail{color:#a00}.gate-pass{color:#070}
small{color:#666}th small{display:inline-block;max-width:24em;word-break:break-all}
"""


def _cell(cell: Any) -> str:
    verdict = escape(cell.verdict)
    if not cell.passed:
        verdict = f'<span class="fail">{verdict}</span>'
    dets = escape(", ".join(cell.detectors))
    title = escape(cell.reason or cell.status, quote=True)
    return f'<td class="{cell.status}" title="{title}">{verdict}<br><small>{dets}</small></td>'


def _confirmed(g: Any, name: str) -> str:
    """What the gate's reruns of `name` gave on each column (empty when it was not rerun)."""
    c = g.confirmations.get(name)
    return f"({c.describe(g.last, g.candidate)})" if c is not None else ""


def matrix_html(result: Any) -> str:
    """The page for a `MatrixResult`."""
    labels = [c.label for c in result.columns]
    head = "".join(f"<th>{escape(c.label)}<br><small>sglang {escape(c.version)}, {c.seconds:.0f}s<br>"
                   f"{escape(c.source)}<br>divergences: {escape(c.divergences or '-')}</small></th>"
                   for c in result.columns)
    rows = []
    for name, row in result.cells.items():
        cells = "".join(_cell(row[label]) if label in row else "<td>-</td>" for label in labels)
        rows.append(f"<tr><th>{escape(name)}</th>{_cell(row['native'])}{cells}</tr>")
    notes = []
    for name, row in result.cells.items():
        for label in labels:
            cell = row.get(label)
            if cell is not None and cell.status in ("known", "unexplained"):
                notes.append(f"<li><b>{escape(name)}</b> on {escape(label)} ({escape(cell.status)}): "
                             f"{escape(cell.reason or 'no recorded reason')}</li>")
    gate = ""
    if result.gate is not None:
        g = result.gate
        cls, word = ("gate-pass", "PASS") if g.ok else ("gate-fail", "FAIL")
        items = "".join(f"<li>regression: <b>{escape(n)}</b> {escape(_confirmed(g, n))}</li>" for n in g.regressions)
        items += "".join(f"<li>fixed: {escape(n)}</li>" for n in g.fixed)
        items += "".join(f"<li class=flaky>FLAKY ({'fails' if g.flaky_fails else 'does not fail'} the gate): "
                         f"<b>{escape(n)}</b> {escape(_confirmed(g, n))}</li>" for n in g.flaky)
        items += "".join(f"<li>not judged, the harness failed a cell: {escape(n)}</li>" for n in g.harness)
        gate = f'<h2 class="{cls}">Gate {escape(g.last)} &rarr; {escape(g.candidate)}: {word}</h2><ul>{items}</ul>'
    side = "servers" if result.runtime == "sglang-server" else "memory paths"
    return (f"<!doctype html><meta charset=utf-8><title>Release matrix</title><style>{_STYLE}</style>"
            f"<h1>Release matrix: SGLang's {side}</h1><p>native: {result.native_seconds:.0f}s; "
            f"{len(result.unexplained)} unexplained cell(s)</p>{gate}"
            f"<table><tr><th>scenario</th><th>native</th>{head}</tr>{''.join(rows)}</table>"
            f"<h2>Differences from native</h2><ul>{''.join(notes) or '<li>none</li>'}</ul>")
