"""The checkout's top-level ``kernels/`` and ``reference/`` folders under their own names.

Both folders are ``minference.kernels`` and ``minference.reference``: ``pyproject.toml`` maps them
into the package at install time. But Python puts the directory it starts from first on
``sys.path`` (``python -m pytest``, ``python -c``, a notebook started in the checkout), and from the
checkout root a plain ``import kernels`` would then find the folder instead of Hugging Face's
``kernels`` distribution, which transformers imports for its hub kernels
(``transformers.integrations.hub_kernels``). Each folder's ``__init__`` therefore checks the name it
was imported under: as ``minference.<folder>`` it is this project's package; under its bare name it
hands the name over to the installed distribution of that name, found on ``sys.path`` without the
checkout root; where there is none it stays an empty namespace package (no ``__file__``, no
submodules), which transformers' availability checks (5.17 imports the module when it finds no
metadata) read as "not installed".
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["hand_over"]


def hand_over(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (the folder ``init_file`` lives in, imported under its bare
    name) by the installed module of that name that the checkout root shadows.

    The import system returns whatever ``sys.modules[name]`` holds once the folder's ``__init__``
    has run, so ``import kernels`` and ``from kernels import X`` get the installed distribution.
    Without one, the folder's module is left as an empty namespace package.
    """
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        _as_namespace(sys.modules[name], f"the folder {name}/ in {root} is minference.{name}; no other {name!r} "
                                         f"is installed")
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _as_namespace(module: types.ModuleType, why: str) -> None:
    """Leave ``module`` as an empty namespace package would be (no ``__file__``, no submodules), the
    form transformers' availability checks read as "not installed"; any attribute read says why."""

    def __getattr__(attr: str):
        raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}: {why}")

    module.__file__ = None
    module.__path__ = []
    module.__dict__["__getattr__"] = __getattr__  # PEP 562: the module-level hook
