"""Vertical-slash index estimation on the device: column and diagonal scores of the sampled rows
(two Triton passes per row set), then the selection (:mod:`minference.kernels.select`).

Same semantics as the naive twin :func:`minference.reference.estimators.vertical_slash_index`
(read its module docstring for the exact selection and budget rules); validation, budgets and
the torch selection are shared with the PyTorch builders (:mod:`minference.builders`), only the
scores (and the one-launch top-k of heads that all keep ``top_k``) are computed here. Nothing
synchronises with the host when the per-head budgets are device tensors (or ints) and the
output widths are given, so a whole prefill that uses these builders can be captured in a
CUDA graph.

The estimation never materialises the ``r x N`` probability matrix beyond one tile.
One program owns the sampled rows of one chunk against ``KT`` consecutive keys: one
``[RC, D] x [D, KT]`` product gives every logit the tile owns (each (row, key) pair is owned by
exactly one tile, and every pair of the product is owned unless past the row or not causal).
Pass 1 reduces each tile to its log-sum-exp per row, a small reduction over the tiles gives
the row's, and pass 2 recomputes the logits, normalises them and reduces
them into column scores (over the chunk's rows, one atomic per key) and diagonal scores. For
the last rows (consecutive positions ``i0 + r``) a register gather rolls row ``r`` left by
``r``, so column ``t`` of the rolled tile holds offset ``i0 - j0 - t`` on the rows that did
not wrap and offset ``i0 - j0 - t + KT`` on those that did: two masked column reductions,
two atomics per offset (add for ``sum``, max for ``max``).

Extra sampled rows (``extra_rows > 0``) are far apart and share no offsets inside a tile: the
same two passes run a second time (``SPREAD``) with row positions read from a ``[B, E]``
tensor (computed on the device, :func:`minference.builders.extra_row_positions`); their diagonal
scores take one atomic per owned (row, key) pair. With ``extra_rows = 0`` nothing of this is
launched.

Query rows (``q_seqlens``, ``q_seqstarts``: ``q [B, Hq, Nq, D]`` holds each row's last tokens;
docs/kernels.md) reach every kernel as two more pointers, the query rows' counts and starts
(the key rows' own lengths and starts for the ordinary call, which therefore computes exactly
what it did): the passes read position ``i``'s query at q's row ``q_starts - q_lo + i`` and
sample no position before ``q_lo``, over a grid of ``min(last_q, bound)`` rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from minference.kernels._common import MIN_DOT, next_pow2
from minference.kernels.select import select_vertical_slash_triton

from minference.builders import build_vertical_slash_index
from minference.patterns import DEFAULT_LAST_Q

__all__ = ["vertical_slash_index"]

#: Keys per program of the vertical-slash estimator (at least its row chunk). 64: the fastest whole
#: index build of 64 / 128 / 256 at 128K and 1M, and faster than the earlier offset-tiled design
#: (see docs/tuning.md#vs-key-tile).
VS_KEY_TILE = 64
#: Sampled query rows per program of the vertical-slash estimator (at most VS_KEY_TILE).
VS_ROW_CHUNK = 64
#: Warps per program of the vertical-slash estimator passes (4: faster than 2 or 8 with 64 keys;
#: see docs/tuning.md#vs-warps).
VS_WARPS = 4
#: Tile statistics per loop step of the row log-sum-exp (:func:`_lse_kernel`).
LSE_CHUNK = 1024


@triton.jit
def _vs_logits(q_ptr, k_ptr, pos_ptr, b, h, kvh, pid_c, pid_t, n, start, q_lo, q_row0, last_q, scale, R_TOTAL,
               sqb, sqh, sqn, sqd, skb, skh, skn, skd, D,
               RC: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, SPREAD: tl.constexpr):
    """Logits ``[RC, KT]`` of the sampled rows of chunk ``pid_c`` against the keys
    ``[pid_t KT, (pid_t + 1) KT)`` (``-inf`` where the pair is not owned: row not sampled, key
    past the row, not causal), the ownership mask, and the row ``[RC]`` and key ``[KT]``
    positions. Rows: the last ones ``n - R_TOTAL + pid_c RC + r`` from ``max(n - last_q, q_lo)``
    on (``SPREAD`` False), or read from ``pos_ptr [B, R_TOTAL]`` (-1 = none). Position ``i``'s
    query is q's row ``q_row0 + i`` (``q_lo = 0``, ``q_row0 = start`` for the ordinary call)."""
    r = tl.arange(0, RC)
    c = tl.arange(0, KT)
    d = tl.arange(0, BLOCK_D)
    if SPREAD:
        i = tl.load(pos_ptr + b.to(tl.int64) * R_TOTAL + pid_c * RC + r)  # [RC] logical query positions
        row_ok = i >= 0
    else:
        i = n - R_TOTAL + pid_c * RC + r
        row_ok = (i >= tl.maximum(n - last_q, q_lo)) & (i < n)
    j = pid_t * KT + c  # [KT] logical key positions
    key_ok = j < n
    own = row_ok[:, None] & key_ok[None, :] & (i[:, None] >= j[None, :])
    q_off = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + (q_row0 + i).to(tl.int64)[:, None] * sqn + d[None, :] * sqd
    qt = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    k_off = b.to(tl.int64) * skb + kvh.to(tl.int64) * skh + (start + j).to(tl.int64)[:, None] * skn + d[None, :] * skd
    kt = tl.load(k_ptr + k_off, mask=key_ok[:, None] & (d[None, :] < D), other=0.0)
    s = tl.dot(qt, tl.trans(kt)) * scale  # [RC, KT] fp32
    return tl.where(own, s, float("-inf")), own, i, j


@triton.jit
def _vs_tile_empty(pid_t, pid_c, n, last_q, R_TOTAL, RC: tl.constexpr, KT: tl.constexpr, SPREAD: tl.constexpr):
    """Whether key tile ``pid_t`` lies wholly after every row of the chunk (the last rows of
    chunk ``pid_c``; for extra rows, all before ``n - min(last_q, n)``, that bound)."""
    if SPREAD:
        last = n - tl.minimum(last_q, n) - 1
    else:
        last = tl.minimum(n - R_TOTAL + (pid_c + 1) * RC, n) - 1
    return pid_t * KT > last


@triton.jit(do_not_specialize=["T"])  # key tiles: ceil(N / KT)
def _vs_stats_kernel(q_ptr, k_ptr, pos_ptr, heads_ptr, lens_ptr, starts_ptr, qlens_ptr, qstarts_ptr, stat_ptr,
                     Hg, group, last_q, scale, R_TOTAL, T,
                     sqb, sqh, sqn, sqd, skb, skh, skn, skd, D,
                     RC: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, SPREAD: tl.constexpr):
    """Each tile's log-sum-exp of its owned logits per row (``-inf`` where it owns none), written
    for every (row, tile) of the grid, so the buffer needs no fill. ``qlens_ptr``,
    ``qstarts_ptr``: the query rows' counts and starts (the key rows' own for the ordinary call)."""
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_t = tl.program_id(2)
    b = pid_bh // Hg
    h = tl.load(heads_ptr + pid_bh % Hg)
    n = tl.load(lens_ptr + b)
    start = tl.load(starts_ptr + b)
    rows = pid_c * RC + tl.arange(0, RC)
    off = (pid_bh.to(tl.int64) * R_TOTAL + rows) * T + pid_t
    if _vs_tile_empty(pid_t, pid_c, n, last_q, R_TOTAL, RC, KT, SPREAD):
        tl.store(stat_ptr + off, tl.full([RC], float("-inf"), tl.float32))
    else:
        q_lo = n - tl.load(qlens_ptr + b)
        q_row0 = tl.load(qstarts_ptr + b) - q_lo
        s, own, _, _ = _vs_logits(q_ptr, k_ptr, pos_ptr, b, h, h // group, pid_c, pid_t, n, start, q_lo, q_row0,
                                  last_q, scale, R_TOTAL, sqb, sqh, sqn, sqd, skb, skh, skn, skd, D, RC, KT, BLOCK_D,
                                  SPREAD)
        m = tl.max(s, axis=1)  # [RC]
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.where(own, tl.exp(s - m_safe[:, None]), 0.0), axis=1)
        tl.store(stat_ptr + off, tl.where(l > 0.0, m_safe + tl.log(l), float("-inf")))


@triton.jit(do_not_specialize=["T"])
def _lse_kernel(stat_ptr, lse_ptr, T, CHUNK: tl.constexpr):
    """One program per sampled row: the log-sum-exp of its ``T`` tile statistics (``-inf`` when
    all are), a running max and rescaled sum over chunks of ``CHUNK``. One launch where
    ``torch.logsumexp`` costs several on the host."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for t0 in range(0, T, CHUNK):
        x = tl.load(stat_ptr + row * T + t0 + offs, mask=t0 + offs < T, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_use) + tl.sum(tl.exp(x - m_use), 0)
        m = m_new
    tl.store(lse_ptr + row, tl.where(total > 0.0, m + tl.log(total), float("-inf")))


# diag_ptr: the second half of one [2, B, Hg, N] fill, at B*Hg*N floats (alignment follows N)
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["diag_ptr"])
def _vs_scores_kernel(q_ptr, k_ptr, pos_ptr, heads_ptr, lens_ptr, starts_ptr, qlens_ptr, qstarts_ptr, lse_ptr,
                      col_ptr, diag_ptr, Hg, group, last_q, scale, R_TOTAL, N,
                      sqb, sqh, sqn, sqd, skb, skh, skn, skd, D,
                      RC: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, USE_MAX: tl.constexpr,
                      SPREAD: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_t = tl.program_id(2)
    b = pid_bh // Hg
    h = tl.load(heads_ptr + pid_bh % Hg)
    n = tl.load(lens_ptr + b)
    start = tl.load(starts_ptr + b)
    if _vs_tile_empty(pid_t, pid_c, n, last_q, R_TOTAL, RC, KT, SPREAD):
        return
    q_lo = n - tl.load(qlens_ptr + b)
    q_row0 = tl.load(qstarts_ptr + b) - q_lo
    s, own, i, j = _vs_logits(q_ptr, k_ptr, pos_ptr, b, h, h // group, pid_c, pid_t, n, start, q_lo, q_row0, last_q,
                              scale, R_TOTAL, sqb, sqh, sqn, sqd, skb, skh, skn, skd, D, RC, KT, BLOCK_D, SPREAD)
    r = tl.arange(0, RC)
    lse = tl.load(lse_ptr + pid_bh.to(tl.int64) * R_TOTAL + pid_c * RC + r)  # [RC]
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    p = tl.where(own, tl.exp(s - lse_safe[:, None]), 0.0)  # [RC, KT]
    key_ok = j < n
    col_base = col_ptr + pid_bh.to(tl.int64) * N
    diag_base = diag_ptr + pid_bh.to(tl.int64) * N
    if USE_MAX:
        tl.atomic_max(col_base + j, tl.max(p, axis=0), mask=key_ok)
    else:
        tl.atomic_add(col_base + j, tl.sum(p, axis=0), mask=key_ok)
    if SPREAD:
        # Far-apart rows share no offsets inside a tile: one atomic per owned (row, key) pair.
        delta = i[:, None] - j[None, :]
        if USE_MAX:
            tl.atomic_max(diag_base + delta, p, mask=own)
        else:
            tl.atomic_add(diag_base + delta, p, mask=own)
    else:
        # rolled[r, t] = p[r, (r + t) mod KT]: key j0 + r + t (offset d0 - t) when r + t < KT,
        # else key j0 + r + t - KT (offset d0 - t + KT), with d0 = i0 - j0
        t = tl.arange(0, KT)
        wrapped = (r[:, None] + t[None, :]) >= KT
        rolled = tl.gather(p, (r[:, None] + t[None, :]) & (KT - 1), axis=1)  # [RC, KT]
        d0 = n - R_TOTAL + pid_c * RC - pid_t * KT
        da = d0 - t  # [KT] offsets of the unwrapped entries
        db = da + KT  # [KT] offsets of the wrapped ones
        if USE_MAX:
            tl.atomic_max(diag_base + da, tl.max(tl.where(wrapped, 0.0, rolled), axis=0), mask=(da >= 0) & (da < n))
            tl.atomic_max(diag_base + db, tl.max(tl.where(wrapped, rolled, 0.0), axis=0), mask=(db >= 0) & (db < n))
        else:
            tl.atomic_add(diag_base + da, tl.sum(tl.where(wrapped, 0.0, rolled), axis=0), mask=(da >= 0) & (da < n))
            tl.atomic_add(diag_base + db, tl.sum(tl.where(wrapped, rolled, 0.0), axis=0), mask=(db >= 0) & (db < n))


def _vs_passes(q, k, hs, lens, starts, pos, last_q: int, scale: float, use_max: bool, col, diag,
               n_rows: int, spread: bool, q_lens, q_starts):
    """Both passes over one row set (the last rows, or the extra rows ``pos``), reducing into
    ``col`` and ``diag``: 3 launches (statistics, their reduction, scores). ``q_lens``,
    ``q_starts``: the query rows (``lens``, ``starts`` for the ordinary call)."""
    B, Hq, Hkv, N, D = q.shape[0], q.shape[1], k.shape[1], k.shape[2], q.shape[3]
    Hg = hs.shape[0]
    rc = max(MIN_DOT, min(VS_ROW_CHUNK, next_pow2(n_rows)))
    kt = max(VS_KEY_TILE, rc)  # the roll needs every row's shift below the tile width
    n_chunks = math.ceil(n_rows / rc)
    r_total = rc * n_chunks
    n_tiles = max(1, math.ceil(N / kt))
    block_d = max(MIN_DOT, next_pow2(D))
    if spread:
        pos = torch.nn.functional.pad(pos.to(torch.int32), (0, r_total - pos.shape[1]), value=-1).contiguous()
    else:
        pos = lens  # unread
    stat = torch.empty((B * Hg, r_total, n_tiles), dtype=torch.float32, device=q.device)
    grid = (B * Hg, n_chunks, n_tiles)
    common = (*q.stride(), *k.stride(), D)
    meta = dict(RC=rc, KT=kt, BLOCK_D=block_d, SPREAD=spread, num_warps=VS_WARPS)
    _vs_stats_kernel[grid](q, k, pos, hs, lens, starts, q_lens, q_starts, stat, Hg, Hq // Hkv, last_q, scale, r_total,
                           n_tiles, *common, **meta)
    lse = torch.empty((B * Hg, r_total), dtype=torch.float32, device=q.device)
    _lse_kernel[(B * Hg * r_total,)](stat, lse, n_tiles, CHUNK=LSE_CHUNK, num_warps=4)
    _vs_scores_kernel[grid](q, k, pos, hs, lens, starts, q_lens, q_starts, lse, col, diag, Hg, Hq // Hkv, last_q, scale,
                            r_total, N, *common, USE_MAX=use_max, **meta)


def _vs_scores_triton(q, k, hs, lens, starts, last_q: int, rows: torch.Tensor | None, scale: float,
                      aggregation: str, qrows=None):
    """Column and diagonal scores ``[B, Hg, N]`` float32 by the two Triton passes over the last
    rows, and two more over the extra rows ``rows [B, E]`` (-1 = none) when given. Query rows
    ``qrows`` (:class:`minference.index.QueryRows`): the kernels read each sampled position's
    query at its q row and sample no position before the row's first query; the last-rows grid
    covers ``min(last_q, qrows.bound)`` rows."""
    B, Hg, N = q.shape[0], hs.shape[0], k.shape[2]
    col, diag = torch.zeros(2, B, Hg, N, dtype=torch.float32, device=q.device).unbind(0)  # one fill
    if B * Hg > 0 and N > 0:
        use_max = aggregation == "max"
        q_lens, q_starts = (lens, starts) if qrows is None else (qrows.lens, qrows.starts)
        n_last = last_q if qrows is None else min(last_q, qrows.bound)
        if n_last > 0:
            _vs_passes(q, k, hs, lens, starts, None, last_q, scale, use_max, col, diag, n_last, False, q_lens, q_starts)
        if rows is not None and rows.shape[1] > 0:
            _vs_passes(q, k, hs, lens, starts, rows, last_q, scale, use_max, col, diag, rows.shape[1], True, q_lens,
                       q_starts)
    return col, diag


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
    vertical_width: int | None = None,
    slash_width: int | None = None,
    validate: bool = True,
    resolved: tuple | None = None,
    rule: str | torch.Tensor = "top_k",
    threshold: float | torch.Tensor | None = None,
    min_vertical: int | torch.Tensor = 0,
    min_slash: int | torch.Tensor = 0,
    resolved_rules: tuple | None = None,
    q_seqlens=None,
    q_seqstarts: torch.Tensor | None = None,
    checked: bool = False,
):
    """Vertical-slash index from the last ``last_q`` queries of each row and ``extra_rows`` earlier
    ones (two Triton passes per row set).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (GQA: head ``h`` reads ``h // (Hq // Hkv)``);
            ``Nq < N`` with query rows.
        vertical, slash: column / offset budgets (forced included): ints, or 1-D int tensors
            indexed by global head ``head_offset + h`` (keep them on q's device for no sync).
        last_q: sampled query rows per batch row (the last ones; fewer when a row is shorter).
        extra_rows: further sampled rows spread evenly over the earlier part of each row (0: none,
            and no extra launch).
        sink_columns, local_diagonals: forced leading columns / offsets (``δ = 0`` always).
        aggregation: ``"sum"`` or ``"max"`` over the sampled rows.
        heads: local query heads to compute (``Hg`` of them); default all.
        vertical_width, slash_width: output widths ``NV``, ``NS`` (default: the largest budget,
            which reads a budget tensor on the host).
        validate: check ``seqlens``/``seqstarts`` values (a host sync; skipped under capture).
        resolved: the per computed head budgets made ahead
            (:func:`minference.index.vertical_slash_budgets` of these budgets and heads; the
            dispatcher keeps them per plan), so no tensor op resolves budgets in the call.
        rule, threshold: budget rule of the columns and the diagonals (``"top_k"``, ``"mass"``
            with γ, ``"relative"`` with α; definitions in
            :mod:`minference.reference.estimators`): a name and a float, or per global head a
            1-D int tensor of :data:`minference.index.RULE_CODES` and a 1-D float tensor.
            ``vertical`` / ``slash`` are then the maxima. ``"top_k"`` only keeps the one-launch
            selection kernel; otherwise the shared torch selection runs.
        min_vertical, min_slash: fewest columns / offsets of the adaptive rules (per global head).
        resolved_rules: :func:`minference.index.vertical_slash_rules` of the rule arguments,
            made ahead (the dispatcher keeps them per plan).
        q_seqlens, q_seqstarts: query rows (docs/kernels.md, as the attention kernels take them:
            a chunk after a cache, or a row's last tokens): only query positions are sampled (the
            last ``min(last_q, q_lens)`` and the extra rows among the earlier queries), each read
            at its q row; columns and offsets stay in the key rows' positions.
        checked: internal: the caller validated the arguments' form at its own edge (the
            dispatcher, through :mod:`minference.backend_triton`: q and k, int32 ``heads``, the
            plan's ``resolved`` budgets and rules), so those checks are skipped. Default ``False``.

    Returns:
        ``(vertical_idx [B, Hg, NV], slash_idx [B, Hg, NS])`` int32, -1 padded, in no
        particular order (a set); with ``return_scores`` also the float32
        scores ``(col [B, Hg, N], diag [B, Hg, N])`` (0 outside the row).
    """
    return build_vertical_slash_index(
        _vs_scores_triton, q, k, vertical, slash, last_q=last_q, extra_rows=extra_rows, sink_columns=sink_columns,
        local_diagonals=local_diagonals, aggregation=aggregation, scale=scale, seqlens=seqlens,
        seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=return_scores,
        vertical_width=vertical_width, slash_width=slash_width, validate=validate,
        selector=select_vertical_slash_triton, resolved=resolved, rule=rule, threshold=threshold,
        min_vertical=min_vertical, min_slash=min_slash, resolved_rules=resolved_rules,
        q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, checked=checked)
