"""index.html: one self-contained page for triaging a run (readable offline).

No network: inline CSS, inline SVG plots generated here (`canaries.report.timeline`), and a few
lines of vanilla JS (expand/collapse, failures only, open the scenario a link points at, copy a
repro command); the page reads fine without them. Links to a scenario's own files
(`NAME/events.jsonl`, ...) are relative, so the report directory can be moved or archived whole.

Layout: a header (run, counts, an interrupted run's banner), the summary (counts by verdict,
failures grouped by signature), the diff against a base run when given one, an index of every
scenario (failures first), the kill matrix, then one section per scenario (`id="s-<name>"`, class
`scenario`, `data-verdict`, `data-passed`): the verdict and reason in words, the expectation,
detection latencies, each landing's digest (what was damaged), the first firing and every later
one, the pool-occupancy timeline, the crash, the idle ledgers, the engine log and event log around
the first firing, the repro commands and the scenario's files.

`write_html(report_dir, diff=...)` writes `report_dir/index.html` atomically and returns its path;
`python -m canaries.report.html REPORT_DIR [--base BASE_REPORT_DIR]` does the same from a shell.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from canaries.report.atomic import write_atomic
from canaries.report.jsonl import read_run, read_verdicts
from canaries.report.timeline import Timeline, build_timeline, legend_html, render_svg, svg_css

if TYPE_CHECKING:
    from canaries.report.diff import DiffResult

__all__ = ["render_html", "write_html", "main", "VERDICT_WORDS", "scenario_anchor"]

PASSING_VERDICTS = ("DETECTED", "DISABLED_AS_DECLARED", "CLEAN")
VERDICT_ORDER = ("INCONCLUSIVE", "NOT_RUN", "MISSED", "WRONG_DETECTOR", "LATE", "FALSE_ALARM",
                 "NOT_INJECTED", "NOT_REACHED", "DETECTED", "DISABLED_AS_DECLARED", "CLEAN")
VERDICT_WORDS = {
    "DETECTED": "The perturbation landed and every expected detector fired, in time.",
    "DISABLED_AS_DECLARED": "The check was off as declared, and the declared fallback detector "
                            "caught the damage.",
    "CLEAN": "A control run: no detector fired and every output matched the no-cache oracle.",
    "MISSED": "The damage landed, but an expected detector never fired after it.",
    "WRONG_DETECTOR": "A detector other than the expected one fired, or one that must stay "
                      "silent fired.",
    "LATE": "The expected detector fired, but later than `within_steps` allows.",
    "FALSE_ALARM": "A detector fired with no damage to explain it (in a control, or before the "
                   "first landing).",
    "NOT_INJECTED": "A perturbation never landed: the scenario tested nothing.",
    "NOT_REACHED": "It landed, but every damaged piece died unread: the scenario is vacuous.",
    "INCONCLUSIVE": "The run tells nothing: a timeout, a harness error, an unexplained crash, or "
                    "the run was interrupted while it ran.",
    "NOT_RUN": "Never started: the run was interrupted first.",
}
MAX_FIRING_ROWS = 30  # grouped firing rows per scenario; the rest are counted, not listed
MAX_LOG_BYTES = 256 * 1024  # read at most this much of the end of an engine.log
LOG_CONTEXT = 8  # engine.log lines either side of the line that names the first firing
MAX_LANDINGS = 3  # landings shown in full; the rest in a compact table
MAX_LIFECYCLE = 12  # reads/deaths listed per landing; the rest are counted
EVENT_CONTEXT = 3  # events either side of the first firing
META_KEYS = ("seq", "ts", "kind", "step", "index", "perturbation", "site", "landing")


# ---- loading ------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    """Every JSON object line of `path`; torn or foreign lines skipped (an event log a crash
    cut short is still worth plotting)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _read_tail(path: Path, limit: int = MAX_LOG_BYTES) -> tuple[list[str], int] | None:
    """The last lines of a text file (at most `limit` bytes) and how many lines were cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return None
    lines = data.decode("utf-8", errors="replace").splitlines()
    skipped = 0
    if size > limit and lines:
        lines = lines[1:]  # a partial first line
        skipped = -1  # unknown: "earlier lines cut"
    return lines, skipped


_KIND_DOCS: dict[str, str] | None = None


def _kind_docs() -> dict[str, str]:
    """Perturbation kind -> its docstring (what it does; what should catch it). Empty if the
    engine's registry cannot be imported here."""
    global _KIND_DOCS
    if _KIND_DOCS is None:
        try:
            from engine_stub.perturb.kinds import KINDS

            _KIND_DOCS = {name: info.doc for name, info in KINDS.items()}
        except Exception:  # noqa: BLE001 - a report without the glossary is still a report
            _KIND_DOCS = {}
    return _KIND_DOCS


@dataclass
class _Scenario:
    record: dict
    anchor: str
    dir: Path | None
    rel: str  # the scenario directory relative to the report, for links
    events: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.record.get("scenario", "?"))

    @property
    def verdict(self) -> str:
        return str(self.record.get("verdict", "?"))

    @property
    def passed(self) -> bool:
        return bool(self.record.get("passed"))


def scenario_anchor(name: str) -> str:
    """The element id of a scenario's section: `s-` and the name, with anything outside
    [A-Za-z0-9_.-] replaced by `-`."""
    return "s-" + re.sub(r"[^A-Za-z0-9_.-]", "-", name)


def _load_scenarios(report_dir: Path, records: list[dict]) -> list[_Scenario]:
    seen: dict[str, int] = {}
    out = []
    by_name: dict[str, dict] = {}
    for r in records:  # the last record of a name wins (as read_verdicts' readers expect)
        by_name[str(r.get("scenario", "?"))] = r
    for name, r in by_name.items():
        anchor = scenario_anchor(name)
        if anchor in seen:
            seen[anchor] += 1
            anchor = f"{anchor}-{seen[anchor]}"
        else:
            seen[anchor] = 0
        d = report_dir / name
        if not (d.is_dir() and d.resolve().parent == report_dir.resolve()):
            alt = (r.get("extra") or {}).get("run_dir")
            d = Path(alt) if alt and Path(alt).is_dir() else None
        sc = _Scenario(record=r, anchor=anchor, dir=d, rel=name)
        if d is not None:
            sc.events = _read_jsonl(d / "events.jsonl")
        out.append(sc)
    return out


# ---- small formatting helpers ---------------------------------------------------------------------


def _e(value: Any) -> str:
    """Escaped for a text node."""
    return escape(str(value), quote=False)


def _a(value: Any) -> str:
    """Escaped for a double-quoted attribute value."""
    return escape(str(value), quote=True)


def _ranges(values: Iterable[Any], limit: int = 16) -> str:
    """[14, 15, 16, 17, 103] -> '14-17, 103' (ints); other values joined; long lists cut."""
    vals = list(values)
    if not vals:
        return ""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        text = ", ".join(str(v) for v in vals[:limit])
        return text + (f", ... ({len(vals)} in all)" if len(vals) > limit else "")
    parts: list[str] = []
    start = prev = vals[0]
    for v in vals[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    text = ", ".join(parts[:limit])
    if len(parts) > limit:
        text += f", ... ({len(vals)} values in all)"
    return text


def _value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + _ranges(v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)


def _badge(verdict: str, passed: bool | None = None) -> str:
    cls = "pass" if (passed if passed is not None else verdict in PASSING_VERDICTS) else "fail"
    return f'<span class="badge {cls}" data-verdict="{_a(verdict)}">{_e(verdict)}</span>'


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def _detector_of(event: dict) -> str | None:
    if event.get("kind") == "invariant_firing":
        return str(event.get("invariant"))
    if event.get("kind") == "canary_violation":
        return f"kv_canary.{event.get('reason')}"
    return None


def _verdict_rank(verdict: str) -> int:
    return VERDICT_ORDER.index(verdict) if verdict in VERDICT_ORDER else -1


def _ordered(scenarios: list[_Scenario]) -> list[_Scenario]:
    """Failures first (grouped by signature), then passes in run order."""
    fails = sorted((s for s in scenarios if not s.passed),
                   key=lambda s: (_verdict_rank(s.verdict), str(s.record.get("signature")), s.name))
    return fails + [s for s in scenarios if s.passed]


# ---- the landing digest -------------------------------------------------------------------------

_WHERE_KEYS = (("rid", "request"), ("rids", "requests"), ("row", "req_to_token row"),
               ("position", "position"), ("positions", "positions"), ("slot", "slot"),
               ("slots", "slots"), ("group", "pool"), ("pool_row", "pool row"),
               ("layer", "layer"), ("byte", "byte"), ("frontier", "window frontier"),
               ("kv_len", "KV length"), ("switch", "switch"), ("value", "value"))


def _landed_slots(landed: list[dict]) -> dict[int, str]:
    """Slot -> which landing touched it (the keys that name slots; a req_to_token row's
    before/after values are slots too)."""
    out: dict[int, str] = {}

    def add(v: Any, what: str) -> None:
        if isinstance(v, int) and not isinstance(v, bool):
            out.setdefault(v, what)
        elif isinstance(v, list):
            for x in v:
                add(x, what)
        elif isinstance(v, dict):
            for k, x in v.items():
                if k.startswith("freed") or k in ("slot", "slots"):
                    add(x, what)

    for ld in landed:
        rid = ld.get("rid")
        what = f"perturbations[{ld.get('index')}] ({ld.get('perturbation')}"
        what += f", request {rid})" if rid else ")"
        for k in ("slot", "slots", "pool_row"):
            add(ld.get(k), what)
        for k in ("before", "after"):
            if "row" in ld or isinstance(ld.get(k), dict):
                add(ld.get(k), what)
    return out


def _landing_html(ld: dict, lifecycle: list[dict], glossary: bool = True) -> str:
    kind = str(ld.get("perturbation", "?"))
    head = (f"<b>{_e(kind)}</b> (perturbations[{_e(ld.get('index'))}]) landed at step "
            f"<b>{_e(ld.get('step'))}</b>, site <code>{_e(ld.get('site'))}</code>")
    if ld.get("landing") not in (None, 1):
        head += f", landing #{_e(ld.get('landing'))}"
    where = [f"{label} <code>{_e(_value(ld[k]))}</code>" for k, label in _WHERE_KEYS if k in ld]
    rows = []
    before, after = ld.get("before"), ld.get("after")
    if isinstance(before, dict) or isinstance(after, dict):
        b, a = before if isinstance(before, dict) else {}, after if isinstance(after, dict) else {}
        for k in list(b) + [k for k in a if k not in b]:
            cls = "" if b.get(k) == a.get(k) else ' class="changed"'
            rows.append(f"<tr{cls}><td>{_e(k)}</td><td>{_e(_value(b.get(k, '-')))}</td>"
                        f"<td>{_e(_value(a.get(k, '-')))}</td></tr>")
        ba = ('<table class="kv ba"><tr><th></th><th>before</th><th>after</th></tr>'
              + "".join(rows) + "</table>")
    elif "before" in ld or "after" in ld:
        ba = (f'<p>before <code>{_e(_value(before))}</code> &rarr; after '
              f'<code>{_e(_value(after))}</code></p>')
    else:
        ba = ""
    known = {k for k, _ in _WHERE_KEYS} | set(META_KEYS) | {"before", "after"}
    rest = [f"{_e(k)} <code>{_e(_value(v))}</code>" for k, v in ld.items()
            if k not in known and k != "damage"]
    damage = ld.get("damage")
    if isinstance(damage, list) and damage:
        # Typed damage, summarised: the where/before/after above already show the first pieces.
        kinds = Counter(str(d.get("kind")) if isinstance(d, dict) else str(d) for d in damage)
        rest.append("damage <code>" + _e(", ".join(f"{k} x{n}" for k, n in kinds.items()))
                    + "</code>")
    glossary = (f'<p class="muted small">What <code>{_e(kind)}</code> does: '
                f'<a href="#kind-{_a(kind)}">perturbation kinds</a></p>'
                if glossary and kind in _kind_docs() else "")
    # One line per (step, outcome, reader): a pool running dry reads a landing's every piece at once.
    grouped = Counter()
    for ev in lifecycle:
        grouped[(ev.get("step"), ev.get("kind"), ev.get("by"))] += int(ev.get("count") or 1)
    grouped = list(grouped.items())
    life = "".join(
        f'<li class="life life-{_e(kind_)}">step {_e(step)}: '
        + ("read" if kind_ == "perturbation_consumed" else "died unread")
        + (f" by <code>{_e(by)}</code>" if by else "") + (f" (x{n})" if n > 1 else "") + "</li>"
        for (step, kind_, by), n in grouped[:MAX_LIFECYCLE])
    if len(grouped) > MAX_LIFECYCLE:
        life += f'<li class="muted">... and {sum(n for _, n in grouped[MAX_LIFECYCLE:])} more</li>'
    return (f'<div class="landing" data-index="{_a(ld.get("index"))}"><p>{head}</p>'
            + (f"<p>{' &middot; '.join(where)}</p>" if where else "") + ba
            + (f"<p class=\"muted\">{' &middot; '.join(rest)}</p>" if rest else "")
            + (f"<ul>{life}</ul>" if life else "") + glossary + "</div>")


def _more_landings_html(landed: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{_e(ld.get('step'))}</td><td>{_e(ld.get('index'))}</td>"
        f"<td>{_e(ld.get('landing', ''))}</td><td>{_e(ld.get('rid', ld.get('rids', '')))}</td>"
        f"<td>{_e(_value({k: v for k, v in ld.items() if k not in META_KEYS and k != 'rid'}))[:160]}"
        "</td></tr>" for ld in landed[:MAX_FIRING_ROWS])
    more = (f'<p class="muted">... and {len(landed) - MAX_FIRING_ROWS} more.</p>'
            if len(landed) > MAX_FIRING_ROWS else "")
    return (f'<details class="more-landings"><summary>{len(landed)} more landing(s)</summary>'
            '<table class="grid"><tr><th>step</th><th>perturbation</th><th>landing</th>'
            f"<th>request</th><th>digest</th></tr>{rows}</table>{more}</details>")


# ---- firings -------------------------------------------------------------------------------------


def _firing_events(sc: _Scenario) -> list[dict]:
    """The scenario's detector events (from events.jsonl; from the record when there is none)."""
    evs = [e for e in sc.events if _detector_of(e) is not None]
    if evs or sc.events:
        return [{**e, "detector": _detector_of(e)} for e in evs]
    return [dict(f) for f in sc.record.get("firings") or []]


def _site_of(f: dict) -> str:
    if f.get("site"):
        return str(f["site"])
    if f.get("phase") or f.get("group"):
        return f"kv_canary {f.get('phase', '?')} {f.get('group', '?')}"
    return "?"


def _first_firing_html(f: dict, first_landed: int | None, landed_slots: dict[int, str],
                       expected: set[str]) -> str:
    det = str(f.get("detector"))
    step = f.get("step")
    items = [("detector", f"<code>{_e(det)}</code>"
              + (' <span class="tag">expected</span>' if det in expected else ""))]
    if isinstance(step, int) and first_landed is not None:
        lat = step - first_landed
        items.append(("step", f"{step} ({_steps(lat)} after the first landing at step "
                              f"{first_landed})" if lat >= 0 else
                              f"{step} (before the first landing at step {first_landed})"))
    else:
        items.append(("step", _e(step)))
    items.append(("site", f"<code>{_e(_site_of(f))}</code>"))
    slots = f.get("slots") if isinstance(f.get("slots"), list) else (
        [f["slot"]] if isinstance(f.get("slot"), int) else [])
    request = f.get("request")
    hits = [s for s in slots if s in landed_slots]
    if request:
        items.append(("request", f"<code>{_e(request)}</code>"))
    elif hits:
        items.append(("request", "not recorded by this detector; slot "
                      f"{hits[0]} was touched by {_e(landed_slots[hits[0]])}"))
    else:
        items.append(("request", '<span class="muted">not recorded by this detector</span>'))
    if slots:
        note = f" (touched by the perturbation: {_e(_ranges(hits))})" if hits else ""
        items.append(("slots", f"<code>{_e(_ranges(slots))}</code>{note}"))
    for k in ("position", "pool_row", "group", "phase", "bucket", "level", "crashed", "stored",
              "expected", "msg", "total_hits"):
        if k in f:
            items.append((k, f"<code>{_e(_value(f[k]))}</code>"))
    return ('<dl class="kv first-firing">'
            + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>")


def _firing_rows(firings: list[dict], first_landed: int | None, expected: set[str],
                 silent: set[str]) -> tuple[str, int]:
    """Rows of (detector, site) over a run of consecutive steps: the steps, count, requests,
    slots and positions. Returns the table and the number of rows left out."""
    groups: list[dict] = []
    open_runs: dict[tuple[str, str], dict] = {}
    for f in firings:
        key = (str(f.get("detector")), _site_of(f))
        step = f.get("step") if isinstance(f.get("step"), int) else None
        g = open_runs.get(key)
        if g is None or step is None or g["last"] is None or step > g["last"] + 1:
            g = {"key": key, "first": step, "last": step, "n": 0, "req": [], "slots": set(),
                 "pos": set()}
            open_runs[key] = g
            groups.append(g)
        g["last"] = step if step is not None else g["last"]
        g["n"] += 1
        if f.get("request") and f["request"] not in g["req"]:
            g["req"].append(f["request"])
        for slot in (f.get("slots") if isinstance(f.get("slots"), list) else [f.get("slot")]):
            if isinstance(slot, int):
                g["slots"].add(slot)
        if isinstance(f.get("position"), int):
            g["pos"].add(f["position"])
    rows = []
    for g in groups[:MAX_FIRING_ROWS]:
        det, site = g["key"]
        a, b = g["first"], g["last"]
        steps = "?" if a is None else (str(a) if a == b else f"{a}-{b}")
        lat = (a - first_landed if a is not None and first_landed is not None else None)
        cls = "expected" if det in expected else ("silent" if det in silent else "")
        rows.append(
            f'<tr class="{cls}"><td>{steps}</td>'
            f"<td>{'' if lat is None else ('+' if lat >= 0 else '') + str(lat)}</td>"
            f"<td><code>{_e(det)}</code></td><td>{_e(site)}</td><td>{g['n']}</td>"
            f"<td>{_e(', '.join(map(str, g['req'][:6])))}</td>"
            f"<td>{_e(_ranges(sorted(g['slots']), 6))}</td>"
            f"<td>{_e(_ranges(sorted(g['pos']), 6))}</td></tr>")
    table = ('<table class="grid firings"><tr><th>steps</th><th>after landing</th><th>detector'
             "</th><th>site</th><th>count</th><th>requests</th><th>slots</th><th>positions</th>"
             "</tr>" + "".join(rows) + "</table>")
    return table, max(0, len(groups) - MAX_FIRING_ROWS)


# ---- logs ------------------------------------------------------------------------------------------


def _engine_log_html(sc: _Scenario, first: dict | None, crash: dict | None) -> str:
    if sc.dir is None:
        return ""
    got = _read_tail(sc.dir / "engine.log")
    if got is None:
        return '<p class="muted">No engine.log.</p>'
    lines, cut = got
    if not lines:
        return '<p class="muted">engine.log is empty.</p>'
    needles = [n for n in ((first or {}).get("detector"), (first or {}).get("reason"),
                           "crashed", "Traceback", "violation", "FAILED") if n]
    hit = next((i for n in needles for i, ln in enumerate(lines) if str(n) in ln), None)
    if hit is None:
        lo, hi, why = max(0, len(lines) - 2 * LOG_CONTEXT), len(lines), "the end of the log"
    else:
        lo, hi = max(0, hit - LOG_CONTEXT), min(len(lines), hit + LOG_CONTEXT + 1)
        why = ("the line naming the first firing" if first is not None
               else "the line naming the crash" if crash is not None else "the first error line")
    body = "".join((f'<span class="hl">{_e(lines[i])}</span>' if i == hit else _e(lines[i]))
                   + "\n" for i in range(lo, hi))
    total = len(lines)
    where = f"lines {lo + 1}-{hi} of {total}" + (" (of the log's last 256 KB)" if cut else "")
    return (f'<p class="muted">engine.log, {where}, around {why}:</p>'
            f'<pre class="log">{body}</pre>')


def _event_log_html(sc: _Scenario, anchor: dict | None) -> str:
    if anchor is None or "seq" not in anchor or not sc.events:
        return ""
    idx = next((i for i, e in enumerate(sc.events) if e.get("seq") == anchor["seq"]), None)
    if idx is None:
        return ""
    lo, hi = max(0, idx - EVENT_CONTEXT), min(len(sc.events), idx + EVENT_CONTEXT + 1)
    out = []
    for i in range(lo, hi):
        e = {k: v for k, v in sc.events[i].items() if k not in ("ts", "traceback", "config",
                                                                 "config_sources", "detail")}
        text = json.dumps(e, default=str)
        if len(text) > 200:
            text = text[:197] + "..."
        out.append((f'<span class="hl">{_e(text)}</span>' if i == idx else _e(text)) + "\n")
    return (f'<p class="muted">events.jsonl, events {lo + 1}-{hi} of {len(sc.events)}, around '
            f'the {"first firing" if _detector_of(sc.events[idx]) else "crash"}:</p>'
            f'<pre class="log">{"".join(out)}</pre>')


# ---- one scenario ------------------------------------------------------------------------------


def _expectation(expect: dict) -> str:
    if not expect:
        return ""
    if expect.get("clean"):
        text = "a control: no detector may fire, every output must match the no-cache oracle"
    elif expect.get("disabled"):
        dis = expect["disabled"]
        checks = {k: v for k, v in dis.items() if k != "reason"} if isinstance(dis, dict) else {}
        checks = checks.get("checks", checks)
        text = (f"checks disabled ({_e(_value(checks))}: {_e(dis.get('reason', ''))}); "
                f"must be caught by {_e(', '.join(expect.get('detected_by') or []) or '?')}")
    else:
        text = f"expects {_e(', '.join(expect.get('fires') or []) or '?')} to fire"
        if expect.get("within_steps") is not None:
            text += f" within {_steps(expect['within_steps'])} of the landing"
    if expect.get("silent"):
        text += f"; must stay silent: {_e(', '.join(expect['silent']))}"
    if expect.get("engine"):
        text += f"; the engine {_e(expect['engine'].replace('crashes', 'must crash').replace('survives', 'must survive'))}"
    if expect.get("verdict"):
        text += (f'; <b>negative test</b>: passes only if the verdict is exactly '
                 f'{_e(expect["verdict"])}')
    return f"<p><b>Expectation</b>: {text}.</p>"


def _latency_html(record: dict, first_landed: int | None) -> str:
    latency = record.get("latency") or {}
    if not latency:
        return ""
    expect = record.get("expect") or {}
    expected = set(expect.get("fires") or []) | set(expect.get("detected_by") or [])
    items = []
    for det, lat in latency.items():
        tag = ' <span class="tag">expected</span>' if det in expected else ""
        if isinstance(lat, int):
            at = f" (landed at step {first_landed}, fired at step {first_landed + lat})" \
                if first_landed is not None else ""
            items.append(f"<li><code>{_e(det)}</code>{tag}: <b>{_steps(lat)}</b> after the "
                         f"first landing{at}</li>")
        else:
            items.append(f"<li><code>{_e(det)}</code>{tag}: did not fire at or after the "
                         "landing</li>")
    return f'<p><b>Detection latency</b>:</p><ul class="latency">{"".join(items)}</ul>'


def _crash_html(crash: dict | None) -> str:
    if not crash:
        return ""
    tb = crash.get("traceback")
    if isinstance(tb, str) and tb.count("\n") > 12:
        tb = "...\n" + "\n".join(tb.rstrip("\n").splitlines()[-12:])
    return (f'<div class="crash"><p><b>Crash</b> at step {_e(crash.get("step"))}: cause '
            f'<code>{_e(crash.get("cause"))}</code>, exit code {_e(crash.get("exit_code"))}: '
            f'{_e(crash.get("error", ""))}</p>'
            + (f'<details><summary>traceback</summary><pre class="log">{_e(tb)}</pre></details>'
               if tb else "") + "</div>")


def _ledgers_html(ledgers: dict | None) -> str:
    if not ledgers:
        return ""
    pools = {name: led for name, led in ledgers.items() if isinstance(led, dict)}
    if pools and all(led.get("delta") == 0 for led in pools.values()):
        # Balanced: one line (available + evictable + protected = total, per pool).
        return ('<p class="muted">idle ledgers balanced (the last idle check): ' + "; ".join(
            f"{_e(name)} {_e(led.get('available'))} + {_e(led.get('evictable'))} + "
            f"{_e(led.get('protected'))} = {_e(led.get('total'))}" for name, led in pools.items())
            + "</p>")
    cols = ("available", "evictable", "protected", "total", "delta")
    rows = "".join(
        f"<tr><td>{_e(name)}</td>" + "".join(
            ('<td class="bad">' if c == "delta" and (led or {}).get(c) else "<td>")
            + f"{_e((led or {}).get(c, ''))}</td>" for c in cols) + "</tr>"
        for name, led in ledgers.items() if isinstance(led, dict))
    return ('<details><summary>idle ledgers (the last idle check)</summary><table class="grid">'
            "<tr><th>pool</th>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + rows
            + "</table></details>")


def _repro_html(sc: _Scenario) -> str:
    cmds = []
    repro = (sc.record.get("extra") or {}).get("repro")
    if repro:
        cmds.append(("rerun the scenario file", str(repro)))
    target = sc.dir
    if target is not None:
        cmds.append(("rerun exactly what ran (spec.json, seed, runtime)",
                     f"canary repro {shlex.quote(str(target.absolute()))}"))
    if not cmds:
        return ""
    return ('<div class="repro"><b>Repro</b>' + "".join(
        f'<div class="cmd"><span class="muted">{_e(what)}:</span> <code>{_e(cmd)}</code>'
        f'<button type="button" class="copy">copy</button></div>'
        for what, cmd in cmds) + "</div>")


def _files_html(sc: _Scenario) -> str:
    if sc.dir is None:
        return ('<p class="muted">No scenario directory (the scenario never started, or its '
                "directory is gone).</p>")
    names = [n for n in ("verdict.json", "events.jsonl", "engine.log", "responses.jsonl",
                         "spec.json", "oracle_mismatches.jsonl", "state.json")
             if (sc.dir / n).exists()]
    prefix = sc.rel if (sc.dir.name == sc.rel) else str(sc.dir)
    return ('<p class="files">files: ' + " &middot; ".join(
        f'<a href="{_a(prefix)}/{_a(n)}">{_e(n)}</a>' for n in names) + "</p>")


def _scenario_html(sc: _Scenario, report_dir: Path) -> str:
    r = sc.record
    expect = r.get("expect") or {}
    expected = set(expect.get("fires") or []) | set(expect.get("detected_by") or [])
    silent = set(expect.get("silent") or [])
    landed = [e for e in sc.events if e.get("kind") == "perturbation_landed"] or list(
        r.get("landed") or [])
    first_landed = min((e.get("step") for e in landed if isinstance(e.get("step"), int)),
                       default=None)
    lifecycle = [e for e in sc.events
                 if e.get("kind") in ("perturbation_consumed", "perturbation_died")]
    crash = next((e for e in reversed(sc.events) if e.get("kind") == "crash"), None) or (
        (r.get("extra") or {}).get("crash"))
    firings = _firing_events(sc)
    after = [f for f in firings if first_landed is None
             or (isinstance(f.get("step"), int) and f["step"] >= first_landed)]
    first = after[0] if after else (firings[0] if firings else None)

    parts = [f'<details class="scenario" id="{sc.anchor}" data-verdict="{_a(sc.verdict)}" '
             f'data-passed="{str(sc.passed).lower()}" data-signature="{_a(r.get("signature", ""))}"'
             + (" open" if not sc.passed else "") + ">"]
    parts.append(f'<summary><span class="name">{_e(sc.name)}</span> {_badge(sc.verdict, sc.passed)}'
                 f' <span class="muted">{"passed" if sc.passed else "FAILED"} &middot; engine '
                 f'{_e(r.get("engine_outcome", "?"))} &middot; seed {_e(r.get("seed", "?"))}'
                 "</span></summary>")
    parts.append('<div class="body">')
    words = VERDICT_WORDS.get(sc.verdict, "")
    if expect.get("verdict"):
        words += (" This is a negative test: it passes exactly when the suite reports "
                  f"{expect['verdict']}.")
    parts.append(f'<p class="verdict-words"><b>{_e(sc.verdict)}</b>: {_e(words)}</p>'
                 f'<p class="reason"><b>Reason</b>: {_e(r.get("reason", ""))}</p>')
    interrupted = (r.get("extra") or {}).get("interrupted")
    if interrupted:
        parts.append(f'<p class="warn">Interrupted ({_e(interrupted.get("state"))})'
                     + (f"; it would have been judged {_e(interrupted['judged'])}"
                        if interrupted.get("judged") else "") + ".</p>")
    parts.append(_expectation(expect))
    parts.append(f'<p class="muted">signature <code>{_e(r.get("signature", ""))}</code></p>')
    parts.append(_latency_html(r, first_landed))

    parts.append("<h4>Pool occupancy</h4>")
    tl: Timeline = build_timeline(sc.events)
    parts.append(render_svg(tl, title=f"{sc.name}: pool occupancy per step"))
    if not tl.empty:
        parts.append(legend_html(tl))
    parts.append("<h4>What was damaged</h4>")
    if landed:
        documented: set[str] = set()
        for ld in landed[:MAX_LANDINGS]:
            parts.append(_landing_html(ld, [e for e in lifecycle
                                            if e.get("index") == ld.get("index")
                                            and e.get("landing", ld.get("landing")) == ld.get("landing")],
                                       glossary=str(ld.get("perturbation")) not in documented))
            documented.add(str(ld.get("perturbation")))
        if len(landed) > MAX_LANDINGS:
            parts.append(_more_landings_html(landed[MAX_LANDINGS:]))
    else:
        parts.append('<p class="muted">Nothing landed'
                     + (" (a control scenario)." if expect.get("clean") else ".") + "</p>")

    parts.append("<h4>Firings</h4>")
    if first is not None:
        title = "First firing" + ("" if first in after else " (before any landing)")
        parts.append(f"<p><b>{title}</b>:</p>")
        parts.append(_first_firing_html(first, first_landed, _landed_slots(landed), expected))
        table, left_out = _firing_rows(firings, first_landed, expected, silent)
        n_det = len({str(f.get("detector")) for f in firings})
        parts.append(f'<details class="all-firings"><summary>every firing: {len(firings)} from '
                     f"{n_det} detector(s), by detector and site over consecutive steps</summary>{table}"
                     + (f'<p class="muted">... {left_out} more group(s): see '
                        f'<a href="{_a(sc.rel)}/events.jsonl">events.jsonl</a>.</p>'
                        if left_out else "") + "</details>")
    else:
        parts.append('<p class="muted">No detector fired.</p>')

    parts.append(_crash_html(crash))
    parts.append(_ledgers_html(r.get("ledgers")))
    log = _engine_log_html(sc, first, crash)
    # The event log around the first firing, for failures (a pass links its events.jsonl).
    ev_log = "" if sc.passed else _event_log_html(
        sc, first if first is not None and "seq" in first else crash)
    if log or ev_log:
        parts.append(f"<h4>Logs</h4>{log}{ev_log}")
    parts.append(_repro_html(sc))
    parts.append(_files_html(sc))
    parts.append("</div></details>")
    return "".join(p for p in parts if p)


# ---- run-level sections ----------------------------------------------------------------------


def _summary_html(scenarios: list[_Scenario]) -> str:
    def counts(group: list[_Scenario], passed: bool) -> str:
        tally: dict[str, list[_Scenario]] = {}
        for sc in group:
            tally.setdefault(sc.verdict, []).append(sc)
        items = []
        for v, scs in sorted(tally.items(), key=lambda kv: _verdict_rank(kv[0])):
            negative = sum(bool((sc.record.get("expect") or {}).get("verdict")) for sc in scs)
            note = (f' <span class="muted">({negative} negative test{"s" if negative > 1 else ""}'
                    " expecting it)</span>" if negative and passed else "")
            items.append(f'<span class="count" data-verdict="{_a(v)}" data-passed='
                         f'"{str(passed).lower()}">{_badge(v, passed)} {len(scs)}{note}</span>')
        return " ".join(items)

    harness = [sc for sc in scenarios if sc.record.get("cause") == "harness"]
    fails = [sc for sc in scenarios if not sc.passed and sc not in harness]
    passes = [sc for sc in scenarios if sc.passed]
    n_fail = len(fails)
    out = ['<section id="summary"><h2>Summary</h2>',
           f'<p><b>{len(passes)} of {len(scenarios)} passed</b>'
           + (f", <b class=\"failtext\">{n_fail} failed</b>" if n_fail else "")
           + (f", {len(harness)} not judged (the harness failed)" if harness else "") + ".</p>"]
    if fails:
        out.append(f'<p class="counts">failed: {counts(fails, False)}</p>')
    if harness:
        links = ", ".join(f'<a href="#{sc.anchor}">{_e(sc.name)}</a>' for sc in harness)
        out.append(f'<p class="counts harness">not judged, the harness failed (cause: harness, after '
                   f"retries; no verdict on the engine): {links}</p>")
    if passes:
        out.append(f'<p class="counts">passed: {counts(passes, True)}</p>')
    fails = [sc for sc in scenarios if not sc.passed]
    if fails:
        groups: dict[str, list[_Scenario]] = {}
        for sc in _ordered(fails):
            groups.setdefault(str(sc.record.get("signature", "")), []).append(sc)
        out.append('<h3>Failures by signature</h3><table class="grid failures"><tr><th>'
                   "signature</th><th>scenarios</th></tr>")
        for sig, scs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            links = ", ".join(f'<a href="#{sc.anchor}">{_e(sc.name)}</a>' for sc in scs)
            out.append(f'<tr class="sig"><td><code>{_e(sig)}</code></td><td>{links}</td></tr>')
        out.append("</table>")
    else:
        out.append('<p class="passtext">Every scenario passed.</p>')
    out.append("</section>")
    return "".join(out)


def _index_html(scenarios: list[_Scenario]) -> str:
    rows = []
    for sc in _ordered(scenarios):
        r = sc.record
        lat = ", ".join(f"{d} {_steps(v)}" for d, v in (r.get("latency") or {}).items()
                        if isinstance(v, int) and d in set((r.get("expect") or {}).get("fires")
                                                           or []) | set(
                            (r.get("expect") or {}).get("detected_by") or []))
        reason = str(r.get("reason", ""))
        short = reason if len(reason) <= 140 else reason[:137] + "..."
        rows.append(f'<tr class="row {"pass" if sc.passed else "fail"}" data-scenario="'
                    f'{_a(sc.name)}"><td><a href="#{sc.anchor}">{_e(sc.name)}</a></td>'
                    f"<td>{_badge(sc.verdict, sc.passed)}</td><td>{_e(lat)}</td>"
                    f'<td>{_e(r.get("engine_outcome", ""))}</td><td title="{_a(reason)}">'
                    f"{_e(short)}</td></tr>")
    return ('<section id="scenarios"><h2>Scenarios</h2><table class="grid index"><tr><th>'
            "scenario</th><th>verdict</th><th>detection latency</th><th>engine</th><th>reason"
            "</th></tr>" + "".join(rows) + "</table></section>")


def _kill_matrix_html(report_dir: Path, scenarios: list[_Scenario]) -> str:
    path = report_dir / "kill_matrix.json"
    note = ""
    matrix = None
    try:
        matrix = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    if not isinstance(matrix, dict) or "cells" not in matrix:
        from canaries.report.kill_matrix import kill_matrix

        matrix = kill_matrix([sc.record for sc in scenarios])
        note = ('<p class="warn">kill_matrix.json is missing or unreadable: recomputed from '
                "verdicts.jsonl (detectors nothing fired are not known here).</p>")
    anchors = {sc.name: sc.anchor for sc in scenarios}

    def link(name: str) -> str:
        return (f'<a href="#{_a(anchors[name])}">{_e(name)}</a>' if name in anchors else _e(name))

    never = set(matrix.get("detectors_never_fired") or [])
    dets = [d for d in matrix.get("detectors") or [] if d not in never]
    head = "".join(f'<th class="det"><span>{_e(d)}</span></th>' for d in dets)
    rows = []
    for kind in matrix.get("kinds") or []:
        cells = (matrix.get("cells") or {}).get(kind) or {}
        tds = "".join(
            f'<td class="hit" title="{_a(", ".join(cells[d]))}">{len(cells[d])}</td>'
            if d in cells else '<td class="miss">.</td>' for d in dets)
        rows.append(f"<tr><th>{_e(kind)}</th>{tds}</tr>")
    interrupted = matrix.get("interrupted")
    banner = (f'<p class="warn">INCOMPLETE: {_e(interrupted.get("summary", ""))}</p>'
              if interrupted else "")
    killing_nothing = matrix.get("scenarios_killing_nothing") or []
    return ('<section id="kill-matrix"><h2>Kill matrix</h2>' + banner + note
            + '<p class="muted">perturbation kind x detector: the number of scenarios in which '
              "the kind landed and the detector fired at or after the landing (hover a cell for "
              "their names).</p>"
            + f'<div class="scroll"><table class="grid matrix"><tr><th>kind</th>{head}</tr>'
            + "".join(rows) + "</table></div>"
            + f"<p>Detectors nothing fired: {_e(', '.join(sorted(never))) or 'none'}.</p>"
            + "<p>Scenarios whose perturbation killed nothing: "
            + (", ".join(link(n) for n in killing_nothing) or "none") + ".</p></section>")


def diff_html(diff: DiffResult, anchors: dict[str, str] | None = None) -> str:
    """The diff against a base run, as an HTML section (`id="diff"`); scenario names link to
    their sections when `anchors` (name -> element id) has them."""
    anchors = anchors or {}

    def link(name: str) -> str:
        return (f'<a href="#{_a(anchors[name])}">{_e(name)}</a>' if name in anchors else _e(name))

    status = ('<p class="regressed">REGRESSED: '
              f"{len(diff.new_failures)} scenario(s) passed in the base run and fail here.</p>"
              if diff.regressed else '<p class="passtext">No regression against the base run.'
              "</p>")
    out = [f'<section id="diff" data-regressed="{str(diff.regressed).lower()}"><h2>Against the '
           f"base run</h2><p class=\"muted\">base <code>{_e(diff.base)}</code> &rarr; this run "
           f"<code>{_e(diff.run)}</code></p>", status]
    for which, rec in (("base", diff.base_interrupted), ("this", diff.run_interrupted)):
        if rec:
            out.append(f'<p class="warn">The {which} run was interrupted: '
                       f'{_e(rec.get("summary", ""))}</p>')
    if diff.new_failures:
        out.append('<h3>New failures, by signature</h3><table class="grid diff-new">'
                   "<tr><th>signature</th><th>scenario</th><th>base &rarr; this run</th>"
                   "<th>reason</th></tr>")
        for sig, changes in diff.new_failures_by_signature().items():
            for i, c in enumerate(changes):
                sig_td = (f'<td rowspan="{len(changes)}"><code>{_e(sig)}</code></td>'
                          if i == 0 else "")
                out.append(f'<tr class="diff-new-failure" data-scenario="{_a(c.scenario)}">'
                           f"{sig_td}<td>{link(c.scenario)}</td><td>{_badge(c.base_verdict, True)}"
                           f" &rarr; {_badge(c.run_verdict, False)}</td><td>{_e(c.run_reason)}"
                           "</td></tr>")
        out.append("</table>")

    def simple(title: str, cls: str, changes, describe) -> None:
        if not changes:
            return
        out.append(f'<h3>{_e(title)} ({len(changes)})</h3><ul class="{cls}">')
        out.extend(f'<li data-scenario="{_a(c.scenario)}">{link(c.scenario)}: {describe(c)}</li>'
                   for c in changes)
        out.append("</ul>")

    simple(f"FLAKY: passed in the base run, failed here, then disagreed with itself when run again "
           f"({'fails' if diff.flaky_fails else 'does not fail'} the gate)", "diff-flaky", diff.flaky,
           lambda c: _e(diff.confirmations[c.scenario].describe("base", "this run"))
           if c.scenario in diff.confirmations else _badge(c.run_verdict, False))
    simple("Fixed", "diff-fixed", diff.fixed, lambda c: f"{_badge(c.base_verdict, False)} &rarr; "
           f"{_badge(c.run_verdict, True)}")
    simple("Changed verdict (same pass state)", "diff-changed-verdict", diff.changed_verdict,
           lambda c: f"{_badge(c.base_verdict, c.base_passed)} &rarr; "
                     f"{_badge(c.run_verdict, c.run_passed)} <code>{_e(c.run_signature)}</code>")
    simple("Changed detector", "diff-changed-detector", diff.changed_detector,
           lambda c: " ".join([f'<code class="added">+{_e(d)}</code>' for d in c.detectors_added]
                              + [f'<code class="removed">-{_e(d)}</code>'
                                 for d in c.detectors_removed]))
    simple(f"Changed latency (by more than {_steps(diff.latency_threshold_steps)})",
           "diff-changed-latency", diff.changed_latency,
           lambda c: ", ".join(f"<code>{_e(d)}</code> {b} &rarr; {_steps(a)}"
                               for d, (b, a) in sorted(c.latency.items())))
    for title, cls, items, named in (("Added", "diff-added", diff.added, link),
                                     ("Removed", "diff-removed", diff.removed, _e)):
        if not items:
            continue
        lis = "".join(f'<li data-scenario="{_a(a["scenario"])}">{named(a["scenario"])}: '
                      + ("was " if cls == "diff-removed" else "")
                      + f'{_badge(a["verdict"], a["passed"])}</li>' for a in items)
        if len(items) > 8:  # a long list (e.g. a run of a selection): one click away
            out.append(f'<details class="{cls}"><summary><b>{title} ({len(items)})</b>'
                       f'</summary><ul class="{cls}">{lis}</ul></details>')
        else:
            out.append(f'<h3>{title} ({len(items)})</h3><ul class="{cls}">{lis}</ul>')
    out.append(f'<p class="muted">{diff.unchanged} scenario(s) unchanged.</p></section>')
    return "".join(out)


def _glossary_html(kinds: Iterable[str]) -> str:
    docs = _kind_docs()
    rows = []
    for kind in sorted(set(kinds)):
        lines = [ln.strip() for ln in docs.get(kind, "").splitlines() if ln.strip()]
        if lines:
            caught = f"<br><span class=\"muted\">Caught by: {_e(' '.join(lines[1:]))}</span>" \
                if len(lines) > 1 else ""
            rows.append(f'<dt id="kind-{_a(kind)}"><code>{_e(kind)}</code></dt>'
                        f"<dd>{_e(lines[0])}{caught}</dd>")
    kinds_html = ('<h2>Perturbation kinds</h2><dl class="kv kinds">' + "".join(rows) + "</dl>"
                  if rows else "")
    return ('<section id="glossary"><h2>Verdicts</h2><dl class="kv">' + "".join(
        f"<dt>{_badge(v)}</dt><dd>{_e(w)}</dd>" for v, w in VERDICT_WORDS.items())
        + "</dl>" + kinds_html + "</section>")


CSS = """
:root{--fg:#111827;--mut:#6b7280;--line:#e5e7eb;--pass:#15803d;--fail:#b91c1c}
*{box-sizing:border-box}body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;
color:var(--fg);margin:0 auto;max-width:1280px;padding:12px 20px 60px}
h1{font-size:22px;margin:6px 0}h2{font-size:18px;border-bottom:1px solid var(--line);
padding-bottom:3px;margin-top:26px}h3{font-size:15px}h4{font-size:14px;margin:14px 0 4px}
code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
code{background:#f3f4f6;padding:0 3px;border-radius:3px;word-break:break-all}
.muted{color:var(--mut)}.small{font-size:12px}.warn{background:#fef3c7;border:1px solid #f59e0b;
padding:6px 10px;border-radius:4px}.regressed{background:#fee2e2;border:1px solid var(--fail);
padding:6px 10px;border-radius:4px;font-weight:600}.passtext{color:var(--pass)}
.failtext{color:var(--fail)}
.badge{display:inline-block;padding:0 6px;border-radius:9px;font-size:11px;font-weight:600;
color:#fff;letter-spacing:.02em}.badge.pass{background:var(--pass)}.badge.fail{background:var(--fail)}
.count{margin-right:10px}.tag{font-size:11px;background:#dbeafe;padding:0 4px;border-radius:3px}
table.grid{border-collapse:collapse;margin:6px 0}table.grid td,table.grid th{border:1px solid
var(--line);padding:2px 6px;text-align:left;vertical-align:top}table.grid th{background:#f9fafb}
table.index tr.fail td:first-child{border-left:3px solid var(--fail)}
table.index td:first-child{white-space:nowrap}
table.firings tr.expected td{background:#f0fdf4}table.firings tr.silent td{background:#fef2f2}
table.matrix td{text-align:center;min-width:26px}table.matrix td.hit{background:#dcfce7}
table.matrix td.miss{color:#d1d5db}th.det{white-space:nowrap;vertical-align:bottom;padding:4px 2px}
th.det span{writing-mode:vertical-rl;transform:rotate(180deg);font-weight:500}.scroll{overflow-x:auto}
table.kv td{padding:1px 8px 1px 0}table.ba tr.changed td{background:#fff7ed}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:1px 12px;margin:4px 0}
dl.kv dt{color:var(--mut)}dl.kv dd{margin:0}
dl.first-firing{grid-template-columns:max-content minmax(0,1fr) max-content minmax(0,1fr)}
details.scenario{border:1px solid var(--line);border-radius:6px;margin:8px 0;padding:0 10px}
details.scenario[data-passed=false]{border-left:4px solid var(--fail)}
details.scenario>summary{cursor:pointer;padding:7px 0;font-weight:600}
details.scenario>summary .muted{font-weight:400}.body{padding-bottom:8px}
.landing{border-left:3px solid #d97706;padding:0 10px;margin:6px 0}
.landing p{margin:3px 0}.crash{border-left:3px solid #111827;padding:0 10px}
pre.log{background:#0f172a;color:#e2e8f0;padding:8px;border-radius:4px;overflow-x:auto;
white-space:pre-wrap;max-height:320px}pre.log .hl{background:#7f1d1d;display:inline-block;width:100%}
svg.timeline{max-width:900px;display:block}svg .plot-bg{fill:#fafafa;stroke:#e5e7eb}
svg .grid{stroke:#e5e7eb}svg text{font:10px system-ui,sans-serif;fill:#6b7280}
svg .ytick{text-anchor:end;dominant-baseline:middle}svg .xtick{text-anchor:middle}
svg .xlabel{text-anchor:end}svg .panel-title{font-weight:600;fill:#374151}
svg .latency-band rect{fill:#fee2e2;opacity:.55}
.legend{font-size:12px;margin:2px 0 6px}.lg{margin-right:14px;white-space:nowrap}
.repro .cmd{margin:3px 0}button.copy{margin-left:6px;font-size:11px;display:none}
.js button.copy{display:inline}.toolbar{display:none;gap:8px;margin:8px 0}.js .toolbar{display:flex}
.only-failures details.scenario[data-passed=true],.only-failures table.index tr.pass{display:none}
code.added{background:#dcfce7}code.removed{background:#fee2e2}
"""

JS = """
(function(){
var d=document,root=d.documentElement;root.classList.add('js');
function all(open){d.querySelectorAll('details.scenario').forEach(function(x){x.open=open;});}
function target(){var id=decodeURIComponent(location.hash.slice(1));if(!id)return;
var el=d.getElementById(id);if(el&&el.tagName==='DETAILS'){el.open=true;el.setAttribute('data-opened-by-link','1');}}
d.addEventListener('click',function(ev){var t=ev.target;if(!t.getAttribute)return;
var a=t.getAttribute('data-action');
if(a==='expand')all(true);else if(a==='collapse')all(false);
else if(a==='failures')d.body.classList.toggle('only-failures');
if(t.classList.contains('copy')&&navigator.clipboard){navigator.clipboard.writeText(t.previousElementSibling.textContent);t.textContent='copied';}});
window.addEventListener('hashchange',target);target();
d.querySelectorAll('details.scenario').forEach(function(x){var n=0;
x.querySelectorAll('svg .marker').forEach(function(m){if(m.getBoundingClientRect().height>0)n++;});
x.setAttribute('data-markers-rendered',n);});
d.body.setAttribute('data-ready','1');
})();
"""


def render_html(report_dir: str | Path, *, diff: DiffResult | None = None) -> str:
    """The page for the report in `report_dir` (a directory with verdicts.jsonl)."""
    report_dir = Path(report_dir)
    verdicts = report_dir / "verdicts.jsonl"
    records = read_verdicts(verdicts)
    run_record = read_run(verdicts)
    scenarios = _load_scenarios(report_dir, records)
    run_id = report_dir.absolute().name
    n_fail = sum(not sc.passed for sc in scenarios)
    title = (f"canary run {run_id}: " + (f"{n_fail} of {len(scenarios)} failed" if n_fail
                                          else f"all {len(scenarios)} passed")
             + (" (interrupted)" if run_record else ""))
    body = [f'<header><h1>{_e(title)}</h1><p class="muted">report <code>'
            f"{_e(report_dir.absolute())}</code> &middot; {len(scenarios)} scenario(s)</p>"]
    if run_record:
        body.append(f'<p class="warn" id="interrupted"><b>INCOMPLETE</b>: '
                    f'{_e(run_record.get("summary") or run_record)}</p>')
    if not scenarios:
        body.append('<p class="warn">verdicts.jsonl holds no scenario record.</p>')
    body.append('<nav class="toolbar"><button type="button" data-action="expand">expand all'
                '</button><button type="button" data-action="collapse">collapse all</button>'
                '<button type="button" data-action="failures">failures only</button> '
                '<a href="#summary">summary</a>' + (' <a href="#diff">diff</a>' if diff else "")
                + ' <a href="#scenarios">scenarios</a> <a href="#kill-matrix">kill matrix</a>'
                "</nav></header>")
    body.append(_summary_html(scenarios))
    if diff is not None:
        body.append(diff_html(diff, {sc.name: sc.anchor for sc in scenarios}))
    body.append(_index_html(scenarios))
    body.append('<section id="details"><h2>Scenario details</h2><p class="muted small">'
                "Timelines: x is the engine step; the full and SWA panels plot available slots as "
                "the engine reported them after each step. The dashed line is an estimate: full "
                "pool total minus available minus the running requests' own slots (prompt and "
                "tokens so far, page-rounded, less the cached prefix), i.e. what the radix cache "
                "holds plus anything leaked. Hover a marker for what happened at that step; the "
                "shaded band runs from the first landing to the first detection.</p>")
    body.extend(_scenario_html(sc, report_dir) for sc in _ordered(scenarios))
    body.append("</section>")
    body.append(_kill_matrix_html(report_dir, scenarios))
    body.append(_glossary_html(str(ld.get("perturbation")) for sc in scenarios
                               for ld in (sc.record.get("landed") or [])))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{_e(title)}</title><style>{CSS}{svg_css()}</style></head><body>"
            + "".join(body) + f"<script>{JS}</script></body></html>\n")


def write_html(report_dir: Path, *, diff: DiffResult | None = None) -> Path:
    """Write `report_dir/index.html` atomically (also for an interrupted run); its path."""
    report_dir = Path(report_dir)
    path = report_dir / "index.html"
    write_atomic(path, render_html(report_dir, diff=diff).encode("utf-8"))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m canaries.report.html REPORT_DIR [--base BASE]`: write REPORT_DIR/index.html
    (with a diff section against BASE); 2 when an input is not a report."""
    from canaries.report.diff import ReportError, diff_runs

    parser = argparse.ArgumentParser(prog="canary html", description=__doc__.splitlines()[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--base", type=Path, help="a base run's report: add a diff section")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if not (args.report_dir / "verdicts.jsonl").is_file():
        print(f"canary html: {args.report_dir}: not a run report: it has no verdicts.jsonl",
              file=sys.stderr)
        return 2
    diff = None
    if args.base is not None:
        try:
            diff = diff_runs(args.base, args.report_dir)
        except ReportError as exc:
            print(f"canary html: {exc}", file=sys.stderr)
            return 2
    path = write_html(args.report_dir, diff=diff)
    print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
