"""Online index builders (Triton, ``minference.kernels``: ``estimate_vs``, ``estimate_bs``,
``select``, and the plain PyTorch ones in ``minference.torch_backend``) against their naive float64 twins
(``minference.reference.estimators``): scores within float32 rounding, selections as exact sets
wherever the naive scores are not tied at the selection boundary."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.kernels import estimate_vs
from minference.kernels import select as kernel_select
from minference.reference import estimators as naive

import minference.torch_backend as portable
from minference import kernels as triton_builders
from minference.backend import get_backend
from minference.index import build_group_index, extra_row_positions, prepare_plan, select_vertical_slash
from minference.patterns import VerticalSlash
from minference.testing.strategies import attention_shapes, head_subsets, qkv, ragged_rows, tp_offsets
from tests.unit.index.cases import SCORE_ATOL, SCORE_RTOL, assert_same_selection, assert_same_vs_index, draw_budget

#: Fast implementations under test; the Triton ones run in the interpreter on the CPU.
IMPLS = [pytest.param(triton_builders, id="triton", marks=pytest.mark.interpret), pytest.param(portable, id="torch")]


CPU_SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=130, head_dims=(16, 32))
#: On the GPU: longer rows, one head dim and bf16 only (each new shape class compiles kernels).
GPU_SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=4, max_n=400, head_dims=(64,))


def _values(budget, ids, head_offset):
    return [budget] * len(ids) if isinstance(budget, int) else [int(budget[head_offset + h]) for h in ids]


def _vs_case(data, dtype, shapes=CPU_SHAPES):
    shape = data.draw(shapes)
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    head_offset, H_global = data.draw(tp_offsets(shape.Hq))
    q, k, _ = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1)),
                  sharpness=data.draw(st.sampled_from((0.5, 1.0, 3.0))))
    kw = dict(
        last_q=data.draw(st.one_of(st.integers(1, 20), st.integers(shape.N, shape.N + 40))),
        # none; a few (rows shorter than last_q + extra_rows included); more than any row has
        extra_rows=data.draw(st.one_of(st.just(0), st.integers(1, 12), st.integers(shape.N, 2 * shape.N + 8))),
        sink_columns=draw_budget(data, H_global, 0, 6),
        local_diagonals=draw_budget(data, H_global, 0, 6),
        aggregation=data.draw(st.sampled_from(("sum", "max"))),
        seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=True,
    )
    vertical = draw_budget(data, H_global, 0, 24)
    slash = draw_budget(data, H_global, 1, 24)
    return shape, q, k, vertical, slash, kw


@pytest.mark.parametrize("fast", IMPLS)
@given(st.data())
def test_vertical_slash_matches_naive(fast, data) -> None:
    shape, q, k, vertical, slash, kw = _vs_case(data, data.draw(st.sampled_from((torch.float16, torch.float32))))
    # Triton: the smallest key tile (the row chunk's width) puts up to 9 tiles in a row, the
    # default at most 2
    key_tile = data.draw(st.sampled_from((16, estimate_vs.VS_KEY_TILE)))
    # and a 16-score selection chunk puts rows through several histogram / output steps; rows
    # longer than SELECT_MAX_N keep topk
    chunk = data.draw(st.sampled_from((16, kernel_select.SELECT_CHUNK)))
    max_n = data.draw(st.sampled_from((0, kernel_select.SELECT_MAX_N)))
    with mock.patch.object(estimate_vs, "VS_KEY_TILE", key_tile), \
            mock.patch.object(kernel_select, "SELECT_CHUNK", chunk), \
            mock.patch.object(kernel_select, "SELECT_MAX_N", max_n):
        fast_out = fast.vertical_slash_index(q, k, vertical, slash, **kw)
    assert_same_vs_index(fast_out, naive.vertical_slash_index(q, k, vertical, slash, **kw))
    check_vs_invariants(shape, fast_out[0], fast_out[1], vertical, slash, kw)


#: The invariant tests' implementations: the torch builders and the float64 twin itself. The Triton
#: builders (seconds an example in the interpreter) are held to the same invariants on every
#: example of their ``*_matches_naive`` test, which also compares them with the twin.
INVARIANT_IMPLS = [pytest.param(portable, id="torch"), pytest.param(naive, id="naive")]


@pytest.mark.parametrize("fast", INVARIANT_IMPLS)
@given(st.data())
def test_vertical_slash_invariants(fast, data) -> None:
    """Properties straight from the definition, independent of either implementation."""
    shape, q, k, vertical, slash, kw = _vs_case(data, torch.float32)
    fv, fs, _, _ = fast.vertical_slash_index(q, k, vertical, slash, **kw)
    check_vs_invariants(shape, fv, fs, vertical, slash, kw)


def check_vs_invariants(shape, fv, fs, vertical, slash, kw) -> None:
    """The definition's properties of a vertical-slash index ``fv, fs`` built with ``kw``: per row
    of length ``n``, ``min(budget, n)`` distinct entries below ``n``, the forced sink columns,
    offset 0 and the forced local diagonals among them."""
    lens = kw["seqlens"] if kw["seqlens"] is not None else torch.full((shape.B,), shape.N)
    ids = kw["heads"].tolist() if kw["heads"] is not None else list(range(shape.Hq))
    off = kw["head_offset"]
    budgets_v, budgets_s = _values(vertical, ids, off), _values(slash, ids, off)
    sinks, locs = _values(kw["sink_columns"], ids, off), _values(kw["local_diagonals"], ids, off)
    for b in range(shape.B):
        n = int(lens[b])
        for g in range(len(ids)):
            cols = {x for x in fv[b, g].tolist() if x >= 0}
            offs = {x for x in fs[b, g].tolist() if x >= 0}
            assert len(cols) == min(budgets_v[g], n) and len(offs) == min(budgets_s[g], n)
            assert all(x < n for x in cols | offs)
            assert set(range(min(sinks[g], budgets_v[g], n))) <= cols
            if n:
                assert 0 in offs
                assert set(range(min(max(locs[g], 1), budgets_s[g], n))) <= offs


@pytest.mark.interpret
@given(st.data())
def test_selection_kernel_is_the_definition(data) -> None:
    """The one-launch selection of the Triton builder on scores with many exact ties (zeros,
    repeated values, negatives): per row, ``min(budget, width, valid)`` distinct positions inside
    the row, the forced ones included, no unpicked valid score above a picked free one, and ties
    at the boundary resolved to the lowest positions; on tie-free rows, the torch selection's set."""
    B, Hg = data.draw(st.integers(1, 2), label="B"), data.draw(st.integers(1, 3), label="Hg")
    N = data.draw(st.integers(1, 200), label="N")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    levels = data.draw(st.sampled_from((0, 3, 50)), label="distinct levels (0: continuous)")
    sign = data.draw(st.sampled_from((1.0, -1.0)), label="sign")

    def scores():
        if levels:
            return sign * torch.randint(0, levels, (B, Hg, N), generator=g).float() / levels
        return sign * torch.rand(B, Hg, N, generator=g) ** 3

    col, diag = scores(), scores()
    lens = torch.randint(1, N + 1, (B,), generator=g, dtype=torch.int32)
    nv = torch.randint(0, N + 4, (Hg,), generator=g)
    ns = torch.randint(1, N + 4, (Hg,), generator=g)
    sinks = torch.minimum(torch.randint(0, 8, (Hg,), generator=g), nv)
    locs = torch.minimum(torch.randint(1, 8, (Hg,), generator=g), ns)
    width_v = min(int(nv.max()) + data.draw(st.integers(0, 3)), N)
    width_s = min(int(ns.max()), N)
    chunk = data.draw(st.sampled_from((16, 64, kernel_select.SELECT_CHUNK)), label="chunk")
    with mock.patch.object(kernel_select, "SELECT_CHUNK", chunk):
        got = kernel_select._select_triton(col, diag, lens, sinks, locs, nv, ns, width_v, width_s)
    want = select_vertical_slash(col, diag, lens, sinks, locs, nv, ns, width_v, width_s)
    for idx, ref_idx, sc, forced, budget in zip(got, want, (col, diag), (sinks, locs), (nv, ns)):
        for b in range(B):
            n = int(lens[b])
            for h in range(Hg):
                row = idx[b, h].tolist()
                picked = [x for x in row if x >= 0]
                assert row == picked + [-1] * (len(row) - len(picked)) and picked == sorted(set(picked))
                assert len(picked) == min(int(budget[h]), idx.shape[-1], n) and all(x < n for x in picked)
                f = min(int(forced[h]), n, len(picked))
                assert set(range(f)) <= set(picked)
                free = [x for x in range(f, n) if x not in picked]
                chosen = [x for x in picked if x >= f]
                if chosen and free:
                    low = min(float(sc[b, h, x]) for x in chosen)
                    assert max(float(sc[b, h, x]) for x in free) <= low
                    assert all(x < y for x in chosen if float(sc[b, h, x]) == low
                               for y in free if float(sc[b, h, y]) == low)
                if not levels:  # continuous scores: no ties, the same set as the torch selection
                    assert set(picked) == {x for x in ref_idx[b, h].tolist() if x >= 0}


def _bs_case(data, dtype, shapes=CPU_SHAPES):
    shape = data.draw(shapes)
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    head_offset, H_global = data.draw(tp_offsets(shape.Hq))
    q, k, _ = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1)))
    kw = dict(
        block=data.draw(st.sampled_from((5, 7, 16, 32, 64))),
        sink_blocks=draw_budget(data, H_global, 0, 3),
        force_diagonal=data.draw(st.booleans()),
        seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=True,
    )
    return shape, q, k, draw_budget(data, H_global, 1, 8), kw


@pytest.mark.parametrize("fast", IMPLS)
@given(st.data())
def test_block_sparse_matches_naive(fast, data) -> None:
    shape, q, k, top_k, kw = _bs_case(data, data.draw(st.sampled_from((torch.float16, torch.float32))))
    fb, fscores = fast.block_sparse_index(q, k, top_k, **kw)
    nb, nscores = naive.block_sparse_index(q, k, top_k, **kw)
    assert torch.equal(torch.isfinite(fscores), torch.isfinite(nscores))
    fin = torch.isfinite(nscores)
    torch.testing.assert_close(fscores.double()[fin], nscores[fin], rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert fb.dtype == torch.int32
    assert_same_selection(fb, nb, nscores, "blocks")
    check_bs_invariants(shape, fb, top_k, kw)


@pytest.mark.parametrize("fast", INVARIANT_IMPLS)
@given(st.data())
def test_block_sparse_invariants(fast, data) -> None:
    shape, q, k, top_k, kw = _bs_case(data, torch.float32)
    check_bs_invariants(shape, fast.block_sparse_index(q, k, top_k, **kw)[0], top_k, kw)


def check_bs_invariants(shape, blocks, top_k, kw) -> None:
    """The definition's properties of a block-sparse index: per query block inside its row,
    ``min(top_k, I + 1)`` causal blocks, the diagonal when forced, the sink blocks; none past the
    row."""
    lens = kw["seqlens"] if kw["seqlens"] is not None else torch.full((shape.B,), shape.N)
    ids = kw["heads"].tolist() if kw["heads"] is not None else list(range(shape.Hq))
    tops = _values(top_k, ids, kw["head_offset"])
    sinks = _values(kw["sink_blocks"], ids, kw["head_offset"])
    block = kw["block"]
    for b in range(shape.B):
        nb = -(-int(lens[b]) // block)
        for g in range(len(ids)):
            for I in range(blocks.shape[2]):
                got = {x for x in blocks[b, g, I].tolist() if x >= 0}
                if I >= nb:
                    assert not got
                    continue
                assert len(got) == min(tops[g], I + 1) and max(got) <= I
                if kw["force_diagonal"]:
                    assert I in got
                assert set(range(min(sinks[g], tops[g] - kw["force_diagonal"], I + 1))) <= got


@pytest.mark.parametrize("fast", IMPLS)
def test_vertical_slash_picks_planted_structure(fast) -> None:
    """Keys built to attract every query (a column) and a key pattern that repeats at a fixed
    distance (a diagonal) are found, and the vertical rows stay within their budget."""
    torch.manual_seed(0)
    N, D, hot_col, lag, code = 96, 16, 41, 7, 8
    q = torch.randn(1, 1, N, D) * 0.1
    k = torch.randn(1, 1, N, D) * 0.1
    q[0, 0, :, 0] = 3.0
    k[0, 0, hot_col, 0] = 3.0  # every query likes this key
    signs = torch.sign(torch.randn(N, code)) * 1.5
    q[0, 0, :, D - code :] = signs
    k[0, 0, : N - lag, D - code :] = signs[lag:]  # key j matches query j + lag
    v, s = fast.vertical_slash_index(q, k, 2, 2, last_q=32, sink_columns=0, local_diagonals=1)
    assert hot_col in v[0, 0].tolist()
    assert set(s[0, 0].tolist()) == {0, lag}


def test_extra_row_positions_are_the_definition() -> None:
    """The device-side positions (shared by the Triton and PyTorch builders) equal the naive
    twin's sampled rows for every small row length, last_q and extra_rows, incl. the cap at N."""
    N = 24
    lens = torch.arange(N + 1)
    for last_q in (1, 3, 8, 30):
        for extra in range(0, 2 * N + 3):
            got = extra_row_positions(lens, N, last_q, extra)
            assert got.shape == (N + 1, min(extra, N))
            for n in range(N + 1):
                rows = [x for x in got[n].tolist() if x >= 0]
                assert rows + list(range(n - min(last_q, n), n)) == naive._sampled_rows(n, last_q, extra), (n, extra)


def test_sampled_rows_definition() -> None:
    assert naive._sampled_rows(10, 4, 0) == [6, 7, 8, 9]
    assert naive._sampled_rows(10, 4, 2) == [2, 4, 6, 7, 8, 9]  # floor(6/3), floor(12/3)
    assert naive._sampled_rows(10, 4, 3) == [1, 3, 4, 6, 7, 8, 9]  # floor(1.5), floor(3), floor(4.5)
    assert naive._sampled_rows(5, 3, 9) == [0, 1, 2, 3, 4]  # more extra rows than earlier rows: all, once
    assert naive._sampled_rows(3, 8, 5) == [0, 1, 2]  # no earlier rows


def _middle_needle(n=64, last_q=8):
    """The last rows all read key 1 and are repelled by key 5; the middle query ``(n - last_q) // 2``
    (the one extra row with ``extra_rows=1``) reads key 5. Other keys carry small distinct logits."""
    g = torch.Generator().manual_seed(3)
    D = 16
    q = torch.randn(1, 1, n, D, generator=g) * 0.05
    k = torch.randn(1, 1, n, D, generator=g) * 0.05
    mid = (n - last_q) // 2
    k[0, 0, 1, 0] = 4.0
    k[0, 0, 5, 1] = 4.0
    q[0, 0, n - last_q :, 0] = 2.0
    q[0, 0, n - last_q :, 1] = -2.0
    q[0, 0, mid, 1] = 3.0
    return q, k, mid


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_extra_rows_find_a_middle_querys_key(impl) -> None:
    """The last-rows proxy misses a key only a middle query needs; one extra row finds it, and a
    plan's ``extra_rows`` reaches the builder through the head grouping."""
    q, k, mid = _middle_needle()
    kw = dict(last_q=8, sink_columns=0, local_diagonals=1, scale=1.0)
    without = impl.vertical_slash_index(q, k, 2, 1, extra_rows=0, **kw)[0]
    with_mid = impl.vertical_slash_index(q, k, 2, 1, extra_rows=1, **kw)[0]
    assert 1 in without[0, 0].tolist() and 5 not in without[0, 0].tolist()
    assert set(with_mid[0, 0].tolist()) == {1, 5}
    if impl is not naive:
        plan = [VerticalSlash(vertical=2, slash=1, last_q=8, sink_columns=0, local_diagonals=1, extra_rows=1)]
        (group,) = prepare_plan(plan, 1, 0, "cpu")
        backend = get_backend("triton" if impl is triton_builders else "torch")
        v, _ = build_group_index(backend, group, q, k, scale=1.0, seqlens=None, seqstarts=None, head_offset=0)
        assert set(v[0, 0].tolist()) == {1, 5}


def test_budget_and_argument_errors() -> None:
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 1, 8, 16)
    for impl in (triton_builders, portable, naive):
        with pytest.raises(ValueError, match="aggregation"):
            impl.vertical_slash_index(q, k, 2, 2, aggregation="mean")
        with pytest.raises(ValueError, match="last_q"):
            impl.vertical_slash_index(q, k, 2, 2, last_q=0)
        for bad in (-1, 1.5, True, None):
            with pytest.raises(ValueError, match="extra_rows must be a non-negative int"):
                impl.vertical_slash_index(q, k, 2, 2, extra_rows=bad)
        with pytest.raises(ValueError, match="slash"):
            impl.vertical_slash_index(q, k, 2, 0)
        with pytest.raises(ValueError, match="vertical"):
            impl.vertical_slash_index(q, k, -1, 2)
        with pytest.raises(ValueError, match="top_k"):
            impl.block_sparse_index(q, k, 0)
        with pytest.raises(ValueError, match="block"):
            impl.block_sparse_index(q, k, 2, block=0)
        with pytest.raises(TypeError, match="top_k"):
            impl.block_sparse_index(q, k, 2.5)
        with pytest.raises(ValueError, match="query heads"):
            impl.vertical_slash_index(q, torch.randn(1, 3, 8, 16), 2, 2)


def test_resolved_budgets_are_the_per_call_ones() -> None:
    """``resolved=`` (what the dispatcher keeps per plan) gives the index the builder computes from
    the budgets itself, with per-global-head tensors and a TP offset; malformed ones are refused."""
    from minference.index import block_sparse_budgets, vertical_slash_budgets

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    heads = torch.tensor([3, 1], dtype=torch.int32)
    vs = dict(vertical=torch.tensor([0, 0, 9, 5, 4, 7]), slash=torch.tensor([0, 0, 3, 6, 8, 11]),
              sink_columns=torch.tensor([0, 0, 2, 9, 1, 3]), local_diagonals=torch.tensor([0, 0, 0, 2, 5, 20]))
    resolved = vertical_slash_budgets(*vs.values(), heads, 2)
    assert [x.tolist() for x in resolved] == [[7, 5], [11, 6], [3, 5], [11, 2]]  # global heads 5 and 3
    kw = dict(heads=heads, head_offset=2, last_q=8)
    for a, b in zip(portable.vertical_slash_index(q, k, **vs, **kw),
                    portable.vertical_slash_index(q, k, **vs, **kw, resolved=resolved)):
        assert torch.equal(a, b)
    bs = dict(top_k=torch.tensor([0, 0, 3, 2, 5, 1]), sink_blocks=torch.tensor([0, 0, 1, 4, 0, 2]))
    resolved_bs = block_sparse_budgets(*bs.values(), True, heads, 2)
    assert [x.tolist() for x in resolved_bs] == [[1, 2], [0, 1]]
    assert torch.equal(portable.block_sparse_index(q, k, **bs, block=16, heads=heads, head_offset=2),
                       portable.block_sparse_index(q, k, **bs, block=16, heads=heads, head_offset=2,
                                                   resolved=resolved_bs))
    with pytest.raises(TypeError, match="tuple of 4"):
        portable.vertical_slash_index(q, k, **vs, **kw, resolved=resolved[:3])
    with pytest.raises(ValueError, match="int64 tensors of shape"):
        portable.vertical_slash_index(q, k, **vs, **kw, resolved=tuple(x.int() for x in resolved))


def _to_cuda(kw: dict) -> dict:
    return {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}


@pytest.mark.gpu
@given(st.data())
def test_vertical_slash_on_gpu_bf16(data) -> None:
    """The compiled kernels on CUDA in bf16 against the naive twin."""
    shape, q, k, vertical, slash, kw = _vs_case(data, torch.bfloat16, GPU_SHAPES)
    fv, fs, fcol, fdiag = triton_builders.vertical_slash_index(q.cuda(), k.cuda(), vertical, slash, **_to_cuda(kw))
    nv, ns, ncol, ndiag = naive.vertical_slash_index(q, k, vertical, slash, **kw)  # on the CPU: faster
    fcol, fdiag = fcol.cpu(), fdiag.cpu()
    torch.testing.assert_close(fcol.double(), ncol, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    torch.testing.assert_close(fdiag.double(), ndiag, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert_same_selection(fv.cpu(), nv.cpu(), ncol.cpu(), "vertical")
    assert_same_selection(fs.cpu(), ns.cpu(), ndiag.cpu(), "slash")


@pytest.mark.gpu
@given(st.data())
def test_block_sparse_on_gpu_bf16(data) -> None:
    shape, q, k, top_k, kw = _bs_case(data, torch.bfloat16, GPU_SHAPES)
    fb, fscores = triton_builders.block_sparse_index(q.cuda(), k.cuda(), top_k, **_to_cuda(kw))
    nb, nscores = naive.block_sparse_index(q, k, top_k, **kw)
    fscores = fscores.cpu()
    fin = torch.isfinite(nscores)
    torch.testing.assert_close(fscores.double()[fin], nscores[fin], rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert_same_selection(fb.cpu(), nb.cpu(), nscores.cpu(), "blocks")
