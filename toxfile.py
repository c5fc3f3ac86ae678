"""tox's inline plugin: the GPU environments run on the runner's own packages.

A GPU runner already holds a CUDA build of torch, triton and the test tools, in the Python that
runs tox, and often no package index. ``system_site_packages`` cannot reach them when that Python
is itself a virtual environment (as on the H200 image, ``/opt/torch/.venv``): virtualenv bases the
new environment on the interpreter the venv came from, whose site-packages hold none of them.
An environment that sets ``runner_site_packages = true`` therefore gets a ``.pth`` file naming the
runner's package directories (its site-packages and ``PYTHONPATH``, the checkout root excluded),
written before ``commands_pre`` runs.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig

from tox.config.sets import EnvConfigSet
from tox.plugin import impl
from tox.session.state import State
from tox.tox_env.api import ToxEnv

PTH = "_minference_runner_site.pth"


def runner_package_dirs(root: str) -> list[str]:
    """Directories the Python running tox imports third-party packages from, in its order."""
    stdlib = {os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")}
    dirs = os.environ.get("PYTHONPATH", "").split(os.pathsep) + site.getsitepackages() + [site.getusersitepackages()]
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d) if d else ""
        if real and os.path.isdir(real) and real not in seen | stdlib and real != os.path.realpath(root):
            seen.add(real)
            out.append(real)
    return out


@impl
def tox_add_env_config(env_conf: EnvConfigSet, state: State) -> None:
    env_conf.add_config(
        keys=["runner_site_packages"], of_type=bool, default=False,
        desc="see the packages of the Python that runs tox (minference's toxfile.py), a virtualenv's included")


@impl
def tox_before_run_commands(tox_env: ToxEnv) -> None:
    if not tox_env.conf["runner_site_packages"]:
        return
    dirs = runner_package_dirs(str(tox_env.core["tox_root"]))
    with open(tox_env.env_site_package_dir() / PTH, "w", encoding="utf-8") as f:
        f.write("".join(d + "\n" for d in dirs))
    print(f"{tox_env.name}: runner packages from {sys.executable}: {os.pathsep.join(dirs)}")
