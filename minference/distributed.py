"""Tensor parallelism by attention heads: each rank computes ``Hq / world`` query heads.

A PatternConfig is keyed by GLOBAL query head id; rank ``r`` holding ``H_local`` query heads
reads heads ``r * H_local + h`` (``head_offset = r * H_local``). Its kv heads are the matching
slice ``r * Hkv_local ...`` so every local query head keeps its GQA group (``Hkv`` must divide by
``world``, as in Megatron-style head sharding).

* :func:`head_shard` — the slices and offset of one rank.
* :func:`check_head_partition` — a collective check that the ranks' ``(head_offset, H_local)``
  tile ``[0, Hq)`` exactly (a wrong offset, an overlap or a gap raises on every rank).
* :func:`tp_sparse_prefill` — :func:`minference.dispatch.sparse_prefill` on local heads with the
  offset derived from the rank (optionally checked and gathered).
* :func:`row_shard` — which rows of a projection weight this rank holds when the weight is a
  ``DTensor`` sharded on its output rows (transformers' own ``tp_plan`` "colwise" sharding); the
  integration turns those rows into a head offset.

The model is sharded by transformers itself (``from_pretrained`` with a ``tp_plan``; see
:func:`minference.integration.tensor_parallel_kwargs`); :func:`minference.integration.patch`
reads each rank's heads from the sharded shapes. This module works on tensors only and imports
nothing of the integration (the layering is dispatch <- distributed <- integration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minference._checks import check_int
from minference.patterns import Pattern

__all__ = [
    "HeadShard",
    "head_shard",
    "shard_heads",
    "check_head_partition",
    "tp_sparse_prefill",
    "gather_heads",
    "row_shard",
]


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads.

    Attributes:
        rank, world: position in the tensor-parallel group.
        q: global query heads this rank holds (``range``).
        kv: global kv heads this rank holds (``range``).
        head_offset: global id of local query head 0 (``q.start``).
    """

    rank: int
    world: int
    q: range
    kv: range

    @property
    def head_offset(self) -> int:
        return self.q.start

    @property
    def local_heads(self) -> int:
        return len(self.q)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """Heads of ``rank`` out of ``world`` for a layer with ``num_heads`` query and
    ``num_kv_heads`` kv heads (both must divide by ``world``)."""
    check_int("num_heads", num_heads, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    check_int("world", world, 1)
    check_int("rank", rank, 0)
    if rank >= world:
        raise ValueError(f"rank must be < world ({world}), got {rank}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_kv_heads % world:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide by the tensor-parallel world size ({world})")
    hq, hkv = num_heads // world, num_kv_heads // world
    return HeadShard(rank, world, range(rank * hq, (rank + 1) * hq), range(rank * hkv, (rank + 1) * hkv))


def shard_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: HeadShard):
    """Views of this rank's heads: ``q [B, Hq, N, D] -> [B, H_local, N, D]``, k/v likewise."""
    kv = slice(shard.kv.start, shard.kv.stop)
    return q[:, shard.q.start : shard.q.stop], k[:, kv], v[:, kv]


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised (call init_process_group first)")
    return dist


def _collective_device(dist, group) -> torch.device:
    """Where a small collective tensor must live: NCCL takes CUDA tensors only, gloo CPU ones."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_head_partition(head_offset: int, local_heads: int, total_heads: int, group=None, *,
                         problem: str | None = None) -> None:
    """Collective: every rank passes its ``(head_offset, local_heads)``; raise ``ValueError`` on
    every rank unless the ranks' head ranges tile ``[0, total_heads)`` exactly, in rank order.

    ``problem``: a rank that found something wrong locally (a shard that splits a head, an offset
    that disagrees with its weights) passes the message here instead of raising on its own, so
    the other ranks do not wait forever in the all-gather: that rank raises ``problem`` and every
    other rank raises naming it."""
    dist = _dist()
    mine = torch.tensor([head_offset, local_heads, problem is not None], dtype=torch.int64,
                        device=_collective_device(dist, group))
    world = dist.get_world_size(group)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if problem is not None:
        raise ValueError(problem)
    refused = [r for r, t in enumerate(every) if int(t[2])]
    if refused:
        raise ValueError(f"tensor-parallel rank(s) {refused} refused their head shard (see the error on that rank)")
    ranges = [(int(t[0]), int(t[1])) for t in every]
    expected = 0
    for r, (off, n) in enumerate(ranges):
        if off != expected:
            detail = ", ".join(f"rank {i}: heads {o}..{o + c - 1}" for i, (o, c) in enumerate(ranges))
            raise ValueError(
                f"tensor-parallel head offsets do not tile [0, {total_heads}): rank {r} has head_offset {off}, "
                f"expected {expected} ({detail})"
            )
        expected = off + n
    if expected != total_heads:
        raise ValueError(f"tensor-parallel ranks cover {expected} query heads, the config has {total_heads}")


def row_shard(weight: torch.Tensor):
    """``(first_row, rows, group)`` of the output rows this rank holds of a ``DTensor`` weight
    ``[out, in]`` sharded on dim 0 over a one-dimensional mesh (transformers' "colwise" style);
    ``(0, out, None)`` for a replicated ``DTensor``; ``None`` for a plain tensor. Raises
    ``ValueError`` for other layouts (a multi-dimensional mesh, a strided or column shard)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch build without torch.distributed
        return None
    if not isinstance(weight, DTensor):
        return None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or len(placements) != 1:
        raise ValueError(f"a DTensor weight on a {mesh.ndim}-dimensional mesh ({placements}) is not a head shard "
                         "this integration can read (expected one tensor-parallel mesh dimension)")
    placement = placements[0]
    if isinstance(placement, Replicate):
        return 0, int(weight.shape[0]), None
    if type(placement) is not Shard or placement.dim not in (0, -weight.dim()):
        raise ValueError(f"a DTensor weight placed as {placement} is not sharded by output rows "
                         "(expected Shard(0), transformers' 'colwise')")
    rows = int(weight.to_local().shape[0])
    try:  # torch's own layout arithmetic (a private helper, stable from torch 2.4 to 2.13)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
        first = int(offset[0])
        if int(local_shape[0]) != rows:
            raise ValueError(f"DTensor local shard has {rows} rows, its layout says {int(local_shape[0])}")
    except ImportError:  # Shard(0) splits like torch.chunk: ceil(out / world) rows per rank
        chunk = -(-int(weight.shape[0]) // mesh.size())
        first = min(mesh.get_local_rank() * chunk, int(weight.shape[0]))
    return first, rows, mesh.get_group()


def gather_heads(out_local: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather ``[B, H_local, N, D]`` from every rank into ``[B, H_local * world, N, D]`` (rank order)."""
    dist = _dist()
    parts = [torch.empty_like(out_local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out_local.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def tp_sparse_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Sequence[Pattern],
    *,
    head_offset: int | None = None,
    check: bool = True,
    gather: bool = False,
    group=None,
    **kwargs,
) -> torch.Tensor:
    """Sparse prefill of this rank's heads.

    Args:
        q: ``[B, H_local, N, D]``; k, v: ``[B, Hkv_local, N, D]``.
        plan: patterns by GLOBAL query head (``len(plan)`` is the global head count).
        head_offset: default ``rank * H_local``.
        check: run :func:`check_head_partition` first (one small all-gather).
        gather: return all heads ``[B, Hq, N, D]`` instead of the local ones.
        kwargs: passed to :func:`minference.dispatch.sparse_prefill`.
    """
    from minference.dispatch import sparse_prefill

    dist = _dist()
    local = q.shape[1]
    if head_offset is None:
        head_offset = dist.get_rank(group) * local
    if check:
        check_head_partition(head_offset, local, len(plan), group)
    out = sparse_prefill(q, k, v, plan, head_offset=head_offset, **kwargs)
    return gather_heads(out, group) if gather else out
