"""Sparse prefill dispatcher: one layer's attention from its per-head plan.

:func:`sparse_prefill` groups the layer's heads by pattern (:mod:`minference.index`), builds each
group's logical index online, converts and runs one kernel per group with ``heads=`` (a layer
costs a handful of launches, never one per head), writing every group into one output. Below
:data:`DENSE_THRESHOLD` tokens it runs dense attention instead (PyTorch SDPA, GQA-aware), because
index building and sparse kernels only pay off on long prompts.

Backends (each a :class:`minference.backend.Backend`, one module each; :func:`sparse_prefill` calls
one step per pattern on it):

* ``"triton"``: :class:`minference.backend_triton.TritonBackend`, the builders and kernels of
  :mod:`minference.kernels` (CUDA, or the Triton interpreter on CPU tensors). The whole path is
  free of host synchronisation (validation that reads values is done once, outside CUDA graph
  capture), so it can be captured in a CUDA graph.
* ``"torch"``: :class:`minference.backend_torch.TorchBackend`, the functions of
  :mod:`minference.torch_backend`, portable PyTorch on any device (reads row lengths on the host).
* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise.

Validation happens once, at the public edge (:func:`sparse_prefill`, :func:`dense_prefill`,
:func:`dense_tail_attention`, :func:`merge_attention`): the backend steps, the index builders and
the kernels below them are called with ``validate=False`` on the checked inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from minference._checks import (
    capturing,
    check_finite_kv,
    check_finite_rows,
    check_key_split,
    check_merge,
    check_out,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    default_scale,
    query_rows_bound,
    uniform_query_rows,
)
from minference.backend import Backend, Rows, ValueGuard, get_backend
from minference.index import heads_tensor, prepare_plan
from minference.index_sets import check_fill_gaps
from minference.patterns import Pattern

__all__ = ["sparse_prefill", "dense_prefill", "dense_tail_attention", "merge_attention", "DENSE_THRESHOLD",
           "MIN_SPARSE_QUERIES", "FILL_GAPS", "BACKENDS", "resolve_backend", "INDEX_RANGE", "ATTENTION_RANGE",
           "profile_range"]

#: Prompts shorter than this many tokens run dense attention. On the real testbed (Qwen2.5-Coder-0.5B,
#: whole-model TTFT, searched configs) the sparse prefill is host-bound and slower than dense at 16K
#: and 32K and faster from 64K (benchmarks/results/h200_s10_qwen_eval.md), so prompts up to 32K run
#: dense; synthetic layers alone would put it at 16K. The threshold is per layer and follows the
#: vertical-slash budget. Figures: see docs/tuning.md#dense-threshold.
DENSE_THRESHOLD = 49152
#: A call on query rows (a chunk after a cache; docs/kernels.md) with fewer query rows than this
#: runs dense attention, whatever the key length: decode steps and short continuations. Not yet
#: measured: the estimate is that a vertical-slash index costs about as much as 128 dense query
#: rows (two passes of 64 sampled rows over every key), so chunks of 1K rows and more leave the
#: sparse path room to pay.
MIN_SPARSE_QUERIES = 1024
BACKENDS = ("auto", "triton", "torch")
#: Vertical-slash offsets are closed over gaps of at most this many missing offsets before the
#: kernel runs (:func:`minference.index_sets.slash_set`). Any value >= 127 (the GPU query
#: tile minus one) makes every slash run hole-free, so its interior tiles run unmasked (the
#: estimator's offsets are dense near the diagonal with scattered holes near the band's edge;
#: unfilled, those holes mask nearly every range tile, ~2x the tile cost). Larger gaps also merge
#: nearby runs: fewer masked run edges and loop restarts for a few more key tiles. 383 is the first
#: value on the kernel time's plateau at 128K and 1M (see docs/tuning.md#fill-gaps). Filling
#: only adds candidates, so captured mass can only grow. 0 disables it. Any value
#: >= 127 also lets the kernel be compiled without its bitmap path (``VSIndex.all_solid``).
FILL_GAPS = 383
#: ``torch.profiler`` range around each group's online index building and (Triton) its conversion
#: to physical tiles; ``minference eval`` reads the device time under it (the eq. 13 split).
INDEX_RANGE = "minference::index"
#: Range around one whole attention call of a patched layer (sparse or dense path;
#: :mod:`minference.integration`); it contains the :data:`INDEX_RANGE` ranges of that call.
ATTENTION_RANGE = "minference::attention"


def profile_range(name: str):
    """``torch.profiler.record_function(name)`` while a profiler records, else a no-op context.

    Host-only either way (no tensor, no device work, no sync): safe inside CUDA-graph capture,
    and with the profiler off it costs one flag read instead of a RecordFunction.
    """
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _rows(scale: float, seqlens: torch.Tensor | None, seqstarts: torch.Tensor | None,
          q_seqlens: int | torch.Tensor | None = None, q_seqstarts: torch.Tensor | None = None) -> Rows:
    """The row arguments of a call's builders and kernels; the query rows only when given."""
    rows = Rows(scale=scale, seqlens=seqlens, seqstarts=seqstarts)
    if q_seqlens is not None or q_seqstarts is not None:
        rows["q_seqlens"], rows["q_seqstarts"] = q_seqlens, q_seqstarts
    return rows


def dense_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Causal dense attention ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]`` -> ``[B,Hq,N,D]``.

    Full rows go to PyTorch SDPA (``enable_gqa``: no repeated kv copies; cuDNN / flash on CUDA).
    Ragged rows and query rows (``q [B,Hq,Nq,D]``, ``q_seqlens`` / ``q_seqstarts``:
    docs/kernels.md) go to the backend's masked dense path; rows that are not computed come out
    as zeros. ``validate``: as :func:`sparse_prefill`.
    """
    B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v)
    scale = default_scale(D, scale)
    _check_values(q, k, v, seqlens, seqstarts, q_seqlens, q_seqstarts, validate)
    if seqlens is None and seqstarts is None and q_seqlens is None and Nq == N:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=Hq != Hkv)
    be = get_backend(resolve_backend(backend, q.device))
    out = torch.zeros_like(q)
    guard = be.value_guard(k, v, checked=validate and not capturing())
    be.check_launch(q)
    return be.dense(q, k, v, None, out=out, guard=guard, rows=_rows(scale, seqlens, seqstarts, q_seqlens, q_seqstarts))


def sparse_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Sequence[Pattern],
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    head_offset: int = 0,
    dense_threshold: int | None = None,
    backend: str = "auto",
    fill_gaps: int = FILL_GAPS,
    dense_over: float | None = None,
    dense_tail: int = 0,
    validate: bool = True,
    shadow=None,
) -> torch.Tensor:
    """Prefill attention of one layer with each head's sparse pattern.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (transformers' layout, any strides; GQA:
            query head ``h`` reads kv head ``h // (Hq // Hkv)``).
        plan: patterns indexed by GLOBAL head id (``len(plan) >= head_offset + Hq``).
        scale: softmax scale, default ``D ** -0.5``.
        seqlens, seqstarts: ``[B]`` ragged rows (tokens of row ``b`` at ``seqstarts[b] ..
            seqstarts[b] + seqlens[b] - 1``); padding rows of the output are zeros.
        q_seqlens, q_seqstarts: query rows that are part of the key rows: ``q [B, Hq, Nq, D]``
            with ``Nq <= N`` (a chunk of a prompt after its cached prefix, a continuation of a
            conversation), or a row's last tokens (docs/kernels.md). Each pattern's index is
            built from the query rows' own queries against all keys, in the row's positions;
            fewer than :data:`MIN_SPARSE_QUERIES` query rows run dense.
        head_offset: global id of local query head 0 (tensor parallelism).
        dense_threshold: run dense attention when ``N`` (the key rows' length) is below this
            (default :data:`DENSE_THRESHOLD`; 0 forces the sparse path, query rows included).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).
        fill_gaps: vertical-slash offsets are closed over gaps of at most this many missing
            offsets (default :data:`FILL_GAPS`; both backends compute the same filled set).
        dense_over: Triton backend only: a vertical-slash head whose converted index runs more
            than ``dense_over`` times the dense causal key tiles computes dense causal attention
            instead (:func:`minference.kernels.convert.convert_vertical_slash`; decided on the
            device, no sync). ``None`` (default): never.
        dense_tail: the last ``dense_tail`` query rows of every row (batch row) attend densely,
            whatever their heads' patterns (:func:`dense_tail_attention`): the rows that make
            the first generated token, a small share of the work (``dense_tail / N`` of the
            rows). With query rows, the last ``dense_tail`` of them. 0 (default): every row
            follows its pattern.
        validate: check the values once, before any launch (skipped under CUDA-graph capture):
            ``seqlens``/``seqstarts`` ranges, and NaN or inf in q, k or v on a token inside its
            row (a ``ValueError`` naming the tensor, batch row, head and token). Costs one pass
            over q, k, v and a host sync; ``False`` skips it (the path is then sync-free), and
            non-finite inputs give non-finite outputs only on rows whose candidate set reaches
            them (the index builders keep their forced entries: ``docs/contract.md``).
        shadow: the quality guard's check of this layer in a checked call
            (:class:`minference.guard.ShadowCheck`, from ``QualityGuard.layer_check``; docs/guard.md):
            it receives every group's index and, after the output is written, compares a few query
            rows with dense attention; in ``enforce`` mode the heads it returns are recomputed
            densely here. ``None`` (default): no check, nothing added to the call.

    Returns:
        ``out [B, Hq, Nq, D]`` in q's dtype.
    """
    B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v)
    name = resolve_backend(backend, q.device)
    groups = prepare_plan(plan, Hq, head_offset, q.device)
    if dense_threshold is None:
        dense_threshold = DENSE_THRESHOLD
    if isinstance(dense_threshold, bool) or not isinstance(dense_threshold, int) or dense_threshold < 0:
        raise ValueError(f"dense_threshold must be a non-negative int, got {dense_threshold!r}")
    scale = default_scale(D, scale)
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    check_fill_gaps(fill_gaps)
    be: Backend = get_backend(name)
    be.check_plan(groups, q, dense_over=dense_over)
    if isinstance(dense_tail, bool) or not isinstance(dense_tail, int) or dense_tail < 0:
        raise ValueError(f"dense_tail must be a non-negative int, got {dense_tail!r}")
    if shadow is not None and not all(callable(getattr(shadow, m, None)) for m in ("add_index", "finish")):
        raise TypeError(f"shadow must be a minference.guard.ShadowCheck or None, got {type(shadow).__name__}")
    qrows = q_seqlens is not None or q_seqstarts is not None or Nq != N
    few_queries = qrows and dense_threshold > 0 and query_rows_bound(q_seqlens, Nq) < MIN_SPARSE_QUERIES
    rows = Rows(scale=scale, seqlens=seqlens, seqstarts=seqstarts)
    if qrows:  # the ordinary call passes no query-row arguments at all
        rows["q_seqlens"], rows["q_seqstarts"] = q_seqlens, q_seqstarts
    if N < dense_threshold or few_queries or all(g.group.kind == "dense" for g in groups):
        # the public dense path (its checks of q repeat the ones above: a dense call's cost is the attention)
        return dense_prefill(q, k, v, backend=name, validate=validate, **rows)
    # once here; everything below runs with validate=False and one value guard (Triton)
    _check_values(q, k, v, seqlens, seqstarts, q_seqlens, q_seqstarts, validate)
    guard = be.value_guard(k, v, checked=validate and not capturing())
    be.check_launch(q)
    ragged = seqlens is not None or seqstarts is not None
    # rows no group writes read as zeros; on Triton a chunk after a cache on full key rows (every q
    # row a query row) has none: every group's kernel writes all the rows of its heads
    uniform = None if ragged or not qrows else uniform_query_rows(q_seqlens, q_seqstarts, Nq, N, given_rows=False)
    every_row = not (ragged or qrows) or name == "triton" and uniform is not None and uniform[0] == Nq
    out = torch.empty_like(q) if every_row else torch.zeros_like(q)
    for dg in groups:
        kind = dg.group.kind
        if kind == "a_shape":
            be.ashape(q, k, v, dg, head_offset=head_offset, out=out, guard=guard, rows=rows)
        elif kind == "vertical_slash":
            with profile_range(INDEX_RANGE):  # the logical index and (Triton) its physical tiles
                index = be.vertical_slash_group_index(q, k, dg, head_offset=head_offset, fill_gaps=fill_gaps,
                                                      dense_over=dense_over, rows=rows)
            if shadow is not None:  # the quality guard's checked call: the sets it compares with dense
                shadow.add_index(dg, vertical=index.vertical, slash=index.slash, dense=index.dense)
            be.vertical_slash(q, k, v, index, dg, out=out, fill_gaps=fill_gaps, guard=guard, rows=rows)
        elif kind == "block_sparse":
            with profile_range(INDEX_RANGE):
                blocks = be.block_sparse_group_index(q, k, dg, head_offset=head_offset, rows=rows)
            if shadow is not None:
                shadow.add_index(dg, blocks=blocks)
            be.block_sparse(q, k, v, blocks, dg, out=out, guard=guard, rows=rows)
        else:
            be.dense(q, k, v, dg.heads, out=out, guard=guard, rows=rows)
    if dense_tail and B and Hq and N:  # dense_tail_attention without its checks: the call passed them above
        _dense_tail(be, q, k, v, dense_tail, out=out, value_guard=guard, **rows)
    if shadow is not None:  # a checked call: compare sampled rows with dense; enforce: heads below the floor go dense
        fallback = shadow.finish(q, k, v, out, groups, head_offset=head_offset, dense_tail=dense_tail,
                                 fill_gaps=fill_gaps, **rows)
        if fallback is not None:  # the check object's heads: their form is checked here, once
            be.dense(q, k, v, heads_tensor(fallback, Hq, q.device), out=out, guard=guard, rows=rows)
    return out


def dense_tail_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, *, out: torch.Tensor,
                         scale: float | None = None, seqlens: torch.Tensor | None = None,
                         seqstarts: torch.Tensor | None = None, q_seqlens: int | torch.Tensor | None = None,
                         q_seqstarts: torch.Tensor | None = None, backend: str = "auto",
                         key_split: int | None = None, value_guard=None) -> torch.Tensor:
    """Causal dense attention of the last ``rows`` query rows of each batch row (all of a row
    shorter than that), written into ``out`` (other rows untouched); returns ``out``.

    One dense call on query rows (docs/kernels.md): the row's last ``rows`` tokens in place, or
    with query rows (``q_seqlens`` / ``q_seqstarts``, ``q`` shorter than ``k``) the last ``rows``
    of them; the work is ``rows * N`` pairs per head. On Triton it is
    :func:`minference.kernels.dense_attention` over those rows (the A-shape kernel's dense case,
    no mask but the causal edge), split over the keys when its grid is small against the GPU's
    SMs (``key_split``: ``None`` chooses from the shapes, 1 is the unsplit kernel, ``n`` forces
    ``n``; docs/kernels.md, "dense tail"); on the torch backend its dense path (``key_split`` is
    ignored there). Device ops only (no host sync: CUDA-graph capturable); a row without queries
    is left untouched. ``value_guard``: the ``(k_masked, v_safe)`` pair of
    :func:`minference.kernels.value_guard` for ``k, v`` (what :func:`sparse_prefill` passes, made once
    for its call); ``None`` makes one in the kernel (Triton; the torch backend ignores it)."""
    B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"dense_tail rows must be a non-negative int, got {rows!r}")
    check_out(out, q)  # the backends write it without checking (checked=True)
    check_key_split(key_split)  # here too: the torch backend ignores it, bad values fail on every backend
    if value_guard is not None:  # likewise
        from minference.kernels._common import check_value_guard

        check_value_guard(value_guard, k, v)
    if rows == 0 or B == 0 or Hq == 0 or N == 0:
        return out
    be = get_backend(resolve_backend(backend, q.device))
    be.check_launch(q)
    return _dense_tail(be, q, k, v, rows, out=out, scale=scale, seqlens=seqlens, seqstarts=seqstarts,
                       q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, key_split=key_split, value_guard=value_guard)


def _dense_tail(be: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, *, out: torch.Tensor,
                scale: float | None, seqlens: torch.Tensor | None, seqstarts: torch.Tensor | None,
                q_seqlens: int | torch.Tensor | None = None, q_seqstarts: torch.Tensor | None = None,
                key_split: int | None = None, value_guard: ValueGuard | None = None) -> torch.Tensor:
    """:func:`dense_tail_attention` on arguments its caller validated (:func:`sparse_prefill`, or
    the public function itself): ``rows > 0`` and a non-empty ``q``, ``be.check_launch(q)`` done."""
    B, Nq, N = q.shape[0], q.shape[2], k.shape[2]
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=False)
    chosen = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                              given_rows=seqlens is not None or seqstarts is not None, values=False)
    tail = Rows(scale=scale, seqlens=seqlens, seqstarts=seqstarts)
    if chosen is None:  # the rows' own last tokens, in place: an int keeps the grid to `rows` rows
        tail["q_seqlens"] = rows
    elif isinstance(q_seqlens, int) or q_seqlens is None and q_seqstarts is None:
        # every row's count is min(c, its length) (an int c, or c = Nq for a chunk on full rows):
        # so is the tail's, with c = min(rows, c), an int again; placed at the end of the queries
        count = min(rows, Nq if q_seqlens is None else q_seqlens)
        q_lens, q_starts = chosen
        tail["q_seqlens"], tail["q_seqstarts"] = count, q_starts + q_lens - torch.clamp(q_lens, max=count)
    else:
        q_lens, q_starts = chosen
        last = torch.clamp(q_lens, max=rows)
        tail["q_seqlens"], tail["q_seqstarts"] = last, q_starts + q_lens - last
    return be.dense(q, k, v, None, out=out, guard=value_guard, key_split=key_split, rows=tail)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the same queries over the union of two disjoint key sets, from each set's
    ``(out [..., D], lse [...])`` (``return_lse=True`` of any kernel): weights ``exp(lse_a -
    lse)`` and ``exp(lse_b - lse)`` with ``lse = log(exp(lse_a) + exp(lse_b))``, in float32
    (float64 when an input is float64). A row empty in both stays 0 with ``lse = -inf``. Merging
    is associative and commutative: several pieces merge in any order.

    Floating tensors only (fp16, bf16, fp32, fp64; outputs of one dtype), all on one device
    (:func:`minference._checks.check_merge`; a ``TypeError`` / ``ValueError`` otherwise).
    Returns ``(out in out_a's dtype, lse in the merge dtype)``; the float64 twin is
    :func:`minference.reference.attention.merge_attention`."""
    acc = check_merge(out_a, lse_a, out_b, lse_b)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, float("-inf")))
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa[..., None] * out_a.to(acc) + wb[..., None] * out_b.to(acc)) / safe[..., None]
    return out.to(out_a.dtype), lse


def _check_values(q, k, v, seqlens, seqstarts, q_seqlens, q_seqstarts, validate: bool) -> None:
    """The value checks of :func:`sparse_prefill` / :func:`dense_prefill` (host reads): row
    ranges, query rows, then finite q (its query rows), k, v inside the rows. Nothing with
    ``validate=False`` or while a CUDA graph is captured."""
    if not validate or capturing():
        return
    B, N = k.shape[0], k.shape[2]
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    chosen = check_query_rows(q_seqlens, q_seqstarts, lens, starts, q.shape[2], N,
                              given_rows=seqlens is not None or seqstarts is not None)
    q_lens, q_starts = chosen if chosen is not None else (lens, starts)
    check_finite_rows({"q": q}, q_lens, q_starts)
    check_finite_kv({"k": k, "v": v}, lens, starts, group=q.shape[1] // k.shape[1])
