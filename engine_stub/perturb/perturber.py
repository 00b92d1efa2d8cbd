"""Perturber: evaluates each loaded perturbation's trigger at its hook site and records landings."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_stub.perturb.kinds import KINDS, KindContext, KindInfo
from engine_stub.perturb.sites import Site
from engine_stub.perturb.spec import PerturbationSpec

if TYPE_CHECKING:
    from engine_stub.scheduler import Scheduler

__all__ = ["Perturber"]


@dataclass
class _Armed:
    index: int
    spec: PerturbationSpec
    kind: KindInfo
    rng: random.Random
    eligible_calls: int = 0
    landings: int = 0


class Perturber:
    """The engine's view of a scenario's perturbations. Seeded: same seed, same landings."""

    def __init__(self, specs: list[PerturbationSpec], seed: int) -> None:
        self.armed = [
            _Armed(i, spec, KINDS[spec.kind], random.Random(seed * 1_000_003 + i)) for i, spec in enumerate(specs)
        ]
        self.sites = {a.kind.site for a in self.armed}
        self._events_seen: set[str] = set()

    def _note_events(self, sched: Scheduler) -> None:
        stats = sched.stats
        if any(r.kv_len > sched.window for r in sched.running):
            self._events_seen.add("window_cross")
        if stats["swa_evicted_tokens"] > 0:
            self._events_seen.add("first_swa_eviction")
        if stats["finished_requests"] > 0:
            self._events_seen.add("request_finish")
        if stats["cached_tokens"] > 0:
            self._events_seen.add("cache_hit")

    def _eligible(self, armed: _Armed, step: int) -> bool:
        trig = armed.spec.trigger
        if armed.landings >= trig.times:
            return False
        if trig.at_step is not None and step != trig.at_step:
            return False
        if trig.after_step is not None and step <= trig.after_step:
            return False
        if step <= trig.warmup_steps:
            return False
        if trig.event is not None and trig.event not in self._events_seen:
            return False
        armed.eligible_calls += 1
        if (armed.eligible_calls - 1) % trig.interval:
            return False
        return trig.probability >= 1.0 or armed.rng.random() < trig.probability

    def at(self, site: Site, sched: Scheduler, **ctx: Any) -> dict:
        """Run every perturbation bound to `site` whose trigger allows it; returns overrides."""
        if site not in self.sites:
            if site == Site.BEFORE_STEP:
                self._note_events(sched)
            return {}
        self._note_events(sched)
        overrides: dict[str, Any] = {}
        for armed in self.armed:
            if armed.kind.site != site or not self._eligible(armed, sched.step_no):
                continue
            landing = armed.kind.fn(KindContext(sched, armed.spec, armed.rng, {**ctx, **overrides}))
            if landing is None:
                continue
            armed.landings += 1
            overrides.update(landing.overrides)
            sched.events.write("perturbation_landed", durable=True, index=armed.index, perturbation=armed.spec.kind,
                               site=site.value, landing=armed.landings, **landing.digest)
        return overrides
