"""Query rows (docs/kernels.md, "Query rows: a chunk after a cache, or a row's last tokens") on
the portable torch backend: its four attention functions against the float64 definition
:func:`minference.reference.attention.query_rows_attention` (tolerance rule, as
test_torch_backend.py), on both of its paths; merging two disjoint sets; the argument errors;
the definition itself; and that the work follows the query rows."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.reference import attention as ref

import minference.torch_backend as tb
from minference.testing import FLOORS, assert_close_to_reference, assert_not_written, poison
from minference.testing.strategies import (
    ashape_budgets,
    attention_shapes,
    block_sparse_indices,
    head_subsets,
    layouts,
    qkv,
    query_rows,
    ragged_rows,
    tp_offsets,
    vertical_slash_indices,
)

SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=130, head_dims=(16, 32))


@contextlib.contextmanager
def _path(fused: bool):
    """The fused CPU path, or the exact gathered one (non-finite inputs, other devices)."""
    saved = tb._FLASH_CPU
    if not fused:
        tb._FLASH_CPU = None
    try:
        yield
    finally:
        tb._FLASH_CPU = saved


def _case(data):
    """Inputs of one query-rows call: ``q [B,Hq,Nq,D]`` (rows that hold no query are NaN: never
    read), ``k, v [B,Hkv,N,D]``, ragged key rows, query rows, heads; ``kw`` the shared keywords and
    ``region [B,Hq,Nq,1]`` the computed (head, query row) pairs."""
    dtype = data.draw(st.sampled_from((torch.float32, torch.float16)))
    shape = data.draw(SHAPES)
    q_full, k, v = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1)), layout=data.draw(layouts()))
    seqlens, seqstarts = data.draw(st.one_of(st.just((None, None)), ragged_rows(shape.B, shape.N)))
    Nq, q_seqlens, q_seqstarts, q_lens, q_starts = data.draw(query_rows(shape.B, shape.N, seqlens, seqstarts))
    rows = torch.zeros(shape.B, Nq, dtype=torch.bool)
    for b, (c, qs) in enumerate(zip(q_lens, q_starts)):
        rows[b, qs : qs + c] = True
    q = q_full[:, :, shape.N - Nq :]
    q.masked_fill_(~rows[:, None, :, None], float("nan"))
    heads = data.draw(head_subsets(shape.Hq))
    computed = torch.zeros(1, shape.Hq, 1, 1, dtype=torch.bool)
    computed[0, heads.tolist() if heads is not None else list(range(shape.Hq))] = True
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, heads=heads, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts)
    return dtype, shape, q, k, v, kw, computed & rows[:, None, :, None]


def _check(data, run_fast, run_ref, dtype, region) -> None:
    """Computed heads x query rows follow the tolerance rule against the definition; everything
    else keeps the NaN of a given ``out`` (or is 0 in a fresh one), lse ``-inf``."""
    given_out = data.draw(st.booleans())
    if given_out:
        out = poison(torch.empty(run_ref.shape, dtype=dtype))
        o, lse = run_fast(out=out, return_lse=True)
        assert o is out
    else:
        o, lse = run_fast(return_lse=True)
    r64, lse64 = run_ref(compute_dtype=torch.float64)
    rsame, _ = run_ref(compute_dtype=dtype)
    assert o.shape == r64.shape and lse.shape == lse64.shape and o.dtype == dtype
    assert_close_to_reference(o, r64, rsame, where=region)
    if given_out:
        assert_not_written(o, ~region)
    else:
        assert bool((o[~region.expand_as(o)] == 0).all())
    where_lse = region[..., 0]
    assert torch.equal(torch.isinf(lse[where_lse]), torch.isinf(lse64[where_lse]))
    fin = where_lse & torch.isfinite(lse64)
    torch.testing.assert_close(lse[fin].double(), lse64[fin], rtol=1e-4, atol=1e-4)
    assert bool(torch.isneginf(lse[~where_lse]).all())


class _Ref:
    """``run_ref(compute_dtype) -> (out, lse)`` of the definition; ``shape`` its output's."""

    def __init__(self, fn, q, k, v, *args, **kw):
        self.shape = q.shape
        self.call = lambda compute_dtype: ref.query_rows_attention(fn, q, k, v, *args, compute_dtype=compute_dtype,
                                                                   **kw)

    def __call__(self, compute_dtype):
        return self.call(compute_dtype)


@given(st.data())
def test_vertical_slash_query_rows_match_the_definition(data) -> None:
    dtype, shape, q, k, v, kw, region = _case(data)
    Hg = shape.Hq if kw["heads"] is None else len(kw["heads"])
    vertical, slash = data.draw(vertical_slash_indices(shape.B, Hg, shape.N))
    kw["fill_gaps"] = data.draw(st.sampled_from((0, 2, 383)))
    with _path(data.draw(st.booleans())):
        _check(data, lambda **o: tb.vertical_slash_attention(q, k, v, vertical, slash, **kw, **o),
               _Ref(ref.vertical_slash_attention, q, k, v, vertical, slash, **kw), dtype, region)


@given(st.data())
def test_block_sparse_query_rows_match_the_definition(data) -> None:
    dtype, shape, q, k, v, kw, region = _case(data)
    Hg = shape.Hq if kw["heads"] is None else len(kw["heads"])
    kw["block"] = data.draw(st.sampled_from((1, 5, 16, 32, 64)))
    blocks = data.draw(block_sparse_indices(shape.B, Hg, shape.N, kw["block"]))  # per query block of the key row
    with _path(data.draw(st.booleans())):
        _check(data, lambda **o: tb.block_sparse_attention(q, k, v, blocks, **kw, **o),
               _Ref(ref.block_sparse_attention, q, k, v, blocks, **kw), dtype, region)


@given(st.data())
def test_ashape_and_dense_query_rows_match_the_definition(data) -> None:
    dtype, shape, q, k, v, kw, region = _case(data)
    head_offset, H_global = data.draw(tp_offsets(shape.Hq))
    sink, window = data.draw(ashape_budgets(H_global, max_n=shape.N))
    with _path(data.draw(st.booleans())):
        _check(data, lambda **o: tb.ashape_attention(q, k, v, sink, window, head_offset=head_offset, **kw, **o),
               _Ref(ref.ashape_attention, q, k, v, sink, window, head_offset=head_offset, **kw), dtype, region)
        _check(data, lambda **o: tb.dense_attention(q, k, v, **kw, **o), _Ref(ref.dense_attention, q, k, v, **kw),
               dtype, region)


@given(st.data())
def test_disjoint_sets_merge_into_their_union(data) -> None:
    """Block-sparse over two disjoint block sets of the same query rows (at random, or the blocks
    before the queries' first block, a cache, against the rest), joined by the reference
    ``merge_attention``, is the call over their union (the definition's pieces merge to its union
    in float64; the backend's pieces merge under the tolerance rule, with the same-dtype pieces
    merged as the same-dtype reference)."""
    dtype, shape, q, k, v, kw, region = _case(data)
    Hg = shape.Hq if kw["heads"] is None else len(kw["heads"])
    block = kw["block"] = data.draw(st.sampled_from((1, 5, 16, 32)))
    blocks = data.draw(block_sparse_indices(shape.B, Hg, shape.N, block))
    nqb = blocks.shape[2]
    if data.draw(st.booleans()):
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        in_a = torch.rand(shape.B, Hg, nqb, nqb, generator=g) < 0.5  # per key block id: each copy on one side
        side = in_a.gather(-1, blocks.clamp(min=0).long())
    else:
        lens = kw["seqlens"].long() if kw["seqlens"] is not None else torch.full((shape.B,), shape.N)
        q_lens = torch.as_tensor(kw["q_seqlens"] if kw["q_seqlens"] is not None else q.shape[2])
        first = ((lens - torch.minimum(q_lens.long(), lens)) // block)[:, None, None, None]
        side = blocks < first
    blocks_a = torch.where(side, blocks, -1)
    blocks_b = torch.where(side, -1, blocks)
    with _path(data.draw(st.booleans())):
        pa = tb.block_sparse_attention(q, k, v, blocks_a, **kw, return_lse=True)
        pb = tb.block_sparse_attention(q, k, v, blocks_b, **kw, return_lse=True)
    merged, merged_lse = ref.merge_attention(*pa, *pb)
    r64, lse64 = ref.query_rows_attention(ref.block_sparse_attention, q, k, v, blocks, **kw)
    ra = ref.query_rows_attention(ref.block_sparse_attention, q, k, v, blocks_a, **kw)
    rb = ref.query_rows_attention(ref.block_sparse_attention, q, k, v, blocks_b, **kw)
    m64, mlse64 = ref.merge_attention(*ra, *rb)
    torch.testing.assert_close(m64, r64, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isinf(mlse64), torch.isinf(lse64))
    fin = torch.isfinite(lse64)
    torch.testing.assert_close(mlse64[fin], lse64[fin], rtol=1e-10, atol=1e-12)
    same = [ref.query_rows_attention(ref.block_sparse_attention, q, k, v, x, **kw, compute_dtype=dtype)
            for x in (blocks_a, blocks_b)]
    msame, _ = ref.merge_attention(*same[0], *same[1])
    assert_close_to_reference(merged, r64, msame, where=region, floor=FLOORS[dtype], name="merged")
    where_lse = region[..., 0]
    assert torch.equal(torch.isinf(merged_lse[where_lse]), torch.isinf(lse64[where_lse]))
    fin = where_lse & fin
    torch.testing.assert_close(merged_lse[fin], lse64[fin], rtol=1e-4, atol=1e-4)


def test_ordinary_call_and_in_place_rows() -> None:
    """``Nq == N`` with ``q_seqlens`` computes the rows' last tokens in place: exactly what the
    ordinary call gives on those rows, every other row of ``out`` untouched."""
    torch.manual_seed(5)
    B, Hq, N, D = 2, 4, 90, 16
    q, k, v = torch.randn(B, Hq, N, D), torch.randn(B, 2, N, D), torch.randn(B, 2, N, D)
    seqlens, seqstarts = torch.tensor([90, 61], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
    q_lens = torch.tensor([33, 61], dtype=torch.int32)
    vertical = torch.randint(-1, N, (B, Hq, 6), dtype=torch.int32)
    slash = torch.randint(-1, N, (B, Hq, 6), dtype=torch.int32)
    blocks = torch.randint(-1, 6, (B, Hq, 6, 3), dtype=torch.int32)
    calls = [lambda **o: tb.dense_attention(q, k, v, **o), lambda **o: tb.ashape_attention(q, k, v, 4, 17, **o),
             lambda **o: tb.vertical_slash_attention(q, k, v, vertical, slash, **o),
             lambda **o: tb.block_sparse_attention(q, k, v, blocks, block=16, **o)]
    rows = torch.zeros(B, 1, N, 1, dtype=torch.bool)
    rows[0, :, 90 - 33 : 90], rows[1, :, 20 : 81] = True, True
    for run in calls:
        whole, whole_lse = run(seqlens=seqlens, seqstarts=seqstarts, return_lse=True)
        out = poison(torch.empty_like(q))
        part, part_lse = run(seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_lens, out=out, return_lse=True)
        torch.testing.assert_close(part[rows.expand_as(q)], whole[rows.expand_as(q)], rtol=0, atol=1e-6)
        assert_not_written(part, ~rows)
        torch.testing.assert_close(part_lse[rows[..., 0].expand(B, Hq, N)], whole_lse[rows[..., 0].expand(B, Hq, N)],
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["dense", "ashape", "vertical_slash", "block_sparse"])
def test_query_row_errors(name: str) -> None:
    B, Hq, N, D = 2, 2, 40, 16
    k, v = torch.randn(B, 1, N, D), torch.randn(B, 1, N, D)
    index = {"vertical_slash": (torch.zeros(B, Hq, 2, dtype=torch.int32),) * 2,
             "block_sparse": (torch.zeros(B, Hq, 3, 2, dtype=torch.int32),), "ashape": (2, 8), "dense": ()}[name]
    fn = getattr(tb, f"{name}_attention")
    extra = {"block": 16} if name == "block_sparse" else {}

    def call(q, **kw):
        return fn(q, k, v, *index, **extra, **kw)

    q = torch.randn(B, Hq, 10, D)
    rows = torch.tensor([30, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_seqlens"):  # more queries than the key row holds
        call(q, seqlens=rows, q_seqlens=torch.tensor([31, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="q_seqlens"):  # more queries than q holds
        call(q, q_seqlens=torch.tensor([11, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="q_seqstarts"):  # past q's end
        call(q, q_seqlens=torch.tensor([4, 5], dtype=torch.int32), q_seqstarts=torch.tensor([7, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="q_seqstarts needs q_seqlens"):
        call(q, q_seqstarts=torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="give q_seqlens"):  # ragged keys, fewer queries: no placement guessed
        call(q, seqlens=rows)
    with pytest.raises(ValueError, match="k must be"):  # q longer than k
        call(torch.randn(B, Hq, N + 1, D))
    with pytest.raises(ValueError, match="out"):  # out has q's rows, not k's
        call(q, out=torch.empty(B, Hq, N, D))


@given(st.data())
def test_the_definition_of_the_ordinary_call_is_the_plain_reference(data) -> None:
    """``query_rows_attention`` with ``Nq == N`` and no ``q_seqlens`` is the plain call (ragged
    rows too: the padding tokens it zeroes are never read)."""
    shape = data.draw(attention_shapes(max_batch=2, max_kv_heads=2, max_group=2, max_n=70, head_dims=(16,)))
    q, k, v = qkv(shape, torch.float64, "cpu", data.draw(st.integers(0, 2**31 - 1)))
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    sink, window = data.draw(ashape_budgets(shape.Hq, max_n=shape.N))
    kw = dict(seqlens=seqlens, seqstarts=seqstarts)
    for fn, args in ((ref.dense_attention, ()), (ref.ashape_attention, (sink, window))):
        want = fn(q, k, v, *args, **kw, return_lse=True)
        got = ref.query_rows_attention(fn, q, k, v, *args, **kw)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_the_definition_of_a_dense_chunk_is_the_last_rows_of_the_prompt() -> None:
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 77, 16, dtype=torch.float64), torch.randn(2, 2, 77, 16, dtype=torch.float64), \
        torch.randn(2, 2, 77, 16, dtype=torch.float64)
    full, full_lse = ref.dense_attention(q, k, v, return_lse=True)
    for C in (1, 30, 77):
        out, lse = ref.query_rows_attention(ref.dense_attention, q[:, :, 77 - C :], k, v)
        torch.testing.assert_close(out, full[:, :, 77 - C :], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, full_lse[:, :, 77 - C :], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "gathered"])
def test_work_follows_the_query_rows(monkeypatch, fused: bool) -> None:
    """A chunk of ``C`` queries after a cache of ``N - C`` tokens: the softmax calls (the fused
    kernel, or the gathered path's :func:`_manual`) see ``(query rows) x keys`` of the order of
    ``C`` times the chosen keys per query, never the prompt's ``N`` rows."""
    work = []
    name = "_FLASH_CPU" if fused else "_manual"
    real = getattr(tb, name)

    def spy(q, k, v, *a, **kw):
        work.append(q.numel() // q.shape[-1] * k.shape[-2])  # query rows x keys
        return real(q, k, v, *a, **kw)

    if not fused:
        monkeypatch.setattr(tb, "_FLASH_CPU", None)
    monkeypatch.setattr(tb, name, spy)
    N, C, R = 4096, 100, tb.TILE_ROWS
    q, k, v = torch.randn(1, 1, C, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    sink, window = 8, 100
    slash = torch.arange(50, dtype=torch.int32).view(1, 1, 50)
    vertical = torch.tensor([[[0, 9, 700]]], dtype=torch.int32)
    blocks = torch.stack([torch.tensor([0, i]) for i in range(N // 64)]).view(1, 1, -1, 2).int()
    rows = C + R  # the query tiles: at most one partly before the chunk
    bounds = [
        (lambda: tb.dense_attention(q, k, v), rows * N),
        (lambda: tb.ashape_attention(q, k, v, sink, window), rows * (sink + window + 2 * R)),
        (lambda: tb.vertical_slash_attention(q, k, v, vertical, slash), rows * (3 + 50 + 2 * R)),
        (lambda: tb.block_sparse_attention(q, k, v, blocks, block=64), (C + 64) * 2 * 64),
    ]
    for run, bound in bounds:
        work.clear()
        run()
        assert work and sum(work) <= bound, (sum(work), bound)
