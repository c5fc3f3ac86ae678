"""The fuzzing strategies produce valid inputs, and every hard case they promise actually occurs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from minference._checks import check_index, check_ragged
from minference.testing.strategies import (
    LAYOUTS,
    ODD_LENGTHS,
    AttnShape,
    ashape_budgets,
    attention_shapes,
    block_sparse_indices,
    head_subsets,
    qkv,
    ragged_rows,
    tp_offsets,
    vertical_slash_indices,
)

#: Search budget for "this case occurs" checks (deterministic, no shrinking of the found case).
_FIND = settings(max_examples=300, database=None, derandomize=True, phases=(Phase.generate,),
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _occurs(strategy, condition) -> None:
    """Fail unless ``strategy`` draws a value satisfying ``condition``."""
    find(strategy, condition, settings=_FIND)


@given(attention_shapes())
def test_attention_shapes_valid(s: AttnShape) -> None:
    assert 1 <= s.B <= 2 and 1 <= s.Hkv <= 2 and 1 <= s.group <= 3
    assert s.Hq == s.Hkv * s.group
    assert 1 <= s.N <= 160 and s.D in (16, 32, 64)


def test_attention_shapes_hit_odd_lengths() -> None:
    for n in (1, 17, 65, 97, 129):
        _occurs(attention_shapes(), lambda s, n=n: s.N == n)
    _occurs(attention_shapes(min_n=100, max_n=110), lambda s: s.N not in ODD_LENGTHS)
    with pytest.raises(ValueError, match="min_n"):
        find(attention_shapes(min_n=0), lambda s: True)


@given(st.data())
def test_ragged_rows_valid(data) -> None:
    B = data.draw(st.integers(1, 4))
    N = data.draw(st.integers(1, 40))
    lens, starts = data.draw(ragged_rows(B, N))
    if lens is None:
        assert starts is None
        return
    assert lens.dtype == torch.int32 and lens.shape == (B,)
    l32, s32 = check_ragged(lens, starts, B, N, "cpu")  # raises if out of range
    assert bool(((s32 >= 0) & (s32 + l32 <= N)).all())


def test_ragged_rows_cover_every_kind() -> None:
    N = 20
    strat = ragged_rows(3, N)

    def rows(pred):
        return lambda r: r[0] is not None and r[1] is not None and any(
            pred(int(n), int(s)) for n, s in zip(r[0], r[1])
        )

    _occurs(strat, lambda r: r == (None, None))
    _occurs(strat, lambda r: r[0] is not None and r[1] is None and bool((r[0] < N).any()))
    _occurs(strat, rows(lambda n, s: n == 0))
    _occurs(strat, rows(lambda n, s: n == N))
    _occurs(strat, rows(lambda n, s: 0 < n < N and s == N - n))  # left padding
    _occurs(strat, rows(lambda n, s: 0 < n and 0 < s < N - n))  # padding on both sides


@given(st.data())
def test_head_subsets_valid(data) -> None:
    Hq = data.draw(st.integers(1, 8))
    heads = data.draw(head_subsets(Hq))
    if heads is not None:
        ids = heads.tolist()
        assert heads.dtype == torch.int32 and heads.dim() == 1
        assert 1 <= len(ids) == len(set(ids)) and all(0 <= h < Hq for h in ids)


def test_head_subsets_cover() -> None:
    _occurs(head_subsets(6), lambda h: h is None)
    _occurs(head_subsets(6), lambda h: h is not None and h.tolist() != sorted(h.tolist()))
    _occurs(head_subsets(6), lambda h: h is not None and len(h) < 6)
    _occurs(head_subsets(3, allow_empty=True), lambda h: h is not None and len(h) == 0)


@given(st.data())
def test_vertical_slash_indices_valid(data) -> None:
    B, Hg, N = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 130))
    vertical, slash = data.draw(vertical_slash_indices(B, Hg, N, max_vertical=5, max_slash=7))
    for name, x, most in (("vertical", vertical, 5), ("slash", slash, 7)):
        assert x.dtype == torch.int32 and x.shape[:2] == (B, Hg) and 1 <= x.shape[2] <= most
        check_index(name, x, rank=3, lead=(B, Hg), device="cpu", upper=N)


def _any_row(x: torch.Tensor, pred) -> bool:
    return any(pred(row) for row in x.reshape(-1, x.shape[-1]).tolist())


def test_vertical_slash_indices_cover_hard_cases() -> None:
    N = 100
    strat = vertical_slash_indices(2, 2, N)

    def dup(row):
        vals = [x for x in row if x >= 0]
        return len(vals) != len(set(vals))

    def mid_pad(row):
        return any(a == -1 and b >= 0 for a, b in zip(row, row[1:]))

    def unsorted(row):
        vals = [x for x in row if x >= 0]
        return vals != sorted(vals)

    _occurs(strat, lambda vs: _any_row(vs[0], dup) and _any_row(vs[1], dup))
    _occurs(strat, lambda vs: _any_row(vs[0], mid_pad) and _any_row(vs[1], mid_pad))
    _occurs(strat, lambda vs: _any_row(vs[0], unsorted) and _any_row(vs[1], unsorted))
    _occurs(strat, lambda vs: _any_row(vs[1], lambda r: all(x == -1 for x in r)))
    _occurs(strat, lambda vs: vs[0].shape[-1] == 1 or vs[1].shape[-1] == 1)
    _occurs(strat, lambda vs: bool((vs[1] == N - 1).any()))  # longest offset
    _occurs(strat, lambda vs: not bool((vs[1] == 0).any()))  # offset 0 absent everywhere
    _occurs(strat, lambda vs: bool(((vs[1] == 0).any(-1)).all()))  # offset 0 in every row

    def vertical_on_slash(vs):
        # some column c > 0 with c + d < N for a listed offset d > 0 of the same head
        for vrow, srow in zip(vs[0].reshape(-1, vs[0].shape[-1]).tolist(), vs[1].reshape(-1, vs[1].shape[-1]).tolist()):
            if any(c > 0 and d > 0 and c + d < N for c in vrow if c >= 0 for d in srow if d >= 0):
                return True
        return False

    _occurs(strat, vertical_on_slash)


@given(st.data())
def test_block_sparse_indices_valid(data) -> None:
    B, Hg, N = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 130))
    block = data.draw(st.sampled_from((1, 16, 64)))
    blocks = data.draw(block_sparse_indices(B, Hg, N, block, max_k=4))
    nqb = -(-N // block)
    assert blocks.dtype == torch.int32 and blocks.shape[:3] == (B, Hg, nqb) and 1 <= blocks.shape[3] <= 4
    check_index("blocks", blocks, rank=4, lead=(B, Hg, nqb), device="cpu", upper=nqb)


def test_block_sparse_indices_cover_hard_cases() -> None:
    strat = block_sparse_indices(1, 2, 300, 64)
    diag = torch.arange(5)[:, None]
    _occurs(strat, lambda b: bool((b > diag).any()))  # above the diagonal
    _occurs(strat, lambda b: not bool((b == diag).any()))  # diagonal absent
    _occurs(strat, lambda b: bool((b == diag).any(-1).all()))  # diagonal everywhere
    _occurs(strat, lambda b: bool((b == -1).all(-1).any()))  # an all-padding row
    _occurs(strat, lambda b: _any_row(b, lambda r: len([x for x in r if x >= 0]) != len({x for x in r if x >= 0})))


@given(st.data())
def test_ashape_budgets_valid(data) -> None:
    H = data.draw(st.integers(1, 6))
    sink, window = data.draw(ashape_budgets(H, max_n=50))
    if isinstance(sink, int):
        assert isinstance(window, int) and sink >= 0 and window >= 1
    else:
        assert sink.dtype == window.dtype == torch.int32 and sink.shape == window.shape == (H,)
        assert bool((sink >= 0).all()) and bool((window >= 1).all())


def test_ashape_budgets_cover() -> None:
    strat = ashape_budgets(3, max_n=50)
    _occurs(strat, lambda sw: isinstance(sw[0], int) and sw[0] == 0)
    _occurs(strat, lambda sw: isinstance(sw[1], int) and sw[1] == 1)
    _occurs(strat, lambda sw: isinstance(sw[1], int) and sw[1] > 50)
    _occurs(strat, lambda sw: isinstance(sw[0], int) and 0 < sw[0] < sw[1])
    _occurs(strat, lambda sw: isinstance(sw[0], torch.Tensor) and len(set(sw[1].tolist())) > 1)


@given(st.integers(1, 8).flatmap(lambda h: st.tuples(st.just(h), tp_offsets(h))))
def test_tp_offsets(args) -> None:
    H_local, (offset, H_global) = args
    assert offset % H_local == 0 and H_global % H_local == 0 and offset + H_local <= H_global


def test_tp_offsets_cover() -> None:
    _occurs(tp_offsets(3), lambda t: t[0] > 0)


def test_qkv_deterministic_quantised_and_nonzero() -> None:
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=17, D=16)
    q, k, v = qkv(shape, torch.float16, "cpu", seed=3)
    assert q.shape == (2, 4, 17, 16) and k.shape == v.shape == (2, 2, 17, 16)
    assert q.dtype == k.dtype == v.dtype == torch.float16
    for x in (q, k, v):
        assert bool((x != 0).any()) and bool(torch.isfinite(x).all())
    q2, _, _ = qkv(shape, torch.float16, "cpu", seed=3)
    q3, _, _ = qkv(shape, torch.float16, "cpu", seed=4)
    assert torch.equal(q, q2) and not torch.equal(q, q3)
    q64, _, _ = qkv(shape, torch.float64, "cpu", seed=3)
    assert torch.equal(q64.to(torch.float16), q)


def test_qkv_sharpness_scales_queries_only() -> None:
    shape = AttnShape(B=1, Hq=2, Hkv=1, N=9, D=32)
    q1, k1, v1 = qkv(shape, torch.float64, "cpu", seed=0)
    q4, k4, v4 = qkv(shape, torch.float64, "cpu", seed=0, sharpness=4.0)
    assert torch.allclose(q4, 4 * q1) and torch.equal(k1, k4) and torch.equal(v1, v4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qkv_layouts_same_values(layout: str) -> None:
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=5, D=16)
    ref = qkv(shape, torch.float32, "cpu", seed=1)
    got = qkv(shape, torch.float32, "cpu", seed=1, layout=layout)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
        assert b.is_contiguous() == (layout == "contiguous")


def test_qkv_rejects_bad_arguments() -> None:
    shape = AttnShape(B=1, Hq=1, Hkv=1, N=2, D=16)
    with pytest.raises(TypeError, match="shape"):
        qkv((1, 1, 1, 2, 16), torch.float32, "cpu", 0)
    with pytest.raises(TypeError, match="dtype"):
        qkv(shape, torch.int32, "cpu", 0)
    with pytest.raises(ValueError, match="sharpness"):
        qkv(shape, torch.float32, "cpu", 0, sharpness=0.0)
    with pytest.raises(ValueError, match="layout"):
        qkv(shape, torch.float32, "cpu", 0, layout="weird")
