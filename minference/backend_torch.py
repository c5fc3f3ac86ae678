"""The torch backend (:class:`minference.backend.Backend`): the functions of
:mod:`minference.torch_backend`, portable PyTorch on any device.

Each step calls one public function of :mod:`minference.torch_backend` with ``validate=False``
and ``checked=True``: the dispatcher validated the call once, at its edge, and those functions
skip their entry checks (as the Triton launchers do). It needs no value guard and no physical index: its
vertical-slash kernel fills the offset gaps itself. It reads row lengths on the host (a sync on
CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import minference.torch_backend as tb
from minference.backend import Rows, ValueGuard, VerticalSlashIndex
from minference.index import DeviceGroup, build_group_index

__all__ = ["TorchBackend", "TORCH"]


class TorchBackend:
    """``backend="torch"``: any device."""

    name = "torch"

    def vertical_slash_index(self, q: torch.Tensor, k: torch.Tensor, vertical: int | torch.Tensor,
                             slash: int | torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`minference.torch_backend.vertical_slash_index`."""
        return tb.vertical_slash_index(q, k, vertical, slash, checked=True, **kwargs)

    def block_sparse_index(self, q: torch.Tensor, k: torch.Tensor, top_k: int | torch.Tensor,
                           **kwargs: Any) -> torch.Tensor:
        """:func:`minference.torch_backend.block_sparse_index`."""
        return tb.block_sparse_index(q, k, top_k, checked=True, **kwargs)

    def check_plan(self, groups: Sequence[DeviceGroup], q: torch.Tensor, *, dense_over: float | None) -> None:
        """Every plan runs; ``dense_over`` is refused (no tile cost model here)."""
        if dense_over is not None:
            raise ValueError("dense_over needs the triton backend (the torch backend has no tile cost model)")

    def check_launch(self, q: torch.Tensor) -> None:
        """Nothing: the torch functions run any float dtype and head dim on any device."""

    def value_guard(self, k: torch.Tensor, v: torch.Tensor, *, checked: bool) -> ValueGuard | None:
        """None: the torch kernels need no guard."""
        return None

    def ashape(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DeviceGroup, *, head_offset: int,
               out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        tb.ashape_attention(q, k, v, group.budgets["sink"], group.budgets["window"], heads=group.heads,
                            head_offset=head_offset, out=out, validate=False, checked=True, **rows)

    def vertical_slash_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                   fill_gaps: int, dense_over: float | None, rows: Rows) -> VerticalSlashIndex:
        """The logical index (:func:`minference.torch_backend.vertical_slash_index`); no physical form."""
        vertical, slash = build_group_index(self, group, q, k, head_offset=head_offset, **rows)
        return VerticalSlashIndex(vertical, slash)

    def vertical_slash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex,
                       group: DeviceGroup, *, out: torch.Tensor, fill_gaps: int, guard: ValueGuard | None,
                       rows: Rows) -> None:
        """:func:`minference.torch_backend.vertical_slash_attention` on the logical sets, gaps filled there."""
        tb.vertical_slash_attention(q, k, v, index.vertical, index.slash, heads=group.heads, out=out, validate=False,
                                    fill_gaps=fill_gaps, checked=True, **rows)

    def block_sparse_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                 rows: Rows) -> torch.Tensor:
        return build_group_index(self, group, q, k, head_offset=head_offset, **rows)

    def block_sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     group: DeviceGroup, *, out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        tb.block_sparse_attention(q, k, v, blocks, block=group.group.key[0], heads=group.heads, out=out,
                                  validate=False, checked=True, **rows)

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None, *,
              out: torch.Tensor, guard: ValueGuard | None, rows: Rows, key_split: int | None = None) -> torch.Tensor:
        """:func:`minference.torch_backend.dense_attention` (``key_split`` and ``guard`` do not apply)."""
        return tb.dense_attention(q, k, v, heads=heads, out=out, validate=False, checked=True, **rows)


#: The one torch backend (stateless).
TORCH = TorchBackend()
