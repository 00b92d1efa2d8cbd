"""Catalogue entries: free_group."""

from canaries.regressions import regression  # noqa: F401
