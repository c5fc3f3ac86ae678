"""Dense attention with a key split (``minference.kernels.dense_attention``, ``key_split``): each
(query block, head, batch row) runs as several programs over disjoint key-tile ranges, merged by
log-sum-exp. Against the float64 dense twin (through the query-rows definition where there are
query rows): the tolerance rule on every computed row, float32 statistics, poisoned rows outside
the computed set left unwritten, NaN in every token no query may read; forced split counts from 1
(the unsplit A-shape call) to more splits than key tiles (splits without keys). The automatic
count is a function of shapes alone; the dispatcher's dense tail takes the split."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minference.kernels import ashape as A
from minference.kernels._common import INTERPRET_TILES, Tiles

from minference import kernels
from minference import reference as ref
from minference._checks import token_mask
from minference.testing import assert_close_to_reference, assert_not_written, poison
from minference.testing.strategies import AttnShape, qkv
from tests.unit.kernels.cases import COMBOS, CUDA, DEVICE, MAX_N, problem, query_problem, run_and_check, run_query_rows

pytestmark = pytest.mark.triton

#: Interpreted programs cost ~1 ms each and the split multiplies them: short rows, few examples.
SPLIT_MAX_N = MAX_N if CUDA else 96
FEW = settings(max_examples=min(settings().max_examples, 25 if CUDA else 8))


def _splits(n: int) -> st.SearchStrategy[int]:
    """1, a few, or more splits than the row has key tiles (some of them without keys)."""
    tiles = -(-n // INTERPRET_TILES.block_n) if not CUDA else -(-n // 64)
    return st.sampled_from((1, 2, 3, tiles + 2))


def _split(split: int):
    return functools.partial(kernels.dense_attention, key_split=split)


@pytest.mark.parametrize("combo", COMBOS)
@FEW
@given(data=st.data())
def test_split_whole_rows_match_reference(data, combo):
    """Whole rows (ragged, head subsets, GQA, strided), every query block split."""
    p = problem(data, max_n=SPLIT_MAX_N, combo=combo)
    split = data.draw(_splits(p["shape"].N), label="key_split")
    run_and_check(p, _split(split), ref.dense_attention)


@pytest.mark.parametrize("combo", COMBOS)
@FEW
@given(data=st.data())
def test_split_query_rows_match_reference(data, combo):
    """Query rows (a chunk after a cache with negative q row offsets, a row's last tokens in
    place, int or tensor q_seqlens, rows without queries) on ragged key rows."""
    p = query_problem(data, combo, max_n=SPLIT_MAX_N)
    split = data.draw(_splits(p["shape"].N), label="key_split")
    run_query_rows(p, _split(split), ref.dense_attention)


def test_split_counts_give_the_unsplit_result():
    """A tail of 20 rows against up to 146 keys (10 interpreter key tiles) over 1, 3 and 13
    splits: every split count agrees with the unsplit kernel (1 is that kernel itself, bit for
    bit) and the float64 reference; 13 leaves splits without keys. The tails' first rows sit two
    keys and one key before a tile edge (126, 95): the last unmasked tile ends exactly there."""
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=150, D=32)
    q, k, v = qkv(shape, torch.float32, DEVICE, seed=3, sharpness=2.0)
    lens = torch.tensor([146, 115], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 30], dtype=torch.int32, device=DEVICE)
    rows = dict(seqlens=lens, seqstarts=starts, q_seqlens=20, return_lse=True)
    base, base_lse = kernels.ashape_attention(q, k, v, 0, shape.N, **rows)
    one, one_lse = kernels.dense_attention(q, k, v, key_split=1, **rows)
    assert torch.equal(one, base) and torch.equal(one_lse, base_lse)
    r64, lse64 = ref.query_rows_attention(ref.dense_attention, q.cpu(), k.cpu(), v.cpu(), seqlens=lens.cpu(),
                                          seqstarts=starts.cpu(), q_seqlens=20)
    tail = token_mask(torch.tensor([20, 20]), torch.tensor([126, 125]), 2, shape.N, "cpu")[:, None, :, None]
    for split in (3, 13):
        out, lse = kernels.dense_attention(q, k, v, key_split=split, **rows)
        torch.testing.assert_close(out, base, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse, base_lse, atol=2e-6, rtol=0)
        assert (out.cpu().double() - r64).abs()[tail.expand_as(r64)].max() < 2e-6
        assert torch.isneginf(lse.cpu()[~tail[..., 0].expand_as(lse)]).all()


def test_empty_rows_and_rows_without_queries():
    """An empty key row comes out as zeros and lse -inf (out=None zero-fills); with ``out=``
    a row without queries is left as it was, whatever the split."""
    shape = AttnShape(B=3, Hq=2, Hkv=1, N=40, D=16)
    q, k, v = qkv(shape, torch.float16, DEVICE, seed=1)
    lens = torch.tensor([40, 0, 33], dtype=torch.int32, device=DEVICE)
    out, lse = kernels.dense_attention(q, k, v, seqlens=lens, key_split=5, return_lse=True)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    q_lens = torch.tensor([7, 0, 0], dtype=torch.int32, device=DEVICE)
    held = poison(torch.empty_like(q))
    kernels.dense_attention(q, k, v, seqlens=lens, q_seqlens=q_lens, out=held, key_split=3)
    assert_not_written(held[1:].cpu(), torch.ones(1, dtype=torch.bool))
    assert_not_written(held[:1, :, :33].cpu(), torch.ones(1, dtype=torch.bool))
    r64 = ref.dense_attention(q.cpu(), k.cpu(), v.cpu(), seqlens=lens.cpu())
    rsame = ref.dense_attention(q.cpu(), k.cpu(), v.cpu(), seqlens=lens.cpu(), compute_dtype=torch.float16)
    assert_close_to_reference(held[:1, :, 33:].cpu(), r64[:1, :, 33:], rsame[:1, :, 33:])


def test_automatic_split_depends_on_shapes_only():
    """The count comes from shapes (meta tensors: no value can be read) and the SM count. The
    testbed tail (B 1, Hq 14, 120K keys, the last 128 rows: a grid of 2 query blocks x 14 heads,
    128x64 tiles, 132 SMs) gets 9 splits (252 programs, at most 2 per SM; ~213 key tiles each);
    big grids, short rows and the interpreter get 1."""
    tiles = Tiles(128, 64, 4, 4)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    q, k = meta(1, 14, 122880, 64), meta(1, 2, 122880, 64)
    assert A.shape_key_split(q, k, None, 128, None, tiles, 132) == 9
    assert A.shape_key_split(q[:, :, -128:], k, None, None, None, tiles, 132) == 9  # a chunk of 128 rows
    assert A.shape_key_split(q, k, meta(7, dtype=torch.int32), 128, None, tiles, 132) == 18  # 7 heads
    assert A.shape_key_split(q[:, :, -128:], k, None, meta(1, dtype=torch.int32), meta(1, dtype=torch.int32),
                             tiles, 132) == 9  # tensor query rows: bounded by Nq
    assert A.shape_key_split(q, k, None, None, None, tiles, 132) == 1  # whole rows: 13440 programs
    assert A.shape_key_split(q, k, None, 128, None, tiles, 16) == 1  # 28 programs on 16 SMs
    assert A.shape_key_split(q[..., :1000, :], k[..., :1000, :], None, None, None, tiles, 132) == 2  # 112 programs
    assert A.shape_key_split(q[..., :500, :], k[..., :500, :], None, None, None, tiles, 132) == 1  # 8 key tiles
    assert A.shape_key_split(q[..., :4096, :], k[..., :4096, :], None, 128, None, tiles, 132) == 8  # 64 tiles
    assert A.shape_key_split(q, k, None, 0, None, tiles, 132) == 1  # no query rows, no grid
    for sms in (1, 66, 132, 264):
        for programs in (1, 14, 28, 263, 264, 10**5):
            for key_tiles in (0, 7, 8, 100, 1920, 10**6):
                c = A.key_split_count(programs, key_tiles, sms)
                assert 1 <= c <= A.KEY_SPLIT_MAX
                assert c == 1 or (c * programs <= A.KEY_SPLIT_PROGRAMS_PER_SM * sms
                                  and key_tiles // c >= A.KEY_SPLIT_MIN_TILES)
    x = torch.zeros(1, 2, 64, 16, device=DEVICE)
    if not CUDA:
        assert A._auto_key_split(x, x[:, :1], None, 8, None) == 1


def test_split_descriptor_path_matches_reference(monkeypatch):
    """The unmasked key tiles of a split read K/V through tensor descriptors on the GPU; forced
    under the interpreter here (ragged rows starting off 0, GQA, a head subset, query rows)."""
    from minference.kernels import _common

    built = []

    def forced(k, v, block_n, block_d):
        pair = _common.kv_descriptors(k, v, block_n, block_d, interpreter=not CUDA)
        built.append(pair[0] is not None)
        return pair

    monkeypatch.setattr(A, "kv_descriptors", forced)
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=120, D=64)
    q, k, v = qkv(shape, torch.float16, DEVICE, 8)
    p = dict(shape=shape, dtype=torch.float16, seqlens=torch.tensor([120, 77], dtype=torch.int32),
             seqstarts=torch.tensor([0, 29], dtype=torch.int32), heads=torch.tensor([2, 1], dtype=torch.int32),
             Hg=2, q=q[:, :, -24:].clone(), k=k, v=v, Nq=24, q_seqlens=torch.tensor([24, 19], dtype=torch.int32),
             q_seqstarts=torch.tensor([0, 3], dtype=torch.int32), q_lens=torch.tensor([24, 19]),
             q_starts=torch.tensor([0, 3]))
    run_query_rows(p, _split(3), ref.dense_attention)
    assert built and all(built), "the descriptor path did not run"


def test_key_split_argument_errors():
    q, k, v = qkv(AttnShape(B=1, Hq=2, Hkv=1, N=32, D=16), torch.float32, DEVICE, seed=0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="key_split"):
            kernels.dense_attention(q, k, v, key_split=bad)
        with pytest.raises(ValueError, match="key_split"):
            from minference.dispatch import dense_tail_attention

            dense_tail_attention(q, k, v, 8, out=torch.zeros_like(q), backend="triton", key_split=bad)


@pytest.mark.parametrize("split", [None, 3, 9])
def test_dense_tail_takes_the_split(split):
    """``dense_tail_attention`` on Triton with a forced split: its rows are dense (tolerance rule
    against float64), every other row of ``out`` (poisoned) is left alone."""
    from minference.dispatch import dense_tail_attention

    shape = AttnShape(B=2, Hq=4, Hkv=2, N=90, D=16)
    q, k, v = qkv(shape, torch.float32, DEVICE, seed=4, sharpness=2.0)
    lens, starts = torch.tensor([90, 13], dtype=torch.int32), torch.tensor([0, 50], dtype=torch.int32)
    out = poison(torch.empty_like(q))
    dense_tail_attention(q, k, v, 16, out=out, seqlens=lens.to(DEVICE), seqstarts=starts.to(DEVICE),
                         backend="triton", key_split=split)
    tail = token_mask(torch.tensor([16, 13]), torch.tensor([74, 50]), 2, shape.N, "cpu")[:, None, :, None]
    tail = tail.expand(q.shape)
    cpu = [x.cpu() for x in (q, k, v)]
    r64 = ref.dense_attention(*cpu, seqlens=lens, seqstarts=starts)
    rsame = ref.dense_attention(*cpu, seqlens=lens, seqstarts=starts, compute_dtype=torch.float32)
    assert_close_to_reference(out.cpu(), r64, rsame, where=tail)
    assert_not_written(out.cpu(), ~tail)


@pytest.mark.gpu
def test_automatic_split_on_the_gpu_tail():
    """On CUDA a 128-row tail against 2K keys splits by itself (14 heads; 4 splits on an H200:
    32 key tiles) and matches the unsplit kernel and the float64 reference (bf16)."""
    shape = AttnShape(B=1, Hq=14, Hkv=2, N=2048, D=64)
    q, k, v = qkv(shape, torch.bfloat16, "cuda", seed=6)
    assert A._auto_key_split(q, k, None, 128, None) > 1
    auto, lse = kernels.dense_attention(q, k, v, q_seqlens=128, return_lse=True, validate=False)
    one, one_lse = kernels.dense_attention(q, k, v, q_seqlens=128, return_lse=True, key_split=1)
    torch.testing.assert_close(lse, one_lse, atol=1e-4, rtol=0)
    r64, lse64 = ref.query_rows_attention(ref.dense_attention, *(x.cpu() for x in (q, k, v)), q_seqlens=128)
    rsame, _ = ref.query_rows_attention(ref.dense_attention, *(x.cpu() for x in (q, k, v)), q_seqlens=128,
                                        compute_dtype=torch.bfloat16)
    tail = torch.zeros(1, 1, shape.N, 1, dtype=torch.bool)
    tail[:, :, -128:] = True
    assert_close_to_reference(auto.cpu(), r64, rsame, where=tail.expand(q.shape))
    assert_close_to_reference(one.cpu(), r64, rsame, where=tail.expand(q.shape))
