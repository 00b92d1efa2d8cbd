"""The README's two set-up commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup)


def test_readme_has_the_main_job_and_the_test_command() -> None:
    main_job, test_command = _readme_commands()[:2]
    assert main_job.endswith("canary run")
    assert "python -m pytest" in test_command
    for command in (main_job, test_command):
        assert "torch==2.13.0" in command, "an unpinned torch would pull a multi-GB CUDA build"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = _readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci_lines


def test_torch_imports_without_a_warning_in_this_environment() -> None:
    # A fresh venv once lacked numpy: torch then warns at import, and pytest's
    # `filterwarnings = error` turned the warning into an ImportError in conftest.py.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "error", "-c", "import torch"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_project_declares_numpy() -> None:
    from importlib.metadata import requires

    names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires("serving-canary") or []}
    assert "numpy" in names
