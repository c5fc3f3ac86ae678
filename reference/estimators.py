"""Naive online index builders: the definitions the fast builders in
:mod:`minference.kernels` (``estimate_vs``, ``estimate_bs``) are tested against (as exact sets on tie-free inputs).

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
* then the best-scoring remaining columns / offsets, as many as the budget rule keeps (below;
  ``"top_k"``: up to ``min(vertical, n)`` / ``min(slash, n)`` in total). The weights of the
  rules are the scores ``col[j]``, ``diag[δ]`` themselves (``>= 0``); columns and diagonals
  are selected separately, with one rule and threshold and their own minimum
  (``min_vertical``, ``min_slash``) and maximum (``vertical``, ``slash``).

Block-sparse, for a row of length ``n``, ``nb = ceil(n / block)`` valid blocks and a head:

* pooled ``q̄_I``, ``k̄_J`` are the means over the VALID tokens of each block;
* ``score[I, J] = scale * q̄_I · k̄_J`` for ``J <= I`` (block-causal);
* forced: the diagonal ``J = I`` (when ``force_diagonal``) and the sinks
  ``J < min(sink_blocks, top_k - force_diagonal)``, ``J <= I``;
* then the best-scoring remaining blocks, as many as the budget rule keeps (below;
  ``"top_k"``: up to ``min(top_k, I + 1)`` in total), per query block. The weights of the rules
  are ``w[J] = exp(score[I, J] - max_{J' <= I} score[I, J'])`` over the candidates ``J <= I``
  (the softmax numerators of the block logits, largest 1), with ``min_blocks`` and ``top_k`` as
  the bounds. Query blocks at or past ``nb`` (padding only) get no blocks.

Budget rules (:func:`select_row`; one selection is the columns, or the diagonals, of one row and
head, or the blocks of one query block). The candidates are the valid positions (inside the row;
block-causal); invalid ones have no weight and are never chosen. A valid candidate whose score
is not finite (NaN or ``+inf``, from non-finite inputs) has no score: it is kept when forced
(weight 0), never chosen otherwise, so one NaN cannot empty a selection or take a scored
candidate's place. ``w`` are the weights above,
``F`` the forced candidates (``|F| <= max`` by the capping above), ``[min, max]`` the bounds:

* order: the forced candidates first, in position order, then the others by score descending
  (for blocks the logit, which orders like its weight: ``exp`` is increasing, and sorting the
  logit lets the rounding of ``exp`` create no ties), ties to the LOWEST position;
* count ``c``: ``"top_k"``: ``max``. ``"mass"`` (γ = ``threshold``; FlexPrefill, XAttention): the
  smallest ``c`` whose prefix of the order holds ``c_w >= γ * W``, ``c_w`` the float64 sum of the
  first ``c`` weights and ``W`` that of all of them, both accumulated one by one in this order
  (forced weights count towards the mass; ``W`` so defined is reached at the last candidate).
  ``"relative"`` (α = ``threshold``; FlashPrefill): ``|F|`` plus the non-forced candidates with
  ``w >= α * max w`` (the max over all candidates, forced ones included): forced and qualifying
  candidates are kept, a forced one below the bar takes no qualifying one's place;
* kept: the first ``min(max(c, min, |F|), max, candidates)`` of the order (and at most the
  output width). Threshold products and sums are in float64, so a fast selection given the same
  float32 scores picks the same set, ties included (:func:`minference.index.select_top` with an
  adaptive rule among the heads; a ``"top_k"``-only selection matches on tie-free scores, and
  breaks ties at the budget's boundary as ``torch.topk`` does, or, in the Triton builder's
  one-launch kernel, to the lowest positions).

Query-aware block scores (:func:`query_block_scores`, the routing score of FlashPrefill), for a
row of length ``n``, ``nb = ceil(n / block)`` valid blocks and a head:

* ``k̄_J`` is the mean over the VALID keys of key block ``J`` (as above); queries are NOT pooled;
* for every valid query ``i`` (``I(i) = i // block``), ``p_i(J)`` is the softmax over the
  block-causal key blocks ``J <= I(i)`` of ``scale * q_i · k̄_J`` (so ``Σ_J p_i(J) = 1``);
* ``score[I, J] = max`` over the valid queries ``i`` of block ``I`` of ``p_i(J)`` for
  ``J <= I < nb``; ``-inf`` above the diagonal and for query blocks at or past ``nb``.

A single query that needs a far block (a needle) keeps that block's score high, where the mean
of the block's queries dilutes it; the score lies in ``(0, 1]`` and is comparable across rows.

Scoring rows (``score_rows = r``, the cheaper estimate; 0 = every row): the max runs over at most
``r`` of the block's valid queries, spaced ``t = max(1, block // r)`` apart and counted back from
its last valid query: positions ``hi - 1 - m * t`` for ``m = 0 .. r - 1`` that are at least
``lo``, where ``lo .. hi - 1`` are the block's valid query positions (:func:`scoring_positions`).
The block's last query always scores it; ``r >= block`` is every row. The score work falls by
``block / r``; a needle read by an unsampled query only is missed.

Query rows (``q_seqlens``, ``q_seqstarts``; docs/kernels.md, "query rows": a chunk after a
cache, or a row's last tokens). ``q [B, Hq, Nq, D]`` holds, for row ``b`` of length ``n``, the
queries of its last ``c = q_lens[b]`` positions ``q_lo = n - c .. n - 1``; position ``p`` is q's
row ``q_starts[b] + p - q_lo``. Keys, columns, offsets, key and query blocks and the output
shapes stay in the key row's positions; only query positions are ever read from ``q``:

* vertical-slash: the sampled positions are the last ``min(last_q, n)`` positions that are
  queries, ``max(n - last_q, q_lo) .. n - 1`` (fewer than ``last_q`` when ``c < last_q``), and
  the extra rows spread the same way over the earlier queries ``[q_lo, n - min(last_q, n))``:
  ``m = max(0, n - min(last_q, n) - q_lo)`` of them, ``i_k = q_lo + floor((k + 1) * m / (E +
  1))``. Each is scored against every key ``j <= i`` of the row (the cache included), exactly as
  above; forced entries are unchanged. A row without queries (``c = 0``) samples nothing: its
  scores are 0, selected by the same rules (ties to the lowest positions);
* block-sparse (both estimates): only the query blocks holding a query, ``q_lo // block .. nb -
  1`` (none when ``c = 0``), are scored and selected as above, ``q̄_I`` the mean over the
  block's query positions only (``>= q_lo``: a partial first block) and the query-aware score
  the max over those positions only; every other query block gets no blocks (-1) and ``-inf``
  scores.

The ordinary call (``Nq = N``, no ``q_seqlens``) is the case ``c = n``, ``q_lo = 0``; with
``q_seqlens = n`` in place it builds the same index, bit for bit.

Output widths: ``NV = min(max vertical, N)``, ``NS = min(max slash, N)``,
``K = min(max top_k, ceil(N / block))`` over the computed heads; unused entries are -1. The
order of entries inside a row is unspecified (a set).
"""

from __future__ import annotations

import math

import torch

from minference._checks import (
    check_int,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    check_row_sampling,
    default_scale,
)
from minference.index_sets import head_ids, per_head_budget
from minference.patterns import DEFAULT_BLOCK_SIZE, DEFAULT_LAST_Q, RULES, check_budget_rule, check_score_rows

__all__ = ["vertical_slash_index", "block_sparse_index", "query_block_scores", "select_row"]


def _rows(q, k, seqlens, seqstarts, q_seqlens=None, q_seqstarts=None) -> list[tuple[int, int, int, int, int]]:
    """Per batch row ``(b, start, n, q_lo, q_row0)``: the key row, its first query position and
    the q row of position 0 (position ``p``'s query is ``q[b, :, q_row0 + p]``); the ordinary call
    has ``q_lo = 0``, ``q_row0 = start``."""
    B, _, _, Nq, N, _ = check_qkv_rows(q, k, k)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                            given_rows=seqlens is not None or seqstarts is not None)
    q_lens, q_starts = rows if rows is not None else (lens, starts)
    out = []
    for b, (s, n, c, qs) in enumerate(zip(starts.tolist(), lens.tolist(), q_lens.tolist(), q_starts.tolist())):
        out.append((b, int(s), int(n), int(n - c), int(qs - (n - c))))
    return out


def _sampled_rows(n: int, last_q: int, extra_rows: int, q_lo: int = 0) -> list[int]:
    """Sampled query positions of a row of length ``n`` whose queries start at ``q_lo`` (see the
    module docstring), ascending."""
    m = max(0, n - min(last_q, n) - q_lo)  # the earlier query positions q_lo .. q_lo + m - 1
    e = min(extra_rows, m)  # any count >= m samples every earlier row: the same set, O(n) work
    extra = {q_lo + (k + 1) * m // (e + 1) for k in range(e)}
    return sorted(i for i in extra if i < q_lo + m) + list(range(max(n - last_q, q_lo), n))


def scoring_positions(lo: int, hi: int, block: int, score_rows: int = 0) -> list[int]:
    """The query positions of ``lo .. hi - 1`` (one query block's valid queries) that score it
    under ``score_rows`` (module docstring), descending from ``hi - 1``."""
    rows = block if score_rows == 0 else score_rows
    step = max(1, block // rows)
    return [p for p in range(hi - 1, lo - 1, -step)][:rows]


def select_row(scores, forced, budget: int, *, rule: str = "top_k", threshold: float | None = None,
               minimum: int = 0, logits: bool = False) -> list[int]:
    """One selection by its budget rule (see the module docstring), in selection order.

    Args:
        scores: ``[M]`` scores (a sequence or 1-D tensor), ``-inf`` = not a candidate; NaN or
            ``+inf``: a candidate without a score (kept only when forced).
        forced: the forced positions (an iterable; invalid ones are ignored).
        budget: ``top_k``'s count, the adaptive rules' maximum.
        rule, threshold, minimum: the budget rule, its γ / α and the adaptive rules' minimum.
        logits: weights ``exp(score - max score)`` (block logits); else the scores (``>= 0``).
    """
    check_budget_rule("", rule, threshold)
    score = [float(x) for x in scores]
    candidates = {j for j, x in enumerate(score) if x != float("-inf")}  # NaN != -inf
    valid = [j for j in sorted(candidates) if math.isfinite(score[j])]  # the scored candidates
    forced = set(forced) & candidates
    order = sorted(forced) + sorted((j for j in valid if j not in forced), key=lambda j: (-score[j], j))
    if not order:
        return []
    top = max((score[j] for j in valid), default=0.0)
    weight = {j: (math.exp(score[j] - top) if logits else score[j]) if math.isfinite(score[j]) else 0.0
              for j in order}
    if rule == "top_k":
        count = budget
    elif rule == "mass":
        total = 0.0
        for j in order:
            total += weight[j]
        count, acc = len(order), 0.0
        for c, j in enumerate(order, 1):
            acc += weight[j]
            if acc >= threshold * total:
                count = c
                break
    else:
        high = max(weight.values())
        count = len(forced) + sum(1 for j in order if j not in forced and weight[j] >= threshold * high)
    if rule != "top_k":
        count = max(count, minimum)
    return order[: min(max(count, len(forced)), budget, len(order))]


def _per_head_rule(rule, threshold, ids: list[int], head_offset: int) -> tuple[list[str], list[float | None]]:
    """Rule name and threshold per computed head from a name and a float, or per global head a
    1-D int tensor of rule codes (the order of :data:`minference.patterns.RULES`) and a 1-D float
    tensor of thresholds."""
    if isinstance(rule, torch.Tensor):
        codes = per_head_budget("rule", rule, ids, head_offset, 0)
        rules = [RULES[c] for c in codes]
    else:
        check_budget_rule("", rule, None if isinstance(threshold, torch.Tensor) else threshold)
        rules = [rule] * len(ids)
    if isinstance(threshold, torch.Tensor):
        every = threshold.tolist()
        thresholds = [every[head_offset + h] for h in ids]
    else:
        thresholds = [threshold] * len(ids)
    thresholds = [None if r == "top_k" else t for r, t in zip(rules, thresholds)]
    for r, t in zip(rules, thresholds):
        check_budget_rule("", r, t)
    return rules, thresholds


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
    rule: str | torch.Tensor = "top_k",
    threshold: float | torch.Tensor | None = None,
    min_vertical: int | torch.Tensor = 0,
    min_slash: int | torch.Tensor = 0,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
):
    """Naive vertical-slash index from the last ``last_q`` queries of each row (and
    ``extra_rows`` earlier ones).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (``Nq = N`` but for query rows).
        vertical, slash: column / offset budgets (forced ones included), per global head.
        last_q: sampled query rows per batch row (the last ones).
        extra_rows: further sampled rows spread evenly over the earlier part of each row.
        sink_columns, local_diagonals: forced leading columns / offsets, per global head.
        aggregation: ``"sum"`` or ``"max"`` over the sampled rows.
        rule, threshold: budget rule of columns and diagonals (a name and a float, or per global
            head rule codes and thresholds); ``vertical`` / ``slash`` are the maxima.
        min_vertical, min_slash: the adaptive rules' minima, per global head.
        q_seqlens, q_seqstarts: query rows (docs/kernels.md; the module docstring says what is
            sampled then); default: every key row is its own query row.

    Returns:
        ``(vertical_idx [B, Hg, NV], slash_idx [B, Hg, NS])`` int32 on q's device, -1 padded;
        with ``return_scores`` also ``(col [B, Hg, N], diag [B, Hg, N])`` float64 (0 outside
        the row).
    """
    B, Hq, Hkv, _, N, D = check_qkv_rows(q, k, k)
    check_row_sampling(last_q, extra_rows, aggregation)
    scale = default_scale(D, scale)
    ids = head_ids(heads, Hq)
    nv = per_head_budget("vertical", vertical, ids, head_offset, 0)
    ns = per_head_budget("slash", slash, ids, head_offset, 1)
    sinks = per_head_budget("sink_columns", sink_columns, ids, head_offset, 0)
    locs = per_head_budget("local_diagonals", local_diagonals, ids, head_offset, 0)
    rules, thresholds = _per_head_rule(rule, threshold, ids, head_offset)
    min_v = per_head_budget("min_vertical", min_vertical, ids, head_offset, 0)
    min_s = per_head_budget("min_slash", min_slash, ids, head_offset, 0)
    width_v = min(max(nv, default=0), N)
    width_s = min(max(ns, default=0), N)
    group = Hq // Hkv
    col = torch.zeros(B, len(ids), N, dtype=torch.float64, device=q.device)
    diag = torch.zeros(B, len(ids), N, dtype=torch.float64, device=q.device)
    v_rows: list[list[int]] = [[] for _ in range(B * len(ids))]
    s_rows: list[list[int]] = [[] for _ in range(B * len(ids))]
    for b, s, n, q_lo, q_row0 in _rows(q, k, seqlens, seqstarts, q_seqlens, q_seqstarts):
        if n == 0:
            continue
        sampled = torch.tensor(_sampled_rows(n, last_q, extra_rows, q_lo), dtype=torch.long, device=q.device)
        for g, h in enumerate(ids):
            if sampled.numel():  # a row without queries samples nothing: zero scores
                qs = q[b, h, q_row0 + sampled].double()  # [R, D]
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
            rule_g = dict(rule=rules[g], threshold=thresholds[g])
            v_rows[b * len(ids) + g] = select_row(col[b, g, :n], range(min(sinks[g], nv[g])), nv[g],
                                                  minimum=min_v[g], **rule_g)
            s_rows[b * len(ids) + g] = select_row(diag[b, g, :n], range(min(max(locs[g], 1), ns[g])), ns[g],
                                                  minimum=min_s[g], **rule_g)
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
    rule: str | torch.Tensor = "top_k",
    threshold: float | torch.Tensor | None = None,
    min_blocks: int | torch.Tensor = 0,
    estimate: str = "pooled",
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    score_rows: int = 0,
):
    """Naive block-sparse routing by mean-pooled queries and keys (``estimate="pooled"``) or by
    :func:`query_block_scores` (``"query"``: those scores are the selection weights).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (``Nq = N`` but for query rows).
        top_k: key blocks per query block (forced ones included), per global head.
        block: block size for queries and keys.
        sink_blocks: forced leading key blocks, per global head.
        force_diagonal: always keep the query block's own block.
        rule, threshold: budget rule per query block (as for :func:`vertical_slash_index`);
            ``top_k`` is the maximum.
        min_blocks: the adaptive rules' minimum, per global head.
        q_seqlens, q_seqstarts: query rows (docs/kernels.md): only the query blocks holding a
            query are routed, by their query positions (module docstring).
        score_rows: the queries that score a block (``estimate="query"`` only; 0: all of them).

    Returns:
        ``blocks [B, Hg, NQB, K]`` int32 on q's device, -1 padded; with ``return_scores`` also
        ``scores [B, Hg, NQB, NQB]`` float64 (``-inf`` above the diagonal and outside the row).
    """
    B, Hq, Hkv, _, N, D = check_qkv_rows(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not isinstance(force_diagonal, bool):
        raise TypeError("force_diagonal must be a bool")
    scale = default_scale(D, scale)
    ids = head_ids(heads, Hq)
    tops = per_head_budget("top_k", top_k, ids, head_offset, 1)
    sinks = per_head_budget("sink_blocks", sink_blocks, ids, head_offset, 0)
    rules, thresholds = _per_head_rule(rule, threshold, ids, head_offset)
    mins = per_head_budget("min_blocks", min_blocks, ids, head_offset, 0)
    nqb = math.ceil(N / block)
    width = min(max(tops, default=0), nqb)
    group = Hq // Hkv
    if estimate not in ("pooled", "query"):
        raise ValueError(f"estimate must be 'pooled' or 'query', got {estimate!r}")
    check_score_rows("score_rows", score_rows, estimate)
    query = query_block_scores(q, k, block=block, scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=heads,
                               q_seqlens=q_seqlens, q_seqstarts=q_seqstarts,
                               score_rows=score_rows) if estimate == "query" else None
    scores = torch.full((B, len(ids), nqb, nqb), float("-inf"), dtype=torch.float64, device=q.device)
    out = torch.full((B, len(ids), nqb, width), -1, dtype=torch.int32)
    for b, s, n, q_lo, q_row0 in _rows(q, k, seqlens, seqstarts, q_seqlens, q_seqstarts):
        nb = math.ceil(n / block)
        first = q_lo // block if q_lo < n else nb  # the query blocks: first .. nb - 1
        for g, h in enumerate(ids):
            # pooled queries: the mean over each query block's query positions (all its valid
            # tokens for the ordinary call)
            qm = {I: q[b, h, q_row0 + max(I * block, q_lo) : q_row0 + min((I + 1) * block, n)].double().mean(0)
                  for I in range(first, nb)}
            km = torch.stack([k[b, h // group, s + J * block : s + min((J + 1) * block, n)].double().mean(0)
                              for J in range(nb)]) if nb else None
            n_sink = min(sinks[g], tops[g] - int(force_diagonal))
            for I in range(first, nb):
                sc = query[b, g, I, : I + 1] if query is not None else (km[: I + 1] @ qm[I]) * scale  # [I + 1]
                scores[b, g, I, : I + 1] = sc
                forced = {J for J in range(min(n_sink, I + 1))}
                if force_diagonal:
                    forced.add(I)
                chosen = select_row(sc, forced, tops[g], rule=rules[g], threshold=thresholds[g], minimum=mins[g],
                                    logits=query is None)
                out[b, g, I, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    out = out.to(q.device)
    return (out, scores) if return_scores else out


def query_block_scores(q: torch.Tensor, k: torch.Tensor, *, block: int, scale: float | None = None,
                       seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
                       heads: torch.Tensor | None = None, q_seqlens: int | torch.Tensor | None = None,
                       q_seqstarts: torch.Tensor | None = None, score_rows: int = 0) -> torch.Tensor:
    """Naive query-aware block scores (see the module docstring), every query row softmaxed on
    its own, in float64.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (GQA: head ``h`` reads ``h // (Hq // Hkv)``;
            ``Nq = N`` but for query rows).
        block: block size for queries and keys.
        heads: local query heads to compute (``Hg`` of them); default all.
        q_seqlens, q_seqstarts: query rows (docs/kernels.md): only query blocks holding a query
            are scored, maxed over their query positions.
        score_rows: the queries of a block that score it (module docstring); 0: all of them.

    Returns:
        ``scores [B, Hg, NQB, NQB]`` float64, ``NQB = ceil(N / block)``: in ``(0, 1]`` for
        ``J <= I`` inside the row (with query rows: ``I`` a query block), ``-inf`` elsewhere.
    """
    B, Hq, Hkv, _, N, D = check_qkv_rows(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    check_int("score_rows", score_rows, 0)
    scale = default_scale(D, scale)
    ids = head_ids(heads, Hq)
    nqb = math.ceil(N / block)
    group = Hq // Hkv
    scores = torch.full((B, len(ids), nqb, nqb), float("-inf"), dtype=torch.float64, device=q.device)
    for b, s, n, q_lo, q_row0 in _rows(q, k, seqlens, seqstarts, q_seqlens, q_seqstarts):
        nb = math.ceil(n / block)
        first = q_lo // block if q_lo < n else nb  # the query blocks: first .. nb - 1
        for g, h in enumerate(ids):
            ks = k[b, h // group, s : s + n].double()  # [n, D]
            km = torch.stack([ks[J * block : (J + 1) * block].mean(0) for J in range(nb)]) if nb else None
            for I in range(first, nb):
                # the block's query positions max(I * block, q_lo) .. min((I + 1) * block, n) - 1, those
                # of score_rows
                pos = scoring_positions(max(I * block, q_lo), min((I + 1) * block, n), block, score_rows)
                qs = q[b, h, [q_row0 + p for p in pos]].double()  # [rows, D]
                probs = torch.softmax((qs @ km[: I + 1].T) * scale, dim=-1)  # [rows, I + 1]
                scores[b, g, I, : I + 1] = probs.amax(0)
    return scores
