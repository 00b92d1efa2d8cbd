"""Hook sites: the named places where the engine hands its state to a loaded perturbation.

With no scenario loaded the engine holds no perturber and never calls a site.
"""

from __future__ import annotations

import enum

__all__ = ["Site"]


class Site(str, enum.Enum):
    BEFORE_STEP = "before_step"  # ctx: -
    AFTER_FORWARD = "after_forward"  # ctx: reqs, batch
    ON_SAMPLING = "on_sampling"  # ctx: reqs, next_ids -> may return next_ids
    # ctx: req, slots, frontier, new_frontier -> may return slots, new_frontier, then_free_swa
    ON_WINDOW_EVICTION = "on_window_eviction"
    ON_REQUEST_FINISH = "on_request_finish"  # ctx: req -> may return leak, then_free_full
    CACHE_HIT = "cache_hit"  # ctx: req, cached_len
