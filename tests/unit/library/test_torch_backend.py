"""The portable PyTorch backend against the float64 reference twins (tolerance rule), and its
row-chunked candidate masks against the reference masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.reference import attention as ref
from minference.reference import masks

import minference.torch_backend as tb
from minference._checks import token_mask
from minference.testing import assert_close_to_reference, assert_not_written, poison
from minference.testing.strategies import (
    ashape_budgets,
    attention_shapes,
    block_sparse_indices,
    head_subsets,
    layouts,
    qkv,
    ragged_rows,
    tp_offsets,
    vertical_slash_indices,
)

SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=130, head_dims=(16, 32))


def _cuts(data, n: int) -> list[int]:
    """Chunk boundaries ``0 = c0 < c1 < ... = n``."""
    inner = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True)) if n > 1 else []
    return [0, *sorted(x for x in inner if x < n), n]


@given(st.data())
def test_rows_masks_equal_reference_masks(data) -> None:
    n = data.draw(st.integers(1, 70))
    cuts = _cuts(data, n)
    H = data.draw(st.integers(1, 3))
    vertical, slash = data.draw(vertical_slash_indices(1, H, n))
    block = data.draw(st.integers(1, 20))
    blocks = data.draw(block_sparse_indices(1, H, n, block))
    sink, window = data.draw(ashape_budgets(H, max_n=n))
    sinks = sink if isinstance(sink, torch.Tensor) else torch.full((H,), sink)
    windows = window if isinstance(window, torch.Tensor) else torch.full((H,), window)

    def stitched(fn):
        # Rows i0..i1-1 over keys 0..i1-1, padded with False to n keys, stacked along the rows.
        parts = [torch.nn.functional.pad(fn(i0, i1), (0, n - i1)) for i0, i1 in zip(cuts, cuts[1:])]
        return torch.cat(parts, dim=-2)

    want_vs = masks.vertical_slash_mask(n, vertical[0], slash[0])
    assert torch.equal(stitched(lambda a, b: tb.vertical_slash_rows_mask(a, b, b, vertical[0], slash[0])), want_vs)
    want_bs = masks.block_sparse_mask(n, blocks[0], block)
    assert torch.equal(stitched(lambda a, b: tb.block_sparse_rows_mask(a, b, b, blocks[0], block)), want_bs)
    want_a = torch.stack([masks.ashape_mask(n, int(g), int(w)) for g, w in zip(sinks, windows)])
    assert torch.equal(stitched(lambda a, b: tb.ashape_rows_mask(a, b, b, sinks, windows)), want_a)
    assert torch.equal(stitched(lambda a, b: tb.causal_rows_mask(a, b, b)), masks.causal_mask(n))


def _valid_rows(shape, seqlens, seqstarts) -> torch.Tensor:
    """``[B, 1, N, 1]`` bool: physical positions that hold a token of their row."""
    return token_mask(seqlens, seqstarts, shape.B, shape.N, "cpu")[:, None, :, None]


def _check(data, run_fast, run_ref, shape, q, k, v, seqlens, seqstarts, heads, dtype) -> None:
    """Poisoned ``out``: computed heads x valid rows follow the tolerance rule, everything else
    keeps its NaN; lse too."""
    out = poison(torch.empty_like(q))
    o, lse = run_fast(out=out, return_lse=True)
    assert o is out
    r64, lse64 = run_ref(compute_dtype=torch.float64)
    rsame, _ = run_ref(compute_dtype=dtype)
    ids = heads.tolist() if heads is not None else list(range(shape.Hq))
    computed = torch.zeros(1, shape.Hq, 1, 1, dtype=torch.bool)
    computed[0, ids] = True
    region = computed & _valid_rows(shape, seqlens, seqstarts)
    assert_close_to_reference(o, r64, rsame, where=region)
    assert_not_written(o, ~region)
    where_lse = region[..., 0]
    assert torch.equal(torch.isinf(lse[where_lse]), torch.isinf(lse64[where_lse]))
    fin = where_lse & torch.isfinite(lse64)
    torch.testing.assert_close(lse[fin].double(), lse64[fin], rtol=1e-4, atol=1e-4)
    assert bool(torch.isneginf(lse[~where_lse]).all())


def _case(data):
    dtype = data.draw(st.sampled_from((torch.float32, torch.float16)))
    shape = data.draw(SHAPES)
    q, k, v = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1)), layout=data.draw(layouts()))
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    return dtype, shape, q, k, v, seqlens, seqstarts, heads


@given(st.data())
def test_vertical_slash_matches_reference(data) -> None:
    dtype, shape, q, k, v, seqlens, seqstarts, heads = _case(data)
    Hg = shape.Hq if heads is None else len(heads)
    vertical, slash = data.draw(vertical_slash_indices(shape.B, Hg, shape.N))
    # gap filling is defined over the whole N axis, also for a ragged row's offsets beyond its end
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, heads=heads, fill_gaps=data.draw(st.sampled_from((0, 2, 383))))
    _check(data, lambda **o: tb.vertical_slash_attention(q, k, v, vertical, slash, **kw, **o),
           lambda compute_dtype: ref.vertical_slash_attention(q, k, v, vertical, slash, **kw, return_lse=True,
                                                              compute_dtype=compute_dtype),
           shape, q, k, v, seqlens, seqstarts, heads, dtype)


@given(st.data())
def test_block_sparse_matches_reference(data) -> None:
    dtype, shape, q, k, v, seqlens, seqstarts, heads = _case(data)
    Hg = shape.Hq if heads is None else len(heads)
    block = data.draw(st.sampled_from((1, 5, 16, 32, 64)))
    blocks = data.draw(block_sparse_indices(shape.B, Hg, shape.N, block))
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, heads=heads, block=block)
    _check(data, lambda **o: tb.block_sparse_attention(q, k, v, blocks, **kw, **o),
           lambda compute_dtype: ref.block_sparse_attention(q, k, v, blocks, **kw, return_lse=True,
                                                            compute_dtype=compute_dtype),
           shape, q, k, v, seqlens, seqstarts, heads, dtype)


@given(st.data())
def test_ashape_and_dense_match_reference(data) -> None:
    dtype, shape, q, k, v, seqlens, seqstarts, heads = _case(data)
    head_offset, H_global = data.draw(tp_offsets(shape.Hq))
    sink, window = data.draw(ashape_budgets(H_global, max_n=shape.N))
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, heads=heads)
    _check(data, lambda **o: tb.ashape_attention(q, k, v, sink, window, head_offset=head_offset, **kw, **o),
           lambda compute_dtype: ref.ashape_attention(q, k, v, sink, window, head_offset=head_offset, **kw,
                                                      return_lse=True, compute_dtype=compute_dtype),
           shape, q, k, v, seqlens, seqstarts, heads, dtype)
    _check(data, lambda **o: tb.dense_attention(q, k, v, **kw, **o),
           lambda compute_dtype: ref.dense_attention(q, k, v, **kw, return_lse=True, compute_dtype=compute_dtype),
           shape, q, k, v, seqlens, seqstarts, heads, dtype)


def test_chunking_does_not_change_the_result(monkeypatch) -> None:
    """Many small chunks and one big chunk give the same output (chunk edges are exact)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    vertical = torch.randint(-1, 200, (1, 4, 9), dtype=torch.int32)
    slash = torch.randint(-1, 200, (1, 4, 9), dtype=torch.int32)
    whole = tb.vertical_slash_attention(q, k, v, vertical, slash)
    monkeypatch.setattr(tb, "CHUNK_ELEMENTS", 4 * 200 * 7)  # 7 rows per chunk
    pieces = tb.vertical_slash_attention(q, k, v, vertical, slash)
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-6)


def test_empty_rows_are_zero() -> None:
    q, k, v = torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16)
    vertical = torch.tensor([[[4]]], dtype=torch.int32)  # rows 0..3 see nothing
    slash = torch.tensor([[[-1]]], dtype=torch.int32)
    out, lse = tb.vertical_slash_attention(q, k, v, vertical, slash, return_lse=True)
    assert torch.equal(out[0, 0, :4], torch.zeros(4, 16))
    assert bool(torch.isneginf(lse[0, 0, :4]).all()) and bool(torch.isfinite(lse[0, 0, 4:]).all())
    torch.testing.assert_close(out[0, 0, 4:], v[0, 0, 4].expand(2, 16))


def test_argument_errors() -> None:
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    bad = torch.zeros(1, 3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="vertical"):
        tb.vertical_slash_attention(q, k, v, bad, bad)
    with pytest.raises(ValueError, match="blocks"):
        tb.block_sparse_attention(q, k, v, torch.full((1, 2, 1, 2), 5, dtype=torch.int32), block=8)
    with pytest.raises(ValueError, match="window"):
        tb.ashape_attention(q, k, v, 0, 0)
    with pytest.raises(ValueError, match="heads"):
        tb.dense_attention(q, k, v, heads=torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="q"):
        tb.dense_attention(q.numpy(), k, v)


def _patterns(N: int, H: int, **kw):
    """One call per pattern on heads ``0..H-1`` of ``q [1, H, N, D]`` and its definition's mask
    ``[H, N, N]``: (name, run(q, k, v) -> out, mask); ``kw`` goes to every call."""
    g = torch.Generator().manual_seed(3)
    vertical = torch.randint(0, N, (1, H, 4), generator=g, dtype=torch.int32)
    slash = torch.cat([torch.zeros(1, H, 1, dtype=torch.int32),
                       torch.randint(1, N, (1, H, 5), generator=g, dtype=torch.int32)], -1)
    block = 16
    nqb = -(-N // block)
    blocks = torch.randint(-1, nqb, (1, H, nqb, 3), generator=g, dtype=torch.int32)
    return [
        ("vertical_slash", lambda q, k, v: tb.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=3, **kw),
         masks.vertical_slash_mask(N, vertical[0], slash[0], 3)),
        ("block_sparse", lambda q, k, v: tb.block_sparse_attention(q, k, v, blocks, block=block, **kw),
         masks.block_sparse_mask(N, blocks[0], block)),
        ("a_shape", lambda q, k, v: tb.ashape_attention(q, k, v, 3, 20, **kw),
         masks.ashape_mask(N, 3, 20).expand(H, N, N)),
        ("dense", lambda q, k, v: tb.dense_attention(q, k, v, **kw), masks.causal_mask(N).expand(H, N, N)),
    ]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "gathered"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_non_finite_key_reaches_only_the_rows_that_read_it(monkeypatch, fused: bool, where: str) -> None:
    """Issue 19: one NaN key (or value) at position ``j`` makes NaN exactly the rows whose
    candidate set holds ``j`` (the definition), every other row stays equal to the clean run, on
    both paths (``gathered``: the exact path non-CPU devices take). Validation off: on, the
    input is refused (:func:`test_validation_refuses_non_finite_kv_naming_kv_head_and_query_heads`)."""
    if not fused:
        monkeypatch.setattr(tb, "_FLASH_CPU", None)
    N, H = 150, 2
    torch.manual_seed(0)
    q, k, v = torch.randn(1, H, N, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    j = 70
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if where == "k" else bad_v)[0, 0, j, 5] = float("nan")
    for name, run, mask in _patterns(N, H, validate=False):
        clean, out = run(q, k, v), run(q, bad_k, bad_v)
        reads = mask[:, :, j]  # [H, N]: row i's set holds key j
        assert bool(reads.any()) and bool((~reads).any()), name
        nan = torch.isnan(out[0]).any(-1)
        assert torch.equal(nan, reads), (name, (nan != reads).nonzero()[:5].tolist())
        torch.testing.assert_close(out[0][~reads], clean[0][~reads], rtol=0, atol=1e-6, msg=name)


@given(st.data())
def test_gathered_path_matches_reference(data) -> None:
    """The exact gathered path (non-finite inputs, non-CPU devices) under the tolerance rule."""
    import minference.torch_backend as backend

    saved = backend._FLASH_CPU
    backend._FLASH_CPU = None
    try:
        test_vertical_slash_matches_reference.hypothesis.inner_test(data)
        test_block_sparse_matches_reference.hypothesis.inner_test(data)
        test_ashape_and_dense_match_reference.hypothesis.inner_test(data)
    finally:
        backend._FLASH_CPU = saved


def test_work_follows_the_chosen_set(monkeypatch) -> None:
    """No call of the fused kernel sees more keys per query tile than the tile's candidates need
    (plus the tile's own span): a narrow band at 4096 tokens never reads the whole row."""
    calls = []
    real = tb._FLASH_CPU

    def spy(q, k, v, *a, **kw):
        calls.append(k.shape[-2])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(tb, "_FLASH_CPU", spy)
    N = 4096
    q, k, v = torch.randn(1, 2, N, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    tb.ashape_attention(q, k, v, 8, 100)
    slash = torch.arange(50, dtype=torch.int32).expand(1, 2, 50)
    tb.vertical_slash_attention(q, k, v, torch.tensor([[[0, 9, 700]]] * 2, dtype=torch.int32).view(1, 2, 3), slash)
    blocks = torch.stack([torch.tensor([0, i]) for i in range(N // 64)]).expand(1, 2, -1, -1).int()
    tb.block_sparse_attention(q, k, v, blocks, block=64)
    assert calls and max(calls) <= 2 * 64 + 100, calls


#: Grouped heads for the non-finite tests (issue 34): ``Hq / Hkv >= 2`` and more than one kv head,
#: so query head ``h`` reads kv head ``h // group``, which differs from ``h % Hkv`` and ``h // Hkv``.
GQA_SHAPES = [(6, 2), (6, 3)]


def _gqa_patterns(N: int, Hq: int, block: int = 16):
    """Every pattern on ``Hq`` heads with fixed indices: ``(name, run(q, k, v, **kw), ref(q, k, v,
    compute_dtype) -> out, mask [Hq, N, N])``."""
    g = torch.Generator().manual_seed(5)
    vertical = torch.randint(0, N, (1, Hq, 3), generator=g, dtype=torch.int32)
    slash = torch.cat([torch.zeros(1, Hq, 1, dtype=torch.int32),
                       torch.randint(1, N, (1, Hq, 4), generator=g, dtype=torch.int32)], -1)
    nqb = -(-N // block)
    blocks = torch.cat([torch.zeros(1, Hq, nqb, 1, dtype=torch.int32),  # the sink block: every row reads it
                        torch.randint(-1, nqb, (1, Hq, nqb, 2), generator=g, dtype=torch.int32)], -1)
    def sub(idx, heads):  # index tensors carry one row per computed head
        return idx if heads is None else idx[:, heads]

    return [
        ("a_shape", lambda q, k, v, **kw: tb.ashape_attention(q, k, v, 2, 12, **kw),
         lambda q, k, v, dt: ref.ashape_attention(q, k, v, 2, 12, compute_dtype=dt),
         masks.ashape_mask(N, 2, 12).expand(Hq, N, N)),
        ("vertical_slash", lambda q, k, v, heads=None, **kw: tb.vertical_slash_attention(
            q, k, v, sub(vertical, heads), sub(slash, heads), heads=heads, **kw),
         lambda q, k, v, dt: ref.vertical_slash_attention(q, k, v, vertical, slash, compute_dtype=dt),
         masks.vertical_slash_mask(N, vertical[0], slash[0])),
        ("block_sparse", lambda q, k, v, heads=None, **kw: tb.block_sparse_attention(
            q, k, v, sub(blocks, heads), block=block, heads=heads, **kw),
         lambda q, k, v, dt: ref.block_sparse_attention(q, k, v, blocks, block=block, compute_dtype=dt),
         masks.block_sparse_mask(N, blocks[0], block)),
        ("dense", lambda q, k, v, **kw: tb.dense_attention(q, k, v, **kw),
         lambda q, k, v, dt: ref.dense_attention(q, k, v, compute_dtype=dt),
         masks.causal_mask(N).expand(Hq, N, N)),
    ]


def _gqa_inputs(Hq: int, Hkv: int, N: int = 97, D: int = 16):
    g = torch.Generator().manual_seed(Hq * 10 + Hkv)
    return (torch.randn(1, Hq, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g),
            torch.randn(1, Hkv, N, D, generator=g))


def _readers(j: int, group: int, computed=None) -> str:
    heads = [h for h in range(j * group, (j + 1) * group) if computed is None or h in computed]
    return f"kv head {j}, read by query heads \\[{', '.join(map(str, heads))}\\];"


@pytest.mark.parametrize("Hq,Hkv", GQA_SHAPES)
def test_validation_refuses_non_finite_kv_naming_kv_head_and_query_heads(Hq, Hkv) -> None:
    """Issue 34: with validation on (the default) every attention function of the backend refuses
    a NaN or inf in one element of one key or value row, with the Triton kernels' one-line error
    naming the kv head and the query heads that read it; computing only heads that read another
    kv head, the same input is no error (the kv head is not read). Before, the backend returned
    finite wrong numbers for a NaN value element (1.85 where the definition gave 0.918)."""
    group = Hq // Hkv
    q, k, v = _gqa_inputs(Hq, Hkv)
    t = 40
    for name, run, _, _ in _gqa_patterns(q.shape[2], Hq):
        for j in range(Hkv):
            for which, bad in (("v", float("nan")), ("k", float("inf"))):
                kk, vv = k.clone(), v.clone()
                (vv if which == "v" else kk)[0, j, t, 3] = bad
                with pytest.raises(ValueError, match=f"{which} holds NaN or inf at batch row 0, token {t} "
                                                     f"\\({_readers(j, group)}"):
                    run(q, kk, vv)
                mine = torch.tensor([j * group + group - 1])
                with pytest.raises(ValueError, match=_readers(j, group, computed={j * group + group - 1})):
                    run(q, kk, vv, heads=mine)
                other = torch.tensor([((j + 1) % Hkv) * group])  # reads kv head j + 1 only
                out = run(q, kk, vv, heads=other)
                assert torch.isfinite(out).all(), (name, j, which)


@pytest.mark.parametrize("Hq,Hkv", GQA_SHAPES)
def test_validate_off_a_non_finite_value_element_leaves_the_other_elements_exact(Hq, Hkv) -> None:
    """Issue 34, validation off: a NaN in element ``d`` of value row ``t`` (one kv head) makes NaN
    exactly element ``d`` of the rows whose set holds ``t`` (in the query heads of that kv head);
    every other element (the same rows' other elements included, which came out finite but wrong
    before) follows the float64 definition under the tolerance rule."""
    group = Hq // Hkv
    q, k, v = _gqa_inputs(Hq, Hkv)
    N, t, d = q.shape[2], 40, 3
    for j in range(Hkv):
        vb = v.clone()
        vb[0, j, t, d] = float("nan")
        v0 = vb.clone()
        v0[0, j, t] = 0.0  # the definition of the elements that do not read the NaN
        for name, run, run_ref, mask in _gqa_patterns(N, Hq):
            out = run(q, k, vb, validate=False)
            reads = torch.zeros(Hq, N, dtype=torch.bool)
            reads[j * group : (j + 1) * group] = mask[j * group : (j + 1) * group, :, t]
            assert bool(reads.any()) and bool((~reads).any()), name
            want_nan = torch.zeros_like(out, dtype=torch.bool)
            want_nan[0, :, :, d] = reads
            assert torch.equal(~torch.isfinite(out), want_nan), (name, j)
            r64, rsame = run_ref(q, k, vb, torch.float64), run_ref(q, k, vb, torch.float32)
            # the reference's einsum spreads 0 * NaN over column d of the whole kv group: there
            # the definition is the run with the row zeroed (a row outside the set never reads it)
            z64, zsame = run_ref(q, k, v0, torch.float64), run_ref(q, k, v0, torch.float32)
            col = torch.zeros_like(want_nan)
            col[..., d] = True
            r64, rsame = torch.where(col & ~want_nan, z64, r64), torch.where(col & ~want_nan, zsame, rsame)
            assert_close_to_reference(out, r64, rsame, where=~want_nan, name=f"{name} kv head {j}")


@pytest.mark.parametrize("Hq,Hkv", GQA_SHAPES)
def test_dispatcher_torch_backend_non_finite_value(Hq, Hkv) -> None:
    """Issue 34 through ``sparse_prefill(..., backend="torch")`` with a mixed plan (A-shape,
    vertical-slash, block-sparse, dense heads): validation on refuses a NaN value element with the
    kv head and its query heads named; validation off leaves every element but ``d`` of every
    output row equal to the clean run's (a value row's finite elements are the same numbers), and
    ``d`` NaN in the rows that read the token only."""
    from minference.dispatch import sparse_prefill
    from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

    group = Hq // Hkv
    q, k, v = _gqa_inputs(Hq, Hkv, N=160)
    kinds = [AShape(sink=2, window=24), VerticalSlash(vertical=4, slash=6, last_q=16, sink_columns=2,
                                                     local_diagonals=4),
             BlockSparse(top_k=3, block=16, sink_blocks=1), Dense()]
    plan = [kinds[h % len(kinds)] for h in range(Hq)]
    t, d = 17, 5  # inside the first block (every block-sparse row reads it) and the A-shape window of rows 17..40
    clean = sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch", validate=False)
    for j in range(Hkv):
        vb = v.clone()
        vb[0, j, t, d] = float("nan")
        with pytest.raises(ValueError, match=f"v holds NaN or inf at batch row 0, token {t} \\({_readers(j, group)}"):
            sparse_prefill(q, k, vb, plan, dense_threshold=0, backend="torch")
        out = sparse_prefill(q, k, vb, plan, dense_threshold=0, backend="torch", validate=False)
        others = torch.ones(out.shape[-1], dtype=torch.bool)
        others[d] = False
        assert torch.isfinite(out[..., others]).all(), j
        torch.testing.assert_close(out[..., others], clean[..., others], rtol=1e-5, atol=1e-6, msg=f"kv head {j}")
        nan_rows = torch.isnan(out[0, :, :, d])  # [Hq, N]
        assert torch.equal(nan_rows.any(-1), torch.arange(Hq) // group == j), j  # each reader head reads t
        assert not nan_rows[:, :t].any(), j  # causal: no row before t reads it
        v0 = vb.clone()
        v0[0, j, t] = 0.0  # element d of a row that does not read t: the run with that value row zeroed
        zeroed = sparse_prefill(q, k, v0, plan, dense_threshold=0, backend="torch", validate=False)
        torch.testing.assert_close(out[0, :, :, d][~nan_rows], zeroed[0, :, :, d][~nan_rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fill_gaps", [0, 40])
def test_a_solid_band_at_offset_zero_runs_causal_and_stays_exact(monkeypatch, fill_gaps) -> None:
    """The fused path's causal shortcut: offsets ``0..b`` all chosen (the local diagonals, an
    A-shape window; with gap filling a band with holes closes) make the rows ``i <= b`` causal,
    run as one causal call; the columns and the other clusters add to the later rows only. Bands
    several tiles wide, with columns inside and outside the band, against the float64 twins
    (the hypothesis cases are shorter than two tiles)."""
    calls = []
    real = tb._FLASH_CPU

    def spy(q, k, v, *a, **kw):
        calls.append(bool(kw.get("is_causal")))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(tb, "_FLASH_CPU", spy)
    N, Hq, Hkv, D = 333, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, N, D, generator=g) for h in (Hq, Hkv, Hkv))
    band = torch.arange(0, 200, 3 if fill_gaps else 1, dtype=torch.int32)  # holes of 2 closed by fill 40
    slash = torch.cat([band, torch.tensor([260, 261, 300], dtype=torch.int32)]).expand(1, Hq, -1).contiguous()
    vertical = torch.tensor([3, 50, 120, 250, 330], dtype=torch.int32).expand(1, Hq, -1).contiguous()
    for kw in ({}, dict(q_seqlens=100)):  # whole rows; the last 100 rows as queries (no shortcut)
        qq = q[:, :, N - 100 :] if kw else q
        calls.clear()
        out = tb.vertical_slash_attention(qq, k, v, vertical, slash, fill_gaps=fill_gaps, **kw)
        assert any(calls) == (not kw), calls
        r64 = ref.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=fill_gaps)
        rs = ref.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=fill_gaps, compute_dtype=torch.float32)
        rows = slice(N - 100, N) if kw else slice(0, N)
        assert_close_to_reference(out, r64[:, :, rows], rs[:, :, rows], name=f"vertical_slash {kw}")
        calls.clear()
        out = tb.ashape_attention(qq, k, v, 5, 150, **kw)
        assert any(calls) == (not kw), calls
        r64 = ref.ashape_attention(q, k, v, 5, 150)
        rs = ref.ashape_attention(q, k, v, 5, 150, compute_dtype=torch.float32)
        assert_close_to_reference(out, r64[:, :, rows], rs[:, :, rows], name=f"a_shape {kw}")


@pytest.mark.parametrize("query_rows", [None, 300, 600])
def test_parts_of_the_heads_rows_stay_exact(monkeypatch, query_rows) -> None:
    """Each head's tiles cut into parts for the head workers (:func:`_parts`): every pattern,
    a solid band whose causal tiles start inside a part, whole rows and query rows (600: the first
    query tile starts inside the solid band, with rows before the first query), against the
    float64 twins; the cut really happens (more tasks than heads, parts that start after tile 0)."""
    tasks = []
    real = tb._each_task

    def spy(fn, parts, threads):
        tasks.append(list(parts))
        return real(fn, parts, threads)

    monkeypatch.setattr(tb, "_each_task", spy)
    monkeypatch.setattr(tb, "PARTS_PER_THREAD", 16)
    N, Hq, Hkv, D = 700, 4, 2, 16
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, N, D, generator=g) for h in (Hq, Hkv, Hkv))
    slash = torch.cat([torch.arange(0, 330, dtype=torch.int32), torch.tensor([400, 401, 520], dtype=torch.int32)])
    vertical = torch.tensor([3, 50, 120, 450, 690], dtype=torch.int32).expand(1, Hq, -1).contiguous()
    slash = slash.expand(1, Hq, -1).contiguous()
    nqb = -(-N // 64)
    blocks = torch.stack([torch.tensor([0, i, max(0, i - 3)]) for i in range(nqb)]).expand(1, Hq, -1, -1).int()
    runs = [
        ("vertical_slash", lambda qq, **kw: tb.vertical_slash_attention(qq, k, v, vertical, slash, **kw),
         lambda dt: ref.vertical_slash_attention(q, k, v, vertical, slash, compute_dtype=dt)),
        ("a_shape", lambda qq, **kw: tb.ashape_attention(qq, k, v, 5, 260, **kw),
         lambda dt: ref.ashape_attention(q, k, v, 5, 260, compute_dtype=dt)),
        ("block_sparse", lambda qq, **kw: tb.block_sparse_attention(qq, k, v, blocks, block=64, **kw),
         lambda dt: ref.block_sparse_attention(q, k, v, blocks, block=64, compute_dtype=dt)),
        ("dense", lambda qq, **kw: tb.dense_attention(qq, k, v, **kw),
         lambda dt: ref.dense_attention(q, k, v, compute_dtype=dt)),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the parts are cut only for more than one head worker
    try:
        kw = {} if query_rows is None else dict(q_seqlens=query_rows)
        qq = q if query_rows is None else q[:, :, N - query_rows :]
        rows = slice(0, N) if query_rows is None else slice(N - query_rows, N)
        for name, run, reference in runs:
            tasks.clear()
            out = run(qq, **kw)
            assert len(tasks[0]) > Hq and any(c0 > 0 for _, c0, _ in tasks[0]), (name, tasks)
            assert_close_to_reference(out, reference(torch.float64)[:, :, rows], reference(torch.float32)[:, :, rows],
                                      name=f"{name} {kw}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["inference", "no_grad"])
def test_head_workers_take_the_callers_grad_mode(mode) -> None:
    """The head workers run in the caller's mode: an output made under ``torch.inference_mode``
    is written there (a worker outside it may not update an inference tensor in place), and
    nothing computed under ``no_grad`` records a graph."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g), torch.randn(
        1, 2, 300, 16, generator=g)
    k.requires_grad_(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode() if mode == "inference" else torch.no_grad():
            out = tb.dense_attention(q, k, v, out=torch.zeros_like(q))
            assert not out.requires_grad
    finally:
        torch.set_num_threads(threads)
    kd = k.detach()
    assert_close_to_reference(out, ref.dense_attention(q, kd, v),
                              ref.dense_attention(q, kd, v, compute_dtype=torch.float32), name=mode)


def test_a_wide_cluster_after_the_first_tiles_reads_only_its_padding(monkeypatch) -> None:
    """A cluster of offsets ``a..b`` wider than several tiles, not solid from offset 0: its tiles
    before ``b / R`` run in chunks whose earlier tiles read keys before key 0 (masked), which lie
    in the keys' zero padding; the padding is as deep as the largest chosen offset. Against the
    float64 twins, with the padding's depth checked on every window."""
    N, Hq, Hkv, D = 1500, 2, 1, 16
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, h, N, D, generator=g) for h in (Hq, Hkv, Hkv))
    slash = torch.arange(100, 1201, dtype=torch.int32).expand(1, Hq, -1).contiguous()
    vertical = torch.tensor([[[0, 7]] * Hq], dtype=torch.int32)
    strided = []
    real = torch.Tensor.as_strided

    def spy(t, size, stride, offset=None):
        strided.append(offset - t.storage_offset())
        return real(t, size, stride, offset)

    monkeypatch.setattr(torch.Tensor, "as_strided", spy)
    out = tb.vertical_slash_attention(q, k, v, vertical, slash)
    monkeypatch.undo()
    assert min(strided) < 1200 * D, "no window read keys before key 0"
    assert_close_to_reference(out, ref.vertical_slash_attention(q, k, v, vertical, slash),
                              ref.vertical_slash_attention(q, k, v, vertical, slash, compute_dtype=torch.float32),
                              name="wide cluster")


def _with_threads(count: int, fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _one_thread(fn):
    return _with_threads(1, fn)


def _two_threads(fn):
    return _with_threads(2, fn)


def test_a_call_that_records_gradients_is_refused() -> None:
    """The backend is for inference: its pieces merge by log-sum-exp, of which the CPU flash kernel
    gives no gradient (autograd through it was wrong by up to 16 at two threads). A call that would
    record a graph is refused in one line; under no_grad, or on detached inputs, it runs."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 16, generator=g) for h in (2, 1, 1))
    k.requires_grad_(True)
    for run in (_one_thread, _two_threads):
        with pytest.raises(RuntimeError, match="for inference"):
            run(lambda: tb.dense_attention(q, k, v))
        with torch.no_grad():
            run(lambda: tb.dense_attention(q, k, v))
        run(lambda: tb.dense_attention(q, k.detach(), v))


def test_autocast_does_not_change_the_backend() -> None:
    """The backend chooses its compute dtypes: under CPU autocast the vertical-slash index (whose
    scores a bf16 matmul broke) and the attention equal the results without it, at one thread
    and at two (autocast is per thread: the head workers never had it)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, 200, 16, generator=g) for h in (2, 1, 1))
    want = tb.vertical_slash_index(q, k, 8, 12, last_q=16)
    out = tb.vertical_slash_attention(q, k, v, *want)
    for run in (_one_thread, _two_threads):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run(lambda: tb.vertical_slash_index(q, k, 8, 12, last_q=16))
            attn = run(lambda: tb.vertical_slash_attention(q, k, v, *want))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert attn.dtype == torch.float32
        torch.testing.assert_close(attn, out, rtol=0, atol=0)


def test_concurrent_calls_with_other_thread_counts_and_a_fork() -> None:
    """The head workers are shared: callers in several threads, each with its own intra-op thread
    count, all finish with the right result (a larger pool never shuts down one in use); a forked
    child makes its own workers (the parent's threads do not exist there; it hung)."""
    import multiprocessing
    import threading

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, 256, 16, generator=g) for h in (4, 2, 2))
    want = tb.dense_attention(q, k, v)
    errors = []

    def caller(count: int) -> None:
        torch.set_num_threads(count)
        try:
            for _ in range(5):
                torch.testing.assert_close(tb.dense_attention(q, k, v), want, rtol=0, atol=0)
        except BaseException as error:
            errors.append(error)

    _two_threads(lambda: tb.dense_attention(q, k, v))  # the parent's workers exist
    callers = [threading.Thread(target=caller, args=(n,)) for n in (2, 3, 2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert not errors, errors
    child = multiprocessing.get_context("fork").Process(target=_child_call, args=(q, k, v, want))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, child.exitcode


def _child_call(q, k, v, want) -> None:
    torch.set_num_threads(2)
    torch.testing.assert_close(tb.dense_attention(q, k, v), want, rtol=0, atol=0)


def test_an_error_in_a_task_is_raised_by_the_call(monkeypatch) -> None:
    """A task that raises on a head worker: the call raises it (after its other runners stopped)."""
    real = tb._fused_band

    def failing(acc_o, acc_l, qh, kpad, vpad, pad, band, scale, t0=0):
        if t0 > 0:
            raise ArithmeticError("planted")
        return real(acc_o, acc_l, qh, kpad, vpad, pad, band, scale, t0)

    monkeypatch.setattr(tb, "_fused_band", failing)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 700, 16, generator=g) for h in (2, 1, 1))
    slash = torch.arange(0, 50, dtype=torch.int32).expand(1, 2, -1).contiguous()
    with pytest.raises(ArithmeticError, match="planted"):
        _two_threads(lambda: tb.vertical_slash_attention(q, k, v, torch.zeros(1, 2, 1, dtype=torch.int32), slash))
