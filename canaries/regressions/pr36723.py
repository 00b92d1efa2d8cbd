"""Catalogue entries: pr36723."""

from canaries.regressions import regression  # noqa: F401
