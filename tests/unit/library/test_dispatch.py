"""sparse_prefill: per-head routing of a mixed plan, grouping into few launches, dense fallback,
plan validation, tensor-parallel offsets, ragged rows, and (GPU) CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
from minference.reference import attention as ref

import minference.torch_backend as tb
from minference import dispatch, kernels
from minference._checks import token_mask
from minference.dispatch import sparse_prefill
from minference.index import group_heads
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing import assert_close_to_reference
from minference.testing.ops import RecordOps
from minference.testing.strategies import AttnShape, qkv
from tests.unit.library.cases import MIXED_PLAN

#: The budget rules and the query-aware routing score in one layer (mixed rules share groups; a
#: head scored by 3 rows of each block is a group of its own).
ADAPTIVE_PLAN = [
    VerticalSlash(vertical=20, slash=30, last_q=16, rule="mass", threshold=0.9, min_vertical=2, min_slash=3),
    BlockSparse(top_k=5, block=16, rule="relative", threshold=0.1, estimate="query"),
    VerticalSlash(vertical=8, slash=12, last_q=16, rule="relative", threshold=0.2),
    BlockSparse(top_k=6, block=16, rule="mass", threshold=0.9, min_blocks=2, estimate="query", score_rows=3),
    BlockSparse(top_k=3, block=16, estimate="query"),
    VerticalSlash(vertical=8, slash=12, last_q=16),
    BlockSparse(top_k=4, block=16, rule="mass", threshold=0.95),
    AShape(sink=2, window=20),
    Dense(),
]
BACKENDS = [pytest.param("triton", marks=pytest.mark.interpret), "torch"]


def _builders(backend: str):
    return kernels if backend == "triton" else tb


def _head_indices(q, k, plan, *, head_offset=0, seqlens=None, seqstarts=None, builders) -> list:
    """Head by head, independently of the dispatcher's grouping: each pattern's index from the
    builder for that head alone (``None`` for the static patterns)."""
    rows = dict(seqlens=seqlens, seqstarts=seqstarts)
    indices = []
    for h in range(q.shape[1]):
        p = plan[head_offset + h]
        one = torch.tensor([h], dtype=torch.int32, device=q.device)
        if isinstance(p, VerticalSlash):
            indices.append(builders.vertical_slash_index(
                q, k, p.vertical, p.slash, last_q=p.last_q, sink_columns=p.sink_columns,
                local_diagonals=p.local_diagonals, aggregation=p.aggregation, extra_rows=p.extra_rows, rule=p.rule,
                threshold=p.threshold, min_vertical=p.min_vertical, min_slash=p.min_slash, heads=one, **rows))
        elif isinstance(p, BlockSparse):
            indices.append(builders.block_sparse_index(
                q, k, p.top_k, block=p.block, sink_blocks=p.sink_blocks, force_diagonal=p.force_diagonal,
                rule=p.rule, threshold=p.threshold, min_blocks=p.min_blocks, estimate=p.estimate,
                score_rows=p.score_rows, heads=one, **rows))
        else:
            indices.append(None)
    return indices


def _expected(q, k, v, plan, *, head_offset=0, seqlens=None, seqstarts=None, builders, compute_dtype,
              fill_gaps=dispatch.FILL_GAPS, indices=None):
    """Head by head, on each head's own index (:func:`_head_indices`, built once; or ``indices``
    built so before), the float64 and the ``compute_dtype`` reference twins: ``(r64, rsame)``."""
    if indices is None:
        indices = _head_indices(q, k, plan, head_offset=head_offset, seqlens=seqlens, seqstarts=seqstarts,
                                builders=builders)
    outs = []
    for dtype in (torch.float64, compute_dtype):
        out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
        for h in range(q.shape[1]):
            p = plan[head_offset + h]
            one = torch.tensor([h], dtype=torch.int32, device=q.device)
            kw = dict(heads=one, compute_dtype=dtype, seqlens=seqlens, seqstarts=seqstarts)
            if isinstance(p, AShape):
                o = ref.ashape_attention(q, k, v, p.sink, p.window, **kw)
            elif isinstance(p, VerticalSlash):
                o = ref.vertical_slash_attention(q, k, v, *indices[h], fill_gaps=fill_gaps, **kw)
            elif isinstance(p, BlockSparse):
                o = ref.block_sparse_attention(q, k, v, indices[h], block=p.block, **kw)
            else:
                o = ref.dense_attention(q, k, v, **kw)
            out[:, h] = o[:, h]
        outs.append(out)
    return tuple(outs)


def _valid(B, N, seqlens, seqstarts) -> torch.Tensor:
    return token_mask(seqlens, seqstarts, B, N, "cpu")[:, None, :, None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("plan", [MIXED_PLAN, ADAPTIVE_PLAN], ids=["budgets", "adaptive"])
def test_mixed_plan_matches_per_head_reference(backend: str, ragged: bool, plan) -> None:
    shape = AttnShape(B=2, Hq=9, Hkv=3, N=113, D=32)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=3, layout="transposed")
    seqlens = torch.tensor([113, 70], dtype=torch.int32) if ragged else None
    seqstarts = torch.tensor([0, 30], dtype=torch.int32) if ragged else None
    out = sparse_prefill(q, k, v, plan, seqlens=seqlens, seqstarts=seqstarts, dense_threshold=0, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, builders=_builders(backend))
    r64, rsame = _expected(q, k, v, plan, compute_dtype=torch.float32, **kw)
    valid = _valid(shape.B, shape.N, seqlens, seqstarts)
    assert_close_to_reference(out, r64, rsame, where=valid)
    assert bool((out[~valid.expand_as(out)] == 0).all()), "padding rows must be zeros"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_offset_selects_the_rank_patterns(backend: str) -> None:
    """Rank 1 of 2: local heads 0..8 are global heads 9..17 and use those patterns."""
    shape = AttnShape(B=1, Hq=9, Hkv=3, N=97, D=16)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=5)
    plan = [Dense()] * 9 + list(reversed(MIXED_PLAN))
    out = sparse_prefill(q, k, v, plan, head_offset=9, dense_threshold=0, backend=backend)
    r64, rsame = _expected(q, k, v, plan, head_offset=9, builders=_builders(backend), compute_dtype=torch.float32)
    assert_close_to_reference(out, r64, rsame)


def test_one_launch_per_group(monkeypatch) -> None:
    """Nine heads in five groups: one attention call per group, each with its heads."""
    calls = []
    for name in ("ashape_attention", "vertical_slash_attention", "block_sparse_attention", "dense_attention"):
        real = getattr(tb, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append((_name, sorted(kw["heads"].tolist())))
            return _real(*a, **kw)

        monkeypatch.setattr(tb, name, spy)
    q, k, v = qkv(AttnShape(B=1, Hq=9, Hkv=3, N=64, D=16), torch.float32, "cpu", seed=0)
    sparse_prefill(q, k, v, MIXED_PLAN, dense_threshold=0, backend="torch")
    assert sorted(calls) == sorted([
        ("ashape_attention", [1, 6]),
        ("vertical_slash_attention", [0, 3]),
        ("vertical_slash_attention", [5]),
        ("block_sparse_attention", [2, 8]),
        ("block_sparse_attention", [7]),
        ("dense_attention", [4]),
    ])
    groups = group_heads(MIXED_PLAN, 9)
    assert [g.heads for g in groups if g.kind == "vertical_slash"] == [(0, 3), (5,)]
    # block-sparse heads group by routing block, diagonal, estimate and scoring rows
    bs = [g for g in group_heads(ADAPTIVE_PLAN, 9) if g.kind == "block_sparse"]
    assert sorted((g.key, g.heads) for g in bs) == [((16, True, "pooled", 0), (6,)), ((16, True, "query", 0), (1, 4)),
                                                     ((16, True, "query", 3), (3,))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_gaps_is_the_same_set_on_both_backends(backend: str) -> None:
    """Sparse slash sets with short gaps: each fill_gaps value gives its own reference set."""
    shape = AttnShape(B=1, Hq=4, Hkv=2, N=96, D=16)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=5)
    plan = [VerticalSlash(vertical=3, slash=9, last_q=8, sink_columns=1, local_diagonals=1)] * 4
    kw = dict(builders=_builders(backend))
    indices = _head_indices(q, k, plan, **kw)  # the index does not depend on fill_gaps
    outs = []
    for fill in (0, 6):
        out = sparse_prefill(q, k, v, plan, dense_threshold=0, backend=backend, fill_gaps=fill)
        r64, rsame = _expected(q, k, v, plan, compute_dtype=torch.float32, fill_gaps=fill, indices=indices, **kw)
        assert_close_to_reference(out, r64, rsame)
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1]), "filling changed nothing: the test does not exercise it"


@pytest.mark.interpret
def test_dense_over_routes_heads_to_dense() -> None:
    """dense_over=0 replaces every vertical-slash head (its tiles exceed 0 x dense) by dense causal
    attention; the torch backend refuses the option."""
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=80, D=16)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=6)
    plan = [VerticalSlash(vertical=2, slash=3, last_q=8)] * 2 + [AShape(sink=1, window=4)] * 2
    out = sparse_prefill(q, k, v, plan, dense_threshold=0, backend="triton", dense_over=0.0)
    dense64 = ref.dense_attention(q, k, v)
    dense32 = ref.dense_attention(q, k, v, compute_dtype=torch.float32)
    assert_close_to_reference(out[:, :2], dense64[:, :2], dense32[:, :2])
    a64 = ref.ashape_attention(q, k, v, 1, 4)
    a32 = ref.ashape_attention(q, k, v, 1, 4, compute_dtype=torch.float32)
    assert_close_to_reference(out[:, 2:], a64[:, 2:], a32[:, 2:])
    with pytest.raises(ValueError, match="dense_over needs the triton backend"):
        sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch", dense_over=0.5)
    with pytest.raises(ValueError, match="fill_gaps"):
        sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch", fill_gaps=-2)


@pytest.mark.parametrize("ragged", [False, True])
def test_below_threshold_runs_dense(ragged: bool, monkeypatch) -> None:
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=50, D=16)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=1)
    seqlens = torch.tensor([50, 20], dtype=torch.int32) if ragged else None
    seqstarts = torch.tensor([0, 25], dtype=torch.int32) if ragged else None
    monkeypatch.setattr(tb, "vertical_slash_index", lambda *a, **kw: pytest.fail("index built below threshold"))
    out = sparse_prefill(q, k, v, [VerticalSlash(vertical=2, slash=2)] * 4, seqlens=seqlens, seqstarts=seqstarts,
                         dense_threshold=51, backend="torch")
    r64 = ref.dense_attention(q, k, v, seqlens=seqlens, seqstarts=seqstarts)
    rsame = ref.dense_attention(q, k, v, seqlens=seqlens, seqstarts=seqstarts, compute_dtype=torch.float32)
    assert_close_to_reference(out, r64, rsame)


def test_default_threshold_is_used(monkeypatch) -> None:
    q, k, v = qkv(AttnShape(B=1, Hq=2, Hkv=1, N=40, D=16), torch.float32, "cpu", seed=2)
    plan = [AShape(sink=1, window=2)] * 2
    monkeypatch.setattr(dispatch, "DENSE_THRESHOLD", 41)
    dense = sparse_prefill(q, k, v, plan, backend="torch")
    monkeypatch.setattr(dispatch, "DENSE_THRESHOLD", 40)
    sparse = sparse_prefill(q, k, v, plan, backend="torch")
    torch.testing.assert_close(dense, ref.dense_attention(q, k, v).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse, ref.ashape_attention(q, k, v, 1, 2).float(), rtol=1e-5, atol=1e-5)


def test_plan_validation_errors() -> None:
    q, k, v = qkv(AttnShape(B=1, Hq=4, Hkv=2, N=32, D=16), torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="plan has 3 head patterns"):
        sparse_prefill(q, k, v, [Dense()] * 3)
    with pytest.raises(ValueError, match="global heads 2..5"):
        sparse_prefill(q, k, v, [Dense()] * 5, head_offset=2)
    with pytest.raises(TypeError, match=r"plan\[1\] must be a pattern"):
        sparse_prefill(q, k, v, [Dense(), {"kind": "dense"}, Dense(), Dense()])
    with pytest.raises(TypeError, match="plan must be a sequence"):
        sparse_prefill(q, k, v, Dense())
    with pytest.raises(ValueError, match="backend"):
        sparse_prefill(q, k, v, [Dense()] * 4, backend="cuda")
    with pytest.raises(ValueError, match="dense_threshold"):
        sparse_prefill(q, k, v, [Dense()] * 4, dense_threshold=-1)
    with pytest.raises(ValueError, match="head_offset"):
        sparse_prefill(q, k, v, [Dense()] * 4, head_offset=-1)
    with pytest.raises(ValueError, match="seqlens"):
        sparse_prefill(q, k, v, [Dense()] * 4, seqlens=torch.tensor([33], dtype=torch.int32))
    with pytest.raises(ValueError, match="BlockSparse.block=24"):
        sparse_prefill(q, k, v, [BlockSparse(block=24)] * 4, backend="triton", dense_threshold=0)
    with pytest.raises(ValueError, match="head dims"):
        q5, k5, v5 = qkv(AttnShape(B=1, Hq=4, Hkv=2, N=32, D=20), torch.float32, "cpu", seed=0)
        sparse_prefill(q5, k5, v5, [Dense()] * 4, backend="triton", dense_threshold=0)


@pytest.mark.interpret
def test_repeat_call_makes_no_per_call_budget_or_row_tensors(monkeypatch) -> None:
    """Host diet of the eager path (what an eager 16K prefill pays per tensor op: docs/dispatch.md):
    once a plan is prepared, a call resolves no per-head budget and fills no default row lengths.
    Launches are recorded, not run, so only the host's own tensor ops are left: allocations, the
    estimator's zeroed score buffer, the converter's zeroed flags, and the value guard
    (docs/contract.md): made once per call for every kernel of the layer (validate=False here),
    its two outputs (``empty``) and one launch of its Triton pass."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    monkeypatch.setattr(InterpretedFunction, "__getitem__",
                        lambda self, grid: lambda *a, **kw: launches.append(self.fn.__name__))
    q, k, v = qkv(AttnShape(B=1, Hq=4, Hkv=2, N=64, D=16), torch.float32, "cpu", seed=0)
    plan = [VerticalSlash(vertical=8, slash=12, last_q=16), AShape(sink=2, window=8),
            VerticalSlash(vertical=5, slash=9, last_q=16, sink_columns=2, local_diagonals=3), Dense()]
    kw = dict(dense_threshold=0, backend="triton", validate=False)
    sparse_prefill(q, k, v, plan, **kw)  # prepares the plan's device tensors
    launches.clear()
    with RecordOps() as ops:
        sparse_prefill(q, k, v, plan, **kw)
    assert set(ops.names) <= {"empty", "empty_like", "zeros", "unbind"}, ops.names
    assert sorted(launches) == sorted(["_value_guard_kernel",  # once per call
                                       "_ashape_fwd", "_ashape_fwd", "_vs_stats_kernel", "_lse_kernel",
                                       "_vs_scores_kernel", "_select_kernel", "_vs_lists_kernel", "_vs_diag_kernel",
                                       "_block_columns_kernel", "_vs_fwd"])


def _gpu_case(N: int, dtype=torch.bfloat16):
    shape = AttnShape(B=2, Hq=8, Hkv=2, N=N, D=64)
    q, k, v = qkv(shape, dtype, "cuda", seed=11)
    plan = [
        VerticalSlash(vertical=64, slash=128), AShape(sink=16, window=256), BlockSparse(top_k=8), Dense(),
        VerticalSlash(vertical=32, slash=256, aggregation="max"), AShape(sink=4, window=64),
        BlockSparse(top_k=4, block=128), VerticalSlash(vertical=100, slash=64, last_q=128),
    ]
    seqlens = torch.tensor([N, N - 301], dtype=torch.int32, device="cuda")
    seqstarts = torch.tensor([0, 150], dtype=torch.int32, device="cuda")
    return q, k, v, plan, seqlens, seqstarts


#: The budget rules and the query-aware routing score under CUDA-graph capture (8 heads).
ADAPTIVE_GPU_PLAN = [
    VerticalSlash(vertical=64, slash=128, rule="mass", threshold=0.9, min_vertical=8, min_slash=16),
    VerticalSlash(vertical=64, slash=128), BlockSparse(top_k=8, rule="relative", threshold=0.12),
    BlockSparse(top_k=8, rule="mass", threshold=0.95, min_blocks=2), BlockSparse(top_k=4),
    VerticalSlash(vertical=32, slash=256, rule="relative", threshold=0.08),
    VerticalSlash(vertical=100, slash=64, last_q=128, rule="mass", threshold=0.95),
    BlockSparse(top_k=8, rule="relative", threshold=0.1, estimate="query"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [False, True], ids=["budgets", "adaptive"])
def test_cuda_graph_capture_matches_eager(adaptive: bool) -> None:
    """Capturing the whole triton path in a CUDA graph fails on any host synchronisation; the
    replay on new inputs matches an eager call on them (fixed budgets, and the adaptive rules)."""
    q, k, v, plan, seqlens, seqstarts = _gpu_case(4096 + 37)
    if adaptive:
        plan = ADAPTIVE_GPU_PLAN
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, dense_threshold=0, backend="triton")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse_prefill(q, k, v, plan, **kw)  # compile, cache the plan's device tensors
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sparse_prefill(q, k, v, plan, **kw)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float32).to(x.dtype))
        graph.replay()
        eager = sparse_prefill(q, k, v, plan, **kw)
        torch.testing.assert_close(static_out, eager, rtol=2e-2, atol=2e-2)
        assert not torch.isnan(static_out).any()


@pytest.mark.gpu
def test_gpu_mixed_plan_bf16_matches_per_head_reference() -> None:
    q, k, v, plan, seqlens, seqstarts = _gpu_case(1000)
    out = sparse_prefill(q, k, v, plan, seqlens=seqlens, seqstarts=seqstarts, dense_threshold=0, backend="triton")
    kw = dict(seqlens=seqlens, seqstarts=seqstarts, builders=kernels)
    r64, rsame = _expected(q, k, v, plan, compute_dtype=torch.bfloat16, **kw)
    assert_close_to_reference(out.cpu(), r64.cpu(), rsame.cpu(), where=_valid(2, 1000, seqlens.cpu(), seqstarts.cpu()))
