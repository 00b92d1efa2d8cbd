"""Catalogue entries: req_to_token."""

from canaries.regressions import regression  # noqa: F401
