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
    _load_kv,
    _load_kv_desc,
    _load_rows,
    _program_ids,
    _scores,
    _softmax_update,
    _store_rows,
    descriptors_ok,
    finish,
    kv_descriptors,
    launch_fitted,
    prepare,
    qkv_strides,
)

from minference._checks import check_budget, check_head_offset, clamp_budget, int32_constant, same_device

__all__ = ["ashape_attention"]


@triton.jit
def _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows, row_ok, offs_n,
                  offs_d, d_ok, skn, skd, svn, svd, qk_scale, t_begin, t_end, key_end, sink, window,
                  MASKED: tl.constexpr, SINK_PART: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  EVEN_D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    """Key tiles ``[t, t + BLOCK_N)`` for ``t`` in ``range(t_begin, t_end, BLOCK_N)``; keys at or past
    ``key_end`` are never loaded. Unmasked tiles lie inside the row and may use descriptors."""
    for t in range(t_begin, t_end, BLOCK_N):
        cols = t + offs_n  # [BN]
        if DESC and not MASKED:
            k, v = _load_kv_desc(desc_k, desc_v, b, kvh, row_start + t, BLOCK_N, BLOCK_D)
        else:
            k, v = _load_kv(k_base, v_base, cols, cols < key_end, offs_d, d_ok, skn, skd, svn, svd,
                            MASKED, EVEN_D)
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
def _ashape_fwd(Q, K, V, O, LSE, desc_k, desc_v, lens, starts, q_los, q_row0s, heads, sinks, windows, head_offset,
                qk_scale,
                sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
                slb, slh, sln,
                group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                RETURN_LSE: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr, QROWS: tl.constexpr):
    b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    if tl.maximum(m0, q_lo) >= row_len:  # past the row, or a row without queries
        return
    sink = tl.load(sinks + head_offset + h)
    window = tl.load(windows + head_offset + h)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = m0 + offs_m  # [BM] logical
    row_ok = (rows >= q_lo) & (rows < row_len)
    b64 = b.to(tl.int64)
    s64 = row_start.to(tl.int64)
    q64 = q_row0.to(tl.int64)
    q_base = Q + b64 * sqb + h.to(tl.int64) * sqh + q64 * sqn
    k_base = K + b64 * skb + kvh.to(tl.int64) * skh + s64 * skn
    v_base = V + b64 * svb + kvh.to(tl.int64) * svh + s64 * svn
    q = _load_rows(q_base, rows, row_ok, offs_d, d_ok, sqn, sqd, EVEN_D)  # [BM, BD]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    rows_full = (m0 >= q_lo) & (m0 + BLOCK_M <= row_len)  # every row of the block is a query
    last_row = tl.minimum(m0 + BLOCK_M, row_len) - 1

    # sink part: keys j < sink with j <= i - window for some row of the block
    sink_end = tl.minimum(sink, last_row - window + 1)
    sink_full = (tl.maximum(tl.minimum(sink, m0 - window + 1), 0) // BLOCK_N) * BLOCK_N
    sink_full = tl.where(rows_full, sink_full, 0)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows,
                                  row_ok, offs_n, offs_d, d_ok,
                                  skn, skd, svn, svd, qk_scale, 0, sink_full, sink_end, sink, window,
                                  False, True, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows,
                                  row_ok, offs_n, offs_d, d_ok,
                                  skn, skd, svn, svd, qk_scale, sink_full, sink_end, sink_end, sink, window,
                                  True, True, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    # window part: keys i - window < j <= i; tiles start at the block's first window key
    lo = tl.maximum(m0 - window + 1, 0)
    hi = last_row + 1
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    k_b = tl.minimum((m0 - lo + 1) // BLOCK_N, n_tiles)  # tiles ending at or before row m0
    k_a = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - window - lo, 0), BLOCK_N), k_b)
    k_b = tl.where(rows_full, k_b, 0)  # a block with padding rows runs every tile masked
    k_a = tl.where(rows_full, k_a, 0)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows,
                                  row_ok, offs_n, offs_d, d_ok,
                                  skn, skd, svn, svd, qk_scale, lo, lo + k_a * BLOCK_N, hi, sink, window,
                                  True, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows,
                                  row_ok, offs_n, offs_d, d_ok,
                                  skn, skd, svn, svd, qk_scale, lo + k_a * BLOCK_N, lo + k_b * BLOCK_N, hi,
                                  sink, window, False, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)
    acc, m_i, l_i = _ashape_tiles(acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, b, kvh, row_start, rows,
                                  row_ok, offs_n, offs_d, d_ok,
                                  skn, skd, svn, svd, qk_scale, lo + k_b * BLOCK_N, hi, hi, sink, window,
                                  True, False, BLOCK_N, BLOCK_D, EVEN_D, PREC, DESC)

    o_base = O + b64 * sob + h.to(tl.int64) * soh + q64 * son
    lse_base = LSE + b64 * slb + h.to(tl.int64) * slh + q64 * sln
    _store_rows(acc, m_i, l_i, o_base, lse_base, rows, row_ok, offs_d, d_ok, son, sod, sln, RETURN_LSE)


#: GPU tiles for 2-byte inputs by padded head dim (``BLOCK_D``). The window interior is long runs of
#: contiguous unmasked tiles. ``BLOCK_D = 128``: 128-key tiles beat 64 (H200 loop-ceiling run: 511
#: vs 501 TFLOP/s with descriptor loads). ``BLOCK_D <= 64`` (Qwen2.5's D = 64): 128x64 tiles in 4
#: warps and 4 stages; H200, s13, 120K, Hq 14, Hkv 2: dense (window N) 65.1 ms against 79.0 with
#: 128x128/8 warps/3 stages, A-shape 128/4096 4.73 against 5.97 (``bench_kernels.py --sweep tiles``).
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

    Returns:
        ``out [B, Hq, N, D]`` in q's dtype, or ``(out, lse)``.
    """
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out,
                   return_lse=return_lse, validate=validate, tiles=_tiles(q))
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
            args = (q, k, v, prep.out, lse, desc_k, desc_v, *prep.row_args(), prep.head_ids(), sinks, windows,
                    head_offset, prep.qk_scale, *qkv_strides(q, k, v, prep.out), slb, slh, sln)
            return prep.grid(), args, dict(**prep.meta(q, return_lse), DESC=desc_k is not None)

        key = (q.dtype, prep.D, return_lse, prep.qrows, descriptors_ok(k, v, prep.block_d))
        launch_fitted("ashape", _ashape_fwd, q.device, key, _candidates(q, prep.tiles), call)
    return finish(prep, return_lse)
