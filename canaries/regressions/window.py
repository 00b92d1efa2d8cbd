"""Catalogue entries: window."""

from canaries.regressions import regression  # noqa: F401
