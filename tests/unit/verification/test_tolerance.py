"""The tolerance rule passes what it should and catches what it must: perturbations, NaN,
unreproduced -inf, unwritten tiles, and a wrong candidate set."""

from __future__ import annotations

import pytest
import torch
from minference.reference.attention import masked_attention
from minference.reference.masks import causal_mask

from minference.testing import ATOL_FACTOR, FLOORS, assert_close_to_reference, assert_not_written, poison


def _refs(dtype=torch.float16, seed=0, n=40):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for _ in range(3))
    mask = causal_mask(n)
    ref64, lse64 = masked_attention(q, k, v, mask)
    ref_same, lse_same = masked_attention(q, k, v, mask, compute_dtype=dtype)
    return (q, k, v), ref64, ref_same.to(dtype), lse64, lse_same


def _bound(ref64, ref_same, dtype) -> float:
    return ATOL_FACTOR * float((ref_same.double() - ref64).abs().max()) + FLOORS[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_same_dtype_reference_passes(dtype) -> None:
    _, ref64, ref_same, _, _ = _refs(dtype)
    assert_close_to_reference(ref_same, ref64, ref_same)
    # an independent computation of the same quality (float32 arithmetic, rounded to dtype) passes too
    (q, k, v), *_ = _refs(dtype)
    other, _ = masked_attention(q, k, v, causal_mask(40), compute_dtype=torch.float32)
    assert_close_to_reference(other.to(dtype), ref64, ref_same)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_perturbed_output_fails(dtype) -> None:
    _, ref64, ref_same, _, _ = _refs(dtype)
    bad = ref64.clone()
    bad[0, 1, 17, 3] += 3 * _bound(ref64, ref_same, dtype)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_reference(bad.to(dtype), ref64, ref_same)
    # ... unless the element is outside the compared region
    where = torch.ones_like(ref64, dtype=torch.bool)
    where[0, 1, 17] = False
    assert_close_to_reference(bad.to(dtype), ref64, ref_same, where=where)


def test_wrong_candidate_set_fails() -> None:
    """Dropping one key from every row is far outside the float16 bound."""
    (q, k, v), ref64, ref_same, _, _ = _refs(torch.float16)
    mask = causal_mask(40).clone()
    mask[torch.arange(1, 40), 0] = False  # rows >= 1 no longer read key 0
    wrong, _ = masked_attention(q, k, v, mask, compute_dtype=torch.float32)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_reference(wrong.half(), ref64, ref_same)


def test_nan_fails_even_when_tiny_bound_would_not_matter() -> None:
    _, ref64, ref_same, _, _ = _refs()
    out = ref_same.clone()
    out[0, 0, 5, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_reference(out, ref64, ref_same)
    where = torch.ones(1, 2, 40, 1, dtype=torch.bool)
    where[0, 0, 5] = False
    assert_close_to_reference(out, ref64, ref_same, where=where)


def test_minus_inf_lse_must_be_reproduced() -> None:
    ref64 = torch.tensor([float("-inf"), 1.0, 2.0], dtype=torch.float64)
    ref_same = ref64.float()
    assert_close_to_reference(ref_same.clone(), ref64, ref_same, name="lse")
    with pytest.raises(AssertionError, match="non-finite reference"):
        assert_close_to_reference(torch.tensor([0.0, 1.0, 2.0]), ref64, ref_same, name="lse")
    with pytest.raises(AssertionError, match="non-finite value"):
        assert_close_to_reference(torch.tensor([float("-inf"), float("-inf"), 2.0]), ref64, ref_same)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_reference(torch.tensor([float("nan"), 1.0, 2.0]), ref64, ref_same)


def test_floor_keeps_exact_references_usable() -> None:
    ref64 = torch.tensor([0.5, 0.25], dtype=torch.float64)
    ref_same = ref64.float()  # exact in float32: the dtype forces no error
    floor = FLOORS[torch.float32]
    assert_close_to_reference(ref_same + floor / 4, ref64, ref_same)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_reference(ref_same + 4 * floor, ref64, ref_same)
    assert_close_to_reference(ref_same + 4 * floor, ref64, ref_same, floor=8 * floor)


def test_non_finite_same_dtype_reference_is_refused() -> None:
    ref64 = torch.tensor([1.0, 2.0], dtype=torch.float64)
    ref_same = torch.tensor([1.0, float("inf")])
    with pytest.raises(AssertionError, match="same-dtype reference is non-finite"):
        assert_close_to_reference(torch.tensor([50.0, 2.0]), ref64, ref_same)


def test_shape_mismatch_and_unknown_dtype() -> None:
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_close_to_reference(x.float(), x, x[:, :2])
    with pytest.raises(AssertionError, match="floor"):
        assert_close_to_reference(torch.zeros(2, 3, dtype=torch.int32), x, x)


def test_poison_and_not_written() -> None:
    out = poison(torch.empty(2, 4))
    assert torch.isnan(out).all()
    out[0] = 1.0
    rows = torch.tensor([[False], [True]])
    assert_not_written(out, rows)
    with pytest.raises(AssertionError, match="written"):
        assert_not_written(out, ~rows)
    # an unwritten element fails the rule itself
    ref = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_reference(out, ref, ref.float())
