"""Routing-quality metrics in float64: how much of dense attention a sparse index keeps, and how
far a sparse output is from the dense one.

Two coordinate systems appear, as everywhere in this package:

* *logical* — ``probs [B, H, N, N]`` from :func:`minference.reference.attention.dense_attention_probs`
  and candidate masks from :mod:`minference.reference.masks`: entry ``[b, h, i, j]`` is the row's
  ``i``-th query and ``j``-th key, so a row of length ``n`` occupies ``[:n, :n]`` whatever its
  start on the ``N`` axis. Only ``seqlens`` matters here.
* *physical* — outputs ``[B, H, N, D]`` as kernels write them: row ``b``'s tokens sit at
  ``seqstarts[b] .. seqstarts[b] + seqlens[b] - 1``. Padding tokens are excluded from the
  comparison.

Metrics:

``captured_mass_per_query(probs, mask)`` ``[B, H, N]``: ``Σ_j P[i, j] · mask[i, j]``, the dense
probability mass a query keeps (1 for dense, 0 for padding queries).
``captured_mass(probs, mask, seqlens)`` ``[B, H]``: its mean over each row's valid queries.
``captured_mass_by_region(probs, mask, seqlens)`` dict ``start / middle / end -> [B, H]``: the mean
over the first, middle and last third of each row's queries (query ``i`` of a length-``n`` row is
in region ``floor(REGIONS * i / n)``); a region with no query (``n < 3``) is ``nan``.
``relative_error(out, ref, ...)`` ``‖out - ref‖_F / ‖ref‖_F`` per ``[B, H]`` (``reduce="head"``)
or over everything (``reduce="all"``, 0-dim); ``0`` when both are zero, ``inf`` when only the
reference is.
``cosine_similarity(out, ref, ...)`` per ``[B, H]`` over the flattened valid tokens
(``reduce="head"``) or per token ``[B, H, N]`` (``reduce="token"``, ``nan`` at padding); two zero
vectors have cosine 1, one zero vector cosine 0.
``pair_count(mask, seqlens)`` ``[B, H]`` int64: logical pairs ``(i, j)``, ``j <= i < n``, that
the mask keeps — the ``E_h`` of the design, independent of tiling.
``density(mask, seqlens)`` ``[B, H]``: ``pair_count`` over the ``n (n + 1) / 2`` causal pairs.
``tile_count(mask, block_m, block_n, seqlens)`` ``[B, H]`` int64: ``block_m x block_n`` tiles
(aligned to each row's first token) holding at least one kept pair — the physical work of a
kernel that skips empty tiles; multiply by ``block_m * block_n`` for the area.
"""

from __future__ import annotations

from typing import Literal

import torch

from minference._checks import check_ragged, check_tensor, same_device, token_mask

__all__ = [
    "REGIONS",
    "REGION_NAMES",
    "captured_mass_per_query",
    "captured_mass",
    "captured_mass_by_region",
    "relative_error",
    "cosine_similarity",
    "pair_count",
    "density",
    "tile_count",
]

#: Query regions of :func:`captured_mass_by_region` (equal thirds of each row's queries).
REGION_NAMES = ("start", "middle", "end")
REGIONS = len(REGION_NAMES)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_probs_mask(probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("probs", probs, rank=4, dtypes=_FLOAT)
    if probs.shape[-1] != probs.shape[-2]:
        raise ValueError(f"probs must be [B, H, N, N], got {tuple(probs.shape)}")
    mask = _check_mask(mask, probs.shape, probs.device)
    return probs.double(), mask


def _check_mask(mask: torch.Tensor, shape, device) -> torch.Tensor:
    check_tensor("mask", mask, dtypes=(torch.bool,))
    if not same_device(mask.device, device):
        raise ValueError(f"mask must be on {device}, got {mask.device}")
    try:
        return torch.broadcast_to(mask, shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None


def _logical_valid(seqlens, B: int, N: int, device) -> torch.Tensor:
    """``[B, N]`` bool: logical position ``i`` lies inside row ``b`` (``i < seqlens[b]``)."""
    lens, _ = check_ragged(seqlens, None, B, N, device)
    return torch.arange(N, device=device)[None, :] < lens[:, None]



def captured_mass_per_query(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dense probability mass each query keeps.

    Args:
        probs: ``[B, H, N, N]`` dense causal attention probabilities (logical coordinates).
        mask: bool candidate mask broadcastable to ``probs``.

    Returns:
        ``[B, H, N]`` float64.
    """
    probs, mask = _check_probs_mask(probs, mask)
    return torch.where(mask, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)).sum(-1)


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values [B, H, N]`` over ``valid [B, 1 or H, N]``; ``nan`` where nothing is valid."""
    valid = torch.broadcast_to(valid, values.shape)
    total = torch.where(valid, values, torch.zeros_like(values)).sum(-1)
    count = valid.sum(-1)
    return total / count  # 0 / 0 -> nan on purpose


def captured_mass(
    probs: torch.Tensor, mask: torch.Tensor, *, seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean captured mass over each row's valid queries: ``[B, H]`` float64 (``nan`` for empty rows).

    Args:
        probs: ``[B, H, N, N]`` dense causal probabilities, logical coordinates.
        mask: bool, broadcastable to ``probs``.
        seqlens: ``[B]`` row lengths (default: every row has ``N`` tokens).
    """
    per_query = captured_mass_per_query(probs, mask)
    B, _, N = per_query.shape
    return _masked_mean(per_query, _logical_valid(seqlens, B, N, probs.device)[:, None])


def captured_mass_by_region(
    probs: torch.Tensor, mask: torch.Tensor, *, seqlens: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Mean captured mass over the start, middle and end thirds of each row's queries.

    Returns:
        ``{name: [B, H] float64}`` for ``name`` in :data:`REGION_NAMES`; ``nan`` where a region
        holds no query.
    """
    per_query = captured_mass_per_query(probs, mask)
    B, _, N = per_query.shape
    lens, _ = check_ragged(seqlens, None, B, N, probs.device)
    i = torch.arange(N, device=probs.device)[None, :]
    valid = i < lens[:, None]
    region = (REGIONS * i) // lens.clamp(min=1)[:, None].long()  # [B, N]
    return {
        name: _masked_mean(per_query, (valid & (region == r))[:, None]) for r, name in enumerate(REGION_NAMES)
    }


def _check_outputs(out, ref, seqlens, seqstarts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_tensor("out", out, rank=4, dtypes=_FLOAT)
    check_tensor("ref", ref, rank=4, dtypes=_FLOAT)
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have one shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    if not same_device(out.device, ref.device):
        raise ValueError(f"out and ref must be on one device, got {out.device} and {ref.device}")
    B, _, N, _ = out.shape
    valid = token_mask(seqlens, seqstarts, B, N, out.device)[:, None, :, None]  # [B, 1, N, 1]
    zero = torch.zeros((), dtype=torch.float64, device=out.device)
    return torch.where(valid, out.double(), zero), torch.where(valid, ref.double(), zero), valid


def _check_reduce(reduce: str, allowed: tuple[str, ...]) -> None:
    if reduce not in allowed:
        raise ValueError(f"reduce must be one of {allowed}, got {reduce!r}")


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with ``0 / 0 = 0`` (identical zero tensors) and ``x / 0 = inf``."""
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(torch.float64).tiny),
                       torch.where(num > 0, torch.full_like(num, float("inf")), torch.zeros_like(num)))


def relative_error(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    reduce: Literal["head", "all"] = "head",
) -> torch.Tensor:
    """Frobenius relative error ``‖out - ref‖ / ‖ref‖`` over valid tokens, in float64.

    Args:
        out, ref: ``[B, H, N, D]`` (physical coordinates).
        seqlens, seqstarts: ``[B]`` ragged rows; padding tokens are ignored.
        reduce: ``"head"`` gives ``[B, H]``; ``"all"`` one 0-dim value over everything.
    """
    _check_reduce(reduce, ("head", "all"))
    o, r, _ = _check_outputs(out, ref, seqlens, seqstarts)
    dims = (-2, -1) if reduce == "head" else tuple(range(4))
    return _ratio((o - r).square().sum(dims).sqrt(), r.square().sum(dims).sqrt())


def cosine_similarity(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    reduce: Literal["head", "token"] = "head",
) -> torch.Tensor:
    """Cosine similarity of ``out`` and ``ref`` ``[B, H, N, D]``, in float64.

    ``reduce="head"``: over the flattened valid tokens of each head, ``[B, H]``.
    ``reduce="token"``: per token over ``D``, ``[B, H, N]``, ``nan`` at padding tokens.
    Two zero vectors have cosine 1; a zero vector against a non-zero one has cosine 0.
    """
    _check_reduce(reduce, ("head", "token"))
    o, r, valid = _check_outputs(out, ref, seqlens, seqstarts)
    dims = (-2, -1) if reduce == "head" else (-1,)
    dot = (o * r).sum(dims)
    no, nr = o.square().sum(dims).sqrt(), r.square().sum(dims).sqrt()
    both_zero = (no == 0) & (nr == 0)
    cos = torch.where(both_zero, torch.ones_like(dot), dot / (no * nr).clamp(min=torch.finfo(torch.float64).tiny))
    cos = cos.clamp(-1.0, 1.0)
    if reduce == "token":
        cos = torch.where(torch.broadcast_to(valid[..., 0], cos.shape), cos, torch.full_like(cos, float("nan")))
    return cos


def _kept(mask: torch.Tensor, seqlens) -> torch.Tensor:
    """``[B, H, N, N]`` bool: mask ∩ causal ∩ both positions inside the row (logical)."""
    check_tensor("mask", mask, rank=4, dtypes=(torch.bool,))
    if mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"mask must be [B, H, N, N], got {tuple(mask.shape)}")
    N = mask.shape[-1]
    B = mask.shape[0]
    if seqlens is not None:
        check_tensor("seqlens", seqlens, rank=1)
        if B not in (1, seqlens.shape[0]):
            raise ValueError(f"mask has {B} batch rows but seqlens has {seqlens.shape[0]}")
        B = seqlens.shape[0]
    valid = _logical_valid(seqlens, B, N, mask.device)  # [B, N]
    causal = torch.ones(N, N, dtype=torch.bool, device=mask.device).tril_()
    return mask & valid[:, None, :, None] & valid[:, None, None, :] & causal


def pair_count(mask: torch.Tensor, *, seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Logical pairs ``(i, j)``, ``j <= i < n``, kept by ``mask [B, H, N, N]``: ``[B, H]`` int64."""
    return _kept(mask, seqlens).sum((-2, -1))


def density(mask: torch.Tensor, *, seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of each row's ``n (n + 1) / 2`` causal pairs kept: ``[B, H]`` float64 (``nan`` if ``n = 0``)."""
    kept = pair_count(mask, seqlens=seqlens).double()
    B, N = kept.shape[0], mask.shape[-1]
    lens, _ = check_ragged(seqlens, None, B, N, mask.device)
    total = (lens.double() * (lens.double() + 1) / 2)[:, None]
    return kept / total


def tile_count(
    mask: torch.Tensor, block_m: int, block_n: int, *, seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Tiles of ``block_m`` queries x ``block_n`` keys holding at least one kept pair: ``[B, H]`` int64.

    Tiles are aligned to each row's first token (logical coordinates), as the kernels tile them.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    kept = _kept(mask, seqlens)
    B, H, N, _ = kept.shape
    tm, tn = -(-N // block_m), -(-N // block_n)
    padded = torch.zeros(B, H, tm * block_m, tn * block_n, dtype=torch.bool, device=kept.device)
    padded[..., :N, :N] = kept
    tiles = padded.view(B, H, tm, block_m, tn, block_n).any(dim=5).any(dim=3)
    return tiles.sum((-2, -1))
