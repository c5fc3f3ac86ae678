"""Tier 3: progressive swap-in — sparse prefill in layers 0..k-1, greedy decoding vs dense.

Tiny random-weight Llama / Qwen2 / Phi-3 / GLM-4 models check the mechanics (a plan that keeps
every key reproduces dense decoding at every step; each step runs exactly ``k`` sparse layers);
SmolLM2-135M with the bundled config checks the product claim on a ~2K-token passkey prompt
in a few swap-in steps (the full sweep is ``minference sweep``). The report of first divergence
and its logit margins is printed (``pytest -s``) whether or not a step diverges.
"""

from __future__ import annotations

import pytest
import torch

from minference.app.main_job import EXTRA_DECODE_TOKENS, format_sweep, swap_in_sweep
from minference.config import PatternConfig, model_signature
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

pytestmark = pytest.mark.model

TINY_N, TINY_STEPS = 64, 4
#: Prompt length and swap-in steps of the SmolLM2 test (CI budget; the full sweep is the CLI's).
SMOLLM2_TOKENS = 2048
SMOLLM2_LAYER_COUNTS = (1, 15, 30)


def tiny_model(arch: str):
    import transformers as T

    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    cfg, cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                "phi3": (T.Phi3Config, T.Phi3ForCausalLM), "glm4": (T.Glm4Config, T.Glm4ForCausalLM)}[arch]
    extra = {"head_dim": 16} if arch == "glm4" else {}
    return cls(cfg(**kw, **extra)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "glm4"])
def test_tiny_keep_everything_plan_never_diverges(arch):
    model = tiny_model(arch)
    keep_all = AShape(sink=0, window=TINY_N)
    cfg = PatternConfig(model_signature(model), [[keep_all] * 4] * 3)
    ids = torch.randint(2, 64, (TINY_N,), generator=torch.Generator().manual_seed(0))
    dense, steps = swap_in_sweep(model, cfg, ids, steps=TINY_STEPS, dense_threshold=0)
    print(format_sweep(dense, steps))
    assert [s.layers for s in steps] == [1, 2, 3]
    assert [s.sparse_calls for s in steps] == [1, 2, 3]
    assert all(s.first_diff is None for s in steps), format_sweep(dense, steps)


@pytest.mark.parametrize("arch", ["llama", "glm4"])
def test_tiny_sparse_plan_sweep_reports_divergence(arch):
    model = tiny_model(arch)
    row = [AShape(sink=1, window=4), VerticalSlash(vertical=2, slash=4, last_q=8, sink_columns=1, local_diagonals=1),
           BlockSparse(top_k=1, block=16, sink_blocks=0), Dense()]
    cfg = PatternConfig(model_signature(model), [row] * 3)
    ids = torch.randint(2, 64, (TINY_N,), generator=torch.Generator().manual_seed(1))
    dense, steps = swap_in_sweep(model, cfg, ids, steps=TINY_STEPS, layer_counts=[0, 3], dense_threshold=0)
    print(format_sweep(dense, steps))
    assert steps[0].first_diff is None and steps[0].tokens == dense and steps[0].sparse_calls == 0
    assert steps[1].sparse_calls == 3
    for s in steps:
        if s.first_diff is not None:
            assert s.tokens[: s.first_diff] == dense[: s.first_diff] and s.tokens[s.first_diff] != dense[s.first_diff]
            assert s.sparse_margin > 0 and s.dense_margin >= 0


def test_smollm2_progressive_swap_in_keeps_the_passkey(smollm2):
    from minference.app.main_job import DEFAULT_CONFIG
    from minference.app.prompts import passkey_prompt
    from minference.config import load_config

    model, tokenizer = smollm2
    config = load_config(DEFAULT_CONFIG, model)
    ids, answer = passkey_prompt(tokenizer, SMOLLM2_TOKENS, key=None, depth=0.5, seed=0)
    dense, steps = swap_in_sweep(model, config, ids, steps=len(answer) + EXTRA_DECODE_TOKENS,
                                 layer_counts=list(SMOLLM2_LAYER_COUNTS), dense_threshold=0)
    report = format_sweep(dense, steps, tokenizer)
    print(f"expected key {tokenizer.decode(answer.tolist())!r}\n{report}")
    key = answer.tolist()
    assert dense[: len(key)] == key, "dense SmolLM2 should retrieve the key at 2K (test setup)"
    assert [s.sparse_calls for s in steps] == list(SMOLLM2_LAYER_COUNTS)
    for s in steps:
        assert s.tokens[: len(key)] == key, f"{s.layers} sparse layers lost the key\n{report}"
