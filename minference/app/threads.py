"""The CPU thread policy of the main job (issue 30): how many intra-op threads a CPU prefill uses.

PyTorch starts with one intra-op thread per core and runs every op as an OpenMP fork-join over
them. On a machine other jobs share, a thread that is descheduled holds up the other at every
join; the more (and the smaller) the ops, the worse: on a 2-core machine at a load of 2.4-4.2 a
user's ``minference run`` took 18.3 s dense and 98.9 s sparse with 2 threads, 13.1 and 14.3 s
with ``OMP_NUM_THREADS=1`` (docs/dispatch.md, "Portable backend on the CPU"). So the main job
chooses its thread count on purpose, once, before the model loads, the same for its dense and
its sparse run:

1. ``--threads N`` (``requested``) wins;
2. else a count the user set is kept: ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the
   environment, or ``torch.set_num_threads`` called after this module was imported (a count
   different from the one torch started with);
3. else every core this process may run on (its CPU affinity), whatever the load: measured on a
   shared 2-core machine (docs/dispatch.md, "Threads and op granularity on a shared 2-core CPU"),
   2 threads gave shorter prefills than 1 at every load seen (0.9 to 6), dense and sparse, once
   the torch backend stopped fork-joining its own small ops (the cause of the 0.18x); a first
   version of this policy took ``cores - load`` threads and made the job ~2x slower for no gain
   in the ratio. The load average is read and reported with the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["THREAD_ENV", "ThreadChoice", "usable_cores", "choose_threads", "apply_threads"]

#: Environment variables through which a user sets the intra-op threads; when one is set the
#: policy keeps torch's count.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: torch's intra-op thread count when this module was imported: a different count later means
#: the user called ``torch.set_num_threads``.
_STARTING_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` intra-op threads, and why (``reason``: ``"--threads"``, the environment
    variable, ``"torch.set_num_threads"`` or ``"policy"``), with the 1-minute load average and
    the usable cores read when choosing."""

    threads: int
    reason: str
    load: float
    cores: int

    def describe(self) -> str:
        return f"{self.threads} ({self.reason}; {self.cores} cores, load {self.load:.2f})"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count of a CPU prefill (the module docstring's rules); sets nothing."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise ValueError(f"threads must be a positive int, got {requested!r}")
    cores, load = usable_cores(), _load()
    if requested is not None:
        return ThreadChoice(requested, "--threads", load, cores)
    for name in THREAD_ENV:
        if os.environ.get(name):
            return ThreadChoice(torch.get_num_threads(), name, load, cores)
    if torch.get_num_threads() != _STARTING_THREADS:
        return ThreadChoice(torch.get_num_threads(), "torch.set_num_threads", load, cores)
    return ThreadChoice(cores, "policy", load, cores)


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op threads to ``choice.threads`` (a no-op when they are already that)."""
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
