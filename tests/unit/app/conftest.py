"""Fixtures shared by the application tests."""

from __future__ import annotations

import pytest

#: Layers of the truncated SmolLM2 the eval and RULER tests run (:func:`small`): every prefill of a
#: real run stays cheap on 2 cores while the bundled config still brings vertical-slash, A-shape
#: and dense heads.
SMALL_LAYERS = 2


@pytest.fixture(scope="module")
def small(smollm2_layers):
    """SmolLM2-135M truncated to :data:`SMALL_LAYERS` layers (fp32, CPU, unpatched): a deep copy
    of the session's model (``tests/conftest.py``), which stays whole."""
    return smollm2_layers(SMALL_LAYERS)
