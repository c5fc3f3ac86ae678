"""The sets an index denotes, shared by the library and the oracle.

These are definitions, not fast paths: :func:`slash_set` closes vertical-slash offsets over gaps
(what every backend, the converter, the search and the float64 oracle compute), and
:func:`head_ids` / :func:`per_head_budget` read the computed heads and their budgets on the host
(the torch backend and :mod:`minference.reference` read them alike). The module sits at the
bottom of the library's layers with :mod:`minference._checks` and :mod:`minference.patterns`:
it imports nothing else of ``minference``, so both :mod:`minference.kernels` and
:mod:`minference.reference` may use it (``docs/architecture.md``, "Layers";
``tests/unit/project/test_layering.py``).
"""

from __future__ import annotations

import torch

from minference._checks import check_int, check_tensor

__all__ = ["scatter_set", "check_fill_gaps", "slash_set", "head_ids", "per_head_budget"]


def scatter_set(n: int, idx: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bool set from ``idx [..., K]`` (entries outside ``[0, n)`` dropped)."""
    idx = idx.long()
    keep = (idx >= 0) & (idx < n)
    target = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    target.scatter_(-1, torch.where(keep, idx, torch.full_like(idx, n)), True)
    return target[..., :n]


def check_fill_gaps(fill_gaps: object) -> int:
    """``fill_gaps`` must be a non-negative int (``0``: no filling)."""
    return check_int("fill_gaps", fill_gaps, 0)


def slash_set(n: int, slash: torch.Tensor, fill_gaps: int = 0) -> torch.Tensor:
    """``[..., n]`` bool: the chosen offsets ``D`` of ``slash [..., NS]`` (-1 padded, entries
    outside ``[0, n)`` dropped), with every **gap** of at most ``fill_gaps`` missing offsets
    between two chosen ones filled: offset ``x`` is added when the nearest chosen offsets below
    and above it, ``a < x < b``, satisfy ``b - a - 1 <= fill_gaps``.

    Filling never adds a tile the vertical-slash kernel would not visit anyway when
    ``fill_gaps < block_m`` (such gaps lie inside one slash run, whose key range is read whole),
    but it turns holey runs into solid ones that run without masks; it only adds candidates, so
    captured attention mass can only grow.
    """
    fill_gaps = check_fill_gaps(fill_gaps)
    chosen = scatter_set(n, slash)
    if fill_gaps == 0 or n == 0:
        return chosen
    pos = torch.arange(n, device=slash.device)
    below = torch.where(chosen, pos, -1).cummax(-1).values  # nearest chosen <= x
    above = torch.where(chosen, pos, n).flip(-1).cummin(-1).values.flip(-1)  # nearest chosen >= x
    return chosen | ((below >= 0) & (above < n) & (above - below - 1 <= fill_gaps))


def head_ids(heads: torch.Tensor | None, Hq: int) -> list[int]:
    """Local query heads to compute: ``heads`` (1-D int tensor of distinct ids) or all ``Hq``."""
    if heads is None:
        return list(range(Hq))
    check_tensor("heads", heads, rank=1, dtypes=(torch.int32, torch.int64))
    ids = heads.tolist()
    if len(set(ids)) != len(ids) or any(h < 0 or h >= Hq for h in ids):
        raise ValueError(f"heads must be distinct ids in [0, {Hq}), got {ids}")
    return ids


def per_head_budget(name: str, value: int | torch.Tensor, ids: list[int], head_offset: int,
                    minimum: int) -> list[int]:
    """Budget per computed head from an int or a 1-D int tensor indexed by global head id."""
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a 1-D int tensor, got bool")
    if isinstance(value, int):
        values = [value] * len(ids)
    elif isinstance(value, torch.Tensor):
        check_tensor(name, value, rank=1, dtypes=(torch.int32, torch.int64))
        every = value.tolist()
        if ids and head_offset + max(ids) >= len(every):
            raise ValueError(
                f"{name} has {len(every)} entries but global head {head_offset + max(ids)} is needed "
                f"(head_offset {head_offset})"
            )
        values = [every[head_offset + h] for h in ids]
    else:
        raise TypeError(f"{name} must be an int or a 1-D int tensor, got {type(value).__name__}")
    if any(x < minimum for x in values):
        raise ValueError(f"{name} must be >= {minimum} for every head, got {values}")
    return values
