"""Perturber: evaluates each loaded perturbation's trigger at its hook site and records landings.

The scheduler hands it a site's typed context (perturb/sites.py) and gets back the site's effect:
the planned one, changed by every kind that landed. Kinds see the engine through a
`SchedulerView`, built at the first hook call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_stub.perturb.contract import KindContext, Landing
from engine_stub.perturb.kinds import KINDS, KindInfo
from engine_stub.perturb.sites import Site, SiteContext, merge_effects
from engine_stub.perturb.spec import PerturbationSpec

if TYPE_CHECKING:
    from engine_stub.perturb.view import SchedulerView
    from engine_stub.scheduler import Scheduler

__all__ = ["Perturber"]


@dataclass
class _Armed:
    index: int
    spec: PerturbationSpec
    kind: KindInfo
    params: dict[str, Any]
    rng: random.Random
    eligible_calls: int = 0
    landings: int = 0


class Perturber:
    """The engine's view of a scenario's perturbations. Seeded: same seed, same landings."""

    def __init__(self, specs: list[PerturbationSpec], seed: int) -> None:
        self.armed = [
            _Armed(i, spec, KINDS[spec.kind], KINDS[spec.kind].resolved_params(spec.params),
                   random.Random(seed * 1_000_003 + i))
            for i, spec in enumerate(specs)
            if spec.via == "engine"  # SGLang's own knob carries out the others (its server only)
        ]
        self.sites = {a.kind.site for a in self.armed}
        self._events_seen: set[str] = set()
        self._view: SchedulerView | None = None
        self.reach: Any = None  # the ReachTracker, once a scheduler attaches

    def _view_of(self, sched: Scheduler) -> SchedulerView:
        if self._view is None:
            from engine_stub.perturb.view import SchedulerView  # torch: only once a hook runs

            self._view = SchedulerView(sched)
        return self._view

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
        if stats["prefill_chunks"] > 0:
            self._events_seen.add("chunk_boundary")

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

    def at(self, hook: SiteContext, sched: Scheduler) -> Any:
        """Run every perturbation bound to `hook`'s site whose trigger allows it; the site's
        effect (its planned one where nothing changed it; None for a site without effects)."""
        site = hook.SITE
        effect = hook.planned()
        if site not in self.sites:
            if site == Site.BEFORE_STEP:
                self._note_events(sched)
            return effect
        self._note_events(sched)
        view = self._view_of(sched)
        for armed in self.armed:
            if armed.kind.site != site or not self._eligible(armed, sched.step_no):
                continue
            landing = armed.kind.fn(KindContext(view, hook, armed.spec, armed.params, armed.rng))
            if landing is None:
                continue
            self._check(armed, hook, landing)
            armed.landings += 1
            if landing.effect is not None:
                effect = merge_effects(effect, landing.effect)
                hook = hook.after(effect)
            sched.events.write("perturbation_landed", durable=True, index=armed.index,
                               perturbation=armed.spec.kind, site=site.value,
                               landing=armed.landings, **landing.digest,
                               damage=[d.to_dict() for d in landing.damage])
            if self.reach is not None:
                self.reach.track(armed.index, armed.landings, landing.damage)
        return effect

    def attach(self, sched: Scheduler) -> Any:
        """The reachability tracker of this engine (perturb/reach.py), made once: it follows
        every landing's damage until it is read or dies."""
        if self.reach is None:
            from engine_stub.perturb.reach import ReachTracker  # torch: engine side only

            cfg = sched.config
            self.reach = ReachTracker(sched.events.write)
            self.reach.configure(window=cfg.window, page_size=cfg.page_size,
                                 layer_pattern=cfg.layer_pattern, canary=cfg.kv_canary != "off")
        return self.reach

    def tracking(self, allocator: Any) -> Any:
        """`allocator`, reporting its reads, frees and re-pairings to the tracker."""
        from engine_stub.perturb.reach import TrackingAllocator

        return TrackingAllocator(allocator, self.reach)

    @staticmethod
    def _check(armed: _Armed, hook: SiteContext, landing: Landing) -> None:
        """A kind's landing must carry its site's effect type (a bug in the kind otherwise)."""
        if not isinstance(landing, Landing):
            raise TypeError(f"kind {armed.kind.name} returned {type(landing).__name__}, "
                            "not a Landing or None")
        if landing.effect is not None and (hook.EFFECT is None
                                           or not isinstance(landing.effect, hook.EFFECT)):
            raise TypeError(f"kind {armed.kind.name} at {hook.SITE.value} returned a "
                            f"{type(landing.effect).__name__}; the site takes "
                            f"{hook.EFFECT.__name__ if hook.EFFECT else 'no effect'}")
