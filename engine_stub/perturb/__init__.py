"""Perturbations: hook sites, registered kinds, triggers, and landed records."""

from engine_stub.perturb.sites import Site

__all__ = ["Site"]
