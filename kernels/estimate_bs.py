"""Block-sparse index estimation on the device: block pooling and query-aware block scores, then
the selection (:mod:`minference.kernels.select`).

Same semantics as the naive twins in :mod:`minference.reference.estimators`; validation, budgets
and the torch selection are shared with the PyTorch builders (:mod:`minference.builders`), only
the pooled means, the query-aware scores and the one-launch selection are computed on the device.
Nothing synchronises with the host when the per-head budgets are device tensors (or ints) and the
output widths are given.

Query-aware block scores (:func:`query_block_scores`) score every query, not the block's mean
query, against the block-mean keys: one program owns one query block's rows and walks the key
means ``J <= I`` in tiles of ``KT``, twice (log-sum-exp per row, then normalised probabilities
reduced by a max over the rows into one ``[KT]`` slice of ``score[I, :]``). It writes its whole
score row (``-inf`` past ``I``), so the output needs no fill, and reads no atomics.

Query rows (``q_seqlens``, ``q_seqstarts``: ``q [B, Hq, Nq, D]`` holds each row's last tokens;
docs/kernels.md) reach every kernel as two more pointers, the query rows' counts and starts
(the key rows' own lengths and starts for the ordinary call): the block kernels run one program
per *slot* (query block ``q_lo // block + s``, :meth:`minference.builders.QueryRows.slots`), not
per query block of the row.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import triton
import triton.language as tl
from minference.kernels._common import MIN_DOT, next_pow2
from minference.kernels.select import select_query_blocks

from minference._checks import check_int, check_qkv_rows, check_ragged, default_scale
from minference.builders import blocks_from_slots, build_block_sparse_index, heads_tensor, scorer_rows
from minference.patterns import DEFAULT_BLOCK_SIZE

__all__ = ["block_sparse_index", "pool_blocks", "query_block_scores"]

#: Tokens pooled per loop step of the block pooling kernel.
POOL_TOKEN_TILE = 64


@triton.jit(do_not_specialize=["NS"])  # query blocks (or slots): no variant per length class
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
    score_rows: int = 0,
    checked: bool = False,
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
            those blocks only (:meth:`minference.builders.QueryRows.slots`).
        score_rows: ``estimate="query"``: the queries of a block that score it
            (:func:`query_block_scores`; 0: all).
        checked: internal: the caller validated the arguments' form (see
            :func:`minference.kernels.vertical_slash_index`); the query-aware scores then skip
            their checks too.

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
        estimate=estimate, scorer=partial(query_block_scores, checked=True) if checked else query_block_scores,
        selector=select_query_blocks, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, score_rows=score_rows,
        checked=checked)


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


# query blocks, slots and the scoring rows' spacing (1 for every row: no variant of its own); lo_off =
# P*B*Hkv*NQB*D stays (a multiple of D)
@triton.jit(do_not_specialize=["NQB", "NS", "rows", "step"])
def _qbs_kernel(q_ptr, keys_ptr, heads_ptr, lens_ptr, qlens_ptr, qstarts_ptr, out_ptr,
                Hg, Hkv, group, NQB, NS, block, rows, step, qk_scale, lo_off,
                sqb, sqh, sqn, sqd, D,
                BM: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                F32: tl.constexpr):
    """One program per (batch row, head, slot): ``score[I, :]`` of query block ``I = q_lo //
    block + slot`` from its query positions ``>= q_lo`` (``q_lo = n - qlens[b]``, position ``i``
    at q's row ``qstarts[b] - q_lo + i``; the ordinary call passes the key rows' lengths and
    starts: ``q_lo = 0``, slot = block). Its rows are the block's scoring positions ``hi - 1 - r *
    step``, ``r < rows``, at least ``max(I * block, q_lo)`` (``hi`` the block's end in the row;
    every position for ``rows = block``, ``step = 1``). Pass 1 keeps each row's running max and
    sum over the key tiles (online log-sum-exp, base 2); pass 2 recomputes the logits, normalises
    them and takes the max over the valid rows. Writes all ``NQB`` entries of its slot's row
    (``-inf`` for a block past the row or a row without queries)."""
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
    i = tl.minimum(I * block + block, n) - 1 - r * step  # [BM] logical query positions, descending
    row_ok = (r < rows) & (i >= tl.maximum(I * block, q_lo))
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
                       slots=None, score_rows: int = 0, checked: bool = False) -> torch.Tensor:
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
        slots: the builder's checked :class:`minference.builders.QueryRows` instead of ``q_seqlens``
            / ``q_seqstarts``; the result is then in their slot layout ``[B, Hg, S, NQB]``.
        score_rows: the queries of a block that score it (0: all; else at most that many, spaced
            ``max(1, block // score_rows)`` apart back from the block's last query): the program's
            row tile shrinks to ``next_pow2(min(score_rows, block))`` (at least 16), and the logits
            and ``exp2`` with it; the key-mean traffic stays.
        checked: internal: the caller (the builder of a checked call) validated the arguments'
            form and the row values; no check, and no host read of the rows.

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
    work. ``score_rows = r`` divides the logits and ``exp2`` by ``block / r``, not the key-mean
    traffic: on an H100, Qwen2.5-1.5B at 128K (336 heads, D = 128, block 128, bf16), one profiled
    prefill's ``_qbs_kernel`` time fell from 93.8 ms (every row) to 41.1 ms (32 rows), against
    ~45 ms predicted with the ~180 GB of key-mean reads from L2 then bounding it
    (docs/search.md, "Cheaper estimation").
    """
    if checked:
        B, Hq, Nq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= QBS_MAX_BLOCK:
        raise ValueError(f"block must be an int in [1, {QBS_MAX_BLOCK}], got {block!r}")
    if not checked:
        check_int("score_rows", score_rows, 0)
    rows = block if score_rows == 0 else min(score_rows, block)
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=not checked)
    qr = scorer_rows(slots, q_seqlens, q_seqstarts, lens, starts, Nq, N, seqlens is not None or seqstarts is not None)
    hs = heads if checked and heads is not None else heads_tensor(heads, Hq, q.device)
    Hg, nqb = hs.shape[0], math.ceil(N / block)
    S, q_lens, q_starts = (nqb, lens, starts) if qr is None else (qr.slots(block), qr.lens, qr.starts)
    out = torch.empty(B, Hg, S, nqb, dtype=torch.float32, device=q.device)
    if out.numel() > 0:
        keys, split = _qbs_keys(k, block, lens, starts, q.dtype)
        f32 = q.dtype not in (torch.float16, torch.bfloat16)
        _qbs_kernel[(B * Hg, S)](q, keys, hs, lens, q_lens, q_starts, out, Hg, Hkv, Hq // Hkv, nqb, S, block,
                                 rows, max(1, block // rows), scale * _LOG2E, keys[0].numel(), *q.stride(), D,
                                 BM=max(MIN_DOT, next_pow2(rows)), KT=QBS_KEY_TILE,
                                 BLOCK_D=max(MIN_DOT, next_pow2(D)), SPLIT=split,
                                 F32=f32, num_warps=QBS_WARPS, num_stages=1 if f32 else QBS_STAGES)
    if qr is not None and slots is None:
        return blocks_from_slots(out, lens, qr, block, nqb, float("-inf"))
    return out
