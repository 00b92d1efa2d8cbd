"""index.html: unit tests of `canaries.report.html` / `timeline` on synthetic reports, and the page
checked in a real browser (headless Chromium, driven by its command line).

The synthetic report has the shape a `canary run` leaves (verdicts.jsonl, kill_matrix.json, per
scenario events.jsonl / engine.log / verdict.json / spec.json), with three scenarios: one that
crashes on the expected invariant (DETECTED), one that leaks and is caught late (LATE, failing),
and a control (CLEAN). The browser test skips only where no Chromium can be found.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from canaries.report.diff import diff_runs
from canaries.report.html import render_html, scenario_anchor, write_html
from canaries.report.timeline import build_timeline, render_svg

FULL, SWA = 2048, 320
CONFIG = {"device": "cpu", "page_size": 1, "window": 16, "full_pool_tokens": FULL,
          "swa_pool_tokens": SWA, "radix_cache": False, "invariant_check": "strict",
          "kv_canary": "log", "seed": 5}


# ---- a synthetic report ----------------------------------------------------------------------------


class Log:
    """Builds an event log the way the engine writes one (seq, step, kind, ts, fields)."""

    def __init__(self, config: dict | None = None) -> None:
        self.events: list[dict] = []
        self.add(0, "engine_start", config=dict(config or CONFIG))

    def add(self, step: int, kind: str, **fields) -> dict:
        e = {"seq": len(self.events) + 1, "step": step, "kind": kind,
             "ts": 1_700_000_000 + len(self.events) / 10, **fields}
        self.events.append(e)
        return e

    def run(self, requests: dict[str, tuple[int, int, int]], steps: range,
            leaked: dict[str, int] | None = None, hooks: dict | None = None) -> None:
        """requests: rid -> (prompt_len, admitted step, finish step). A step event per step with
        the available slots of a page-1, no-radix engine (plus whatever `leaked` holds)."""
        leaked = dict(leaked or {})
        hooks = hooks or {}
        for step in steps:
            for rid, (prompt, admitted, _) in requests.items():
                if admitted == step:
                    self.add(step, "request_admitted", rid=rid, prompt_len=prompt, cached_len=0,
                             row=1)
            for rid, (_prompt, admitted, finished) in requests.items():
                if finished == step:
                    self.add(step, "request_finished", rid=rid, output_len=step - admitted,
                             admitted_step=admitted, finish_reason="length")
            for hook in hooks.get(step, []):
                hook(self, step)
            live = [(p, a) for p, a, f in requests.values() if a <= step < f]
            used = sum(p + step - a for p, a in live) + sum(leaked.values())
            self.add(step, "step", batch="prefill" if step == 1 else "decode", running=len(live),
                     waiting=0, full_available=FULL - used,
                     swa_available=SWA - min(SWA, 16 * len(live)), firings=0, violations=0)

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(e) + "\n" for e in self.events))


def verdict_record(name, verdict, passed, reason, signature, log: Log, latency, expect,
                   outcome, repro=None, extra=None) -> dict:
    events = log.events
    landed = [{k: v for k, v in e.items() if k != "ts"} for e in events
              if e["kind"] == "perturbation_landed"]
    first = min((e["step"] for e in landed), default=None)
    firings = []
    for e in events:
        if e["kind"] == "invariant_firing":
            det = e["invariant"]
        elif e["kind"] == "canary_violation":
            det = f"kv_canary.{e['reason']}"
        else:
            continue
        firings.append({"detector": det, "step": e["step"],
                        "latency": e["step"] - first if first is not None else None})
    return {"scenario": name, "verdict": verdict, "passed": passed, "reason": reason,
            "signature": signature, "landed": landed, "firings": firings, "latency": latency,
            "engine_outcome": outcome, "ledgers": None, "seed": 5, "engine": dict(CONFIG),
            "expect": {"clean": False, "fires": [], "within_steps": None, "silent": [],
                       "engine": None, "disabled": None, "detected_by": [], "verdict": None,
                       **expect},
            "extra": {"repro": repro or f"canary run configs/scenarios/{name}.yaml --runtime local",
                      **(extra or {})}}


def strip_crash() -> tuple[Log, dict, str]:
    log = Log()

    def damage(log: Log, step: int) -> None:
        log.add(step, "perturbation_landed", index=0, perturbation="strip_swa_mapping",
                site="before_step", landing=1, rid="r0000", positions=[5], slots=[6],
                before=[6], after=[0])
        log.add(step, "perturbation_consumed", index=0, by="kv_canary HEAD SWA")
        log.add(step, "canary_violation", reason="verify_position", group="SWA", phase="HEAD",
                slot=6, pool_row=6, position=5, request="r0000", stored=7, expected=5,
                line="kv_canary violation: launch_tag=HEAD_SWA fail_reason=verify_position")

    log.run({"r0000": (20, 1, 99), "r0001": (30, 1, 99)}, range(1, 4), hooks={3: [damage]})
    log.add(4, "invariant_firing", invariant="swa.peer_mapped", bucket="FATAL_UNCONTAINABLE",
            level="STRICT", site="SWATokenToKVPoolAllocator.free_swa",
            msg="caller wants free_full", new_hits=1, total_hits=1, crashed=True, slots=[6])
    crash = log.add(4, "crash", cause="invariant",
                    error="invariant-check FAILED [swa.peer_mapped]: caller wants free_full",
                    exit_code=3, traceback="Traceback (most recent call last):\n  ...\n"
                    "engine_stub.invariants.InvariantViolation: invariant-check FAILED\n")
    rec = verdict_record(
        "strip-crash", "DETECTED", True, "fired after the perturbation landed: swa.peer_mapped +1",
        "DETECTED|kv_canary.verify_position,swa.peer_mapped|strip_swa_mapping", log,
        {"swa.peer_mapped": 1, "kv_canary.verify_position": 0},
        {"fires": ["swa.peer_mapped"], "engine": "crashes"}, "crashed",
        extra={"crash": {k: v for k, v in crash.items() if k != "ts"}})
    engine_log = ("engine_stub ready on http://127.0.0.1:40000\n"
                  "engine_stub: crashed (invariant): invariant-check FAILED [swa.peer_mapped]: "
                  "caller wants free_full\n")
    return log, rec, engine_log


LEAKED = 10 + 4  # r0000's prompt and the 4 tokens it decoded, never freed


def leak_late(verdict: str = "LATE") -> tuple[Log, dict, str]:
    log = Log()

    def leak(log: Log, step: int) -> None:
        log.add(step, "perturbation_landed", index=0, perturbation="leak_request",
                site="on_request_finish", landing=1, rid="r0000", row=1, kv_len=LEAKED)

    requests = {"r0000": (10, 1, 5), "r0001": (12, 1, 9)}
    log.run(requests, range(1, 5))
    log.run(requests, range(5, 11), leaked={"r0000": LEAKED}, hooks={5: [leak]})
    log.add(10, "idle_check", ledgers={"full": {"available": FULL - LEAKED, "evictable": 0,
                                                "protected": 0, "total": FULL,
                                                "delta": -LEAKED}},
            balanced=False)
    log.add(10, "invariant_firing", invariant="idle.full_ledger", bucket="GUARD",
            level="STRICT", site="idle_tick", msg=f"full ledger off by -{LEAKED}", new_hits=1,
            total_hits=1, crashed=False, slots=[])
    log.add(10, "shutdown", completed=2, received=2)
    passed = verdict == "DETECTED"
    reason = ("fired after the perturbation landed: idle.full_ledger +5" if passed
              else "idle.full_ledger after 5 steps (within_steps 2)")
    rec = verdict_record("leak-late", verdict, passed, reason,
                         f"{verdict}|idle.full_ledger|leak_request", log,
                         {"idle.full_ledger": 5},
                         {"fires": ["idle.full_ledger"], "within_steps": 2}, "survived")
    rec["ledgers"] = log.events[-3]["ledgers"]
    return log, rec, "engine_stub ready on http://127.0.0.1:40001\n"


def clean_ctl() -> tuple[Log, dict, str]:
    log = Log()
    log.run({"r0000": (8, 1, 6)}, range(1, 7))
    log.add(6, "shutdown", completed=1, received=1)
    rec = verdict_record("clean-ctl", "CLEAN", True,
                         "no detector fired and every output matched the no-cache oracle",
                         "CLEAN||control", log, {}, {"clean": True}, "survived")
    return log, rec, "engine_stub ready on http://127.0.0.1:40002\n"


def make_report(root: Path, scenarios=None, *, kill_matrix: bool = True,
                run_record: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    scenarios = scenarios if scenarios is not None else [strip_crash(), leak_late(), clean_ctl()]
    lines = []
    for log, rec, engine_log in scenarios:
        d = root / rec["scenario"]
        d.mkdir()
        log.write(d / "events.jsonl")
        (d / "engine.log").write_text(engine_log)
        (d / "verdict.json").write_text(json.dumps(rec, indent=2))
        (d / "spec.json").write_text(json.dumps({"name": rec["scenario"], "seed": 5}))
        (d / "responses.jsonl").write_text("")
        lines.append(json.dumps(rec))
    if run_record:
        lines.append(json.dumps(run_record))
    (root / "verdicts.jsonl").write_text("".join(line + "\n" for line in lines))
    if kill_matrix:
        from canaries.report.kill_matrix import kill_matrix as km

        (root / "kill_matrix.json").write_text(json.dumps(km([s[1] for s in scenarios])))
    return root


class Elements(HTMLParser):
    """Every start tag with its attributes, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.items: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.items.append((tag, {k: (v if v is not None else "") for k, v in attrs}))

    def find(self, tag: str | None = None, cls: str | None = None, **attrs) -> list[dict]:
        out = []
        for t, a in self.items:
            if tag and t != tag:
                continue
            if cls and cls not in a.get("class", "").split():
                continue
            if any(a.get(k.replace("_", "-")) != v for k, v in attrs.items()):
                continue
            out.append(a)
        return out


def section(page: str, name: str) -> str:
    """The HTML of one scenario's section."""
    start = page.index(f'<details class="scenario" id="{scenario_anchor(name)}"')
    end = page.find('<details class="scenario"', start + 1)
    return page[start:end if end != -1 else len(page)]


# ---- the timeline ------------------------------------------------------------------------------


def test_timeline_series_and_the_held_estimate():
    log, _, _ = leak_late()
    tl = build_timeline(log.events)
    assert tl.steps == list(range(1, 11))
    assert tl.full_total == FULL and tl.swa_total == SWA and tl.radix_cache is False
    # exact on the steps before the leak, the leaked slots after it
    assert tl.other_held == [0] * 4 + [LEAKED] * 6
    assert tl.full_available[0] == FULL - 22
    kinds = [(m.kind, m.step) for m in tl.markers]
    assert kinds == [("landing", 5), ("firing", 10)]
    assert tl.markers[1].first and "idle.full_ledger" in tl.markers[1].label


def test_timeline_markers_in_the_svg():
    log, _, _ = strip_crash()
    svg = render_svg(build_timeline(log.events), title="t")
    els = Elements(svg)
    assert [a["data-step"] for a in els.find("g", "marker-landing")] == ["3"]
    assert [a["data-step"] for a in els.find("g", "marker-consumed")] == ["3"]
    assert [a["data-step"] for a in els.find("g", "marker-firing")] == ["3", "4"]
    assert [a["data-step"] for a in els.find("g", "marker-crash")] == ["4"]
    assert len(els.find("g", "marker-first")) == 1
    assert len(els.find("polyline", "series-full_available")) == 1
    assert len(els.find("polyline", "series-swa_available")) == 1
    assert "<script" not in svg and "href" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_timeline_collapses_a_run_of_firing_steps():
    log = Log()

    def fire(log: Log, step: int) -> None:
        if step == 2:
            log.add(step, "perturbation_landed", index=0, perturbation="flip_kv_byte",
                    site="before_step", landing=1)
        log.add(step, "canary_violation", reason="verify_chain_hash", group="FULL",
                phase="HEAD", slot=3, position=1, request="r0000")

    log.run({"r0000": (8, 1, 99)}, range(1, 60), hooks={s: [fire] for s in range(2, 60)})
    tl = build_timeline(log.events)
    firing = [m for m in tl.markers if m.kind == "firing"]
    assert [(m.step, m.end, m.first) for m in firing] == [(2, None, True), (3, 59, False)]
    assert "steps 3-59" in firing[1].label and "57 firings" in firing[1].label
    assert 'data-step-end="59"' in render_svg(tl)


def test_timeline_without_steps_or_pool_sizes():
    assert "nothing to plot" in render_svg(build_timeline([]))
    tl = build_timeline([{"seq": 1, "step": 1, "kind": "step", "full_available": 5,
                          "swa_available": 3, "running": 0}])
    assert tl.other_held is None  # no engine_start: pool size unknown, no estimate
    assert "series-other_held" not in render_svg(tl)


def test_timeline_renders_future_lifecycle_events():
    log = Log()
    log.add(2, "perturbation_landed", index=0, perturbation="flip_kv_byte", site="x", landing=1)
    log.add(5, "perturbation_died", index=0)
    tl = build_timeline(log.events)
    assert [(m.kind, m.step) for m in tl.markers] == [("landing", 2), ("died", 5)]
    assert 'class="marker marker-died"' in render_svg(tl)


# ---- the page ----------------------------------------------------------------------------------


@pytest.fixture
def report(tmp_path) -> Path:
    return make_report(tmp_path / "run-1")


def test_write_html_is_atomic_and_returns_the_path(report):
    path = write_html(report)
    assert path == report / "index.html" and path.stat().st_size > 0
    assert [p.name for p in report.iterdir() if p.name.startswith(".")] == []  # no temp left
    assert path.read_text().startswith("<!DOCTYPE html>")


def test_scenarios_findable_failures_first(report):
    page = render_html(report)
    els = Elements(page)
    sections = els.find("details", "scenario")
    assert [s["id"] for s in sections] == ["s-leak-late", "s-strip-crash", "s-clean-ctl"]
    assert [(s["data-verdict"], s["data-passed"]) for s in sections] == [
        ("LATE", "false"), ("DETECTED", "true"), ("CLEAN", "true")]
    assert "open" in sections[0] and "open" not in sections[1]  # failures open
    rows = els.find("tr", "row")
    assert [r["data-scenario"] for r in rows] == ["leak-late", "strip-crash", "clean-ctl"]
    assert len(els.find("a", href="#s-leak-late")) >= 2  # index and failures-by-signature
    assert "canary run run-1: 1 of 3 failed" in page


def test_summary_counts_and_signatures(report):
    page = render_html(report)
    summary = page[page.index('<section id="summary"'):page.index('<section id="scenarios"')]
    assert 'data-verdict="LATE" data-passed="false"' in summary
    assert 'data-verdict="DETECTED" data-passed="true"' in summary
    assert "<code>LATE|idle.full_ledger|leak_request</code>" in summary
    assert "2 of 3 passed" in summary and "1 failed" in summary


def test_scenario_details(report):
    page = render_html(report)
    s = section(page, "strip-crash")
    # verdict and reason in words
    assert "every expected detector fired, in time" in s
    assert "fired after the perturbation landed: swa.peer_mapped +1" in s
    # the landing digest: what was damaged
    assert "<b>strip_swa_mapping</b> (perturbations[0]) landed at step <b>3</b>" in s
    assert "request <code>r0000</code>" in s and "positions <code>[5]</code>" in s
    assert "before <code>[6]</code> &rarr; after <code>[0]</code>" in s
    assert "step 3: read by <code>kv_canary HEAD SWA</code>" in s  # perturbation_consumed
    # the first firing: step, site, request, slots
    first = s[s.index('<dl class="kv first-firing">'):]
    first = first[:first.index("</dl>")]
    assert "<code>kv_canary.verify_position</code>" in first
    assert "3 (0 steps after the first landing at step 3)" in first
    assert "<code>kv_canary HEAD SWA</code>" in first and "<code>r0000</code>" in first
    assert "<code>6</code> (touched by the perturbation: 6)" in first
    # every later firing
    assert "every firing: 2 from 2 detector(s)" in s
    assert "<td><code>swa.peer_mapped</code></td><td>SWATokenToKVPoolAllocator.free_swa</td>" in s
    # latency in steps
    assert "<code>swa.peer_mapped</code> <span class=\"tag\">expected</span>: <b>1 step</b>" in s
    # the crash, the engine log around the firing, the events around it
    assert "<b>Crash</b> at step 4" in s
    assert ('<span class="hl">engine_stub: crashed (invariant): invariant-check FAILED '
            "[swa.peer_mapped]") in s
    # the repro commands
    assert "<code>canary run configs/scenarios/strip-crash.yaml --runtime local</code>" in s
    assert f"<code>canary repro {report.absolute() / 'strip-crash'}</code>" in s
    assert '<a href="strip-crash/events.jsonl">events.jsonl</a>' in s
    # the timeline with its markers
    els = Elements(s)
    assert len(els.find("svg", "timeline")) == 1
    assert els.find("g", "marker-crash")[0]["data-step"] == "4"


def test_failing_scenario_shows_the_event_log_and_the_leak(report):
    s = section(render_html(report), "leak-late")
    assert "events.jsonl, events" in s and '<span class="hl">{"seq":' in s
    assert "full ledger off by -14" in s
    assert "<b>5 steps</b> after the first landing (landed at step 5, fired at step 10)" in s
    assert "within 2 steps of the landing" in s
    assert '<td class="bad">-14</td>' in s  # the idle ledger's delta
    assert "est.: leaked; no radix cache" in s


def test_kill_matrix_and_glossary(report):
    page = render_html(report)
    km = page[page.index('<section id="kill-matrix"'):page.index('<section id="glossary"')]
    assert "<th>leak_request</th>" in km and 'title="leak-late"' in km
    assert "Scenarios whose perturbation killed nothing: none." in km
    assert 'id="glossary"' in page


def test_self_contained(report):
    page = render_html(report)
    assert "<link" not in page and "@import" not in page and "<iframe" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"url\(", page)
    assert page.count("<script>") == 1 and "<script src" not in page


def test_escaping(tmp_path):
    log, rec, _ = clean_ctl()
    rec["scenario"] = "evil"
    rec["reason"] = "<script>alert(1)</script> & \"quotes\""
    rec["signature"] = 'CLEAN|"><img src=x>|control'
    page = render_html(make_report(tmp_path / "r", [(log, rec, "<b>log</b>\n")]))
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '"><img' not in page and "&lt;b&gt;log&lt;/b&gt;" in page


def test_interrupted_run(tmp_path):
    log, rec, elog = strip_crash()
    not_run = verdict_record("never-started", "NOT_RUN", False,
                             "not run: the run was interrupted before it started",
                             "NOT_RUN||control", Log(), {}, {}, "not_started")
    not_run["extra"] = {"interrupted": {"state": "not_run"}}
    root = tmp_path / "cut"
    make_report(root, [(log, rec, elog)], kill_matrix=False, run_record={
        "run": "interrupted", "cause": "SIGINT",
        "summary": "the run was interrupted (SIGINT): 1 of 2 scenario(s) judged; not run: "
                   "never-started"})
    with open(root / "verdicts.jsonl", "r+") as f:  # NOT_RUN before the run record, as run_many
        lines = f.readlines()
        f.seek(0)
        f.writelines([lines[0], json.dumps(not_run) + "\n", lines[1]])
        f.write('{"scenario": "torn', )  # a torn last write
    page = write_html(root).read_text()
    assert 'id="interrupted"' in page and "INCOMPLETE" in page and "(interrupted)" in page
    s = section(page, "never-started")
    assert 'data-verdict="NOT_RUN"' in s and "No scenario directory" in s
    assert "Interrupted (not_run)" in s
    assert "kill_matrix.json is missing or unreadable: recomputed" in page


def test_torn_event_log_and_missing_files(tmp_path):
    log, rec, elog = strip_crash()
    root = make_report(tmp_path / "r", [(log, rec, elog)])
    ev = root / "strip-crash" / "events.jsonl"
    ev.write_text(ev.read_text() + '{"seq": 99, "step": 5, "kind": "st')
    (root / "strip-crash" / "engine.log").unlink()
    page = render_html(root)
    assert "No engine.log." in page and 'class="marker marker-crash"' in page


def test_no_records(tmp_path):
    (tmp_path / "verdicts.jsonl").write_text("")
    assert "verdicts.jsonl holds no scenario record" in render_html(tmp_path)


def test_size_stays_bounded_for_a_noisy_scenario(tmp_path):
    """A scenario that fires every step, for hundreds of steps, with thousands of violations."""
    log = Log()

    def fire(log: Log, step: int) -> None:
        if step == 2:
            log.add(step, "perturbation_landed", index=0, perturbation="flip_kv_byte",
                    site="before_step", landing=1, slot=3, before=1, after=254)
        for i in range(8):
            log.add(step, "canary_violation", reason="verify_chain_hash" if i % 2 else
                    "verify_position", group="FULL" if i < 4 else "SWA", phase="HEAD",
                    slot=100 + step + i, position=step, request=f"r{i:04d}")

    log.run({"r0000": (8, 1, 999)}, range(1, 400), hooks={s: [fire] for s in range(2, 400)})
    rec = verdict_record("noisy", "DETECTED", True, "r", "DETECTED|x|flip_kv_byte", log,
                         {"kv_canary.verify_chain_hash": 0}, {}, "survived")
    page = render_html(make_report(tmp_path / "r", [(log, rec, "x\n" * 100_000)]))
    assert len(page.encode()) < 60_000, len(page.encode())
    assert "more group(s)" not in page or "events.jsonl" in page


def test_diff_section(tmp_path):
    base = make_report(tmp_path / "base", [strip_crash(), leak_late("DETECTED"), clean_ctl()])
    run = make_report(tmp_path / "run")
    page = render_html(run, diff=diff_runs(base, run))
    els = Elements(page)
    (sec,) = els.find("section", id="diff")
    assert sec["data-regressed"] == "true"
    rows = els.find("tr", "diff-new-failure")
    assert [r["data-scenario"] for r in rows] == ["leak-late"]
    diff = page[page.index('<section id="diff"'):page.index('<section id="scenarios"')]
    assert "REGRESSED: 1 scenario(s) passed in the base run and fail here." in diff
    assert '<a href="#s-leak-late">leak-late</a>' in diff
    assert "<code>LATE|idle.full_ledger|leak_request</code>" in diff


def test_module_entry_point(tmp_path):
    base = make_report(tmp_path / "base", [clean_ctl()])
    run = make_report(tmp_path / "run", [clean_ctl()])
    proc = subprocess.run([sys.executable, "-m", "canaries.report.html", str(run), "--base",
                           str(base)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'id="diff"' in (run / "index.html").read_text()
    proc = subprocess.run([sys.executable, "-m", "canaries.report.html", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no verdicts.jsonl" in proc.stderr


# ---- in a real browser ----------------------------------------------------------------------------


def find_chromium() -> str | None:
    """$CHROMIUM, else the first Chromium-like browser on PATH."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable", "chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = find_chromium()
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-extensions",
                  "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND"]


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    proc = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def png_info(path: Path) -> tuple[int, int, float]:
    """Width, height, and the share of non-zero bytes in the (filtered) pixel data: a blank
    white page filters to almost nothing but zeros."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    return width, height, sum(1 for b in raw[::97] if b) / math.ceil(len(raw) / 97)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found ($CHROMIUM, chromium, "
                    "chromium-browser or google-chrome on PATH); install Debian's: "
                    "apt-get install -y chromium")
def test_report_in_headless_chromium(tmp_path):
    base = make_report(tmp_path / "base", [strip_crash(), leak_late("DETECTED"), clean_ctl()])
    run = make_report(tmp_path / "run")
    index = write_html(run, diff=diff_runs(base, run))
    url = index.absolute().as_uri()

    # The DOM after the page's scripts ran, opened at a scenario's anchor.
    dom = chromium(tmp_path, "--dump-dom", url + "#s-strip-crash").stdout
    els = Elements(dom)
    assert els.find("body", data_ready="1"), "the page's script did not run"
    assert "js" in els.find("html")[0].get("class", "").split()
    rows = els.find("tr", "row")
    assert [r["data-scenario"] for r in rows] == ["leak-late", "strip-crash", "clean-ctl"]
    sections = {a["id"]: a for a in els.find("details", "scenario")}
    assert set(sections) == {"s-leak-late", "s-strip-crash", "s-clean-ctl"}
    # the link opened its (passing, otherwise closed) scenario; a failure is open anyway
    assert "open" in sections["s-strip-crash"] and "data-opened-by-link" in sections["s-strip-crash"]
    assert "open" in sections["s-leak-late"] and "open" not in sections["s-clean-ctl"]
    # timelines and markers exist, and are laid out (non-zero height) where the section is open
    assert len(els.find("svg", "timeline")) == 3
    for kind in ("landing", "firing", "crash", "consumed"):
        assert els.find("g", f"marker-{kind}"), kind
    strip = Elements(section(dom.replace(' data-opened-by-link="1"', ""), "strip-crash"))
    n_markers = len(strip.find("g", "marker"))
    assert n_markers == 5  # landing, consumed, 2 firing steps, crash
    assert sections["s-strip-crash"]["data-markers-rendered"] == str(n_markers)
    assert sections["s-leak-late"]["data-markers-rendered"] == "2"
    assert sections["s-clean-ctl"]["data-markers-rendered"] == "0"  # closed: not rendered
    # the diff section
    (diff,) = els.find("section", id="diff")
    assert diff["data-regressed"] == "true"
    assert [r["data-scenario"] for r in els.find("tr", "diff-new-failure")] == ["leak-late"]
    assert "REGRESSED: 1 scenario(s) passed in the base run and fail here." in dom

    # The picture.
    shot = tmp_path / "index.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", url)
    width, height, ink = png_info(shot)
    assert (width, height) == (1400, 2000)
    assert ink > 0.005, f"the screenshot looks blank ({ink:.4f} of the pixel bytes set)"
    print(f"\nscreenshot: {shot}")


# ---- on a real run ----------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_page_of_a_real_run(tmp_path):
    """Two library scenarios run for real (a crash on the expected invariant; a leak the idle
    ledgers catch), then the page: every scenario found, the landing, the timeline markers."""
    names = ("corrupt-r2t-strict", "leak-request")
    report = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "canaries.cli", "run",
         *(str(REPO / "configs" / "scenarios" / f"{n}.yaml") for n in names),
         "--jobs", "2", "--report-dir", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert (report / "verdicts.jsonl").is_file(), proc.stdout + proc.stderr
    page = write_html(report).read_text()
    els = Elements(page)
    assert {a["id"] for a in els.find("details", "scenario")} == {f"s-{n}" for n in names}
    strip = Elements(section(page, "corrupt-r2t-strict"))
    assert strip.find("g", "marker-landing") and strip.find("g", "marker-firing")
    assert strip.find("g", "marker-crash")
    leak = section(page, "leak-request")
    assert "<b>leak_request</b> (perturbations[0]) landed at step" in leak
    assert "radix cache + leaked" in leak
    assert not diff_runs(report, report).changed


def test_timeline_of_a_kind_landing_every_step_stays_a_few_markers():
    # never_evict_swa lands on every eviction and its damage is read at every next one: one
    # marker per run of steps, not one per event (that made a library report 5 MB).
    events = [{"kind": "step", "step": s, "full_available": 100, "swa_available": 50, "running": 1}
              for s in range(1, 401)]
    for s in range(3, 400):
        events.append({"kind": "perturbation_landed", "step": s, "index": 0,
                       "perturbation": "never_evict_swa", "site": "on_window_eviction"})
        events += [{"kind": "perturbation_consumed", "step": s + 1, "index": 0, "by": "window eviction"}] * 5
    tl = build_timeline(events)
    by_kind = {k: [m for m in tl.markers if m.kind == k] for k in ("landing", "consumed")}
    assert len(by_kind["landing"]) == 2 and by_kind["landing"][0].step == 3  # the first alone
    assert (by_kind["landing"][1].step, by_kind["landing"][1].end) == (4, 399)
    assert len(by_kind["consumed"]) == 1 and "1985 in all" in by_kind["consumed"][0].label
    assert len(render_svg(tl)) < 20_000


def test_landing_lists_reads_of_one_step_by_one_reader_once():
    from canaries.report.html import _landing_html

    landing = {"perturbation": "never_evict_swa", "index": 0, "step": 3, "site": "on_window_eviction"}
    reads = [{"kind": "perturbation_consumed", "step": 83, "index": 0, "by": "a dry decode allocation"}] * 17
    reads.append({"kind": "perturbation_died", "step": 90, "index": 0, "by": "the request's finish"})
    html = _landing_html(landing, reads)
    assert html.count("<li") == 2
    assert "step 83: read by <code>a dry decode allocation</code> (x17)" in html
    assert "step 90: died unread by <code>the request's finish</code></li>" in html
