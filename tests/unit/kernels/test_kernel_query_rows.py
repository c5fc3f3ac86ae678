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

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import (
    ashape_budgets,
    block_sparse_indices,
    vertical_slash_indices,
)
from tests.unit.kernels.cases import COMBOS, DEVICE, query_problem, run_query_rows, torch_converter

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_ashape_query_rows(data, combo):
    p = query_problem(data, combo)
    sink, window = data.draw(ashape_budgets(p["shape"].Hq, max_n=p["shape"].N + 4), label="budgets")
    run_query_rows(p, kernels.ashape_attention, ref.ashape_attention, sink, window)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_vertical_slash_query_rows(data, combo):
    p = query_problem(data, combo)
    s = p["shape"]
    vertical, slash = data.draw(vertical_slash_indices(s.B, p["Hg"], s.N), label="index")
    fill = data.draw(st.sampled_from((0, 383)), label="fill_gaps")
    # the conversion does not see the query rows (vertical, slash, N): the whole-row kernel tests
    # run the Triton converter on this distribution of indices, so the interpreter takes its
    # torch twin here (the same index, field by field) and the query-row kernel is the subject
    with torch_converter():
        run_query_rows(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash,
                       fill_gaps=fill)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_block_sparse_query_rows(data, combo):
    p = query_problem(data, combo)
    s = p["shape"]
    block = data.draw(st.sampled_from((16, 32) if DEVICE == "cpu" else (32, 64, 128)), label="block")
    blocks = data.draw(block_sparse_indices(s.B, p["Hg"], s.N, block), label="blocks")
    run_query_rows(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)


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
