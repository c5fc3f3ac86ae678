"""Patch a transformers model so that its prefill runs sparse attention from a PatternConfig.

``patch(model, config)`` registers one attention function, ``"minference"``, with transformers'
``AttentionInterface`` (and the SDPA mask builder under the same name with
``AttentionMaskInterface``, so padded batches arrive with their boolean mask), records each
attention layer's plan on the layer module (attribute ``minference_layer``) and switches the
model's ``attn_implementation`` to it. No ``forward`` method is rebound; ``unpatch(model)``
restores the previous implementation and removes the attributes.

Each call of the attention function picks one path (counted in :class:`LayerState.calls`):

==================== ==================================================================== ======
path                 when                                                                 runs
==================== ==================================================================== ======
``sparse``           prefill from an empty cache: ``q`` and ``k`` have the same length    sparse
``dense_decode``     one query token (decode)                                             dense
``dense_continue``   ``q`` shorter than ``k``: chunked prefill, a multi-turn prompt that   dense
                     extends a cache, a pre-allocated static cache
``dense_short``      prompt shorter than ``dense_threshold`` tokens                        dense
``dense_mask``       a mask that is not causal + contiguous padding (packed sequences,     dense
                     sliding windows, custom masks), or a sliding-window layer
``dense_layer``      the layer is not in ``layers`` (progressive swap-in), its plan is     dense
                     all :class:`~minference.patterns.Dense`, or attention dropout is on
==================== ==================================================================== ======

Dense paths call transformers' own SDPA attention, so they equal an unpatched model bit for bit.
Every call of a patched layer runs inside the profiler range
:data:`~minference.dispatch.ATTENTION_RANGE` (recorded only while a ``torch.profiler`` runs).
The sparse path calls :func:`minference.dispatch.sparse_prefill` with the layer's plan indexed by
GLOBAL head id (``head_offset + local head``, for tensor-parallel shards). The KV cache is
written by the model before attention runs and is never pruned, so after a sparse prefill it
holds every token, exactly as dense prefill writes it (only the hidden states that later layers
project from differ, by the sparse approximation). Padding positions of a padded batch get zero
attention output.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from minference._checks import token_mask
from minference.config import PatternConfig, load_config, model_signature
from minference.dispatch import ATTENTION_RANGE, profile_range
from minference.distributed import HeadShard, _dist, check_head_partition, head_shard
from minference.patterns import Dense, Pattern
from minference.reference.masks import check_fill_gaps

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayerState",
    "patch",
    "unpatch",
    "is_patched",
    "layer_states",
    "call_counts",
    "reset_counts",
    "register",
    "padding_rows",
    "observe_attention",
    "attention_modules",
    "shard_model_heads",
]

#: Name registered with transformers' AttentionInterface and AttentionMaskInterface.
ATTN_IMPLEMENTATION = "minference"
#: Attribute that holds a :class:`LayerState` on each patched attention module.
STATE_ATTR = "minference_layer"
#: Attribute on the patched model that remembers what ``unpatch`` must restore.
MODEL_ATTR = "_minference_patch"
PATHS = ("sparse", "dense_decode", "dense_continue", "dense_short", "dense_mask", "dense_layer")


@dataclass
class LayerState:
    """What one patched attention layer does.

    Attributes:
        layer: layer index.
        plan: patterns indexed by GLOBAL query head (length >= head_offset + local heads).
        sparse: False for layers left dense (progressive swap-in) or all-dense plans.
        head_offset: global id of this module's first query head (tensor parallelism).
        dense_threshold: prompts shorter than this many tokens run dense (``None``:
            :data:`minference.dispatch.DENSE_THRESHOLD`, measured on the GPU).
        backend: dispatcher backend (``"auto"``, ``"triton"``, ``"torch"``).
        calls: how many calls took each path (see the module docstring).
        dense_tail: prompt tokens at the end of a sparse prefill that attend densely.
        observer: optional ``fn(layer, query, key, seqlens, seqstarts)`` called on the sparse path
            with the inputs the dispatcher sees (measurements such as coverage; not timed work).
    """

    layer: int
    plan: list[Pattern]
    sparse: bool
    head_offset: int = 0
    dense_threshold: int | None = None
    backend: str = "auto"
    fill_gaps: int | None = None
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    observer: Callable | None = None
    dense_tail: int = 0


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


_mask_cache: list = [None, None]  # [weakref to the last mask, its rows]


def padding_rows(mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor] | None | bool:
    """Ragged rows ``(seqlens [B], seqstarts [B])`` int32 from a prefill mask ``[B, 1, n, n]``.

    Returns ``None`` for no mask (plain causal, no padding) and ``False`` when the mask is not
    "causal AND key is a token of the row" with each row's tokens contiguous (left or right
    padding); the caller then runs dense. The result is cached for the last mask object, which
    transformers passes to every layer of one forward call.
    """
    if mask is None:
        return None
    ref = _mask_cache[0]
    if ref is not None and ref() is mask:
        return _mask_cache[1]
    result = _padding_rows(mask, n)
    try:
        _mask_cache[0], _mask_cache[1] = weakref.ref(mask), result
    except TypeError:
        pass
    return result


def _padding_rows(mask: torch.Tensor, n: int):
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != n or mask.shape[-1] != n:
        return False
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, n, n]
    valid = allowed.any(dim=1)  # [B, n]: keys some query reads
    pos = torch.arange(n, device=mask.device)
    causal = pos[None, :] <= pos[:, None]
    if not torch.equal(allowed | ~valid[:, :, None], causal[None] & valid[:, None, :] | ~valid[:, :, None]):
        return False
    lens = valid.sum(dim=1)
    starts = torch.where(lens > 0, valid.int().argmax(dim=1), torch.zeros_like(lens))
    if not torch.equal(token_mask(lens, starts, valid.shape[0], n, mask.device, values=False), valid):
        return False
    return lens.to(torch.int32), starts.to(torch.int32)


def _threshold(state: LayerState) -> int:
    if state.dense_threshold is not None:
        return state.dense_threshold
    from minference.dispatch import DENSE_THRESHOLD

    return DENSE_THRESHOLD


def minference_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, L, D]``, ``key, value [B, Hkv, S, D]``
    (no GQA repeat) -> ``([B, L, Hq, D], None)``."""
    state: LayerState | None = getattr(module, STATE_ATTR, None)
    L, S = query.shape[2], key.shape[2]
    dense = lambda: _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if state is None:
        return dense()
    if L == 1:
        path = "dense_decode"
    elif L != S:
        path = "dense_continue"
    elif not state.sparse or dropout:
        path = "dense_layer"
    elif L < _threshold(state):
        path = "dense_short"
    elif getattr(module, "sliding_window", None) is not None or kwargs.get("cu_seq_lens_q") is not None:
        path = "dense_mask"
    else:
        rows = padding_rows(attention_mask, L)
        path = "dense_mask" if rows is False else "sparse"
    state.calls[path] += 1
    if path != "sparse":
        with profile_range(ATTENTION_RANGE):
            return dense()
    from minference.dispatch import sparse_prefill

    seqlens, seqstarts = rows if rows is not None else (None, None)
    if state.observer is not None:
        state.observer(state.layer, query, key, seqlens, seqstarts)
    with profile_range(ATTENTION_RANGE):
        out = sparse_prefill(
            query, key, value, state.plan, scale=scaling, seqlens=seqlens, seqstarts=seqstarts,
            head_offset=state.head_offset, dense_threshold=0, backend=state.backend, dense_tail=state.dense_tail,
            **({} if state.fill_gaps is None else {"fill_gaps": state.fill_gaps}),
        )  # [B, Hq, L, D], zeros at padding positions; the length threshold was applied above
    return out.transpose(1, 2), None


def register() -> None:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, minference_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Attention modules by layer index (modules with ``layer_idx`` whose class name ends in
    ``Attention``)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and type(module).__name__.endswith("Attention"):
            if idx in found:
                raise ValueError(f"model has two attention modules for layer {idx}")
            found[idx] = module
    return found


def _local_heads(module: torch.nn.Module, cfg: Any) -> int:
    for attr in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    q_proj = getattr(module, "q_proj", None)
    head_dim = getattr(module, "head_dim", None)
    if q_proj is not None and head_dim:
        return q_proj.out_features // head_dim
    return int(cfg.num_attention_heads)


def patch(
    model: torch.nn.Module,
    config: PatternConfig,
    *,
    layers: list[int] | range | None = None,
    dense_threshold: int | None = None,
    backend: str = "auto",
    head_offset: int = 0,
    allow_mismatch: bool = False,
    check_fingerprint: bool = True,
    check_partition: bool | None = None,
    fill_gaps: int | None = None,
    dense_tail: int = 0,
) -> torch.nn.Module:
    """Route ``model``'s prefill attention through sparse patterns (in place; returns ``model``).

    Args:
        model: a transformers causal LM (Llama, Qwen2, Phi-3, GLM-4, ... any model whose
            attention calls ``AttentionInterface``).
        config: the PatternConfig (or a path to one, native or MInference format); it is
            checked against the model and a mismatch (layers,
            heads, kv heads, head dim, rope, weights fingerprint) raises
            :class:`~minference.config.ConfigMismatchError` unless ``allow_mismatch``.
        layers: layers that run sparse (default all); others stay dense (progressive swap-in).
        dense_threshold: prompts shorter than this run dense (``None``:
            :data:`minference.dispatch.DENSE_THRESHOLD`; 0 always runs sparse).
        backend: dispatcher backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        fill_gaps: vertical-slash gap filling passed to the dispatcher (``None``: its default
            :data:`minference.dispatch.FILL_GAPS`; 0 runs the estimator's exact sets).
        dense_tail: the last ``dense_tail`` prompt tokens of a sparse prefill attend densely
            (:func:`minference.dispatch.sparse_prefill`; 0, the default: none).
        head_offset: global id of local query head 0 (a tensor-parallel shard of the model).
        check_fingerprint: hash the weights to compare with the config's fingerprint (a
            tensor-parallel shard hashes differently from the full model: pass False there).
        check_partition: verify with one all-gather that the ranks' head offsets tile the
            config's heads (:func:`minference.distributed.check_head_partition`); default: when
            the model holds fewer heads than the config (a shard) and ``torch.distributed`` is
            initialised with more than one rank (a collective: every rank must call ``patch``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(config, (str, os.PathLike)):
        config = load_config(config, model, allow_mismatch=allow_mismatch, fingerprint=check_fingerprint)
    if not isinstance(config, PatternConfig):
        raise TypeError(f"config must be a PatternConfig or a path to one, got {type(config).__name__}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if dense_threshold is not None and (isinstance(dense_threshold, bool) or not isinstance(dense_threshold, int)
                                        or dense_threshold < 0):
        raise ValueError(f"dense_threshold must be a non-negative int or None, got {dense_threshold!r}")
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    if fill_gaps is not None:
        check_fill_gaps(fill_gaps)
    if isinstance(dense_tail, bool) or not isinstance(dense_tail, int) or dense_tail < 0:
        raise ValueError(f"dense_tail must be a non-negative int, got {dense_tail!r}")
    if is_patched(model):
        unpatch(model)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("model has no attention modules with a layer_idx (not a transformers decoder?)")
    signature = model_signature(model, fingerprint=check_fingerprint and config.model.weights_fingerprint is not None)
    config.check(signature, allow_mismatch=allow_mismatch)
    if layers is None:
        chosen = set(modules)
    else:
        chosen = set()
        for l in layers:
            if isinstance(l, bool) or not isinstance(l, int) or l not in modules:
                raise ValueError(f"layers entries must be layer indices in [0, {len(modules)}), got {l!r}")
            chosen.add(l)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for idx, module in modules.items():
        if idx >= len(config.layers):
            raise ValueError(f"config has {len(config.layers)} layers, the model has layer {idx}")
        plan = config.plan(idx)
        local = _local_heads(module, cfg)
        if head_offset + local > len(plan):
            raise ValueError(
                f"layer {idx}: head_offset {head_offset} + {local} local heads exceeds the config's {len(plan)} heads"
            )
        active = plan[head_offset : head_offset + local]
        sparse = idx in chosen and not all(isinstance(p, Dense) for p in active)
        setattr(module, STATE_ATTR, LayerState(idx, plan, sparse, head_offset, dense_threshold, backend, fill_gaps,
                                               dense_tail=dense_tail))
    first = min(modules)
    local, total = _local_heads(modules[first], cfg), len(config.plan(first))
    if check_partition is None:
        import torch.distributed as dist

        sharded = local < total  # a head shard (not a data-parallel replica of the whole model)
        check_partition = sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if check_partition:
        try:
            check_head_partition(head_offset, local, total)
        except ValueError:
            for module in modules.values():
                if hasattr(module, STATE_ATTR):
                    delattr(module, STATE_ATTR)
            raise
    register()
    previous = getattr(model.config, "_attn_implementation", None)
    setattr(model, MODEL_ATTR, {"previous": previous})
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: restore the previous attention implementation and drop layer states."""
    saved = getattr(model, MODEL_ATTR, None)
    if saved is None:
        raise ValueError("model is not patched by minference")
    for module in model.modules():
        if hasattr(module, STATE_ATTR):
            delattr(module, STATE_ATTR)
    model.set_attn_implementation(saved["previous"] or "sdpa")
    delattr(model, MODEL_ATTR)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return getattr(model, MODEL_ATTR, None) is not None


def layer_states(model: torch.nn.Module) -> dict[int, LayerState]:
    """The :class:`LayerState` of each patched attention layer, by layer index."""
    return {idx: getattr(m, STATE_ATTR) for idx, m in attention_modules(model).items() if hasattr(m, STATE_ATTR)}


def call_counts(model: torch.nn.Module) -> dict[str, int]:
    """Attention calls per path summed over layers since the last :func:`reset_counts`."""
    total = dict.fromkeys(PATHS, 0)
    for state in layer_states(model).values():
        for path, count in state.calls.items():
            total[path] += count
    return total


def reset_counts(model: torch.nn.Module) -> None:
    """Zero every layer's call counters."""
    for state in layer_states(model).values():
        state.calls = dict.fromkeys(PATHS, 0)


#: Name of the observing (dense) attention implementation used by :func:`observe_attention`.
OBSERVE_IMPLEMENTATION = "minference_observe"
OBSERVER_ATTR = "minference_observer"


def _observing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Dense SDPA attention that first hands ``(layer, query, key, rows)`` to the module's observer."""
    observer = getattr(module, OBSERVER_ATTR, None)
    L, S = query.shape[2], key.shape[2]
    if observer is not None and L == S and L > 1:
        rows = padding_rows(attention_mask, L)
        if rows is not False:
            seqlens, seqstarts = rows if rows is not None else (None, None)
            observer(module.layer_idx, query, key, seqlens, seqstarts)
    return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@contextmanager
def observe_attention(model: torch.nn.Module, observer: Callable) -> Iterator[torch.nn.Module]:
    """Run ``model`` with dense SDPA attention while ``observer(layer, query [B, Hq, N, D],
    key [B, Hkv, N, D], seqlens, seqstarts)`` sees every prefill call (the offline search and the
    coverage measurements read the model's real queries and keys this way)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if is_patched(model):
        raise ValueError("unpatch the model before observing its dense attention")
    AttentionInterface.register(OBSERVE_IMPLEMENTATION, _observing_attention)
    AttentionMaskInterface.register(OBSERVE_IMPLEMENTATION, sdpa_mask)
    previous = getattr(model.config, "_attn_implementation", None)
    modules = attention_modules(model)
    for module in modules.values():
        setattr(module, OBSERVER_ATTR, observer)
    model.set_attn_implementation(OBSERVE_IMPLEMENTATION)
    try:
        yield model
    finally:
        for module in modules.values():
            delattr(module, OBSERVER_ATTR)
        model.set_attn_implementation(previous or "sdpa")


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def shard_model_heads(model: torch.nn.Module, rank: int, world: int, group=None) -> HeadShard:
    """Shard a Llama-family model's attention by heads in place (``q_proj``/``k_proj``/``v_proj``
    rows, ``o_proj`` input columns, ``o_proj`` bias on rank 0 only, an all-reduce of ``o_proj``'s
    output through a forward hook). Everything else stays replicated. Returns the shard."""
    from minference.integration import attention_modules

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shard = head_shard(int(cfg.num_attention_heads), int(cfg.num_key_value_heads or cfg.num_attention_heads),
                       rank, world)
    dist = _dist() if world > 1 else None

    def reduce(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    for module in attention_modules(model).values():
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
