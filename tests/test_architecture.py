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
    "engine_stub.invariants": set(),
    "engine_stub.events": set(),
    "engine_stub.synccheck": set(),
    "engine_stub.config": set(),
    "engine_stub.req": set(),
    "engine_stub.mem": {"engine_stub.invariants", "engine_stub.mem"},
    "engine_stub.model": {"engine_stub.mem"},
    "engine_stub.kv_canary": {"engine_stub.mem"},
    "engine_stub.perturb": {"engine_stub.perturb"},
    "engine_stub.idle_check": {"engine_stub.invariants"},
    "engine_stub.scheduler": {
        "engine_stub.config", "engine_stub.events", "engine_stub.idle_check", "engine_stub.invariants",
        "engine_stub.kv_canary", "engine_stub.mem", "engine_stub.model", "engine_stub.perturb.sites",
        "engine_stub.req",
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
        "engine_stub.__main__", "engine_stub.engine", "engine_stub.perturb", "engine_stub.server",
    },
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
