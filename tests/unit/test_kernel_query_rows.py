"""The three kernels on query rows that are part of the key rows (a chunk after a cache, a row's
last tokens in place; docs/kernels.md) against the definition,
:func:`minference.reference.attention.query_rows_attention` over each kernel's float64 twin:
the tolerance rule on every query row of a computed head, float32 softmax statistics, every other
output row left as it was (poisoned), and NaN in every q, k, v token no query row may read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.reference.attention import merge_attention, query_rows_attention
from test_kernel_common import COMBOS, DEVICE, MAX_N, SEED, problem, torch_converter

from minference import kernels
from minference import reference as ref
from minference._checks import token_mask
from minference.testing import assert_close_to_reference, assert_not_written, assert_stats_close, poison
from minference.testing.strategies import (
    ashape_budgets,
    block_sparse_indices,
    query_rows,
    vertical_slash_indices,
)

pytestmark = pytest.mark.triton


def _query_problem(data, combo, max_n: int = MAX_N):
    """A kernel problem (keys, values, ragged rows, heads) plus query rows and their q."""
    p = problem(data, max_n=max_n, combo=combo)
    s = p["shape"]
    Nq, q_seqlens, q_seqstarts, q_lens, q_starts = data.draw(query_rows(s.B, s.N, p["seqlens"], p["seqstarts"]),
                                                             label="query rows")
    g = torch.Generator().manual_seed(data.draw(SEED, label="q seed"))
    q = torch.randn(s.B, s.Hq, Nq, s.D, generator=g, dtype=torch.float64).to(p["dtype"]).to(DEVICE)
    return dict(p, q=q, Nq=Nq, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, q_lens=torch.tensor(q_lens),
                q_starts=torch.tensor(q_starts))


def _run(p, kernel, twin, *args, **kwargs):
    s, dtype = p["shape"], p["dtype"]
    q, k, v = p["q"], p["k"], p["v"]
    rows = dict(seqlens=p["seqlens"], seqstarts=p["seqstarts"], q_seqlens=p["q_seqlens"], q_seqstarts=p["q_seqstarts"])
    dev = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in rows.items()}
    # every token no query row may read is NaN: q outside the query rows, k and v outside the rows
    q_rows = token_mask(p["q_lens"], p["q_starts"], s.B, p["Nq"], "cpu")  # [B, Nq]
    k_rows = token_mask(p["seqlens"], p["seqstarts"], s.B, s.N, "cpu")
    q.masked_fill_(~q_rows[:, None, :, None].to(q.device), float("nan"))
    for x in (k, v):
        x.masked_fill_(~k_rows[:, None, :, None].to(x.device), float("nan"))
    out = poison(torch.empty(s.B, s.Hq, p["Nq"], s.D, dtype=dtype, device=DEVICE))
    dev_args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    heads = None if p["heads"] is None else p["heads"].to(DEVICE)
    res, lse = kernel(q, k, v, *dev_args, heads=heads, out=out, return_lse=True, **dev, **kwargs)
    assert res.data_ptr() == out.data_ptr() and res.shape == q.shape and lse.shape == q.shape[:3]
    cpu = [x.cpu() for x in (q, k, v)]
    ref64, lse64 = query_rows_attention(twin, *cpu, *args, heads=p["heads"], **rows, **kwargs)
    ref_t, lse_t = query_rows_attention(twin, *cpu, *args, heads=p["heads"], **rows, **kwargs, compute_dtype=dtype)
    head = torch.zeros(s.Hq, dtype=torch.bool)
    head[p["heads"].long() if p["heads"] is not None else slice(None)] = True
    region = q_rows[:, None, :] & head[None, :, None]  # [B, Hq, Nq]
    assert_close_to_reference(res, ref64, ref_t, where=region[..., None], name="out")
    assert_not_written(res.cpu(), ~region[..., None], name="out")
    assert_stats_close(lse, lse64, where=region, name="lse")
    assert torch.isneginf(lse.cpu()[~region]).all(), "lse outside the query rows must read as empty rows"


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_ashape_query_rows(data, combo):
    p = _query_problem(data, combo)
    sink, window = data.draw(ashape_budgets(p["shape"].Hq, max_n=p["shape"].N + 4), label="budgets")
    _run(p, kernels.ashape_attention, ref.ashape_attention, sink, window)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_vertical_slash_query_rows(data, combo):
    p = _query_problem(data, combo)
    s = p["shape"]
    vertical, slash = data.draw(vertical_slash_indices(s.B, p["Hg"], s.N), label="index")
    fill = data.draw(st.sampled_from((0, 383)), label="fill_gaps")
    # the conversion does not see the query rows (vertical, slash, N): the whole-row kernel tests
    # run the Triton converter on this distribution of indices, so the interpreter takes its
    # torch twin here (the same index, field by field) and the query-row kernel is the subject
    with torch_converter():
        _run(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash, fill_gaps=fill)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_block_sparse_query_rows(data, combo):
    p = _query_problem(data, combo)
    s = p["shape"]
    block = data.draw(st.sampled_from((16, 32) if DEVICE == "cpu" else (32, 64, 128)), label="block")
    blocks = data.draw(block_sparse_indices(s.B, p["Hg"], s.N, block), label="blocks")
    _run(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)


def test_two_halves_of_a_chunk_merge_into_one_call():
    """A chunk's attention over the cached prefix's key blocks and over its own, merged from the
    two calls' log-sum-exps, equals one call over both (the serving engine's merge)."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, N, C, D, block = 1, 4, 2, 96, 40, 32, 16
    q = torch.randn(B, Hq, C, D, generator=g).to(DEVICE)
    k = torch.randn(B, Hkv, N, D, generator=g).to(DEVICE)
    v = torch.randn(B, Hkv, N, D, generator=g).to(DEVICE)
    nqb = N // block
    every = torch.arange(nqb, dtype=torch.int32).expand(B, Hq, nqb, nqb).contiguous()
    first = (N - C) // block  # the chunk's first block: blocks before it are the cache's own
    cache = torch.where(every < first, every, -1).to(DEVICE)
    own = torch.where(every >= first, every, -1).to(DEVICE)
    o1, l1 = kernels.block_sparse_attention(q, k, v, cache, block=block, return_lse=True)
    o2, l2 = kernels.block_sparse_attention(q, k, v, own, block=block, return_lse=True)
    one, lse = kernels.block_sparse_attention(q, k, v, every.to(DEVICE), block=block, return_lse=True)
    merged, merged_lse = merge_attention(o1, l1, o2, l2)
    dense, dense_lse = query_rows_attention(ref.dense_attention, q.cpu(), k.cpu(), v.cpu())
    torch.testing.assert_close(merged, one.double(), atol=2e-6, rtol=0)
    torch.testing.assert_close(merged_lse, lse.double(), atol=2e-6, rtol=0)
    torch.testing.assert_close(merged.cpu(), dense, atol=2e-6, rtol=0)  # every block: dense attention
    torch.testing.assert_close(merged_lse.cpu(), dense_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize("which", ["ashape", "vertical_slash", "block_sparse"])
def test_bad_query_rows(which):
    q = torch.randn(2, 2, 8, 16, device=DEVICE)
    k = torch.randn(2, 1, 20, 16, device=DEVICE)
    call = {
        "ashape": lambda **kw: kernels.ashape_attention(q, k, k, 1, 4, **kw),
        "vertical_slash": lambda **kw: kernels.vertical_slash_attention(
            q, k, k, torch.zeros(2, 2, 1, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 2, 1, dtype=torch.int32, device=DEVICE), **kw),
        "block_sparse": lambda **kw: kernels.block_sparse_attention(
            q, k, k, torch.zeros(2, 2, 2, 1, dtype=torch.int32, device=DEVICE), block=16, **kw),
    }[which]
    lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="give q_seqlens"):
        call(seqlens=lens)
    with pytest.raises(ValueError, match="must not exceed the key rows"):
        call(seqlens=lens, q_seqlens=torch.tensor([8, 6], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="q_seqstarts needs q_seqlens"):
        call(q_seqstarts=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"q_seqstarts \+ q_seqlens must lie in"):
        call(q_seqlens=torch.tensor([8, 8], dtype=torch.int32, device=DEVICE),
             q_seqstarts=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="N >= 21"):
        kernels.ashape_attention(torch.randn(2, 2, 21, 16, device=DEVICE), k, k, 1, 4)
