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


def _patterns(N: int, H: int):
    """One call per pattern on heads ``0..H-1`` of ``q [1, H, N, D]`` and its definition's mask
    ``[H, N, N]``: (name, run(q, k, v) -> out, mask)."""
    g = torch.Generator().manual_seed(3)
    vertical = torch.randint(0, N, (1, H, 4), generator=g, dtype=torch.int32)
    slash = torch.cat([torch.zeros(1, H, 1, dtype=torch.int32),
                       torch.randint(1, N, (1, H, 5), generator=g, dtype=torch.int32)], -1)
    block = 16
    nqb = -(-N // block)
    blocks = torch.randint(-1, nqb, (1, H, nqb, 3), generator=g, dtype=torch.int32)
    return [
        ("vertical_slash", lambda q, k, v: tb.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=3),
         masks.vertical_slash_mask(N, vertical[0], slash[0], 3)),
        ("block_sparse", lambda q, k, v: tb.block_sparse_attention(q, k, v, blocks, block=block),
         masks.block_sparse_mask(N, blocks[0], block)),
        ("a_shape", lambda q, k, v: tb.ashape_attention(q, k, v, 3, 20),
         masks.ashape_mask(N, 3, 20).expand(H, N, N)),
        ("dense", lambda q, k, v: tb.dense_attention(q, k, v), masks.causal_mask(N).expand(H, N, N)),
    ]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "gathered"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_non_finite_key_reaches_only_the_rows_that_read_it(monkeypatch, fused: bool, where: str) -> None:
    """Issue 19: one NaN key (or value) at position ``j`` makes NaN exactly the rows whose
    candidate set holds ``j`` (the definition), every other row stays equal to the clean run, on
    both paths (``gathered``: the exact path non-CPU devices take)."""
    if not fused:
        monkeypatch.setattr(tb, "_FLASH_CPU", None)
    N, H = 150, 2
    torch.manual_seed(0)
    q, k, v = torch.randn(1, H, N, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    j = 70
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if where == "k" else bad_v)[0, 0, j, 5] = float("nan")
    for name, run, mask in _patterns(N, H):
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
