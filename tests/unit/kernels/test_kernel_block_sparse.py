"""Block-sparse kernel vs its float64 twin: duplicated, unsorted and -1 padded block lists,
blocks above the diagonal, diagonal blocks forced or absent, every routing block size."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.kernels.block_sparse import normalize_blocks

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import block_sparse_indices
from tests.unit.kernels.cases import (
    COMBOS,
    CUDA,
    DEVICE,
    SHARP_CASES,
    check_sharp,
    problem,
    run_and_check,
    sharp_problem,
)

pytestmark = pytest.mark.triton

#: Routing blocks drawn: the GPU default and its neighbours; small ones under the interpreter.
BLOCKS = (32, 64, 128) if CUDA else (16, 32)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_block_sparse_matches_reference(data, combo):
    p = problem(data, combo=combo)
    block = data.draw(st.sampled_from(BLOCKS), label="block")
    s = p["shape"]
    blocks = data.draw(block_sparse_indices(s.B, p["Hg"], s.N, block), label="blocks")
    run_and_check(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)


@pytest.mark.parametrize("combo", COMBOS)
@given(data=st.data())
def test_block_sparse_key_split_matches_reference(data, combo):
    """A routing block read as two key tiles of half its size (``block_sparse._KEY_SPLIT``: the
    off-diagonal loop steps twice per block, each half of the diagonal block masked alone) gives
    the float64 twin's output, as the whole-block tiles do."""
    from minference.kernels import block_sparse

    p = problem(data, combo=combo)
    block = data.draw(st.sampled_from([b for b in BLOCKS if b >= 32]), label="block")
    s = p["shape"]
    blocks = data.draw(block_sparse_indices(s.B, p["Hg"], s.N, block), label="blocks")
    with patch.dict(block_sparse._KEY_SPLIT, {block: 2}):  # not monkeypatch: a fixture outlives the examples
        assert block_sparse._tiles(p["q"], block).block_n == block // 2
        run_and_check(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)


@pytest.mark.parametrize("block, split", [(16, 2), (64, 3), (32, 0)])
def test_key_split_that_is_not_a_whole_tile_is_refused(block, split, monkeypatch):
    """A ``_KEY_SPLIT`` entry whose key tile is not a whole part of the block, or smaller than a
    dot's 16 keys, is refused in one line before anything launches."""
    from minference.kernels import block_sparse

    monkeypatch.setitem(block_sparse._KEY_SPLIT, block, split)
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match=rf"^block_sparse._KEY_SPLIT\[{block}\] = {split}: "):
        block_sparse._tiles(q, block)


@given(data=st.data())
def test_normalized_blocks_are_the_same_set(data):
    """The launcher's sorted/deduplicated list plus the diagonal flag is exactly the causal set."""
    nqb = data.draw(st.integers(1, 12))
    blocks = data.draw(block_sparse_indices(2, 2, nqb, 1))
    off, count, diag = normalize_blocks(blocks)
    for b in range(2):
        for h in range(2):
            for i in range(nqb):
                want = {x for x in blocks[b, h, i].tolist() if 0 <= x <= i}
                got = off[b, h, i, : int(count[b, h, i])].tolist()
                assert got == sorted(set(got)) and all(x < i for x in got)
                assert set(got) | ({i} if diag[b, h, i] else set()) == want
                assert (off[b, h, i, int(count[b, h, i]):] == -1).all()


@given(data=st.data())
def test_ascending_blocks_normalize_alike(data):
    """``ascending=True`` (rows of distinct causal ids in ascending order, -1 after: what the
    one-launch selection writes) gives exactly the general normalisation."""
    nqb, K = data.draw(st.integers(1, 12)), data.draw(st.integers(0, 14))
    rows = []
    for i in range(nqb):
        ids = sorted(data.draw(st.sets(st.integers(0, i), max_size=min(K, i + 1))))
        rows.append(ids + [-1] * (K - len(ids)))
    dtype = data.draw(st.sampled_from((torch.int32, torch.int64)))
    blocks = torch.tensor(rows, dtype=dtype).reshape(1, 1, nqb, K)
    for fast, general in zip(normalize_blocks(blocks, ascending=True), normalize_blocks(blocks)):
        assert fast.dtype == general.dtype and fast.is_contiguous() and torch.equal(fast, general)


@pytest.mark.parametrize("rule, threshold", [("top_k", None), ("relative", 0.2)])
def test_ascending_builder_index(rule, threshold):
    """The query-aware builder's index is ascending where ``block_index_ascending`` says so: the
    launcher's check (``validate``) passes and the output equals the sorting path's; a row that
    breaks the promise is refused."""
    from minference.kernels import block_index_ascending, block_sparse_index

    from minference.index import block_sparse_rules, heads_tensor

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 70, 16, device=DEVICE) for h in (4, 2, 2))
    blocks = block_sparse_index(q, k, 3, block=16, sink_blocks=1, estimate="query", rule=rule, threshold=threshold)
    rules = block_sparse_rules(rule, threshold, 0, heads_tensor(None, 4, DEVICE), 0)
    assert block_index_ascending("query", None if rules is None else rules[0])
    assert not block_index_ascending("pooled", None)
    fast = kernels.block_sparse_attention(q, k, v, blocks, block=16, ascending=True)
    assert torch.equal(fast, kernels.block_sparse_attention(q, k, v, blocks, block=16))
    with pytest.raises(ValueError, match="ascending=True but"):
        kernels.block_sparse_attention(q, k, v, blocks.flip(-1), block=16, ascending=True)


def test_bad_blocks():
    q = torch.randn(1, 2, 40, 16, device=DEVICE)
    k = torch.randn(1, 1, 40, 16, device=DEVICE)
    good = torch.zeros(1, 2, 3, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block must be one of"):
        kernels.block_sparse_attention(q, k, k, good, block=24)
    with pytest.raises(TypeError, match="blocks must have dtype"):
        kernels.block_sparse_attention(q, k, k, good.float(), block=16)
    with pytest.raises(ValueError, match="blocks axis 2 must have size 3"):
        kernels.block_sparse_attention(q, k, k, good[:, :, :2], block=16)
    with pytest.raises(ValueError, match=r"blocks entries must lie in \[-1, 3\)"):
        kernels.block_sparse_attention(q, k, k, good + 3, block=16)
    with pytest.raises(ValueError, match="blocks must have rank 4"):
        kernels.block_sparse_attention(q, k, k, good[0], block=16)


@pytest.mark.parametrize(("dtype", "nats", "shape", "seqlens", "seqstarts", "heads"), SHARP_CASES)
def test_masked_keys_dominating_the_kept_ones(dtype, nats, shape, seqlens, seqstarts, heads):
    """Keys after the row inside its diagonal block (the only masked keys of a visited block) and
    in unselected blocks lead the kept ones by 30 or 150 nats: a mask applied after the
    exponential fails."""
    block = BLOCKS[0]
    Hg = shape.Hq if heads is None else len(heads)
    nqb = -(-shape.N // block)
    gen = torch.Generator().manual_seed(12)
    blocks = torch.randint(0, nqb, (shape.B, Hg, nqb, 2), generator=gen, dtype=torch.int32)
    blocks[..., 0] = torch.arange(nqb, dtype=torch.int32)  # the diagonal block: its future keys are masked
    # logical blocks of a row that starts at an offset are still counted from its first token
    p = sharp_problem(shape, dtype, lambda b, g, L: ref.block_sparse_mask(L, blocks[b, g, : -(-L // block)], block),
                      nats=nats, seqlens=seqlens, seqstarts=seqstarts, heads=heads)
    check_sharp(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)
