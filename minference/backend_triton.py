"""The Triton backend (:class:`minference.backend.Backend`): the builders and kernels of
:mod:`minference.kernels`.

Each step calls one public function of :mod:`minference.kernels` with ``validate=False`` and
``checked=True`` (the dispatcher validated the call once, at its edge, and
:meth:`TritonBackend.check_launch` added what the kernels require; no launcher or builder checks
the arguments' form again) and the call's value guard. Vertical-slash groups convert
their logical index to physical tiles here, inside the index step, so the conversion counts as
index time (:data:`minference.dispatch.INDEX_RANGE`). Nothing here synchronises with the host: the
dispatcher's path can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from minference import kernels
from minference.backend import Rows, ValueGuard, VerticalSlashIndex
from minference.index import DeviceGroup, build_group_index
from minference.kernels._common import check_launch, default_tiles

__all__ = ["TritonBackend", "TRITON"]


class TritonBackend:
    """``backend="triton"``: CUDA tensors, or CPU tensors in the Triton interpreter."""

    name = "triton"

    def vertical_slash_index(self, q: torch.Tensor, k: torch.Tensor, vertical: int | torch.Tensor,
                             slash: int | torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`minference.kernels.vertical_slash_index` on validated inputs (``checked=True``)."""
        return kernels.vertical_slash_index(q, k, vertical, slash, checked=True, **kwargs)

    def block_sparse_index(self, q: torch.Tensor, k: torch.Tensor, top_k: int | torch.Tensor,
                           **kwargs: Any) -> torch.Tensor:
        """:func:`minference.kernels.block_sparse_index` on validated inputs (``checked=True``)."""
        return kernels.block_sparse_index(q, k, top_k, checked=True, **kwargs)

    def check_plan(self, groups: Sequence[DeviceGroup], q: torch.Tensor, *, dense_over: float | None) -> None:
        """Refuse head dims and block sizes the kernels do not compile (``dense_over`` is checked by
        the converter)."""
        if q.shape[-1] not in kernels.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"the triton backend supports head dims {kernels.SUPPORTED_HEAD_DIMS}, got "
                             f"D={q.shape[-1]}; use backend='torch'")
        for dg in groups:
            if dg.group.kind == "block_sparse" and dg.group.key[0] not in kernels.BLOCK_SIZES:
                raise ValueError(f"BlockSparse.block={dg.group.key[0]} (heads {list(dg.group.heads)}) is not one of "
                                 f"the triton backend's block sizes {kernels.BLOCK_SIZES}; use backend='torch'")

    def check_launch(self, q: torch.Tensor) -> None:
        """:func:`minference.kernels._common.check_launch`: the kernels' dtypes, head dims and devices."""
        check_launch(q)

    def value_guard(self, k: torch.Tensor, v: torch.Tensor, *, checked: bool) -> ValueGuard | None:
        """:func:`minference.kernels.value_guard`: one pass making ``(k_masked, v_safe)``, or ``(k, v)``
        when ``checked``."""
        return kernels.value_guard(k, v, checked=checked)

    def ashape(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DeviceGroup, *, head_offset: int,
               out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        kernels.ashape_attention(q, k, v, group.budgets["sink"], group.budgets["window"], heads=group.heads,
                                 head_offset=head_offset, out=out, validate=False, value_guard=guard, checked=True,
                                 **rows)

    def vertical_slash_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                   fill_gaps: int, dense_over: float | None, rows: Rows) -> VerticalSlashIndex:
        """The logical index (:func:`minference.kernels.vertical_slash_index`), then its physical
        tiles (:func:`minference.kernels.convert_vertical_slash`: what
        :func:`~minference.kernels.vertical_slash_attention` does inside)."""
        vertical, slash = build_group_index(self, group, q, k, head_offset=head_offset, **rows)
        tiles = default_tiles(q)
        physical = kernels.convert_vertical_slash(vertical, slash, k.shape[2], block_m=tiles.block_m,
                                                  fill_gaps=fill_gaps, dense_over=dense_over, block_n=tiles.block_n)
        return VerticalSlashIndex(vertical, slash, physical)

    def vertical_slash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex,
                       group: DeviceGroup, *, out: torch.Tensor, fill_gaps: int, guard: ValueGuard | None,
                       rows: Rows) -> None:
        """:func:`minference.kernels.vertical_slash_attention_physical` on the converted tiles (gaps
        were filled by the conversion)."""
        kernels.vertical_slash_attention_physical(q, k, v, index.physical, heads=group.heads, out=out, validate=False,
                                                  value_guard=guard, checked=True, **rows)

    def block_sparse_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                 rows: Rows) -> torch.Tensor:
        return build_group_index(self, group, q, k, head_offset=head_offset, **rows)

    def block_sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     group: DeviceGroup, *, out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        """:func:`minference.kernels.block_sparse_attention`; an index the one-launch selection wrote
        is ascending already (:func:`minference.kernels.block_index_ascending`: no sort in the launcher)."""
        block, _, estimate, _ = group.group.key
        ascending = kernels.block_index_ascending(estimate, group.rules[0] if group.rules else None)
        kernels.block_sparse_attention(q, k, v, blocks, block=block, heads=group.heads, out=out, validate=False,
                                       ascending=ascending, value_guard=guard, checked=True, **rows)

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None, *,
              out: torch.Tensor, guard: ValueGuard | None, rows: Rows, key_split: int | None = None) -> torch.Tensor:
        """:func:`minference.kernels.dense_attention` (the A-shape kernel with no sink and a window as
        long as the key rows); ``key_split`` as there."""
        return kernels.dense_attention(q, k, v, heads=heads, out=out, validate=False, key_split=key_split,
                                       value_guard=guard, checked=True, **rows)


#: The one Triton backend (stateless).
TRITON = TritonBackend()
