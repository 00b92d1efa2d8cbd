"""Catalogue entries: suballoc."""

from canaries.regressions import regression  # noqa: F401
