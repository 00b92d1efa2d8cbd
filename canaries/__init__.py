"""serving-canary: the fault-injection canary suite that drives engine_stub."""

__version__ = "0.1.0"
