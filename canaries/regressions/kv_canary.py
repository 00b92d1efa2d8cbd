"""Catalogue entries: kv_canary."""

from canaries.regressions import regression  # noqa: F401
