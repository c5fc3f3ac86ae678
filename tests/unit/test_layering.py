"""The library never imports the application, and its modules import without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def test_distributed_does_not_import_integration():
    # the layering is dispatch <- distributed <- integration: no import circle between the two
    assert not any(n.startswith("minference.integration") for n in _imports(ROOT / "minference" / "distributed.py"))


def test_the_library_imports_without_the_application():
    modules = ["minference.distributed", "minference.integration", "minference.dispatch", "minference.index",
               "minference.config", "minference.torch_backend", "minference.testing", "minference.kernels"]
    code = ("import importlib, sys\nfor m in %r:\n    importlib.import_module(m)\n"
            "assert not [m for m in sys.modules if m.startswith('minference.app')], 'library pulled in the app'\n")
    subprocess.run([sys.executable, "-c", code % (modules,)], check=True, cwd=ROOT)
