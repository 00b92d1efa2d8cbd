"""A patched copy of an imported package, loaded into this process without importing it again.

A fork parent (`engine_stub.forkserver`) that has torch and SGLang imported serves a patched
release's engines from a fork of itself: the fork calls `apply(site)`, where `site` is a mirror of
the package (`canaries.sglang.releases.patches.patch_mirror`: the patched files real, everything else a
symlink to the installed file), or a full copy of it (an `engine_root`: the engine's sources with
catalogue regressions applied, whose untouched files are skipped). For each patched file:

- a module the process has not imported yet is imported from the mirror when it is (a finder
  first on `sys.meta_path`);
- a module it has imported gets the patched file's code in place: every function of the module
  whose code the patch changed takes the new code object (`function.__code__`), so every
  reference to it (bound methods, other modules' `from x import f`, decorators' wrappers) runs
  the patched code at once.

The second is only sound where the patch changes nothing but function bodies: the module's and
its classes' own statements (imports, constants, class attributes, decorators, signatures'
defaults) must parse the same, and no statement of them may name a function whose code changed
(it could have run at import). Otherwise, or where a changed function is not found among the
module's live objects, `apply` raises HotPatchRefused naming the file and why, and the caller
imports the patched copy afresh instead. A change that only moves lines (a comment) is not a
change of behaviour: its functions take the new code where found (tracebacks then name the
patched file's lines), and one not found is no refusal.
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HotPatchRefused", "PatchedFile", "apply", "patched_files"]


class HotPatchRefused(RuntimeError):
    """The patch cannot be loaded in place; the message names the file and why."""


@dataclass(frozen=True)
class PatchedFile:
    """A file of the mirror that differs from the installed package: its module and its path."""

    module: str
    path: str

    @property
    def is_package(self) -> bool:
        return Path(self.path).name == "__init__.py"


def patched_files(site: str | os.PathLike, package: str | None = None) -> list[PatchedFile]:
    """The mirror's real `.py` files under `site/package` (the rest are symlinks); every package
    the mirror holds when `package` is None."""
    if package is None:
        return [f for entry in sorted(Path(site).iterdir()) if entry.is_dir() and not entry.is_symlink()
                for f in patched_files(site, entry.name)]
    root = Path(site) / package
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk does not follow symlinked dirs
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and not path.is_symlink():
                parts = path.relative_to(Path(site)).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                out.append(PatchedFile(module, str(path)))
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) / d).is_symlink())
    return out


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Imports the listed modules from their patched files."""

    def __init__(self, files: dict[str, PatchedFile]) -> None:
        self.files = files

    def find_spec(self, name, path=None, target=None):
        file = self.files.get(name)
        if file is None:
            return None
        locations = [str(Path(file.path).parent)] if file.is_package else None
        return importlib.util.spec_from_file_location(name, file.path, submodule_search_locations=locations)


def _strip_bodies(tree: ast.AST) -> ast.AST:
    """`tree` with every function's body (module level, in classes, at any depth) replaced by
    `...`: what is left runs at import."""

    class Stripper(ast.NodeTransformer):
        def _strip(self, node):
            node.body = [ast.Expr(ast.Constant(...))]
            return node

        visit_FunctionDef = visit_AsyncFunctionDef = _strip

    return Stripper().visit(tree)


def _names_used(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def _codes(code: types.CodeType) -> dict[str, list[types.CodeType]]:
    """Every function's code object under module code `code`, by qualified name, in source order."""
    out: dict[str, list[types.CodeType]] = {}

    def walk(parent: types.CodeType) -> None:
        for const in parent.co_consts:
            if isinstance(const, types.CodeType):
                out.setdefault(const.co_qualname, []).append(const)
                walk(const)

    walk(code)
    for codes in out.values():
        codes.sort(key=lambda c: c.co_firstlineno)
    return out


def _behaviour(code: types.CodeType) -> tuple:
    """What `code` does, its line numbers and file name left out."""
    consts = tuple(_behaviour(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_flags, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
            code.co_exceptiontable)


def _live_functions(module: types.ModuleType, filename: str) -> list[types.FunctionType]:
    """The functions of `module` reachable from its namespace whose code is from `filename`:
    its functions, its classes' methods (static, class, properties), and what decorators wrap
    (`__wrapped__`, closure cells, partials)."""
    found: list[types.FunctionType] = []
    seen: set[int] = set()

    def visit(obj: object, depth: int = 0) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if obj.__code__.co_filename == filename:
                found.append(obj)
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
        if callable(obj):
            try:
                wrapped = getattr(obj, "__wrapped__", None)
            except Exception:  # noqa: BLE001 - an object whose __getattr__ misbehaves wraps nothing of ours
                wrapped = None
            if wrapped is not None:
                visit(wrapped, depth + 1)
        if isinstance(obj, staticmethod | classmethod | types.MethodType):
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, property):
            for accessor in (obj.fget, obj.fset, obj.fdel):
                if accessor is not None:
                    visit(accessor, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
        elif isinstance(obj, type) and obj.__module__ == module.__name__:
            for value in list(vars(obj).values()):
                visit(value, depth + 1)
        elif isinstance(obj, dict | list | tuple) and depth == 0:
            for value in list(obj.values() if isinstance(obj, dict) else obj):
                visit(value, depth + 1)

    for value in list(vars(module).values()):
        visit(value)
    return found


def _swap_in_place(module: types.ModuleType, file: PatchedFile) -> int:
    """Give `module`'s live functions the patched file's code; how many changed behaviour."""
    original = getattr(module, "__file__", None)
    if not original or not original.endswith(".py") or not os.path.isfile(original):
        raise HotPatchRefused(f"{file.module}: imported from {original!r}, not a .py file")
    old_text = Path(original).read_text(encoding="utf-8")
    new_text = Path(file.path).read_text(encoding="utf-8")
    try:
        old_tree, new_tree = ast.parse(old_text), ast.parse(new_text)
    except SyntaxError as exc:
        raise HotPatchRefused(f"{file.path}: {exc}") from None
    old_codes = _codes(compile(old_tree, original, "exec"))
    new_codes = _codes(compile(new_tree, file.path, "exec"))
    # Class bodies run at import (the skeleton check covers them): only functions count.
    changed = {(name, i) for name, codes in old_codes.items() for i, code in enumerate(codes)
               if code.co_flags & inspect.CO_OPTIMIZED
               and (name not in new_codes or len(new_codes[name]) != len(codes)
                    or _behaviour(code) != _behaviour(new_codes[name][i]))}
    old_skeleton, new_skeleton = _strip_bodies(old_tree), _strip_bodies(new_tree)
    if ast.dump(old_skeleton) != ast.dump(new_skeleton):
        raise HotPatchRefused(f"{file.module}: the patch changes more than function bodies (what runs at import)")
    at_import = _names_used(new_skeleton) & {name.rsplit(".", 1)[-1] for name, _ in changed}
    if at_import:
        raise HotPatchRefused(f"{file.module}: a changed function ({', '.join(sorted(at_import))}) is named where "
                              "the module runs at import")
    where = {(code.co_qualname, code.co_firstlineno): i for codes in old_codes.values() for i, code in enumerate(codes)}
    swapped: set[tuple[str, int]] = set()
    for function in _live_functions(module, original):
        code = function.__code__
        index = where.get((code.co_qualname, code.co_firstlineno))
        if index is None:
            raise HotPatchRefused(f"{file.module}: {code.co_qualname} (line {code.co_firstlineno}) is not in "
                                  f"{original} as it is now")
        new = new_codes[code.co_qualname][index]
        if new == code:
            continue
        try:
            function.__code__ = new
        except ValueError as exc:  # its closure no longer fits
            raise HotPatchRefused(f"{file.module}: {code.co_qualname}: {exc}") from None
        swapped.add((code.co_qualname, index))
    missing = sorted(name for name, index in changed - swapped
                     if not any(name.startswith(f"{outer}.<locals>.") for outer, _ in swapped))
    if missing:
        raise HotPatchRefused(f"{file.module}: the patch changes {', '.join(missing)}, which no live function of "
                              "the module runs (a decorator that hides it?)")
    return len(changed)


def _same_source(module: types.ModuleType, file: PatchedFile) -> bool:
    original = getattr(module, "__file__", None)
    try:
        return bool(original) and Path(original).read_bytes() == Path(file.path).read_bytes()
    except OSError:
        return False


def apply(site: str | os.PathLike, package: str | None = None) -> dict[str, str]:
    """Load the mirror `site/package`'s patched files (every package's in `site` when None) into
    this process (see the module docstring); module -> what was done. HotPatchRefused if any file cannot be loaded in place:
    the process may then hold part of the patch and must not serve (a fork parent exits)."""
    plans = [(file, sys.modules.get(file.module)) for file in patched_files(site, package)]
    done: dict[str, str] = {}
    for file, module in plans:
        if module is not None and _same_source(module, file):
            continue  # a full copy's untouched file (an engine_root): nothing to load
        if module is not None:
            done[file.module] = f"in place ({_swap_in_place(module, file)} function(s) changed)"
    later = {file.module: file for file, module in plans if module is None}
    if later:
        sys.meta_path.insert(0, _MirrorFinder(later))
        done.update(dict.fromkeys(later, "from the mirror when imported"))
    return done
