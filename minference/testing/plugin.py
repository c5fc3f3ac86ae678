"""pytest plugin (entry point ``minference``): markers, hypothesis profiles, device fixture.

Markers: ``gpu`` (needs CUDA; skipped without it), ``triton`` (runs Triton kernels on the
``device`` fixture's device: CUDA when present, else the interpreter on CPU — the kernel tier
that runs on both), ``interpret`` (runs Triton kernels on CPU tensors under
``TRITON_INTERPRET=1``; skipped when the interpreter is off, as on a GPU runner), ``layer``
(tier 2, real model layers), ``model`` (tier 3, whole model), ``bench`` (pytest-benchmark, GPU
timings).

Hypothesis profiles: ``ci`` (bounded, CPU, 25 examples, no shrink phase: a failing example is
reported as drawn, in the seconds one interpreted example takes, instead of after minutes of
shrinking), ``ci-shrink`` (``ci`` with shrinking, to minimise a failure locally) and ``gpu`` (400
examples, shrinking on). The profile comes from ``MINFERENCE_HYPOTHESIS_PROFILE``, else ``gpu``
when CUDA is available, else ``ci``.

This plugin never imports triton: ``TRITON_INTERPRET`` must be decided (by the caller's
environment or a ``conftest.py``) before triton's first import.
"""

from __future__ import annotations

import os

import pytest

MARKERS = {
    "gpu": "needs a CUDA GPU; skipped when none is present",
    "triton": "runs Triton kernels on the device fixture's device (CUDA, else the CPU interpreter)",
    "interpret": "runs Triton kernels on CPU tensors under TRITON_INTERPRET=1; skipped when it is off",
    "layer": "tier 2: dense vs sparse on real model layers",
    "model": "tier 3: whole-model progressive swap-in",
    "bench": "pytest-benchmark timing on the GPU; skipped when none is present",
}

#: Every phase but shrinking (``explain`` needs a shrunk example, so it goes too).
NO_SHRINK = ("explicit", "reuse", "generate", "target")

PROFILES = {
    "ci": dict(max_examples=25, deadline=None, derandomize=True, print_blob=True, phases=NO_SHRINK),
    "ci-shrink": dict(max_examples=25, deadline=None, derandomize=True, print_blob=True),
    "gpu": dict(max_examples=400, deadline=None, print_blob=True),
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the plugin works without the test extra; strategies need it
        return
    from hypothesis import Phase

    # Every profile derives from hypothesis' own defaults, never from the loaded profile (the
    # implicit parent): with a ``CI`` variable set hypothesis loads its built-in ``ci`` profile,
    # registering our ``ci`` over it reloads ours, and ``ci-shrink`` would inherit its phases.
    base = settings.get_profile("default")
    for name, kwargs in PROFILES.items():
        if "phases" in kwargs:
            kwargs = dict(kwargs, phases=tuple(Phase[p] for p in kwargs["phases"]))
        settings.register_profile(
            name, parent=base, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kwargs
        )
    profile = os.environ.get("MINFERENCE_HYPOTHESIS_PROFILE") or ("gpu" if _cuda() else "ci")
    if profile not in PROFILES:
        raise pytest.UsageError(f"MINFERENCE_HYPOTHESIS_PROFILE={profile!r}; expected one of {sorted(PROFILES)}")
    settings.load_profile(profile)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interp = pytest.mark.skip(reason="CPU interpreter test; TRITON_INTERPRET is off in this run")
    cuda, interpreting = _cuda(), os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if ("gpu" in item.keywords or "bench" in item.keywords) and not cuda:
            item.add_marker(no_gpu)
        if "interpret" in item.keywords and not interpreting:
            item.add_marker(no_interp)


@pytest.fixture
def device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"`` (Triton then runs interpreted)."""
    return "cuda" if _cuda() else "cpu"
