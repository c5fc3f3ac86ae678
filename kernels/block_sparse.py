"""Block-sparse attention: per query block, a list of key blocks of the same size.

Query ``i`` reads ``{j : j // block ∈ J(i // block), j <= i}``. The launcher turns the raw list
(any order, duplicates, -1 padding, blocks above the diagonal) into a sorted, deduplicated list
of *off-diagonal* key blocks plus a flag for the diagonal block (torch ops, no host sync). The
kernel runs off-diagonal blocks with no masking at all (they are entirely causal and inside the
row), then the diagonal block with the causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from minference.kernels._common import (
    INTERPRET_TILES,
    MIN_DOT,
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
    finish,
    fitted_stages,
    kv_descriptors,
    launch_fitted,
    prepare,
    qkv_strides,
)
from minference.kernels.convert import _compact

from minference._checks import arange_constant, capturing, check_index

__all__ = ["block_sparse_attention", "BLOCK_SIZES"]

#: Block sizes the kernel runs (the query tile is the routing block, the key tile too unless
#: :data:`_KEY_SPLIT` splits it; powers of two for tl.arange).
BLOCK_SIZES = (16, 32, 64, 128)
#: Warps per program by block size on the GPU (a 64 x 64 tile needs fewer warps than 128 x 128).
_GPU_WARPS = {16: 4, 32: 4, 64: 4, 128: 8}
#: Pipeline stages by block size: each block is a random jump, so deeper prefetch hides it. 64: 5
#: stages, faster than 3; 128 (D = 128): 5, 16% less time per tile than 2, and it fits an H100's
#: 227 KB (the launcher drops stages where a device has less; see docs/tuning.md#bs-stages).
_GPU_STAGES = {16: 3, 32: 3, 64: 5, 128: 5}
#: ``(warps, stages)`` for 2-byte inputs at head dims up to 64 (half the K/V bytes of D = 128 per
#: stage), where they differ from the tables above. Block 128: 4 warps, 5 stages, faster than 8
#: warps and 2 at the Qwen shape (see docs/tuning.md#bs-small-d).
_GPU_SMALL_D = {128: (4, 5)}
_GPU_STAGES_FP32 = {16: 2, 32: 2, 64: 2, 128: 1}
#: Key tiles per routing block by block size (the kernel's key tile is ``block // split``; query
#: tiles stay the routing block), on the GPU and in the interpreter alike. 1 everywhere until a
#: measurement says otherwise (docs/tuning.md#bs-split).
_KEY_SPLIT: dict[int, int] = {}


# index sizes only scale index addresses, and the log-sum-exp batch/head strides (N-dependent:
# divisible by 16 or not) only a per-row scalar store: specialising on them would only multiply
# compiles (the GPU tier draws many N)
@triton.jit(do_not_specialize=["n_k", "n_qblk", "slb", "slh"])
def _bs_fwd(Q, K, V, KM, VS, O, LSE, desc_k, desc_v, lens, starts, q_los, q_row0s, heads, kv_blocks, kv_count,
            has_diag, n_k, n_qblk, qk_scale,
            sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
            skmb, skmh, skmn, skmd, svsb, svsh, svsn, svsd, slb, slh, sln,
            group, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            RETURN_LSE: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr, QROWS: tl.constexpr):
    b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0 = _program_ids(
        lens, starts, heads, q_los, q_row0s, group, BLOCK_M, QROWS)
    if tl.maximum(m0, q_lo) >= row_len:  # past the row, or a row without queries
        return
    offs_n, offs_d, d_ok, rows, row_ok, b64, q64, k_base, v_base, km_base, vs_base, q, acc, m_i, l_i = _prologue(
        Q, K, V, KM, VS, b, h, kvh, m0, row_len, row_start, q_lo, q_row0, sqb, sqh, sqn, sqd, skb, skh, skn, svb, svh,
        svn, skmb, skmh, skmn, svsb, svsh, svsn, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D)

    slot = (b64 * tl.num_programs(1) + g) * n_qblk + qblk  # the index has a row per query block of the key row
    ids = kv_blocks + slot * n_k

    # off-diagonal blocks: every key precedes row m0 and lies inside the row, so no mask
    # (query rows past the row's end compute throw-away values and are never stored). A routing
    # block (BLOCK_M keys) is SPLIT key tiles of BLOCK_N, one loop step each.
    SPLIT: tl.constexpr = BLOCK_M // BLOCK_N
    for kk in range(0, tl.load(kv_count + slot) * SPLIT):
        if SPLIT == 1:
            t = tl.load(ids + kk) * BLOCK_N
        else:
            t = tl.load(ids + kk // SPLIT) * BLOCK_M + (kk % SPLIT) * BLOCK_N
        if DESC:
            k, v = _load_kv_desc(desc_k, desc_v, b, kvh, row_start + t, BLOCK_N, BLOCK_D)
        else:
            cols = t + offs_n  # [BN]
            k, v = _load_kv(k_base, v_base, cols, cols < row_len, offs_d, d_ok, skn, skd, svn, svd, False, EVEN_D)
        s = _scores(q, k, PREC)
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)

    # the diagonal block, causal-masked: key rows from k_masked, value rows from v_safe
    if tl.load(has_diag + slot) != 0:
        for sub in tl.static_range(SPLIT):
            cols = m0 + sub * BLOCK_N + offs_n
            col_ok = cols < row_len
            k, v = _load_kv(km_base, vs_base, cols, col_ok, offs_d, d_ok, skmn, skmd, svsn, svsd, True, EVEN_D)
            s = _scores(q, k, PREC)
            keep = (cols[None, :] <= rows[:, None]) & row_ok[:, None] & col_ok[None, :]
            s = tl.where(keep, s, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC)

    _epilogue(acc, m_i, l_i, O, LSE, b64, h, q64, rows, row_ok, offs_d, d_ok, sob, soh, son, sod, slb, slh, sln,
              RETURN_LSE)


def _key_tile(block: int) -> int:
    """The kernel's key tile for routing block ``block`` (:data:`_KEY_SPLIT`), checked."""
    split = _KEY_SPLIT.get(block, 1)
    if split < 1 or block % split or block // split < MIN_DOT:
        raise ValueError(f"block_sparse._KEY_SPLIT[{block}] = {split}: the key tile must be a whole part of the "
                         f"block and at least {MIN_DOT} keys")
    return block // split


def _tiles(q: torch.Tensor, block: int) -> Tiles:
    if q.device.type != "cuda":
        return Tiles(block_m=block, block_n=_key_tile(block), num_warps=INTERPRET_TILES.num_warps,
                     num_stages=INTERPRET_TILES.num_stages)
    return gpu_tiles(q, block)


def gpu_tiles(q: torch.Tensor, block: int) -> Tiles:
    """The GPU tiles for ``q``'s dtype and head dim at routing block ``block`` (the tables above;
    :func:`_tiles` picks them for CUDA tensors, ``benchmarks/sm90_registers.py`` for CPU ones)."""
    if q.dtype == torch.float32:
        warps, stages = _GPU_WARPS[block], _GPU_STAGES_FP32[block]
    elif q.shape[-1] <= 64 and block in _GPU_SMALL_D:
        warps, stages = _GPU_SMALL_D[block]
    else:
        warps, stages = _GPU_WARPS[block], _GPU_STAGES[block]
    return Tiles(block_m=block, block_n=_key_tile(block), num_warps=warps, num_stages=stages)


def normalize_blocks(blocks: torch.Tensor, *,
                     ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocks [B, H, NQB, K]`` -> ``(off_diagonal [B, H, NQB, K] ascending distinct ids < I, -1
    after; count [B, H, NQB]; has_diag [B, H, NQB] int8)`` for query block ``I``. No host sync.

    ``ascending``: every row of ``blocks`` already holds distinct ids in ``[0, I]``, ascending,
    then only -1 (what the builders' one-launch selection writes:
    :func:`minference.kernels.block_index_ascending`); the diagonal is then the last id
    of its row, and dropping it gives the same result without the sort and the compaction (5 ops
    instead of ~25)."""
    nqb = blocks.shape[-2]
    I = arange_constant(nqb, blocks.device)[:, None]  # [NQB, 1]
    if ascending:
        diag = blocks == I
        off = blocks.masked_fill(diag, -1).to(torch.int32).contiguous()
        return off, (off >= 0).sum(-1, dtype=torch.int32), diag.sum(-1, dtype=torch.int8)  # distinct: 0 or 1
    x = torch.where((blocks >= 0) & (blocks <= I), blocks, nqb).sort(dim=-1).values  # ids in their own dtype
    first = (x < nqb) & (x != F.pad(x[..., :-1], (1, 0), value=-1))
    off, count = _compact(x, first & (x < I))
    has_diag = (first & (x == I)).any(-1).to(torch.int8)
    return off, count, has_diag


def _check_blocks_args(ascending: object, block: object) -> None:
    """``ascending`` and ``block`` of :func:`block_sparse_attention`."""
    if not isinstance(ascending, bool):
        raise TypeError(f"ascending must be a bool, got {type(ascending).__name__}")
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block}")


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block: int = 64,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    q_seqlens: int | torch.Tensor | None = None,
    q_seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = True,
    ascending: bool = False,
    value_guard: ValueGuard | None = None,
    checked: bool = False,
):
    """Causal block-sparse attention.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (GQA inside the kernel), fp16/bf16/fp32,
            any strides, ``D`` in :data:`SUPPORTED_HEAD_DIMS`.
        blocks: ``[B, Hg, NQB, K]`` int key-block ids per query block (``NQB = ceil(N / block)``),
            -1 padded, any order, duplicates allowed; blocks above the diagonal contribute nothing.
        block: block size for queries and keys, one of :data:`BLOCK_SIZES` (default 64).
        scale: softmax scale, default ``D ** -0.5``.
        seqlens, seqstarts: ``[B]`` ragged rows (blocks are in each row's logical positions).
        q_seqlens, q_seqstarts: query rows that are part of the key rows (``q [B, Hq, Nq, D]``,
            ``Nq <= N``; ``blocks`` keeps a row per query block of the key row; docs/kernels.md).
        heads: 1-D int tensor of local query heads to compute; other heads are left untouched.
        out: optional ``[B, Hq, N, D]`` output to write into.
        return_lse: also return the log-sum-exp ``[B, Hq, N]`` (fp32).
        validate: check index/length values (host syncs); ``False`` keeps the call sync-free.
        ascending: ``blocks`` rows are already distinct causal ids in ascending order, -1 after
            (the builders' one-launch selection; :func:`normalize_blocks`), so the launcher skips
            its sort. With ``validate`` that promise is checked (a host read).
        value_guard: ``(k_masked, v_safe)`` of :func:`minference.kernels.value_guard` for
            this ``k, v`` (see :func:`~minference.kernels.ashape_attention`).
        checked: internal: the caller validated the arguments' form (``blocks`` and ``block``
            included) at its own edge (see :func:`~minference.kernels.ashape_attention`).

    Returns:
        ``out [B, Hq, N, D]`` in q's dtype, or ``(out, lse)``.
    """
    if not checked:
        _check_blocks_args(ascending, block)
    prep = prepare(q, k, v, scale=scale, seqlens=seqlens, seqstarts=seqstarts, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, heads=heads, out=out, return_lse=return_lse, validate=validate,
                   tiles=_tiles(q, block), guard=value_guard, checked=checked)
    nqb = cdiv(prep.N, block)
    if not checked or validate:
        check_index("blocks", blocks, rank=4, lead=(prep.B, prep.Hg, nqb), device=q.device, upper=max(nqb, 1),
                    values=validate)
    lse, sln = prep.lse_arg()
    slb, slh = prep.lse_strides()
    if prep.launches():
        off, count, has_diag = normalize_blocks(blocks, ascending=ascending)
        if ascending and validate and not capturing():
            general = normalize_blocks(blocks)
            if not all(torch.equal(a, b) for a, b in zip((off, count, has_diag), general)):
                raise ValueError("ascending=True but blocks rows are not distinct causal ids in ascending order "
                                 "followed by -1 only")
        desc_k, desc_v = kv_descriptors(k, v, prep.tiles.block_n, prep.block_d)

        def call(tiles: Tiles):  # the routing block and the split fix the tile sizes: only the stages vary
            prep.tiles = tiles
            args = (q, k, v, *prep.guard_args(), prep.out, lse, desc_k, desc_v, *prep.row_args(), prep.head_ids(),
                    off, count, has_diag, off.shape[-1], nqb, prep.qk_scale, *qkv_strides(q, k, v, prep.out),
                    *prep.guard_strides(), slb, slh, sln)
            return prep.grid(), args, dict(**prep.meta(q, return_lse), DESC=desc_k is not None)

        key = (q.dtype, prep.D, block, prep.tiles.block_n, return_lse, prep.qrows, desc_k is not None)
        launch_fitted("block_sparse", _bs_fwd, q.device, key, fitted_stages(prep.tiles), call)
    return finish(prep, return_lse)
