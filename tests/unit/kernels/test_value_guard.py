"""The value guard (``kernels.value_guard``, docs/contract.md "Non-finite inputs") on the device
it runs on: its one Triton pass against its definition in torch (CUDA on a GPU, the interpreter
on CPU), and on a GPU the kernels' non-finite-value rule at GPU tiles, where unmasked tiles read
K/V through tensor descriptors and masked tiles read the guard's pair. The interpreter's version
of the rule, at interpreter tiles with the descriptor path forced, is in test_input_contract.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minference import kernels

pytestmark = pytest.mark.triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NAN, INF = float("nan"), float("inf")


@settings(deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 300 if CUDA else 70),
       D=st.sampled_from([1, 3, 16, 20, 64, 128] if CUDA else [1, 3, 16, 20, 64]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       layout=st.sampled_from(["bhnd", "bnhd", "expanded"]), data=st.data())
def test_value_guard_pass_matches_its_definition(B, H, N, D, dtype, layout, data):
    """The one-pass guard against ``isfinite(v).all(-1)`` per token row: ``k_masked`` is ``k``
    with NaN rows there, ``v_safe`` is ``v`` with zero rows there, bit for bit, for any batch,
    head count, length (none needs to be a multiple of the pass's row block), head dim (padded
    or not), dtype and layout (the transposed ``[B, N, H, D]`` view transformers hands over, an
    expanded head axis of stride 0), with NaN, +inf and -inf planted anywhere in ``v`` and in
    ``k`` (a non-finite key is copied as it is)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    stored = {"bhnd": (B, H, N, D), "bnhd": (B, N, H, D), "expanded": (B, 1, N, D)}[layout]
    base = [torch.randn(stored, generator=g).to(dtype) for _ in range(2)]  # what the views share
    cells = st.tuples(*(st.integers(0, n - 1) for n in stored), st.sampled_from([NAN, INF, -INF]))
    for x, name in zip(base, "kv"):
        for *at, value in data.draw(st.lists(cells, max_size=4), label=f"non-finite {name}"):
            x[tuple(at)] = value
    view = {"bhnd": lambda x: x, "bnhd": lambda x: x.transpose(1, 2), "expanded": lambda x: x.expand(B, H, N, D)}
    k, v = (view[layout](x.to(DEVICE)) for x in base)
    k_masked, v_safe = kernels.value_guard(k, v)
    finite = torch.isfinite(v).all(-1, keepdim=True)
    assert k_masked.is_contiguous() and v_safe.is_contiguous()
    assert k_masked.dtype == dtype and v_safe.dtype == dtype
    torch.testing.assert_close(k_masked, torch.where(finite, k, NAN), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_safe, torch.where(finite, v, 0), rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_keep_non_finite_values_to_the_rows_whose_set_holds_them(bad, dtype):
    """Validation off, GPU tiles (128-row query blocks, descriptor loads in unmasked tiles):
    non-finite values planted in value rows inside masked and unmasked tiles of every kernel
    (A-shape sinks, window edge and interior, vertical-slash columns and diagonals, block-sparse
    diagonal and off-diagonal blocks, the dense kernel with and without a key split). The
    non-finite output rows are exactly the rows whose candidate set (``reference.masks``) holds a
    planted token; every other row equals, bit for bit, the same call on ``v`` with those rows
    zeroed, which no such row reads."""
    from minference.reference import masks

    B, H, N, D, block = 1, 2, 1000, 64, 64
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(dtype).cuda() for _ in range(3))
    vertical = torch.tensor([[[1, 130, 517, 700, -1]] * H], dtype=torch.int32, device="cuda")
    slash = torch.tensor([[[0, 5, 120, 384]] * H], dtype=torch.int32, device="cuda")
    n_blocks = -(-N // block)  # each query block: block 0, itself, and the block two before it
    rows = [[0, max(qb - 2, 0), qb] if qb >= 2 else [0, qb, -1] for qb in range(n_blocks)]
    rows = [sorted(set(r) - {-1}) + [-1] * (3 - len(set(r) - {-1})) for r in rows]
    blocks = torch.tensor([[rows] * H], dtype=torch.int32, device="cuda")
    # planted tokens per kernel, so that some rows keep one and others do not: a token every
    # later row keeps (a sink, a vertical column, block 0, any token for dense) is planted late
    cases = {
        "ashape": (lambda vv: kernels.ashape_attention(q, k, vv, 4, 300, validate=False),
                   masks.ashape_mask(N, 4, 300), [130, 300, 517, 640, 901]),
        "ashape sink": (lambda vv: kernels.ashape_attention(q, k, vv, 4, 300, validate=False),
                        masks.ashape_mask(N, 4, 300), [2]),
        "vertical_slash": (lambda vv: kernels.vertical_slash_attention(q, k, vv, vertical, slash, validate=False),
                           masks.vertical_slash_mask(N, vertical.cpu(), slash.cpu()), [21, 300, 640, 700, 901]),
        "block_sparse": (lambda vv: kernels.block_sparse_attention(q, k, vv, blocks, block=block, validate=False),
                         masks.block_sparse_mask(N, blocks.cpu(), block), [130, 300, 517, 640, 901]),
        "dense": (lambda vv: kernels.dense_attention(q, k, vv, validate=False), masks.causal_mask(N), [517]),
        "dense split": (lambda vv: kernels.dense_attention(q, k, vv, key_split=3, validate=False),
                        masks.causal_mask(N), [517, 901]),
    }
    for name, (call, mask, planted) in cases.items():
        vb, v0 = v.clone(), v.clone()
        for n in planted:
            vb[:, :, n, n % D] = bad
        v0[:, :, planted] = 0.0
        hit = torch.zeros(N, dtype=torch.bool)
        hit[planted] = True
        want_bad = (mask.expand(B, H, N, N) & hit).any(-1)
        assert want_bad.any() and not want_bad.all(), name
        out = call(vb).cpu()
        assert torch.equal((~torch.isfinite(out)).any(-1), want_bad), name
        ok = ~want_bad
        torch.testing.assert_close(out[ok], call(v0).cpu()[ok], rtol=0, atol=0, msg=name)
