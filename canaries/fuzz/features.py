"""What a run reached: a set of state features read from its event log, the steering signal.

Cheap by construction: the engine already writes every event read here (`events.jsonl`), so
collecting features costs the harness one pass over a file and the engine nothing. A feature is
a short string; a run's features are a frozenset, hashable and comparable across runs. They say:

- pool levels: the lowest free share each pool reached, bucketed (`swa_low:0`, `full_low:<5%`);
  the tree's share of each pool at idle (`tree_swa:<25%`), the running set's peak;
- scheduler co-occurrence: which scheduler events met in one step (`step:admit+chunk+finish`),
  cache hits, chunked prompts, parked chunks, stalls, gate timeouts, hang-ups;
- perturbations: which kind landed at which site, and what became of its damage (`consumed`
  by what, `died`);
- detectors and symptoms: every fired detector, the idle check's unbalanced ledgers, radix
  problems, slots held twice, drop counters, and the oracle's outcome.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

__all__ = ["run_features"]

# Scheduler events that say what happened in a step; their combination per step is a feature.
_STEP_EVENTS = {"request_admitted": "admit", "prefill_chunk": "chunk", "request_finished": "finish",
                "chunk_parked": "park", "perturbation_landed": "land", "decode_stall": "dstall",
                "admission_stall": "astall", "invariant_firing": "fire", "canary_violation": "canary"}


def _share(free: float, total: float) -> str:
    """A free share bucketed: exhaustion and near-exhaustion are told apart from roomy."""
    if total <= 0:
        return "?"
    share = free / total
    for bound, label in ((0.0, "0"), (0.05, "<5%"), (0.25, "<25%"), (0.5, "<50%")):
        if share <= bound:
            return label
    return ">=50%"


def _events(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "events.jsonl").read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a crashed engine
    return out


def run_features(run_dir: str | Path, outcome: str) -> frozenset[str]:
    """The features of the run left in `run_dir`, judged `outcome` by the oracle."""
    events = _events(Path(run_dir))
    features = {f"outcome:{outcome}"}
    config = next((e.get("config") or {} for e in events if e.get("kind") == "engine_start"), {})
    totals = {"full": config.get("full_pool_tokens") or 0, "swa": config.get("swa_pool_tokens") or 0}
    lowest = {pool: float("inf") for pool in totals}
    per_step: dict[int, set[str]] = defaultdict(set)
    peak_running = 0
    for event in events:
        kind = event.get("kind")
        if kind == "step":
            peak_running = max(peak_running, event.get("running") or 0)
            features.add(f"batch:{event.get('batch')}")
        for pool in totals:
            if isinstance(event.get(f"{pool}_available"), int):
                lowest[pool] = min(lowest[pool], event[f"{pool}_available"])
        if kind in _STEP_EVENTS and isinstance(event.get("step"), int):
            per_step[event["step"]].add(_STEP_EVENTS[kind])
        if kind == "request_admitted":
            if event.get("cached_len"):
                features.add("cache_hit")
            if (event.get("chunk_end") or 0) < (event.get("prompt_len") or 0):
                features.add("chunked")
        elif kind == "request_finished":
            features.add(f"finish:{event.get('finish_reason')}")
        elif kind in ("chunk_parked", "decode_stall", "admission_stall", "gate_timeout",
                      "unanswered_requests", "crash"):
            features.add(kind if kind != "crash" else f"crash:{event.get('cause')}")
        elif kind == "perturbation_landed":
            features.add(f"landed:{event.get('perturbation')}@{event.get('site')}")
        elif kind == "perturbation_consumed":
            features.add(f"consumed:{event.get('damage_kind')}:{event.get('by')}")
        elif kind == "perturbation_died":
            features.add(f"died:{event.get('damage_kind')}")
        elif kind == "invariant_firing":
            features.add(f"fired:{event.get('invariant')}")
        elif kind == "canary_violation":
            features.add(f"canary:{event.get('reason') or event.get('check')}")
        elif kind == "idle_check":
            features |= _idle_features(event, totals)
    for pool, low in lowest.items():
        if low != float("inf"):
            features.add(f"{pool}_low:{_share(low, totals[pool])}")
    features.add(f"running_peak:{min(peak_running, 4)}")
    features |= {"step:" + "+".join(sorted(kinds)) for kinds in per_step.values() if len(kinds) > 1}
    return frozenset(features)


def _idle_features(event: dict, totals: dict[str, int]) -> set[str]:
    out = set()
    for pool, ledger in (event.get("ledgers") or {}).items():
        if ledger.get("delta"):
            out.add(f"ledger:{pool}:{'+' if ledger['delta'] > 0 else '-'}")
        if pool in totals and ledger.get("total"):
            held = (ledger.get("evictable") or 0) + (ledger.get("protected") or 0)
            out.add(f"tree_{pool}:{_share(held, ledger['total'])}")
            if ledger.get("protected"):
                out.add(f"tree_locked:{pool}")
    if event.get("radix_problems"):
        out.add("radix_problems")
    for key, count in (event.get("census") or {}).items():
        if count:
            out.add(f"census:{key}")
    for pool, counters in (event.get("drops") or {}).items():
        out |= {f"drop:{pool}:{name}" for name, count in (counters or {}).items() if count}
    return out
