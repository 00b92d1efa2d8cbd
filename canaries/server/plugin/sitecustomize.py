"""Loaded at start-up by every process of an SGLang server the suite launches (the runtime puts
this directory first on PYTHONPATH): on a CPU, the stand-ins SGLang needs there."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    from canaries.server import cpu_standins

    cpu_standins.install()
