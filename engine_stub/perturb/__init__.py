"""Perturbations: hook sites, registered kinds, triggers, and landed records."""

from engine_stub.perturb.kinds import KINDS, register_kind
from engine_stub.perturb.loader import load_engine_scenario
from engine_stub.perturb.perturber import Perturber
from engine_stub.perturb.sites import Site
from engine_stub.perturb.spec import PerturbationSpec, SpecError, parse_perturbations

__all__ = ["KINDS", "PerturbationSpec", "Perturber", "Site", "SpecError", "load_engine_scenario",
           "parse_perturbations", "register_kind"]
