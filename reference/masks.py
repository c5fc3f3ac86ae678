"""Candidate sets straight from the formulas, as dense boolean causal masks.

Every mask is in *logical* coordinates: entry ``[..., i, j]`` says whether query position ``i``
reads key position ``j`` of the same sequence. All masks are causal (``j <= i``); a key reached
twice (a vertical inside a slash, a duplicated id, a sink inside the window) is simply ``True``
once. Positions that fall before 0 are dropped, never wrapped. ``-1`` is index padding.

These are slow and obviously right on purpose; they are the definition the kernels are tested
against. ``length_mask`` turns per-row lengths into the valid region of each row.

The set of a slash index (``slash_set``, with gap filling) and ``check_fill_gaps`` are defined in
:mod:`minference.index_sets`, which the library uses too, and exported here with the masks built
on them.
"""

from __future__ import annotations

import torch

from minference._checks import check_tensor
from minference.index_sets import check_fill_gaps, scatter_set, slash_set

__all__ = [
    "causal_mask",
    "length_mask",
    "ashape_mask",
    "vertical_slash_mask",
    "block_sparse_mask",
    "slash_set",
    "check_fill_gaps",
]

_INT = (torch.int32, torch.int64)

def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def causal_mask(n: int, device=None) -> torch.Tensor:
    """``[n, n]`` bool, ``True`` where ``j <= i``."""
    _check_n(n)
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def length_mask(n: int, seqlens: torch.Tensor) -> torch.Tensor:
    """``[B, 1, n, n]`` bool: both ``i`` and ``j`` below the row's length (``seqlens [B]``)."""
    _check_n(n)
    check_tensor("seqlens", seqlens, rank=1, dtypes=_INT)
    pos = torch.arange(n, device=seqlens.device)
    valid = pos[None, :] < seqlens[:, None].long()  # [B, n]
    return (valid[:, :, None] & valid[:, None, :])[:, None]


def ashape_mask(n: int, sink: int, window: int, device=None) -> torch.Tensor:
    """``[n, n]`` A-shape: ``{0..min(g-1, i)} ∪ {max(0, i-w+1)..i}`` for ``g = sink, w = window``."""
    _check_n(n)
    for name, value, lo in (("sink", sink, 0), ("window", window, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & ((j < sink) | (j > i - window))


def vertical_slash_mask(n: int, vertical: torch.Tensor, slash: torch.Tensor, fill_gaps: int = 0) -> torch.Tensor:
    """``[..., n, n]`` vertical-slash: ``{j ∈ C: j <= i} ∪ {i - δ: δ ∈ D, i - δ >= 0}``.

    Args:
        vertical: ``[..., NV]`` key columns ``C`` (absolute positions), -1 padded.
        slash: ``[..., NS]`` diagonal offsets ``D`` (``δ = i - j``), -1 padded.
        fill_gaps: ``D`` is first closed over gaps of at most this many offsets
            (:func:`slash_set`).
    """
    _check_n(n)
    check_tensor("vertical", vertical, dtypes=_INT)
    check_tensor("slash", slash, dtypes=_INT)
    if vertical.dim() < 1 or slash.dim() < 1 or vertical.shape[:-1] != slash.shape[:-1]:
        raise ValueError(
            f"vertical and slash must share leading dims, got {tuple(vertical.shape)} and {tuple(slash.shape)}"
        )
    cols = scatter_set(n, vertical)  # [..., n]
    diags = slash_set(n, slash, fill_gaps)  # [..., n]
    i = torch.arange(n, device=vertical.device)[:, None]
    j = torch.arange(n, device=vertical.device)[None, :]
    causal = j <= i
    offset = (i - j).clamp(min=0)  # [n, n]
    slash_part = diags[..., offset]  # [..., n, n]
    vertical_part = cols[..., None, :]  # [..., 1, n]
    return (slash_part | vertical_part) & causal


def block_sparse_mask(n: int, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., n, n]`` block-sparse: key ``j`` is read by ``i`` iff ``j // block`` is listed for
    query block ``i // block`` and ``j <= i``.

    Args:
        blocks: ``[..., NQB, K]`` key-block ids per query block, ``NQB = ceil(n / block)``, -1 padded.
        block: block size for queries and keys.
    """
    _check_n(n)
    check_tensor("blocks", blocks, dtypes=_INT)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    nb = -(-n // block)
    if blocks.dim() < 2 or blocks.shape[-2] != nb:
        raise ValueError(f"blocks must be [..., NQB={nb}, K] for n={n}, block={block}, got {tuple(blocks.shape)}")
    chosen = scatter_set(nb, blocks)  # [..., NQB, NKB]
    pos = torch.arange(n, device=blocks.device)
    qb = (pos // block)[:, None]
    kb = (pos // block)[None, :]
    causal = pos[None, :] <= pos[:, None]
    return chosen[..., qb, kb] & causal
