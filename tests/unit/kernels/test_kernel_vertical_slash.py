"""Vertical-slash kernel vs its float64 twin, and the logical -> physical converter as exact sets.

Indices come from :func:`minference.testing.strategies.vertical_slash_indices`: duplicates,
unsorted rows, -1 padding anywhere, offsets that run off the start of rows, offset 0 present /
absent, verticals lying on slash diagonals.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.kernels import convert

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import AttnShape, qkv, vertical_slash_indices
from tests.unit.kernels.cases import (
    COMBOS,
    DEVICE,
    SHARP_CASES,
    check_sharp,
    problem,
    run_and_check,
    sharp_problem,
    torch_converter,
)

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_vertical_slash_matches_reference(data, combo):
    p = problem(data, combo=combo)
    s = p["shape"]
    vertical, slash = data.draw(vertical_slash_indices(s.B, p["Hg"], s.N), label="index")
    run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_filled_gaps_match_reference(data, combo):
    """Gap filling (below, at and above the query tile) computes exactly the filled set."""
    p = problem(data, combo=combo)
    s = p["shape"]
    vertical, slash = data.draw(vertical_slash_indices(s.B, p["Hg"], s.N), label="index")
    fill = data.draw(st.sampled_from((1, 5, 15, 40, 127, 300)), label="fill_gaps")
    run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash,
                  fill_gaps=fill)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_dense_slash_band_runs_unmasked_tiles(data, combo):
    """Local bands wide enough that whole tiles lie on chosen diagonals (the unmasked path)."""
    p = problem(data, combo=combo)
    s = p["shape"]
    width = data.draw(st.integers(1, s.N), label="band")
    slash = torch.arange(width, dtype=torch.int32).expand(s.B, p["Hg"], width).contiguous()
    vertical = torch.randint(0, s.N, (s.B, p["Hg"], 3), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(width))
    run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_columns_past_a_short_row_are_not_read(dtype):
    """Every column chosen, ragged rows: the last block's columns beyond the row's end are padding
    (poisoned with NaN) and must never be loaded, even though they lie before the block's end."""
    s = AttnShape(B=3, Hq=2, Hkv=1, N=150, D=16)
    q, k, v = qkv(s, dtype, DEVICE, seed=5)
    p = dict(shape=s, dtype=dtype, seqlens=torch.tensor([37, 21, 150], dtype=torch.int32),
             seqstarts=torch.tensor([0, 129, 0], dtype=torch.int32), heads=None, Hg=2, q=q, k=k, v=v)
    vertical = torch.arange(s.N, dtype=torch.int32).expand(3, 2, s.N).contiguous()
    slash = torch.full((3, 2, 1), -1, dtype=torch.int32)  # no slash range to absorb the columns
    run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash)


def test_only_the_diagonal():
    """Rows whose only candidate is themselves return v exactly (GQA: their kv head's v)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 16, generator=g).to(DEVICE)
    k = torch.randn(2, 2, 37, 16, generator=g).to(DEVICE)
    v = torch.randn(2, 2, 37, 16, generator=g).to(DEVICE)
    slash = torch.tensor([-1, 0, 0, -1], dtype=torch.int32).expand(2, 4, 4).contiguous().to(DEVICE)
    vertical = torch.full((2, 4, 2), -1, dtype=torch.int32, device=DEVICE)
    out, lse = kernels.vertical_slash_attention(q, k, v, vertical, slash, return_lse=True)
    assert torch.equal(out, v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(lse, (q * k.repeat_interleave(2, dim=1)).sum(-1) * 16**-0.5)


@given(data=st.data())
def test_converter_is_exact(data):
    """Physical tiles, expanded back to pairs, visit each logical pair exactly once and nothing else."""
    n = data.draw(st.integers(1, 90), label="n")
    block_m = data.draw(st.sampled_from((1, 4, 16, 64)), label="block_m")
    fill = data.draw(st.sampled_from((0, 0, 1, 3, 16, 40)), label="fill_gaps")
    vertical, slash = data.draw(vertical_slash_indices(2, 2, n), label="index")
    index = kernels.convert_vertical_slash(vertical.to(DEVICE), slash.to(DEVICE), n, block_m=block_m,
                                           fill_gaps=fill)
    visits = kernels.vs_index_to_dense(index).cpu()
    want = ref.vertical_slash_mask(n, vertical, slash, fill)
    # the host-side promise that lets the kernel compile out the bitmap path (checked per run below)
    assert index.all_solid == (fill >= block_m - 1)
    assert int(visits.max()) <= 1, "a (query, key) pair is visited twice"
    assert torch.equal(visits.bool(), want)
    # the leftover columns of a block are distinct, ascending, causal for the block and outside its ranges
    for b in range(2):
        for h in range(2):
            count = int(index.run_count[b, h])
            runs = [(int(a), int(z)) for a, z in zip(index.run_start[b, h, :count], index.run_end[b, h, :count])]
            assert all(z >= a for a, z in runs)
            assert all(nxt[0] - prev[1] > max(block_m, fill + 1) for prev, nxt in zip(runs, runs[1:]))
            # a run is flagged hole-free exactly when every offset of it is chosen
            solid = [bool(index.diag_mask[b, h, a : z + 1].all()) for a, z in runs]
            assert index.run_solid[b, h, :count].bool().tolist() == solid
            assert not index.run_solid[b, h, count:].any()
            if fill >= block_m - 1:  # every run is hole-free: the kernel masks only its edge tiles
                assert all(solid)
            valid = vertical[b, h][(vertical[b, h] >= 0) & (vertical[b, h] < n)]
            distinct = sorted(set(valid.tolist()))
            assert index.columns[b, h].tolist() == distinct + [-1] * (vertical.shape[-1] - len(distinct))
            for I in range(-(-n // block_m)):
                m0 = I * block_m
                cols = index.col_index[b, h, I, : int(index.col_count[b, h, I])].tolist()
                # the block's list begins with the head's first col_lead columns, and no further
                lead = int(index.col_lead[b, h, I])
                assert cols[:lead] == distinct[:lead]
                assert lead == len(distinct) or distinct[lead] not in cols
                assert cols == sorted(set(cols)) and all(0 <= c <= m0 + block_m - 1 for c in cols)
                assert int(index.col_before[b, h, I]) == sum(c < m0 for c in cols)
                assert not any(m0 - z <= c <= m0 + block_m - 1 - a for c in cols for a, z in runs)


@given(data=st.data())
def test_converter_kernels_match_torch_ops(data):
    """The three converter launches (CUDA / interpreter) equal the torch ops that CPU tensors take
    outside the interpreter and long lists take everywhere, field by field: unsorted indices with
    duplicates, padding and entries past ``n``, widths that are not powers of two, both int dtypes."""
    B, H = data.draw(st.integers(1, 2), label="B"), data.draw(st.integers(1, 3), label="H")
    n = data.draw(st.integers(1, 300), label="n")
    block_m = data.draw(st.sampled_from((1, 16, 64, 128)), label="block_m")
    fill = data.draw(st.sampled_from((0, 1, 5, 63, 127, 383, 10**9)), label="fill_gaps")
    NV, NS = data.draw(st.integers(0, 40), label="NV"), data.draw(st.integers(0, 70), label="NS")
    dtype = data.draw(st.sampled_from((torch.int32, torch.int64)), label="dtype")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    vertical = torch.randint(-2, n + 3, (B, H, NV), generator=g, dtype=dtype)
    slash = torch.randint(-2, n + 3, (B, H, NS), generator=g, dtype=dtype)
    if dtype == torch.int64 and NS:
        slash[..., 0] = 2**32 + 1  # past n, and 1 after a wrap to int32: must read as padding
    got = kernels.convert_vertical_slash(vertical.to(DEVICE), slash.to(DEVICE), n, block_m=block_m, fill_gaps=fill)
    # small chunks put the torch path's prefix sums through their two-level path
    chunk = data.draw(st.sampled_from((4, 16, convert._SCAN_CHUNK)), label="scan chunk")
    with mock.patch.object(convert, "_SCAN_CHUNK", chunk), mock.patch.object(convert, "LIST_CAP", 0):
        want = kernels.convert_vertical_slash(vertical, slash, n, block_m=block_m, fill_gaps=fill)
    for f in dataclasses.fields(convert.VSIndex):
        x, y = getattr(got, f.name), getattr(want, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y), f.name
        else:
            assert x == y, f.name


def test_converter_runs_unsorted_without_offset_zero():
    slash = torch.tensor([[[9, -1, 3, 40, 4, 3, 2]]], dtype=torch.int32)
    vertical = torch.tensor([[[5, 5, -1, 0]]], dtype=torch.int32)
    # distinct offsets 2, 3, 4, 9, 40: gaps 1, 1, 5, 31; runs merge gaps of at most block_m
    index = kernels.convert_vertical_slash(vertical, slash, 50, block_m=4)
    assert index.run_count.tolist() == [[3]]
    assert index.run_start[0, 0, :3].tolist() == [2, 9, 40] and index.run_end[0, 0, :3].tolist() == [4, 9, 40]
    assert index.run_start[0, 0, 3:].eq(-1).all() and index.run_end[0, 0, 3:].eq(-1).all()
    index = kernels.convert_vertical_slash(vertical, slash, 50, block_m=5)
    assert index.run_start[0, 0, :2].tolist() == [2, 40] and index.run_end[0, 0, :2].tolist() == [9, 40]
    # block 1 (rows 5..9) reads key ranges [0, 7] and none for δ=40: column 5 is inside, 0 too
    assert index.col_count[0, 0].tolist()[:2] == [0, 0]
    # block 9 (rows 45..49): ranges [36, 47] and [5, 9]: column 5 inside, column 0 left over
    assert index.col_index[0, 0, 9, : int(index.col_count[0, 0, 9])].tolist() == [0]


def test_converter_errors():
    v = torch.zeros(1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="share"):
        kernels.convert_vertical_slash(v, torch.zeros(1, 3, 3, dtype=torch.int32), 8, block_m=4)
    with pytest.raises(TypeError, match="slash must have dtype"):
        kernels.convert_vertical_slash(v, v.float(), 8, block_m=4)
    with pytest.raises(ValueError, match="block_m must be >= 1"):
        kernels.convert_vertical_slash(v, v, 8, block_m=0)


def test_bad_indices():
    q = torch.randn(1, 2, 30, 16, device=DEVICE)
    k = torch.randn(1, 1, 30, 16, device=DEVICE)
    good = torch.zeros(1, 2, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"slash entries must lie in \[-1, 30\)"):
        kernels.vertical_slash_attention(q, k, k, good, good + 30)
    with pytest.raises(ValueError, match=r"vertical entries must lie"):
        kernels.vertical_slash_attention(q, k, k, good - 2, good)
    with pytest.raises(TypeError, match="vertical must have dtype"):
        kernels.vertical_slash_attention(q, k, k, good.half(), good)
    with pytest.raises(ValueError, match="vertical axis 1 must have size 2"):
        kernels.vertical_slash_attention(q, k, k, good[:, :1], good)
    with pytest.raises(ValueError, match="vertical axis 1 must have size 1"):
        kernels.vertical_slash_attention(q, k, k, good, good, heads=torch.tensor([1], device=DEVICE))


@given(data=st.data())
def test_physical_tile_count_matches_the_kernel_loop(data):
    """``vs_physical_tiles`` (used for physical throughput) counts what the kernel's loops visit."""
    n = data.draw(st.integers(1, 120), label="n")
    block_m, block_n = data.draw(st.sampled_from(((16, 16), (32, 16), (128, 64))), label="tiles")
    vertical, slash = data.draw(vertical_slash_indices(1, 2, n), label="index")
    with torch_converter():  # CPU indices: the count is the subject, not the conversion
        index = kernels.convert_vertical_slash(vertical, slash, n, block_m=block_m)
    got = kernels.vs_physical_tiles(index, block_n)
    for h in range(2):
        want = 0
        for m0 in range(0, n, block_m):
            last = min(m0 + block_m, n) - 1
            for r in range(int(index.run_count[0, h])):
                lo = max(m0 - int(index.run_end[0, h, r]), 0)
                hi = min(m0 + block_m - 1 - int(index.run_start[0, h, r]), last) + 1
                want += len(range(lo, hi, block_n))
            want += -(-int(index.col_count[0, h, m0 // block_m]) // block_n)
        assert int(got[0, h]) == want


def _mutations(x: torch.Tensor):
    """Ways to make one field of a physical index disagree with the kernel's addressing: one entry
    short on the last axis, the right shape but not contiguous, the wrong dtype."""
    short = x[..., :-1]
    strided = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)[..., ::2]
    strided.copy_(x)
    wide = torch.int16 if x.dtype == torch.int64 else torch.int64
    return (("short", short, ValueError), ("strided", strided, ValueError), ("dtype", x.to(wide), TypeError))


def test_physical_index_must_match_the_kernel():
    """Every field of a mismatched physical index is refused before the launch, the same on every
    device: the geometry is derived from the kernel's own query tile (several query blocks, several
    columns and runs), so no mutation below is a no-op there. (On main the fixture was N=40, one
    column: with the CUDA fp32 tile of 64 rows there was one query block, so cutting col_lead to one
    block or transposing a [1, 1] col_index changed nothing, and the GPU tier saw "DID NOT RAISE".)"""
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(1, 2, 8, 16, generator=g).to(DEVICE)
    bm = kernels.vertical_slash_block_m(q0)
    N = 2 * bm + 7  # three query blocks, the last one partial
    q = torch.randn(1, 2, N, 16, generator=g).to(DEVICE)
    k = torch.randn(1, 1, N, 16, generator=g).to(DEVICE)
    vert = torch.tensor([[[3, N - 2, 0], [1, 1, -1]]], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([[[0, N // 2], [2, -1]]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_m"):
        kernels.vertical_slash_attention_physical(q, k, k, kernels.convert_vertical_slash(vert, sl, N, block_m=bm + 1))
    with pytest.raises(ValueError, match="index.n"):
        kernels.vertical_slash_attention_physical(q, k, k, kernels.convert_vertical_slash(vert, sl, N + 1, block_m=bm))
    with pytest.raises(TypeError, match="VSIndex"):
        kernels.vertical_slash_attention_physical(q, k, k, (vert, sl))
    good = kernels.convert_vertical_slash(vert, sl, N, block_m=bm)
    kernels.vertical_slash_attention_physical(q, k, k, good)  # the unmutated index is accepted
    with pytest.raises(ValueError, match=r"\[B, H\]"):
        kernels.vertical_slash_attention_physical(q[:, :1], k, k, good)
    # the sizes that define the others (R from run_start, NV from columns) name a sibling
    names = {"run_start": "index.(run_start|run_end|run_solid)", "columns": "index.(columns|col_index)",
             "run_count": r"\[B, H\]|index.run_count"}
    checked = 0
    for f in dataclasses.fields(convert.VSIndex):
        x = getattr(good, f.name)
        if not isinstance(x, torch.Tensor) or f.name in ("diag_mask", "dense"):  # not read by the kernel
            continue
        for how, bad, err in _mutations(x):
            # the mutation really changes what the kernel would address (never a no-op)
            assert bad.shape != x.shape or not bad.is_contiguous() or bad.dtype != x.dtype, (f.name, how)
            with pytest.raises(err, match=names.get(f.name, f"index.{f.name}")):
                kernels.vertical_slash_attention_physical(q, k, k, dataclasses.replace(good, **{f.name: bad}))
            checked += 1
    assert checked == 3 * 11


@pytest.mark.parametrize(("dtype", "nats", "shape", "seqlens", "seqstarts", "heads"), SHARP_CASES)
def test_masked_keys_dominating_the_kept_ones(dtype, nats, shape, seqlens, seqstarts, heads):
    """Masked keys inside visited tiles (off-diagonal keys of a range tile with holes, keys just
    after the row) lead the kept ones by 30 or 150 nats: a mask applied after the exponential fails."""
    Hg = shape.Hq if heads is None else len(heads)
    gen = torch.Generator().manual_seed(11)
    vertical = torch.randint(0, shape.N, (shape.B, Hg, 6), generator=gen, dtype=torch.int32)
    slash = torch.tensor([0, 1, 3, 4, 6, 9, 13, 17, 30], dtype=torch.int32).expand(shape.B, Hg, -1).contiguous()
    p = sharp_problem(shape, dtype, lambda b, g, L: ref.vertical_slash_mask(L, vertical[b, g], slash[b, g]),
                      nats=nats, seqlens=seqlens, seqstarts=seqstarts, heads=heads)
    check_sharp(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vertical, slash)
