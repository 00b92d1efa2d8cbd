"""What the commands share: exit codes, the usage error, and finding and loading scenarios."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError",
           "load_scenarios", "scenario_files", "scenarios_dir"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad arguments or invalid scenarios: exit 2 with the message."""


def scenarios_dir() -> Path:
    from canaries.scenario import SCENARIO_DIR

    here = Path.cwd() / "configs" / "scenarios"
    return here if here.is_dir() else SCENARIO_DIR


def scenario_files(paths: Sequence[str]) -> list[Path]:
    """The scenario files `paths` name (directories expanded), default the library."""
    from canaries import scenario as sc

    if not paths:
        return [Path(p) for p in sc.discover()]
    for raw in paths:
        if not Path(raw).exists():
            raise UsageError(f"{raw}: no such file or directory")
    return [Path(p) for p in sc.discover(paths)]


def load_scenarios(paths: Sequence[str]) -> list:
    """Load and validate; UsageError listing every problem (duplicate names included)."""
    from canaries import scenario as sc

    files = scenario_files(paths)
    if not files:
        raise UsageError("no scenario files found")
    scenarios, problems, _ = sc.load_paths(files)
    if problems:
        raise UsageError("\n".join(str(p) for p in problems))
    return scenarios
