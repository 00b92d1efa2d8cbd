"""The scenario format as JSON Schema (draft 2020-12), generated from the field table."""

from __future__ import annotations

from canaries.scenario.fields import SCENARIO

__all__ = ["json_schema"]


def json_schema() -> dict:
    """A JSON Schema of the scenario format, for editors: the SCENARIO table, every kind's
    params from its declaration, every detector from the catalogue."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://serving-canary/scenario.schema.json",
        "title": "serving-canary scenario",
        **SCENARIO.schema(),
    }
