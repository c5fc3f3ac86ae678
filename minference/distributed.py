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
* :func:`shard_model_heads` — shard a Llama-family transformers model in place (``q/k/v_proj``
  rows, ``o_proj`` columns, an all-reduce after ``o_proj``); then
  ``minference.patch(model, config, head_offset=shard.head_offset, check_fingerprint=False)``.
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
    "shard_model_heads",
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


def check_head_partition(head_offset: int, local_heads: int, total_heads: int, group=None) -> None:
    """Collective: every rank passes its ``(head_offset, local_heads)``; raise ``ValueError`` on
    every rank unless the ranks' head ranges tile ``[0, total_heads)`` exactly, in rank order."""
    dist = _dist()
    mine = torch.tensor([head_offset, local_heads], dtype=torch.int64)
    world = dist.get_world_size(group)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
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


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def shard_model_heads(model: torch.nn.Module, rank: int, world: int, group=None) -> HeadShard:
    """Shard a Llama-family model's attention by heads in place (``q_proj``/``k_proj``/``v_proj``
    rows, ``o_proj`` input columns, ``o_proj`` bias on rank 0 only, an all-reduce of ``o_proj``'s
    output through a forward hook). Everything else stays replicated. Returns the shard."""
    from minference.integration import _attention_modules

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shard = head_shard(int(cfg.num_attention_heads), int(cfg.num_key_value_heads or cfg.num_attention_heads),
                       rank, world)
    dist = _dist() if world > 1 else None

    def reduce(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    for module in _attention_modules(model).values():
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in names):
            raise ValueError(f"{type(module).__name__} lacks separate q/k/v/o projections; only Llama-style "
                             "attention can be head-sharded here")
        D = module.head_dim
        _rows(module.q_proj, shard.q.start * D, shard.q.stop * D)
        _rows(module.k_proj, shard.kv.start * D, shard.kv.stop * D)
        _rows(module.v_proj, shard.kv.start * D, shard.kv.stop * D)
        o = module.o_proj
        o.weight = torch.nn.Parameter(o.weight.data[:, shard.q.start * D : shard.q.stop * D].clone(),
                                      requires_grad=False)
        o.in_features = shard.local_heads * D
        if o.bias is not None and rank != 0:
            o.bias = torch.nn.Parameter(torch.zeros_like(o.bias), requires_grad=False)
        if dist is not None:
            o.register_forward_hook(reduce)
    return shard
