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
