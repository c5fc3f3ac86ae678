"""Naive online index builders: the definitions the fast builders in
:mod:`minference.kernels.estimate` are tested against (as exact sets on tie-free inputs).

Both work row by row and head by head in float64 on whatever device the inputs are on, with
the full score matrices materialised. Index values are LOGICAL positions within a batch row
(0 = the row's first token, see :func:`minference._checks.check_ragged`).

Per-head budgets are ints, or 1-D int tensors indexed by GLOBAL head id ``head_offset + h``
for local query head ``h``.

Vertical-slash, for a row of length ``n`` and a head:

* the sampled queries are the last ``r = min(last_q, n)`` positions ``i ∈ [n - r, n)`` and,
  with ``extra_rows = E > 0``, up to ``E`` more spread evenly over the earlier ``m = n - r``
  rows: ``i_k = floor((k + 1) * m / (E + 1))`` for ``k = 0..E-1``, as a set (tiny rows repeat
  points; ``m = 0`` gives none). Every ``i_k < m``, so no row is sampled twice, and
  ``E >= m`` samples every earlier row. Extra rows are scored exactly like the last ones: the
  last rows alone miss keys that only middle queries need (a needle read half-way through a
  prompt); evenly spaced single rows are deterministic, per batch row and cover the whole
  prompt at ``E`` rows' cost;
* ``P[i, j]`` is the causal softmax of ``scale * q_i · k_j`` over ``j <= i``;
* column score ``col[j] = agg_i P[i, j]``; diagonal score ``diag[δ] = agg_i P[i, i - δ]`` over
  the sampled ``i`` with ``i - δ >= 0`` (``agg`` is ``sum`` or ``max``); ``j, δ ∈ [0, n)``;
* forced: columns ``j < min(sink_columns, vertical)`` and offsets
  ``δ < min(max(local_diagonals, 1), slash)`` (``δ = 0`` is always kept);
* then the best-scoring remaining columns / offsets up to ``min(vertical, n)`` /
  ``min(slash, n)`` in total.

Block-sparse, for a row of length ``n``, ``nb = ceil(n / block)`` valid blocks and a head:

* pooled ``q̄_I``, ``k̄_J`` are the means over the VALID tokens of each block;
* ``score[I, J] = scale * q̄_I · k̄_J`` for ``J <= I`` (block-causal);
* forced: the diagonal ``J = I`` (when ``force_diagonal``) and the sinks
  ``J < min(sink_blocks, top_k - force_diagonal)``, ``J <= I``;
* then the best-scoring remaining blocks up to ``min(top_k, I + 1)`` in total. Query blocks at
  or past ``nb`` (padding only) get no blocks.

Output widths: ``NV = min(max vertical, N)``, ``NS = min(max slash, N)``,
``K = min(max top_k, ceil(N / block))`` over the computed heads; unused entries are -1. The
order of entries inside a row is unspecified (a set).
"""

from __future__ import annotations

import math

import torch
from minference.reference.attention import head_ids, per_head_budget

from minference._checks import check_qkv, check_ragged, check_row_sampling, default_scale
from minference.patterns import DEFAULT_BLOCK_SIZE, DEFAULT_LAST_Q

__all__ = ["vertical_slash_index", "block_sparse_index"]


def _rows(q, k, seqlens, seqstarts) -> list[tuple[int, int, int]]:
    B, _, _, N, _ = check_qkv(q, k, k)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    return [(b, int(s), int(n)) for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist()))]


def _sampled_rows(n: int, last_q: int, extra_rows: int) -> list[int]:
    """Sampled query positions of a row of length ``n`` (see the module docstring), ascending."""
    m = n - min(last_q, n)
    extra = {(k + 1) * m // (extra_rows + 1) for k in range(extra_rows)}
    return sorted(i for i in extra if i < m) + list(range(m, n))


def _select(scores: torch.Tensor, forced: int, budget: int) -> list[int]:
    """Indices ``0..forced-1`` then the best of the rest by score (ties: lower index), ``budget`` in all."""
    n = scores.shape[0]
    budget = min(budget, n)
    forced = min(forced, budget)
    chosen = list(range(forced))
    rest = sorted(range(forced, n), key=lambda j: (-float(scores[j]), j))
    return chosen + rest[: budget - forced]


def _pad(rows: list[list[int]], width: int) -> list[int]:
    return [x for row in rows for x in row + [-1] * (width - len(row))]


def vertical_slash_index(
    q: torch.Tensor,
    k: torch.Tensor,
    vertical: int | torch.Tensor,
    slash: int | torch.Tensor,
    *,
    last_q: int = DEFAULT_LAST_Q,
    extra_rows: int = 0,
    sink_columns: int | torch.Tensor = 0,
    local_diagonals: int | torch.Tensor = 1,
    aggregation: str = "sum",
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    head_offset: int = 0,
    return_scores: bool = False,
):
    """Naive vertical-slash index from the last ``last_q`` queries of each row (and
    ``extra_rows`` earlier ones).

    Args:
        q: ``[B, Hq, N, D]``; k: ``[B, Hkv, N, D]``.
        vertical, slash: column / offset budgets (forced ones included), per global head.
        last_q: sampled query rows per batch row (the last ones).
        extra_rows: further sampled rows spread evenly over the earlier part of each row.
        sink_columns, local_diagonals: forced leading columns / offsets, per global head.
        aggregation: ``"sum"`` or ``"max"`` over the sampled rows.

    Returns:
        ``(vertical_idx [B, Hg, NV], slash_idx [B, Hg, NS])`` int32 on q's device, -1 padded;
        with ``return_scores`` also ``(col [B, Hg, N], diag [B, Hg, N])`` float64 (0 outside
        the row).
    """
    B, Hq, Hkv, N, D = check_qkv(q, k, k)
    check_row_sampling(last_q, extra_rows, aggregation)
    scale = default_scale(D, scale)
    ids = head_ids(heads, Hq)
    nv = per_head_budget("vertical", vertical, ids, head_offset, 0)
    ns = per_head_budget("slash", slash, ids, head_offset, 1)
    sinks = per_head_budget("sink_columns", sink_columns, ids, head_offset, 0)
    locs = per_head_budget("local_diagonals", local_diagonals, ids, head_offset, 0)
    width_v = min(max(nv, default=0), N)
    width_s = min(max(ns, default=0), N)
    group = Hq // Hkv
    col = torch.zeros(B, len(ids), N, dtype=torch.float64, device=q.device)
    diag = torch.zeros(B, len(ids), N, dtype=torch.float64, device=q.device)
    v_rows: list[list[int]] = [[] for _ in range(B * len(ids))]
    s_rows: list[list[int]] = [[] for _ in range(B * len(ids))]
    for b, s, n in _rows(q, k, seqlens, seqstarts):
        if n == 0:
            continue
        sampled = torch.tensor(_sampled_rows(n, last_q, extra_rows), device=q.device)
        for g, h in enumerate(ids):
            qs = q[b, h, s + sampled].double()  # [R, D]
            ks = k[b, h // group, s : s + n].double()  # [n, D]
            logits = (qs @ ks.T) * scale  # [R, n]
            i = sampled[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            probs = torch.softmax(logits.masked_fill(j > i, float("-inf")), dim=-1)  # [R, n]
            delta = i - j  # [R, n]
            col[b, g, :n] = probs.sum(0) if aggregation == "sum" else probs.amax(0)
            for d in range(n):
                on = probs[delta == d]
                diag[b, g, d] = on.sum() if aggregation == "sum" else on.max()
            v_rows[b * len(ids) + g] = _select(col[b, g, :n], min(sinks[g], nv[g]), nv[g])
            s_rows[b * len(ids) + g] = _select(diag[b, g, :n], min(max(locs[g], 1), ns[g]), ns[g])
    v_idx = torch.tensor(_pad(v_rows, width_v), dtype=torch.int32).view(B, len(ids), width_v)
    s_idx = torch.tensor(_pad(s_rows, width_s), dtype=torch.int32).view(B, len(ids), width_s)
    v_idx, s_idx = v_idx.to(q.device), s_idx.to(q.device)
    return (v_idx, s_idx, col, diag) if return_scores else (v_idx, s_idx)


def block_sparse_index(
    q: torch.Tensor,
    k: torch.Tensor,
    top_k: int | torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK_SIZE,
    sink_blocks: int | torch.Tensor = 0,
    force_diagonal: bool = True,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    head_offset: int = 0,
    return_scores: bool = False,
):
    """Naive block-sparse routing by mean-pooled queries and keys.

    Args:
        q: ``[B, Hq, N, D]``; k: ``[B, Hkv, N, D]``.
        top_k: key blocks per query block (forced ones included), per global head.
        block: block size for queries and keys.
        sink_blocks: forced leading key blocks, per global head.
        force_diagonal: always keep the query block's own block.

    Returns:
        ``blocks [B, Hg, NQB, K]`` int32 on q's device, -1 padded; with ``return_scores`` also
        ``scores [B, Hg, NQB, NQB]`` float64 (``-inf`` above the diagonal and outside the row).
    """
    B, Hq, Hkv, N, D = check_qkv(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not isinstance(force_diagonal, bool):
        raise TypeError("force_diagonal must be a bool")
    scale = default_scale(D, scale)
    ids = head_ids(heads, Hq)
    tops = per_head_budget("top_k", top_k, ids, head_offset, 1)
    sinks = per_head_budget("sink_blocks", sink_blocks, ids, head_offset, 0)
    nqb = math.ceil(N / block)
    width = min(max(tops, default=0), nqb)
    group = Hq // Hkv
    scores = torch.full((B, len(ids), nqb, nqb), float("-inf"), dtype=torch.float64, device=q.device)
    out = torch.full((B, len(ids), nqb, width), -1, dtype=torch.int32)
    for b, s, n in _rows(q, k, seqlens, seqstarts):
        nb = math.ceil(n / block)
        for g, h in enumerate(ids):
            qm = torch.stack([q[b, h, s + I * block : s + min((I + 1) * block, n)].double().mean(0)
                              for I in range(nb)]) if nb else None
            km = torch.stack([k[b, h // group, s + J * block : s + min((J + 1) * block, n)].double().mean(0)
                              for J in range(nb)]) if nb else None
            n_sink = min(sinks[g], tops[g] - int(force_diagonal))
            for I in range(nb):
                sc = (km[: I + 1] @ qm[I]) * scale  # [I + 1]
                scores[b, g, I, : I + 1] = sc
                forced = {J for J in range(min(n_sink, I + 1))}
                if force_diagonal:
                    forced.add(I)
                budget = min(tops[g], I + 1)
                rest = sorted((J for J in range(I + 1) if J not in forced), key=lambda J: (-float(sc[J]), J))
                chosen = sorted(forced) + rest[: budget - len(forced)]
                out[b, g, I, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    out = out.to(q.device)
    return (out, scores) if return_scores else out
