"""`canary validate [PATHS...]`: every problem as `file:line: field: message`, warnings too.

Exit 0 when no file has a problem (warnings do not fail), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from canaries.commands.common import EXIT_FAILED, EXIT_OK, scenario_files

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    val = sub.add_parser("validate", help="check scenario files (file:line: field: message)")
    val.add_argument("paths", nargs="*", metavar="PATHS")
    val.add_argument("--runtime", choices=("local", "docker", "sglang-server"), default="local",
                     help="also what this runtime cannot run (sglang-server: the engine knobs and kinds "
                          "SGLang's server cannot take, and planted engine regressions)")
    val.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canaries.scenario import check_paths

    files = scenario_files(args.paths)
    problems, warnings = check_paths(files)
    if args.runtime == "sglang-server" and not problems:
        problems = _server_refusals(files)
    elif not problems:
        problems = _knob_refusals(files, args.runtime)
    for p in [*problems, *warnings]:
        sys.stdout.write(f"{p}\n")
    # Every problem line is out before the summary goes to the other stream: where both end up
    # in one place, the summary must not land inside a half-flushed problem line.
    sys.stdout.flush()
    if problems:
        bad = len({p.file for p in problems})
        print(f"{len(problems)} problem(s) in {bad} file(s)", file=sys.stderr, flush=True)
        return EXIT_FAILED
    noted = f" ({len(warnings)} warning(s))" if warnings else ""
    print(f"{len(files)} scenarios OK{noted}")
    return EXIT_OK


def _knob_refusals(files: list, runtime: str) -> list:
    """Perturbations `via: sglang_knob` (SGLang's own knobs) on a runtime that runs our engine."""
    from pathlib import Path

    from canaries.scenario import load_paths
    from canaries.scenario.model import Problem
    from canaries.scenario.yamldoc import read_doc

    scenarios, _, _ = load_paths(files)
    problems = []
    for scenario in scenarios:
        doc = None
        for index, spec in enumerate(scenario.perturbations):
            if spec.via != "engine":
                doc = doc or read_doc(Path(scenario.path))
                where = f"perturbations[{index}].via"
                problems.append(Problem(scenario.path, doc.line(where), where,
                                        f"--runtime {runtime}: {spec.via} is SGLang's own perturbation knob; "
                                        "only SGLang's server runs it (--runtime sglang-server)"))
    return problems


def _server_refusals(files: list) -> list:
    """What SGLang's server cannot run, as problems at the field's line."""
    from pathlib import Path

    from canaries.scenario import load_paths
    from canaries.scenario.loader import engine_spec
    from canaries.scenario.model import Problem
    from canaries.scenario.yamldoc import read_doc
    from canaries.sglang.runtime import spec_refusals

    scenarios, _, _ = load_paths(files)
    problems = []
    for scenario in scenarios:
        doc = read_doc(Path(scenario.path))
        found = []
        if scenario.regressions:
            found.append(("regressions", "the server runs SGLang's code: the engine regressions a "
                                         "scenario plants do not apply"))
        found += spec_refusals(engine_spec(scenario))
        problems += [Problem(scenario.path, doc.line(where), where, f"--runtime sglang-server: {why}")
                     for where, why in found]
    return problems
