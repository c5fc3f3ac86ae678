"""minference.patch / unpatch on random-weight tiny Llama, Qwen2, Phi-3 and GLM-4 models.

The sparse path is compared with an independent reference attention function registered in
this file: the fp64 masked attention of :mod:`minference.reference` with each head's A-shape
mask (A-shape sets are static, so the expected mask is known without the online index
builders), dense SDPA elsewhere. Vertical-slash and block-sparse plans are checked for routing
(calls, finite outputs, full KV cache); their index builders are tested in the kernel tiers.
"""

from __future__ import annotations

import pytest
import torch
from minference.reference.attention import ashape_attention as ref_ashape
from minference.reference.attention import masked_attention, query_rows_attention
from minference.reference.masks import ashape_mask

import minference.integration as I
from minference.app.models import cache_keyword, output_cache
from minference.config import ConfigMismatchError, PatternConfig, Provenance, model_signature
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

VOCAB, HIDDEN, HEADS, KV, LAYERS, HEAD_DIM = 64, 64, 4, 2, 2, 16
N = 48
ARCHS = ["llama", "qwen2", "phi3", "glm4"]
# fp32 model, fp64 reference attention: logits agree to well within this (measured ~1e-6).
LOGIT_ATOL = 1e-4


def tiny_model(arch: str, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    cfg, cls = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM),
        "glm4": (T.Glm4Config, T.Glm4ForCausalLM),
    }[arch]
    extra = {"head_dim": HEAD_DIM} if arch == "glm4" else {}
    return cls(cfg(**kw, **extra)).eval()


def ashape_config(model, windows=None, sinks=None, layers=LAYERS) -> PatternConfig:
    windows = windows or [[3 + 5 * h + 2 * l for h in range(HEADS)] for l in range(layers)]
    sinks = sinks or [[h % 3 for h in range(HEADS)] for _ in range(layers)]
    plan = [[AShape(sink=sinks[l][h], window=windows[l][h]) for h in range(HEADS)] for l in range(layers)]
    return PatternConfig(model_signature(model), plan, Provenance(package_version="test"))


# ---- the independent reference -------------------------------------------------------------

REF = {"config": None, "layers": set(), "rows": None}


def _ref_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    L, S = query.shape[2], key.shape[2]
    if L == 1 or module.layer_idx not in REF["layers"]:
        return I._sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    plan = REF["config"].plan(module.layer_idx)
    if L != S:  # a chunk after its cache: the last L rows of the whole prompt's A-shape attention
        sinks, windows = (torch.tensor([getattr(p, a) for p in plan[: query.shape[1]]]) for a in ("sink", "window"))
        out, _ = query_rows_attention(ref_ashape, query, key, value, sinks, windows, scale=scaling)
        return out.to(query.dtype).transpose(1, 2), None
    masks = torch.stack([ashape_mask(L, p.sink, p.window) for p in plan[: query.shape[1]]])[None]
    seqlens, seqstarts = REF["rows"] or (None, None)
    out, _ = masked_attention(query, key, value, masks, scale=scaling, seqlens=seqlens, seqstarts=seqstarts)
    return out.to(query.dtype).transpose(1, 2), None


def reference_logits(model, config, ids, *, layers=None, rows=None, **kw):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("h4_reference", _ref_attention)
    AttentionMaskInterface.register("h4_reference", sdpa_mask)
    REF.update(config=config, layers=set(range(LAYERS) if layers is None else layers), rows=rows)
    model.set_attn_implementation("h4_reference")
    try:
        with torch.no_grad():
            return model(ids, **kw).logits
    finally:
        model.set_attn_implementation("sdpa")


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


# ---- tests ----------------------------------------------------------------------------------


def test_ashape_plan_matches_reference(arch):
    model = tiny_model(arch)
    ids = torch.randint(2, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
    cfg = ashape_config(model)
    dense = logits(model, ids)
    want = reference_logits(model, cfg, ids)
    I.patch(model, cfg, dense_threshold=0)
    got = logits(model, ids)
    assert I.call_counts(model)["sparse"] == LAYERS
    I.unpatch(model)
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    assert (got - dense).abs().max() > 100 * LOGIT_ATOL  # the plan is really sparse


def test_unpatch_restores_the_dense_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(2))
    before = logits(model, ids)
    I.patch(model, ashape_config(model), dense_threshold=0)
    assert I.is_patched(model) and model.config._attn_implementation == I.ATTN_IMPLEMENTATION
    I.unpatch(model)
    assert not I.is_patched(model)
    assert not any(hasattr(m, I.STATE_ATTR) for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


def _one_sparse_layer_matches_reference(model, cfg, ids, *, layer: int) -> None:
    """Patch only ``layer`` of the two: it runs sparse, the other dense, and the logits match the
    reference with that layer swapped in."""
    want = reference_logits(model, cfg, ids, layers=[layer])
    I.patch(model, cfg, layers=[layer], dense_threshold=0)
    got = logits(model, ids)
    counts = I.call_counts(model)
    I.unpatch(model)
    assert counts["sparse"] == 1 and counts["dense_layer"] == 1
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


def test_progressive_swap_in_leaves_other_layers_dense():
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(3))
    _one_sparse_layer_matches_reference(model, ashape_config(model), ids, layer=1)


def test_short_prompts_run_dense_bit_for_bit():
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(4))
    dense = logits(model, ids)
    I.patch(model, ashape_config(model), dense_threshold=N + 1)
    got = logits(model, ids)
    assert I.call_counts(model)["dense_short"] == LAYERS and I.call_counts(model)["sparse"] == 0
    I.unpatch(model)
    assert torch.equal(got, dense)


def test_all_dense_plan_never_calls_the_dispatcher():
    model = tiny_model("llama")
    plan = [[Dense()] * HEADS] * LAYERS
    I.patch(model, PatternConfig(model_signature(model), plan), dense_threshold=0)
    ids = torch.randint(2, VOCAB, (1, N))
    logits(model, ids)
    assert I.call_counts(model)["dense_layer"] == LAYERS
    I.unpatch(model)


def test_decode_is_dense_and_the_cache_is_full(arch):
    model = tiny_model(arch)
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        dense_cache = output_cache(model(ids, use_cache=True))
    cfg = ashape_config(model)
    I.patch(model, cfg, dense_threshold=0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = output_cache(out)
        step = out.logits[:, -1:].argmax(-1)
        nxt = model(step, **{cache_keyword(model): cache}, use_cache=True)
    counts = I.call_counts(model)
    I.unpatch(model)
    assert counts["sparse"] == LAYERS and counts["dense_decode"] == LAYERS
    assert torch.isfinite(nxt.logits).all()
    # every token is in the cache; layer 0 keys/values are projected before any sparse attention
    # ran, so they equal dense prefill's exactly
    for layer in range(LAYERS):
        assert cache.layers[layer].keys.shape[-2] == N + 1
    assert torch.equal(cache.layers[0].keys[..., :N, :], dense_cache.layers[0].keys)
    assert torch.equal(cache.layers[0].values[..., :N, :], dense_cache.layers[0].values)


def test_dense_equivalent_plan_reproduces_dense_prefill_and_cache():
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        dense = model(ids, use_cache=True)
    wide = ashape_config(model, windows=[[N] * HEADS] * LAYERS, sinks=[[0] * HEADS] * LAYERS)
    I.patch(model, wide, dense_threshold=0)
    with torch.no_grad():
        sparse = model(ids, use_cache=True)
    assert I.call_counts(model)["sparse"] == LAYERS
    I.unpatch(model)
    torch.testing.assert_close(sparse.logits, dense.logits, atol=LOGIT_ATOL, rtol=0)
    for a, b in zip(output_cache(sparse).layers, output_cache(dense).layers):
        torch.testing.assert_close(a.keys, b.keys, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=LOGIT_ATOL, rtol=0)


def _observed_and_attended(model, ids, observing):
    """Per layer, the ``(query, key, value, seqlens, seqstarts)`` an observer saw (installed by the
    context ``observing(observer)``) and the attention output ``o_proj`` then read ``[1, N, Hq * D]``."""
    seen, attended = {}, {}

    def observer(layer, query, key, value, seqlens, seqstarts):
        seen[layer] = (query.clone(), key.clone(), value.clone(), seqlens, seqstarts)

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args, i=i: attended.__setitem__(i, args[0].clone())) for i, layer in enumerate(model.model.layers)]
    try:
        with observing(observer):
            logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return seen, attended


def _check_observed_values(model, seen, attended):
    """The observed ``q, k, v`` give the layer's (dense-equivalent) attention output: ``value`` is the
    layer's own ``[1, Hkv, N, D]``, next to ``key``."""
    assert sorted(seen) == list(range(LAYERS))
    for layer, (q, k, v, seqlens, seqstarts) in seen.items():
        assert q.shape == (1, HEADS, N, HEAD_DIM) and k.shape == v.shape == (1, KV, N, HEAD_DIM)
        assert seqlens is None and seqstarts is None
        scale = model.model.layers[layer].self_attn.scaling
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out.transpose(1, 2).reshape(1, N, -1), attended[layer], atol=1e-5, rtol=0)


def test_observe_attention_hands_the_observer_queries_keys_and_values():
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(12))
    seen, attended = _observed_and_attended(model, ids, lambda observer: I.observe_attention(model, observer))
    _check_observed_values(model, seen, attended)


def test_the_sparse_path_observer_sees_queries_keys_and_values():
    from contextlib import contextmanager

    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(13))
    wide = ashape_config(model, windows=[[N] * HEADS] * LAYERS, sinks=[[0] * HEADS] * LAYERS)  # dense-equivalent
    I.patch(model, wide, dense_threshold=0)

    @contextmanager
    def on_the_sparse_path(observer):
        states = I.layer_states(model).values()
        for state in states:
            state.observer = observer
        try:
            yield
        finally:
            for state in states:
                state.observer = None

    try:
        seen, attended = _observed_and_attended(model, ids, on_the_sparse_path)
        assert I.call_counts(model)["sparse"] == LAYERS
    finally:
        I.unpatch(model)
    _check_observed_values(model, seen, attended)


def test_chunked_prefill_continues_sparse():
    """A prompt fed in two chunks through the cache: the second chunk runs sparse on query rows,
    equals the reference's rows of the whole prompt, and (A-shape has no online index) the
    one-shot sparse prefill's logits at those positions."""
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(7))
    cfg = ashape_config(model)
    first, second = ids[:, : N // 2], ids[:, N // 2 :]

    def chunked(run):
        with torch.no_grad():
            out = run(first)
            return run(second, **{cache_keyword(model): output_cache(out)}).logits

    want = chunked(lambda x, **kw: _ref_run(model, cfg, x, **kw))
    I.patch(model, cfg, dense_threshold=0)
    got = chunked(lambda x, **kw: model(x, use_cache=True, **kw))
    counts = I.call_counts(model)
    one_shot = logits(model, ids)
    I.unpatch(model)
    assert counts["sparse"] == LAYERS and counts["sparse_continue"] == LAYERS
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(got, one_shot[:, N // 2 :], atol=LOGIT_ATOL, rtol=0)
    dense = logits(model, ids)[:, N // 2 :]
    assert (got - dense).abs().max() > 100 * LOGIT_ATOL, "the plan must differ from dense for the test to see it"


def test_chunked_prefill_runs_the_dense_tail_on_the_last_chunk_only():
    """``forward_chunks`` on a model patched with a dense tail: the last chunk's logits equal the
    one-shot prefill's (A-shape: no online index), so the earlier chunk ran no tail (a tail at its
    end would change those rows' keys and values in the later layers); ``prompt_continues``
    restores every layer's tail on exit, after an error too."""
    from minference.app.models import forward_chunks

    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(9))
    I.patch(model, ashape_config(model), dense_threshold=0, dense_tail=5)
    try:
        one_shot = logits(model, ids)[:, N // 2 :]
        with torch.no_grad():
            got = forward_chunks(model, ids, N // 2).logits
        assert I.call_counts(model)["sparse_continue"] == LAYERS
        with pytest.raises(RuntimeError, match="inside"), I.prompt_continues(model):
            assert {st.dense_tail for st in I.layer_states(model).values()} == {0}
            raise RuntimeError("inside")
        assert {st.dense_tail for st in I.layer_states(model).values()} == {5}
    finally:
        I.unpatch(model)
    torch.testing.assert_close(got, one_shot, atol=LOGIT_ATOL, rtol=0)
    with torch.no_grad():
        I.patch(model, ashape_config(model), dense_threshold=0, dense_tail=5)
        first = model(ids[:, : N // 2], use_cache=True)  # a tail at the first chunk's end
        tailed = model(ids[:, N // 2 :], use_cache=True, **{cache_keyword(model): output_cache(first)}).logits
        I.unpatch(model)
    assert (tailed - one_shot).abs().max() > 100 * LOGIT_ATOL, "a tail on the first chunk must show"


@pytest.mark.parametrize("padded", [False, True])
def test_short_chunk_after_a_cache_runs_the_dense_kernel_on_query_rows(padded: bool):
    """A chunk under the dense threshold after a cache (``dense_continue``): on the Triton backend
    (here the interpreter, on CPU tensors: not a GPU-tier test) it runs our dense kernel on its
    query rows with no mask, on the torch backend transformers' SDPA; both give the unpatched
    model's logits (left padding included)."""
    from unittest import mock

    model = tiny_model("qwen2")
    ids = torch.randint(2, VOCAB, (2, N), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, N, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    half = N // 2

    def chunked():
        with torch.no_grad():
            first = model(ids[:, :half], attention_mask=mask[:, :half], use_cache=True)
            return model(ids[:, half:], attention_mask=mask, use_cache=True,
                         **{cache_keyword(model): output_cache(first)}).logits

    want = chunked()
    for backend, kernel_calls in (("triton", LAYERS), ("torch", 0)):
        I.patch(model, ashape_config(model), dense_threshold=4 * N, backend=backend)
        try:
            with mock.patch.object(I, "_dense_rows", wraps=I._dense_rows) as spy:
                got = chunked()
            counts = I.call_counts(model)
        finally:
            I.unpatch(model)
        assert counts["dense_continue"] == LAYERS and counts["dense_short"] == LAYERS, counts
        assert spy.call_count == kernel_calls, backend
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


def _ref_run(model, cfg, ids, **kw):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("h4_reference", _ref_attention)
    AttentionMaskInterface.register("h4_reference", sdpa_mask)
    REF.update(config=cfg, layers=set(range(LAYERS)), rows=None)
    model.set_attn_implementation("h4_reference")
    try:
        return model(ids, use_cache=True, **kw)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_rows_equal_their_unpadded_runs(side):
    model = tiny_model("qwen2")
    cfg = ashape_config(model)
    lens = [N, N - 13]
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(2, VOCAB, (n,), generator=g) for n in lens]
    ids = torch.zeros(2, N, dtype=torch.long)
    mask = torch.zeros(2, N, dtype=torch.long)
    pos = torch.zeros(2, N, dtype=torch.long)
    for b, r in enumerate(rows):
        s = N - len(r) if side == "left" else 0
        ids[b, s : s + len(r)] = r
        mask[b, s : s + len(r)] = 1
        pos[b, s : s + len(r)] = torch.arange(len(r))
    I.patch(model, cfg, dense_threshold=0)
    batched = logits(model, ids, attention_mask=mask, position_ids=pos)
    singles = [logits(model, r[None]) for r in rows]
    counts = I.call_counts(model)
    I.unpatch(model)
    assert counts["sparse"] == 3 * LAYERS and counts["dense_mask"] == 0
    for b, r in enumerate(rows):
        s = N - len(r) if side == "left" else 0
        torch.testing.assert_close(batched[b, s : s + len(r)], singles[b][0], atol=LOGIT_ATOL, rtol=0)


def test_dynamic_patterns_route_and_stay_finite():
    model = tiny_model("llama")
    plan = [[VerticalSlash(vertical=4, slash=8, last_q=16, sink_columns=2, local_diagonals=2),
             BlockSparse(top_k=2, block=16), AShape(sink=2, window=8), Dense()] for _ in range(LAYERS)]
    cfg = PatternConfig(model_signature(model), plan)
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(9))
    dense = logits(model, ids)
    I.patch(model, cfg, dense_threshold=0)
    got = logits(model, ids)
    assert I.call_counts(model)["sparse"] == LAYERS
    I.unpatch(model)
    assert torch.isfinite(got).all()
    assert not torch.equal(got, dense)


def test_fill_gaps_reaches_the_dispatcher(monkeypatch):
    """patch(fill_gaps=...) is what every sparse layer's dispatcher call receives; None keeps the
    dispatcher's default."""
    from minference import dispatch

    model = tiny_model("llama")
    plan = [[VerticalSlash(vertical=2, slash=6, last_q=16, sink_columns=0, local_diagonals=1)] * HEADS
            for _ in range(LAYERS)]
    cfg = PatternConfig(model_signature(model), plan)
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(4))
    seen = []
    real = dispatch.sparse_prefill

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fill_gaps", "default"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "sparse_prefill", spy)
    outs = {}
    for fill in (None, 0, 3):
        I.patch(model, cfg, dense_threshold=0, fill_gaps=fill)
        outs[fill] = logits(model, ids)
        I.unpatch(model)
    assert seen == ["default"] * LAYERS + [0] * LAYERS + [3] * LAYERS
    assert not torch.equal(outs[0], outs[None]), "the default filling changed nothing on this input"


def test_patch_checks_the_config_against_the_model(tmp_path):
    model = tiny_model("llama")
    other = tiny_model("llama", seed=1)
    cfg = ashape_config(other)
    with pytest.raises(ConfigMismatchError, match="weights_fingerprint"):
        I.patch(model, cfg)
    assert not I.is_patched(model)
    I.patch(model, cfg, allow_mismatch=True)
    I.unpatch(model)
    path = tmp_path / "cfg.json"
    cfg.save(path)
    with pytest.raises(ConfigMismatchError, match="weights_fingerprint"):
        I.patch(model, str(path))
    I.patch(other, path)
    assert I.is_patched(other)
    I.unpatch(other)
    small = PatternConfig(model_signature(tiny_model("llama")).__class__(
        model_id="x", architecture=None, num_layers=1, num_heads=HEADS), [[Dense()] * HEADS])
    with pytest.raises(ConfigMismatchError, match="num_layers"):
        I.patch(model, small, allow_mismatch=True)


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(layers=[5]), ValueError, "layers"),
        (dict(dense_threshold=-1), ValueError, "dense_threshold"),
        (dict(head_offset=-2), ValueError, "head_offset"),
        (dict(fill_gaps=-1), ValueError, "fill_gaps"),
    ],
)
def test_bad_arguments(kwargs, error, needle):
    model = tiny_model("llama")
    with pytest.raises(error, match=needle):
        I.patch(model, ashape_config(model), **kwargs)
    assert not I.is_patched(model)


def test_bad_types():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="config"):
        I.patch(model, {"layers": []})
    with pytest.raises(TypeError, match="model"):
        I.patch("model", ashape_config(model))
    with pytest.raises(ValueError, match="not patched"):
        I.unpatch(model)


def _tiny_bert(**kw):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       intermediate_size=64, **kw)
    return (T.BertLMHeadModel if kw.get("is_decoder") else T.BertModel)(cfg).eval()


def _bert_config(model):
    return PatternConfig(model_signature(model), [[AShape(sink=1, window=4)] * HEADS] * LAYERS)


def test_patch_refuses_a_bidirectional_encoder():
    """A BERT encoder's attention says is_causal=False: patch refuses it (it used to run it causal)."""
    model = _tiny_bert()
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self \(BertSelfAttention, layer 0\) "
                                         r"is not causal \(is_causal=False"):
        I.patch(model, _bert_config(model), dense_threshold=0)
    assert not I.is_patched(model) and not any(hasattr(m, I.STATE_ATTR) for m in model.modules())


def test_patch_refuses_cross_attention():
    """A decoder's causal self-attention is servable, its cross-attention is not: refused, named."""
    model = _tiny_bert(is_decoder=True, add_cross_attention=True)
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.0\.crossattention\.self \(BertCrossAttention, "
                                         r"layer 0\) is cross-attention"):
        I.patch(model, _bert_config(model), dense_threshold=0)
    assert not I.is_patched(model)


def test_a_non_causal_layer_is_refused_unless_left_dense():
    """One layer of a Llama made bidirectional: refused when chosen to run sparse; left out of
    ``layers`` it runs transformers' own (non-causal) SDPA, bit for bit."""
    model = tiny_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(10))
    cfg = ashape_config(model)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn \(LlamaAttention, layer 1\) is not causal"):
        I.patch(model, cfg, dense_threshold=0)
    assert not I.is_patched(model)
    _one_sparse_layer_matches_reference(model, cfg, ids, layer=0)


def test_a_call_that_says_not_causal_runs_dense():
    """A module turned non-causal after patching (or a call passing is_causal=False) takes the
    dense SDPA path with the module's own masking, never the causal sparse kernels."""
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, N), generator=torch.Generator().manual_seed(11))
    I.patch(model, ashape_config(model), dense_threshold=0)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    got = logits(model, ids)
    counts = I.call_counts(model)
    I.unpatch(model)
    assert counts["dense_mask"] == LAYERS and counts["sparse"] == 0
    assert torch.equal(got, logits(model, ids))  # the unpatched model, still non-causal


def test_a_head_count_other_than_patched_is_refused():
    """The sparse path checks the heads it receives against the heads patch() read, so a model
    sharded some way patch() did not see fails loudly instead of reading other heads' plans."""
    model = tiny_model("llama")
    I.patch(model, ashape_config(model), dense_threshold=0)
    for state in I.layer_states(model).values():
        state.heads = HEADS // 2
    with pytest.raises(ValueError, match="attention received 4 query heads, but patch\\(\\) read 2"):
        logits(model, torch.randint(2, VOCAB, (1, N)))
    I.unpatch(model)


def _sdpa_mask(lens, starts, n):
    pos = torch.arange(n)
    lo, hi = torch.tensor(starts), torch.tensor(starts) + torch.tensor(lens)
    valid = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
    return ((pos[None, :] <= pos[:, None])[None] & valid[:, None, :])[:, None]


@pytest.mark.parametrize("lens, starts", [([10, 7], [0, 0]), ([10, 7], [0, 3]), ([0, 10], [0, 0]), ([4, 9], [6, 1])])
def test_padding_rows_reads_contiguous_rows(lens, starts):
    rows = I.padding_rows(_sdpa_mask(lens, starts, 10), 10)
    assert rows[0].tolist() == lens
    assert [s if n else 0 for s, n in zip(rows[1].tolist(), lens)] == [s if n else 0 for s, n in zip(starts, lens)]


def test_padding_rows_refuses_other_masks():
    n = 10
    gap = _sdpa_mask([10], [0], n).clone()
    gap[..., 4] = False  # a hole inside the row
    assert I.padding_rows(gap, n) is False
    window = _sdpa_mask([10], [0], n) & (torch.arange(n)[None, :] > torch.arange(n)[:, None] - 4)
    assert I.padding_rows(window, n) is False
    assert I.padding_rows(torch.ones(1, 1, n, n, dtype=torch.bool), n) is False  # not causal
    assert I.padding_rows(None, n) is None


def _continuation_mask(S, L, own0, key_starts):
    """``[B, 1, L, S]``: query ``i`` of row ``b`` reads keys ``key_starts[b] .. own0 + i``."""
    j, i = torch.arange(S), torch.arange(L)
    lo = torch.tensor(key_starts)[:, None, None]
    return ((j[None, None] >= lo) & (j[None, None] <= (own0 + i)[None, :, None]))[:, None]


def test_query_rows_reads_chunks_after_a_cache():
    S, L = 12, 5
    assert I.query_rows(_continuation_mask(S, L, S - L, [0, 0]), L, S) is None  # plain: the kernels' defaults
    lens, starts, q_lens, q_starts = I.query_rows(_continuation_mask(S, L, S - L, [0, 3]), L, S)  # left padding
    assert lens.tolist() == [12, 9] and starts.tolist() == [0, 3] and q_lens.tolist() == [5, 5]
    assert q_starts.tolist() == [0, 0]
    lens, starts, q_lens, q_starts = I.query_rows(_continuation_mask(S, L, 4, [0]), L, S)  # a static cache filled to 4
    assert (lens.tolist(), starts.tolist(), q_lens.tolist(), q_starts.tolist()) == ([9], [0], [5], [0])
    padded = _continuation_mask(S, L, S - L, [0]).clone()
    padded[:, :, :2] = False  # the first two queries are left padding of a new turn: they read nothing
    lens, starts, q_lens, q_starts = I.query_rows(padded, L, S)
    assert (lens.tolist(), q_lens.tolist(), q_starts.tolist()) == ([12], [3], [2])


def test_query_rows_refuses_what_the_kernels_cannot_take():
    S, L = 12, 5
    assert I.query_rows(torch.ones(1, 1, L, S, dtype=torch.bool), L, S) is False  # not causal
    gap = _continuation_mask(S, L, S - L, [0]).clone()
    gap[..., 3] = False  # a hole in the row
    assert I.query_rows(gap, L, S) is False
    right = _continuation_mask(S, L, S - L - 2, [0]).clone()
    right[:, :, 3:] = right[:, :, 2:3]  # right padding after a cache: the mask alone is ambiguous
    assert I.query_rows(right, L, S) is False
    window = _continuation_mask(S, L, S - L, [0]) & (torch.arange(S)[None, :] > (S - L + torch.arange(L))[:, None] - 4)
    assert I.query_rows(window, L, S) is False


def test_cli_registers_run_search_sweep():
    import argparse

    from minference.app.main_job import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "--tokens", "2048", "--backend", "torch", "--no-progress"])
    assert (args.tokens, args.backend, args.dense_threshold, args.no_progress) == (2048, "torch", 0, True)
    args = parser.parse_args(["search", "--out", "x.json", "--target-density", "0.25"])
    assert args.out == "x.json" and args.target_density == 0.25
    args = parser.parse_args(["sweep", "--layers", "1", "5", "30"])
    assert args.layers == [1, 5, 30]
