"""The backend seam: what the dispatcher asks of a backend, as one typed protocol.

:func:`minference.dispatch.sparse_prefill` runs each head group of a layer through a
:class:`Backend`: build the group's logical index (:class:`IndexBuilders`, the builder part that
:func:`minference.index.build_group_index` takes), convert it where the backend needs physical
tiles, and run the pattern's kernel into the layer's output. Two implementations, one module
each:

* :class:`minference.backend_triton.TritonBackend` (``"triton"``): the Triton builders and kernels
  of :mod:`minference.kernels` (CUDA, or the Triton interpreter on CPU tensors); sync-free with
  ``validate=False``, so the dispatcher's path can be captured in a CUDA graph.
* :class:`minference.backend_torch.TorchBackend` (``"torch"``): the functions of
  :mod:`minference.torch_backend`, portable PyTorch on any device.

Every method takes inputs the dispatcher has already validated (once, at its public edge, with
:meth:`Backend.check_plan` and :meth:`Backend.check_launch` for what the backend itself requires)
and calls the kernels with ``validate=False`` (the Triton ones also with ``checked=True``: no
second check of the arguments' form): a backend is not a public entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from minference.index import DeviceGroup
    from minference.kernels import VSIndex

__all__ = ["Rows", "ValueGuard", "VerticalSlashIndex", "IndexBuilders", "Backend", "get_backend"]

#: ``(k_masked, v_safe)`` of :func:`minference.kernels.value_guard`, made once per dispatcher call.
ValueGuard = tuple[torch.Tensor, torch.Tensor]


class Rows(TypedDict, total=False):
    """The row arguments every builder and kernel of one call takes (``scale``, ``seqlens`` and
    ``seqstarts`` always, ``scale`` ``None`` for the default; the query rows only when the call has
    them: docs/kernels.md)."""

    scale: float | None
    seqlens: torch.Tensor | None
    seqstarts: torch.Tensor | None
    q_seqlens: int | torch.Tensor | None
    q_seqstarts: torch.Tensor | None


@dataclass(frozen=True)
class VerticalSlashIndex:
    """One vertical-slash group's index: the logical sets and, on Triton, their physical tiles.

    Attributes:
        vertical: ``[B, Hg, NV]`` int32 key columns, -1 padded.
        slash: ``[B, Hg, NS]`` int32 offsets, -1 padded.
        physical: :class:`minference.kernels.VSIndex` (Triton: converted once, with gap filling
            and ``dense_over``), ``None`` on the torch backend (its kernel fills the gaps itself).
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    physical: VSIndex | None = None

    @property
    def dense(self) -> torch.Tensor | None:
        """``[B, Hg]`` bool heads the converter replaced by dense causal attention (Triton), else ``None``."""
        return None if self.physical is None else self.physical.dense


class IndexBuilders(Protocol):
    """The builder part of a backend: the online index builders with the signatures of
    :func:`minference.kernels.vertical_slash_index` / :func:`minference.kernels.block_sparse_index`
    (and their twins in :mod:`minference.torch_backend`), as :func:`minference.index.build_group_index`
    calls them (budgets and widths of a :class:`~minference.index.DeviceGroup` by keyword)."""

    def vertical_slash_index(
        self, q: torch.Tensor, k: torch.Tensor, vertical: int | torch.Tensor, slash: int | torch.Tensor, *,
        last_q: int, extra_rows: int, aggregation: str, sink_columns: int | torch.Tensor,
        local_diagonals: int | torch.Tensor, min_vertical: int | torch.Tensor, min_slash: int | torch.Tensor,
        vertical_width: int | None, slash_width: int | None, scale: float | None, seqlens: torch.Tensor | None,
        seqstarts: torch.Tensor | None, heads: torch.Tensor | None, head_offset: int, validate: bool,
        resolved: tuple | None, resolved_rules: tuple | None, q_seqlens: int | torch.Tensor | None = None,
        q_seqstarts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(vertical [B, Hg, NV], slash [B, Hg, NS])`` int32, -1 padded."""
        ...

    def block_sparse_index(
        self, q: torch.Tensor, k: torch.Tensor, top_k: int | torch.Tensor, *, block: int, force_diagonal: bool,
        estimate: str, score_rows: int, sink_blocks: int | torch.Tensor, min_blocks: int | torch.Tensor,
        top_k_width: int | None,
        scale: float | None, seqlens: torch.Tensor | None, seqstarts: torch.Tensor | None,
        heads: torch.Tensor | None, head_offset: int, validate: bool, resolved: tuple | None,
        resolved_rules: tuple | None, q_seqlens: int | torch.Tensor | None = None,
        q_seqstarts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``blocks [B, Hg, NQB, K]`` int32, -1 padded."""
        ...


class Backend(IndexBuilders, Protocol):
    """One backend of :func:`minference.dispatch.sparse_prefill`: a step per pattern.

    ``rows`` (:class:`Rows`) are the call's row arguments; ``guard`` the call's
    :data:`ValueGuard` (Triton; ``None`` makes one in the kernel, the torch backend ignores it);
    ``out [B, Hq, Nq, D]`` the layer's output, written on the group's heads only.
    """

    name: str

    def check_plan(self, groups: Sequence[DeviceGroup], q: torch.Tensor, *, dense_over: float | None) -> None:
        """Refuse, before any launch, what this backend cannot run."""
        ...

    def check_launch(self, q: torch.Tensor) -> None:
        """Refuse, once per call and before any launch, what the backend's kernels cannot run on
        (dtype, head dim, device) of a ``q`` that passed the dispatcher's checks."""
        ...

    def value_guard(self, k: torch.Tensor, v: torch.Tensor, *, checked: bool) -> ValueGuard | None:
        """The call's value guard, made once (``checked``: the call validated ``v``); ``None``
        where the backend needs none."""
        ...

    def ashape(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DeviceGroup, *, head_offset: int,
               out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        """A-shape attention of ``group``'s heads (its sink and window budgets) into ``out``."""
        ...

    def vertical_slash_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                   fill_gaps: int, dense_over: float | None, rows: Rows) -> VerticalSlashIndex:
        """``group``'s vertical-slash index (and its physical tiles where the kernel needs them)."""
        ...

    def vertical_slash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex,
                       group: DeviceGroup, *, out: torch.Tensor, fill_gaps: int, guard: ValueGuard | None,
                       rows: Rows) -> None:
        """Vertical-slash attention of ``group``'s heads on ``index`` into ``out``."""
        ...

    def block_sparse_group_index(self, q: torch.Tensor, k: torch.Tensor, group: DeviceGroup, *, head_offset: int,
                                 rows: Rows) -> torch.Tensor:
        """``group``'s block index ``[B, Hg, NQB, K]``."""
        ...

    def block_sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     group: DeviceGroup, *, out: torch.Tensor, guard: ValueGuard | None, rows: Rows) -> None:
        """Block-sparse attention of ``group``'s heads on ``blocks`` into ``out``."""
        ...

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None, *,
              out: torch.Tensor, guard: ValueGuard | None, rows: Rows, key_split: int | None = None) -> torch.Tensor:
        """Causal dense attention of ``heads`` (all: ``None``) on the call's rows or query rows into
        ``out``; returns ``out``. ``key_split``: Triton's key split (``None``: chosen from the shapes)."""
        ...


def get_backend(name: str) -> Backend:
    """The backend named ``"triton"`` or ``"torch"`` (a resolved name:
    :func:`minference.dispatch.resolve_backend`). Imported on first use, so the torch path never
    imports the Triton kernels."""
    if name == "triton":
        from minference.backend_triton import TRITON

        return TRITON
    if name == "torch":
        from minference.backend_torch import TORCH

        return TORCH
    raise ValueError(f"backend must be 'triton' or 'torch', got {name!r}")
