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
``sparse_continue``  ``q`` shorter than ``k`` (a chunk after a cache: chunked prefill, a   sparse
                     continued conversation, a static cache) with at least
                     :data:`~minference.dispatch.MIN_SPARSE_QUERIES` queries, and a mask
                     whose rows the kernels take (:func:`query_rows`)
``dense_decode``     one query token (decode)                                             dense
``dense_continue``   a chunk after a cache that is too short (or too few keys), or whose  dense
                     mask is not causal with contiguous rows (right padding after a
                     cache, custom masks), or a sliding-window / non-causal module. On
                     the Triton backend a short causal chunk with contiguous rows runs
                     our dense kernel on its query rows (no mask); otherwise SDPA
``dense_short``      prompt shorter than ``dense_threshold`` tokens                        dense
``dense_mask``       a mask that is not causal + contiguous padding (packed sequences,     dense
                     sliding windows, custom masks), a sliding-window layer, or a call or
                     module that says ``is_causal=False``
``dense_layer``      the layer is not in ``layers`` (progressive swap-in), its plan is     dense
                     all :class:`~minference.patterns.Dense`, or attention dropout is on
==================== ==================================================================== ======

The key-length threshold (``dense_threshold``) applies to both sparse paths; ``dense_threshold=0``
also lifts the chunk minimum (tests run tiny chunks sparse). A continued prefill builds each
pattern's index from the chunk's own queries against every cached and new key (docs/kernels.md,
"query rows").

``patch`` refuses attention that is not causal self-attention (``is_causal=False``, as in a
bidirectional encoder, or cross-attention) in any layer chosen to run sparse, naming the module.
On a model sharded by transformers' own tensor parallelism (``from_pretrained(...,
**tensor_parallel_kwargs())``), each rank's head offset is read from its DTensor ``q_proj`` rows
and checked collectively (:func:`minference.distributed.check_head_partition`).

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

import dataclasses
import os
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from minference._checks import token_mask
from minference.config import GuardSettings, PatternConfig, load_config, model_signature
from minference.dispatch import ATTENTION_RANGE, profile_range
from minference.distributed import check_head_partition, row_shard
from minference.index_sets import check_fill_gaps
from minference.patterns import Dense, Pattern

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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
    "query_rows",
    "observe_attention",
    "prompt_continues",
    "attention_modules",
    "tensor_parallel_kwargs",
    "guard_of",
]

#: Name registered with transformers' AttentionInterface and AttentionMaskInterface.
ATTN_IMPLEMENTATION = "minference"
#: Attribute that holds a :class:`LayerState` on each patched attention module.
STATE_ATTR = "minference_layer"
#: Attribute on the patched model that remembers what ``unpatch`` must restore.
MODEL_ATTR = "_minference_patch"
PATHS = ("sparse", "sparse_continue", "dense_decode", "dense_continue", "dense_short", "dense_mask", "dense_layer")


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
        observer: optional ``fn(layer, query, key, value, seqlens, seqstarts)`` called on the sparse
            path with the inputs the dispatcher sees (``query [B, Hq, N, D]``, ``key, value [B, Hkv,
            N, D]``, the padding rows or ``None``; measurements such as coverage, not timed work).
        heads: the query heads ``patch`` read this module to hold (its local heads under tensor
            parallelism); a sparse call that brings another count raises instead of reading the
            wrong global heads of the plan.
        graphs: the :class:`minference.graphs.PrefillGraphs` the sparse path runs through, keyed
            by ``layer`` (shared by the model's layers; ``None``: direct calls).
        guard: the model's :class:`minference.guard.QualityGuard` (shared by its layers; ``None``:
            no quality checks). A checked call's sparse layers run directly (not from graphs).
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
    heads: int | None = None
    dense_tail: int = 0
    graphs: Any = None
    guard: Any = None


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


#: ``(seqlens, seqstarts, q_seqlens, q_seqstarts)`` ``[B]`` int32: a mask's rows in query-row terms.
_QueryRowTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_mask_cache: list = [None, None]  # [weakref to the last mask, {(L, S): its rows}]


def padding_rows(mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor] | Literal[False] | None:
    """Ragged rows ``(seqlens [B], seqstarts [B])`` int32 from a prefill mask ``[B, 1, n, n]``.

    Returns ``None`` for no mask (plain causal, no padding) and ``False`` when the mask is not
    "causal AND key is a token of the row" with each row's tokens contiguous (left or right
    padding); the caller then runs dense. Cached for the last mask object, which transformers
    passes to every layer of one forward call.
    """
    if mask is None:
        return None
    rows = query_rows(mask, n, n)  # a square mask's rows are never None (the plain case after a cache)
    return rows if rows is False or rows is None else rows[:2]


def query_rows(mask: torch.Tensor, L: int, S: int) -> _QueryRowTensors | Literal[False] | None:
    """The rows of a mask ``[B, 1, L, S]`` (bool, or additive with 0 = attend) in the kernels'
    query-row terms (docs/kernels.md): int32 ``(seqlens, seqstarts, q_seqlens, q_seqstarts)``
    ``[B]``; ``None`` after a cache (``L < S``) when every row is the plain case (all ``S`` keys,
    the ``L`` queries their last tokens: the kernels' defaults); ``False`` when the mask is not
    that shape. A square mask (``L == S``) must be a padded prefill: every row's queries are its
    own tokens (``q_seqlens == seqlens``, ``q_seqstarts == seqstarts``).

    A query's own position is the last key it reads. The query rows of a batch row are the ones
    whose own position is ``i + d`` for the row's offset ``d`` (that of its first query that
    reads anything: ``S - L`` after a dynamic cache, the cache's fill after a static one); they
    must be contiguous, and each must read exactly the row's keys from its first up to its own
    position. Other query rows must be padding (not computed; zeros): in a square prefill the
    positions outside the row, after a cache rows that read nothing. The key row ends at the last
    query's own position (keys after it, such as a static cache's empty slots, are not in the
    row). Cached for the last mask object per ``(L, S)``.
    """
    ref = _mask_cache[0]
    if ref is not None and ref() is mask and (L, S) in _mask_cache[1]:
        return _mask_cache[1][(L, S)]
    result = _query_rows(mask, L, S)
    try:
        if ref is None or ref() is not mask:
            _mask_cache[0], _mask_cache[1] = weakref.ref(mask), {}
        _mask_cache[1][(L, S)] = result
    except TypeError:
        pass
    return result


def _query_rows(mask: torch.Tensor, L: int, S: int) -> _QueryRowTensors | Literal[False] | None:
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != L or mask.shape[-1] != S or L > S:
        return False
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, L, S]
    B, dev = allowed.shape[0], mask.device
    reads = allowed.any(dim=2)  # [B, L]
    i = torch.arange(L, device=dev)
    own = torch.where(reads, S - 1 - allowed.flip(-1).int().argmax(-1), torch.full_like(reads, -1, dtype=torch.long))
    first = torch.where(reads.any(1), reads.int().argmax(1), torch.zeros(B, dtype=torch.long, device=dev))
    d = own.gather(1, first[:, None]) - first[:, None]  # [B, 1] the row's offset
    is_query = reads & (own - i[None] == d)  # [B, L]
    q_lens = is_query.sum(1)
    q_starts = torch.where(q_lens > 0, is_query.int().argmax(1), torch.zeros_like(q_lens))
    if not torch.equal(token_mask(q_lens, q_starts, B, L, dev, values=False), is_query):
        return False  # query rows with a gap
    key_start = torch.where(q_lens > 0, allowed.gather(1, first[:, None, None].expand(B, 1, S))[:, 0].int().argmax(1),
                            torch.zeros_like(q_lens))
    end = torch.where(q_lens > 0, d[:, 0] + q_starts + q_lens, key_start)  # one past the last query's own key
    j = torch.arange(S, device=dev)
    expect = (j[None, None] >= key_start[:, None, None]) & (j[None, None] <= (d + i[None])[:, :, None])
    if not torch.equal(allowed & is_query[:, :, None], expect & is_query[:, :, None]):
        return False  # not "causal AND key of the row" with the row's keys contiguous
    lens = (end - key_start).to(torch.int32)
    # the other query rows must be padding: in a square prefill, positions outside the row (they
    # may read anything); after a cache, rows that read nothing (left padding). A row that reads
    # keys without being a query of its row (a non-causal mask, or right padding after a cache,
    # which the mask alone cannot tell apart) is refused: the caller runs dense.
    if L == S:
        inside = token_mask(lens, key_start, B, S, dev, values=False)
        own_rows = torch.equal(q_lens.to(torch.int32), lens) and torch.equal(
            torch.where(lens > 0, q_starts, key_start), key_start)
        if bool((~is_query & inside).any()) or not own_rows:
            return False  # queries that are not the row's own tokens: not a plain padded prefill
    elif bool((~is_query & reads).any()):
        return False
    elif bool((lens == S).all()) and bool((q_lens == L).all()):
        return None  # every row is a plain chunk after its cache: the kernels' defaults
    return lens, key_start.to(torch.int32), q_lens.to(torch.int32), q_starts.to(torch.int32)


def _min_queries() -> int:
    from minference.dispatch import MIN_SPARSE_QUERIES

    return MIN_SPARSE_QUERIES


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
    rows: tuple[torch.Tensor, torch.Tensor] | _QueryRowTensors | Literal[False] | None = None
    # the query rows of a short chunk after a cache, where dense_continue can take them
    chunk_rows: _QueryRowTensors | Literal[False] | None = False
    if L == 1:
        path = "dense_decode"
    elif not state.sparse or dropout:
        path = "dense_layer"
    elif S < _threshold(state) or (L != S and state.dense_threshold != 0 and L < _min_queries()):
        path = "dense_short" if L == S else "dense_continue"
        if L != S and attention_mask is not None and _plain_causal(module, kwargs) and _triton(state, query):
            chunk_rows = query_rows(attention_mask, L, S)  # None (plain) or rows: our dense kernel may run it
    elif not _plain_causal(module, kwargs):
        path = "dense_mask" if L == S else "dense_continue"  # not causal self-attention: the module's own masking
    elif L == S:
        rows = padding_rows(attention_mask, L)
        path = "dense_mask" if rows is False else "sparse"
    else:  # a chunk after a cache (chunked prefill, a continued conversation, a static cache)
        rows = False if attention_mask is None else query_rows(attention_mask, L, S)
        path = "dense_continue" if rows is False else "sparse_continue"
    state.calls[path] += 1
    if chunk_rows is not False:
        # a short chunk after a cache, causal with contiguous rows, on the Triton backend: our dense
        # kernel on its query rows needs no mask (transformers' SDPA takes a boolean mask here, ~2x
        # slower per FLOP on the H200; docs/tuning.md#chunk-dense-rows)
        with profile_range(ATTENTION_RANGE):
            return _dense_rows(query, key, value, chunk_rows, scaling), None
    if not path.startswith("sparse"):
        with profile_range(ATTENTION_RANGE):
            return dense()
    from minference.dispatch import sparse_prefill

    if state.heads is not None and query.shape[1] != state.heads:
        raise ValueError(
            f"layer {state.layer}: attention received {query.shape[1]} query heads, but patch() read "
            f"{state.heads} heads (global {state.head_offset}..{state.head_offset + state.heads - 1}) from the "
            "model; its projections are not sharded the way patch() saw them"
        )
    seqlens: torch.Tensor | None = None
    seqstarts: torch.Tensor | None = None
    q_seqlens: torch.Tensor | None = None
    q_seqstarts: torch.Tensor | None = None
    # rows is None (plain) or a tuple here: False took a dense path above
    if isinstance(rows, tuple) and len(rows) == 2:  # a padded prefill (L == S)
        seqlens, seqstarts = rows
    elif isinstance(rows, tuple):  # a chunk after a cache
        seqlens, seqstarts, q_seqlens, q_seqstarts = rows
    if state.observer is not None and L == S:
        state.observer(state.layer, query, key, value, seqlens, seqstarts)
    # the quality guard: None unless this call is a checked one (an attribute read otherwise)
    shadow = None if state.guard is None else state.guard.layer_check(state.layer, state.head_offset)
    # patch(cuda_graphs=...): square prefills through the layer's graph (a chunk's key length grows: direct)
    direct = state.graphs is None or L != S or shadow is not None
    run = sparse_prefill if direct else partial(state.graphs, state.layer)
    with profile_range(ATTENTION_RANGE):
        out = run(
            query, key, value, state.plan, scale=scaling, seqlens=seqlens, seqstarts=seqstarts,
            q_seqlens=q_seqlens, q_seqstarts=q_seqstarts,
            head_offset=state.head_offset, dense_threshold=0, backend=state.backend, dense_tail=state.dense_tail,
            validate=False,  # the model's own activations: no host sync per layer (as SDPA checks nothing)
            **({} if state.fill_gaps is None else {"fill_gaps": state.fill_gaps}),
            **({} if shadow is None else {"shadow": shadow}),
        )  # [B, Hq, L, D], zeros at padding positions; the thresholds were applied above
    return out.transpose(1, 2), None


def _triton(state: LayerState, query: torch.Tensor) -> bool:
    """True when the layer's backend resolves to Triton for ``query``'s device."""
    from minference.dispatch import resolve_backend

    return resolve_backend(state.backend, query.device) == "triton"


def _plain_causal(module: torch.nn.Module, kwargs: dict) -> bool:
    """True for causal self-attention without a window or packed sequences (what the kernels run)."""
    return not (getattr(module, "sliding_window", None) is not None or kwargs.get("cu_seq_lens_q") is not None
                or kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False)


def _dense_rows(query, key, value, rows, scaling) -> torch.Tensor:
    """Dense causal attention of a chunk's query rows (:func:`query_rows`: ``None`` for the plain
    case) on the Triton backend, ``[B, L, Hq, D]``; rows that are not queries come out as zeros."""
    from minference.dispatch import dense_prefill

    seqlens, seqstarts, q_seqlens, q_seqstarts = (None,) * 4 if rows is None else rows
    out = dense_prefill(query, key, value, scale=scaling, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                        q_seqstarts=q_seqstarts, backend="triton", validate=False)
    return out.transpose(1, 2)


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
    weight = getattr(q_proj, "weight", None)
    if isinstance(weight, torch.Tensor) and head_dim:
        return int(weight.shape[0]) // head_dim  # rows actually held (a hand-sharded model holds a slice)
    return int(cfg.num_attention_heads)


#: Last names of attention modules that read another sequence's keys (cross-attention).
_CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention", "enc_dec_attn", "src_attn")


def _attention_entries(model: torch.nn.Module) -> list[tuple[str, int, torch.nn.Module]]:
    """Every module :func:`attention_modules` would consider, with its qualified name and layer index."""
    return [(name, idx, m) for name, m in model.named_modules()
            if isinstance(idx := getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]


def _not_causal_self_attention(name: str, module: torch.nn.Module) -> str | None:
    """Why ``module`` is not causal self-attention (``None`` when it is, as far as it says)."""
    parts = [p.lower() for p in name.split(".")]
    if (getattr(module, "is_cross_attention", False) is True or "cross" in type(module).__name__.lower()
            or any("cross" in p or p in _CROSS_NAMES for p in parts)):
        return "cross-attention (its keys and values come from another sequence)"
    if getattr(module, "is_causal", True) is False:
        return "not causal (is_causal=False: bidirectional attention, as in an encoder)"
    return None


#: transformers tensor-parallel styles whose output is gathered: every rank's attention sees all heads.
_GATHERED_STYLES = frozenset({"colwise_gather_output", "colwise_rep", "replicate", "replicated_with_grad_allreduce"})
#: styles whose output stays sharded by rows: a rank's attention sees its slice of the heads.
_SHARDED_STYLES = frozenset({"colwise", "local_colwise"})


def _tp_style(model: torch.nn.Module, name: str) -> str | None:
    """The model's ``tp_plan`` style for module ``name`` (``None`` when the plan names none)."""
    plan = getattr(model, "_tp_plan", None)
    try:
        plan = getattr(model, "tp_plan", None) or plan
    except Exception:  # a property that needs state this model lacks
        pass
    if not isinstance(plan, dict):
        return None
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    return plan.get(generic, plan.get(name))


@dataclass
class _Shard:
    """The query heads one attention module holds, as read from its (DTensor) projections."""

    offset: int
    heads: int
    group: Any = None
    problem: str | None = None
    where: str = ""


def _tp_shard(model: torch.nn.Module, name: str, module: torch.nn.Module, num_heads: int,
              num_kv_heads: int) -> _Shard | None:
    """Heads of a module sharded by transformers' tensor parallelism (DTensor ``q/k/v_proj``
    weights), or ``None`` when its projections are plain tensors."""
    projections = {n: getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")}
    weights = {n: getattr(p, "weight", None) for n, p in projections.items()}
    try:
        rows = {n: row_shard(w) for n, w in weights.items() if isinstance(w, torch.Tensor)}
    except ValueError as err:
        return _Shard(0, 0, None, f"{name}: {err}")
    q = rows.get("q_proj")
    if q is None or q[2] is None:  # plain or replicated weights: no head shard read here
        return None
    style = _tp_style(model, f"{name}.q_proj")
    if style in _GATHERED_STYLES:
        return _Shard(0, num_heads, None)  # q_proj's output is gathered: attention sees every head
    if style is not None and style not in _SHARDED_STYLES:
        known = sorted(_SHARDED_STYLES | _GATHERED_STYLES)
        return _Shard(0, 0, q[2], f"{name}.q_proj: tensor-parallel style {style!r} is not one whose heads this "
                                  f"integration can read (expected one of {known})")
    D = getattr(module, "head_dim", None)
    if not isinstance(D, int) or D <= 0:
        return _Shard(0, 0, q[2], f"{name}: a tensor-parallel attention module without an int head_dim")
    q0, qn, group = q
    where = f"{name}.q_proj holds rows {q0}..{q0 + qn - 1}"
    k = rows.get("k_proj")
    if k is None or k[2] is None or rows.get("v_proj") != k:
        return _Shard(0, 0, group, f"{name}: q_proj is sharded by rows but k_proj/v_proj are not sharded alike "
                                   f"(q {q[:2]}, k {None if k is None else k[:2]}, v "
                                   f"{None if rows.get('v_proj') is None else rows['v_proj'][:2]})")
    k0, kn, _ = k
    if q0 % D or qn % D or k0 % D or kn % D:
        return _Shard(0, 0, group, f"{name}: the tensor-parallel shard splits a head: q_proj rows {q0}..{q0 + qn - 1}, "
                                   f"k_proj/v_proj rows {k0}..{k0 + kn - 1}, head_dim {D} (the head counts must divide "
                                   "by the tensor-parallel size)")
    h0, hn, kv0, kvn = q0 // D, qn // D, k0 // D, kn // D
    groups = num_heads // num_kv_heads
    if hn != kvn * groups or h0 != kv0 * groups:
        return _Shard(0, 0, group, f"{name}: query heads {h0}..{h0 + hn - 1} and kv heads {kv0}..{kv0 + kvn - 1} on "
                                   f"this rank do not keep whole GQA groups of {groups} (kv heads must divide by the "
                                   "tensor-parallel size)")
    return _Shard(h0, hn, group, None, where)


def _is_tensor_parallel(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def tensor_parallel_kwargs(tp_plan: Literal["auto"] | dict[str, str] = "auto") -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that shard a model with transformers' own tensor
    parallelism: ``AutoModelForCausalLM.from_pretrained(path, **tensor_parallel_kwargs())`` in
    every process of an initialised ``torch.distributed`` group (``torchrun``).

    The spelling follows the installed transformers: where
    ``transformers.distributed.DistributedConfig`` has a ``tp_plan`` field (5.17 and 5.24, the
    GPU's and the CPU's versions, both checked; they deprecate the bare keyword and announce its
    removal for 5.18), ``{"distributed_config": DistributedConfig(tp_plan=...)}``; on an older
    transformers, the bare ``{"tp_plan": ...}`` keyword it takes instead. ``DistributedConfig``
    reads ``WORLD_SIZE`` from the environment (``torchrun`` sets it)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    fields = ({f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig)
              else set())
    if "tp_plan" not in fields:
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def patch(
    model: PreTrainedModel,
    config: PatternConfig,
    *,
    layers: list[int] | range | None = None,
    dense_threshold: int | None = None,
    backend: str = "auto",
    head_offset: int | None = None,
    allow_mismatch: bool = False,
    check_fingerprint: bool = True,
    check_partition: bool | None = None,
    fill_gaps: int | None = None,
    dense_tail: int = 0,
    cuda_graphs: Any = False,
    guard: Any = None,
) -> PreTrainedModel:
    """Route ``model``'s prefill attention through sparse patterns (in place; returns ``model``).

    Args:
        model: a transformers causal LM (Llama, Qwen2, Phi-3, GLM-4, ... any model whose
            attention calls ``AttentionInterface``), whole or sharded by transformers' tensor
            parallelism (``from_pretrained(..., **tensor_parallel_kwargs())``). Attention that is
            not causal self-attention (``is_causal=False``, as in a bidirectional encoder, or
            cross-attention) is refused, naming the module, in every layer chosen to run sparse.
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
        cuda_graphs: ``True`` runs every sparse layer through one new
            :class:`minference.graphs.PrefillGraphs` (a CUDA graph per layer and prompt shape,
            captured on the first prefill of that shape and replayed after; CUDA tensors on the
            Triton backend only, direct calls elsewhere and for chunks after a cache, whose key
            length changes every chunk), or pass a ``PrefillGraphs`` to use (and
            keep across ``patch`` calls). ``False`` (default): direct calls. docs/integration.md,
            "CUDA graphs".
        guard: the quality guard (docs/guard.md): a :class:`minference.guard.QualityGuard` (kept by
            the caller, e.g. across patches), a :class:`~minference.config.GuardSettings` (a new
            guard), or ``None`` (default): a new guard from the config's ``runtime.guard``
            settings, none when their mode is ``"off"``. The guard's calls follow the model's
            forwards (a forward pre-hook and hook, removed by :func:`unpatch`); :func:`guard_of`
            returns it.
        head_offset: global id of local query head 0. ``None`` (default): read from the model:
            the rows of the DTensor ``q_proj`` shard this rank holds under transformers' tensor
            parallelism, else 0. Given on a DTensor model, it must equal what the weights say.
        check_fingerprint: hash the weights to compare with the config's fingerprint. A DTensor
            model (transformers' tensor parallelism) hashes as the whole model (its parameters
            are gathered one at a time: every rank must call ``patch``); a model sharded by hand
            hashes differently from the full one: pass False there (the other signature fields
            are still checked).
        check_partition: verify with one all-gather (over the tensor-parallel group) that the
            ranks' head offsets tile the config's heads
            (:func:`minference.distributed.check_head_partition`) and that no rank found its shard
            unreadable; default: when the model holds fewer heads than the config (a shard) and
            ``torch.distributed`` is initialised with more than one rank (a collective: every
            rank must call ``patch``). False trusts ``head_offset`` as given.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if dense_threshold is not None and (isinstance(dense_threshold, bool) or not isinstance(dense_threshold, int)
                                        or dense_threshold < 0):
        raise ValueError(f"dense_threshold must be a non-negative int or None, got {dense_threshold!r}")
    if head_offset is not None and (isinstance(head_offset, bool) or not isinstance(head_offset, int)
                                    or head_offset < 0):
        raise ValueError(f"head_offset must be a non-negative int or None, got {head_offset!r}")
    if fill_gaps is not None:
        check_fill_gaps(fill_gaps)
    if isinstance(dense_tail, bool) or not isinstance(dense_tail, int) or dense_tail < 0:
        raise ValueError(f"dense_tail must be a non-negative int, got {dense_tail!r}")
    from minference.graphs import PrefillGraphs

    if cuda_graphs is not False and cuda_graphs is not True and not isinstance(cuda_graphs, PrefillGraphs):
        raise TypeError(f"cuda_graphs must be a bool or a PrefillGraphs, got {type(cuda_graphs).__name__}")
    graphs = PrefillGraphs() if cuda_graphs is True else None if cuda_graphs is False else cuda_graphs
    from minference.guard import QualityGuard

    if guard is not None and not isinstance(guard, (QualityGuard, GuardSettings)):
        raise TypeError(f"guard must be a QualityGuard, a GuardSettings or None, got {type(guard).__name__}")
    tensor_parallel = _is_tensor_parallel(model)
    if isinstance(config, (str, os.PathLike)):
        config = load_config(config, model, allow_mismatch=allow_mismatch, fingerprint=check_fingerprint)
    if not isinstance(config, PatternConfig):
        raise TypeError(f"config must be a PatternConfig or a path to one, got {type(config).__name__}")
    if not isinstance(guard, QualityGuard):
        settings = config.runtime.guard if guard is None else guard
        guard = QualityGuard(settings) if settings.mode != "off" else None
    entries = _attention_entries(model)
    if not entries:
        raise ValueError("model has no attention modules with a layer_idx (not a transformers decoder?)")
    layer_ids = {idx for _, idx, _ in entries}
    if layers is None:
        chosen = set(layer_ids)
    else:
        chosen = set()
        for l in layers:
            if isinstance(l, bool) or not isinstance(l, int) or l not in layer_ids:
                raise ValueError(f"layers entries must be layer indices in [0, {len(layer_ids)}), got {l!r}")
            chosen.add(l)
    for name, idx, module in entries:
        why = _not_causal_self_attention(name, module)
        if why is not None and idx in chosen:
            raise ValueError(
                f"{name} ({type(module).__name__}, layer {idx}) is {why}; minference's sparse prefill "
                "is causal self-attention only (leave the layer out of layers= to keep it dense)"
            )
    if is_patched(model):
        unpatch(model)
    modules = attention_modules(model)
    signature = model_signature(model, fingerprint=check_fingerprint and config.model.weights_fingerprint is not None)
    config.check(signature, allow_mismatch=allow_mismatch)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total = len(config.plan(min(modules)))

    # this rank's heads: read from DTensor projections (transformers' tensor parallelism) or counted
    problem, shard = None, None
    if tensor_parallel:
        num_heads = int(cfg.num_attention_heads)
        num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        names = {id(m): n for n, _, m in entries}
        shards = [_tp_shard(model, names[id(m)], m, num_heads, num_kv) for m in modules.values()]
        failed = [s for s in shards if s is not None and s.problem]
        shard = failed[0] if failed else next((s for s in shards if s is not None), None)
        read = {None if s is None else (s.offset, s.heads) for s in shards}
        if failed:
            problem = failed[0].problem
        elif len(read) > 1:
            problem = f"the layers' attention modules hold different head shards on this rank: {sorted(read, key=str)}"
    if shard is not None:  # heads read from the tensor-parallel shard (or found unreadable)
        group = shard.group
        local = shard.heads if problem is None else 0
        if head_offset is None:
            head_offset = shard.offset
        elif problem is None and head_offset != shard.offset and check_partition is not False:
            problem = (f"head_offset {head_offset} was given, but this rank's tensor-parallel shard ({shard.where}) "
                       f"holds global heads {shard.offset}..{shard.offset + shard.heads - 1}")
    else:
        local, group = _local_heads(modules[min(modules)], cfg), None
        if head_offset is None:
            head_offset = 0
    if problem is None and head_offset + local > total:
        problem = f"head_offset {head_offset} + {local} local heads exceeds the config's {total} heads"

    if check_partition is None:
        import torch.distributed as dist

        # a head shard (not a data-parallel replica of the whole model), or a shard some rank cannot read
        sharded = local < total or problem is not None
        check_partition = sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if check_partition:
        check_head_partition(head_offset, local, total, group, problem=problem)  # raises on every rank
    elif problem is not None:
        raise ValueError(problem)

    for idx, module in modules.items():
        if idx >= len(config.layers):
            raise ValueError(f"config has {len(config.layers)} layers, the model has layer {idx}")
        plan = config.plan(idx)
        if head_offset + local > len(plan):
            raise ValueError(
                f"layer {idx}: head_offset {head_offset} + {local} local heads exceeds the config's {len(plan)} heads"
            )
        active = plan[head_offset : head_offset + local]
        sparse = idx in chosen and not all(isinstance(p, Dense) for p in active)
        setattr(module, STATE_ATTR, LayerState(idx, plan, sparse, head_offset, dense_threshold, backend, fill_gaps,
                                               heads=local, dense_tail=dense_tail, graphs=graphs, guard=guard))
    register()
    previous = getattr(model.config, "_attn_implementation", None)
    hooks = [] if guard is None else [  # one guard call per model forward
        model.register_forward_pre_hook(lambda _module, _args: guard.begin_call()),
        model.register_forward_hook(lambda _module, _args, _output: guard.end_call())]
    setattr(model, MODEL_ATTR, {"previous": previous, "guard": guard, "hooks": hooks})
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`patch`: restore the previous attention implementation and drop layer states."""
    saved = getattr(model, MODEL_ATTR, None)
    if saved is None:
        raise ValueError("model is not patched by minference")
    for module in model.modules():
        if hasattr(module, STATE_ATTR):
            delattr(module, STATE_ATTR)
    for hook in saved.get("hooks", ()):
        hook.remove()
    if saved.get("guard") is not None:
        saved["guard"].end_call()  # a forward cut short by an error leaves its call open
    model.set_attn_implementation(saved["previous"] or "sdpa")
    delattr(model, MODEL_ATTR)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return getattr(model, MODEL_ATTR, None) is not None


def guard_of(model: torch.nn.Module) -> Any:
    """The :class:`minference.guard.QualityGuard` of a patched model (``None``: no guard or not patched)."""
    saved = getattr(model, MODEL_ATTR, None)
    return None if saved is None else saved.get("guard")


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


@contextmanager
def prompt_continues(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside, the patched layers run no dense tail: for the chunks of a chunked prefill before
    the prompt's last one. The tail (``patch(dense_tail=T)``) is for the rows that make the first
    generated token, the last ``T`` of the prompt; a chunk that a later chunk follows does not end
    the prompt, so a tail there is work the one-shot prefill does not do (docs/tuning.md#tail-on-last-chunk:
    every chunked call made its own tail before). A serving loop that knows its last chunk wraps the others in
    this; :func:`minference.app.models.forward_chunks` does. No-op on a model that is not patched
    or has no tail; the tails are restored on exit, also after an error."""
    states = list(layer_states(model).values())
    saved = [state.dense_tail for state in states]
    for state in states:
        state.dense_tail = 0
    try:
        yield model
    finally:
        for state, tail in zip(states, saved, strict=True):
            state.dense_tail = tail


#: Name of the observing (dense) attention implementation used by :func:`observe_attention`.
OBSERVE_IMPLEMENTATION = "minference_observe"
OBSERVER_ATTR = "minference_observer"


def _observing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Dense SDPA attention that first hands ``(layer, query, key, value, rows)`` to the module's observer."""
    observer = getattr(module, OBSERVER_ATTR, None)
    L, S = query.shape[2], key.shape[2]
    if observer is not None and L == S and L > 1:
        rows = padding_rows(attention_mask, L)
        if rows is not False:
            seqlens, seqstarts = rows if rows is not None else (None, None)
            observer(module.layer_idx, query, key, value, seqlens, seqstarts)
    return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@contextmanager
def observe_attention(model: PreTrainedModel, observer: Callable) -> Iterator[PreTrainedModel]:
    """Run ``model`` with dense SDPA attention while ``observer(layer, query [B, Hq, N, D],
    key [B, Hkv, N, D], value [B, Hkv, N, D], seqlens, seqstarts)`` sees every prefill call (the
    offline search and the coverage measurements read the model's real queries, keys and values
    this way; ``seqlens, seqstarts`` ``[B]`` are a padded batch's rows, ``None`` without padding).
    The arguments are positional, in the attention function's order, as for
    :attr:`LayerState.observer`."""
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
