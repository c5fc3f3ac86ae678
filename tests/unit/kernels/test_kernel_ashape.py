"""A-shape kernel vs its float64 twin: sinks inside/outside the window, per-head budgets indexed
by global head (tensor parallelism), GQA, ragged rows, head subsets, strided inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import ashape_budgets, tp_offsets
from tests.unit.kernels.cases import COMBOS, DEVICE, SHARP_CASES, check_sharp, problem, run_and_check, sharp_problem

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_ashape_matches_reference(data, combo):
    p = problem(data, combo=combo)
    head_offset, H_global = data.draw(tp_offsets(p["shape"].Hq), label="tp")
    sink, window = data.draw(ashape_budgets(H_global, max_n=p["shape"].N), label="budgets")
    run_and_check(p, kernels.ashape_attention, ref.ashape_attention, sink, window, head_offset=head_offset)


def test_budget_indexed_by_global_head():
    """Rank 1 of 2 reads budgets at global heads 2, 3: swapping rank-0 budgets changes nothing."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 40, 16, generator=g).to(DEVICE)
    k = torch.randn(1, 1, 40, 16, generator=g).to(DEVICE)
    v = torch.randn(1, 1, 40, 16, generator=g).to(DEVICE)
    sink = torch.tensor([0, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    window = torch.tensor([1, 1, 5, 17], dtype=torch.int32, device=DEVICE)
    a = kernels.ashape_attention(q, k, v, sink, window, head_offset=2)
    b = kernels.ashape_attention(q, k, v, sink + torch.tensor([9, 9, 0, 0], device=DEVICE, dtype=torch.int32),
                                 window + torch.tensor([30, 2, 0, 0], device=DEVICE, dtype=torch.int32),
                                 head_offset=2)
    assert torch.equal(a, b)
    expect = ref.ashape_attention(q.cpu(), k.cpu(), v.cpu(), sink.cpu(), window.cpu(), head_offset=2)
    assert (a.cpu().double() - expect).abs().max() < 1e-5


def test_budget_errors():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    k = torch.randn(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="window must be >= 1"):
        kernels.ashape_attention(q, k, k, 1, 0)
    with pytest.raises(ValueError, match="sink entries must be >= 0"):
        kernels.ashape_attention(q, k, k, torch.tensor([-1, 0], device=DEVICE), 3)
    with pytest.raises(ValueError, match="fewer than the 3 global heads"):
        kernels.ashape_attention(q, k, k, torch.tensor([1, 1, 1], device=DEVICE)[:2], 3, head_offset=1)
    with pytest.raises(TypeError, match="sink must have dtype"):
        kernels.ashape_attention(q, k, k, torch.tensor([1.0, 1.0], device=DEVICE), 3)
    with pytest.raises(TypeError, match="head_offset"):
        kernels.ashape_attention(q, k, k, 1, 3, head_offset=1.5)


@pytest.mark.parametrize(("dtype", "nats", "shape", "seqlens", "seqstarts", "heads"), SHARP_CASES)
def test_masked_keys_dominating_the_kept_ones(dtype, nats, shape, seqlens, seqstarts, heads):
    """Every row's masked key (between sink and window, or just after the row) leads its kept keys
    by 30 or 150 nats: a mask applied after the exponential instead of -inf before the max fails."""
    sink, window = 3, 20
    p = sharp_problem(shape, dtype, lambda b, g, L: ref.ashape_mask(L, sink, window), nats=nats,
                      seqlens=seqlens, seqstarts=seqstarts, heads=heads)
    check_sharp(p, kernels.ashape_attention, ref.ashape_attention, sink, window)
