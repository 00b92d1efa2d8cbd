"""The import directions of docs/architecture.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports at runtime (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
            visit(child)

    visit(tree)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


ENGINE_FILES = _modules("engine_stub")

# module (or package prefix) -> engine_stub modules it may import; everything else is forbidden.
ALLOWED = {
    # Torch-free leaves: the detector catalogue and the field tables.
    "engine_stub.detectors": set(),
    "engine_stub.fields": set(),
    "engine_stub.invariants": {"engine_stub.detectors"},
    "engine_stub.events": set(),
    "engine_stub.synccheck": set(),
    "engine_stub.config": set(),
    # The submit-time refusal rule: torch-free, so `canary validate` asks it too.
    "engine_stub.admission": {"engine_stub.config"},
    "engine_stub.req": set(),
    # The sglang backend maps SGLang's firings onto catalogued detectors.
    "engine_stub.mem.sglang_backend": {"engine_stub.invariants", "engine_stub.mem", "engine_stub.detectors"},
    # SGLang's radix tree and request-row table behind ours' interfaces (memory: sglang).
    "engine_stub.mem.sglang_tree": {"engine_stub.mem.radix"},
    "engine_stub.mem.sglang_req_to_token": set(),
    "engine_stub.mem": {"engine_stub.invariants", "engine_stub.mem"},
    "engine_stub.model": {"engine_stub.mem"},
    "engine_stub.kv_canary": {"engine_stub.mem"},
    "engine_stub.perturb": {"engine_stub.perturb", "engine_stub.detectors", "engine_stub.fields"},
    "engine_stub.idle_check": {"engine_stub.invariants"},
    # The memory census reads the pools, the rows and the tree (our tree's nodes by type).
    "engine_stub.census": {"engine_stub.invariants", "engine_stub.mem"},
    "engine_stub.scheduler": {
        "engine_stub.admission", "engine_stub.census", "engine_stub.config", "engine_stub.events",
        "engine_stub.idle_check",
        "engine_stub.invariants", "engine_stub.kv_canary", "engine_stub.mem", "engine_stub.model",
        "engine_stub.perturb.sites", "engine_stub.req",
    },
    "engine_stub.engine": {
        "engine_stub.config", "engine_stub.events", "engine_stub.invariants", "engine_stub.req",
        "engine_stub.scheduler",
    },
    "engine_stub.server": {"engine_stub.engine", "engine_stub.model", "engine_stub.req"},
    "engine_stub.__main__": {
        "engine_stub.config", "engine_stub.engine", "engine_stub.perturb", "engine_stub.server",
    },
    # The warm parent imports what `python -m engine_stub` will need, then forks it.
    "engine_stub.forkserver": {
        "engine_stub.__main__", "engine_stub.engine", "engine_stub.forkproto", "engine_stub.hotpatch",
        "engine_stub.perturb", "engine_stub.server",
    },
    # The fork server's wire protocol: torch-free, the harness reads the server with it.
    "engine_stub.forkproto": set(),
    # A patched copy loaded into a fork parent in place: standard library only.
    "engine_stub.hotpatch": set(),
}


def _allowed_for(module: str) -> set[str]:
    if module == "engine_stub":
        return set()
    for prefix, allowed in ALLOWED.items():
        if module == prefix or module.startswith(prefix + "."):
            return allowed
    raise AssertionError(f"{module} has no row in ALLOWED: add it (and to docs/architecture.md)")


@pytest.mark.parametrize("path", ENGINE_FILES, ids=_module_name)
def test_engine_module_never_imports_the_suite_or_test_tools(path: Path) -> None:
    forbidden = {"canaries", "pytest", "docker", "hypothesis"}
    bad = {name for name in _imports(path) if name.split(".")[0] in forbidden}
    assert not bad, f"{_module_name(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=_module_name)
def test_engine_module_imports_only_downward(path: Path) -> None:
    module = _module_name(path)
    allowed = _allowed_for(module)
    internal = {name for name in _imports(path) if name.startswith("engine_stub")}
    bad = {name for name in internal if not any(name == a or name.startswith(a + ".") for a in allowed)}
    assert not bad, f"{module} may import only {sorted(allowed) or 'nothing from engine_stub'}, imports {sorted(bad)}"


def test_nothing_in_the_engine_imports_the_server() -> None:
    offenders = [
        _module_name(path) for path in ENGINE_FILES
        if path.name not in ("server.py", "__main__.py", "forkserver.py")
        and "engine_stub.server" in _imports(path)
    ]
    assert not offenders, f"only __main__ (and its fork server) may import engine_stub.server: {offenders}"


def test_import_walk_sees_a_planted_edge_but_not_type_checking_ones(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "import canaries.cli\n"
        "def f():\n    from engine_stub.server import create_app\n"
        "if TYPE_CHECKING:\n    from engine_stub.scheduler import Scheduler\n"
    )
    names = _imports(planted)
    assert {"canaries.cli", "engine_stub.server"} <= names
    assert "engine_stub.scheduler" not in names


# ---- the suite's side ------------------------------------------------------------------------

SUITE_FILES = _modules("canaries")


def test_scenario_never_imports_the_verdict() -> None:
    # canaries.verdict judges a Scenario; the scenario format only names the verdicts.
    offenders = {_module_name(path): sorted(n for n in _imports(path) if n.startswith("canaries.verdict"))
                 for path in _modules("canaries/scenario")}
    assert not {m: v for m, v in offenders.items() if v}, offenders


def test_every_command_has_its_module_and_the_cli_only_dispatches() -> None:
    from canaries.commands import COMMANDS

    assert {p.stem for p in (ROOT / "canaries" / "commands").glob("*.py")} \
        == {*COMMANDS, "__init__", "common"}
    cli = ROOT / "canaries" / "cli.py"
    assert len(cli.read_text(encoding="utf-8").splitlines()) < 80, "cli.py is a thin dispatcher"


# Modules of the author's loop (validate, list, schema, new): none may import torch when it is
# imported; tests/test_author_loop.py checks the same at run time.
TORCH_FREE = ("canaries.cli", "canaries.commands", "canaries.scenario", "engine_stub.admission",
              "engine_stub.config", "engine_stub.detectors", "engine_stub.fields", "engine_stub.perturb.contract",
              "engine_stub.perturb.kinds", "engine_stub.perturb.loader",
              "engine_stub.perturb.perturber", "engine_stub.perturb.sites",
              "engine_stub.perturb.spec", "engine_stub.perturb.targets")


@pytest.mark.parametrize("path", [p for p in ENGINE_FILES + SUITE_FILES
                                  if _module_name(p).startswith(TORCH_FREE)], ids=_module_name)
def test_author_loop_module_imports_no_torch_at_import(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n for n in names if n.split(".")[0] == "torch"}, f"{_module_name(path)} imports torch"


@pytest.mark.parametrize("path", _modules("canaries/sglang/server"), ids=_module_name)
def test_code_loaded_into_sglangs_processes_imports_no_other_part_of_the_suite(path: Path) -> None:
    """canaries/sglang/server/ runs inside SGLang's own processes (its server venv): beside the
    standard library, torch and sglang it may import only engine_stub and its own package."""
    suite = {name for name in _imports(path) if name.startswith("canaries")}
    bad = {name for name in suite if not name.startswith("canaries.sglang.server")}
    assert not bad, f"{_module_name(path)} imports {sorted(bad)}"


def test_the_suite_names_sglang_only_inside_its_sglang_package() -> None:
    """Everything that faces SGLang is in canaries/sglang/ (a reader sees our engine, SGLang, and
    the harness that drives either): nowhere else in the suite imports sglang."""
    offenders = [_module_name(p) for p in SUITE_FILES if "sglang" not in p.relative_to(ROOT).parts[:2]
                 and any(name.split(".")[0] == "sglang" for name in _imports(p))]
    assert not offenders, offenders
