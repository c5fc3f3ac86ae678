"""What the three attention kernels share: the program prologue, the online-softmax tile update
(one home), tile loads, the row epilogue, and the host-side preparation (validation, allocation,
tile configuration).

Conventions inside every kernel:

* one program per ``(query block, computed head, batch row)``; grid ``(ceil(N / BLOCK_M), Hg, B)``,
  query blocks launched last-first so the longest causal rows start earliest;
* positions are *logical* (0 = the row's first token); the row's tokens sit at physical
  ``seqstarts[b] + i`` on the N axis, so a pointer is ``base + (start + i) * stride_n``;
* the softmax lives in the log2 domain: raw products ``q . k`` are masked with ``-inf`` *before*
  the running max, which is kept as ``max(q . k) * scale * log2(e)``, and the update is
  ``exp2(s * scale * log2(e) - m)`` (one fused multiply-add per score);
* unmasked tiles whose keys all lie inside the row may load K/V through tensor descriptors
  (TMA on Hopper, ``DESC``); masked tiles always use pointer loads with ``other=0``.
* non-finite values (docs/contract.md): unmasked tiles read ``k`` and ``v`` themselves (every
  row keeps every key there); masked tiles read their key rows from ``k_masked`` (a NaN key row
  where the value row is not finite) and their value rows from ``v_safe`` (those rows zeroed),
  both made once per call by one pass (:func:`value_guard`): the masked tile's own
  ``where(keep, s, -inf)`` leaves the NaN score only where a row keeps such a key, so a
  non-finite value reaches exactly the rows that keep its key, with no arithmetic added in the
  kernels (pointer swaps only).
* every program opens with :func:`_program_ids`, its early return (a block past its row), then
  :func:`_prologue` (offsets, base pointers, the ``q`` tile, the softmax state), and closes with
  :func:`_epilogue` (the output and log-sum-exp addresses, then :func:`_store_rows`);
* the epilogue writes only rows ``i < seqlens[b]`` and only the computed head; an empty row
  (no key at all) is written as zeros with log-sum-exp ``-inf``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minference._checks import (
    arange_constant,
    capturing,
    check_finite_kv,
    check_finite_rows,
    check_out,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    check_tensor,
    default_scale,
    int32_constant,
    query_rows_bound,
    same_device,
    uniform_query_rows,
)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

#: Head dimensions the kernels accept; each is padded to the next power of two in registers
#: (masked loads), and the softmax scale always comes from the real ``D``.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128)

_INT_DTYPES = (torch.int32, torch.int64)
#: Next power of two of every head dim up to 256.
_POW2 = [1] + [1 << (n - 1).bit_length() for n in range(1, 257)]


#: Smallest tile side ``tl.dot`` accepts.
MIN_DOT = 16


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2(n)`` for a host int (0 for ``n <= 0``), in plain Python: the
    Triton helper is a ``constexpr_function`` that costs microseconds of host time a call, and
    the launchers call it several times per launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv(a, b)`` (``ceil(a / b)`` for ``b > 0``) for host ints, in plain Python
    (:func:`next_pow2` says why)."""
    return -(-a // b)


def grid_blocks(N: int, block_m: int, q_bound: int | None) -> int:
    """Query blocks on axis 0 of a kernel grid: ``ceil(N / block_m)`` for whole rows; with query
    rows (``q_bound``: the most query rows of a batch row) the blocks that ``q_bound`` rows
    starting anywhere can touch, one more than they fill (0 without any). Shapes only, so the
    launch that :meth:`Prepared.grid` makes can be predicted before it (the key split)."""
    if q_bound is None:
        return cdiv(N, block_m)
    return cdiv(q_bound, block_m) + 1 if q_bound else 0


# --------------------------------------------------------------------------------------------
# device helpers (shared by ashape.py, vertical_slash.py, block_sparse.py)
# --------------------------------------------------------------------------------------------


@triton.jit
def _program_ids(lens_ptr, starts_ptr, heads_ptr, q_los_ptr, q_row0s_ptr, group, BLOCK_M: tl.constexpr,
                 QROWS: tl.constexpr):
    """Decode the program id: ``(b, g, h, kvh, qblk, m0, row_len, row_start, q_lo, q_row0)``. The
    GQA group and the computed heads are runtime values (one scalar load): as constexprs they only
    multiplied the compiled variants.

    Query blocks are in the row's positions (``m0 = qblk * BLOCK_M``). With query rows
    (``QROWS``) only positions ``q_lo .. row_len - 1`` are queries, the grid covers the blocks
    from ``q_lo``'s on, and position ``i``'s query (and output) row is ``q_row0 + i`` on q's N
    axis (``q_row0`` may be negative: it is only ever offset by query positions); otherwise
    ``q_lo = 0`` and ``q_row0 = row_start``."""
    g = tl.program_id(1)
    b = tl.program_id(2)
    h = tl.load(heads_ptr + g)
    kvh = h // group
    row_len = tl.load(lens_ptr + b)
    row_start = tl.load(starts_ptr + b)
    if QROWS:
        q_lo = tl.load(q_los_ptr + b)
        q_row0 = tl.load(q_row0s_ptr + b)
        qblk = q_lo // BLOCK_M + tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        q_lo = 0
        q_row0 = row_start
        qblk = tl.num_programs(0) - 1 - tl.program_id(0)
    return b, g, h, kvh, qblk, qblk * BLOCK_M, row_len, row_start, q_lo, q_row0


@triton.jit
def _load_rows(base, rows, row_ok, offs_d, d_ok, stride_n, stride_d, EVEN_D: tl.constexpr):
    """Load ``[BLOCK_M, BLOCK_D]`` rows at int64 offsets; rows outside ``row_ok`` read 0."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d
    if EVEN_D:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def _load_kv(k_base, v_base, cols, col_ok, offs_d, d_ok, skn, skd, svn, svd,
             MASK_COLS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load the K and V rows of key positions ``cols [BLOCK_N]`` (physical, int64 addressing)."""
    c = cols.to(tl.int64)
    kp = k_base + c[:, None] * skn + offs_d[None, :] * skd  # [BN, BD]
    vp = v_base + c[:, None] * svn + offs_d[None, :] * svd  # [BN, BD]
    if MASK_COLS:
        if EVEN_D:
            k = tl.load(kp, mask=col_ok[:, None], other=0.0)
            v = tl.load(vp, mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(kp, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(vp, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(kp)
            v = tl.load(vp)
        else:
            k = tl.load(kp, mask=d_ok[None, :], other=0.0)
            v = tl.load(vp, mask=d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _load_kv_desc(desc_k, desc_v, b, kvh, p0, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """K and V rows ``p0 .. p0 + BLOCK_N - 1`` (physical) through tensor descriptors (TMA on
    Hopper). Only for tiles whose keys all lie inside the row: nothing here masks."""
    k = desc_k.load([b, kvh, p0, 0]).reshape(BLOCK_N, BLOCK_D)
    v = desc_v.load([b, kvh, p0, 0]).reshape(BLOCK_N, BLOCK_D)
    return k, v


@triton.jit
def _scores(q, k, PREC: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` raw fp32 products ``q . k``; :func:`_softmax_update` applies the
    scale (masking with ``-inf`` before that is exact: the scale is positive)."""
    return tl.dot(q, tl.trans(k), input_precision=PREC)


@triton.jit
def _softmax_update(acc, m_i, l_i, s, v, qk_scale, PREC: tl.constexpr):
    """One online-softmax step over a tile: the only copy, used by all three kernels.

    ``s [BM, BN]`` are raw products with every excluded entry already ``-inf``; ``qk_scale =
    scale * log2 e > 0``. ``acc [BM, BD]`` is the unnormalised output, ``m_i`` the running max in
    the log2 domain, ``l_i`` the running denominator (all fp32). The row max is taken on the raw
    products and scaled once per row, so each score costs one fused multiply-add before ``exp2``.
    A row that has seen only ``-inf`` keeps ``m_i = -inf, l_i = 0``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: avoid inf - inf
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, o_base, lse_base, rows, row_ok, offs_d, d_ok, son, sod, sln,
                RETURN_LSE: tl.constexpr):
    """Normalise and write the block's valid rows (zeros and ``lse = -inf`` for empty rows)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    r = rows.to(tl.int64)
    op = o_base + r[:, None] * son + offs_d[None, :] * sod
    tl.store(op, out.to(o_base.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(lse_base + r * sln, lse, mask=row_ok)


@triton.jit
def _prologue(Q, K, V, KM, VS, b, h, kvh, m0, row_len, row_start, q_lo, q_row0,
              sqb, sqh, sqn, sqd, skb, skh, skn, svb, svh, svn, skmb, skmh, skmn, svsb, svsh, svsn,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              EVEN_D: tl.constexpr):
    """The set-up every attention program shares once :func:`_program_ids` has placed it and the
    kernel has returned early for a block past its row: the tile offsets, the block's query rows
    (``rows`` logical, ``row_ok`` the query rows inside the row), the int64 base pointers of the
    head's ``q`` rows and its kv head's ``k``, ``v``, ``k_masked`` and ``v_safe`` rows (offset to
    the row's first token), the ``q`` tile ``[BLOCK_M, BLOCK_D]`` (rows outside ``row_ok`` read 0,
    unscaled: :func:`_softmax_update` applies the scale) and the online-softmax state (``acc = 0``,
    ``m_i = -inf``, ``l_i = 0``, fp32).

    Returns ``(offs_n, offs_d, d_ok, rows, row_ok, b64, q64, k_base, v_base, km_base, vs_base, q,
    acc, m_i, l_i)``; ``b64`` and ``q64`` (the batch row and ``q_row0`` as int64) are what
    :func:`_epilogue` addresses the output with. Inlined by Triton: the compiled kernel is the one
    the copies it replaces compiled to."""
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
    km_base = KM + b64 * skmb + kvh.to(tl.int64) * skmh + s64 * skmn
    vs_base = VS + b64 * svsb + kvh.to(tl.int64) * svsh + s64 * svsn
    q = _load_rows(q_base, rows, row_ok, offs_d, d_ok, sqn, sqd, EVEN_D)  # [BM, BD]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return offs_n, offs_d, d_ok, rows, row_ok, b64, q64, k_base, v_base, km_base, vs_base, q, acc, m_i, l_i


@triton.jit
def _epilogue(acc, m_i, l_i, O, LSE, b64, h, q64, rows, row_ok, offs_d, d_ok, sob, soh, son, sod, slb, slh, sln,
              RETURN_LSE: tl.constexpr):
    """Write the block's query rows of head ``h`` (``b64``, ``q64``: :func:`_prologue`'s) through
    :func:`_store_rows`: output row ``i`` at ``O[b, h, q_row0 + i]``, its log-sum-exp at
    ``LSE[b, h, q_row0 + i]`` with ``RETURN_LSE``."""
    o_base = O + b64 * sob + h.to(tl.int64) * soh + q64 * son
    lse_base = LSE + b64 * slb + h.to(tl.int64) * slh + q64 * sln
    _store_rows(acc, m_i, l_i, o_base, lse_base, rows, row_ok, offs_d, d_ok, son, sod, sln, RETURN_LSE)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Kernel tiling (never part of a pattern config): query tile, key tile, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: GPU tiles for 2-byte inputs (FlashAttention-style: 128 queries x 64 keys, 8 warps, 3 stages).
GPU_TILES = Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
#: GPU tiles for fp32 inputs (twice the bytes per element: smaller tiles, fewer stages). Their ieee
#: dots compile to unrolled FMA loops, so compile time follows the tile area: 32x32 compiles in well
#: under half the time of 64x32 (see docs/tuning.md#fp32-tiles); fp32 is for exactness, not speed.
GPU_TILES_FP32 = Tiles(block_m=32, block_n=32, num_warps=4, num_stages=2)
#: Interpreter tiles: small, so that short test sequences still span several tiles.
INTERPRET_TILES = Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)


#: Environment variable that lowers the shared memory a kernel program may use below the device's
#: own limit (bytes): how the H200 runs the tiles an A100 (164 KB a block: 166912) or a consumer
#: GPU (~100 KB: 101376) would get.
SMEM_LIMIT_ENV = "MINFERENCE_SMEM_LIMIT"
_FITTED: dict = {}
_DEVICE_SMEM: dict = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def smem_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: the device's opt-in per-block
    limit, or :data:`SMEM_LIMIT_ENV` when that is lower (read at every call, so tests may set it;
    the device query is made once per device)."""
    index = _device_index(device)
    limit = _DEVICE_SMEM.get(index)
    if limit is None:
        props = torch.cuda.get_device_properties(index)
        limit = _DEVICE_SMEM[index] = int(getattr(props, "shared_memory_per_block_optin", 0)
                                          or props.shared_memory_per_block)
    forced = os.environ.get(SMEM_LIMIT_ENV)
    if forced:
        try:
            value = int(forced)
        except ValueError:
            raise ValueError(f"{SMEM_LIMIT_ENV} must be a byte count, got {forced!r}") from None
        if value <= 0:
            raise ValueError(f"{SMEM_LIMIT_ENV} must be positive, got {value}")
        limit = min(limit, value)
    return limit


def fit_tiles(name: str, key: tuple, device: torch.device, candidates, compiled_shared) -> Tiles:
    """The first of ``candidates`` (preferred first) whose compiled program fits the device's
    shared memory (:func:`smem_limit`), remembered per ``(name, key, device, limit)``.

    ``compiled_shared(tiles) -> bytes`` compiles the kernel for ``tiles`` without launching it
    (``JITFunction.warmup``) and returns its ``metadata.shared``; it runs once per candidate tried,
    the first time a key is seen. On CPU tensors (the interpreter) the first candidate is used.
    Raises ``RuntimeError`` naming the limit when no candidate fits."""
    candidates = list(candidates)
    if device.type != "cuda" or interpreting():
        return candidates[0]
    limit = smem_limit(device)
    cache_key = (name, key, _device_index(device), limit)
    hit = _FITTED.get(cache_key)
    if hit is not None:
        return hit
    tried = []
    for tiles in candidates:
        need = int(compiled_shared(tiles))
        tried.append(f"{tiles.block_m}x{tiles.block_n}/{tiles.num_stages} stages: {need} B")
        if need <= limit:
            _FITTED[cache_key] = tiles
            return tiles
    raise RuntimeError(f"{name}: no tile configuration fits {limit} bytes of shared memory per program "
                       f"({'; '.join(tried)})")


def launch_fitted(name: str, jit_fn, device: torch.device, key: tuple, candidates, call) -> Tiles:
    """Launch ``jit_fn`` with the first of ``candidates`` that fits (:func:`fit_tiles`); ``call(tiles)
    -> (grid, args, kwargs)`` builds the launch for a configuration (grid, descriptors and
    constexprs follow the tiles). Returns the tiles used."""
    def shared(tiles: Tiles) -> int:
        grid, args, kwargs = call(tiles)
        return jit_fn.warmup(*args, grid=grid, **kwargs).metadata.shared

    tiles = fit_tiles(name, key, device, candidates, shared)
    grid, args, kwargs = call(tiles)
    jit_fn[grid](*args, **kwargs)
    return tiles


def fitted_stages(tiles: Tiles) -> list[Tiles]:
    """``tiles`` and the same tiles with fewer pipeline stages down to 1: the candidates of a
    kernel whose tile sizes are fixed by its index (block-sparse blocks, the vertical-slash
    converter's ``block_m``)."""
    return [Tiles(tiles.block_m, tiles.block_n, tiles.num_warps, s) for s in range(tiles.num_stages, 0, -1)]


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_tiles(q: torch.Tensor) -> Tiles:
    if q.device.type != "cuda":
        return INTERPRET_TILES
    return GPU_TILES_FP32 if q.dtype == torch.float32 else GPU_TILES


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 inputs (so fp32 runs meet the fp32 tolerance rule), else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


ValueGuard = tuple[torch.Tensor, torch.Tensor]

#: Elements of ``v`` one program of :func:`_value_guard_kernel` reads (rows x padded head dim).
GUARD_TILE = 4096


@triton.jit(do_not_specialize=["N"])  # the length: docs/kernels.md, "No argument derived from the length"
def _value_guard_kernel(K, V, KM, VS, N, H, skb, skh, skn, skd, svb, svh, svn, svd,
                        D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One pass of :func:`value_guard` over ``BLOCK_R`` token rows of one ``(batch row, kv
    head)`` (a flat grid: program ``(b * H + h) * ceil(N / BLOCK_R) + block``): reads the ``v``
    and ``k`` rows once and writes ``k_masked`` and ``v_safe`` (contiguous ``[B, H, N, D]``). A
    row is flagged when any element is NaN (``x != x``) or ±inf."""
    n_blocks = tl.cdiv(N, BLOCK_R)
    pid = tl.program_id(0).to(tl.int64)  # one flat axis: B * H * blocks may pass 65535
    bh, blk = pid // n_blocks, pid % n_blocks
    b, h = bh // H, bh % H
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < N) & (cols[None, :] < D)
    v = tl.load(V + b * svb + h * svh + rows[:, None] * svn + cols[None, :] * svd, mask=inside, other=0.0)
    x = v.to(tl.float32) if v.dtype == tl.bfloat16 else v  # the interpreter misses a bf16 NaN (x != x)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    flagged = tl.max(bad.to(tl.int32), axis=1)[:, None] > 0  # an integer max: no NaN semantics
    k = tl.load(K + b * skb + h * skh + rows[:, None] * skn + cols[None, :] * skd, mask=inside, other=0.0)
    out = (bh * N + rows[:, None]) * D + cols[None, :]
    tl.store(KM + out, tl.where(flagged, float("nan"), k).to(KM.dtype.element_ty), mask=inside)
    tl.store(VS + out, tl.where(flagged, 0.0, v).to(VS.dtype.element_ty), mask=inside)


def value_guard(k: torch.Tensor, v: torch.Tensor, checked: bool = False) -> ValueGuard:
    """What the attention kernels' masked tiles read instead of ``k`` and ``v``, so that a
    non-finite value (NaN or ±inf in any element of a value row) reaches only the rows that keep
    its key (docs/contract.md, "Non-finite inputs"): ``(k_masked, v_safe)``.

    * ``k_masked [B, Hkv, N, D]`` in ``k``'s dtype: ``k`` with a NaN row where the value row is
      not finite (every score against that key is NaN; a masked tile's ``where(keep, s, -inf)``
      keeps it only in the rows that keep the key, which the online softmax turns to NaN); a key
      row of ``k`` itself is kept as it is (a NaN key behaves as without the guard);
    * ``v_safe [B, Hkv, N, D]`` in ``v``'s dtype: ``v`` with those rows zeroed (a row that masks
      such a key multiplies ``p = 0`` by zeros).

    Both are new contiguous tensors, written by one Triton pass (:func:`_value_guard_kernel`: one
    read of ``k`` and of ``v``, one write of each; two allocations and one launch on the host, no
    host sync and no data-dependent shape, so it is CUDA-graph capturable). ``checked=True`` (the
    caller has validated that ``v`` is finite on every token its rows read): ``(k, v)``
    themselves, no device op. Call it once per call of the dispatcher, not per kernel launch:
    every kernel of a layer reads the same pair (``value_guard=`` of the kernel entries). CPU
    tensors run the pass in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    check_tensor("k", k, rank=4, dtypes=dtypes)
    check_tensor("v", v, rank=4, dtypes=dtypes)
    if tuple(k.shape) != tuple(v.shape) or k.device != v.device:
        raise ValueError(f"k and v must have one shape and device, got {tuple(k.shape)} on {k.device} and "
                         f"{tuple(v.shape)} on {v.device}")
    if not isinstance(checked, bool):
        raise TypeError(f"checked must be a bool, got {type(checked).__name__}")
    B, H, N, D = k.shape
    if checked or D == 0:  # an empty row holds nothing non-finite
        return k, v
    if k.device.type not in ("cpu", "cuda") or (k.device.type == "cpu" and not interpreting()):
        raise ValueError(f"value_guard runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got "
                         f"{k.device}{' without the interpreter' if k.device.type == 'cpu' else ''}")
    k_masked = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v_safe = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if k.numel() == 0:
        return k_masked, v_safe
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(GUARD_TILE // block_d, triton.next_power_of_2(N)))
    grid = (B * H * triton.cdiv(N, block_r),)
    _value_guard_kernel[grid](k, v, k_masked, v_safe, N, H, *k.stride(), *v.stride(), D=D, BLOCK_R=block_r,
                              BLOCK_D=block_d)
    return k_masked, v_safe


def check_value_guard(guard, k: torch.Tensor, v: torch.Tensor) -> ValueGuard:
    """A ``value_guard=`` argument: a pair ``(k_masked, v_safe)`` as :func:`value_guard` makes for
    ``k, v`` (``k_masked`` with k's shape, dtype and device, ``v_safe`` with v's, any strides).
    Metadata only; the values are the caller's promise."""
    if not isinstance(guard, (tuple, list)) or len(guard) != 2:
        raise ValueError(f"value_guard must be a pair (k_masked, v_safe) from kernels.value_guard(k, v), got "
                         f"{type(guard).__name__}")
    for name, x, ref, of in (("k_masked", guard[0], k, "k"), ("v_safe", guard[1], v, "v")):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"value_guard's {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != ref.device:
            raise ValueError(f"value_guard's {name} must be on {of}'s device {ref.device}, got {x.device}")
        if tuple(x.shape) != tuple(ref.shape) or x.dtype != ref.dtype:
            raise ValueError(f"value_guard's {name} must match {of} ({tuple(ref.shape)}, {ref.dtype}), got "
                             f"{tuple(x.shape)}, {x.dtype}")
    return guard[0], guard[1]


@dataclass
class Prepared:
    """Validated launch state shared by the three public functions."""

    B: int
    Hq: int
    Hkv: int
    N: int
    D: int
    Hg: int
    scale: float
    lens: torch.Tensor
    starts: torch.Tensor
    heads: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None
    tiles: Tiles
    #: query rows (docs/kernels.md): the most query rows of a batch row, and the int32 ``[B]``
    #: first query position and q row of position 0 (``None``: every key row is its own query row)
    q_bound: int = 0
    q_los: torch.Tensor | None = None
    q_row0s: torch.Tensor | None = None
    #: the value guard (:func:`value_guard`): the key and value rows masked tiles read
    k_masked: torch.Tensor | None = None
    v_safe: torch.Tensor | None = None

    @property
    def block_d(self) -> int:
        """``D`` padded to a power of two (a table lookup: this runs several times per launch, and
        ``triton.next_power_of_2`` costs microseconds of host time each)."""
        return _POW2[self.D] if self.D < len(_POW2) else next_pow2(self.D)

    @property
    def qk_scale(self) -> float:
        return self.scale * LOG2E

    @property
    def qrows(self) -> bool:
        return self.q_los is not None

    def grid(self) -> tuple[int, int, int]:
        """``(query blocks, computed heads, B)``: with query rows, the blocks that ``q_bound``
        rows starting anywhere can touch (one more than they fill)."""
        return (grid_blocks(self.N, self.tiles.block_m, self.q_bound if self.qrows else None), self.Hg, self.B)

    def launches(self) -> bool:
        """Whether a kernel has anything to compute."""
        return self.Hg > 0 and self.N > 0 and (not self.qrows or self.q_bound > 0)

    def row_args(self) -> list:
        """The row arguments every kernel takes after ``heads``: lengths, starts, first query
        positions, q rows of position 0 (the lengths stand in when there are no query rows)."""
        if self.qrows:
            return [self.lens, self.starts, self.q_los, self.q_row0s]
        return [self.lens, self.starts, self.lens, self.lens]

    def meta(self, q: torch.Tensor, return_lse: bool) -> dict:
        """Constexprs and launch options common to every kernel."""
        return dict(
            group=self.Hq // self.Hkv,
            HEAD_DIM=self.D,
            BLOCK_D=self.block_d,
            EVEN_D=self.block_d == self.D,
            BLOCK_M=self.tiles.block_m,
            BLOCK_N=self.tiles.block_n,
            RETURN_LSE=return_lse,
            PREC=dot_precision(q.dtype),
            QROWS=self.qrows,
            num_warps=self.tiles.num_warps,
            num_stages=self.tiles.num_stages,
        )

    def guard_args(self) -> list:
        """``k_masked`` and ``v_safe`` (the kernels' ``KM, VS`` arguments, after ``V``)."""
        return [self.k_masked, self.v_safe]

    def guard_strides(self) -> list[int]:
        """The 8 strides of ``k_masked`` and ``v_safe`` (b, h, n, d each), after the 16 of
        :func:`qkv_strides`."""
        return [*self.k_masked.stride(), *self.v_safe.stride()]

    def head_ids(self) -> torch.Tensor:
        """The computed local heads as the kernels read them (all heads when none were given)."""
        if self.heads is not None:
            return self.heads
        return arange_constant(self.Hq, self.out.device, torch.int32)

    def lse_arg(self) -> tuple[torch.Tensor, int]:
        """LSE pointer and its row stride (the output itself stands in when no LSE is asked)."""
        if self.lse is None:
            return self.out, 0
        return self.lse, self.lse.stride(2)

    def lse_strides(self) -> tuple[int, int]:
        if self.lse is None:
            return 0, 0
        return self.lse.stride(0), self.lse.stride(1)


def check_heads(heads, Hq: int, device, *, values: bool) -> torch.Tensor | None:
    """Validate ``heads``: 1-D int tensor of distinct local query heads in ``[0, Hq)``."""
    if heads is None:
        return None
    check_tensor("heads", heads, rank=1, dtypes=_INT_DTYPES)
    if not same_device(heads.device, device):
        raise ValueError(f"heads must be on {device}, got {heads.device}")
    if heads.shape[0] > Hq:
        raise ValueError(f"heads lists {heads.shape[0]} heads but q has only {Hq}")
    if values and heads.numel() > 0 and not capturing():
        if bool((heads < 0).any()) or bool((heads >= Hq).any()):
            raise ValueError(f"heads must lie in [0, {Hq}), got {heads.tolist()}")
        if heads.unique().numel() != heads.numel():
            raise ValueError(f"heads must be distinct, got {heads.tolist()}")
    return heads.to(torch.int32).contiguous()


def _check_launch(q: torch.Tensor, D: int, return_lse: object) -> None:
    """What every launcher refuses before it prepares a launch: head dims the kernels do not
    compile, devices they cannot run on, a non-bool ``return_lse``."""
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; expected one of {SUPPORTED_HEAD_DIMS}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before triton is first imported"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), got {q.device}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")


def check_launch(q: torch.Tensor) -> None:
    """What the attention launchers refuse of a ``q`` that passed the dispatcher's own checks
    (:func:`minference._checks.check_qkv_rows`; ``k``, ``v`` share its dtype and device), with their
    messages: a dtype or head dim the kernels do not compile, a device they cannot run on. The
    dispatcher calls it once per call (:meth:`minference.backend_triton.TritonBackend.check_launch`)
    and then launches with ``checked=True``."""
    check_tensor("q", q, rank=4, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    _check_launch(q, q.shape[-1], False)


def prepare(q, k, v, *, scale, seqlens, seqstarts, heads, out, return_lse, validate,
            tiles: Tiles | None = None, q_seqlens=None, q_seqstarts=None, guard=None,
            checked: bool = False) -> Prepared:
    """Validate the common arguments and allocate outputs; never synchronises when
    ``validate=False``. ``q_seqlens`` / ``q_seqstarts``: query rows (docs/kernels.md). ``guard``:
    a precomputed :func:`value_guard` pair (the dispatcher's, made once per call), else it is made
    here (without a pass when the values were validated).

    ``checked``: the caller validated the arguments' form at its own edge (the dispatcher through
    :mod:`minference.backend_triton`): shapes, dtypes and devices of q, k, v, ``heads`` (int32),
    ``out`` and ``guard``, the head dim, ``return_lse``; those checks are skipped, and the row
    arguments are only converted (``validate`` still governs value reads)."""
    if checked:
        B, Hq, Nq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32))
        _check_launch(q, D, return_lse)
    scale = default_scale(D, scale)
    values = validate and not capturing()
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=values)
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                            given_rows=seqlens is not None or seqstarts is not None, values=values)
    partial = seqlens is not None or seqstarts is not None or heads is not None or rows is not None
    if checked:
        heads = None if heads is None else heads.to(torch.int32).contiguous()
    else:
        heads = check_heads(heads, Hq, q.device, values=validate)
    q_lens, q_starts = rows if rows is not None else (lens, starts)
    if values:
        check_finite_rows({"q": q}, q_lens, q_starts, heads=None if heads is None else {"q": heads})
        check_finite_kv({"k": k, "v": v}, lens, starts, group=Hq // Hkv, query_heads=heads)
    Hg = Hq if heads is None else heads.shape[0]
    if out is None:
        alloc = torch.zeros if partial else torch.empty
        out = alloc(B, Hq, Nq, D, dtype=q.dtype, device=q.device)
    elif not checked:
        check_out(out, q)
    lse = None
    if return_lse:
        if partial:  # rows and heads the kernel never touches read as empty rows
            lse = torch.full((B, Hq, Nq), float("-inf"), dtype=torch.float32, device=q.device)
        else:
            lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    prep = Prepared(B, Hq, Hkv, N, D, Hg, scale, lens, starts, heads, out, lse, tiles or default_tiles(q))
    if rows is not None:
        uniform = uniform_query_rows(q_seqlens, q_seqstarts, Nq, N, given_rows=seqlens is not None
                                     or seqstarts is not None)
        if uniform is not None:  # every row's first query and q row of position 0 known on the host
            count, start = uniform
            prep.q_los = int32_constant(B, N - count, q.device)
            prep.q_row0s = int32_constant(B, start - (N - count), q.device)
        else:
            q_los = (lens - q_lens).contiguous()
            prep.q_los, prep.q_row0s = q_los, (q_starts - q_los).contiguous()
        prep.q_bound = query_rows_bound(q_seqlens, Nq)
    if guard is not None:
        prep.k_masked, prep.v_safe = guard if checked else check_value_guard(guard, k, v)
    elif prep.launches():  # nothing reads it otherwise
        prep.k_masked, prep.v_safe = value_guard(k, v, checked=values)
    return prep


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int, *, interpreter: bool = False):
    """Host tensor descriptors of K and V (blocks of ``[1, 1, block_n, D]``), or ``(None, None)``
    where the pointer path must run: CPU/interpreter, a head dim that is not a power of two, a
    last dimension that is not contiguous, or a base or stride that is not 16-byte aligned (what
    TMA requires). The kernels read them only in unmasked tiles (``DESC``). ``interpreter=True``
    also builds them for CPU tensors under the interpreter (tests of the descriptor path)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not descriptors_ok(k, v, block_d, interpreter=interpreter):
        return None, None
    blk = [1, 1, block_n, block_d]
    return (TensorDescriptor(k, list(k.shape), list(k.stride()), blk),
            TensorDescriptor(v, list(v.shape), list(v.stride()), blk))


def descriptors_ok(k: torch.Tensor, v: torch.Tensor, block_d: int, *, interpreter: bool = False) -> bool:
    """Whether :func:`kv_descriptors` builds descriptors for ``k, v`` (for any key tile)."""
    on_gpu = k.device.type == "cuda" and not interpreting()
    if not (on_gpu or (interpreter and interpreting())) or k.shape[-1] != block_d or block_d * k.element_size() < 16:
        return False
    for x in (k, v):
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * x.element_size() % 16 for st in x.stride()[:-1]):
            return False
    return not (k.shape[-2] == 0 or k.shape[0] == 0 or k.shape[1] == 0)


def qkv_strides(q, k, v, out) -> list[int]:
    """The 16 strides the kernels take, in (q, k, v, out) x (b, h, n, d) order."""
    return [*q.stride(), *k.stride(), *v.stride(), *out.stride()]


def finish(prep: Prepared, return_lse: bool):
    return (prep.out, prep.lse) if return_lse else prep.out
