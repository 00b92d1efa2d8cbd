"""Catalogue entries: mapping."""

from canaries.regressions import regression  # noqa: F401
