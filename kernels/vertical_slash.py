"""Vertical-slash attention: chosen key columns plus chosen diagonals, exact on the logical set.

Query ``i`` reads ``{j ∈ C : j <= i} ∪ {i - δ : δ ∈ D, i - δ >= 0}``. The logical index is turned
into the physical format of :mod:`minference.kernels.convert` (slash runs read as disjoint key
ranges per query block, plus the leftover columns of each block), then one program per query
block walks its key ranges in contiguous tiles and its leftover columns in gathered tiles.

Masking: a range tile whose keys are all causal for the block, inside the range, and whose every
diagonal ``i - j`` is a chosen offset (the run's hole-free flag) runs unmasked; any other range
tile applies the exact set ``(i - j ∈ D or j ∈ C) and j <= i`` before the running max. When
every run is hole-free by construction (``VSIndex.all_solid``, the dispatcher's gap filling),
the kernel is compiled without the 64-bit bitmap path (``SOLID``). Unmasked range tiles (read
through tensor descriptors) and all column tiles span ``WIDE_TILE_FACTOR * BLOCK_N`` keys,
masked range tiles ``BLOCK_N``.

Column scratch: where K/V are read through descriptors, the K/V rows of each head's distinct
columns (``VSIndex.columns``) are first copied into a contiguous scratch ``[B, Hg, NV, D]``
(:func:`_gather_columns_kernel`, one launch). A block's leftover list begins with the head's
first ``col_lead`` columns, so those of its columns that precede its first row are read from
the scratch in contiguous descriptor tiles, like a key range; only the rest are gathered.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minference.kernels._common import (
    Prepared,
    Tiles,
    ValueGuard,
    _epilogue,
    _load_kv,
    _load_kv_desc,
    _program_ids,
    _prologue,
    _scores,
    _softmax_update,
    cdiv,
    default_tiles,
    descriptors_ok,
    finish,
    fitted_stages,
    kv_descriptors,
    launch_fitted,
    prepare,
    qkv_strides,
)
from minference.kernels.convert import _WORD, BITS_PAD_WORDS, VSIndex, convert_vertical_slash

from minference._checks import check_index

__all__ = ["vertical_slash_attention", "vertical_slash_attention_physical", "vertical_slash_block_m"]

#: Unmasked range tiles (one descriptor load each) and all gathered column tiles span
#: ``WIDE = WIDE_TILE_FACTOR * BLOCK_N`` keys; masked range tiles keep ``BLOCK_N``. Each of the
#: three wide tiles was faster than 64 keys at 128K and 512K; masked range tiles of 128 keys spill
#: (136 bytes on sm_90) and were slower. See docs/tuning.md#wide-tile-factor.
WIDE_TILE_FACTOR = 2

#: Software-pipeline stages of the gathered column loops on the GPU (``None``: the kernel's
#: ``num_stages``). Not pipelined: pipelined, the ~7% gathered tiles cost ~14% of the time
#: (see docs/tuning.md#column-stages).
COLUMN_STAGES: int | None = 1
#: Software-pipeline stages of the column-scratch tile loop (``None``: the kernel's
#: ``num_stages``). One stage: pipelined, the scratch loop slows the whole kernel, even where no
#: column tile runs (see docs/tuning.md#scratch-stages).
SCRATCH_STAGES: int | None = 1
#: Scratch slots per program of :func:`_gather_columns_kernel`.
_GATHER_SLOTS = 32


@triton.jit
def _vs_range_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh, row_start, rows,
                    row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn, svsd, qk_scale, t_begin,
                    t_end, hi, bits_base, cm_base, solid, da, db,
                    MASKED: tl.constexpr, PAD_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    EVEN_D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    """Key tiles ``[t, t + BLOCK_N)``, ``t`` in ``range(t_begin, t_end, BLOCK_N)``, of a key range
    ending at ``hi``, of the run ``[da, db]``. Masked tiles keep ``(i - j ∈ D or j ∈ C) and j <= i``;
    in a hole-free (``solid``) run ``i - j ∈ D`` is ``da <= i - j <= db``, otherwise it comes from
    the packed bitmap: row ``i`` needs offsets ``i - t - (BLOCK_N - 1) .. i - t``, one 64-bit
    window assembled from two words. ``solid`` is the constant ``True`` in the all-solid build
    (every run hole-free, known on the host): the bitmap path is then not compiled. Masked tiles
    read ``k_masked`` and ``v_safe``; unmasked ones read ``k`` and ``v``."""
    for t in range(t_begin, t_end, BLOCK_N):
        cols = t + offs_n  # [BN]
        col_ok = cols < hi
        if MASKED:
            k, v = _load_kv(km_base, vs_base, cols, col_ok, offs_d, d_ok, skmn, skmd, svsn, svsd, True, EVEN_D)
        elif DESC:  # unmasked tiles lie inside the range, hence inside the row
            k, v = _load_kv_desc(desc_k, desc_v, b, kvh, row_start + t, BLOCK_N, BLOCK_D)
        else:
            k, v = _load_kv(k_base, v_base, cols, col_ok, offs_d, d_ok, skn, skd, svn, svd, False, EVEN_D)
        s = _scores(q, k, PREC)  # [BM, BN]
        if MASKED:
            if solid:  # a hole-free run: the offsets are exactly [da, db]
                delta = rows[:, None] - cols[None, :]
                on_diag = (delta >= da) & (delta <= db)
            else:
                x0 = rows - t - (BLOCK_N - 1)  # [BM] lowest offset the row needs (may be < 0)
                word = (x0 >> 6) + PAD_WORDS
                shift = (x0 & 63).to(tl.uint64)
                w0 = tl.load(bits_base + word, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
                w1 = tl.load(bits_base + word + 1, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
                upper = tl.where(shift == 0, 0, w1 << ((64 - shift) & 63))
                window = (w0 >> shift) | upper  # [BM] bit b = offset x0 + b
                bit = (BLOCK_N - 1 - offs_n).to(tl.uint64)  # [BN] offset of key t + c is x0 + BN - 1 - c
                on_diag = ((window[:, None] >> bit[None, :]) & 1) != 0
            on_col = tl.load(cm_base + cols, mask=col_ok, other=0) != 0  # [BN]
            keep = (on_diag | on_col[None, :]) & col_ok[None, :] & (cols[None, :] <= rows[:, None])
            s = tl.where(keep & row_ok[:, None], s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_cols", "safe"])  # n_cols: the vertical width, as _vs_fwd takes it
def _gather_columns_kernel(K, V, KM, VS, CK, CV, CKM, CVS, columns, lens, starts, heads, group, n_cols, safe,
                           skb, skh, skn, skd, svb, svh, svn, svd, skmb, skmh, skmn, skmd, svsb, svsh, svsn, svsd,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """Column scratch rows ``[s, s + BLOCK_C)`` of one (batch row, computed head): the K and V rows
    of ``columns[b, g, s]`` (contiguous ``[B, Hg, n_cols, D]``), and with ``safe != 0`` also the
    ``k_masked`` and ``v_safe`` rows (:func:`minference.kernels._common.value_guard`) into ``CKM``
    and ``CVS``, which the one masked scratch tile of a block reads. Padding slots (-1) and
    columns past the row's end are written as zeros (finite)."""
    b, g, h, kvh, _, _, row_len, row_start, _, _ = _program_ids(lens, starts, heads, lens, lens, group, 1, False)
    slot = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    bg = b.to(tl.int64) * tl.num_programs(1) + g
    in_list = slot < n_cols
    cols = tl.load(columns + bg * n_cols + slot, mask=in_list, other=-1)
    ok = (cols >= 0) & (cols < row_len)
    s64 = row_start.to(tl.int64)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh + s64 * skn
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh + s64 * svn
    k, v = _load_kv(k_base, v_base, tl.where(ok, cols, 0), ok, offs_d, d_ok, skn, skd, svn, svd, True, EVEN_D)
    dst = (bg * n_cols + slot.to(tl.int64))[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(CK + dst, k, mask=in_list[:, None] & d_ok[None, :])
    tl.store(CV + dst, v, mask=in_list[:, None] & d_ok[None, :])
    if safe != 0:
        km_base = KM + b.to(tl.int64) * skmb + kvh.to(tl.int64) * skmh + s64 * skmn
        vs_base = VS + b.to(tl.int64) * svsb + kvh.to(tl.int64) * svsh + s64 * svsn
        km, vs = _load_kv(km_base, vs_base, tl.where(ok, cols, 0), ok, offs_d, d_ok, skmn, skmd, svsn, svsd, True,
                          EVEN_D)
        tl.store(CKM + dst, km, mask=in_list[:, None] & d_ok[None, :])
        tl.store(CVS + dst, vs, mask=in_list[:, None] & d_ok[None, :])


# index sizes only scale index addresses, and the log-sum-exp batch/head strides (N-dependent:
# divisible by 16 or not) only a per-row scalar store: specialising on them would only multiply
# compiles (the GPU tier draws many N)
@triton.jit(do_not_specialize=["n_idx", "n_words", "n_runs", "n_cols", "n_qblk", "slb", "slh"])
def _vs_fwd(Q, K, V, KM, VS, O, LSE, desc_k, desc_v, desc_ck, desc_cv, desc_ckm, desc_cvs, lens, starts, q_los, q_row0s,
            heads, run_start, run_end, run_count, run_solid, col_index, col_count, col_before, col_lead, diag_bits,
            col_mask, n_idx, n_words, n_runs, n_cols, n_qblk, qk_scale,
            sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
            skmb, skmh, skmn, skmd, svsb, svsh, svsn, svsd, slb, slh, sln,
            group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            RETURN_LSE: tl.constexpr, PREC: tl.constexpr, PAD_WORDS: tl.constexpr, DESC: tl.constexpr,
            COL_STAGES: tl.constexpr, SOLID: tl.constexpr, WIDE: tl.constexpr, SCRATCH: tl.constexpr,
            SCRATCH_STAGES: tl.constexpr, QROWS: tl.constexpr):
    b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    if tl.maximum(m0, q_lo) >= row_len:  # past the row, or a row without queries
        return
    offs_n, offs_d, d_ok, rows, row_ok, b64, q64, k_base, v_base, km_base, vs_base, q, acc, m_i, l_i = _prologue(
        Q, K, V, KM, VS, b, h, kvh, m0, row_len, row_start, q_lo, q_row0, sqb, sqh, sqn, sqd, skb, skh, skn, svb, svh,
        svn, skmb, skmh, skmn, svsb, svsh, svsn, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D)

    bg = b64 * tl.num_programs(1) + g  # (batch row, computed head) slot of the index tensors
    rs_base = run_start + bg * n_runs
    re_base = run_end + bg * n_runs
    bits_base = diag_bits + bg * n_words
    solid_base = run_solid + bg * n_runs
    cm_base = col_mask + bg * n_idx
    ci_base = col_index + (bg * n_qblk + qblk) * n_cols

    rows_full = (m0 >= q_lo) & (m0 + BLOCK_M <= row_len)  # every row of the block is a query
    last_row = tl.minimum(m0 + BLOCK_M, row_len) - 1

    # slash runs: disjoint key ranges [max(0, m0 - δb), m0 + BM - 1 - δa] of this block. In a run
    # without holes, tile t lies wholly on chosen diagonals when its offsets m0 - t - BN + 1 ..
    # m0 + BM - 1 - t fit in [δa, δb]: those tiles (a contiguous stretch) run with no mask at all.
    nr = tl.load(run_count + bg)
    for r in range(0, nr):
        da = tl.load(rs_base + r)
        db = tl.load(re_base + r)
        lo = tl.maximum(m0 - db, 0)
        hi = tl.minimum(m0 + BLOCK_M - 1 - da, last_row) + 1
        if SOLID:
            solid = True  # a constant: the range tiles compile without the bitmap path
            bare = rows_full  # the run's interior tiles may run without a mask
        else:
            solid = tl.load(solid_base + r) != 0
            bare = solid & rows_full
        k_b = tl.maximum(m0 + 1 - da - lo, 0) // BLOCK_N  # tiles whose last key is <= m0 - δa
        k_b = tl.minimum(k_b, tl.maximum(hi - lo, 0) // BLOCK_N)  # ... and inside the range
        k_a = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 - db - lo, 0), BLOCK_N), k_b)
        k_a = tl.where(bare, k_a, 0)
        k_b = tl.where(bare, k_b, 0)
        acc, m_i, l_i = _vs_range_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                        row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn,
                                        skmd, svsn, svsd, qk_scale,
                                        lo, lo + k_a * BLOCK_N, hi, bits_base, cm_base, solid, da, db,
                                        True, PAD_WORDS, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
        # the unmasked stretch in tiles of WIDE keys; an odd BLOCK_N tile is left to the masked tail
        k_b = k_a + (k_b - k_a) // (WIDE // BLOCK_N) * (WIDE // BLOCK_N)
        acc, m_i, l_i = _vs_range_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                        row_start, rows, row_ok, tl.arange(0, WIDE), offs_d, d_ok, skn, skd, svn,
                                        svd, skmn, skmd, svsn, svsd, qk_scale,
                                        lo + k_a * BLOCK_N, lo + k_b * BLOCK_N, hi, bits_base, cm_base, solid, da, db,
                                        False, PAD_WORDS, WIDE, BLOCK_D, EVEN_D, PREC, DESC)
        acc, m_i, l_i = _vs_range_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                        row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn,
                                        skmd, svsn, svsd, qk_scale,
                                        lo + k_b * BLOCK_N, hi, hi, bits_base, cm_base, solid, da, db,
                                        True, PAD_WORDS, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    # leftover vertical columns of this block (ascending, none inside a key range), in tiles of
    # WIDE columns. Columns before the block's first row are causal for every row: the leading
    # ones that are the head's first columns (slot = list position) come from the column scratch
    # in contiguous tiles, masked only past their count; then whole gathered tiles of the others
    # run unmasked, the rest masked
    nc = tl.load(col_count + bg * n_qblk + qblk)
    before = tl.load(col_before + bg * n_qblk + qblk)
    if SCRATCH:
        fast = tl.minimum(tl.load(col_lead + bg * n_qblk + qblk), before)
        n_fast = (fast // WIDE) * WIDE
        for t in tl.range(0, n_fast, WIDE, num_stages=SCRATCH_STAGES):
            k, v = _load_kv_desc(desc_ck, desc_cv, b, g, t, WIDE, BLOCK_D)
            s = _scores(q, k, PREC)
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)
        for t in tl.range(n_fast, fast, WIDE, num_stages=1):  # at most one tile
            # its slots past the count are other columns, which this block may not read: key and
            # value rows from the k_masked / v_safe scratch, so a bad value there stays masked
            k, v = _load_kv_desc(desc_ckm, desc_cvs, b, g, t, WIDE, BLOCK_D)
            s = _scores(q, k, PREC)
            s = tl.where((t + tl.arange(0, WIDE) < fast)[None, :], s, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)
    else:
        fast = 0
    n_unmasked = fast + ((before - fast) // WIDE) * WIDE
    for t in tl.range(fast, n_unmasked, WIDE, num_stages=COL_STAGES):
        cols = tl.load(ci_base + t + tl.arange(0, WIDE))  # [WIDE], every entry a column < m0
        k, v = _load_kv(k_base, v_base, cols, cols >= 0, offs_d, d_ok, skn, skd, svn, svd, False, EVEN_D)
        s = _scores(q, k, PREC)
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)
    for t in tl.range(n_unmasked, nc, WIDE, num_stages=COL_STAGES):
        idx = t + tl.arange(0, WIDE)
        ok = idx < nc
        cols = tl.load(ci_base + idx, mask=ok, other=0)  # [WIDE]
        ok = ok & (cols <= last_row)  # columns past a short row's end are padding: never read
        k, v = _load_kv(km_base, vs_base, cols, ok, offs_d, d_ok, skmn, skmd, svsn, svsd, True, EVEN_D)
        s = _scores(q, k, PREC)
        keep = ok[None, :] & (cols[None, :] <= rows[:, None]) & row_ok[:, None]
        s = tl.where(keep, s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)

    _epilogue(acc, m_i, l_i, O, LSE, b64, h, q64, rows, row_ok, offs_d, d_ok, sob, soh, son, sod, slb, slh, sln,
              RETURN_LSE)


def vertical_slash_block_m(q: torch.Tensor) -> int:
    """Query rows per block the vertical-slash kernel uses for ``q`` (the converter's ``block_m``)."""
    return default_tiles(q).block_m


def vertical_slash_attention_physical(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: VSIndex,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = True,
    value_guard: ValueGuard | None = None,
    checked: bool = False,
):
    """Vertical-slash attention from an already converted :class:`VSIndex` (see
    :func:`vertical_slash_attention` for the arguments); ``index.block_m`` must equal
    :func:`vertical_slash_block_m` and ``index.n`` the sequence length. ``checked``: internal:
    the caller validated the arguments' form at its own edge and converted ``index`` for this
    call (see :func:`~minference.kernels.ashape_attention`), so those checks are skipped."""
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out,
                   return_lse=return_lse, validate=validate, guard=value_guard, checked=checked)
    return _run(prep, q, k, v, index, return_lse, checked=checked)


def _run(prep: Prepared, q, k, v, index: VSIndex, return_lse: bool, *, checked: bool = False):
    """Check ``index`` against the prepared call (unless ``checked``: the caller converted it for
    this call) and launch the kernel (both public functions)."""
    if not checked:
        if not isinstance(index, VSIndex):
            raise TypeError(f"index must be a VSIndex, got {type(index).__name__}")
        if index.block_m != prep.tiles.block_m:
            raise ValueError(f"index.block_m={index.block_m} but the kernel runs blocks of {prep.tiles.block_m} "
                             "rows")
    if prep.tiles.block_n > _WORD or prep.tiles.block_m + prep.tiles.block_n - 2 > BITS_PAD_WORDS * _WORD:
        raise ValueError(f"vertical-slash tiles {prep.tiles} exceed the packed diagonal window")
    if not checked:
        if index.n != prep.N:
            raise ValueError(f"index.n={index.n} but the sequence length is {prep.N}")
        _check_physical(prep, index, q.device)
    lse, sln = prep.lse_arg()
    slb, slh = prep.lse_strides()
    if prep.launches():
        heads = prep.head_ids()
        scratch = {}  # the column scratch per wide tile width (built once, for the tiles launched)

        def call(tiles: Tiles):  # the converter fixed block_m: the key tile and the stages vary
            prep.tiles = tiles
            wide = WIDE_TILE_FACTOR * tiles.block_n
            desc_k, desc_v = kv_descriptors(k, v, wide, prep.block_d)  # only unmasked (wide) tiles read them
            desc_ck = desc_cv = desc_ckm = desc_cvs = None
            if desc_k is not None and index.columns.shape[-1] > 0:
                if wide not in scratch:
                    scratch[wide] = _column_scratch(prep, k, v, index, heads, wide)
                desc_ck, desc_cv, desc_ckm, desc_cvs = scratch[wide]
            args = (q, k, v, *prep.guard_args(), prep.out, lse, desc_k, desc_v, desc_ck, desc_cv, desc_ckm, desc_cvs,
                    *prep.row_args(), heads, index.run_start, index.run_end, index.run_count, index.run_solid,
                    index.col_index, index.col_count, index.col_before, index.col_lead, index.diag_bits,
                    index.col_mask, prep.N, index.diag_bits.shape[-1], index.run_start.shape[-1],
                    index.col_index.shape[-1], index.col_count.shape[-1], prep.qk_scale,
                    *qkv_strides(q, k, v, prep.out), *prep.guard_strides(), slb, slh, sln)
            return prep.grid(), args, dict(
                **prep.meta(q, return_lse), PAD_WORDS=BITS_PAD_WORDS, DESC=desc_k is not None,
                COL_STAGES=COLUMN_STAGES, SOLID=index.all_solid, WIDE=wide, SCRATCH=desc_ck is not None,
                SCRATCH_STAGES=SCRATCH_STAGES)

        key = (q.dtype, prep.D, prep.tiles.block_m, return_lse, prep.qrows, index.all_solid,
               descriptors_ok(k, v, prep.block_d), index.columns.shape[-1] > 0)
        launch_fitted("vertical_slash", _vs_fwd, q.device, key, _candidates(prep.tiles), call)
    return finish(prep, return_lse)


def _candidates(preferred: Tiles) -> list[Tiles]:
    """``preferred`` then, at its ``block_m`` (the converter's), fewer stages and narrower key tiles
    where the device's shared memory is smaller (at D = 128 the preferred 2-byte tiles take
    ~229 KB with their 128-key wide tiles)."""
    out = fitted_stages(preferred)
    for block_n in (32, 16):
        if block_n < preferred.block_n:
            out += fitted_stages(Tiles(preferred.block_m, block_n, preferred.num_warps, min(2, preferred.num_stages)))
    return out


def _check_physical(prep: Prepared, index: VSIndex, device) -> None:
    """Every tensor field of ``index`` must have the shape, dtype and (contiguous) layout the
    kernel addresses it with, on ``device``. Only metadata is read: no host synchronisation, on
    every device and with ``validate`` on or off (the kernel reads each field through flat offsets
    computed from these shapes, so a mismatch would read out of bounds, not raise)."""
    B, Hg, n = prep.B, prep.Hg, prep.N
    if tuple(index.run_count.shape) != (B, Hg):
        raise ValueError(f"index is for [B, H]={tuple(index.run_count.shape)}, expected {(B, Hg)}")
    nqb = cdiv(n, prep.tiles.block_m)
    R = index.run_start.shape[-1] if index.run_start.dim() == 3 else -1
    NV = index.columns.shape[-1] if index.columns.dim() == 3 else -1
    NW = BITS_PAD_WORDS + cdiv(n, _WORD) + 1
    i32, i8 = torch.int32, torch.int8
    want = {
        "run_start": ((B, Hg, R), i32), "run_end": ((B, Hg, R), i32), "run_count": ((B, Hg), i32),
        "run_solid": ((B, Hg, R), i8), "columns": ((B, Hg, NV), i32), "col_index": ((B, Hg, nqb, NV), i32),
        "col_count": ((B, Hg, nqb), i32), "col_before": ((B, Hg, nqb), i32), "col_lead": ((B, Hg, nqb), i32),
        "diag_bits": ((B, Hg, NW), torch.int64), "col_mask": ((B, Hg, n), i8),
    }
    if R < 1:
        raise ValueError(f"index.run_start must have shape [B, H, R] with R >= 1, got {tuple(index.run_start.shape)}")
    for name, (shape, dtype) in want.items():
        x = getattr(index, name)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"index.{name} must be a tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(f"index.{name} must be contiguous with shape {shape}, got {tuple(x.shape)}"
                             + ("" if x.is_contiguous() else " (not contiguous)"))
        if x.dtype != dtype:
            raise TypeError(f"index.{name} must have dtype {dtype}, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"index must be on {device}, got index.{name} on {x.device}")


def _column_scratch(prep: Prepared, k, v, index: VSIndex, heads: torch.Tensor, wide: int):
    """Copy the K/V rows of each head's distinct columns into a contiguous ``[B, Hg, NV, D]``
    scratch (one launch) and return the descriptors ``(K, V, k_masked, v_safe)`` of its tiles of
    ``wide`` rows (``None`` where descriptors cannot be built). The ``k_masked`` / ``v_safe``
    scratches (the rows of the value guard's pair, read by a block's one masked scratch tile) are
    two more copies only when the guard is active (the values were not checked); otherwise they
    are the ``K`` / ``V`` scratches."""
    NV = index.columns.shape[-1]
    ck = torch.empty(prep.B, prep.Hg, NV, prep.D, dtype=k.dtype, device=k.device)
    cv = torch.empty_like(ck)
    safe = prep.k_masked is not k or prep.v_safe is not v
    ckm, cvs = (torch.empty_like(ck), torch.empty_like(ck)) if safe else (ck, cv)
    _gather_columns_kernel[(cdiv(NV, _GATHER_SLOTS), prep.Hg, prep.B)](
        k, v, prep.k_masked, prep.v_safe, ck, cv, ckm, cvs, index.columns, prep.lens, prep.starts, heads,
        prep.Hq // prep.Hkv, NV, int(safe), *k.stride(), *v.stride(), *prep.guard_strides(), HEAD_DIM=prep.D,
        BLOCK_D=prep.block_d, EVEN_D=prep.block_d == prep.D, BLOCK_C=_GATHER_SLOTS, num_warps=4)
    desc_ck, desc_cv = kv_descriptors(ck, cv, wide, prep.block_d)
    if desc_ck is None or not safe:
        return desc_ck, desc_cv, desc_ck, desc_cv
    return (desc_ck, desc_cv, *kv_descriptors(ckm, cvs, wide, prep.block_d))


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = True,
    fill_gaps: int = 0,
    dense_over: float | None = None,
    value_guard: ValueGuard | None = None,
):
    """Causal vertical-slash attention on the exact logical set.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (GQA inside the kernel), fp16/bf16/fp32,
            any strides, ``D`` in :data:`SUPPORTED_HEAD_DIMS`.
        vertical: ``[B, Hg, NV]`` int key columns (logical positions), -1 padded, any order,
            duplicates allowed; ``Hg = len(heads)`` or ``Hq``.
        slash: ``[B, Hg, NS]`` int diagonal offsets ``δ = i - j``, -1 padded, any order,
            duplicates allowed; offsets that run before position 0 are clipped.
        scale: softmax scale, default ``D ** -0.5``.
        seqlens, seqstarts: ``[B]`` ragged rows; padding is neither read nor written.
        q_seqlens, q_seqstarts: query rows that are part of the key rows (``q [B, Hq, Nq, D]``,
            ``Nq <= N``: a chunk after a cache, or a row's last tokens; docs/kernels.md).
        heads: 1-D int tensor of local query heads to compute; other heads are left untouched.
        out: optional ``[B, Hq, N, D]`` output to write into.
        return_lse: also return the log-sum-exp ``[B, Hq, N]`` (fp32).
        validate: check index/length values (host syncs); ``False`` keeps the call sync-free.
        fill_gaps: close the offsets over gaps of at most this many missing offsets first
            (:func:`minference.index_sets.slash_set`); the kernel computes that set exactly.
        dense_over: dense fallback of :func:`~minference.kernels.convert.convert_vertical_slash`:
            heads whose index runs more than ``dense_over`` times the dense causal key tiles
            compute dense causal attention instead (sync-free). ``None``: never.
        value_guard: ``(k_masked, v_safe)`` of :func:`minference.kernels.value_guard` for
            this ``k, v`` (see :func:`~minference.kernels.ashape_attention`).

    Returns:
        ``out [B, Hq, N, D]`` in q's dtype, or ``(out, lse)``.
    """
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out,
                   return_lse=return_lse, validate=validate, guard=value_guard)
    for name, idx in (("vertical", vertical), ("slash", slash)):
        check_index(name, idx, rank=3, lead=(prep.B, prep.Hg), device=q.device, upper=max(prep.N, 1),
                    values=validate)
    index = convert_vertical_slash(vertical, slash, prep.N, block_m=prep.tiles.block_m, fill_gaps=fill_gaps,
                                   dense_over=dense_over, block_n=prep.tiles.block_n)
    return _run(prep, q, k, v, index, return_lse)
