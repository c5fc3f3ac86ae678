"""The quality guard on SmolLM2-135M (docs/guard.md): a planted config whose A-shape window misses
the passkey that dense attention finds. Observe mode reports it (heads below the floor) and
leaves the wrong answer; enforce mode recomputes those heads densely and answers as dense does;
the bundled config, which answers right, raises no alarm at the same floor."""

from __future__ import annotations

import pytest
import torch

import minference.integration as integ
from minference.app.main_job import DEFAULT_CONFIG
from minference.app.prompts import passkey_prompt
from minference.config import GuardSettings, PatternConfig, Provenance, load_config, model_signature
from minference.guard import QualityGuard, format_summary
from minference.patterns import AShape

pytestmark = pytest.mark.model

#: Prompt length (CI budget: SmolLM2 retrieves the key at 1K; the planted window of 64 tokens
#: cannot reach the needle at depth 0.5).
TOKENS = 1024
#: The floor of this test. Measured on this prompt (torch backend, 32 checked rows per batch
#: row): the bundled config's lowest head mean mass is 0.925; under the planted config 86 heads fall
#: below 0.5, and recomputing only those (floor 0.5) still answers wrong ('1000.'), so the test
#: asks for the floor the bundled config clears.
FLOOR = 0.9


def _answer(model, ids: torch.Tensor, steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids[None], max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[0]:].tolist()


def _guarded(model, config, mode: str, ids, steps) -> tuple[list[int], QualityGuard]:
    guard = QualityGuard(GuardSettings(mode=mode, sample_rate=1.0, min_mass=FLOOR), name=mode)
    integ.patch(model, config, backend="torch", dense_threshold=0, guard=guard, check_fingerprint=False)
    try:
        guard.prompt_id = "passkey-1k"
        tokens = _answer(model, ids, steps)
    finally:
        integ.unpatch(model)
    print(format_summary(guard.summary()))
    return tokens, guard


def test_observe_reports_a_planted_miss_and_enforce_answers_as_dense(smollm2) -> None:
    model, tokenizer = smollm2
    ids, answer = passkey_prompt(tokenizer, TOKENS, key=None, depth=0.5, seed=0)
    key = tokenizer.decode(answer.tolist())
    steps = len(answer) + 1
    dense = _answer(model, ids, steps)
    assert tokenizer.decode(dense).startswith(key), "dense SmolLM2 retrieves the key at 1K"

    sig = model_signature(model, fingerprint=False)
    planted = PatternConfig(sig, [[AShape(sink=4, window=64)] * sig.num_heads for _ in range(sig.num_layers)],
                            Provenance(package_version="test"))
    observed, guard = _guarded(model, planted, "observe", ids, steps)
    assert not tokenizer.decode(observed).startswith(key), "the planted config misses the needle"
    assert guard.calls_below_floor == 1 and guard.below_floor > 0 and guard.fallbacks == 0
    assert guard.saved_prompts == ["passkey-1k"] and guard.calls == 1  # decode steps are not checked

    enforced, guard = _guarded(model, planted, "enforce", ids, steps)
    assert guard.fallbacks == guard.below_floor > 0
    assert enforced == dense, (tokenizer.decode(enforced), tokenizer.decode(dense))

    bundled, guard = _guarded(model, load_config(DEFAULT_CONFIG, model), "observe", ids, steps)
    assert guard.sampled == 1 and guard.below_floor == 0, "no alarm on an input the bundled config covers"
    assert tokenizer.decode(bundled).startswith(key)
