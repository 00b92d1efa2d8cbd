"""The one error of `canaries.sglang.releases`: a release, venv, diff or patch that cannot be used."""

from __future__ import annotations

__all__ = ["ReleaseError"]


class ReleaseError(ValueError):
    """A release spec, venv or patch that cannot be used; the message says which and why."""
