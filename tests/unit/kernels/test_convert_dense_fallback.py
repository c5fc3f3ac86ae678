"""Dense fallback of the vertical-slash converter (``dense_over``): heads whose index would run
more than ``dense_over`` times the dense causal key tiles get the dense causal index instead.

Expected values are computed here independently: the dense tile count in closed form, the
decision from it, the dense heads' mask as the causal mask, the other heads' index as the
plain conversion, and the kernel's output from the fp64 reference on the expected set.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from minference.kernels._common import default_tiles
from minference.kernels.convert import DENSE_OVER, VSIndex, convert_vertical_slash

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import vertical_slash_indices
from tests.unit.kernels.cases import CUDA, DEVICE, MAX_N, problem, run_and_check, torch_converter

pytestmark = pytest.mark.triton

_FIELDS = ("run_start", "run_end", "run_count", "run_solid", "col_index", "col_count", "diag_mask", "diag_bits",
           "col_mask", "dense")


def dense_tiles(n: int, block_m: int, block_n: int) -> int:
    """Key tiles of the causal triangle: query block at ``m0`` reads keys ``0 .. min(m0 + bm, n) - 1``."""
    return sum(-(-min(m0 + block_m, n) // block_n) for m0 in range(0, n, block_m))


def scattered(n: int, block_m: int, count: int) -> torch.Tensor:
    """Offsets more than ``block_m`` apart: every one its own run, every range its own masked tiles."""
    return torch.arange(0, n, block_m + 1, dtype=torch.int32)[:count]


def pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([torch.cat([r, torch.full((width - r.numel(),), -1, dtype=torch.int32)]) for r in rows])


def check_dense_heads(index: VSIndex, plain: VSIndex, expect_dense: torch.Tensor) -> None:
    """Dense heads expand to the causal mask exactly; the others equal the plain conversion."""
    n = index.n
    assert torch.equal(index.dense.cpu(), expect_dense)
    visits = kernels.vs_index_to_dense(index)
    causal = ref.causal_mask(n).int()
    B, H = expect_dense.shape
    for b in range(B):
        for h in range(H):
            if expect_dense[b, h]:
                assert torch.equal(visits[b, h], causal), f"head ({b}, {h}) is not the causal mask"
                assert int(index.run_count[b, h]) == 1 and int(index.run_start[b, h, 0]) == 0
                assert int(index.run_end[b, h, 0]) == n - 1 and index.run_start[b, h, 1:].eq(-1).all()
                assert int(index.run_solid[b, h, 0]) == 1 and index.run_solid[b, h, 1:].eq(0).all()
                assert index.col_count[b, h].eq(0).all() and index.col_index[b, h].eq(-1).all()
                assert index.col_mask[b, h].eq(0).all() and index.diag_mask[b, h].eq(1).all()
            else:
                for f in _FIELDS:
                    assert torch.equal(getattr(index, f)[b, h], getattr(plain, f)[b, h]), f"{f} of ({b}, {h})"


def test_scattered_head_is_replaced_local_head_is_not():
    n, bm, bn = 320, 16, 16
    far = scattered(n, bm, n)  # 0, 17, ..., 306
    local = torch.arange(4, dtype=torch.int32)
    NS = far.numel()
    slash = torch.stack([pad([far, local], NS), pad([local, far], NS)])  # [2, 2, NS]: mixed heads
    vertical = torch.tensor([[[0, 50], [0, -1]], [[-1, 7], [99, 99]]], dtype=torch.int32)
    plain = convert_vertical_slash(vertical, slash, n, block_m=bm)
    index = convert_vertical_slash(vertical, slash, n, block_m=bm, dense_over=0.5, block_n=bn)
    tiles = kernels.vs_physical_tiles(plain, bn)
    full = dense_tiles(n, bm, bn)
    # the geometry is what the test claims: scattered heads well above half, local ones well below
    assert (tiles[[0, 1], [0, 1]] > 0.9 * full).all() and (tiles[[0, 1], [1, 0]] < 0.4 * full).all()
    expect = torch.tensor([[True, False], [False, True]])
    check_dense_heads(index, plain, expect)
    # the replacement changed something: the scattered head's own set is not the causal mask
    assert not torch.equal(kernels.vs_index_to_dense(plain)[0, 0], ref.causal_mask(n).int())
    # the dense heads' tables equal those of the logical index "every offset" converted plainly
    every = convert_vertical_slash(torch.full((1, 1, 1), -1, dtype=torch.int32),
                                   torch.arange(n, dtype=torch.int32).view(1, 1, n), n, block_m=bm)
    for f in ("diag_mask", "diag_bits", "col_mask"):
        assert torch.equal(getattr(index, f)[0, 0], getattr(every, f)[0, 0]), f
    # without dense_over nothing is replaced and R stays NS
    assert not plain.dense.any() and plain.run_start.shape[-1] == NS


def test_no_offsets_every_column_is_replaced_too():
    """Columns alone can exceed the threshold; with NS = 0 the index still has room for one run."""
    n, bm, bn = 40, 16, 16
    vertical = torch.arange(n, dtype=torch.int32).view(1, 1, n)
    slash = torch.zeros(1, 1, 0, dtype=torch.int32)
    plain = convert_vertical_slash(vertical, slash, n, block_m=bm)
    index = convert_vertical_slash(vertical, slash, n, block_m=bm, dense_over=DENSE_OVER, block_n=bn)
    assert plain.run_start.shape[-1] == 1 and int(plain.run_count[0, 0]) == 0
    check_dense_heads(index, plain, torch.tensor([[True]]))


@given(data=st.data())
def test_decision_follows_the_tile_counts(data):
    """Mixed heads over several batch rows: replaced iff tiles > dense_over * dense causal tiles."""
    B = data.draw(st.integers(1, 3), label="B")
    H = data.draw(st.integers(1, 3), label="H")
    n = data.draw(st.integers(1, 90), label="n")
    bm, bn = data.draw(st.sampled_from(((1, 16), (4, 16), (16, 16), (64, 64), (16, 64))), label="tiles")
    dense_over = data.draw(st.sampled_from((0.0, 0.25, DENSE_OVER, 1.0, 2.0)), label="dense_over")
    vertical, slash = data.draw(vertical_slash_indices(B, H, n), label="index")
    far = scattered(n, bm, slash.shape[-1])
    for b in range(B):
        for h in range(H):
            if data.draw(st.booleans(), label=f"scatter ({b}, {h})"):
                slash[b, h] = -1
                slash[b, h, : far.numel()] = far
    # the fallback decides and replaces with torch ops after either converter: its CPU indices
    # take the torch one (as on a GPU runner); the kernel test below runs the Triton one with it
    with torch_converter():
        plain = convert_vertical_slash(vertical, slash, n, block_m=bm)
        index = convert_vertical_slash(vertical, slash, n, block_m=bm, dense_over=dense_over, block_n=bn)
    expect = kernels.vs_physical_tiles(plain, bn) > dense_over * dense_tiles(n, bm, bn)
    check_dense_heads(index, plain, expect)


@given(data=st.data())
def test_kernel_on_the_dense_fallback_index(data):
    """The Triton kernel on the converted index equals the fp64 reference on the expected set:
    causal for replaced heads, the logical set for the others (ragged rows, GQA, head subsets)."""
    p = problem(data, max_n=MAX_N if CUDA else 64)
    s = p["shape"]
    vertical, slash = data.draw(vertical_slash_indices(s.B, p["Hg"], s.N), label="index")
    dense_over = data.draw(st.sampled_from((0.0, DENSE_OVER)), label="dense_over")
    q = p["q"]
    bm, bn = kernels.vertical_slash_block_m(q), default_tiles(q).block_n
    far = scattered(s.N, bm, slash.shape[-1])
    for b in range(s.B):
        for h in range(p["Hg"]):
            if data.draw(st.booleans(), label=f"scatter ({b}, {h})"):
                slash[b, h] = -1
                slash[b, h, : far.numel()] = far
    index = convert_vertical_slash(vertical.to(DEVICE), slash.to(DEVICE), s.N, block_m=bm, dense_over=dense_over,
                                   block_n=bn)
    with torch_converter():  # the expected decision from the other converter
        plain = convert_vertical_slash(vertical, slash, s.N, block_m=bm)
    expect = kernels.vs_physical_tiles(plain, bn) > dense_over * dense_tiles(s.N, bm, bn)
    assert torch.equal(index.dense.cpu(), expect)
    width = max(s.N, slash.shape[-1])
    every = pad([torch.arange(s.N, dtype=torch.int32)], width).expand(s.B, p["Hg"], width)
    want_slash = torch.where(expect[..., None], every, F.pad(slash, (0, width - slash.shape[-1]), value=-1))

    def kernel(q, k, v, **kw):
        return kernels.vertical_slash_attention_physical(q, k, v, index, **kw)

    def twin(q, k, v, **kw):
        return ref.vertical_slash_attention(q, k, v, vertical, want_slash, **kw)

    run_and_check(p, kernel, twin)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-0.1, ValueError, "dense_over must be a finite number >= 0"),
        (math.nan, ValueError, "dense_over must be a finite number >= 0"),
        (math.inf, ValueError, "None disables"),
        (True, TypeError, "dense_over must be a float or None, got bool"),
        ("0.5", TypeError, "dense_over must be a float or None, got str"),
        (torch.tensor(0.5), TypeError, "dense_over must be a float or None, got Tensor"),
    ],
)
def test_bad_dense_over(value, error, match):
    idx = torch.zeros(1, 1, 2, dtype=torch.int32)
    with pytest.raises(error, match=match):
        convert_vertical_slash(idx, idx, 8, block_m=4, dense_over=value)


def test_bad_block_n():
    idx = torch.zeros(1, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_n must be >= 1"):
        convert_vertical_slash(idx, idx, 8, block_m=4, dense_over=0.5, block_n=0)
    with pytest.raises(TypeError, match="block_n must be an int"):
        convert_vertical_slash(idx, idx, 8, block_m=4, dense_over=0.5, block_n=16.0)


def test_values_above_one_are_allowed():
    """Physical tiles can exceed the dense count (unaligned ranges, gathered columns), so
    ``dense_over > 1`` is meaningful: only heads costlier than dense are replaced."""
    n, bm, bn = 64, 4, 16  # ranges of 4 keys, each in its own key tile
    slash = scattered(n, bm, n).view(1, 1, -1)
    vertical = torch.full((1, 1, 1), -1, dtype=torch.int32)
    plain = convert_vertical_slash(vertical, slash, n, block_m=bm)
    ratio = int(kernels.vs_physical_tiles(plain, bn)) / dense_tiles(n, bm, bn)
    assert ratio > 2
    assert convert_vertical_slash(vertical, slash, n, block_m=bm, dense_over=2.0, block_n=bn).dense.all()
    assert not convert_vertical_slash(vertical, slash, n, block_m=bm, dense_over=ratio, block_n=bn).dense.any()


@pytest.mark.gpu
def test_conversion_with_fallback_is_capturable():
    """A host synchronisation inside ``torch.cuda.graph`` raises; the replay equals an eager call."""
    n, B, H = 4096 + 37, 2, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    vertical = torch.randint(0, n, (B, H, 64), generator=g, device="cuda", dtype=torch.int32)
    far = torch.arange(0, 16 * 256, 16, device="cuda", dtype=torch.int32)  # scattered over n: replaced
    local = torch.arange(256, device="cuda", dtype=torch.int32)  # local: kept
    slash = torch.stack([far, local]).repeat(H // 2, 1).expand(B, H, 256).contiguous()
    kw = dict(block_m=128, dense_over=DENSE_OVER, block_n=64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        convert_vertical_slash(vertical, slash, n, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = convert_vertical_slash(vertical, slash, n, **kw)
    slash.copy_(slash.roll(1, dims=1))  # new values in the captured input: now odd heads are scattered
    graph.replay()
    eager = convert_vertical_slash(vertical, slash, n, **kw)
    assert eager.dense[:, 1::2].all() and not eager.dense[:, ::2].any()
    for f in _FIELDS:
        assert torch.equal(getattr(static, f), getattr(eager, f)), f
