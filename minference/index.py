"""Host side of online index building: from a layer's per-head plan to head groups, per-head
budget tensors on the device, and the logical indices of each group.

A *plan* is a sequence of :mod:`minference.patterns` patterns indexed by GLOBAL head id; a rank
of a tensor-parallel run owns the local query heads ``0..Hq-1``, which are global heads
``head_offset..head_offset+Hq-1``.

Heads are grouped so that a layer costs a handful of launches, never one per head:

* every :class:`~minference.patterns.AShape` head in one group (budgets per head);
* :class:`~minference.patterns.VerticalSlash` heads by ``(last_q, extra_rows, aggregation)`` (the
  sampled rows and the reduction are kernel-wide; budgets, sinks and local diagonals are per head);
* :class:`~minference.patterns.BlockSparse` heads by ``(block, force_diagonal, estimate, score_rows)``
  (the routing block and the scorer are kernel-wide);
* every :class:`~minference.patterns.Dense` head in one group.

:func:`prepare_plan` turns the groups into device tensors once per (plan, device) and caches
them, so a prefill that reuses a plan creates no tensor from host data (a CUDA graph can
capture it after one eager warm-up call). :func:`build_group_index` builds one group's logical
index with a backend's builders (:class:`minference.backend.IndexBuilders`).

The builders' shared half (validation, budgets, budget rules, query rows and the selection
:func:`select_top`) lives one layer down in :mod:`minference.builders`, which the Triton
builders in :mod:`minference.kernels` import too; its public names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, TypedDict, cast

import torch

from minference._checks import BUDGET_MAX
from minference.builders import (
    ROUTING_CHUNK_ELEMENTS,
    RULE_CODES,
    QueryRows,
    SelectionRule,
    block_sparse_budgets,
    block_sparse_rules,
    blocks_from_slots,
    budget_tensor,
    build_block_sparse_index,
    build_vertical_slash_index,
    extra_row_positions,
    heads_tensor,
    query_rows,
    scorer_rows,
    select_top,
    select_vertical_slash,
    vertical_slash_budgets,
    vertical_slash_rules,
)
from minference.patterns import AShape, BlockSparse, Dense, Pattern, VerticalSlash

if TYPE_CHECKING:
    from minference.backend import IndexBuilders

__all__ = [
    "HeadGroup",
    "DeviceGroup",
    "group_heads",
    "prepare_plan",
    "build_group_index",
    "validate_plan",
    "heads_tensor",
    "budget_tensor",
    "SelectionRule",
    "RULE_CODES",
    "vertical_slash_rules",
    "block_sparse_rules",
    "select_top",
    "build_vertical_slash_index",
    "vertical_slash_budgets",
    "block_sparse_budgets",
    "select_vertical_slash",
    "build_block_sparse_index",
    "extra_row_positions",
    "QueryRows",
    "query_rows",
    "blocks_from_slots",
    "scorer_rows",
    "ROUTING_CHUNK_ELEMENTS",
]


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
        budgets: per-head budgets as ``[head_offset + Hq]`` tensors indexed by global head id
            (zero for heads outside the group), by builder / kernel argument name: int64, int32
            for A-shape (the kernel's dtype).
        widths: output index widths (the group's largest budgets) by builder argument name.
        resolved: the builder's per computed head budgets (:func:`vertical_slash_budgets`,
            :func:`block_sparse_budgets`), made once per plan; empty for other kinds.
        rules: the builder's per computed head budget rules (:func:`vertical_slash_rules`,
            :func:`block_sparse_rules`), made once per plan; ``None`` when every head of the
            group keeps ``top_k`` (and for other kinds).
    """

    group: HeadGroup
    heads: torch.Tensor
    budgets: dict[str, torch.Tensor] = field(default_factory=dict)
    widths: dict[str, int] = field(default_factory=dict)
    resolved: tuple[torch.Tensor, ...] = ()
    rules: tuple[SelectionRule, ...] | None = None




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
        return (pattern.last_q, pattern.extra_rows, pattern.aggregation)
    if isinstance(pattern, BlockSparse):
        return (pattern.block, pattern.force_diagonal, pattern.estimate, pattern.score_rows)
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
                       "local_diagonals": "local_diagonals", "min_vertical": "min_vertical",
                       "min_slash": "min_slash"},
    "block_sparse": {"top_k": "top_k", "sink_blocks": "sink_blocks", "min_blocks": "min_blocks"},
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
                values[head_offset + h] = min(getattr(pattern, name), BUDGET_MAX)  # beyond int32: "all"
            # A-shape budgets in the kernel's int32 (no cast per call); the builders' in int64
            dtype = torch.int32 if group.kind == "a_shape" else torch.int64
            budgets[arg] = torch.tensor(values, dtype=dtype, device=device)
        widths = {arg: min(max(getattr(p, _BUDGET_FIELDS[group.kind][b]) for p in group.patterns), BUDGET_MAX)
                  for arg, b in _WIDTHS.get(group.kind, {}).items()}
        resolved: tuple[torch.Tensor, ...] = ()
        rules: tuple[SelectionRule, ...] | None = None
        if group.kind in ("vertical_slash", "block_sparse"):
            # grouped by kind: the patterns of these two kinds are of their two classes
            ruled = cast("tuple[VerticalSlash | BlockSparse, ...]", group.patterns)
            used = frozenset(p.rule for p in ruled)
            code, thresholds = [0] * (head_offset + Hq), [1.0] * (head_offset + Hq)
            for h, pattern in zip(group.heads, ruled):
                code[head_offset + h] = RULE_CODES[pattern.rule]
                thresholds[head_offset + h] = 1.0 if pattern.threshold is None else pattern.threshold
            rule: str | torch.Tensor = "top_k"
            threshold: torch.Tensor | None = None
            if used != {"top_k"}:
                rule = torch.tensor(code, dtype=torch.int64, device=device)
                threshold = torch.tensor(thresholds, dtype=torch.float64, device=device)
        if group.kind == "vertical_slash":
            resolved = vertical_slash_budgets(budgets["vertical"], budgets["slash"], budgets["sink_columns"],
                                              budgets["local_diagonals"], heads, head_offset)
            rules = vertical_slash_rules(rule, threshold, budgets["min_vertical"], budgets["min_slash"], heads,
                                         head_offset, rules=used)
        elif group.kind == "block_sparse":
            resolved = block_sparse_budgets(budgets["top_k"], budgets["sink_blocks"], group.key[1], heads,
                                            head_offset)
            rules = block_sparse_rules(rule, threshold, budgets["min_blocks"], heads, head_offset, rules=used)
        out.append(DeviceGroup(group, heads, budgets, widths, resolved, rules))
    return tuple(out)


def prepare_plan(plan: Sequence[Pattern], Hq: int, head_offset: int,
                 device: torch.device | str) -> tuple[DeviceGroup, ...]:
    """Validated, grouped plan with its device tensors (cached per plan slice, offset and device)."""
    local = validate_plan(plan, Hq, head_offset)
    return _prepare(local, head_offset, str(torch.device(device)))


class _BuildArgs(TypedDict):
    """The arguments :func:`build_group_index` passes to both builders alike."""

    scale: float | None
    seqlens: torch.Tensor | None
    seqstarts: torch.Tensor | None
    heads: torch.Tensor
    head_offset: int
    validate: bool
    resolved: tuple[torch.Tensor, ...]
    resolved_rules: tuple[SelectionRule, ...] | None
    q_seqlens: int | torch.Tensor | None
    q_seqstarts: torch.Tensor | None


def build_group_index(
    builders: IndexBuilders,
    group: DeviceGroup,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None,
    seqlens: torch.Tensor | None,
    seqstarts: torch.Tensor | None,
    head_offset: int,
    validate: bool = False,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
):
    """Logical index of one group with a backend's ``builders``
    (:class:`minference.backend.IndexBuilders`, e.g. ``minference.backend.get_backend("triton")``,
    whose builders take the group's budgets on validated inputs). ``q_seqlens``, ``q_seqstarts``:
    query rows (docs/kernels.md; the builders sample only queries), forwarded.

    Returns:
        ``(vertical [B, Hg, NV], slash [B, Hg, NS])`` for vertical-slash groups, ``blocks
        [B, Hg, NQB, K]`` for block-sparse groups.
    """
    g, b, w = group.group, group.budgets, group.widths
    common = _BuildArgs(scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=group.heads, head_offset=head_offset,
                        validate=validate, resolved=group.resolved, resolved_rules=group.rules, q_seqlens=q_seqlens,
                        q_seqstarts=q_seqstarts)
    # the budgets and widths by the names _BUDGET_FIELDS and _WIDTHS give them for the group's kind
    if g.kind == "vertical_slash":
        last_q, extra_rows, aggregation = g.key
        return builders.vertical_slash_index(
            q, k, vertical=b["vertical"], slash=b["slash"], last_q=last_q, extra_rows=extra_rows,
            aggregation=aggregation, sink_columns=b["sink_columns"], local_diagonals=b["local_diagonals"],
            min_vertical=b["min_vertical"], min_slash=b["min_slash"], vertical_width=w["vertical_width"],
            slash_width=w["slash_width"], **common)
    if g.kind == "block_sparse":
        block, force_diagonal, estimate, score_rows = g.key
        return builders.block_sparse_index(
            q, k, top_k=b["top_k"], block=block, force_diagonal=force_diagonal, estimate=estimate,
            score_rows=score_rows,
            sink_blocks=b["sink_blocks"], min_blocks=b["min_blocks"], top_k_width=w["top_k_width"], **common)
    raise ValueError(f"{g.kind} heads have no online index")

