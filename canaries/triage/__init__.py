"""Triage from a report: rerun what ran (`repro`), make a failing scenario small (`shrink`), and
find the engine commit that changed a verdict (`bisect`)."""
