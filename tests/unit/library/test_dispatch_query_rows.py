"""``sparse_prefill`` on query rows (a chunk after its cache): for every pattern, a chunk that
ends the prompt computes the same rows as the one-shot prefill of the whole prompt wherever its
index is the same by construction (vertical-slash from the same last rows, block-sparse on a
chunk that starts at a block edge, A-shape and dense always), on both backends; with ragged key
rows and explicit query rows it matches the float64 definition on the chunk's own index."""

from __future__ import annotations

import pytest
import torch

from minference.dispatch import MIN_SPARSE_QUERIES, sparse_prefill
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing import assert_close_to_reference
from minference.testing.strategies import AttnShape, qkv
from tests.unit.kernels.cases import backend_device

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
#: one head per pattern kind (and both block-sparse estimates), GQA 2
PLAN = [AShape(sink=2, window=9), VerticalSlash(vertical=6, slash=5, last_q=8),
        BlockSparse(top_k=2, block=16, sink_blocks=1), Dense(),
        BlockSparse(top_k=2, block=16, sink_blocks=0, rule="relative", threshold=0.3, estimate="query"),
        VerticalSlash(vertical=4, slash=8, last_q=16, rule="mass", threshold=0.9, min_vertical=2, min_slash=2)]


# chunk lengths that start at a block edge of 16 (N = 144); one on the interpreter (25 s a case)
@pytest.mark.parametrize(("backend", "C"), [("torch", 48), ("torch", 80), pytest.param("triton", 48,
                                                                                      marks=pytest.mark.triton)])
def test_a_chunk_ending_the_prompt_gives_the_one_shot_rows(backend, C):
    shape = AttnShape(B=2, Hq=6, Hkv=3, N=144, D=16)
    q, k, v = qkv(shape, torch.float32, backend_device(backend), seed=11, sharpness=2.0)
    full = sparse_prefill(q, k, v, PLAN, dense_threshold=0, backend=backend)
    chunk = sparse_prefill(q[:, :, -C:], k, v, PLAN, dense_threshold=0, backend=backend)
    assert chunk.shape == (2, 6, C, 16)
    torch.testing.assert_close(chunk, full[:, :, -C:], atol=2e-6, rtol=0)
    # and the tail on the chunk: its last rows dense, the rest unchanged
    tail = sparse_prefill(q[:, :, -C:], k, v, PLAN, dense_threshold=0, backend=backend, dense_tail=7)
    torch.testing.assert_close(tail[:, :, :-7], chunk[:, :, :-7], atol=0, rtol=0)
    dense = sparse_prefill(q, k, v, [Dense()] * 6, dense_threshold=0, backend=backend)
    torch.testing.assert_close(tail[:, :, -7:], dense[:, :, -7:], atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_query_rows_follow_each_row(backend):
    """Left-padded key rows, each row's chunk at its own place in q: row by row, the same as the
    unpadded single-row call (the definition of a ragged batch)."""
    shape = AttnShape(B=2, Hq=6, Hkv=3, N=144, D=16)
    q, k, v = qkv(shape, torch.float32, backend_device(backend), seed=12)
    lens = torch.tensor([144, 100], dtype=torch.int32, device=q.device)
    starts = torch.tensor([0, 44], dtype=torch.int32, device=q.device)
    q_lens = torch.tensor([48, 32], dtype=torch.int32, device=q.device)
    q_starts = torch.tensor([0, 16], dtype=torch.int32, device=q.device)
    qc = q[:, :, :48].clone()
    out = sparse_prefill(qc, k, v, PLAN, seqlens=lens, seqstarts=starts, q_seqlens=q_lens, q_seqstarts=q_starts,
                         dense_threshold=0, backend=backend)
    for b in range(2):
        n, s, c, qs = int(lens[b]), int(starts[b]), int(q_lens[b]), int(q_starts[b])
        alone = sparse_prefill(qc[b : b + 1, :, qs : qs + c], k[b : b + 1, :, s : s + n], v[b : b + 1, :, s : s + n],
                               PLAN, dense_threshold=0, backend=backend)
        torch.testing.assert_close(out[b : b + 1, :, qs : qs + c], alone, atol=2e-6, rtol=0)
        rest = torch.ones(48, dtype=torch.bool, device=q.device)
        rest[qs : qs + c] = False
        assert (out[b, :, rest] == 0).all(), "rows of q that are not queries come out as zeros"


def test_few_query_rows_run_dense_unless_forced():
    """Fewer than MIN_SPARSE_QUERIES query rows (a short continuation) run dense attention over the
    whole cache; dense_threshold=0 forces the sparse path."""
    shape = AttnShape(B=1, Hq=6, Hkv=3, N=144, D=16)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=13, sharpness=2.0)
    assert 40 < MIN_SPARSE_QUERIES
    dense = sparse_prefill(q, k, v, [Dense()] * 6, dense_threshold=0, backend="torch")[:, :, -40:]
    got = sparse_prefill(q[:, :, -40:], k, v, PLAN, dense_threshold=1, backend="torch")
    assert_close_to_reference(got, dense.double(), dense, floor=2e-6)
    forced = sparse_prefill(q[:, :, -40:], k, v, PLAN, dense_threshold=0, backend="torch")
    assert (forced - dense).abs().max() > 1e-2
