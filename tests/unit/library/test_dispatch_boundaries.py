"""The dispatcher's two boundaries, on both sides (issue 34, test power): a prompt of exactly
``dense_threshold`` tokens runs sparse and one token fewer runs dense (``N < dense_threshold``
is dense, docs/dispatch.md); a call on exactly :data:`MIN_SPARSE_QUERIES` query rows runs
sparse and one row fewer runs dense. Each boundary is checked twice, independently: at the
dispatcher (which path ran, spied, and the output against the float64 definition of that path)
and in a patched model (the integration's path counts and logits), since the integration takes
the same decisions before calling the dispatcher."""

from __future__ import annotations

import pytest
import torch
from minference.reference import attention as ref

import minference.dispatch as dispatch
import minference.integration as I
from minference.dispatch import MIN_SPARSE_QUERIES, sparse_prefill
from minference.patterns import AShape
from minference.testing import assert_close_to_reference
from minference.testing.strategies import AttnShape, qkv

SINK, WINDOW = 1, 3
HQ, HKV, D = 4, 2, 16
PLAN = [AShape(sink=SINK, window=WINDOW)] * HQ


@pytest.fixture
def dense_calls(monkeypatch):
    """Every call of ``dispatch.dense_prefill`` (the dense path of ``sparse_prefill``)."""
    calls = []
    real = dispatch.dense_prefill

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "dense_prefill", spy)
    return calls


def _want(q, k, v, sparse: bool, **rows):
    """``(float64, float32)`` definitions of the path: A-shape or dense, on the query rows."""
    fn, args = (ref.ashape_attention, (SINK, WINDOW)) if sparse else (ref.dense_attention, ())
    if q.shape[2] == k.shape[2] and not rows:
        return fn(q, k, v, *args), fn(q, k, v, *args, compute_dtype=torch.float32)
    return (ref.query_rows_attention(fn, q, k, v, *args, **rows)[0],
            ref.query_rows_attention(fn, q, k, v, *args, **rows, compute_dtype=torch.float32)[0])


def _check_path(out, q, k, v, *, sparse: bool, **rows) -> None:
    r64, r32 = _want(q, k, v, sparse, **rows)
    other, _ = _want(q, k, v, not sparse, **rows)
    assert (r64 - other).abs().max() > 1e-2, "the two paths must differ for the test to tell them apart"
    assert_close_to_reference(out, r64, r32, name="sparse path" if sparse else "dense path")


@pytest.mark.parametrize("N", [63, 64, 65])
def test_a_prompt_at_the_dense_threshold_runs_sparse_and_one_token_less_runs_dense(N, dense_calls):
    threshold = 64
    q, k, v = qkv(AttnShape(B=1, Hq=HQ, Hkv=HKV, N=N, D=D), torch.float32, "cpu", seed=N)
    out = sparse_prefill(q, k, v, PLAN, dense_threshold=threshold, backend="torch")
    sparse = N >= threshold
    assert (len(dense_calls) == 0) == sparse, (N, dense_calls)
    _check_path(out, q, k, v, sparse=sparse)


@pytest.mark.parametrize("N", [40, 41])
def test_the_default_threshold_has_the_same_boundary(N, dense_calls, monkeypatch):
    monkeypatch.setattr(dispatch, "DENSE_THRESHOLD", 41)
    q, k, v = qkv(AttnShape(B=1, Hq=HQ, Hkv=HKV, N=N, D=D), torch.float32, "cpu", seed=N)
    out = sparse_prefill(q, k, v, PLAN, backend="torch")
    assert (len(dense_calls) == 0) == (N >= 41)
    _check_path(out, q, k, v, sparse=N >= 41)


#: Key rows of the query-row calls: a cache of a few tokens before the chunk.
CACHED = 40


@pytest.mark.parametrize("rows", [MIN_SPARSE_QUERIES - 1, MIN_SPARSE_QUERIES])
@pytest.mark.parametrize("form", ["chunk", "int q_seqlens"])
def test_min_sparse_queries_runs_sparse_and_one_row_less_runs_dense(rows, form, dense_calls):
    """A chunk of ``rows`` queries after a cache (``q`` shorter than ``k``), or the last ``rows``
    tokens of a row in place (``q_seqlens=rows``): sparse from :data:`MIN_SPARSE_QUERIES` rows
    on, dense below, with any positive ``dense_threshold`` the key length reaches."""
    assert MIN_SPARSE_QUERIES == 1024  # the documented value (docs/dispatch.md, integration.py)
    N = rows + CACHED
    q, k, v = qkv(AttnShape(B=1, Hq=HQ, Hkv=HKV, N=N, D=D), torch.float32, "cpu", seed=rows)
    if form == "chunk":
        q_in, kw = q[:, :, -rows:], {}
    else:
        q_in, kw = q, dict(q_seqlens=rows)
    out = sparse_prefill(q_in, k, v, PLAN, dense_threshold=1, backend="torch", **kw)
    sparse = rows >= MIN_SPARSE_QUERIES
    assert (len(dense_calls) == 0) == sparse, (rows, form, dense_calls)
    if form == "chunk":
        _check_path(out, q_in, k, v, sparse=sparse)
    else:  # the last `rows` rows are computed in place, the others are zeros
        _check_path(out[:, :, -rows:], q[:, :, -rows:], k, v, sparse=sparse)
        assert (out[:, :, :-rows] == 0).all()


@pytest.mark.parametrize("threshold", [MIN_SPARSE_QUERIES + CACHED, MIN_SPARSE_QUERIES + CACHED + 1])
def test_enough_query_rows_still_follow_the_key_threshold(threshold, dense_calls):
    """Query rows enough for the sparse path, keys exactly at the threshold (sparse) or one short
    of it (dense): the key threshold applies to chunks too."""
    N = MIN_SPARSE_QUERIES + CACHED
    q, k, v = qkv(AttnShape(B=1, Hq=HQ, Hkv=HKV, N=N, D=D), torch.float32, "cpu", seed=5)
    chunk = q[:, :, -MIN_SPARSE_QUERIES:]
    out = sparse_prefill(chunk, k, v, PLAN, dense_threshold=threshold, backend="torch")
    sparse = N >= threshold
    assert (len(dense_calls) == 0) == sparse
    _check_path(out, chunk, k, v, sparse=sparse)


# ---- the same boundaries in a patched model ----------------------------------------------------


def _tiny_llama():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=HQ, num_key_value_heads=HKV, pad_token_id=0, eos_token_id=1,
                        bos_token_id=1)
    return T.LlamaForCausalLM(cfg).eval()


def _config(model):
    from minference.config import PatternConfig, Provenance, model_signature

    return PatternConfig(model_signature(model), [PLAN] * 2, Provenance(package_version="test"))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=True, **kw)


@pytest.mark.parametrize("N", [31, 32])
def test_a_patched_model_at_the_dense_threshold(N):
    model = _tiny_llama()
    ids = torch.randint(2, 64, (1, N), generator=torch.Generator().manual_seed(N))
    dense = _logits(model, ids).logits
    I.patch(model, _config(model), dense_threshold=32)
    try:
        got = _logits(model, ids).logits
        counts = I.call_counts(model)
    finally:
        I.unpatch(model)
    if N >= 32:
        assert counts["sparse"] == 2 and counts["dense_short"] == 0, counts
        assert (got - dense).abs().max() > 1e-3, "the sparse plan must change the logits"
    else:
        assert counts["dense_short"] == 2 and counts["sparse"] == 0, counts
        assert torch.equal(got, dense)


@pytest.mark.parametrize("rows", [MIN_SPARSE_QUERIES - 1, MIN_SPARSE_QUERIES])
def test_a_patched_model_continues_sparse_from_min_sparse_queries(rows):
    """A cached prefix, then a chunk of ``rows`` tokens: ``sparse_continue`` from
    :data:`MIN_SPARSE_QUERIES` rows on, ``dense_continue`` below (dense_threshold 1: the key
    length is no obstacle, and the chunk minimum is not lifted as it is by 0)."""
    from minference.app.models import cache_keyword, output_cache

    model = _tiny_llama()
    ids = torch.randint(2, 64, (1, CACHED + rows), generator=torch.Generator().manual_seed(rows))
    I.patch(model, _config(model), dense_threshold=1)
    try:
        first = _logits(model, ids[:, :CACHED])
        I.reset_counts(model)
        _logits(model, ids[:, CACHED:], **{cache_keyword(model): output_cache(first)})
        counts = I.call_counts(model)
    finally:
        I.unpatch(model)
    if rows >= MIN_SPARSE_QUERIES:
        assert counts["sparse_continue"] == 2 and counts["dense_continue"] == 0, counts
    else:
        assert counts["dense_continue"] == 2 and counts["sparse_continue"] == 0, counts
