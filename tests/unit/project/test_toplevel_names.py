"""The checkout's top-level ``kernels/`` and ``reference/`` folders never shadow an installed package.

Run from the checkout root (``python -m pytest``, ``python -c``: the root first on ``sys.path``),
transformers' ``import kernels`` must reach Hugging Face's distribution, and a patched model must
still run. See ``minference/_toplevel.py``.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _from_root(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` started in the checkout root, as the README's commands start."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_transformers_hub_kernels_and_model_modules_import_from_the_checkout_root():
    run = _from_root(
        "import sys, os\n"
        "assert os.path.realpath(sys.path[0] or os.getcwd()) == os.getcwd(), sys.path[0]\n"
        "import transformers.integrations.hub_kernels\n"
        "from transformers.models.llama import modeling_llama\n"
        "from transformers.models.qwen2 import modeling_qwen2\n"
        "import minference.kernels, minference.reference\n"
        "print(minference.kernels.__file__)\n")
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.split()[-1]) == ROOT / "kernels" / "__init__.py"


@pytest.mark.parametrize("name", ["kernels", "reference"])
def test_a_bare_import_reaches_the_installed_distribution_or_an_empty_namespace(name):
    run = _from_root(
        f"import os\n"
        f"import {name}\n"
        f"if {name}.__file__ is None:\n"
        f"    try:\n"
        f"        {name}.anything\n"
        f"    except AttributeError as e:\n"
        f"        print('namespace', e)\n"
        f"else:\n"
        f"    print('found', os.path.realpath({name}.__file__))\n")
    assert run.returncode == 0, run.stderr[-3000:]
    verdict, rest = run.stdout.strip().split(" ", 1)
    if _installed(name):
        assert verdict == "found" and not Path(rest).is_relative_to(ROOT), run.stdout
    else:
        assert verdict == "namespace" and f"minference.{name}" in rest, run.stdout


def test_transformers_availability_check_reads_a_shadowed_name_as_not_installed():
    """transformers 5.17 imports a module it finds without metadata and calls it installed unless it
    has neither ``__version__`` nor ``__file__``: the folder must not pass for Hugging Face's package."""
    run = _from_root(
        "import importlib, importlib.metadata, importlib.util\n"
        "for name in ('kernels', 'reference'):\n"
        "    try:\n"
        "        importlib.metadata.version(name)\n"
        "        continue\n"
        "    except importlib.metadata.PackageNotFoundError:\n"
        "        pass\n"
        "    assert importlib.util.find_spec(name) is not None\n"
        "    module = importlib.import_module(name)\n"
        "    installed = getattr(module, '__version__', 'N/A') != 'N/A' or getattr(module, '__file__', None)\n"
        "    assert not installed, (name, module)\n"
        "    print('not installed', name)\n")
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_patched_llama_and_qwen2_run_from_the_checkout_root():
    """The integration tests' reference check, collected by pytest started in the checkout root."""
    run = _from_root(
        "import sys, pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/unit/library/test_integration.py', '-k',\n"
        "                      'ashape_plan_matches_reference and (llama or qwen2)']))\n")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
