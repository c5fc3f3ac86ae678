"""The library's layers point one way (docs/architecture.md, "Layers"): the library never imports the
application; the Triton kernels and the float64 oracle sit on the library's base modules only; the
production modules never import the oracle; and the modules import without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = [p for p in (ROOT / "minference").glob("*.py")] + list((ROOT / "minference" / "testing").glob("*.py")) \
    + list((ROOT / "kernels").glob("*.py")) + list((ROOT / "reference").glob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_library_modules_never_import_the_application():
    assert len(LIBRARY) > 10
    offenders = {p.relative_to(ROOT).as_posix(): sorted(n for n in _imports(p) if n.startswith("minference.app"))
                 for p in LIBRARY}
    assert {k: v for k, v in offenders.items() if v} == {}


def _minference_imports(path: Path) -> set[str]:
    """The ``minference`` modules (or names of a module) ``path`` imports, fully qualified, anywhere
    in the file (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "minference":  # `from minference import kernels`: the submodule
                names.update(f"minference.{a.name}" for a in node.names)
            else:
                names.add(node.module)
    return {n for n in names if n == "minference" or n.startswith("minference.")}


def _outside(path: Path, allowed: tuple[str, ...]) -> list[str]:
    return sorted(n for n in _minference_imports(path) if not any(n == a or n.startswith(a + ".") for a in allowed))


#: The library's base: definitions every layer may import (they import only each other).
BASE = ("minference._checks", "minference.patterns", "minference.index_sets")
#: What the Triton kernels may import: themselves, the base, and the builders' shared half (the
#: validation, budgets and torch selection their builders wrap), never the plan side
#: (``minference.index``), the dispatcher, the backends or anything above them.
KERNELS_MAY_IMPORT = ("minference.kernels", *BASE, "minference.builders")
#: What the float64 oracle may import: itself and the base (the set definitions it shares with
#: the library); nothing it is the oracle of.
REFERENCE_MAY_IMPORT = ("minference.reference", *BASE)


def test_base_modules_import_only_the_base():
    for name in ("_checks", "patterns", "index_sets"):
        assert _outside(ROOT / "minference" / f"{name}.py", BASE) == [], name
    assert _outside(ROOT / "minference" / "builders.py", BASE) == []


def test_kernels_import_nothing_above_them():
    files = list((ROOT / "kernels").glob("*.py"))
    assert len(files) > 5
    offenders = {p.name: _outside(p, KERNELS_MAY_IMPORT) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_oracle_imports_only_itself_and_the_base():
    files = list((ROOT / "reference").glob("*.py"))
    offenders = {p.name: _outside(p, REFERENCE_MAY_IMPORT) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_production_never_imports_the_oracle():
    # the library's production modules (minference/*.py): shared definitions live in
    # minference.index_sets; the oracle is for the tests, minference.testing and the application's
    # verification and picture commands (minference.app.cli, minference.app.plots)
    files = list((ROOT / "minference").glob("*.py"))
    offenders = {p.relative_to(ROOT).as_posix(): sorted(n for n in _minference_imports(p)
                                                        if n.startswith("minference.reference")) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_distributed_does_not_import_integration():
    # the layering is dispatch <- distributed <- integration: no import circle between the two
    assert not any(n.startswith("minference.integration") for n in _imports(ROOT / "minference" / "distributed.py"))


def test_the_library_imports_without_the_application():
    modules = ["minference.distributed", "minference.integration", "minference.dispatch", "minference.index",
               "minference.config", "minference.torch_backend", "minference.testing", "minference.kernels",
               "minference.backend", "minference.backend_triton", "minference.backend_torch", "minference.builders",
               "minference.index_sets"]
    code = ("import importlib, sys\nfor m in %r:\n    importlib.import_module(m)\n"
            "assert not [m for m in sys.modules if m.startswith('minference.app')], 'library pulled in the app'\n")
    subprocess.run([sys.executable, "-c", code % (modules,)], check=True, cwd=ROOT)
