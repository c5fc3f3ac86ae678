"""A-shape attention: attention sinks plus a local sliding window, no materialised index.

Query ``i`` reads ``{0 .. min(g-1, i)} ∪ {max(0, i-w+1) .. i}`` for its head's ``(sink g, window
w)``. The kernel splits the set into two disjoint parts so a key reached by both counts once:

* sink part: ``j < g`` and ``j <= i - w`` (sinks that fall outside the window),
* window part: ``i - w < j <= i``.

Each part runs masked edge tiles and unmasked interior tiles in separate loops, so the interior
(almost all of the work for long rows) carries no masking work at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minference.kernels._common import (
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
    grid_blocks,
    interpreting,
    kv_descriptors,
    launch_fitted,
    prepare,
    qkv_strides,
)

from minference._checks import (
    check_budget,
    check_head_offset,
    check_key_split,
    clamp_budget,
    int32_constant,
    query_rows_bound,
    same_device,
)

__all__ = ["ashape_attention", "dense_attention", "key_split_count"]


@triton.jit
def _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh, row_start, rows,
                  row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn, svsd, qk_scale, t_begin,
                  t_end, key_end, sink, window,
                  MASKED: tl.constexpr, SINK_PART: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  EVEN_D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    """Key tiles ``[t, t + BLOCK_N)`` for ``t`` in ``range(t_begin, t_end, BLOCK_N)``; keys at or past
    ``key_end`` are never loaded. Unmasked tiles lie inside the row, may use descriptors and read
    ``k`` and ``v``; masked tiles read ``k_masked`` and ``v_safe``
    (:func:`minference.kernels._common.value_guard`)."""
    for t in range(t_begin, t_end, BLOCK_N):
        cols = t + offs_n  # [BN]
        if MASKED:
            k, v = _load_kv(km_base, vs_base, cols, cols < key_end, offs_d, d_ok, skmn, skmd, svsn, svsd,
                            True, EVEN_D)
        elif DESC:
            k, v = _load_kv_desc(desc_k, desc_v, b, kvh, row_start + t, BLOCK_N, BLOCK_D)
        else:
            k, v = _load_kv(k_base, v_base, cols, cols < key_end, offs_d, d_ok, skn, skd, svn, svd,
                            False, EVEN_D)
        s = _scores(q, k, PREC)  # [BM, BN]
        if MASKED:
            if SINK_PART:
                keep = (cols[None, :] < sink) & (cols[None, :] <= rows[:, None] - window)
            else:
                keep = (cols[None, :] > rows[:, None] - window) & (cols[None, :] <= rows[:, None])
            s = tl.where(keep & row_ok[:, None], s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)
    return acc, m_i, l_i


# index sizes only scale index addresses, and the log-sum-exp batch/head strides (N-dependent:
# divisible by 16 or not) only a per-row scalar store: specialising on them would only multiply
# compiles (the GPU tier draws many N)
@triton.jit(do_not_specialize=["head_offset", "slb", "slh"])
def _ashape_fwd(Q, K, V, KM, VS, O, LSE, desc_k, desc_v, lens, starts, q_los, q_row0s, heads, sinks, windows,
                head_offset, qk_scale,
                sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
                skmb, skmh, skmn, skmd, svsb, svsh, svsn, svsd, slb, slh, sln,
                group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                RETURN_LSE: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr, QROWS: tl.constexpr):
    b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    if tl.maximum(m0, q_lo) >= row_len:  # past the row, or a row without queries
        return
    sink = tl.load(sinks + head_offset + h)
    window = tl.load(windows + head_offset + h)
    offs_n, offs_d, d_ok, rows, row_ok, b64, q64, k_base, v_base, km_base, vs_base, q, acc, m_i, l_i = _prologue(
        Q, K, V, KM, VS, b, h, kvh, m0, row_len, row_start, q_lo, q_row0, sqb, sqh, sqn, sqd, skb, skh, skn, svb, svh,
        svn, skmb, skmh, skmn, svsb, svsh, svsn, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D)

    rows_full = (m0 >= q_lo) & (m0 + BLOCK_M <= row_len)  # every row of the block is a query
    last_row = tl.minimum(m0 + BLOCK_M, row_len) - 1

    # sink part: keys j < sink with j <= i - window for some row of the block
    sink_end = tl.minimum(sink, last_row - window + 1)
    sink_full = (tl.maximum(tl.minimum(sink, m0 - window + 1), 0) // BLOCK_N) * BLOCK_N
    sink_full = tl.where(rows_full, sink_full, 0)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, 0, sink_full, sink_end, sink, window,
                                  False, True, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, sink_full, sink_end, sink_end, sink, window,
                                  True, True, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    # window part: keys i - window < j <= i; tiles start at the block's first window key
    lo = tl.maximum(m0 - window + 1, 0)
    hi = last_row + 1
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    k_b = tl.minimum((m0 - lo + 1) // BLOCK_N, n_tiles)  # tiles ending at or before row m0
    k_a = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - window - lo, 0), BLOCK_N), k_b)
    k_b = tl.where(rows_full, k_b, 0)  # a block with padding rows runs every tile masked
    k_a = tl.where(rows_full, k_a, 0)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, lo, lo + k_a * BLOCK_N, hi, sink, window,
                                  True, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, lo + k_a * BLOCK_N, lo + k_b * BLOCK_N, hi,
                                  sink, window, False, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, lo + k_b * BLOCK_N, hi, hi, sink, window,
                                  True, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    _epilogue(acc, m_i, l_i, O, LSE, b64, h, q64, rows, row_ok, offs_d, d_ok, sob, soh, son, sod, slb, slh, sln,
              RETURN_LSE)


#: GPU tiles for 2-byte inputs by padded head dim (``BLOCK_D``). The window interior is long runs of
#: contiguous unmasked tiles. ``BLOCK_D = 128``: 128-key tiles beat 64. ``BLOCK_D <= 64`` (Qwen2.5's
#: D = 64): 128x64 tiles in 4 warps and 4 stages beat 128x128/8 warps/3 stages, dense and A-shape
#: (see docs/tuning.md#ashape-tiles).
_GPU_TILES_2BYTE = {64: Tiles(block_m=128, block_n=64, num_warps=4, num_stages=4),
                    128: Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3)}


#: Smaller tiles, tried in order where the preferred ones exceed the device's shared memory
#: (:func:`minference.kernels._common.fit_tiles`): fewer stages first, then 64-key tiles, then
#: 64-row blocks. At D = 128 the preferred 2-byte tiles take ~229 KB (more than an A100's 164 KB).
_GPU_FALLBACK_2BYTE = (Tiles(128, 128, 8, 2), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 2),
                       Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 1))
_GPU_FALLBACK_FP32 = (Tiles(32, 32, 4, 1), Tiles(32, 16, 4, 1))


def gpu_tiles_2byte(head_dim: int) -> Tiles:
    """The preferred GPU tiles for 2-byte inputs of head dim ``head_dim`` (:data:`_GPU_TILES_2BYTE`)."""
    return _GPU_TILES_2BYTE[64 if head_dim <= 64 else 128]


def _tiles(q: torch.Tensor) -> Tiles | None:
    if q.device.type == "cuda" and q.element_size() == 2:
        return gpu_tiles_2byte(q.shape[-1])
    return None  # the shared defaults (fp32 on the GPU, the interpreter)


def _candidates(q: torch.Tensor, preferred: Tiles) -> list[Tiles]:
    """``preferred`` and the fallbacks for ``q``'s dtype (the kernel takes any tile sizes)."""
    return [preferred, *(_GPU_FALLBACK_2BYTE if q.element_size() == 2 else _GPU_FALLBACK_FP32)]


def _budget(name: str, value, H_needed: int, device, minimum: int, validate: bool,
            read: torch.Tensor | None = None) -> torch.Tensor:
    """Per-global-head budget as an int32 tensor on ``device`` (an int becomes a constant; ints
    and int64 entries beyond int32 are clamped to :data:`minference._checks.BUDGET_MAX`, i.e. "the whole row").
    int32 tensors are used as given (no op per call: the dispatcher's own are made in range)."""
    if isinstance(value, torch.Tensor) and not same_device(value.device, device):
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    value = check_budget(name, value, total=H_needed, minimum=minimum, values=validate, read=read)
    if isinstance(value, int):
        return int32_constant(H_needed, value, device)
    if value.dtype != torch.int32:
        value = clamp_budget(value, minimum, device).to(torch.int32)
    return value.contiguous()


def ashape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: int | torch.Tensor,
    window: int | torch.Tensor,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    head_offset: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = True,
    value_guard: ValueGuard | None = None,
    checked: bool = False,
):
    """Causal A-shape (sinks + sliding window) attention.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (GQA inside the kernel), fp16/bf16/fp32,
            any strides, ``D`` in :data:`SUPPORTED_HEAD_DIMS`.
        sink: leading key positions every query reads (``g >= 0``): an int, or a 1-D int tensor
            indexed by global head ``head_offset + h``.
        window: local window width including the query itself (``w >= 1``), same forms.
        scale: softmax scale, default ``D ** -0.5`` (real head dim).
        seqlens, seqstarts: ``[B]`` ragged rows; padding is neither read nor written.
        q_seqlens, q_seqstarts: query rows that are part of the key rows (``q [B, Hq, Nq, D]``,
            ``Nq <= N``: a chunk after a cache, or a row's last tokens; docs/kernels.md).
        heads: 1-D int tensor of local query heads to compute; other heads are left untouched.
        head_offset: global id of local head 0 (tensor parallelism), used for tensor budgets.
        out: optional ``[B, Hq, N, D]`` output to write into (else allocated).
        return_lse: also return the log-sum-exp ``[B, Hq, N]`` (fp32, natural log).
        validate: check index/length values (host syncs); ``False`` keeps the call sync-free.
        value_guard: ``(k_masked, v_safe)`` of :func:`minference.kernels.value_guard` for this
            ``k, v`` (made once by a caller that runs several kernels on them); ``None``: made
            here (no pass over ``k`` and ``v`` when ``validate`` checked the values).
        checked: internal: the caller validated the arguments' form at its own edge (the dispatcher,
            through :mod:`minference.backend_triton`), so the shape, dtype and device checks
            are skipped (:func:`minference.kernels._common.prepare`). Default ``False``.

    Returns:
        ``out [B, Hq, N, D]`` in q's dtype, or ``(out, lse)``.
    """
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out,
                   return_lse=return_lse, validate=validate, tiles=_tiles(q), guard=value_guard, checked=checked)
    if not checked:
        check_head_offset(head_offset, prep.Hq, head_offset + prep.Hq, "the budgets")
    read = prep.head_ids().long() + head_offset if validate else None  # the entries the kernel reads
    sinks = _budget("sink", sink, head_offset + prep.Hq, q.device, 0, validate, read)
    windows = _budget("window", window, head_offset + prep.Hq, q.device, 1, validate, read)
    lse, sln = prep.lse_arg()
    slb, slh = prep.lse_strides()
    if prep.launches():
        def call(tiles: Tiles):
            prep.tiles = tiles
            desc_k, desc_v = kv_descriptors(k, v, tiles.block_n, prep.block_d)
            args = (q, k, v, *prep.guard_args(), prep.out, lse, desc_k, desc_v, *prep.row_args(), prep.head_ids(),
                    sinks, windows, head_offset, prep.qk_scale, *qkv_strides(q, k, v, prep.out),
                    *prep.guard_strides(), slb, slh, sln)
            return prep.grid(), args, dict(**prep.meta(q, return_lse), DESC=desc_k is not None)

        key = (q.dtype, prep.D, return_lse, prep.qrows, descriptors_ok(k, v, prep.block_d))
        launch_fitted("ashape", _ashape_fwd, q.device, key, _candidates(q, prep.tiles), call)
    return finish(prep, return_lse)


# --------------------------------------------------------------------------------------------
# dense attention with a key split (flash-decoding style): few query rows against long key rows
# --------------------------------------------------------------------------------------------
#
# Dense causal attention is the A-shape kernel's dense case (sink 0, a window as long as the row),
# one program per (query block, head, batch row). With few query rows (the dispatcher's dense tail:
# 128 rows against 120K keys) that grid is a handful of programs each walking every key tile in
# turn: latency-bound. The split runs ``n_split`` programs per (query block, head, batch row), each
# over a disjoint contiguous range of the block's key tiles through the same tile loop
# (:func:`_ashape_tiles`), writing its unnormalised output and softmax statistics (running max in
# the log2 domain, denominator) to float32 scratch; :func:`_dense_split_merge` then joins the
# splits exactly by log-sum-exp and writes the rows through the shared epilogue
# (:func:`minference.kernels._common._epilogue`). A split whose key range is empty writes
# ``m = -inf, l = 0`` and weighs nothing in the merge.

#: The automatic split fills the GPU with at most this many programs per SM: a whole number of
#: waves when two programs fit an SM (the 2-byte tiles at D <= 64), two equal waves when one does;
#: rounding down keeps a last, nearly empty wave from doubling the time ...
KEY_SPLIT_PROGRAMS_PER_SM = 2
#: ... gives every split at least this many key tiles (the merge and the scratch traffic are paid
#: once per split) ...
KEY_SPLIT_MIN_TILES = 8
#: ... and never more than this many splits (bounds the scratch).
KEY_SPLIT_MAX = 64
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """``multi_processor_count`` of a CUDA device (one query per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = int(torch.cuda.get_device_properties(index).multi_processor_count)
    return count


def key_split_count(programs: int, key_tiles: int, sms: int) -> int:
    """The automatic key split of a dense call whose unsplit grid has ``programs`` programs
    (query blocks x computed heads x batch rows) over rows of at most ``key_tiles`` key tiles, on
    ``sms`` SMs: ``(KEY_SPLIT_PROGRAMS_PER_SM * sms) // programs``, at most ``key_tiles //
    KEY_SPLIT_MIN_TILES`` and :data:`KEY_SPLIT_MAX`; 1 (no split) when that is below 2. Plain
    ints: shapes, never tensor values, so a CUDA graph replays the launch it captured."""
    if programs <= 0 or sms <= 0:
        return 1
    split = min(KEY_SPLIT_PROGRAMS_PER_SM * sms // programs, key_tiles // KEY_SPLIT_MIN_TILES, KEY_SPLIT_MAX)
    return split if split >= 2 else 1


def _auto_key_split(q: torch.Tensor, k: torch.Tensor, heads, q_seqlens, q_seqstarts) -> int:
    """The automatic key split of a call: :func:`shape_key_split` with the preferred tiles and the
    device's SM count on CUDA; 1 elsewhere (the interpreter)."""
    if q.device.type != "cuda" or interpreting():
        return 1
    return shape_key_split(q, k, heads, q_seqlens, q_seqstarts, _tiles(q) or default_tiles(q), _sm_count(q.device))


def shape_key_split(q: torch.Tensor, k: torch.Tensor, heads, q_seqlens, q_seqstarts, tiles: Tiles, sms: int) -> int:
    """:func:`key_split_count` for a call's arguments from their shapes alone: the unsplit grid
    (:func:`minference.kernels._common.grid_blocks`, as :meth:`~minference.kernels._common.Prepared.grid`
    launches it; with query rows an int ``q_seqlens`` bounds them, a tensor's values are never
    read) and the key tiles of ``N``."""
    B, Hq, Nq = q.shape[0], q.shape[1], q.shape[2]
    N = k.shape[2]
    qrows = q_seqlens is not None or q_seqstarts is not None or Nq != N
    blocks = grid_blocks(N, tiles.block_m, query_rows_bound(q_seqlens, Nq) if qrows else None)
    Hg = Hq if heads is None else heads.shape[0]
    return key_split_count(blocks * Hg * B, cdiv(N, tiles.block_n), sms)


@triton.jit(do_not_specialize=["n_split", "sps", "spb", "sph"])
def _dense_split_fwd(Q, K, V, KM, VS, PO, PM, PL, desc_k, desc_v, lens, starts, q_los, q_row0s, heads, n_split,
                     qk_scale, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     skmb, skmh, skmn, skmd, svsb, svsh, svsn, svsd, sps, spb, sph,
                     group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr,
                     QROWS: tl.constexpr):
    """One key split of one (query block, computed head, batch row): grid ``(blocks * n_split, Hg,
    B)``, axis 0 ``= j * n_split + split`` with ``j`` the block's place in the unsplit grid (last
    blocks first, as :func:`_program_ids`). Writes the rows' unnormalised output ``PO [S, B, Hg, R,
    BLOCK_D]`` and statistics ``PM, PL [S, B, Hg, R]`` (scratch row ``j * BLOCK_M + r``) for the
    block's query rows only."""
    b, g, h, kvh, _, _, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    split = tl.program_id(0) % n_split
    blk = tl.num_programs(0) // n_split - 1 - tl.program_id(0) // n_split
    m0 = (q_lo // BLOCK_M + blk) * BLOCK_M  # q_lo = 0 without query rows
    first = tl.maximum(m0, q_lo)  # the block's first query row
    if first >= row_len:  # past the row, or a row without queries
        return
    offs_n, offs_d, d_ok, rows, row_ok, b64, _, k_base, v_base, km_base, vs_base, q, acc, m_i, l_i = _prologue(
        Q, K, V, KM, VS, b, h, kvh, m0, row_len, row_start, q_lo, q_row0, sqb, sqh, sqn, sqd, skb, skh, skn, svb, svh,
        svn, skmb, skmh, skmn, svsb, svsh, svsn, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D)
    offs_m = tl.arange(0, BLOCK_M)  # the block's scratch rows (the prologue's arange again: one op after CSE)

    hi = tl.minimum(m0 + BLOCK_M, row_len)  # keys 0 .. hi - 1 (causal: up to the block's last row)
    n_tiles = tl.cdiv(hi, BLOCK_N)
    # tiles of keys at or before the first query row: every query row reads all of them (no window
    # edge in the dense case), and they lie inside the row, so they run unmasked even in a block
    # with rows that are not queries (those rows read q = 0 and are never stored)
    k_b = (first + 1) // BLOCK_N
    per = tl.cdiv(n_tiles, n_split)
    t0 = split * per
    t1 = tl.minimum(t0 + per, n_tiles)  # this split's tiles t0 .. t1 - 1 (none when t0 >= n_tiles)
    # the window part of the A-shape loop with a window of hi keys: ``j > i - hi`` holds for every
    # key of every query row, so only the causal edge and the row bounds mask
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, tl.minimum(t0, k_b) * BLOCK_N, tl.minimum(t1, k_b) * BLOCK_N, hi, 0,
                                  hi, False, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, km_base, vs_base, desc_k, desc_v, b, kvh,
                                  row_start, rows, row_ok, offs_n, offs_d, d_ok, skn, skd, svn, svd, skmn, skmd, svsn,
                                  svsd, qk_scale, tl.maximum(t0, k_b) * BLOCK_N, tl.minimum(t1 * BLOCK_N, hi), hi, 0,
                                  hi, True, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    stat = split.to(tl.int64) * sps + b64 * spb + g.to(tl.int64) * sph + blk * BLOCK_M + offs_m  # [BM]
    tl.store(PM + stat, m_i, mask=row_ok)
    tl.store(PL + stat, l_i, mask=row_ok)
    tl.store(PO + stat[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_split", "sps", "spb", "sph", "slb", "slh"])
def _dense_split_merge(O, LSE, PO, PM, PL, lens, starts, q_los, q_row0s, heads, n_split, sps, spb, sph,
                       sob, soh, son, sod, slb, slh, sln,
                       group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       RETURN_LSE: tl.constexpr, QROWS: tl.constexpr):
    """Join the ``n_split`` partial results of one (query block, computed head, batch row) by
    log-sum-exp and write its query rows (grid: the unsplit one, ``(blocks, Hg, B)``)."""
    b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    if tl.maximum(m0, q_lo) >= row_len:
        return
    blk = tl.num_programs(0) - 1 - tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = m0 + offs_m
    row_ok = (rows >= q_lo) & (rows < row_len)
    b64 = b.to(tl.int64)
    stat = b64 * spb + g.to(tl.int64) * sph + blk * BLOCK_M + offs_m  # [BM] split 0's
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, n_split):
        m = tl.maximum(m, tl.load(PM + s * sps + stat, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)  # rows no split saw a key of: weights 0, not NaN
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, n_split):
        at = s * sps + stat
        w = tl.math.exp2(tl.load(PM + at, mask=row_ok, other=float("-inf")) - m_use)  # empty split: 0
        l_i += w * tl.load(PL + at, mask=row_ok, other=0.0)
        part = tl.load(PO + at[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        acc += w[:, None] * part
    _epilogue(acc, m, l_i, O, LSE, b64, h, q_row0.to(tl.int64), rows, row_ok, offs_d, d_ok, sob, soh, son, sod, slb,
              slh, sln, RETURN_LSE)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    key_split: int | None = None,
    value_guard: ValueGuard | None = None,
    checked: bool = False,
):
    """Causal dense attention (float64 twin: :func:`minference.reference.attention.dense_attention`),
    on whole rows or query rows, with an optional key split for calls of few query rows.

    Arguments as :func:`ashape_attention` (no budgets). ``key_split``: programs per (query block,
    computed head, batch row), each over a disjoint contiguous range of the block's key tiles,
    joined exactly by log-sum-exp (docs/kernels.md, "dense tail"). ``None`` (default): chosen from
    the shapes and the device's SM count (:func:`key_split_count`; always 1 off CUDA); 1: the
    unsplit call, exactly ``ashape_attention(q, k, v, 0, max(1, N), ...)``; any ``n >= 1`` is
    computed as given, splits without keys included (tests force it under the interpreter).
    Sync-free with ``validate=False``: the split and the float32 scratch (``torch.empty``) follow
    the shapes only, so the call can be captured in a CUDA graph. ``value_guard``, ``checked``
    (internal: the caller validated the arguments' form): as :func:`ashape_attention`.
    """
    check_key_split(key_split)
    split = _auto_key_split(q, k, heads, q_seqlens, q_seqstarts) if key_split is None else key_split
    if split == 1:
        return ashape_attention(q, k, v, 0, max(1, k.shape[2]), scale=scale, seqlens=seqlens, seqstarts=seqstarts,
                                q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, heads=heads, out=out,
                                return_lse=return_lse, validate=validate, value_guard=value_guard, checked=checked)
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out,
                   return_lse=return_lse, validate=validate, tiles=_tiles(q), guard=value_guard, checked=checked)
    if prep.launches():
        _launch_split(prep, q, k, v, split, return_lse)
    return finish(prep, return_lse)


def _launch_split(prep, q, k, v, split: int, return_lse: bool) -> None:
    """The split launch (fitted tiles, float32 scratch for them) and the merge."""
    scratch = {}

    def call(tiles: Tiles):
        prep.tiles = tiles
        blocks, Hg, B = prep.grid()
        R = blocks * tiles.block_m
        f32 = dict(dtype=torch.float32, device=q.device)
        po = torch.empty(split, B, Hg, R, prep.block_d, **f32)
        pm = torch.empty(split, B, Hg, R, **f32)
        pl = torch.empty(split, B, Hg, R, **f32)
        scratch.update(po=po, pm=pm, pl=pl, strides=(B * Hg * R, Hg * R, R))
        desc_k, desc_v = kv_descriptors(k, v, tiles.block_n, prep.block_d)
        args = (q, k, v, *prep.guard_args(), po, pm, pl, desc_k, desc_v, *prep.row_args(), prep.head_ids(), split,
                prep.qk_scale, *q.stride(), *k.stride(), *v.stride(), *prep.guard_strides(), *scratch["strides"])
        meta = prep.meta(q, False)
        del meta["RETURN_LSE"]
        return (blocks * split, Hg, B), args, dict(meta, DESC=desc_k is not None)

    key = (q.dtype, prep.D, prep.qrows, descriptors_ok(k, v, prep.block_d))
    launch_fitted("dense_split", _dense_split_fwd, q.device, key, _candidates(q, prep.tiles), call)
    lse, sln = prep.lse_arg()
    slb, slh = prep.lse_strides()
    meta = prep.meta(q, return_lse)
    _dense_split_merge[prep.grid()](
        prep.out, lse, scratch["po"], scratch["pm"], scratch["pl"], *prep.row_args(), prep.head_ids(), split,
        *scratch["strides"], *prep.out.stride(), slb, slh, sln,
        group=meta["group"], HEAD_DIM=meta["HEAD_DIM"], BLOCK_D=meta["BLOCK_D"], BLOCK_M=meta["BLOCK_M"],
        RETURN_LSE=return_lse, QROWS=meta["QROWS"], num_warps=4)
