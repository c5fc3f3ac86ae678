"""Routing-quality metrics against hand-computed values and brute-force loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.reference.attention import dense_attention_probs
from minference.reference.masks import ashape_mask, causal_mask, vertical_slash_mask
from minference.reference.metrics import (
    REGION_NAMES,
    captured_mass,
    captured_mass_by_region,
    captured_mass_per_query,
    cosine_similarity,
    density,
    pair_count,
    relative_error,
    tile_count,
)


def _uniform_probs(B: int, H: int, N: int) -> torch.Tensor:
    """Causal probabilities of all-equal scores: query ``i`` spreads ``1 / (i + 1)`` over ``0..i``."""
    i = torch.arange(N, dtype=torch.float64)[:, None]
    return (causal_mask(N).double() / (i + 1)).expand(B, H, N, N).clone()


def test_captured_mass_by_hand() -> None:
    N = 6
    probs = _uniform_probs(1, 1, N)
    first_column = torch.zeros(N, N, dtype=torch.bool)
    first_column[:, 0] = True
    per_query = captured_mass_per_query(probs, first_column)
    assert torch.allclose(per_query[0, 0], torch.tensor([1 / (i + 1) for i in range(N)], dtype=torch.float64))
    mean = sum(1 / (i + 1) for i in range(N)) / N
    assert math.isclose(float(captured_mass(probs, first_column)), mean, rel_tol=1e-12)
    regions = captured_mass_by_region(probs, first_column)
    assert list(regions) == list(REGION_NAMES)
    for r, name in enumerate(REGION_NAMES):
        want = (1 / (2 * r + 1) + 1 / (2 * r + 2)) / 2
        assert math.isclose(float(regions[name]), want, rel_tol=1e-12)
    assert torch.allclose(captured_mass(probs, causal_mask(N)), torch.ones(1, 1, dtype=torch.float64))
    assert float(captured_mass(probs, torch.zeros(N, N, dtype=torch.bool))) == 0.0


def test_captured_mass_ragged_rows() -> None:
    torch.manual_seed(0)
    N = 7
    q, k = torch.randn(2, 2, N, 16, dtype=torch.float64), torch.randn(2, 1, N, 16, dtype=torch.float64)
    seqlens, seqstarts = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([4, 2], dtype=torch.int32)
    probs = dense_attention_probs(q, k, seqlens=seqlens, seqstarts=seqstarts)
    dense = captured_mass(probs, causal_mask(N), seqlens=seqlens)
    assert torch.allclose(dense[0], torch.ones(2, dtype=torch.float64))
    assert torch.isnan(dense[1]).all()  # an empty row has no queries to average
    regions = captured_mass_by_region(probs, causal_mask(N), seqlens=seqlens)
    for name in REGION_NAMES:  # n = 3: one query per region
        assert torch.allclose(regions[name][0], torch.ones(2, dtype=torch.float64))
    short = captured_mass_by_region(probs, causal_mask(N), seqlens=torch.tensor([2, 1], dtype=torch.int32))
    # query i of an n-row sits in region floor(3 i / n): n = 2 -> start, middle; n = 1 -> start
    assert not torch.isnan(short["middle"][0]).any() and torch.isnan(short["end"][0]).all()
    assert not torch.isnan(short["start"][1]).any() and torch.isnan(short["middle"][1]).all()


@given(st.integers(1, 12), st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 5))
def test_metrics_match_brute_force(N: int, seed: int, bm: int, bn: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 2
    probs = torch.rand(B, H, N, N, generator=g, dtype=torch.float64)
    mask = torch.rand(B, H, N, N, generator=g) < 0.4
    lens = torch.randint(0, N + 1, (B,), generator=g, dtype=torch.int32)
    got_mass = captured_mass_per_query(probs, mask)
    got_pairs = pair_count(mask, seqlens=lens)
    got_tiles = tile_count(mask, bm, bn, seqlens=lens)
    for b in range(B):
        n = int(lens[b])
        for h in range(H):
            pairs, tiles = 0, set()
            for i in range(N):
                mass = sum(float(probs[b, h, i, j]) for j in range(N) if mask[b, h, i, j])
                assert math.isclose(float(got_mass[b, h, i]), mass, rel_tol=1e-12, abs_tol=1e-15)
                for j in range(i + 1):
                    if i < n and mask[b, h, i, j]:
                        pairs += 1
                        tiles.add((i // bm, j // bn))
            assert int(got_pairs[b, h]) == pairs
            assert int(got_tiles[b, h]) == len(tiles)


def test_pair_count_density_tiles_by_hand() -> None:
    assert int(pair_count(ashape_mask(8, 1, 2)[None, None])) == 21
    n = 1024
    vertical = torch.tensor([[[0, 512]]], dtype=torch.int32)
    none = torch.full((1, 1, 1), -1, dtype=torch.int32)
    assert int(pair_count(vertical_slash_mask(n, vertical, none))) == 1536
    dense = causal_mask(130)[None, None]
    assert float(density(dense)) == 1.0
    lens = torch.tensor([10, 0], dtype=torch.int32)
    assert pair_count(dense, seqlens=lens).tolist() == [[55], [0]]
    assert math.isnan(float(density(dense, seqlens=lens)[1, 0]))
    assert int(tile_count(dense, 64, 64)) == 3 + 2 + 1  # lower triangle of a 3 x 3 tile grid
    column = vertical_slash_mask(130, torch.tensor([[[0]]], dtype=torch.int32), none)
    assert int(tile_count(column, 64, 64)) == 3
    assert pair_count(dense.expand(1, 3, 130, 130)).shape == (1, 3)


def _outputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)


def test_relative_error_by_hand() -> None:
    ref = _outputs()
    assert torch.allclose(relative_error(ref * 1.01, ref), torch.full((2, 3), 0.01, dtype=torch.float64))
    assert math.isclose(float(relative_error(ref * 0.5, ref, reduce="all")), 0.5, rel_tol=1e-12)
    assert relative_error(ref.float(), ref).max() < 1e-6
    zero = torch.zeros_like(ref)
    assert relative_error(zero, zero).eq(0).all() and relative_error(ref, zero).isinf().all()
    # padding tokens are ignored, whatever they hold
    lens, starts = torch.tensor([4, 9], dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32)
    noisy = ref.clone()
    noisy[0, :, :5] += 100.0
    assert relative_error(noisy, ref, seqlens=lens, seqstarts=starts).eq(0).all()
    assert relative_error(noisy, ref, seqlens=lens).gt(1).all(dim=-1)[0]


def test_cosine_similarity_by_hand() -> None:
    ref = _outputs(1)
    assert torch.allclose(cosine_similarity(2 * ref, ref), torch.ones(2, 3, dtype=torch.float64))
    assert torch.allclose(cosine_similarity(-ref, ref), -torch.ones(2, 3, dtype=torch.float64))
    a = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    b = a.clone()
    a[..., 0], b[..., 1] = 1.0, 1.0
    assert float(cosine_similarity(a, b)) == 0.0
    assert float(cosine_similarity(torch.zeros_like(a), torch.zeros_like(a))) == 1.0
    assert float(cosine_similarity(torch.zeros_like(a), b)) == 0.0
    lens = torch.tensor([3, 9], dtype=torch.int32)
    tok = cosine_similarity(ref, ref, seqlens=lens, reduce="token")
    assert tok.shape == (2, 3, 9) and torch.isnan(tok[0, :, 3:]).all()
    assert torch.allclose(tok[0, :, :3], torch.ones(3, 3, dtype=torch.float64))
    mixed = ref.clone()
    mixed[:, :, 0] *= -1  # one token flipped: per-token cosine -1 there, head cosine below 1
    tok = cosine_similarity(mixed, ref, reduce="token")
    assert torch.allclose(tok[..., 0], -torch.ones(2, 3, dtype=torch.float64))
    assert (cosine_similarity(mixed, ref) < 1).all()


def test_metrics_reject_bad_inputs() -> None:
    probs = _uniform_probs(1, 1, 4)
    with pytest.raises(ValueError, match="probs"):
        captured_mass(probs[..., :3], causal_mask(4))
    with pytest.raises(TypeError, match="mask"):
        captured_mass(probs, causal_mask(4).int())
    with pytest.raises(ValueError, match="mask"):
        captured_mass(probs, causal_mask(3))
    with pytest.raises(TypeError, match="probs"):
        captured_mass(probs.long(), causal_mask(4))
    with pytest.raises(ValueError, match="seqlens"):
        captured_mass(probs, causal_mask(4), seqlens=torch.tensor([5]))
    ref = _outputs()
    with pytest.raises(ValueError, match="shape"):
        relative_error(ref[:, :2], ref)
    with pytest.raises(ValueError, match="rank"):
        relative_error(ref[0], ref[0])
    with pytest.raises(ValueError, match="reduce"):
        cosine_similarity(ref, ref, reduce="all")
    with pytest.raises(ValueError, match="block_m"):
        tile_count(causal_mask(4)[None, None], 0, 4)
    with pytest.raises(ValueError, match="rank"):
        pair_count(causal_mask(4))
    with pytest.raises(ValueError, match="seqlens"):
        pair_count(causal_mask(4).expand(2, 1, 4, 4), seqlens=torch.tensor([1, 2, 3]))


def test_metrics_reject_mixed_devices() -> None:
    probs = _uniform_probs(1, 1, 4)
    with pytest.raises(ValueError, match="mask is a meta tensor"):  # refused before the device check
        captured_mass(probs, causal_mask(4).to("meta"))
    ref = _outputs()
    with pytest.raises(ValueError, match="is a meta tensor"):
        relative_error(ref.to("meta"), ref)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="mask must be on"):
            captured_mass(probs, causal_mask(4).cuda())
        with pytest.raises(ValueError, match="one device"):
            relative_error(ref.cuda(), ref)
