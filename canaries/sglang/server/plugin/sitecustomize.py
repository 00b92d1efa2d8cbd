"""Loaded at start-up by every process of an SGLang server the suite launches (the runtime puts
this directory first on PYTHONPATH): on a CPU, the stand-ins SGLang needs there; in the process
that builds SGLang's scheduler, the suite's event log."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    from canaries.sglang.server import cpu_standins

    cpu_standins.install()

if os.environ.get("CANARY_SERVER_EVENT_LOG"):
    from canaries.sglang.server import scheduler_plugin

    scheduler_plugin.install()
