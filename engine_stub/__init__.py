"""engine_stub: a mini serving engine carrying SGLang's hybrid SWA KV memory path."""

__version__ = "0.1.0"
