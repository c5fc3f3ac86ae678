"""``merge_attention`` (the dispatcher's, float32, and its float64 twin in ``reference``): the
merged output AND the merged log-sum-exp, for pieces over disjoint key sets merged in every
order, against one call over their union; exact values on hand-made pieces; the argument checks
(issue 34: integer outputs were truncated, a list gave an AttributeError)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import minference.torch_backend as tb
from minference import reference as ref
from minference.dispatch import merge_attention
from minference.testing.strategies import attention_shapes, qkv

MERGES = {"dispatch": merge_attention, "reference": ref.merge_attention}
#: the dispatcher's merge of the torch backend's pieces (float32 log-sum-exps) against its union
#: call (measured ~1e-6).
ATOL32 = 2e-5


def _three_sides(B: int, Hq: int, nqb: int, seed: int) -> torch.Tensor:
    """``[B, Hq, nqb, nqb]`` side 0, 1 or 2 of every (query block, key block) pair."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (B, Hq, nqb, nqb), generator=g)


def _fold(merge, pieces):
    out, lse = pieces[0]
    for o, l in pieces[1:]:
        out, lse = merge(out, lse, o, l)
    return out, lse


def _assert_same(got, want, *, atol: float, rtol: float, what: str) -> None:
    (out, lse), (out_w, lse_w) = got, want
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_w)), f"{what}: empty rows differ"
    fin = torch.isfinite(lse_w)
    torch.testing.assert_close(lse[fin].double(), lse_w[fin].double(), atol=atol, rtol=rtol, msg=f"{what}: lse")
    torch.testing.assert_close(out.double(), out_w.double(), atol=atol, rtol=rtol, msg=f"{what}: out")


@given(shape=attention_shapes(max_n=96, head_dims=(16, 32)), block=st.sampled_from((1, 8, 16)),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from((torch.float32, torch.float64)))
def test_three_pieces_merge_in_every_order_into_the_union(shape, block, seed, dtype) -> None:
    """Block-sparse attention over three disjoint key-block sets (random sides, so some rows have
    keys in one piece only and some in none), merged in all six orders and both groupings, gives
    the output and the log-sum-exp of one call over the union: the torch backend's pieces with
    the dispatcher's merge, and the float64 definition's pieces with the reference merge."""
    q, k, v = qkv(shape, dtype, "cpu", seed)
    nqb = -(-shape.N // block)
    every = torch.arange(nqb, dtype=torch.int32).expand(shape.B, shape.Hq, nqb, nqb)
    sides = _three_sides(shape.B, shape.Hq, nqb, seed)
    sets = [torch.where(sides == s, every, -1) for s in range(3)]
    union_of = every.contiguous()
    for name, attend, atol, rtol in (
        ("dispatch", lambda b: tb.block_sparse_attention(q, k, v, b, block=block, return_lse=True),
         ATOL32, 1e-5),  # the torch backend's lse is float32 for every input dtype
        ("reference", lambda b: ref.block_sparse_attention(q, k, v, b, block=block, return_lse=True), 1e-10, 1e-10),
    ):
        merge = MERGES[name]
        pieces = [attend(b) for b in sets]
        union = attend(union_of)
        for order in itertools.permutations(range(3)):
            ordered = [pieces[i] for i in order]
            _assert_same(_fold(merge, ordered), union, atol=atol, rtol=rtol, what=f"{name} (({order}))")
            right = merge(*ordered[0], *merge(*ordered[1], *ordered[2]))
            _assert_same(right, union, atol=atol, rtol=rtol, what=f"{name} {order[0]}, ({order[1:]})")


@pytest.mark.parametrize("name", sorted(MERGES))
def test_hand_made_pieces_give_the_exact_merge(name) -> None:
    """``lse_a = log 2``, ``lse_b = log 3``: ``lse = log 5``, ``out = (2 a + 3 b) / 5``; an empty
    piece (``-inf``) leaves the other as it is; two empty pieces give 0 and ``-inf``; equal
    log-sum-exps far from 0 (``±1000``) do not overflow."""
    merge = MERGES[name]
    a = torch.tensor([[1.0, -2.0], [4.0, 0.5], [3.0, 3.0], [7.0, 8.0], [1.0, 2.0]])
    b = torch.tensor([[5.0, 1.0], [-1.0, 2.0], [9.0, 9.0], [1.0, 0.0], [3.0, 4.0]])
    inf = float("inf")
    la = torch.tensor([math.log(2), 0.7, -inf, -inf, 1000.0])
    lb = torch.tensor([math.log(3), -inf, 0.2, -inf, 1000.0])
    out, lse = merge(a, la, b, lb)
    want_lse = torch.tensor([math.log(5), 0.7, 0.2, -inf, 1000.0 + math.log(2)], dtype=torch.float64)
    want_out = torch.stack([(2 * a[0] + 3 * b[0]) / 5, a[1], b[2], torch.zeros(2), (a[4] + b[4]) / 2]).double()
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), want_out, atol=1e-6, rtol=1e-6)


def test_the_dispatchers_merge_keeps_the_output_dtype_and_float64_precision() -> None:
    """Half outputs come back in their dtype (merged in float32); float64 pieces merge in float64
    (a float32 merge would lose the 1e-12 difference below)."""
    a = torch.full((3, 4), 1.0, dtype=torch.float64)
    b = a + 1e-12
    lse = torch.zeros(3, dtype=torch.float64)
    out, out_lse = merge_attention(a, lse, b, lse)
    assert out.dtype == out_lse.dtype == torch.float64
    torch.testing.assert_close(out, a + 0.5e-12, atol=1e-15, rtol=0)
    for dtype in (torch.float16, torch.bfloat16):
        out, out_lse = merge_attention(a.to(dtype), lse.float(), (a * 3).to(dtype), lse.float())
        assert out.dtype == dtype and out_lse.dtype == torch.float32
        assert torch.equal(out, torch.full_like(out, 2.0))


@pytest.mark.parametrize("name", sorted(MERGES))
def test_bad_arguments_are_clear_errors(name) -> None:
    merge = MERGES[name]
    out, lse = torch.ones(2, 3), torch.zeros(2)
    cases = [
        ((out.long(), lse, out.long(), lse), TypeError, "out_a must have dtype in"),  # was: truncated
        ((out, lse, out.int(), lse), TypeError, "out_b must have dtype in"),
        ((out, lse.long(), out, lse), TypeError, "lse_a must have dtype in"),
        ((out, lse, out.half(), lse), TypeError, "out_a and out_b must share a dtype"),
        (([1.0], lse, out, lse), TypeError, "out_a must be a torch.Tensor, got list"),  # was: AttributeError
        ((out, lse, out, 0.0), TypeError, "lse_b must be a torch.Tensor, got float"),
        ((out, lse, out[:1], lse), ValueError, "of one shape"),
        ((out, lse[:1], out, lse[:1]), ValueError, "of one shape"),
        ((out, lse.to("meta"), out, lse), ValueError, "lse_a is a meta tensor"),
    ]
    for args, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            merge(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MERGES))
def test_pieces_on_two_devices_are_refused(name) -> None:
    out, lse = torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="on one device"):
        MERGES[name](out.cuda(), lse, out.cuda(), lse.cuda())
