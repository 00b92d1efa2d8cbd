"""Perturbations: hook sites, registered kinds, triggers, and landed records.

Torch-free to import: the declarations (kinds, their params and caught_by, the sites' contexts)
are read by the canary suite without torch; only `perturb/view.py`, built when a hook first runs
in an engine, touches tensors.
"""

from engine_stub.perturb.contract import Damage, EngineView, KindContext, Landing
from engine_stub.perturb.kinds import KINDS, KindInfo, register_kind
from engine_stub.perturb.loader import load_engine_scenario
from engine_stub.perturb.perturber import Perturber
from engine_stub.perturb.sites import Site
from engine_stub.perturb.spec import PerturbationSpec, SpecError, parse_perturbations

__all__ = ["KINDS", "Damage", "EngineView", "KindContext", "KindInfo", "Landing",
           "PerturbationSpec", "Perturber", "Site", "SpecError", "load_engine_scenario",
           "parse_perturbations", "register_kind"]
