"""Online index builders on query rows (docs/kernels.md, "query rows": a chunk after a cache,
ragged rows with explicit ``q_seqlens`` / ``q_seqstarts``, a row's last tokens in place): the
Triton builders (interpreter) and the PyTorch ones against their float64 twins
(``minference.reference.estimators``) with ``q [B, Hq, Nq, D]`` against ``k [B, Hkv, N, D]``.

Scores within float32 rounding; selections as exact sets (``top_k``: up to ties at the
boundary, as ``test_estimators.py``; the adaptive rules: the naive rule on the builder's own
scores, exactly, as ``test_budget_rules.py``). Every q row that holds no query and every k, v
token outside its row is NaN, so a builder that reads a wrong row fails. The ordinary call
(``Nq == N``, no ``q_seqlens``) is checked to be the query-row call of whole rows, bit for bit,
and a chunk's index to be the full prompt's where the two sample the same rows.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minference.kernels import estimate_vs
from minference.reference import estimators as naive

import minference.torch_backend as portable
from minference import kernels as triton_builders
from minference._checks import check_query_rows, check_ragged
from minference.backend import get_backend
from minference.index import QueryRows, build_group_index, extra_row_positions, prepare_plan
from minference.patterns import BlockSparse, VerticalSlash
from minference.testing.strategies import (
    AttnShape,
    attention_shapes,
    head_subsets,
    qkv,
    query_rows,
    ragged_rows,
    tp_offsets,
)
from tests.unit.index.cases import (
    SCORE_ATOL,
    SCORE_RTOL,
    assert_same_selection,
    assert_same_vs_index,
    check_block_rule,
    check_vertical_slash_rule,
    draw_budget,
    draw_score_rows,
    rule_kwargs,
)

#: Fast implementations under test; the Triton ones run in the interpreter on the CPU.
IMPLS = [pytest.param(triton_builders, id="triton", marks=pytest.mark.interpret), pytest.param(portable, id="torch")]
SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=110, head_dims=(16, 32))
#: The CPU suite's budget: interpreted builders run a few examples each.
FEW = settings(max_examples=min(settings().max_examples, 12))
BLOCKS = (5, 7, 16, 32, 64)


def _query_case(data, dtype=torch.float32, shapes=SHAPES):
    """Key rows (ragged or not), query rows drawn by ``query_rows``, ``q [B, Hq, Nq, D]`` whose
    query rows are the full prompt's queries at their positions and NaN elsewhere, ``k`` NaN
    outside the key rows. Returns the case and the host rows ``(lens, q_lens, q_starts)``."""
    shape = data.draw(shapes, label="shape")
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N), label="ragged")
    Nq, q_seqlens, q_seqstarts = data.draw(query_rows(shape.B, shape.N, seqlens, seqstarts), label="query rows")[:3]
    full, k, _ = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1), label="seed"),
                     sharpness=data.draw(st.sampled_from((0.5, 1.0, 3.0)), label="sharpness"))
    lens, starts = check_ragged(seqlens, seqstarts, shape.B, shape.N, "cpu")
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, shape.N,
                            given_rows=seqlens is not None or seqstarts is not None)
    q_lens, q_starts = rows if rows is not None else (lens, starts)
    q = torch.full((shape.B, shape.Hq, Nq, shape.D), float("nan"), dtype=dtype)
    for b in range(shape.B):
        n, c, s, qs = int(lens[b]), int(q_lens[b]), int(starts[b]), int(q_starts[b])
        q[b, :, qs : qs + c] = full[b, :, s + n - c : s + n]
        k[b, :, :s] = float("nan")
        k[b, :, s + n :] = float("nan")
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts)
    return shape, q, k, kw, (lens.tolist(), q_lens.tolist(), q_starts.tolist())


def _vs_kw(data, shape, H_global: int) -> dict:
    return dict(
        # a few (below and above the queries a row has), or more than any row has
        last_q=data.draw(st.one_of(st.integers(1, 20), st.integers(shape.N, shape.N + 40)), label="last_q"),
        extra_rows=data.draw(st.one_of(st.just(0), st.integers(1, 12), st.integers(shape.N, 2 * shape.N + 8)),
                             label="extra_rows"),
        sink_columns=draw_budget(data, H_global, 0, 6),
        local_diagonals=draw_budget(data, H_global, 0, 6),
        aggregation=data.draw(st.sampled_from(("sum", "max")), label="aggregation"),
        return_scores=True,
    )


def _query_blocks(n: int, c: int, block: int) -> set[int]:
    """The query blocks of a row of length ``n`` whose last ``c`` positions are queries."""
    return set(range((n - c) // block, -(-n // block))) if c else set()


def _check_block_rows(blocks, scores, rows, block: int) -> None:
    """Query blocks without a query: no blocks and ``-inf`` scores."""
    lens, q_lens, _ = rows
    for b, (n, c) in enumerate(zip(lens, q_lens)):
        chosen = _query_blocks(n, c, block)
        for I in range(blocks.shape[2]):
            if I not in chosen:
                assert (blocks[b, :, I] == -1).all(), (b, I, blocks[b, :, I])
                assert torch.isneginf(scores[b, :, I]).all(), (b, I)


@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_vertical_slash_query_rows_match_naive(fast, data) -> None:
    """``top_k``: scores within rounding of the twin, columns and offsets its sets (up to ties);
    GQA, ragged rows, head subsets, TP offsets, per-head budgets, extra rows, small key tiles."""
    shape, q, k, rows_kw, _ = _query_case(data, data.draw(st.sampled_from((torch.float16, torch.float32))))
    head_offset, H_global = data.draw(tp_offsets(shape.Hq), label="tp")
    kw = dict(_vs_kw(data, shape, H_global), heads=data.draw(head_subsets(shape.Hq), label="heads"),
              head_offset=head_offset, **rows_kw)
    vertical, slash = draw_budget(data, H_global, 0, 24), draw_budget(data, H_global, 1, 24)
    key_tile = data.draw(st.sampled_from((16, estimate_vs.VS_KEY_TILE)), label="key tile")
    with mock.patch.object(estimate_vs, "VS_KEY_TILE", key_tile):
        fast_out = fast.vertical_slash_index(q, k, vertical, slash, **kw)
    naive_out = naive.vertical_slash_index(q, k, vertical, slash, **kw)
    assert fast_out[2].shape == (shape.B, naive_out[2].shape[1], shape.N)  # scores over the key rows
    assert_same_vs_index(fast_out, naive_out)


@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_vertical_slash_query_rows_keep_the_rule(fast, data) -> None:
    """The budget rules (one by name, or per head ``top_k`` / ``mass`` / ``relative``) on query
    rows: each row's columns and offsets are the naive rule's on the builder's own scores, which
    match the twin's."""
    shape, q, k, rows_kw, rows = _query_case(data)
    heads = data.draw(head_subsets(shape.Hq), label="heads")
    offset = data.draw(st.sampled_from((0, shape.Hq)), label="offset")
    vertical, slash = data.draw(st.integers(0, 30)), data.draw(st.integers(1, 30))
    kw = dict(last_q=data.draw(st.integers(1, 24)), extra_rows=data.draw(st.sampled_from((0, 3))),
              sink_columns=data.draw(st.integers(0, 4)), local_diagonals=data.draw(st.integers(0, 4)),
              aggregation=data.draw(st.sampled_from(("sum", "max"))), heads=heads, head_offset=offset,
              return_scores=True, **rows_kw, **rule_kwargs(data, offset + shape.Hq, ("min_vertical", "min_slash"),
                                                        {"min_vertical": vertical, "min_slash": slash}))
    check_vertical_slash_rule(fast, q, k, vertical, slash, kw, heads, offset, shape.Hq, list(rows[0]), bounds=False)


@pytest.mark.parametrize("estimate", ["pooled", "query"])
@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_block_sparse_query_rows_match_naive(fast, estimate, data) -> None:
    """``top_k``, both estimates: the ``-inf`` pattern exactly (query blocks without a query
    included), finite scores within rounding, blocks the twin's sets; other rows all -1."""
    shape, q, k, rows_kw, rows = _query_case(data, data.draw(st.sampled_from((torch.float16, torch.float32))))
    head_offset, H_global = data.draw(tp_offsets(shape.Hq), label="tp")
    block = data.draw(st.sampled_from(BLOCKS), label="block")
    kw = dict(block=block, sink_blocks=draw_budget(data, H_global, 0, 3), force_diagonal=data.draw(st.booleans()),
              heads=data.draw(head_subsets(shape.Hq), label="heads"), head_offset=head_offset, return_scores=True,
              estimate=estimate, score_rows=draw_score_rows(data, estimate), **rows_kw)
    top_k = draw_budget(data, H_global, 1, 8)
    fb, fscores = fast.block_sparse_index(q, k, top_k, **kw)
    nb, nscores = naive.block_sparse_index(q, k, top_k, **kw)
    assert fscores.shape == nscores.shape and fb.shape == nb.shape and fb.dtype == torch.int32
    fin = torch.isfinite(nscores)
    assert torch.equal(torch.isfinite(fscores), fin)
    torch.testing.assert_close(fscores.double()[fin], nscores[fin], rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert_same_selection(fb, nb, nscores, "blocks")
    _check_block_rows(fb, fscores, rows, block)


@pytest.mark.parametrize("estimate", ["pooled", "query"])
@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_block_sparse_query_rows_keep_the_rule(fast, estimate, data) -> None:
    """The budget rules per query block on query rows (the one-launch Triton selection for
    ``top_k`` / ``relative`` on query-aware scores, the torch one otherwise): the naive rule's
    sets on the builder's own scores; query blocks without a query get none."""
    shape, q, k, rows_kw, rows = _query_case(data)
    heads = data.draw(head_subsets(shape.Hq), label="heads")
    offset = data.draw(st.sampled_from((0, shape.Hq)), label="offset")
    block, top_k = data.draw(st.sampled_from((5, 8, 16))), data.draw(st.integers(1, 12))
    kw = dict(block=block, sink_blocks=data.draw(st.integers(0, 2)), force_diagonal=data.draw(st.booleans()),
              heads=heads, head_offset=offset, return_scores=True, estimate=estimate,
              score_rows=draw_score_rows(data, estimate), **rows_kw,
              **rule_kwargs(data, offset + shape.Hq, ("min_blocks",), {"min_blocks": top_k}))
    fb, fscores = check_block_rule(fast, q, k, top_k, kw, heads, offset, shape.Hq, estimate, rows=rows)
    _check_block_rows(fb, fscores, rows, block)


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_ordinary_call_is_the_query_rows_call_of_whole_rows(impl) -> None:
    """Every key row its own query row given explicitly (``q_seqlens = lens``, in place) builds
    the ordinary call's index and scores bit for bit, on ragged rows with a head subset."""
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=70, D=16)
    q, k, _ = qkv(shape, torch.float32, "cpu", seed=3, sharpness=3.0)
    lens = torch.tensor([70, 41], dtype=torch.int32)
    rows = dict(seqlens=lens, seqstarts=torch.tensor([0, 20], dtype=torch.int32), heads=torch.tensor([2, 0]))
    explicit = dict(rows, q_seqlens=lens.clone())
    vs = dict(last_q=16, extra_rows=3, sink_columns=2, local_diagonals=3, return_scores=True)
    for rule in ({}, dict(rule="mass", threshold=0.9)):
        a = impl.vertical_slash_index(q, k, 9, 12, **vs, **rows, **rule)
        b = impl.vertical_slash_index(q, k, 9, 12, **vs, **explicit, **rule)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        for estimate in ("pooled", "query"):
            bs = dict(block=16, sink_blocks=1, return_scores=True, estimate=estimate, **rule)
            a = impl.block_sparse_index(q, k, 3, **bs, **rows)
            b = impl.block_sparse_index(q, k, 3, **bs, **explicit)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rule, estimate)


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_a_chunk_builds_the_full_prompts_index_where_it_samples_the_same_rows(impl) -> None:
    """A chunk of the last ``C >= last_q`` tokens after a cache samples the full prompt's rows
    (no extra rows): the same vertical-slash index; a chunk that starts on a block boundary
    routes its query blocks as the full prompt does, the earlier ones get no blocks."""
    shape = AttnShape(B=2, Hq=2, Hkv=1, N=96, D=16)
    q, k, _ = qkv(shape, torch.float32, "cpu", seed=7, sharpness=3.0)
    C = 40
    vs = dict(last_q=16, sink_columns=1, local_diagonals=2)
    full = impl.vertical_slash_index(q, k, 7, 9, **vs, return_scores=True)
    chunk = impl.vertical_slash_index(q[:, :, -C:], k, 7, 9, **vs, return_scores=True)
    close = torch.equal if impl is naive else (lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7))
    for x, y in zip(full[2:], chunk[2:]):
        assert close(x, y)
    for x, y, sc in zip(full[:2], chunk[:2], full[2:]):
        assert_same_selection(y, x, sc, "chunk vs full")
    C = 32  # two whole blocks of 16
    for estimate in ("pooled", "query"):
        fb, fs = impl.block_sparse_index(q, k, 3, block=16, sink_blocks=1, estimate=estimate, return_scores=True)
        cb, cs = impl.block_sparse_index(q[:, :, -C:], k, 3, block=16, sink_blocks=1, estimate=estimate,
                                         return_scores=True)
        first = (shape.N - C) // 16
        assert (cb[:, :, :first] == -1).all() and torch.isneginf(cs[:, :, :first]).all()
        fin = torch.isfinite(fs[:, :, first:])
        assert close(torch.where(fin, cs[:, :, first:], 0), torch.where(fin, fs[:, :, first:], 0))
        assert_same_selection(cb[:, :, first:], fb[:, :, first:], fs[:, :, first:], estimate)


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_rows_without_queries_and_fewer_queries_than_last_q(impl) -> None:
    """Row 0 has no queries (zero scores; no query block), row 1 has 3 < last_q, both with extra
    rows asked for; explicit places in a chunk of 5 rows, NaN in every other q row."""
    shape = AttnShape(B=2, Hq=2, Hkv=1, N=60, D=16)
    full, k, _ = qkv(shape, torch.float32, "cpu", seed=11, sharpness=3.0)
    q = torch.full((2, 2, 5, 16), float("nan"))
    q[1, :, 1:4] = full[1, :, 57:60]
    rows = dict(q_seqlens=torch.tensor([0, 3], dtype=torch.int32), q_seqstarts=torch.tensor([2, 1], dtype=torch.int32))
    v, s, col, diag = impl.vertical_slash_index(q, k, 6, 6, last_q=8, extra_rows=4, sink_columns=2,
                                                local_diagonals=2, return_scores=True, **rows)
    assert (col[0] == 0).all() and (diag[0] == 0).all()
    assert col[1, :, 58:].gt(0).all() and col[1, :, 57].gt(0).all()  # the 3 queries see their keys
    nv, ns, ncol, ndiag = naive.vertical_slash_index(q, k, 6, 6, last_q=8, extra_rows=4, sink_columns=2,
                                                     local_diagonals=2, return_scores=True, **rows)
    torch.testing.assert_close(col.double(), ncol, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert_same_selection(v, nv, ncol, "vertical")
    assert_same_selection(s, ns, ndiag, "slash")
    for estimate in ("pooled", "query"):
        b, sc = impl.block_sparse_index(q, k, 2, block=8, return_scores=True, estimate=estimate, **rows)
        assert (b[0] == -1).all() and torch.isneginf(sc[0]).all()
        assert (b[1, :, :7] == -1).all() and (b[1, :, 7] >= 0).sum(-1).tolist() == [2, 2]  # 57..59: block 7


def test_blocks_from_slots_of_uniform_rows_is_the_gather() -> None:
    """Query rows known on the host (``QueryRows.first``, what :func:`query_rows` sets for full
    key rows and ``q_seqlens`` None or an int) place the slots by one pad or crop: the same
    tensor as the gather by each row's first query block, for every length, count and block."""
    from minference.index import blocks_from_slots, query_rows

    g = torch.Generator().manual_seed(0)
    B, Hg, W = 2, 3, 4
    for N in (1, 7, 16, 33):
        for block in (1, 4, 16):
            nqb = -(-N // block)
            lens, starts = check_ragged(None, None, B, N, "cpu")
            for Nq, q_seqlens in [(c, None) for c in range(1, N)] + [(N, c) for c in range(N + 1)]:
                qr = query_rows(q_seqlens, None, lens, starts, Nq, N, given_rows=False, validate=True)
                assert qr.first == N - (Nq if q_seqlens is None else q_seqlens)
                S = qr.slots(block)
                for x, fill in ((torch.randint(0, 50, (B, Hg, S, W), generator=g, dtype=torch.int32), -1),
                                (torch.randn(B, Hg, S, W, generator=g), float("-inf"))):
                    gathered = blocks_from_slots(x, lens, QueryRows(qr.lens, qr.starts, qr.bound, N), block, nqb, fill)
                    placed = blocks_from_slots(x, lens, qr, block, nqb, fill)
                    assert placed.shape == (B, Hg, nqb, W) and placed.dtype == x.dtype and placed.is_contiguous()
                    assert torch.equal(placed, gathered), (N, block, Nq, q_seqlens)


def test_extra_rows_on_query_rows_are_the_definition() -> None:
    """The device-side extra rows with query rows equal the twin's sampled rows (the extra part)
    for every small row length, query count, last_q and extra_rows, including the cap at the
    queries' bound."""
    N = 20
    for last_q in (1, 3, 8, 30):
        for extra in range(0, 2 * N + 3, 3):
            for c in range(N + 1):
                lens = torch.arange(c, N + 1, dtype=torch.int32)  # every row with at least c tokens
                qr = QueryRows(torch.full_like(lens, c), torch.zeros_like(lens), c, N)
                got = extra_row_positions(lens, N, last_q, extra, qr)
                assert got.shape == (lens.shape[0], min(extra, N, c))
                for r, n in enumerate(lens.tolist()):
                    q_lo = n - c
                    want = naive._sampled_rows(n, last_q, extra, q_lo)
                    last = list(range(max(n - last_q, q_lo), n))
                    assert [x for x in got[r].tolist() if x >= 0] + last == want, (n, c, last_q, extra)
                    assert all(q_lo <= x < n for x in want)


@pytest.mark.interpret
def test_triton_grids_follow_the_query_rows(monkeypatch) -> None:
    """A chunk of 16 queries (an int ``q_seqlens``) after 240 cached tokens: the vertical-slash
    passes launch for 16 sampled rows (not ``last_q = 64``), the block kernels for the 2 query
    blocks 16 queries can touch (not the row's 16), the key pooling for every key block."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    original = InterpretedFunction.__getitem__

    def record(self, grid):
        launches.append((self.fn.__name__, tuple(grid)))
        return original(self, grid)

    monkeypatch.setattr(InterpretedFunction, "__getitem__", record)
    shape = AttnShape(B=1, Hq=2, Hkv=1, N=256, D=16)
    q, k, _ = qkv(shape, torch.float32, "cpu", seed=1)
    chunk = q[:, :, -32:].contiguous()
    triton_builders.vertical_slash_index(chunk, k, 8, 8, last_q=64, q_seqlens=16, q_seqstarts=torch.tensor([16]))
    stats = [g for name, g in launches if name == "_vs_stats_kernel"]
    assert stats == [(2, 1, 4)]  # one chunk of 16 rows against 4 key tiles of 64
    launches.clear()
    blocks = triton_builders.block_sparse_index(chunk, k, 3, block=16, estimate="query", q_seqlens=16,
                                                q_seqstarts=torch.tensor([16]))
    assert sorted(launches) == sorted([("_pool_kernel", (1, 16)), ("_qbs_kernel", (2, 2)),
                                       ("_block_select_kernel", (2, 2))])
    assert (blocks[0, :, :15] == -1).all() and (blocks[0, :, 15] >= 0).sum(-1).tolist() == [3, 3]
    launches.clear()
    triton_builders.block_sparse_index(chunk, k, 3, block=16, q_seqlens=16, q_seqstarts=torch.tensor([16]))
    assert sorted(launches) == sorted([("_pool_kernel", (2, 2)), ("_pool_kernel", (1, 16))])


@pytest.mark.parametrize("impl", IMPLS)
def test_group_index_forwards_query_rows(impl) -> None:
    """``build_group_index`` (what the dispatcher calls) passes ``q_seqlens`` / ``q_seqstarts`` to
    the builders: a plan's groups build what the builders build directly."""
    shape = AttnShape(B=2, Hq=2, Hkv=1, N=64, D=16)
    q, k, _ = qkv(shape, torch.float32, "cpu", seed=2, sharpness=3.0)
    chunk = q[:, :, -20:].contiguous()
    rows = dict(q_seqlens=torch.tensor([20, 9], dtype=torch.int32),
                q_seqstarts=torch.tensor([0, 11], dtype=torch.int32))
    plan = [VerticalSlash(vertical=6, slash=8, last_q=8, sink_columns=1, local_diagonals=2, extra_rows=2),
            BlockSparse(top_k=3, block=8, sink_blocks=1)]
    vs_group, bs_group = sorted(prepare_plan(plan, 2, 0, "cpu"), key=lambda g: g.group.kind != "vertical_slash")
    backend = get_backend("triton" if impl is triton_builders else "torch")
    got_v, got_s = build_group_index(backend, vs_group, chunk, k, scale=None, seqlens=None, seqstarts=None,
                                     head_offset=0, **rows)
    want_v, want_s = impl.vertical_slash_index(chunk, k, 6, 8, last_q=8, sink_columns=1, local_diagonals=2,
                                               extra_rows=2, heads=torch.tensor([0]), **rows)
    assert torch.equal(got_v, want_v) and torch.equal(got_s, want_s)
    got_b = build_group_index(backend, bs_group, chunk, k, scale=None, seqlens=None, seqstarts=None, head_offset=0,
                              **rows)
    assert torch.equal(got_b, impl.block_sparse_index(chunk, k, 3, block=8, sink_blocks=1, heads=torch.tensor([1]),
                                                      **rows))


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_query_row_argument_errors(impl) -> None:
    q, k = torch.randn(2, 2, 8, 16), torch.randn(2, 1, 12, 16)
    seqlens = torch.tensor([12, 10], dtype=torch.int32)
    for call in (lambda **kw: impl.vertical_slash_index(q, k, 2, 2, **kw),
                 lambda **kw: impl.block_sparse_index(q, k, 2, block=4, **kw),
                 lambda **kw: impl.block_sparse_index(q, k, 2, block=4, estimate="query", **kw)):
        with pytest.raises(ValueError, match="give q_seqlens"):
            call(seqlens=seqlens)  # ragged key rows and fewer q rows: no placement is guessed
        with pytest.raises(ValueError, match="q_seqstarts needs q_seqlens"):
            call(q_seqstarts=torch.zeros(2, dtype=torch.int32))
        with pytest.raises(ValueError, match="must not exceed the key rows"):
            call(seqlens=torch.tensor([12, 6], dtype=torch.int32), q_seqlens=torch.tensor([8, 7], dtype=torch.int32))
        with pytest.raises(ValueError, match="q_seqstarts"):
            call(q_seqlens=torch.tensor([8, 4], dtype=torch.int32), q_seqstarts=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="N >= 13"):
        impl.vertical_slash_index(torch.randn(2, 2, 13, 16), k, 2, 2)
    if impl is not naive:
        qr = QueryRows(torch.tensor([8, 8], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 8, 12)
        with pytest.raises(ValueError, match="not both"):
            impl.query_block_scores(q, k, block=4, q_seqlens=8, slots=qr)
