"""Generated scenarios: a seeded walk over the whole scenario space, one scenario per index.

`generate(seed, index)` is a pure function: the same (seed, index) gives the same scenario
document on every machine, so a campaign is a function of its seed. Each document is a normal
scenario file (what `canary validate` and `canary run` take), built to be valid by the rules the
loader and the engine apply (the SWA pool holds its headroom plus a page, every request fits the
context and the pools as admission reserves them): `scenario_for` loads it and, in the rare case
the loader still finds a problem, draws again from the same index (`Draw.attempt`), so what comes
out has passed the loader.

The space: page sizes 1 to 32 (non-powers of two too), windows 1 to 64 (1, a page's neighbours,
values not a multiple of the page), SWA pools from the smallest admission accepts to roomy, full
pools from the workload's footprint to roomy, radix on and off, every invariant level, canary
modes and sweep intervals, chunked prefill auto/off/a size; workloads of 1 to 8 requests with
shared prefixes and follow-ups (an earlier prompt cut, extended, or followed by its answer) and
client hang-ups mid-decode; and
0 to 3 perturbations of every kind with every trigger and target form.
"""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine_stub.admission import full_reserve
from engine_stub.perturb.kinds import KINDS
from engine_stub.perturb.spec import TARGET, TRIGGER

__all__ = ["Draw", "generate", "library_perturbations", "scenario_for", "write_scenario"]

MAX_CONTEXT = 512
EVENTS = TRIGGER["event"].type.choices
VALUES = TARGET["value"].type.choices
POSITIONS_WORDS = ("last", "in_window", "retained_unread", "out_of_window")
# What a control or a perturbed scenario is, for the oracle: at least this share are controls.
CONTROL_SHARE = 0.25
# The share of perturbations whose trigger and target come from the library's own scenarios.
SEED_SHARE = 0.6


@dataclass(frozen=True)
class Draw:
    """Where a generated scenario comes from: campaign seed, index, and which attempt."""

    seed: int
    index: int
    attempt: int = 0

    @property
    def name(self) -> str:
        return f"fuzz-s{self.seed}-{self.index:05d}"

    def rng(self) -> random.Random:
        return random.Random(f"canary-fuzz:{self.seed}:{self.index}:{self.attempt}")


def _pick(rng: random.Random, weighted: dict[Any, float]) -> Any:
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def _page_and_window(rng: random.Random) -> tuple[int, int]:
    page = _pick(rng, {1: 4, 2: 1, 3: 1, 4: 2, 5: 1, 8: 1, 16: 2, 32: 1, rng.randint(1, 32): 1})
    window = _pick(rng, {1: 1, 16: 3, 5: 1, 33: 1, 64: 1, max(1, page - 1): 1, page: 1,
                         min(64, page + 1): 1, rng.randint(1, 64): 2})
    return page, min(64, max(1, window))


def _workload(rng: random.Random, page: int, window: int) -> dict:
    requests = rng.randint(1, 8)
    longest = _pick(rng, {rng.randint(1, 24): 2, rng.randint(window, 4 * window + 8): 3,
                          rng.randint(40, 200): 2, rng.randint(200, 400): 1})
    longest = max(1, min(longest, 400))
    shortest = rng.randint(1, longest) if rng.random() < 0.6 else longest
    max_new = _pick(rng, {rng.randint(1, 8): 2, rng.randint(8, 48): 3, window + 1: 1})
    max_new = max(1, min(max_new, MAX_CONTEXT - longest - 64))
    workload: dict[str, Any] = {
        "requests": requests,
        "concurrency": rng.randint(1, 4),
        "prompt_tokens": longest if shortest == longest else [shortest, longest],
        "max_new_tokens": max_new,
    }
    if rng.random() < 0.35 and shortest > 1:
        workload["shared_prefix_tokens"] = rng.randint(1, shortest - 1)
    if rng.random() < 0.3:
        workload["unique_prompts"] = False
    extras: list[dict] = []
    hung_up: set[int] = set()  # requests whose client hangs up: no answer to follow
    for _ in range(_pick(rng, {0: 5, 1: 3, 2: 2})):
        extra: dict[str, Any] = {"prompt_of": rng.randrange(requests + len(extras))}
        if rng.random() < 0.5 and extra["prompt_of"] not in hung_up:
            extra["with_answer"] = True
        if rng.random() < 0.4 and extra["prompt_of"] < requests:  # an extra's own length varies
            extra["keep_tokens"] = rng.randint(1, shortest)
        if rng.random() < 0.6:
            extra["append_tokens"] = rng.randint(1, 24)
        if max_new > 1 and rng.random() < 0.3:
            extra["hang_up_after_tokens"] = rng.randint(1, max_new - 1)
            hung_up.add(requests + len(extras))
        extras.append(extra)
    while extras:
        workload["extra_requests"] = extras
        if _longest_prompt(workload) + max_new <= MAX_CONTEXT:
            break
        extras.pop()  # follow-ups of follow-ups outgrew the context
    else:
        workload.pop("extra_requests", None)
    return workload


def _longest_prompt(workload: dict) -> int:
    """The longest prompt the plan can send: a follow-up is its source's prompt (cut to
    keep_tokens), plus the source's answer with `with_answer`, plus its appended tokens."""
    prompt = workload["prompt_tokens"]
    longest = max(prompt) if isinstance(prompt, list) else prompt
    lengths = [max(longest, workload.get("shared_prefix_tokens", 0) + 1)] * workload["requests"]
    for extra in workload.get("extra_requests", ()):
        length = lengths[extra["prompt_of"]] + workload["max_new_tokens"] * bool(extra.get("with_answer"))
        if "keep_tokens" in extra:
            length = min(length, extra["keep_tokens"])
        lengths.append(length + extra.get("append_tokens", 0))
    return max(lengths)


def _engine(rng: random.Random, page: int, window: int, workload: dict) -> dict:
    headroom = max(window, page) + window + 2 * page
    smallest_swa = headroom + page
    longest = _longest_prompt(workload)
    extend = -(-longest // page) * page
    chunked = _pick(rng, {"auto": 6, "off": 2, "size": 2})
    swa = _pick(rng, {smallest_swa: 2, smallest_swa + page: 2, 2 * smallest_swa: 2,
                      smallest_swa + rng.randint(0, 256): 2, 1024: 1})
    full_need = extend + full_reserve(page, workload["max_new_tokens"])
    running = rng.randint(1, 6)
    full = _pick(rng, {full_need: 2, full_need + page: 1, 2 * full_need: 2,
                       running * full_need: 1, 2048: 2})
    engine: dict[str, Any] = {
        "page_size": page,
        "window": window,
        "swa_pool_tokens": swa,
        "full_pool_tokens": full,
        "max_running_requests": running,
        "radix_cache": rng.random() < 0.6,
        "invariant_check": _pick(rng, {"strict": 5, "warn": 3, "off": 1}),
        "kv_canary": _pick(rng, {"log": 4, "raise": 2, "off": 2}),
        "kv_canary_sweep_interval": _pick(rng, {0: 2, 1: 1, 4: 1, 8: 2}),
    }
    if rng.random() < 0.2:
        engine["strict_mem_check_during_idle"] = False
    if chunked == "off":
        engine["chunked_prefill_size"] = "off"
    elif chunked == "size":
        room = engine["swa_pool_tokens"] - headroom
        engine["chunked_prefill_size"] = max(page, rng.randint(page, max(page, room)) // page * page)
    return _fit_pools(engine, workload)


def _fit_pools(engine: dict, workload: dict) -> dict:
    """Raise the pools to what the engine accepts and the workload's every request needs: the
    SWA pool holds one headroom plus a page (and, unchunked, the longest prompt besides), the full
    pool the SWA pool's slots and the longest request as admission reserves it."""
    page, window = engine["page_size"], engine["window"]
    headroom = max(window, page) + window + 2 * page
    longest = _longest_prompt(workload)
    extend = -(-longest // page) * page
    swa = max(engine["swa_pool_tokens"], headroom + page)
    if engine.get("chunked_prefill_size") == "off":
        swa = max(swa, extend + headroom)  # whole prompts only: the SWA pool must take the longest
    swa = -(-swa // page) * page
    full_need = extend + full_reserve(page, workload["max_new_tokens"])
    full = max(engine["full_pool_tokens"], full_need, swa, longest + workload["max_new_tokens"])
    full = -(-full // page) * page
    engine.update(swa_pool_tokens=swa, full_pool_tokens=full, max_context_len=min(MAX_CONTEXT, full))
    return engine


# What a kind needs of the engine and the workload to have anything to act on.
NEEDS_TWO_RUNNING = frozenset({"swap_next_token", "alias_swa_mapping"})  # two requests in a batch
NEEDS_CHUNKS = frozenset({"unfinished_insert_live_head"})  # a prompt cached between its chunks


def _fit_needs(rng: random.Random, kinds: list[str], events: set[str], engine: dict,
               workload: dict) -> None:
    """Make the engine and workload give each drawn kind (and trigger event) something to act
    on: two requests running at once, a prompt chunked with a radix cache, a cache hit."""
    if NEEDS_TWO_RUNNING & set(kinds):
        workload["requests"] = max(workload["requests"], 2)
        workload["concurrency"] = max(workload["concurrency"], 2)
        engine["max_running_requests"] = max(engine["max_running_requests"], 2)
    if NEEDS_CHUNKS & set(kinds) or "chunk_boundary" in events:
        page = engine["page_size"]
        engine["radix_cache"] = engine["radix_cache"] or bool(NEEDS_CHUNKS & set(kinds))
        engine["chunked_prefill_size"] = page * rng.randint(1, 3)
        prompt = workload["prompt_tokens"]
        longest = max(prompt) if isinstance(prompt, list) else prompt
        if longest <= engine["chunked_prefill_size"]:
            shortest = prompt[0] if isinstance(prompt, list) else prompt  # what extras were cut to
            workload["prompt_tokens"] = [shortest, engine["chunked_prefill_size"] + rng.randint(1, 3 * page)]
    if "cache_hit" in events:
        engine["radix_cache"] = True
        if not any("prompt_of" in x for x in workload.get("extra_requests", ())):
            workload.setdefault("extra_requests", []).append(
                {"prompt_of": 0, "append_tokens": rng.randint(1, 8)})


def _trigger(rng: random.Random, kind: str, steps: int, event: str | None) -> dict:
    # An exact step rarely meets a site that only some steps reach (an eviction, a finish).
    at_step = 2 if KINDS[kind].site.value == "before_step" else 0.3
    form = "event" if event else _pick(rng, {"plain": 2, "at_step": at_step, "after_step": 1.5,
                                             "cadence": 1})
    trigger: dict[str, Any] = {}
    if form == "at_step":
        trigger["at_step"] = rng.randint(1, max(1, steps))
    elif form == "after_step":
        trigger["after_step"] = rng.randint(0, max(0, steps // 2))
    elif form == "event":
        trigger["event"] = event
    elif form == "cadence":
        trigger["warmup_steps"] = rng.randint(0, max(0, min(12, steps // 2)))
        trigger["interval"] = rng.randint(1, 4)
    if kind == "never_evict_swa":
        trigger["times"] = _pick(rng, {1000: 3, rng.randint(1, 20): 1})
    elif rng.random() < 0.3:
        trigger["times"] = rng.randint(2, 5)
    if rng.random() < 0.1:
        trigger["probability"] = rng.choice((0.25, 0.5, 0.75))
    return trigger


def _target(rng: random.Random, window: int, running_at_most: int) -> dict:
    target: dict[str, Any] = {}
    request = _pick(rng, {0: 4, rng.randrange(running_at_most): 2, "random": 1, "all": 2,
                          "cached": 1})
    if request != 0:
        target["request"] = request
    positions = _pick(rng, {"last": 3, "in_window": 1, "retained_unread": 1, "out_of_window": 1,
                            "range": 1})
    if positions == "range":
        lo = rng.randint(0, 3 * window)
        positions = [lo, lo + rng.randint(1, max(1, window))]
    if positions != "last":
        target["positions"] = positions
    if rng.random() < 0.4:
        target["group"] = "swa"
    if rng.random() < 0.5:
        target["value"] = rng.choice(VALUES)
    if rng.random() < 0.3:
        target["count"] = rng.randint(2, 4)
    return target


@functools.lru_cache(maxsize=1)
def library_perturbations() -> dict[str, tuple[dict, ...]]:
    """The library's own perturbations by kind (trigger, target, params): forms known to land,
    which the generator reuses on its own engines and workloads (syzkaller's seed corpus)."""
    from canaries.scenario import SCENARIO_DIR

    by_kind: dict[str, list[dict]] = {}
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for item in doc.get("perturbations") or ():
            if isinstance(item, dict) and item.get("kind") in KINDS:
                by_kind.setdefault(item["kind"], []).append(copy.deepcopy(item))
    return {kind: tuple(items) for kind, items in by_kind.items()}


def _perturbation(rng: random.Random, kind: str, event: str | None, window: int,
                  running_at_most: int, radix: bool, steps: int) -> dict:
    """One perturbation of `kind`: a library form of it, or one drawn here (with `event` as its
    trigger when given)."""
    seeds = library_perturbations().get(kind)
    if seeds and rng.random() < SEED_SHARE:
        item = copy.deepcopy(rng.choice(seeds))
        target = item.get("target") or {}
        request = target.get("request", target.get("index"))
        if isinstance(request, int) and request >= running_at_most:
            target.pop("index", None)
            target["request"] = rng.randrange(running_at_most)
        if target.get("request") == "cached" and not radix:
            target["request"] = "all"
        return item
    item: dict[str, Any] = {"kind": kind, "trigger": _trigger(rng, kind, steps, event),
                            "target": _target(rng, window, running_at_most)}
    if item["target"].get("request") == "cached" and not radix:
        item["target"]["request"] = 0
    if kind == "flip_kv_byte" and rng.random() < 0.5:
        item["params"] = {"byte": rng.randint(0, 200)}
    elif kind == "evict_inside_window" and rng.random() < 0.5:
        item["params"] = {"extra_tokens": rng.randint(1, 2 * window)}
    return item


def generate(draw: Draw) -> dict:
    """The scenario document of `draw` (plain data, ready for yaml.safe_dump)."""
    rng = draw.rng()
    page, window = _page_and_window(rng)
    workload = _workload(rng, page, window)
    engine = {"profile": "cpu-tiny", **_engine(rng, page, window, workload)}
    control = rng.random() < CONTROL_SHARE
    doc: dict[str, Any] = {
        "name": draw.name,
        "description": f"generated by canary fuzz (seed {draw.seed}, index {draw.index}"
                       + (f", attempt {draw.attempt}" if draw.attempt else "") + ")",
        "seed": rng.randrange(1_000_000),
        "engine": engine,
        "workload": workload,
    }
    if control:
        doc["expect"] = {"clean": True}
        return doc
    kinds = [rng.choice(tuple(KINDS)) for _ in range(_pick(rng, {1: 6, 2: 3, 3: 1}))]
    events = [rng.choice(EVENTS) if rng.random() < 1 / 3 else None for _ in kinds]
    _fit_needs(rng, kinds, {e for e in events if e}, engine, workload)
    _fit_pools(engine, workload)
    running_at_most = min(workload["requests"], workload["concurrency"], engine["max_running_requests"])
    # Engine steps the workload takes at least: each wave of requests decodes its outputs.
    waves = -(-workload["requests"] // running_at_most)
    steps = waves * (workload["max_new_tokens"] + 1)
    perturbations = [_perturbation(rng, kind, event, window, running_at_most, engine["radix_cache"], steps)
                     for kind, event in zip(kinds, events, strict=True)]
    if engine["invariant_check"] == "off" and engine["kv_canary"] == "off":
        engine["kv_canary"] = "log"  # something must be able to see damage for a finding to mean anything
    doc["perturbations"] = perturbations
    caught_by = sorted({name for p in perturbations for name in KINDS[p["kind"]].caught_by})
    doc["expect"] = {"fires": caught_by, "any": True}
    return doc


def write_scenario(doc: dict, path: Path, header: str = "") -> Path:
    """Write `doc` as a scenario file (an optional comment header first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    path.write_text(text + yaml.safe_dump(doc, sort_keys=False, width=100), encoding="utf-8")
    return path


def scenario_for(seed: int, index: int, directory: Path, max_attempts: int = 8) -> tuple[Any, Draw]:
    """Generate, write and load the scenario of (seed, index) into `directory`: (Scenario, Draw).

    A draw the loader rejects (or one with a warning: a request the engine would refuse, a
    target no running set reaches) is drawn again; the loader has the last word."""
    from canaries.scenario import ScenarioError, load_scenario

    last: Exception | None = None
    for attempt in range(max_attempts):
        draw = Draw(seed, index, attempt)
        path = write_scenario(generate(draw), directory / f"{draw.name}.yaml")
        try:
            scenario = load_scenario(path)
        except ScenarioError as exc:
            last = exc
            continue
        if not scenario.warnings:
            return scenario, draw
        last = ValueError("; ".join(str(w) for w in scenario.warnings))
    raise RuntimeError(f"canary fuzz: no valid scenario at seed {seed} index {index} in "
                       f"{max_attempts} attempts; last problem: {last}")
