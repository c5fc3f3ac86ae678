"""Online index builders: vertical-slash estimation and block-sparse routing on the device.

Same semantics as the naive twins in :mod:`minference.reference.estimators` (read their module
docstring for the exact selection and budget rules); validation, budgets and the selection
(:func:`minference.index.select_top`) are shared with the PyTorch builders
(:mod:`minference.index`), only the scores (and the one-launch top-k of vertical-slash
heads that all keep ``top_k``) are computed here. Nothing
synchronises with the host when the per-head budgets are device tensors (or ints) and the
output widths are given, so a whole prefill that uses these builders can be captured in a
CUDA graph.

Vertical-slash estimation never materialises the ``r x N`` probability matrix beyond one tile.
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
tensor (computed on the device, :func:`minference.index.extra_row_positions`); their diagonal
scores take one atomic per owned (row, key) pair. With ``extra_rows = 0`` nothing of this is
launched.

Query-aware block scores (:func:`query_block_scores`) score every query, not the block's mean
query, against the block-mean keys: one program owns one query block's rows and walks the key
means ``J <= I`` in tiles of ``KT``, twice (log-sum-exp per row, then normalised probabilities
reduced by a max over the rows into one ``[KT]`` slice of ``score[I, :]``). It writes its whole
score row (``-inf`` past ``I``), so the output needs no fill, and reads no atomics.

Query rows (``q_seqlens``, ``q_seqstarts``: ``q [B, Hq, Nq, D]`` holds each row's last tokens;
docs/kernels.md) reach every kernel as two more pointers, the query rows' counts and starts
(the key rows' own lengths and starts for the ordinary call, which therefore computes exactly
what it did): the vertical-slash passes read position ``i``'s query at q's row ``q_starts -
q_lo + i`` and sample no position before ``q_lo``, over a grid of ``min(last_q, bound)`` rows;
the block kernels run one program per *slot* (query block ``q_lo // block + s``,
:meth:`minference.index.QueryRows.slots`), not per query block of the row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from minference.kernels._common import next_pow2

from minference._checks import check_qkv_rows, check_ragged, default_scale
from minference.index import (
    blocks_from_slots,
    build_block_sparse_index,
    build_vertical_slash_index,
    heads_tensor,
    scorer_rows,
    select_vertical_slash,
)
from minference.patterns import DEFAULT_BLOCK_SIZE, DEFAULT_LAST_Q

__all__ = ["vertical_slash_index", "block_sparse_index", "pool_blocks", "query_block_scores", "select_query_blocks"]

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
#: Smallest tile side ``tl.dot`` accepts.
_MIN_DOT = 16
#: Tokens pooled per loop step of the block pooling kernel.
POOL_TOKEN_TILE = 64


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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
def _pool_kernel(x_ptr, heads_ptr, lens_ptr, qlens_ptr, qstarts_ptr, out_ptr, Hs, NS, block,
                 sxb, sxh, sxn, sxd, D,
                 TT: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch row, head, slot): the mean of the slot's block over the positions
    ``q_lo .. n - 1`` (``q_lo = n - qlens[b]``), read at rows ``qstarts[b] - q_lo + p``; slot ``s``
    is block ``q_lo // block + s``. The ordinary call (``qlens = lens``, ``qstarts = starts``):
    every block of the row, slot = block."""
    pid_bh = tl.program_id(0)
    slot = tl.program_id(1)
    b = pid_bh // Hs
    h = tl.load(heads_ptr + pid_bh % Hs)
    n = tl.load(lens_ptr + b)
    q_lo = n - tl.load(qlens_ptr + b)
    row0 = tl.load(qstarts_ptr + b) - q_lo
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, TT)
    I = q_lo // block + slot
    lo = tl.maximum(I * block, q_lo)
    hi = tl.minimum(I * block + block, n)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    for t0 in range(0, block, TT):
        pos = lo + t0 + t
        ok = pos < hi
        x = tl.load(base + (row0 + pos).to(tl.int64)[:, None] * sxn + d[None, :] * sxd,
                    mask=ok[:, None] & (d[None, :] < D), other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    count = tl.maximum(hi - lo, 1).to(tl.float32)
    tl.store(out_ptr + (pid_bh.to(tl.int64) * NS + slot) * D + d, acc / count, mask=d < D)


def _vs_passes(q, k, hs, lens, starts, pos, last_q: int, scale: float, use_max: bool, col, diag,
               n_rows: int, spread: bool, q_lens, q_starts):
    """Both passes over one row set (the last rows, or the extra rows ``pos``), reducing into
    ``col`` and ``diag``: 3 launches (statistics, their reduction, scores). ``q_lens``,
    ``q_starts``: the query rows (``lens``, ``starts`` for the ordinary call)."""
    B, Hq, Hkv, N, D = q.shape[0], q.shape[1], k.shape[1], k.shape[2], q.shape[3]
    Hg = hs.shape[0]
    rc = max(_MIN_DOT, min(VS_ROW_CHUNK, next_pow2(n_rows)))
    kt = max(VS_KEY_TILE, rc)  # the roll needs every row's shift below the tile width
    n_chunks = math.ceil(n_rows / rc)
    r_total = rc * n_chunks
    n_tiles = max(1, math.ceil(N / kt))
    block_d = max(_MIN_DOT, next_pow2(D))
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


#: Scores per loop step of the selection kernel (:func:`_select_kernel`).
SELECT_CHUNK = 4096
#: Warps of the selection kernel.
SELECT_WARPS = 8
#: Longest row the selection kernel takes; longer rows keep ``torch.topk``
#: (:func:`minference.index.select_vertical_slash`). One program walks a whole row five times,
#: which is latency-bound on long rows: the kernel beats topk up to 32K and loses from 64K (see
#: docs/tuning.md#select-max-n).
SELECT_MAX_N = 32768


@triton.jit
def _order_bits(x):
    """fp32 (no NaN) -> int64 in ``[0, 2**32)`` whose order is the float order."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order = float order
    return key.to(tl.int64) + 2147483648


@triton.jit
def _select_scores(scores, forced, pos, n):
    """A chunk of one row's scores: -inf past the row's length and for unforced non-finite
    scores (a candidate without a score), +inf where forced (NaN included)."""
    x = tl.load(scores + pos, mask=pos < n, other=float("-inf"))
    keep = (pos < forced) & (x != float("-inf"))  # NaN too: a forced position is kept whatever its score
    x = tl.where(tl.abs(x) < float("inf"), x, float("-inf"))  # only finite scores rank
    return tl.where(keep, float("inf"), x)


@triton.jit
def _select_keys(ptr, pos, lim, forced_arg, FORCE_DIAG: tl.constexpr, BLOCKS: tl.constexpr):
    """A chunk's radix keys and what may be chosen: a vertical-slash row (:func:`_select_scores`:
    length ``lim``, forced prefix ``forced_arg``) or a query block's row of block scores
    (:func:`_block_candidates`: diagonal ``lim``, sinks ``forced_arg``); forced entries key as
    ``+inf``."""
    if BLOCKS:
        x, valid, forced = _block_candidates(ptr, pos, lim, forced_arg, FORCE_DIAG)
        x = tl.where(forced, float("inf"), x)
    else:
        x = _select_scores(ptr, forced_arg, pos, lim)
        valid = x > float("-inf")
    return _order_bits(x), valid


@triton.jit
def _radix_take(ptr, end, lim, forced_arg, need, out, width, FORCE_DIAG: tl.constexpr, BLOCKS: tl.constexpr,
                CHUNK: tl.constexpr):
    """Write the ``need`` largest keys (:func:`_select_keys`) of positions ``[0, end)`` to
    ``out[:width]`` as ascending positions, -1 after, ties to the lowest position.

    A radix select on the scores' order bits: four passes of 8-bit histograms narrow the
    ``need``-th largest key ``T`` and how many entries equal to ``T`` to take; a last pass writes
    every entry above ``T`` and the first ties in position order. Fewer selectable entries than
    ``need``: all of them."""
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, 512)
    prefix = tl.zeros([], tl.int64)  # the digits of T chosen so far
    for p in tl.static_range(4):
        hist = tl.zeros([512], tl.int32)
        for c0 in range(0, end, CHUNK):
            u, ok = _select_keys(ptr, c0 + offs, lim, forced_arg, FORCE_DIAG, BLOCKS)
            if p > 0:
                ok = ok & ((u >> (32 - 8 * p)) == prefix)
            hist += tl.histogram(tl.where(ok, (u >> (24 - 8 * p)) & 255, 256).to(tl.int32), 512)
        hist = tl.where(bins < 256, hist, 0)
        if p == 0:  # fewer valid entries than the budget: take them all
            need = tl.minimum(need, tl.sum(hist, 0))
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [bin]: entries with digit >= bin
        digit = tl.max(tl.where((at_least >= need) & (bins < 256), bins, -1), 0)  # 255 when need == 0
        need -= tl.sum(tl.where(bins == digit, at_least - hist, 0), 0)  # minus those above the digit
        prefix = prefix * 256 + digit
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c0 in range(0, end, CHUNK):
        pos = c0 + offs
        u, ok = _select_keys(ptr, pos, lim, forced_arg, FORCE_DIAG, BLOCKS)
        eq = ok & (u == prefix)
        sel = (ok & (u > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= need))
        tl.store(out + taken + tl.cumsum(sel.to(tl.int32), 0) - 1, pos, mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)
    for c0 in range(taken, width, CHUNK):
        tl.store(out + c0 + offs, tl.full([CHUNK], -1, tl.int32), mask=c0 + offs < width)


@triton.jit
def _select_kernel(col_ptr, diag_ptr, lens_ptr, sinks_ptr, locs_ptr, nv_ptr, ns_ptr, vout_ptr, sout_ptr,
                   N, Hg, BHg, width_v, width_s, CHUNK: tl.constexpr):
    """One program per (kind, batch row, head): the ``min(budget, width)`` highest scores of one
    row (forced ones first, never -inf), written as ascending positions, -1 after, by the radix
    select of :func:`_radix_take`."""
    r = tl.program_id(0)
    if r < BHg:  # columns
        g = r % Hg
        scores = col_ptr + r.to(tl.int64) * N
        out = vout_ptr + r.to(tl.int64) * width_v
        forced = tl.load(sinks_ptr + g).to(tl.int32)
        need = tl.minimum(tl.load(nv_ptr + g), width_v).to(tl.int32)
        width = width_v
    else:  # diagonals
        g = (r - BHg) % Hg
        scores = diag_ptr + (r - BHg).to(tl.int64) * N
        out = sout_ptr + (r - BHg).to(tl.int64) * width_s
        forced = tl.load(locs_ptr + g).to(tl.int32)
        need = tl.minimum(tl.load(ns_ptr + g), width_s).to(tl.int32)
        width = width_s
    b = (r % BHg) // Hg
    n = tl.load(lens_ptr + b)
    _radix_take(scores, n, n, forced, need, out, width, False, False, CHUNK)


def _select(col, diag, lens, sinks, locs, nv, ns, width_v: int, width_s: int, rules=None, *, full_rows=False):
    """The builder's selection: the kernel up to :data:`SELECT_MAX_N` scores a row, topk above,
    and the shared torch selection whenever a head may use an adaptive budget rule (decided on
    the host from ``rules``, :func:`minference.index.vertical_slash_rules`)."""
    if rules is None and col.shape[-1] <= SELECT_MAX_N:
        return _select_triton(col, diag, lens, sinks, locs, nv, ns, width_v, width_s)
    return select_vertical_slash(col, diag, lens, sinks, locs, nv, ns, width_v, width_s, rules, full_rows=full_rows)


def _select_triton(col, diag, lens, sinks, locs, nv, ns, width_v: int, width_s: int):
    """:func:`minference.index.select_vertical_slash` in one launch (same sets on tie-free
    scores; among equal scores it takes the lowest positions). Positions come out ascending."""
    B, Hg, N = col.shape
    v_idx = torch.empty(B, Hg, width_v, dtype=torch.int32, device=col.device)
    s_idx = torch.empty(B, Hg, width_s, dtype=torch.int32, device=col.device)
    if B * Hg > 0:
        _select_kernel[(2 * B * Hg,)](col, diag, lens, sinks, locs, nv, ns, v_idx, s_idx, N, Hg, B * Hg, width_v,
                                      width_s, CHUNK=SELECT_CHUNK, num_warps=SELECT_WARPS)
    return v_idx, s_idx


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

    Returns:
        ``(vertical_idx [B, Hg, NV], slash_idx [B, Hg, NS])`` int32, -1 padded, in no
        particular order (a set); with ``return_scores`` also the float32
        scores ``(col [B, Hg, N], diag [B, Hg, N])`` (0 outside the row).
    """
    return build_vertical_slash_index(
        _vs_scores_triton, q, k, vertical, slash, last_q=last_q, extra_rows=extra_rows, sink_columns=sink_columns,
        local_diagonals=local_diagonals, aggregation=aggregation, scale=scale, seqlens=seqlens,
        seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=return_scores,
        vertical_width=vertical_width, slash_width=slash_width, validate=validate, selector=_select, resolved=resolved,
        rule=rule, threshold=threshold, min_vertical=min_vertical, min_slash=min_slash, resolved_rules=resolved_rules,
        q_seqlens=q_seqlens, q_seqstarts=q_seqstarts)


def pool_blocks(x: torch.Tensor, block: int, lens: torch.Tensor, starts: torch.Tensor,
                heads: torch.Tensor | None = None, qrows=None) -> torch.Tensor:
    """Mean of the valid tokens of each block: ``x [B, H, N, D]`` -> ``[B, Hs, ceil(N/block), D]``
    float32 (heads ``heads`` or all; blocks with no valid token are 0).

    Query rows ``qrows`` (:class:`minference.index.QueryRows`; ``x`` is then ``q [B, H, Nq, D]``,
    ``lens`` the key rows' lengths): the means over each block's query positions only, in the
    slot layout ``[B, Hs, S, D]`` (``S = qrows.slots(block)``, slot ``s`` =
    block ``q_lo // block + s``), one program per slot."""
    B, H, N, D = x.shape
    hs = heads_tensor(heads, H, x.device)
    nqb = math.ceil(N / block)
    q_lens, q_starts = lens, starts
    if qrows is not None:
        nqb, q_lens, q_starts = qrows.slots(block), qrows.lens, qrows.starts
    out = torch.empty(B, hs.shape[0], nqb, D, dtype=torch.float32, device=x.device)  # every entry is written
    if out.numel():
        tt = min(POOL_TOKEN_TILE, next_pow2(block))
        _pool_kernel[(B * hs.shape[0], nqb)](x, hs, lens, q_lens, q_starts, out, hs.shape[0], nqb, block, *x.stride(),
                                              D, TT=tt, BLOCK_D=next_pow2(D))
    return out


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
    top_k_width: int | None = None,
    validate: bool = True,
    resolved: tuple | None = None,
    rule: str | torch.Tensor = "top_k",
    threshold: float | torch.Tensor | None = None,
    min_blocks: int | torch.Tensor = 0,
    resolved_rules: tuple | None = None,
    estimate: str = "pooled",
    q_seqlens=None,
    q_seqstarts: torch.Tensor | None = None,
):
    """Block-sparse routing: mean-pooled Q/K per block (Triton), scaled block scores, block-causal
    mask, forced diagonal and sink blocks, top-k (or a budget rule) per query block (chunked to
    bound memory).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (``Nq < N`` with query rows).
        top_k: key blocks per query block (forced included): int or 1-D int tensor indexed by
            global head ``head_offset + h``.
        block: block size for queries and keys.
        sink_blocks: forced leading key blocks (per global head).
        force_diagonal: always keep the query block's own block.
        heads: local query heads to compute; default all.
        top_k_width: output width ``K`` (default: the largest budget, a host read for tensors).
        resolved: the per computed head budgets made ahead
            (:func:`minference.index.block_sparse_budgets`).
        rule, threshold: budget rule per query block, as for :func:`vertical_slash_index`; the
            weights are ``exp(s - max s)`` of the block logits. ``top_k`` is then the maximum.
        min_blocks: fewest blocks of the adaptive rules per query block (per global head).
        resolved_rules: :func:`minference.index.block_sparse_rules` of the rule arguments.
        q_seqlens, q_seqstarts: query rows (docs/kernels.md): query blocks stay in the key rows'
            positions; only those holding a query are scored and selected, from their query
            positions (pooled means, or the queries of ``estimate="query"``); the grids cover
            those blocks only (:meth:`minference.index.QueryRows.slots`).

    Returns:
        ``blocks [B, Hg, NQB, K]`` int32, -1 padded (every entry of a query block without a
        query); with ``return_scores`` also the float32 scores ``[B, Hg, NQB, NQB]`` (``-inf``
        where not a candidate).
    """
    return build_block_sparse_index(
        pool_blocks, q, k, top_k, block=block, sink_blocks=sink_blocks, force_diagonal=force_diagonal,
        scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=head_offset,
        return_scores=return_scores, top_k_width=top_k_width, validate=validate, resolved=resolved,
        rule=rule, threshold=threshold, min_blocks=min_blocks, resolved_rules=resolved_rules,
        estimate=estimate, scorer=query_block_scores, selector=select_query_blocks, q_seqlens=q_seqlens,
        q_seqstarts=q_seqstarts)


#: Block-mean keys per loop step of the query-aware block scores (:func:`_qbs_kernel`).
QBS_KEY_TILE = 64
#: Warps per program of the query-aware block scores.
QBS_WARPS = 4
#: Software-pipeline stages of the key-tile loop (16-bit inputs; float32 tiles take 1, as a
#: 128 x 128 float32 query block and its tf32x3 split leave no shared memory for more).
QBS_STAGES = 3
#: Largest block the query-aware kernel takes: one program holds a query block in registers.
QBS_MAX_BLOCK = 128
#: 16-bit inputs: the block-mean keys (float32) enter the product as hi + lo halves in the input
#: dtype, two MMAs whose sum carries float32-grade logits (the queries are exact in their dtype).
#: False: one MMA on the means rounded to the input dtype (relative error 2**-9 for bf16), half
#: the tensor-core work and half the key traffic.
QBS_SPLIT_KEYS = True
_LOG2E = 1.4426950408889634


@triton.jit
def _qbs_logits(qt, keys, lo_off, j, I, D, qk_scale,
                KT: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
    """Base-2 logits ``[BM, KT]`` of the query block ``qt [BM, BLOCK_D]`` against the key means
    ``j [KT]`` of ``keys`` (``[NQB, D]`` of one kv head; the low halves ``lo_off`` further), ``-inf``
    for ``j > I``."""
    d = tl.arange(0, BLOCK_D)
    ok = j <= I
    k_off = j.to(tl.int64)[:, None] * D + d[None, :]
    k_mask = ok[:, None] & (d[None, :] < D)
    hi = tl.load(keys + k_off, mask=k_mask, other=0.0)  # [KT, BLOCK_D]
    if F32:
        s = tl.dot(qt, tl.trans(hi), input_precision="tf32x3")
    else:
        s = tl.dot(qt, tl.trans(hi))
        if SPLIT:
            lo = tl.load(keys + lo_off + k_off, mask=k_mask, other=0.0)
            s = tl.dot(qt, tl.trans(lo), acc=s)
    return tl.where(ok[None, :], s * qk_scale, float("-inf"))


@triton.jit
def _qbs_kernel(q_ptr, keys_ptr, heads_ptr, lens_ptr, qlens_ptr, qstarts_ptr, out_ptr,
                Hg, Hkv, group, NQB, NS, block, qk_scale, lo_off,
                sqb, sqh, sqn, sqd, D,
                BM: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                F32: tl.constexpr):
    """One program per (batch row, head, slot): ``score[I, :]`` of query block ``I = q_lo //
    block + slot`` from its query positions ``>= q_lo`` (``q_lo = n - qlens[b]``, position ``i``
    at q's row ``qstarts[b] - q_lo + i``; the ordinary call passes the key rows' lengths and
    starts: ``q_lo = 0``, slot = block). Pass 1 keeps each row's running max and sum over the key
    tiles (online log-sum-exp, base 2); pass 2 recomputes the logits, normalises them and takes
    the max over the valid rows. Writes all ``NQB`` entries of its slot's row (``-inf`` for a
    block past the row or a row without queries)."""
    pid_bh = tl.program_id(0)
    slot = tl.program_id(1)
    b = pid_bh // Hg
    h = tl.load(heads_ptr + pid_bh % Hg)
    n = tl.load(lens_ptr + b)
    q_lo = n - tl.load(qlens_ptr + b)
    q_row0 = tl.load(qstarts_ptr + b) - q_lo
    I = q_lo // block + slot
    r = tl.arange(0, BM)
    c = tl.arange(0, KT)
    d = tl.arange(0, BLOCK_D)
    i = I * block + r  # [BM] logical query positions
    row_ok = (r < block) & (i < n) & (i >= q_lo)
    q_off = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + (q_row0 + i).to(tl.int64)[:, None] * sqn + d[None, :] * sqd
    qt = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)  # [BM, BLOCK_D]
    if F32:
        qt = qt.to(tl.float32)
    keys = keys_ptr + (b * Hkv + h // group).to(tl.int64) * NQB * D
    # key blocks scored; 0 for a query block past the row (or a row without queries)
    last = tl.where((I * block < n) & (q_lo < n), I + 1, 0)
    m = tl.full([BM], float("-inf"), tl.float32)
    acc = tl.zeros([BM], tl.float32)
    nan_row = tl.zeros([BM], tl.int32)
    for j0 in range(0, last, KT):
        # every tile holds j0 <= I, so m is finite from the first tile on (zero rows give 0)
        s = _qbs_logits(qt, keys, lo_off, j0 + c, I, D, qk_scale, KT, BLOCK_D, SPLIT, F32)  # [BM, KT]
        # a NaN logit makes its row's softmax NaN, as in the definition (max and sum skip NaN here)
        nan_row = tl.maximum(nan_row, tl.max(tl.where(s != s, 1, 0), axis=1))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        acc = acc * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log2(tl.where(acc > 0.0, acc, 1.0))  # [BM]; acc >= 1 on every row when last > 0
    lse = tl.where(nan_row > 0, float("nan"), lse)
    out = out_ptr + (pid_bh.to(tl.int64) * NS + slot) * NQB
    for j0 in range(0, last, KT):
        j = j0 + c
        s = _qbs_logits(qt, keys, lo_off, j, I, D, qk_scale, KT, BLOCK_D, SPLIT, F32)
        p = tl.where(row_ok[:, None], tl.exp2(s - lse[:, None]), float("-inf"))  # [BM, KT]
        best = tl.max(p, axis=0)  # [KT]; the max skips NaN: a NaN row makes the column NaN
        best = tl.where(tl.max(tl.where(p != p, 1, 0), axis=0) > 0, float("nan"), best)
        tl.store(out + j, tl.where(j <= I, best, float("-inf")), mask=j < NQB)
    for j0 in range((last + KT - 1) // KT * KT, NQB, KT):
        j = j0 + c
        tl.store(out + j, tl.full([KT], float("-inf"), tl.float32), mask=j < NQB)


def _qbs_keys(k: torch.Tensor, block: int, lens: torch.Tensor, starts: torch.Tensor, dtype: torch.dtype):
    """Block-mean keys ``[P, B, Hkv, NQB, D]`` for the kernel: float32 (``P = 1``) for 32/64-bit
    queries, else in the queries' dtype, hi and lo halves (``P = 2``) with :data:`QBS_SPLIT_KEYS`."""
    km = pool_blocks(k, block, lens, starts)  # [B, Hkv, NQB, D] float32
    if dtype not in (torch.float16, torch.bfloat16):
        return km[None], False
    hi = km.to(dtype)
    if not QBS_SPLIT_KEYS:
        return hi[None], False
    return torch.stack((hi, (km - hi.float()).to(dtype))), True


def query_block_scores(q: torch.Tensor, k: torch.Tensor, *, block: int, scale: float | None = None,
                       seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
                       heads: torch.Tensor | None = None, q_seqlens=None, q_seqstarts: torch.Tensor | None = None,
                       slots=None) -> torch.Tensor:
    """Query-aware block scores (the FlashPrefill routing score): every query against the
    block-mean keys, softmaxed over its block-causal key blocks, maxed over its block's rows
    (definition: :func:`minference.reference.estimators.query_block_scores`).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]`` (GQA: head ``h`` reads ``h // (Hq // Hkv)``,
            never repeated). Strides respected.
        block: block size for queries and keys, ``1..QBS_MAX_BLOCK`` (a power of two from 16 on
            wastes no rows of the query tile).
        scale: logit scale (default ``D ** -0.5``).
        seqlens, seqstarts: ragged rows ``[B]`` int (read on the device); padding is never read.
        heads: local query heads to compute (``Hg`` of them); default all.
        q_seqlens, q_seqstarts: query rows (docs/kernels.md, as the attention kernels take them):
            only the query blocks that hold a query are scored, from their query positions.
        slots: the builder's checked :class:`minference.index.QueryRows` instead of ``q_seqlens``
            / ``q_seqstarts``; the result is then in their slot layout ``[B, Hg, S, NQB]``.

    Returns:
        ``scores [B, Hg, NQB, NQB]`` float32, ``NQB = ceil(N / block)``: in ``(0, 1]`` for
        ``J <= I`` inside the row, ``-inf`` above the diagonal and for query blocks past the row
        (or, with query rows, holding no query).

    Launches: the key pooling (:func:`pool_blocks`), the hi/lo split (16-bit inputs) and one
    ``(B * Hg, NQB)`` grid (with query rows ``(B * Hg, S)``, ``S = QueryRows.slots(block)``, and
    one gather to put the rows back by query block). No host synchronisation beyond the value
    checks of :func:`check_ragged` and :func:`~minference._checks.check_query_rows` (skipped
    under CUDA-graph capture).

    Cost per head: each pass computes ``block * sum_I ceil((I + 1) / KT) * KT`` logits, about
    ``N * (NQB / 2 + KT / 2)``, at ``2 D`` FLOPs each (twice with the hi/lo split), so
    ``2 passes * 2 (split) * 2 D * N * NQB / 2 = 4 * N * NQB * D``: 5.9e10 FLOPs at N = 120K,
    block 64, D = 64 (NQB = 1875; 3.1e10 at block 128), and one ``exp2`` per logit per pass
    (2.3e8 / 1.2e8). Key means are re-read from L2 per program: ``2 * KT * D * 2`` bytes per tile,
    ``NQB**2 / KT`` tiles per head over both passes (0.9 GB per head at block 64, 0.24 GB at 128).
    Predicted for the H200, Hq = 14 (Hkv = 2), D = 64, bf16, N = 120K: block 64 about 2-3 ms
    (exp2 0.8 ms, MMA 1.4 ms at 600 TFLOP/s, L2 13 GB, overlapping only in part), block 128
    about 0.8-1.2 ms. Measured there (B = 1, ``do_bench`` median, whole call, random inputs):
    block 64 3.08 ms (2.26 with ``QBS_SPLIT_KEYS`` off), block 128 1.27 ms (1.02); at 64K
    1.00 / 0.45 ms; 2 to 4 pipeline stages within 5%. The mean-pooled
    :func:`block_sparse_index` (top 32, block 64: scores, masks and top-k) took 5.24 ms in the
    same run. The output (0.2 GB at block 64) is written once; a selection
    that consumed the tiles in the kernel would save that write and its re-read, not the score
    work.
    """
    B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= QBS_MAX_BLOCK:
        raise ValueError(f"block must be an int in [1, {QBS_MAX_BLOCK}], got {block!r}")
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    qr = scorer_rows(slots, q_seqlens, q_seqstarts, lens, starts, Nq, N, seqlens is not None or seqstarts is not None)
    hs = heads_tensor(heads, Hq, q.device)
    Hg, nqb = hs.shape[0], math.ceil(N / block)
    S, q_lens, q_starts = (nqb, lens, starts) if qr is None else (qr.slots(block), qr.lens, qr.starts)
    out = torch.empty(B, Hg, S, nqb, dtype=torch.float32, device=q.device)
    if out.numel() > 0:
        keys, split = _qbs_keys(k, block, lens, starts, q.dtype)
        f32 = q.dtype not in (torch.float16, torch.bfloat16)
        _qbs_kernel[(B * Hg, S)](q, keys, hs, lens, q_lens, q_starts, out, Hg, Hkv, Hq // Hkv, nqb, S, block,
                                 scale * _LOG2E, keys[0].numel(), *q.stride(), D,
                                 BM=max(_MIN_DOT, next_pow2(block)), KT=QBS_KEY_TILE,
                                 BLOCK_D=max(_MIN_DOT, next_pow2(D)), SPLIT=split,
                                 F32=f32, num_warps=QBS_WARPS, num_stages=1 if f32 else QBS_STAGES)
    if qr is not None and slots is None:
        return blocks_from_slots(out, lens, qr, block, nqb, float("-inf"))
    return out


#: Scores per loop step of the fused block selection (:func:`_block_select_kernel`).
BLOCK_SELECT_CHUNK = 1024
#: Warps per program of the fused block selection.
BLOCK_SELECT_WARPS = 4
_TOP_K_CODE = 0  # minference.index.RULE_CODES["top_k"], checked in select_query_blocks
_RELATIVE_CODE = 2  # minference.index.RULE_CODES["relative"]


@triton.jit
def _block_candidates(row, pos, I, sinks, FORCE_DIAG: tl.constexpr):
    """A chunk of one query block's routing scores: ``(x, valid, forced)`` as the definition
    (:func:`minference.reference.estimators.select_row`) reads them: ``-inf`` (and positions
    past the diagonal) is no candidate; NaN or ``+inf`` is a candidate without a score, kept
    only when forced; ``x`` holds the finite scores (``-inf`` elsewhere), ``valid`` what may be
    chosen (forced candidates and finite scores)."""
    raw = tl.load(row + pos, mask=pos <= I, other=float("-inf"))
    candidate = raw != float("-inf")  # NaN included
    finite = (raw == raw) & (raw != float("inf")) & candidate
    forced = pos < sinks
    if FORCE_DIAG:
        forced = forced | (pos == I)
    forced = forced & candidate
    return tl.where(finite, raw, float("-inf")), finite | forced, forced


@triton.jit
def _block_select_kernel(s_ptr, lens_ptr, qlens_ptr, sinks_ptr, tops_ptr, code_ptr, alpha_ptr, mins_ptr, out_ptr,
                         Hg, NQB, NS, block, width, FORCE_DIAG: tl.constexpr, CHUNK: tl.constexpr):
    """One program per (batch row, head, slot): query block ``I = q_lo // block + slot`` (``q_lo =
    n - qlens[b]``; the ordinary call passes the key rows' lengths, slot = block), the block selection of
    :func:`minference.index.select_top` for the ``"top_k"`` and ``"relative"`` rules on
    query-aware scores (weights = the scores), without a sort.

    Pass 1: the row's largest score, its valid and forced counts; pass 2 (relative): how many
    unforced candidates reach ``alpha * max`` (compared in float64, as the definition does). The
    count ``c = min(max(rule count, minimum, forced), budget, candidates, width)`` then picks the
    ``c`` largest (forced ones as ``+inf``, ties to the lowest position) by the radix select of
    :func:`_radix_take`, written ascending, -1 after."""
    r = tl.program_id(0)  # b * Hg + g
    slot = tl.program_id(1)
    g = r % Hg
    b = r // Hg
    n = tl.load(lens_ptr + b)
    I = (n - tl.load(qlens_ptr + b)) // block + slot
    out = out_ptr + (r.to(tl.int64) * NS + slot) * width
    offs = tl.arange(0, CHUNK)
    row = s_ptr + (r.to(tl.int64) * NS + slot) * NQB
    sinks = tl.load(sinks_ptr + g).to(tl.int32)
    end = tl.where(I < (n + block - 1) // block, I + 1, 0)  # no candidate in a block past the row
    top = tl.full([], float("-inf"), tl.float32)
    n_valid = tl.zeros([], tl.int32)
    n_forced = tl.zeros([], tl.int32)
    for c0 in range(0, end, CHUNK):
        x, valid, forced = _block_candidates(row, c0 + offs, I, sinks, FORCE_DIAG)
        top = tl.maximum(top, tl.max(x, 0))
        n_valid += tl.sum(valid.to(tl.int32), 0)
        n_forced += tl.sum(forced.to(tl.int32), 0)
    code = tl.load(code_ptr + g)
    budget = tl.load(tops_ptr + g).to(tl.int32)
    count = budget
    if code == 2:  # relative
        bar = tl.load(alpha_ptr + g) * top.to(tl.float64)
        above = tl.zeros([], tl.int32)
        for c0 in range(0, end, CHUNK):
            x, valid, forced = _block_candidates(row, c0 + offs, I, sinks, FORCE_DIAG)
            above += tl.sum((valid & ~forced & (x.to(tl.float64) >= bar)).to(tl.int32), 0)  # unforced: finite
        count = tl.maximum(n_forced + above, tl.load(mins_ptr + g).to(tl.int32))
    count = tl.minimum(tl.maximum(count, n_forced), budget)
    need = tl.minimum(tl.minimum(count, n_valid), width)
    _radix_take(row, end, I, sinks, need, out, width, FORCE_DIAG, True, CHUNK)


def select_query_blocks(scores: torch.Tensor, lens: torch.Tensor, sinks: torch.Tensor, budget: torch.Tensor,
                        rule, *, block: int, force_diagonal: bool, width: int,
                        q_lens: torch.Tensor | None = None) -> torch.Tensor | None:
    """The block selection of :func:`minference.index.build_block_sparse_index` on query-aware
    scores in one launch, or ``None`` when a head may use the ``"mass"`` rule (its prefix sums
    stay with :func:`minference.index.select_top`; decided on the host from ``rule.rules``).

    Args:
        scores: ``[B, Hg, NQB, NQB]`` float32 :func:`query_block_scores` (``-inf`` = no candidate).
        lens: ``[B]`` int row lengths; sinks, budget: ``[Hg]`` forced leading blocks and the
            budget (``top_k``'s count, the relative rule's maximum) per computed head.
        rule: the heads' :class:`minference.index.SelectionRule` or ``None`` (every head top-k).
        block: the routing block; force_diagonal: keep each query block's own block.
        width: output width.
        q_lens: ``[B]`` query rows' counts (:class:`minference.index.QueryRows`): ``scores`` are
            then ``[B, Hg, S, NQB]`` in their slot layout (slot ``s`` = query block ``(lens -
            q_lens) // block + s``), and so is the result.

    Returns:
        ``[B, Hg, NQB, width]`` (``[B, Hg, S, width]``) int32 key blocks, ascending, -1 padded:
        the same sets as :func:`minference.index.select_top` (ties to the lowest position). No
        host sync.
    """
    from minference.index import RULE_CODES

    assert RULE_CODES["top_k"] == _TOP_K_CODE and RULE_CODES["relative"] == _RELATIVE_CODE
    if not _selects_in_one_launch(rule):
        return None
    B, Hg, n_slots, nqb = scores.shape
    out = torch.empty(B, Hg, n_slots, width, dtype=torch.int32, device=scores.device)
    if out.numel() == 0:
        return out
    dev = scores.device
    if rule is None:
        code = torch.zeros(Hg, dtype=torch.int64, device=dev)
        alpha = torch.zeros(Hg, dtype=torch.float64, device=dev)
        mins = torch.zeros(Hg, dtype=torch.int64, device=dev)
    else:
        code, alpha, mins = rule.code, rule.threshold.to(torch.float64), rule.minimum
    scores = scores.contiguous()
    _block_select_kernel[(B * Hg, n_slots)](scores, lens, lens if q_lens is None else q_lens, sinks, budget, code,
                                            alpha, mins, out, Hg, nqb, n_slots, block, width,
                                            FORCE_DIAG=force_diagonal,
                                            CHUNK=min(BLOCK_SELECT_CHUNK, max(16, next_pow2(nqb))),
                                            num_warps=BLOCK_SELECT_WARPS)
    return out


def _selects_in_one_launch(rule) -> bool:
    """Whether :func:`select_query_blocks` takes a selection under the heads' ``rule``
    (:class:`minference.index.SelectionRule` or ``None``), decided on the host."""
    return rule is None or rule.rules <= {"top_k", "relative"}


def block_index_ascending(estimate: str, rule) -> bool:
    """Whether :func:`block_sparse_index` with ``estimate`` and the heads' resolved ``rule``
    (``None``: ``top_k`` only) writes every query block's ids distinct, causal (``<= I``) and
    ascending, then only -1: the one-launch selection (:func:`select_query_blocks`) does, and so
    does an empty index; the torch selection (pooled estimate, the ``mass`` rule) writes its
    selection order. What the dispatcher passes as ``ascending`` to
    :func:`minference.kernels.block_sparse_attention`, which then skips its sort."""
    return estimate == "query" and _selects_in_one_launch(rule)
