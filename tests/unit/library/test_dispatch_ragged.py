"""The dispatcher's dense threshold on a ragged batch: one decision per call on the batch's
(padded) length ``N``, taken without reading ``seqlens`` on the host (no sync). With a threshold
strictly between the shortest and the longest row, every row, the short ones included, follows
its head's sparse pattern; only a threshold above ``N`` runs the whole batch dense."""

from __future__ import annotations

import pytest
import torch
from minference.reference import attention as ref

from minference.dispatch import sparse_prefill
from minference.patterns import AShape
from minference.testing import assert_close_to_reference
from minference.testing.strategies import AttnShape, qkv

SHAPE = AttnShape(B=3, Hq=4, Hkv=2, N=50, D=16)
SEQLENS = torch.tensor([20, 50, 35], dtype=torch.int32)  # the longest row in the middle
SEQSTARTS = torch.tensor([17, 0, 9], dtype=torch.int32)
SINK, WINDOW = 2, 5
PLAN = [AShape(sink=SINK, window=WINDOW)] * 4


def _refs(q, k, v, sparse: bool):
    rows = dict(seqlens=SEQLENS, seqstarts=SEQSTARTS)
    if sparse:
        return (ref.ashape_attention(q, k, v, SINK, WINDOW, **rows),
                ref.ashape_attention(q, k, v, SINK, WINDOW, **rows, compute_dtype=torch.float32))
    return ref.dense_attention(q, k, v, **rows), ref.dense_attention(q, k, v, **rows, compute_dtype=torch.float32)


@pytest.mark.parametrize("threshold", [21, 50])
def test_threshold_between_shortest_and_longest_row_runs_sparse(threshold: int) -> None:
    assert int(SEQLENS.min()) < threshold <= SHAPE.N == int(SEQLENS.max())
    q, k, v = qkv(SHAPE, torch.float32, "cpu", seed=4)
    out = sparse_prefill(q, k, v, PLAN, seqlens=SEQLENS, seqstarts=SEQSTARTS, dense_threshold=threshold,
                         backend="torch")
    r64, rsame = _refs(q, k, v, sparse=True)
    d64, _ = _refs(q, k, v, sparse=False)
    for b in range(SHAPE.B):  # every row, the ones shorter than the threshold too, is sparse
        s0, n = int(SEQSTARTS[b]), int(SEQLENS[b])
        rows = slice(s0, s0 + n)
        assert (r64[b, :, rows] - d64[b, :, rows]).abs().max() > 1e-2, "sparse and dense agree: no power"
        assert_close_to_reference(out[b, :, rows], r64[b, :, rows], rsame[b, :, rows], name=f"row {b}")
    # padding rows stay zero
    pad = torch.ones(SHAPE.B, SHAPE.N, dtype=torch.bool)
    for b in range(SHAPE.B):
        pad[b, int(SEQSTARTS[b]) : int(SEQSTARTS[b] + SEQLENS[b])] = False
    assert (out.permute(0, 2, 1, 3)[pad] == 0).all()


def test_threshold_above_the_batch_length_runs_dense() -> None:
    q, k, v = qkv(SHAPE, torch.float32, "cpu", seed=4)
    out = sparse_prefill(q, k, v, PLAN, seqlens=SEQLENS, seqstarts=SEQSTARTS, dense_threshold=SHAPE.N + 1,
                         backend="torch")
    d64, dsame = _refs(q, k, v, sparse=False)
    valid = torch.zeros(SHAPE.B, 1, SHAPE.N, 1, dtype=torch.bool)
    for b in range(SHAPE.B):
        valid[b, :, int(SEQSTARTS[b]) : int(SEQSTARTS[b] + SEQLENS[b])] = True
    assert_close_to_reference(out, d64, dsame, where=valid)
