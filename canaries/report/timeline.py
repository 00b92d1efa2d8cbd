"""A scenario's pool-occupancy timeline, from its event log, as an inline SVG.

Per `step` event: the full and SWA pools' available slots (exact: the engine reports them), and
an estimate of the full slots held outside the running requests, i.e. by the radix cache or by
nothing at all (a leak): `full total - full available - the running requests' own slots`, where a
request admitted at step a with prompt length p and cached prefix c owns, at the end of step s,
`ceil((p + s - a) / page) * page - floor(c / page) * page` slots (its prompt and every token
decoded so far, rounded up to pages, less the cached prefix the tree already holds). On clean runs
this is exact (0 without a radix cache; the idle ledger's `evictable` with one); a perturbation
can bend it, hence "est." on the plot. Markers: perturbation landings, detector firings (one per
step), crashes, decode stalls and, when the engine records them, `perturbation_consumed` /
`perturbation_died` (a landed piece of damage read by something, or gone unread).

Every marker is an SVG group with class `marker marker-<kind>` and `data-step`, and a `<title>`
for a browser tooltip, so that a test (or a person) can find it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

__all__ = ["MARKER_KINDS", "Marker", "Timeline", "build_timeline", "legend_html", "render_svg",
           "svg_css"]

# marker kind -> (legend label, colour)
MARKER_KINDS: dict[str, tuple[str, str]] = {
    "landing": ("perturbation landed", "#d97706"),
    "firing": ("detector fired", "#dc2626"),
    "crash": ("engine crashed", "#111827"),
    "consumed": ("damage read", "#7c3aed"),
    "died": ("damage died unread", "#6b7280"),
    "stall": ("decode stall", "#0891b2"),
}
SERIES = {  # name -> (label, colour, dash)
    "full_available": ("full available", "#2563eb", ""),
    "other_held": ("full held outside running requests (est.)", "#16a34a", "5,3"),
    "swa_available": ("SWA available", "#9333ea", ""),
}


@dataclass(frozen=True)
class Marker:
    kind: str  # a key of MARKER_KINDS
    step: int
    label: str  # one line, for the tooltip
    first: bool = False  # the first firing at or after the first landing
    end: int | None = None  # a marker spanning steps step..end (a run of firing steps)


@dataclass
class Timeline:
    steps: list[int] = field(default_factory=list)
    full_available: list[int] = field(default_factory=list)
    swa_available: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    other_held: list[int] | None = None  # None: not derivable (no pool size or no admissions)
    full_total: int | None = None
    swa_total: int | None = None
    radix_cache: bool | None = None
    markers: list[Marker] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.steps and not self.markers

    def other_held_label(self) -> str:
        if self.radix_cache is False:
            return "full held outside running requests (est.: leaked; no radix cache)"
        return "full held outside running requests (est.: radix cache + leaked)"


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step(event: dict) -> int:
    return _int(event.get("step")) or 0


def _detector(event: dict) -> str | None:
    if event.get("kind") == "invariant_firing":
        return str(event.get("invariant"))
    if event.get("kind") == "canary_violation":
        return f"kv_canary.{event.get('reason')}"
    return None


def build_timeline(events: list[dict]) -> Timeline:
    """The timeline of one event log (events in log order; unknown kinds are ignored)."""
    tl = Timeline()
    start = next((e for e in events if e.get("kind") == "engine_start"), None)
    config = (start or {}).get("config") or {}
    page = _int(config.get("page_size")) or 1
    tl.full_total = _int(config.get("full_pool_tokens"))
    tl.swa_total = _int(config.get("swa_pool_tokens"))
    if isinstance(config.get("radix_cache"), bool):
        tl.radix_cache = config["radix_cache"]
    for e in events:  # an idle ledger knows the pool totals exactly
        if e.get("kind") == "idle_check":
            ledgers = e.get("ledgers") or {}
            tl.full_total = _int((ledgers.get("full") or {}).get("total")) or tl.full_total
            tl.swa_total = _int((ledgers.get("swa") or {}).get("total")) or tl.swa_total
            break

    live: dict[str, tuple[int, int, int]] = {}  # rid -> (prompt_len, cached_len, admitted step)
    derivable = tl.full_total is not None
    other: list[int] = []
    first_landed: int | None = None
    firings_by_step: dict[int, dict[str, int]] = {}
    early_steps: set[int] = set()
    # Landings and damage reads by step: a kind that lands on every eviction (never_evict_swa)
    # would otherwise draw thousands of markers.
    damage_by_step: dict[str, dict[int, list[str]]] = {"landing": {}, "consumed": {}, "died": {}}
    for e in events:
        kind = e.get("kind")
        step = _step(e)
        if kind == "request_admitted":
            prompt, cached = _int(e.get("prompt_len")), _int(e.get("cached_len")) or 0
            if prompt is None:
                derivable = False
            else:
                live[str(e.get("rid"))] = (prompt, cached, step)
        elif kind == "request_finished":
            live.pop(str(e.get("rid")), None)
        elif kind == "step":
            full, swa = _int(e.get("full_available")), _int(e.get("swa_available"))
            if full is None or swa is None:
                continue
            tl.steps.append(step)
            tl.full_available.append(full)
            tl.swa_available.append(swa)
            tl.running.append(_int(e.get("running")) or 0)
            if derivable:
                own = sum(math.ceil((p + step - a) / page) * page - (c // page) * page
                          for p, c, a in live.values())
                other.append(tl.full_total - full - own)
        elif kind == "perturbation_landed":
            first_landed = step if first_landed is None else min(first_landed, step)
            damage_by_step["landing"].setdefault(step, []).append(
                f"perturbations[{e.get('index')}] {e.get('perturbation')} landed at {e.get('site')}")
        elif kind in ("perturbation_consumed", "perturbation_died"):
            short = "consumed" if kind == "perturbation_consumed" else "died"
            by = f" by {e['by']}" if e.get("by") else ""
            what = "read" if short == "consumed" else "died unread"
            count = f" (x{e['count']})" if e.get("count") else ""
            damage_by_step[short].setdefault(step, []).append(
                f"perturbations[{e.get('index')}]'s damage {what}{by}{count}")
        elif kind == "crash":
            tl.markers.append(Marker("crash", step, (
                f"step {step}: engine crashed ({e.get('cause')}): {e.get('error', '')}")[:300]))
        elif kind == "decode_stall":
            tl.markers.append(Marker("stall", step, f"step {step}: decode stalled (a pool ran dry)"))
        elif kind == "admission_stall":
            tl.markers.append(Marker("stall", step, (
                f"step {step}: nothing runs and the next request cannot be admitted")))
        det = _detector(e)
        if det is not None:
            counts = firings_by_step.setdefault(step, {})
            counts[det] = counts.get(det, 0) + 1
            if first_landed is None or step < first_landed:
                early_steps.add(step)
    _damage_markers(tl, damage_by_step, first_landed)
    first_detection = min((s for s in firings_by_step
                           if first_landed is not None and s >= first_landed), default=None)
    # One marker per firing step; a run of consecutive steps with the same detectors (after the
    # first detection) becomes one marker spanning them, so a log that fires every step stays small.
    run: list[int] = []

    def flush() -> None:
        if not run:
            return
        a, b = run[0], run[-1]
        dets = sorted(firings_by_step[a])
        total = sum(sum(firings_by_step[s].values()) for s in run)
        early = " (before any landing)" if a in early_steps else ""
        if a == b:
            counts = firings_by_step[a]
            text = ", ".join(f"{d} x{n}" if n > 1 else d for d, n in sorted(counts.items()))
            label = f"step {a}: {text}{early}"
        else:
            label = f"steps {a}-{b}: {', '.join(dets)} ({total} firings){early}"
        tl.markers.append(Marker("firing", a, label, first=a == first_detection,
                                 end=b if b != a else None))
        run.clear()

    for step in sorted(firings_by_step):
        if run and (step != run[-1] + 1 or run[0] == first_detection or step == first_detection
                    or set(firings_by_step[step]) != set(firings_by_step[run[0]])
                    or (step in early_steps) != (run[0] in early_steps)):
            flush()
        run.append(step)
    flush()
    tl.other_held = other if derivable and len(other) == len(tl.steps) and tl.steps else None
    tl.markers.sort(key=lambda m: (m.step, list(MARKER_KINDS).index(m.kind)))
    return tl


def _damage_markers(tl: Timeline, by_step: dict[str, dict[int, list[str]]],
                    first_landed: int | None) -> None:
    """One marker per step and kind, and one spanning marker per run of consecutive steps (the
    first landing always a marker of its own, for the latency band)."""
    for kind, steps in by_step.items():
        runs: list[list[int]] = []
        for step in sorted(steps):
            if runs and step == runs[-1][-1] + 1 and first_landed not in (step, runs[-1][0]):
                runs[-1].append(step)
            else:
                runs.append([step])
        for run in runs:
            a, b = run[0], run[-1]
            events = [label for s in run for label in steps[s]]
            if a == b:
                more = f" (and {len(events) - 1} more)" if len(events) > 1 else ""
                label = f"step {a}: {events[0]}{more}"
            else:
                label = f"steps {a}-{b}: {events[0]} ({len(events)} in all)"
            tl.markers.append(Marker(kind, a, label, end=b if b != a else None))


# ---- SVG ----------------------------------------------------------------------------------------

W, PAD_L, PAD_R, PAD_T = 900, 58, 12, 22
PANEL_H, GAP, AXIS_H = 110, 26, 30


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _simplify(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop points that lie on the straight line through their neighbours (a decode step takes
    `running` slots, so long runs of a series are linear)."""
    if len(points) <= 2:
        return points
    out = [points[0]]
    for i in range(1, len(points) - 1):
        (x0, y0), (x1, y1), (x2, y2) = out[-1], points[i], points[i + 1]
        if (x1 - x0) * (y2 - y1) != (y1 - y0) * (x2 - x1):
            out.append(points[i])
    out.append(points[-1])
    return out


def render_svg(tl: Timeline, *, title: str = "") -> str:
    """The timeline as one inline `<svg>` element (no scripts, no external references)."""
    if tl.empty:
        return '<p class="muted">No step events: nothing to plot.</p>'
    all_steps = tl.steps + [m.step for m in tl.markers]
    x_lo, x_hi = min(all_steps + [0]), max(all_steps + [1])
    if x_hi == x_lo:
        x_hi = x_lo + 1
    plot_w = W - PAD_L - PAD_R
    panels = [("full pool", tl.full_total, [("full_available", tl.full_available)]
               + ([("other_held", tl.other_held)] if tl.other_held is not None else [])),
              ("SWA pool", tl.swa_total, [("swa_available", tl.swa_available)])]
    height = PAD_T + len(panels) * PANEL_H + (len(panels) - 1) * GAP + AXIS_H

    def x_of(step: float) -> float:
        return PAD_L + (step - x_lo) / (x_hi - x_lo) * plot_w

    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" '
           f'width="100%" role="img" aria-label="{escape(title or "pool occupancy timeline")}">']
    out.append(f"<title>{escape(title or 'pool occupancy per step')}</title>")
    for p, (name, total, series) in enumerate(panels):
        top = PAD_T + p * (PANEL_H + GAP)
        values = [v for _, vs in series for v in vs]
        y_hi = max([total or 0] + values + [1])
        y_lo = min([0] + values)

        def y_of(v: float, top=top, y_lo=y_lo, y_hi=y_hi) -> float:
            return top + PANEL_H - (v - y_lo) / (y_hi - y_lo) * PANEL_H

        out.append(f'<g class="panel panel-{"full" if p == 0 else "swa"}">')
        out.append(f'<rect x="{PAD_L}" y="{top}" width="{plot_w}" height="{PANEL_H}" '
                   f'class="plot-bg"/>')
        out.append(f'<text x="{PAD_L}" y="{top - 6}" class="panel-title">{escape(name)}'
                   + (f" ({total} slots)" if total is not None else "") + "</text>")
        for v in sorted({y_lo, 0, y_hi} | ({total} if total is not None else set())):
            y = _fmt(y_of(v))
            out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y}" y2="{y}" class="grid"/>'
                       f'<text x="{PAD_L - 4}" y="{y}" class="ytick">{v}</text>')
        for key, vs in series:
            _, colour, dash = SERIES[key]
            pts = _simplify(list(zip(tl.steps, vs, strict=True)))
            d = " ".join(f"{round(x_of(s))},{round(y_of(v))}" for s, v in pts)
            out.append(f'<polyline class="series series-{key}" points="{d}"/>')  # styled by svg_css
        out.append("</g>")
    # x axis
    axis_y = PAD_T + len(panels) * PANEL_H + (len(panels) - 1) * GAP
    n_ticks = min(10, x_hi - x_lo)
    tick_step = max(1, math.ceil((x_hi - x_lo) / max(1, n_ticks)))
    for s in range(x_lo, x_hi + 1, tick_step):
        out.append(f'<text x="{_fmt(x_of(s))}" y="{axis_y + 14}" class="xtick">{s}</text>')
    out.append(f'<text x="{W - PAD_R}" y="{axis_y + 27}" class="xlabel">step</text>')
    # the detection latency band: first landing -> first detection
    landings = [m.step for m in tl.markers if m.kind == "landing"]
    first = next((m for m in tl.markers if m.kind == "firing" and m.first), None)
    if landings and first is not None:
        x0, x1 = x_of(min(landings)), x_of(first.step)
        out.append(f'<g class="latency-band"><rect x="{_fmt(x0)}" y="{PAD_T}" '
                   f'width="{_fmt(max(x1 - x0, 2))}" height="{axis_y - PAD_T}"/>'
                   f"<title>detection latency: {first.step - min(landings)} step(s)</title></g>")
    # markers: a vertical line over both panels and a glyph on top (colours from the CSS classes)
    glyph_row = {"landing": 0, "consumed": 0, "died": 0, "firing": 1, "stall": 1, "crash": 1}
    for m in tl.markers:
        x = round(x_of(m.step))
        gy = PAD_T - 14 + 7 * glyph_row[m.kind]
        classes = f"marker marker-{m.kind}" + (" marker-first" if m.first else "")
        if m.end is None:
            line = f'<path class="mline" d="M{x},{PAD_T}V{axis_y}"/>'
            end = ""
        else:
            x2 = round(x_of(m.end))
            line = (f'<rect class="mband" x="{x}" y="{PAD_T}" width="{max(x2 - x, 1)}" '
                    f'height="{axis_y - PAD_T}"/>')
            end = f' data-step-end="{m.end}"'
        out.append(f'<g class="{classes}" data-step="{m.step}"{end}><title>{escape(m.label)}'
                   f"</title>{line}{_glyph(m.kind, x, gy)}</g>")
    out.append("</svg>")
    return "".join(out)


def _glyph(kind: str, x: int, y: int) -> str:
    if kind == "landing":  # a down-pointing triangle
        return f'<path class="glyph" d="M{x - 5},{y - 3}h10l-5,8z"/>'
    if kind == "crash":  # an X
        return f'<path class="glyph-x" d="M{x - 4},{y - 4}l8,8m0,-8l-8,8"/>'
    if kind in ("consumed", "died"):  # a diamond
        return f'<path class="glyph" d="M{x},{y - 5}l5,5l-5,5l-5,-5z"/>'
    return f'<circle class="glyph" cx="{x}" cy="{y}" r="3.6"/>'


def svg_css() -> str:
    """The CSS the SVG's classes need (markers coloured by kind)."""
    rules = [".marker .mline{stroke-width:1.2;stroke-dasharray:3,2}",
             ".marker-landing .mline,.marker-crash .mline{stroke-dasharray:none}",
             ".marker-first .mline,.marker-crash .mline{stroke-width:2}",
             ".marker .glyph-x{stroke-width:2.4;fill:none}",
             ".marker .mband{opacity:.18}"]
    rules.append(".lg i{display:inline-block;width:10px;height:10px;margin-right:4px;"
                 "vertical-align:middle;border-radius:50%}")
    rules.append(".series{fill:none;stroke-width:1.6}")
    for key, (_, colour, dash) in SERIES.items():
        rules.append(f".series-{key}{{stroke:{colour}" + (f";stroke-dasharray:{dash}" if dash else "") + "}")
        rules.append(f".lg-{key} i{{width:20px;height:0;border-radius:0;"
                     f"border-top:2px {'dashed' if dash else 'solid'} {colour}}}")
    for kind, (_, colour) in MARKER_KINDS.items():
        rules.append(f".lg-{kind} i{{background:{colour}}}")
    for kind, (_, colour) in MARKER_KINDS.items():
        rules.append(f".marker-{kind} .mline,.marker-{kind} .glyph-x{{stroke:{colour}}}"
                     f".marker-{kind} .glyph,.marker-{kind} .mband{{fill:{colour}}}")
    return "".join(rules)


def legend_html(tl: Timeline) -> str:
    """A small HTML legend for the series and the marker kinds present (styled by `svg_css`)."""
    items = []
    for key in ("full_available", "other_held", "swa_available"):
        if key == "other_held" and tl.other_held is None:
            continue
        label = tl.other_held_label() if key == "other_held" else SERIES[key][0]
        items.append(f'<span class="lg lg-{key}"><i></i>{escape(label)}</span>')
    present = {m.kind for m in tl.markers}
    items.extend(f'<span class="lg lg-{kind}"><i></i>{escape(label)}</span>'
                 for kind, (label, _) in MARKER_KINDS.items() if kind in present)
    return '<div class="legend">' + "".join(items) + "</div>"
