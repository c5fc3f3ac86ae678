"""Shared input validation: every failure is a ValueError/TypeError naming the argument."""

from __future__ import annotations

import pytest
import torch

from minference._checks import (
    arange_constant,
    capturing,
    check_head_offset,
    check_index,
    check_qkv,
    check_query_rows,
    check_ragged,
    check_tensor,
    default_scale,
    same_device,
    uniform_query_rows,
)

I32 = torch.int32


def _qkv(B=2, Hq=4, Hkv=2, N=5, D=8, dtype=torch.float32):
    return torch.zeros(B, Hq, N, D, dtype=dtype), torch.zeros(B, Hkv, N, D, dtype=dtype), torch.zeros(
        B, Hkv, N, D, dtype=dtype)


def test_check_qkv_accepts_and_returns_sizes() -> None:
    assert check_qkv(*_qkv()) == (2, 4, 2, 5, 8)
    q, k, v = _qkv(dtype=torch.float16)
    assert check_qkv(q.transpose(1, 2).contiguous().transpose(1, 2), k, v) == (2, 4, 2, 5, 8)  # strided
    assert check_qkv(*_qkv(N=0)) == (2, 4, 2, 0, 8)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have rank 4"),
        (lambda q, k, v: (q, k[0], v), ValueError, "k must have rank 4"),
        (lambda q, k, v: (q, k, v.long()), TypeError, "v must have dtype"),
        (lambda q, k, v: (q, k.half(), v.half()), TypeError, "share a dtype"),
        (lambda q, k, v: (q, k, v[..., :4]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q[:1], k, v), ValueError, "k must be"),
        (lambda q, k, v: (q[..., :3, :], k, v), ValueError, "k must be"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of kv heads"),
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, "multiple of kv heads"),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, "k is a meta tensor"),
        (lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta")), ValueError, "q is a meta tensor"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_check_qkv_errors(mutate, exc, match) -> None:
    with pytest.raises(exc, match=match):
        check_qkv(*mutate(*_qkv()))


def test_check_ragged_defaults_and_values() -> None:
    lens, starts = check_ragged(None, None, 3, 7, "cpu")
    assert lens.tolist() == [7, 7, 7] and starts.tolist() == [0, 0, 0] and lens.dtype == starts.dtype == I32
    lens, starts = check_ragged(torch.tensor([0, 7, 3]), torch.tensor([7, 0, 4]), 3, 7, "cpu")
    assert lens.dtype == I32 and lens.tolist() == [0, 7, 3] and starts.tolist() == [7, 0, 4]
    # values=False skips the range checks (no host sync) but still checks shape and dtype
    check_ragged(torch.tensor([9], dtype=I32), None, 1, 7, "cpu", values=False)


@pytest.mark.parametrize(
    "lens, starts, exc, match",
    [
        ([8], None, ValueError, "seqlens must lie in"),
        ([-1], None, ValueError, "seqlens must lie in"),
        ([3], [5], ValueError, "seqstarts"),
        ([3], [-1], ValueError, "seqstarts"),
        (None, [1], ValueError, "seqstarts"),  # default length N leaves no room
        ([3, 3], None, ValueError, "seqlens must have shape"),
        ([[3]], None, ValueError, "seqlens must have rank 1"),
        ([3.0], None, TypeError, "seqlens must have dtype"),
    ],
)
def test_check_ragged_errors(lens, starts, exc, match) -> None:
    lens = None if lens is None else torch.tensor(lens)
    starts = None if starts is None else torch.tensor(starts)
    with pytest.raises(exc, match=match):
        check_ragged(lens, starts, 1, 7, "cpu")


def test_check_ragged_device_and_type() -> None:
    with pytest.raises(ValueError, match="seqlens is a meta tensor"):
        check_ragged(torch.tensor([3], device="meta"), None, 1, 7, "cpu")
    with pytest.raises(TypeError, match="seqstarts must be a torch.Tensor"):
        check_ragged(None, [0], 1, 7, "cpu")


def test_check_index() -> None:
    idx = torch.tensor([[[0, -1, 4]]], dtype=I32)
    assert check_index("vertical", idx, rank=3, lead=(1, 1), device="cpu", upper=5) is idx
    check_index("vertical", idx[..., :0], rank=3, lead=(1, 1), device="cpu", upper=5)  # empty is fine
    with pytest.raises(ValueError, match=r"vertical entries must lie in \[-1, 4\)"):
        check_index("vertical", idx, rank=3, lead=(1, 1), device="cpu", upper=4)
    with pytest.raises(ValueError, match="slash entries"):
        check_index("slash", idx - 2, rank=3, lead=(1, 1), device="cpu", upper=5)
    check_index("slash", idx - 2, rank=3, lead=(1, 1), device="cpu", upper=5, values=False)
    with pytest.raises(ValueError, match="axis 1 must have size 2"):
        check_index("vertical", idx, rank=3, lead=(1, 2), device="cpu", upper=5)
    check_index("vertical", idx, rank=3, lead=(1, -1), device="cpu", upper=5)  # -1: caller checks
    with pytest.raises(ValueError, match="rank 4"):
        check_index("blocks", idx, rank=4, lead=(1,), device="cpu", upper=5)
    with pytest.raises(TypeError, match="blocks must have dtype"):
        check_index("blocks", idx.float(), rank=3, lead=(1,), device="cpu", upper=5)
    with pytest.raises(ValueError, match="blocks is a meta tensor"):
        check_index("blocks", idx.to("meta"), rank=3, lead=(1,), device="cpu", upper=5)


def test_check_head_offset_and_scale() -> None:
    check_head_offset(4, 4, 8, "sink")
    with pytest.raises(ValueError, match="exceeds the 8 heads of sink"):
        check_head_offset(5, 4, 8, "sink")
    with pytest.raises(ValueError, match="head_offset"):
        check_head_offset(-1, 4, 8, "sink")
    with pytest.raises(TypeError, match="head_offset must be an int"):
        check_head_offset(True, 4, 8, "sink")
    assert default_scale(64, None) == 0.125 and default_scale(64, 2) == 2.0
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="scale"):
            default_scale(64, bad)


def test_small_helpers() -> None:
    assert same_device("cpu", torch.device("cpu")) and not same_device("cpu", "meta")
    assert same_device("cuda", "cuda:1") and not same_device("cuda:0", "cuda:1")
    assert capturing() is False
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        check_tensor("x", 3)


def test_arange_constant_follows_its_key() -> None:
    """The cached aranges: every length and dtype gets its own values, growing the cache (a
    longer length, then shorter ones again) never changes a view handed out before."""
    kept = []
    for n, dtype in [(0, torch.int64), (5, torch.int64), (3, torch.int32), (200, torch.int64), (7, torch.int32),
                     (1000, torch.int32), (64, torch.int64), (5, torch.int64)]:
        x = arange_constant(n, "cpu", dtype)
        assert x.dtype == dtype and torch.equal(x, torch.arange(n, dtype=dtype))
        kept.append((x, n, dtype))
    for x, n, dtype in kept:
        assert torch.equal(x, torch.arange(n, dtype=dtype))


@pytest.mark.parametrize("Nq, N", [(3, 8), (8, 8), (0, 4)])
@pytest.mark.parametrize("q_seqlens", [None, 0, 2, 5, 100])
def test_uniform_query_rows_equal_the_tensor_path(Nq, N, q_seqlens) -> None:
    """Full key rows with ``q_seqlens`` None or an int: the host-known constants of
    :func:`check_query_rows` equal what the same rows given as tensors give."""
    B = 3
    lens, starts = check_ragged(None, None, B, N, "cpu")
    got = check_query_rows(q_seqlens, None, lens, starts, Nq, N, given_rows=False)
    uniform = uniform_query_rows(q_seqlens, None, Nq, N, given_rows=False)
    if q_seqlens is None and Nq == N:
        assert got is None and uniform is None
        return
    count = Nq if q_seqlens is None else min(q_seqlens, Nq)
    want = check_query_rows(torch.full((B,), count, dtype=I32), None, lens, starts, Nq, N, given_rows=False)
    assert uniform == (count, N - count if Nq == N else 0)
    for a, b in zip(got, want):
        assert a.dtype == I32 and torch.equal(a, b)
    # ragged rows or given starts: never the constants
    assert uniform_query_rows(q_seqlens, None, Nq, N, given_rows=True) is None
    assert uniform_query_rows(q_seqlens, torch.zeros(B, dtype=I32), Nq, N, given_rows=False) is None
