"""The safety net's SIGTERM handler: every runtime stopped, then the harness dies, however many
SIGTERMs arrive."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A runtime whose stop takes a while under its lock, as LocalRuntime.stop does, and a harness
# that gets two SIGTERMs 0.15 s apart while the first one stops it.
HARNESS = """\
import os, signal, threading, time
from canaries.runtime import safety

class SlowRuntime:
    def __init__(self):
        self.lock = threading.Lock()
        self.stops = 0

    def stop(self, timeout=5.0):
        with self.lock:
            self.stops += 1
            time.sleep(0.5)
            safety.unregister(self)
            print("stopped", self.stops, flush=True)

safety.register(SlowRuntime())
safety.install_sigterm_handler()

def twice():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.15)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=twice).start()
time.sleep(20)
print("SIGTERM did not stop the harness", flush=True)
"""


def test_sigterm_twice_stops_every_runtime_once_and_exits_143() -> None:
    proc = subprocess.run([sys.executable, "-c", HARNESS], cwd=REPO, capture_output=True,
                          text=True, timeout=15, check=False)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["stopped 1"], proc.stdout + proc.stderr
