"""The checkout's top-level ``kernels/`` and ``reference/`` folders under their own names.

Both folders are ``minference.kernels`` and ``minference.reference``: ``pyproject.toml`` maps them
into the package at install time. But Python puts the directory it starts from first on
``sys.path`` (``python -m pytest``, ``python -c``, a notebook started in the checkout), and from the
checkout root a plain ``import kernels`` would then find the folder instead of Hugging Face's
``kernels`` distribution, which transformers imports for its hub kernels
(``transformers.integrations.hub_kernels``). Each folder's ``__init__`` therefore checks the name it
was imported under: as ``minference.<folder>`` it is this project's package; under its bare name it
hands the name over to the installed distribution of that name, found on ``sys.path`` without the
checkout root, or raises ``ModuleNotFoundError`` as if the folder were not there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["hand_over"]


def hand_over(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (the folder ``init_file`` lives in, imported under its bare
    name) by the installed module of that name that the checkout root shadows.

    The import system returns whatever ``sys.modules[name]`` holds once the folder's ``__init__``
    has run, so ``import kernels`` and ``from kernels import X`` get the installed distribution.
    Raises ``ModuleNotFoundError`` when no other module of that name is on ``sys.path``.
    """
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r}: the folder {name}/ in {root} is minference.{name}; install the project "
            f"(pip install -e .) and import minference.{name}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
