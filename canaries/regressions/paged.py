"""Catalogue entries: paged."""

from canaries.regressions import regression  # noqa: F401
