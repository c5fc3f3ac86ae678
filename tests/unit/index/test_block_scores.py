"""Query-aware block scores (``query_block_scores``: Triton in ``minference.kernels.estimate_bs``, plain
PyTorch in ``minference.torch_backend``) against the float64 definition in
``minference.reference.estimators``: the ``-inf`` pattern exactly, finite scores within a bound
derived from float32 rounding (:func:`_bound`), ragged rows whose padding holds NaN, GQA, head
subsets, lengths that are not multiples of the block, and keys that dominate their block's mean."""

from __future__ import annotations

import math
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.kernels import estimate_bs
from minference.reference import estimators as naive

import minference.torch_backend as portable
from minference import kernels as triton_builders
from minference._checks import check_ragged
from minference.testing.strategies import AttnShape, attention_shapes, head_subsets, layouts, qkv, ragged_rows

#: Fast implementations under test; the Triton one runs in the interpreter on the CPU.
IMPLS = [pytest.param(triton_builders, id="triton", marks=pytest.mark.interpret), pytest.param(portable, id="torch")]
#: Blocks drawn on the CPU: the two routing sizes of record, small powers of two (several key
#: tiles per row at these lengths) and odd sizes (query tiles with unused rows).
BLOCKS = (64, 128, 16, 32, 7)
#: Scoring rows drawn: every row (twice as likely), one, counts that do and do not divide the
#: blocks, and more than any block.
SCORE_ROWS = (0, 0, 1, 2, 3, 8, 200)
CPU_SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=260, head_dims=(16, 64, 128))
GPU_SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=4, max_n=700, head_dims=(64, 128))
#: Relative error of the key means as the product sees them, per input dtype: float32 (tf32x3
#: on the GPU keeps about 21 bits, the interpreter all 24), hi + lo fp16 halves (22 bits), hi + lo
#: bf16 halves (16: the low half's 8 bits start 8 bits below the high half's).
KEY_UNIT = {torch.float32: 2.0 ** -21, torch.float16: 2.0 ** -21, torch.bfloat16: 2.0 ** -16}
#: float32 unit roundoff: the key mean and the D-term product accumulate in float32.
F32_UNIT = 2.0 ** -24
#: exp2 / log2 rounding on a probability of at most 1.
FLOOR = 1e-6


def _poison_padding(x: torch.Tensor, seqlens, seqstarts) -> torch.Tensor:
    """``x`` (in place, strides kept) with NaN on every token outside its row: a kernel that reads
    padding fails."""
    if seqlens is None:
        return x
    starts = seqstarts if seqstarts is not None else torch.zeros_like(seqlens)
    pos = torch.arange(x.shape[2])[None, :]
    pad = (pos < starts[:, None]) | (pos >= (starts + seqlens)[:, None])  # [B, N]
    return x.masked_fill_(pad[:, None, :, None].to(x.device), float("nan"))


def _bound(q, k, block: int, scale: float, dtype: torch.dtype, seqlens=None, seqstarts=None,
           key_unit: float | None = None) -> float:
    """Largest logit error ``Δ`` the dtype's path may make, relative to ``M = scale * Σ_d |q_d|
    mean_J|k_d|`` (maxed over rows and blocks): the float32 key mean and the float32 ``D``-term
    product add at most ``(block + D) u`` (the standard ``γ_n`` summation bounds), the key means'
    representation in the product :data:`KEY_UNIT`. A probability ``p = exp(s - lse)`` then moves
    by at most ``2 Δ p`` (``s`` and ``lse`` both move by ``Δ``), a max over rows by no more than its
    largest term."""
    B, Hq, N, D = q.shape
    group = Hq // k.shape[1]
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    mean_abs = portable._pool_torch(k.double().abs().nan_to_num(0.0), block, lens, starts, None)  # [B, Hkv, NQB, D]
    worst = torch.matmul(q.double().abs().nan_to_num(0.0), mean_abs.double().repeat_interleave(group, 1).mT)
    unit = (block + D) * F32_UNIT + (KEY_UNIT[dtype] if key_unit is None else key_unit)
    return unit * float(worst.amax()) * scale


def assert_scores_match(got: torch.Tensor, want: torch.Tensor, delta: float, name: str = "scores") -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN (an unwritten entry or a read of padding)"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), f"{name}: -inf pattern differs"
    assert torch.equal(got[~fin], want[~fin].float()), f"{name}: non-finite entries other than -inf"
    err = (got.double()[fin] - want[fin]).abs()
    tol = 2 * delta * want[fin] + FLOOR
    worst = int((err - tol).argmax()) if err.numel() else 0
    assert bool((err <= tol).all()), f"{name}: error {float(err[worst]):.3g} > bound {float(tol[worst]):.3g}"


@contextmanager
def _nan_outputs():
    """Every float tensor ``torch.empty`` makes during the call starts as NaN, so an output entry the
    kernel never writes fails the comparison."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    with mock.patch.object(torch, "empty", poisoned):
        yield


def _case(data, dtype, shapes=CPU_SHAPES, device="cpu"):
    shape = data.draw(shapes, label="shape")
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N), label="ragged")
    q, k, _ = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1), label="seed"),
                  sharpness=data.draw(st.sampled_from((0.5, 1.0, 3.0)), label="sharpness"),
                  layout=data.draw(layouts(), label="layout"))
    if data.draw(st.booleans(), label="spiky"):  # one key per kv head dominates its block's mean
        for h in range(shape.Hkv):
            k[:, h, data.draw(st.integers(0, shape.N - 1))] *= 40
    kw = dict(block=data.draw(st.sampled_from(BLOCKS), label="block"),
              scale=data.draw(st.sampled_from((None, 0.3)), label="scale"),
              seqlens=seqlens, seqstarts=seqstarts, heads=data.draw(head_subsets(shape.Hq), label="heads"),
              score_rows=data.draw(st.sampled_from(SCORE_ROWS), label="score rows"))
    q, k = _poison_padding(q, seqlens, seqstarts), _poison_padding(k, seqlens, seqstarts)
    return shape, q, k, kw


def _scale(kw, D):
    return kw["scale"] if kw["scale"] is not None else D ** -0.5


@pytest.mark.parametrize("fast", IMPLS)
@given(st.data())
def test_matches_naive(fast, data) -> None:
    dtype = data.draw(st.sampled_from((torch.float16, torch.float32)), label="dtype")
    shape, q, k, kw = _case(data, dtype)
    # Triton: a 16-mean key tile puts up to 17 tiles in a row, the default 1 to 5
    tile = data.draw(st.sampled_from((16, estimate_bs.QBS_KEY_TILE)), label="key tile")
    with mock.patch.object(estimate_bs, "QBS_KEY_TILE", tile), _nan_outputs():
        got = fast.query_block_scores(q, k, **kw)
    want = naive.query_block_scores(q, k, **kw)
    assert_scores_match(got, want, _bound(q, k, kw["block"], _scale(kw, shape.D), dtype, kw["seqlens"],
                                          kw["seqstarts"]))


@pytest.mark.parametrize("fast", IMPLS)
@pytest.mark.parametrize("N, block, D, dtype", [
    (97, 64, 64, torch.float32), (200, 64, 128, torch.float16), (257, 128, 64, torch.float16),
    (257, 64, 128, torch.float32), (200, 128, 128, torch.float32),
])
def test_sizes_of_record(fast, N, block, D, dtype) -> None:
    """The routing blocks (64, 128) and head dims (64, 128) of record, GQA 4:2, a ragged batch
    (a left-padded row and a short offset one, padding NaN), a head subset out of order."""
    shape = AttnShape(B=3, Hq=4, Hkv=2, N=N, D=D)
    q, k, _ = qkv(shape, dtype, "cpu", N + block + D, sharpness=2.0)
    seqlens = torch.tensor([N, N - 30, block + 3], dtype=torch.int32)
    seqstarts = torch.tensor([0, 30, 11], dtype=torch.int32)
    ragged = dict(seqlens=seqlens, seqstarts=seqstarts, heads=torch.tensor([3, 0, 1], dtype=torch.int32))
    for kw in (dict(), ragged):
        if kw:
            q, k = _poison_padding(q, seqlens, seqstarts), _poison_padding(k, seqlens, seqstarts)
        with _nan_outputs():
            got = fast.query_block_scores(q, k, block=block, **kw)
        want = naive.query_block_scores(q, k, block=block, **kw)
        assert_scores_match(got, want, _bound(q, k, block, D ** -0.5, dtype, kw.get("seqlens"), kw.get("seqstarts")))


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_definition_properties(impl) -> None:
    """Straight from the definition: scores in (0, 1], the first block scores 1 (a softmax over one
    block), and each row's scores sum to at least 1 (each is at least one query's probability)."""
    shape = AttnShape(B=2, Hq=2, Hkv=1, N=150, D=32)
    q, k, _ = qkv(shape, torch.float32, "cpu", 7, sharpness=3.0)
    seqlens = torch.tensor([150, 70], dtype=torch.int32)
    s = impl.query_block_scores(q, k, block=16, seqlens=seqlens).double()
    for b, n in enumerate(seqlens.tolist()):
        nb = math.ceil(n / 16)
        tri = torch.tril(torch.ones(nb, nb, dtype=torch.bool))
        rows = s[b, :, :nb, :nb]
        assert bool((rows[:, tri] > 0).all() and (rows[:, tri] <= 1 + 1e-6).all())
        assert bool((rows[:, ~tri] == float("-inf")).all() and (s[b, :, nb:] == float("-inf")).all())
        torch.testing.assert_close(rows[:, 0, 0], torch.ones(2, dtype=torch.float64))
        assert bool((rows.masked_fill(~tri, 0).sum(-1) >= 1 - 1e-5).all())


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_one_query_keeps_its_far_block(impl) -> None:
    """A single query in the last block that needs key block 1 (a needle) gives that block the
    top score of its row; the mean-pooled routing score of the same block does not rank it first."""
    g = torch.Generator().manual_seed(1)
    N, D, block = 256, 32, 32
    q = torch.randn(1, 1, N, D, generator=g) * 0.3
    k = torch.randn(1, 1, N, D, generator=g) * 0.3
    k[0, 0, block + 5, 0] = 40.0  # one key of block 1: the block mean is still large along dim 0
    q[0, 0, N - block :, 1] += 1.5  # the last block's queries prefer its own keys
    k[0, 0, N - block :, 1] += 1.5
    q[0, 0, N - 3, :2] = torch.tensor([4.0, 0.0])  # but one of them reads the far key
    s = impl.query_block_scores(q, k, block=block, scale=1.0)
    last = s[0, 0, -1]
    assert int(last.argmax()) == 1 and float(last[1]) > 0.9
    _, pooled = portable.block_sparse_index(q, k, 1, block=block, scale=1.0, return_scores=True)
    assert int(pooled[0, 0, -1].argmax()) != 1


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_scoring_rows_from_the_definition(impl) -> None:
    """``score_rows``, written out by hand: each query's softmax against the block means, maxed over
    the block's last valid query alone (one row) or its last and the one 8 before it (two rows
    of a 16-block; only the last in the partial block of 6 queries); counts at or past the block
    are every row, and fewer rows never score higher."""
    shape = AttnShape(B=2, Hq=2, Hkv=1, N=150, D=32)
    q, k, _ = qkv(shape, torch.float32, "cpu", 5, sharpness=3.0)
    seqlens = torch.tensor([150, 70], dtype=torch.int32)
    full = impl.query_block_scores(q, k, block=16, seqlens=seqlens).double()
    for rows, back in ((1, (0,)), (2, (0, 8))):
        got = impl.query_block_scores(q, k, block=16, seqlens=seqlens, score_rows=rows).double()
        for b, n in enumerate(seqlens.tolist()):
            nb = math.ceil(n / 16)
            km = torch.stack([k[b, 0, J * 16 : min((J + 1) * 16, n)].double().mean(0) for J in range(nb)])
            for I in range(nb):
                last = min((I + 1) * 16, n) - 1
                probs = [torch.softmax(q[b, :, last - t].double() @ km[: I + 1].T / math.sqrt(32), dim=-1)
                         for t in back if last - t >= I * 16]  # [Hq, I + 1] each
                torch.testing.assert_close(got[b, :, I, : I + 1], torch.stack(probs).amax(0), rtol=1e-5, atol=1e-6)
        fin = torch.isfinite(full)
        assert torch.equal(torch.isfinite(got), fin) and bool((got[fin] <= full[fin] + 1e-6).all())
    for rows in (16, 40):
        torch.testing.assert_close(impl.query_block_scores(q, k, block=16, seqlens=seqlens, score_rows=rows).double(),
                                   full, rtol=0, atol=0)


@pytest.mark.interpret
def test_unsplit_keys_stay_within_fp16_rounding() -> None:
    """``QBS_SPLIT_KEYS = False`` (one MMA on fp16-rounded key means) is off by the fp16 rounding
    of the means alone."""
    shape = AttnShape(B=1, Hq=2, Hkv=1, N=200, D=64)
    q, k, _ = qkv(shape, torch.float16, "cpu", 3)
    with mock.patch.object(estimate_bs, "QBS_SPLIT_KEYS", False):
        got = triton_builders.query_block_scores(q, k, block=32)
    want = naive.query_block_scores(q, k, block=32)
    assert_scores_match(got, want, _bound(q, k, 32, 64 ** -0.5, torch.float16, key_unit=2.0 ** -11))


def test_argument_errors() -> None:
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16)
    for impl in (triton_builders, portable, naive):
        for bad in (0, -3, True, 1.5):
            with pytest.raises(ValueError, match="block must be"):
                impl.query_block_scores(q, k, block=bad)
        with pytest.raises(ValueError, match="query heads"):
            impl.query_block_scores(q, torch.randn(1, 3, 40, 16), block=16)
        with pytest.raises(ValueError, match="scale"):
            impl.query_block_scores(q, k, block=16, scale=-1.0)
        with pytest.raises(ValueError, match="seqlens"):
            impl.query_block_scores(q, k, block=16, seqlens=torch.tensor([41], dtype=torch.int32))
    with pytest.raises(ValueError, match="block must be an int in"):
        triton_builders.query_block_scores(q, k, block=estimate_bs.QBS_MAX_BLOCK * 2)
    empty = triton_builders.query_block_scores(q, k, block=16, heads=torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (1, 0, 3, 3)


def _cuda(kw: dict) -> dict:
    return {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}


@pytest.mark.gpu
@given(st.data())
def test_matches_naive_on_gpu(data) -> None:
    """The compiled kernel in bf16, fp16 and fp32 against the float64 definition."""
    dtype = data.draw(st.sampled_from((torch.bfloat16, torch.float16, torch.float32)), label="dtype")
    shape, q, k, kw = _case(data, dtype, GPU_SHAPES)
    with _nan_outputs():
        got = triton_builders.query_block_scores(q.cuda(), k.cuda(), **_cuda(kw)).cpu()
    want = naive.query_block_scores(q, k, **kw)
    assert_scores_match(got, want, _bound(q, k, kw["block"], _scale(kw, shape.D), dtype, kw["seqlens"],
                                          kw["seqstarts"]))


@pytest.mark.gpu
def test_cuda_graph_capture() -> None:
    """Ragged lengths live on the device: the whole call captures and replays in a CUDA graph."""
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=1000, D=64)
    q, k, _ = qkv(shape, torch.bfloat16, "cuda", 5)
    kw = dict(block=64, seqlens=torch.tensor([1000, 700], dtype=torch.int32, device="cuda"),
              seqstarts=torch.tensor([0, 300], dtype=torch.int32, device="cuda"))
    eager = triton_builders.query_block_scores(q, k, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_builders.query_block_scores(q, k, **kw)
    q.copy_(q.flip(2))
    graph.replay()
    torch.testing.assert_close(captured, triton_builders.query_block_scores(q, k, **kw), rtol=0, atol=0)
    assert not torch.equal(captured, eager)
