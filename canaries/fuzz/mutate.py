"""Mutation operators over scenario documents: the steered fuzzer's way from a corpus entry to a
neighbour (AFL's havoc stage, over scenario parameters instead of bytes).

`mutate(doc, rng)` returns a new document and the names of the operators applied (1 to 3), each
a small change of one parameter: workload sizes, prompt and output lengths, concurrency, extra
requests; page size, window, pool sizes (the exact fit admission accepts among them), chunk
size, running requests, radix cache, detector levels; a perturbation's kind, trigger or target,
one added or removed. The pools are then raised to what the engine accepts and the workload
needs (`generate._fit_pools`), so a mutant is valid by the generator's rules; the loader has the
last word (the sequence draws again when it refuses).

`normalized(scenario)` turns a loaded scenario (a library file) into the generator's document
shape (every engine knob explicit), so library scenarios can seed the corpus.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

from canaries.fuzz.generate import (
    EVENTS,
    MAX_CONTEXT,
    _fit_pools,
    _longest_prompt,
    _perturbation,
    _target,
    _trigger,
)
from engine_stub.admission import full_reserve
from engine_stub.config import CHUNKED_PREFILL_AUTO, CHUNKED_PREFILL_OFF
from engine_stub.perturb.kinds import KINDS

__all__ = ["MUTATIONS", "expect_for", "mutate", "normalized"]

Op = Callable[[dict, random.Random], bool]


def _prompt_range(workload: dict) -> tuple[int, int]:
    prompt = workload["prompt_tokens"]
    return (min(prompt), max(prompt)) if isinstance(prompt, list) else (prompt, prompt)


def _requests(doc: dict, rng: random.Random) -> bool:
    w = doc["workload"]
    w["requests"] = max(1, min(8, rng.choice((w["requests"] - 1, w["requests"] + 1, w["requests"] * 2, 1))))
    _drop_dangling_extras(w)
    return True


def _concurrency(doc: dict, rng: random.Random) -> bool:
    doc["workload"]["concurrency"] = rng.randint(1, 4)
    return True


def _prompt(doc: dict, rng: random.Random) -> bool:
    w = doc["workload"]
    lo, hi = _prompt_range(w)
    window = doc["engine"]["window"]
    hi = max(1, min(400, rng.choice((hi // 2, hi * 2, hi + 1, window, window + 1, rng.randint(1, 400)))))
    lo = min(lo, hi)
    w["prompt_tokens"] = hi if lo == hi else [lo, hi]
    if w.get("shared_prefix_tokens", 0) >= lo:
        w.pop("shared_prefix_tokens", None)
    for extra in w.get("extra_requests", ()):
        if extra.get("keep_tokens", 0) > lo:
            extra["keep_tokens"] = lo
    return True


def _max_new(doc: dict, rng: random.Random) -> bool:
    w = doc["workload"]
    window = doc["engine"]["window"]
    w["max_new_tokens"] = max(1, rng.choice((1, w["max_new_tokens"] // 2, w["max_new_tokens"] * 2,
                                             window, window + 1, rng.randint(1, 48))))
    for extra in w.get("extra_requests", ()):
        if extra.get("hang_up_after_tokens", 0) >= w["max_new_tokens"]:
            extra.pop("hang_up_after_tokens")
    return True


def _shared_prefix(doc: dict, rng: random.Random) -> bool:
    w = doc["workload"]
    lo, _ = _prompt_range(w)
    if "shared_prefix_tokens" in w or lo < 2:
        w.pop("shared_prefix_tokens", None)
    else:
        w["shared_prefix_tokens"] = rng.randint(1, lo - 1)
    return True


def _extra(doc: dict, rng: random.Random) -> bool:
    w = doc["workload"]
    extras = w.setdefault("extra_requests", [])
    if extras and rng.random() < 0.4:
        extras.pop(rng.randrange(len(extras)))
        _drop_dangling_extras(w)
    else:
        extra: dict[str, Any] = {"prompt_of": rng.randrange(w["requests"] + len(extras)),
                                 "append_tokens": rng.randint(1, 24)}
        if rng.random() < 0.5:
            extra["with_answer"] = True
        if w["max_new_tokens"] > 1 and rng.random() < 0.3:
            extra["hang_up_after_tokens"] = rng.randint(1, w["max_new_tokens"] - 1)
        extras.append(extra)
    if not w.get("extra_requests"):
        w.pop("extra_requests", None)
    return True


def _page(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    e["page_size"] = rng.choice((1, 2, 3, 4, 5, 8, 16, 32, max(1, e["page_size"] - 1), e["page_size"] + 1))
    e["page_size"] = min(32, e["page_size"])
    _rechunk(e)
    return True


def _window(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    e["window"] = max(1, min(64, rng.choice((1, e["page_size"], e["page_size"] + 1, e["window"] - 1,
                                             e["window"] + 1, 2 * e["window"], rng.randint(1, 64)))))
    return True


def _headroom(engine: dict) -> int:
    page, window = engine["page_size"], engine["window"]
    return max(window, page) + window + 2 * page


def _swa_pool(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    smallest = _headroom(e) + e["page_size"]  # the exact fit: one headroom and a page
    e["swa_pool_tokens"] = rng.choice((smallest, smallest, smallest + e["page_size"], 2 * smallest,
                                       e["swa_pool_tokens"] * 2, 1024))
    return True


def _full_pool(doc: dict, rng: random.Random) -> bool:
    e, w = doc["engine"], doc["workload"]
    page = e["page_size"]
    need = -(-_longest_prompt(w) // page) * page + full_reserve(page, w["max_new_tokens"])
    e["full_pool_tokens"] = rng.choice((need, need, need + page, 2 * need,
                                        e.get("max_running_requests", 1) * need, 2048))
    return True


def _chunk(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    choice = rng.choice(("auto", "off", "pages", "pages"))
    e.pop("chunked_prefill_size", None)
    if choice == "off":
        e["chunked_prefill_size"] = "off"
    elif choice == "pages":
        e["chunked_prefill_size"] = e["page_size"] * rng.randint(1, 4)
    return True


def _running(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    e["max_running_requests"] = rng.randint(1, 6)
    return True


def _radix(doc: dict, rng: random.Random) -> bool:
    doc["engine"]["radix_cache"] = not doc["engine"].get("radix_cache", False)
    return True


def _levels(doc: dict, rng: random.Random) -> bool:
    e = doc["engine"]
    which = rng.choice(("invariant_check", "kv_canary", "kv_canary_sweep_interval"))
    e[which] = rng.choice({"invariant_check": ("strict", "warn", "off"),
                           "kv_canary": ("log", "raise", "off"),
                           "kv_canary_sweep_interval": (0, 1, 4, 8)}[which])
    return True


def _running_at_most(doc: dict) -> int:
    w, e = doc["workload"], doc["engine"]
    return max(1, min(w["requests"], w["concurrency"], e.get("max_running_requests", 1)))


def _new_perturbation(doc: dict, rng: random.Random, kind: str) -> dict:
    event = rng.choice(EVENTS) if rng.random() < 1 / 3 else None
    steps = -(-doc["workload"]["requests"] // _running_at_most(doc)) * (doc["workload"]["max_new_tokens"] + 1)
    return _perturbation(rng, kind, event, doc["engine"]["window"], _running_at_most(doc),
                         bool(doc["engine"].get("radix_cache")), steps)


def _perturbations(doc: dict, rng: random.Random) -> bool:
    """Add, remove, or change one perturbation's kind, trigger or target."""
    items = doc.setdefault("perturbations", [])
    what = rng.choice(("add", "remove", "kind", "trigger", "target")) if items else "add"
    if what == "add" or (what == "remove" and len(items) < 2):
        if len(items) >= 3:
            return False
        items.append(_new_perturbation(doc, rng, rng.choice(tuple(KINDS))))
        return True
    i = rng.randrange(len(items))
    if what == "remove":
        items.pop(i)
    elif what == "kind":
        items[i] = {**items[i], "kind": rng.choice(tuple(KINDS))}
        items[i].pop("params", None)  # params belong to the kind they were drawn for
    elif what == "trigger":
        steps = doc["workload"]["max_new_tokens"] + 1
        event = rng.choice(EVENTS) if rng.random() < 1 / 3 else None
        items[i]["trigger"] = _trigger(rng, items[i]["kind"], steps, event)
    else:
        items[i]["target"] = _target(rng, doc["engine"]["window"], _running_at_most(doc))
        if items[i]["target"].get("request") == "cached" and not doc["engine"].get("radix_cache"):
            items[i]["target"]["request"] = 0
    return True


MUTATIONS: dict[str, Op] = {
    "requests": _requests, "concurrency": _concurrency, "prompt": _prompt, "max_new": _max_new,
    "shared_prefix": _shared_prefix, "extra": _extra, "page": _page, "window": _window,
    "swa_pool": _swa_pool, "full_pool": _full_pool, "chunk": _chunk, "running": _running,
    "radix": _radix, "levels": _levels, "perturbation": _perturbations,
}


def _drop_dangling_extras(workload: dict) -> None:
    """Extras that follow a request no longer in the plan go (and those that follow them)."""
    kept: list[dict] = []
    for extra in workload.get("extra_requests", ()):
        if extra.get("prompt_of", 0) < workload["requests"] + len(kept):
            kept.append(extra)
    if kept:
        workload["extra_requests"] = kept
    else:
        workload.pop("extra_requests", None)


def _rechunk(engine: dict) -> None:
    size = engine.get("chunked_prefill_size")
    if isinstance(size, int) and size > 0:
        engine["chunked_prefill_size"] = max(1, size // engine["page_size"]) * engine["page_size"]


def expect_for(doc: dict) -> dict:
    """The generator's expectation: a control is clean, a perturbed run fires one of its kinds'
    detectors (what `canary run` checks; the fuzzer's oracle needs none)."""
    items = doc.get("perturbations") or []
    if not items:
        return {"clean": True}
    return {"fires": sorted({d for p in items for d in KINDS[p["kind"]].caught_by}), "any": True}


def mutate(doc: dict, rng: random.Random) -> tuple[dict, list[str]]:
    """A neighbour of `doc` and the operators that made it."""
    child = copy.deepcopy(doc)
    applied: list[str] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        name = rng.choice(tuple(MUTATIONS))
        if MUTATIONS[name](child, rng):
            applied.append(name)
    w = child["workload"]
    w["max_new_tokens"] = max(1, min(w["max_new_tokens"], MAX_CONTEXT - _longest_prompt(w) - 8))
    while w.get("extra_requests") and _longest_prompt(w) + w["max_new_tokens"] > MAX_CONTEXT:
        w["extra_requests"].pop()
    if not w.get("extra_requests"):
        w.pop("extra_requests", None)
    if not child.get("perturbations"):
        child.pop("perturbations", None)
    _rechunk(child["engine"])
    _fit_pools(child["engine"], w)
    if child["engine"].get("invariant_check") == "off" and child["engine"].get("kv_canary") == "off":
        child["engine"]["kv_canary"] = "log"  # as the generator: something must be able to see
    child["expect"] = expect_for(child)
    return child, applied


def normalized(scenario: Any, raw: dict) -> dict:
    """A loaded scenario (and `raw`, its file's document) as a generator-shaped document: every
    engine knob the operators touch explicit, extras reduced to follow-ups (the only form the
    generator's sizing reads), the perturbations as written."""
    e, w = scenario.engine, scenario.workload
    engine: dict[str, Any] = {
        "profile": "cpu-tiny", "page_size": e.page_size, "window": e.window,
        "swa_pool_tokens": e.swa_pool_tokens, "full_pool_tokens": e.full_pool_tokens,
        "max_running_requests": e.max_running_requests, "radix_cache": e.radix_cache,
        "invariant_check": e.invariant_check, "kv_canary": e.kv_canary,
        "kv_canary_sweep_interval": e.kv_canary_sweep_interval,
    }
    if e.chunked_prefill_size == CHUNKED_PREFILL_OFF:
        engine["chunked_prefill_size"] = "off"
    elif e.chunked_prefill_size != CHUNKED_PREFILL_AUTO:
        engine["chunked_prefill_size"] = e.chunked_prefill_size
    lo, hi = w.prompt_tokens
    workload: dict[str, Any] = {"requests": w.requests, "concurrency": w.concurrency,
                                "prompt_tokens": hi if lo == hi else [lo, hi],
                                "max_new_tokens": w.max_new_tokens}
    if w.shared_prefix_tokens:
        workload["shared_prefix_tokens"] = w.shared_prefix_tokens
    if not w.unique_prompts:
        workload["unique_prompts"] = False
    extras = []
    for x in w.extra_requests:
        if x.prompt_of is None or x.status != 200 or x.max_new_tokens is not None:
            break  # later follow-ups may point at it: stop at the first one we cannot size
        extra: dict[str, Any] = {"prompt_of": x.prompt_of}
        if x.with_answer:
            extra["with_answer"] = True
        if x.keep_tokens is not None:
            extra["keep_tokens"] = x.keep_tokens
        if x.append_tokens:
            extra["append_tokens"] = x.append_tokens
        if x.hang_up_after_tokens is not None:
            extra["hang_up_after_tokens"] = x.hang_up_after_tokens
        extras.append(extra)
    if extras:
        workload["extra_requests"] = extras
    doc: dict[str, Any] = {"name": scenario.name, "seed": scenario.seed, "engine": engine,
                           "workload": workload}
    if scenario.perturbations:
        doc["perturbations"] = copy.deepcopy(list(raw.get("perturbations") or ()))
    return doc
