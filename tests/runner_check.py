"""Fail fast, in one line, when a GPU runner lacks what ``tox -e kernels`` or ``tox -e bench`` needs.

The GPU environments install nothing from an index (``toxfile.py``): they run on the runner's own
packages, so a missing one is named here before the editable install or pytest starts.

    python tests/runner_check.py kernels|kernels-nightly|bench
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

# import name -> distribution to install; each environment's needs
COMMON = {"torch": "torch (a CUDA build)", "triton": "triton", "numpy": "numpy", "transformers": "transformers",
          "tqdm": "tqdm", "jsonschema": "jsonschema", "setuptools": "setuptools>=68", "pytest": "pytest",
          "hypothesis": "hypothesis"}
NEEDS = {"kernels": {**COMMON, "xdist": "pytest-xdist"},
         "kernels-nightly": {**COMMON, "xdist": "pytest-xdist"},
         "bench": {**COMMON, "pytest_benchmark": "pytest-benchmark"}}


def missing(env: str) -> list[str]:
    lacks = [dist for name, dist in NEEDS[env].items() if importlib.util.find_spec(name) is None]
    if importlib.util.find_spec("setuptools") is not None:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
        if major < 68:
            lacks.append(f"setuptools>=68 (has {major})")
    return lacks


def main(argv: list[str]) -> int:
    env = argv[1] if len(argv) > 1 else ""
    if env not in NEEDS:
        print(f"runner_check: unknown environment {env!r}; expected one of {sorted(NEEDS)}", file=sys.stderr)
        return 2
    lacks = missing(env)
    if lacks:
        print(f"tox -e {env}: the runner lacks {', '.join(lacks)}; install them into the Python that runs tox "
              f"(offline: carry wheels, docs/verification.md)", file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(f"tox -e {env}: TRITON_INTERPRET=1 is set; the GPU environments run compiled kernels", file=sys.stderr)
        return 1
    import torch

    if not torch.cuda.is_available():
        print(f"tox -e {env}: torch {torch.__version__} sees no CUDA device; the GPU environments need one",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
