"""Host side of online index building: from a layer's per-head plan to head groups, per-head
budget tensors on the device, and the logical indices of each group.

A *plan* is a sequence of :mod:`minference.patterns` patterns indexed by GLOBAL head id; a rank
of a tensor-parallel run owns the local query heads ``0..Hq-1``, which are global heads
``head_offset..head_offset+Hq-1``.

Heads are grouped so that a layer costs a handful of launches, never one per head:

* every :class:`~minference.patterns.AShape` head in one group (budgets per head);
* :class:`~minference.patterns.VerticalSlash` heads by ``(last_q, aggregation)`` (the sampled
  rows and the reduction are kernel-wide; budgets, sinks and local diagonals are per head);
* :class:`~minference.patterns.BlockSparse` heads by ``(block, force_diagonal)``;
* every :class:`~minference.patterns.Dense` head in one group.

:func:`prepare_plan` turns the groups into device tensors once per (plan, device) and caches
them, so a prefill that reuses a plan creates no tensor from host data (a CUDA graph can
capture it after one eager warm-up call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType

import torch

from minference.patterns import AShape, BlockSparse, Dense, Pattern, VerticalSlash

__all__ = ["HeadGroup", "DeviceGroup", "group_heads", "prepare_plan", "build_group_index", "validate_plan"]

_PATTERN_CLASSES = (AShape, VerticalSlash, BlockSparse, Dense)
#: Order in which groups run (cheapest index first; purely cosmetic for traces).
_KIND_ORDER = {"a_shape": 0, "block_sparse": 1, "vertical_slash": 2, "dense": 3}
#: Plans prepared on devices kept alive (each holds a few small tensors).
PLAN_CACHE_SIZE = 256


@dataclass(frozen=True)
class HeadGroup:
    """Local query heads that share one index build and one kernel launch.

    Attributes:
        kind: the patterns' ``kind``.
        key: the kernel-wide settings the heads share (see the module docstring).
        heads: local query head ids, ascending.
        patterns: the pattern of each head, in the order of ``heads``.
    """

    kind: str
    key: tuple
    heads: tuple[int, ...]
    patterns: tuple[Pattern, ...]


@dataclass(frozen=True)
class DeviceGroup:
    """A :class:`HeadGroup` with its device tensors.

    Attributes:
        group: the head group.
        heads: ``[Hg]`` int32 local head ids on the device.
        budgets: per-head budgets as ``[head_offset + Hq]`` int64 tensors indexed by global head
            id (zero for heads outside the group), by builder / kernel argument name.
        widths: output index widths (the group's largest budgets) by builder argument name.
    """

    group: HeadGroup
    heads: torch.Tensor
    budgets: dict[str, torch.Tensor] = field(default_factory=dict)
    widths: dict[str, int] = field(default_factory=dict)


def validate_plan(plan: object, Hq: int, head_offset: int) -> tuple[Pattern, ...]:
    """Check ``plan`` covers global heads ``head_offset..head_offset+Hq-1`` with patterns; return
    the local slice."""
    if isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence):
        raise TypeError(f"plan must be a sequence of patterns indexed by global head, got {type(plan).__name__}")
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    if len(plan) < head_offset + Hq:
        raise ValueError(
            f"plan has {len(plan)} head patterns but global heads {head_offset}..{head_offset + Hq - 1} "
            f"are needed (head_offset {head_offset}, {Hq} local query heads)"
        )
    local = tuple(plan[head_offset : head_offset + Hq])
    for h, pattern in enumerate(local):
        if not isinstance(pattern, _PATTERN_CLASSES):
            raise TypeError(
                f"plan[{head_offset + h}] must be a pattern (AShape, VerticalSlash, BlockSparse, Dense), "
                f"got {type(pattern).__name__}"
            )
    return local


def _key(pattern: Pattern) -> tuple:
    if isinstance(pattern, VerticalSlash):
        return (pattern.last_q, pattern.aggregation)
    if isinstance(pattern, BlockSparse):
        return (pattern.block, pattern.force_diagonal)
    return ()


def group_heads(plan: Sequence[Pattern], Hq: int, head_offset: int = 0) -> list[HeadGroup]:
    """Group the local heads of ``plan`` (see the module docstring); deterministic order."""
    local = validate_plan(plan, Hq, head_offset)
    members: dict[tuple[str, tuple], list[int]] = {}
    for h, pattern in enumerate(local):
        members.setdefault((pattern.kind, _key(pattern)), []).append(h)
    groups = [HeadGroup(kind, key, tuple(hs), tuple(local[h] for h in hs)) for (kind, key), hs in members.items()]
    return sorted(groups, key=lambda g: (_KIND_ORDER[g.kind], repr(g.key)))


#: Builder / kernel argument name -> pattern field, per kind.
_BUDGET_FIELDS = {
    "a_shape": {"sink": "sink", "window": "window"},
    "vertical_slash": {"vertical": "vertical", "slash": "slash", "sink_columns": "sink_columns",
                       "local_diagonals": "local_diagonals"},
    "block_sparse": {"top_k": "top_k", "sink_blocks": "sink_blocks"},
    "dense": {},
}
#: Output width argument -> the budget it bounds.
_WIDTHS = {
    "vertical_slash": {"vertical_width": "vertical", "slash_width": "slash"},
    "block_sparse": {"top_k_width": "top_k"},
}


@lru_cache(maxsize=PLAN_CACHE_SIZE)
def _prepare(local: tuple[Pattern, ...], head_offset: int, device: str) -> tuple[DeviceGroup, ...]:
    Hq = len(local)
    out = []
    for group in group_heads(local, Hq, 0):
        heads = torch.tensor(group.heads, dtype=torch.int32, device=device)
        budgets = {}
        for arg, name in _BUDGET_FIELDS[group.kind].items():
            values = [0] * (head_offset + Hq)
            for h, pattern in zip(group.heads, group.patterns):
                values[head_offset + h] = getattr(pattern, name)
            budgets[arg] = torch.tensor(values, dtype=torch.int64, device=device)
        widths = {arg: max(getattr(p, _BUDGET_FIELDS[group.kind][b]) for p in group.patterns)
                  for arg, b in _WIDTHS.get(group.kind, {}).items()}
        out.append(DeviceGroup(group, heads, budgets, widths))
    return tuple(out)


def prepare_plan(plan: Sequence[Pattern], Hq: int, head_offset: int,
                 device: torch.device | str) -> tuple[DeviceGroup, ...]:
    """Validated, grouped plan with its device tensors (cached per plan slice, offset and device)."""
    local = validate_plan(plan, Hq, head_offset)
    return _prepare(local, head_offset, str(torch.device(device)))


def build_group_index(
    builders: ModuleType,
    group: DeviceGroup,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None,
    seqlens: torch.Tensor | None,
    seqstarts: torch.Tensor | None,
    head_offset: int,
    validate: bool = False,
):
    """Logical index of one group with ``builders`` (:mod:`minference.kernels.estimate` or
    :mod:`minference.torch_backend`).

    Returns:
        ``(vertical [B, Hg, NV], slash [B, Hg, NS])`` for vertical-slash groups, ``blocks
        [B, Hg, NQB, K]`` for block-sparse groups.
    """
    g = group.group
    common = dict(scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=group.heads, head_offset=head_offset,
                  validate=validate)
    if g.kind == "vertical_slash":
        last_q, aggregation = g.key
        return builders.vertical_slash_index(q, k, last_q=last_q, aggregation=aggregation, **group.budgets,
                                             **group.widths, **common)
    if g.kind == "block_sparse":
        block, force_diagonal = g.key
        return builders.block_sparse_index(q, k, block=block, force_diagonal=force_diagonal, **group.budgets,
                                           **group.widths, **common)
    raise ValueError(f"{g.kind} heads have no online index")
