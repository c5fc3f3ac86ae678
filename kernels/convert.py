"""Vertical-slash index conversion: logical ``(vertical, slash)`` -> physical tiles the kernel runs.

Three Triton launches and no compiled extension, no host synchronisation (every output has a
static shape; nothing reads a tensor value on the host), so it runs inside a CUDA graph:

1. :func:`_vs_lists_kernel`, one program per (batch row, head): sorts the offsets and the
   columns in registers, deduplicates them, and writes the runs (with their hole-free flag), the
   filled offset segments (see "Gap filling"), the distinct columns and ``col_mask``;
2. :func:`_vs_diag_kernel`, one program per 1024 offsets: ``diag_mask`` and ``diag_bits`` by a
   binary search of each offset in the segments;
3. :func:`_block_columns_kernel`, one program per query block: the block's leftover columns.

The same conversion in torch ops (:func:`_convert_torch`) serves CPU tensors outside the Triton
interpreter and index widths beyond :data:`LIST_CAP` (one program sorts the whole list in
registers); the tests hold the two to equal outputs field by field. The torch path issued ~100
small operations a call (2-4 ms of host time at 128K on the H200; docs/tuning.md#triton-converter);
these launches replace them.

Physical format (:class:`VSIndex`), per batch row ``b`` and computed head ``h``
-------------------------------------------------------------------------------

Slash offsets ``δ`` are deduplicated, sorted and merged into **runs** ``[δa, δb]`` of offsets
whose gaps are at most ``block_m``. A run does not depend on the query block: query block ``I``
(rows ``m0 = I * block_m .. m0 + block_m - 1``) reads the run as the **key range**
``[max(0, m0 - δb), m0 + block_m - 1 - δa]`` (offsets that run before position 0 are clipped).
Because consecutive runs are more than ``block_m`` apart, the key ranges of one query block are
disjoint, so no key is visited twice. Inside a range the kernel keeps key ``j`` for row ``i``
iff ``j <= i`` and (``i - j`` is a chosen offset or ``j`` is a chosen column): tile expansion is
masked exactly, and a vertical inside a range is read there once.

Vertical columns are deduplicated and, per query block, the ones that lie inside one of its key
ranges or beyond its last row are **removed**; the rest are compacted into ``col_index[b, h, I,
:col_count[b, h, I]]`` (ascending). The kernel reads them as gathered key tiles, masked ``j <= i``.

Fields (``R = max(NS, 1)``, ``NQB = ceil(n / block_m)``):

* ``run_start, run_end [B, H, R]`` int32: ``δa``, ``δb`` of each run (ascending), -1 past
  ``run_count [B, H]``; ``run_solid [B, H, R]`` int8: 1 where every offset of ``[δa, δb]`` is
  chosen (after gap filling), so the kernel runs the tiles of the run that lie wholly on its
  diagonals without any mask; 0 past ``run_count``.
* ``col_index [B, H, NQB, NV]`` int32, -1 past ``col_count [B, H, NQB]``; ``col_before [B, H,
  NQB]`` int32 counts the leading ones that precede the block's first row ``m0`` (causal for
  every row of the block: the kernel runs their full tiles without a mask).
* ``columns [B, H, NV]`` int32: the head's distinct chosen columns, ascending, -1 after them;
  ``col_lead [B, H, NQB]`` int32: the block's list begins with the head's first ``col_lead``
  columns (``col_index[b, h, I, :L] == columns[b, h, :L]``, ``L = col_lead[b, h, I]``: no column
  before them was removed). The kernel copies the K/V rows of ``columns`` into a scratch once
  per call and reads that leading stretch of each block from it in contiguous tiles (TMA on
  Hopper) instead of gathering it row by row.
* ``all_solid`` (host bool): every run is hole-free by construction (``fill_gaps >= block_m -
  1``, or the dense causal index), so the kernel is compiled without the bitmap path.
* ``diag_mask [B, H, n]`` int8: 1 where ``δ`` is a chosen offset; ``diag_bits [B, H, NW]``
  int64, the same set packed 64 offsets a word after :data:`BITS_PAD_WORDS` zero words (offsets
  below 0 read as "not chosen"), so a masked tile builds its ``[rows, 64]`` diagonal mask from
  two words per row instead of a gather per element; ``col_mask [B, H, n]`` int8: 1 where ``j``
  is a chosen column.
* ``dense [B, H]`` bool: the head's index was replaced by the dense causal one (below).

Gap filling (``fill_gaps``)
---------------------------

With ``fill_gaps = G > 0`` the offsets are first closed over gaps of at most ``G`` missing
offsets between two chosen ones (the set :func:`minference.index_sets.slash_set` defines;
the kernel then computes exactly that larger set). Runs merge across distances up to
``max(block_m, G + 1)``, so a filled gap never separates two runs. With ``G >= block_m - 1`` every
run is hole-free, so every range tile that lies on the run's diagonals runs unmasked, and no tile
is added: the holes were inside key ranges the kernel reads anyway. The dispatcher fills by
default (:data:`minference.dispatch.FILL_GAPS`): estimated slash sets are dense near the
diagonal with scattered holes near their edge, which otherwise mask nearly every range tile.

Dense fallback (``dense_over``)
-------------------------------

A head whose offsets scatter over the prompt touches nearly every key tile and must mask every
one (2-3x the cost of a dense causal head). With ``dense_over`` given, a head whose converted
index runs more than ``dense_over`` times the key tiles of the dense causal index (both counted
by :func:`vs_physical_tiles` at length ``n``) gets the dense causal index instead: one run
``[0, n - 1]`` (every offset chosen), no columns. The kernel runs it like causal dense attention:
unmasked tiles up to the diagonal, the causal mask on the diagonal tiles only. The head then
computes **dense** causal attention (a superset of its sparse set). The choice is made with
``torch.where`` on device values: no host synchronisation. Counts use the padded length ``n``
(the converter does not see row lengths); the kernel still clips the run to each row's length.

The loop that turns the format back into the dense mask the kernel computes (this is
:func:`vs_index_to_dense`, which counts visits so tests can also prove no pair is read twice)::

    for I in range(NQB):
        m0 = I * block_m
        for i in range(m0, min(m0 + block_m, n)):
            for r in range(run_count[b, h]):
                lo = max(0, m0 - run_end[b, h, r])
                hi = m0 + block_m - 1 - run_start[b, h, r]
                for j in range(lo, min(hi, i) + 1):
                    if diag_mask[b, h, i - j] or col_mask[b, h, j]:
                        mask[i, j] += 1
            for c in col_index[b, h, I, :col_count[b, h, I]]:
                if c <= i:
                    mask[i, c] += 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from minference.kernels._common import cdiv, interpreting, next_pow2

from minference._checks import check_int, check_tensor, same_device
from minference.index_sets import check_fill_gaps

__all__ = [
    "BITS_PAD_WORDS",
    "DENSE_OVER",
    "VSIndex",
    "convert_vertical_slash",
    "vs_index_to_dense",
    "vs_physical_tiles",
]

_INT = (torch.int32, torch.int64)
#: Zero words in front of ``diag_bits``: a tile reads offsets down to ``-(block_m + block_n - 2)``.
BITS_PAD_WORDS = 4
_WORD = 64

#: Default ``dense_over`` (the dispatcher's): replace a head by the dense causal index when its
#: index runs more than half the dense causal key tiles. Measured on the H200 (docs/kernels.md,
#: 128K, bf16): a masked tile costs about twice an unmasked one (VS scattered, nearly every tile
#: masked: 193 physical TFLOP/s; VS local and A-shape, mostly unmasked: 357-425). A head of ``T``
#: tiles costs between ``T`` and ``2T`` unmasked-tile units; its dense replacement (one solid run:
#: unmasked but for the diagonal tiles) costs about ``D``, the dense tile count. Replacing wins
#: when ``2T > D`` for an all-masked head, hence 0.5. At long prompts the heads above 0.5 are the
#: scattered ones (local runs of the estimator's ~6K offsets run ~2*(NS + block_m)/N of the
#: dense tiles: ~10% at 128K), whose tiles are nearly all masked, so each replacement is a gain
#: (731 ms -> about D at the unmasked rate, ~350 ms, at 128K). A mostly-unmasked head crosses
#: 0.5 only below N ~ 4*(NS + block_m) (~25K), where it can lose up to 2x on a short prefill.
DENSE_OVER = 0.5


@dataclass(frozen=True)
class VSIndex:
    """Physical vertical-slash index for query blocks of ``block_m`` rows over ``n`` positions."""

    block_m: int
    n: int
    run_start: torch.Tensor
    run_end: torch.Tensor
    run_count: torch.Tensor
    run_solid: torch.Tensor
    col_index: torch.Tensor
    col_count: torch.Tensor
    col_before: torch.Tensor
    columns: torch.Tensor
    col_lead: torch.Tensor
    diag_mask: torch.Tensor
    diag_bits: torch.Tensor
    col_mask: torch.Tensor
    dense: torch.Tensor
    #: every run is hole-free by construction (``fill_gaps >= block_m - 1``, or the dense causal
    #: index): known on the host, so the kernel compiles only the two-compare run mask
    all_solid: bool = False


def _sorted_set(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort ``x [..., K]`` with invalid entries (outside ``[0, n)``) mapped to the sentinel ``n``
    and placed last; return ``(sorted int64, valid, first occurrence)``."""
    x = x.long()
    x = torch.where((x >= 0) & (x < n), x, torch.full_like(x, n)).sort(dim=-1).values
    valid = x < n
    prev = F.pad(x[..., :-1], (1, 0), value=-1)
    return x, valid, valid & (x != prev)


def _membership(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., n]`` int8 indicator of the values of ``x`` (sentinel ``n`` dropped)."""
    target = torch.zeros(*x.shape[:-1], n + 1, dtype=torch.int8, device=x.device)
    return target.scatter_(-1, x, 1)[..., :n].contiguous()


def _compact(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move ``values[keep]`` to the front of the last axis (order kept), -1 after; with counts."""
    K = values.shape[-1]
    pos = keep.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1
    pos = torch.where(keep, pos, K).long()
    out = torch.full((*values.shape[:-1], K + 1), -1, dtype=torch.int32, device=values.device)
    out.scatter_(-1, pos, values.to(torch.int32))
    return out[..., :K].contiguous(), keep.sum(-1, dtype=torch.int32)


#: Longest offset or column list (padded to a power of two) that :func:`_vs_lists_kernel` sorts
#: in one program's registers; longer lists take the torch path.
LIST_CAP = 16384
#: Warps of :func:`_vs_lists_kernel` (its 8192-entry sort is most of the conversion's GPU time).
#: 32: the fastest of 4 / 8 / 16 / 32 from 16K to 1M (see docs/tuning.md#lists-warps).
LISTS_WARPS = 32
#: 64-offset words per program of :func:`_vs_diag_kernel`.
_DIAG_WORDS = 16


@triton.jit
def _upper_bound(base, count, x):
    """Per lane of ``x`` (int32): how many of the ascending ``base[0 .. count)`` are ``<= x``: a
    binary search of ``ceil(log2(count + 1))`` steps (a head's runs are usually a handful)."""
    lo = x * 0
    hi = lo + count
    steps = 0
    while (1 << steps) <= count:
        steps += 1
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(base + mid, mask=active, other=0)
        right = active & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _sorted_row(src_ptr, count, n, work, SIZE: tl.constexpr):
    """``src_ptr[0 .. count)`` sorted in registers, entries outside ``[0, n)`` (and the padding up
    to ``SIZE``) as the sentinel ``n``, last; also written to ``work`` so that neighbours can be
    read back (behind a barrier)."""
    k = tl.arange(0, SIZE)
    x = tl.load(src_ptr + k, mask=k < count, other=-1)
    x = tl.sort(tl.where((x >= 0) & (x < n), x, n).to(tl.int32))
    tl.store(work + k, x)
    tl.debug_barrier()
    return x


@triton.jit
def _split(s, prev, nxt, valid, gap, n, lo_ptr, hi_ptr):
    """Groups of the sorted values ``s`` (``prev``/``nxt`` their neighbours) split where two
    distinct values are more than ``gap`` apart: the first value of group ``i`` goes to
    ``lo_ptr[i]``, its last to ``hi_ptr[i]``. Returns ``(start, end, group id, count)``."""
    start = valid & (s - prev > gap)
    end = valid & ((nxt - s > gap) | (nxt >= n))
    group = tl.cumsum(start.to(tl.int32), 0) - 1
    tl.store(lo_ptr + group, s, mask=start)
    tl.store(hi_ptr + group, s, mask=end)
    return start, end, group, tl.sum(start.to(tl.int32), 0)


# merge and fill are clipped to n; NS, NV and R are the budgets clipped to n (they follow the length where a
# budget exceeds the prompt), and the slash offsets can be a view that starts Hg clipped rows into a buffer.
# W = 5 NSP + NVP + 1 (powers of two) is never 1 nor a multiple of 16: one key whatever the budgets
@triton.jit(do_not_specialize=["n", "merge", "fill", "NS", "NV", "R"], do_not_specialize_on_alignment=["slash_ptr"])
def _vs_lists_kernel(slash_ptr, vert_ptr, NS, NV, n, merge, fill, R, W,
                     run_start_ptr, run_end_ptr, run_count_ptr, run_solid_ptr, cols_ptr, col_mask_ptr, work_ptr,
                     NSP: tl.constexpr, NVP: tl.constexpr):
    """Two programs per (batch row, head), one for the offsets and one for the columns.

    Offsets: sort (invalid ones become the sentinel ``n`` and sort last), then, on distinct
    values, runs split where the distance to the previous one exceeds ``merge`` and filled
    segments where it exceeds ``fill + 1``; a run is solid when no distance inside it leaves
    more than ``fill`` offsets out. Columns: sort, the distinct ones compacted (-1 after them),
    ``col_mask``. Workspace row
    (``W`` int32): sorted offsets, hole counts at run starts and ends, segment lows and highs,
    sorted columns, segment count."""
    bh = tl.program_id(0).to(tl.int64)
    work = work_ptr + bh * W
    at_start = work + NSP
    at_end = work + 2 * NSP
    seg_lo = work + 3 * NSP
    seg_hi = work + 4 * NSP
    sorted_c = work + 5 * NSP

    if tl.program_id(1) == 0:  # offsets
        k = tl.arange(0, NSP)
        s = _sorted_row(slash_ptr + bh * NS, NS, n, work, NSP)
        prev = tl.load(work + k - 1, mask=k > 0, other=-merge - 1)  # the first offset always starts
        nxt = tl.load(work + k + 1, mask=k < NSP - 1, other=n)
        valid = s < n
        rs = run_start_ptr + bh * R
        re = run_end_ptr + bh * R
        start, end, run, nrun = _split(s, prev, nxt, valid, merge, n, rs, re)
        tl.store(rs + k, tl.full([NSP], -1, tl.int32), mask=(k >= nrun) & (k < R))
        tl.store(re + k, tl.full([NSP], -1, tl.int32), mask=(k >= nrun) & (k < R))
        tl.store(run_count_ptr + bh, nrun)
        # a hole: a distinct offset more than fill + 1 past the previous one of its run
        holes = tl.cumsum((valid & (s != prev) & ~start & (s - prev - 1 > fill)).to(tl.int32), 0)
        tl.store(at_start + run, holes, mask=start)
        tl.store(at_end + run, holes, mask=end)
        _, _, _, nseg = _split(s, prev, nxt, valid, fill + 1, n, seg_lo, seg_hi)
        tl.store(sorted_c + NVP, nseg)
        tl.debug_barrier()
        solid = tl.load(at_end + k, mask=k < nrun, other=0) == tl.load(at_start + k, mask=k < nrun, other=1)
        tl.store(run_solid_ptr + bh * R + k, solid.to(tl.int8), mask=k < R)
    else:  # columns (a second program: the two sorts run side by side)
        kv = tl.arange(0, NVP)
        c = _sorted_row(vert_ptr + bh * NV, NV, n, sorted_c, NVP)
        c_first = (c < n) & (c != tl.load(sorted_c + kv - 1, mask=kv > 0, other=-1))
        slot = tl.cumsum(c_first.to(tl.int32), 0) - 1  # distinct columns, compacted in order
        tl.store(cols_ptr + bh * NV + slot, c, mask=c_first)
        tl.store(cols_ptr + bh * NV + kv, tl.full([NVP], -1, tl.int32),
                 mask=(kv >= tl.sum(c_first.to(tl.int32), 0)) & (kv < NV))
        tl.store(col_mask_ptr + bh * n + c, tl.full([NVP], 1, tl.int8), mask=c_first)


@triton.jit(do_not_specialize=["n", "NW"])
def _vs_diag_kernel(work_ptr, diag_mask_ptr, diag_bits_ptr, n, NW, W,
                    NSP: tl.constexpr, NVP: tl.constexpr, WORDS: tl.constexpr, PAD: tl.constexpr):
    """``diag_bits`` words ``[w0, w0 + WORDS)`` of one (batch row, head) and the ``diag_mask``
    entries they hold: offset ``x`` is chosen iff it lies in one of the filled segments."""
    bh = tl.program_id(1).to(tl.int64)
    work = work_ptr + bh * W
    w = tl.program_id(0) * WORDS + tl.arange(0, WORDS)  # [WORDS]
    bit = tl.arange(0, 64)
    x = (w[:, None] - PAD) * 64 + bit[None, :]  # [WORDS, 64]
    inside = (x >= 0) & (x < n) & (w[:, None] < NW)
    seg = _upper_bound(work + 3 * NSP, tl.load(work + 5 * NSP + NVP), x) - 1
    hi = tl.load(work + 4 * NSP + seg, mask=inside & (seg >= 0), other=-1)
    member = inside & (x <= hi)
    word = tl.sum(member.to(tl.int64) << bit[None, :].to(tl.int64), axis=1)  # distinct bits: the sum is the OR
    tl.store(diag_bits_ptr + bh * NW + w, word, mask=w < NW)
    tl.store(diag_mask_ptr + bh * n + x, member.to(tl.int8), mask=inside)


@triton.jit(do_not_specialize=["nqb", "NV", "R"])  # NV, R: budgets clipped to the length, as in _vs_lists_kernel
def _block_columns_kernel(c_ptr, run_start_ptr, run_end_ptr, run_count_ptr, idx_ptr, count_ptr, before_ptr,
                          lead_ptr, NV, R, nqb, block_m, NVP: tl.constexpr):
    """One program per (query block ``I``, batch row x head): keep the distinct columns that are
    causal for the block's last row and outside its key ranges, compacted in ascending order;
    ``col_lead``: how many of the head's first columns are kept before the first one dropped."""
    I = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, NVP)
    c = tl.load(c_ptr + bh * NV + k, mask=k < NV, other=-1)  # [NVP] distinct ascending, then -1
    m0 = I * block_m
    # column c lies in a key range of this block iff y = m0 + block_m - 1 - c is in [δa, δb +
    # block_m - 1] for a run; those intervals are disjoint and ascending: test the last with δa <= y
    y = m0 + block_m - 1 - c
    ok = (c >= 0) & (y >= 0)
    r = _upper_bound(run_start_ptr + bh * R, tl.load(run_count_ptr + bh), y) - 1
    end = tl.load(run_end_ptr + bh * R + r, mask=ok & (r >= 0), other=-1)
    keep = ok & ~((r >= 0) & (y <= end + block_m - 1))
    kept = keep.to(tl.int32)
    count = tl.sum(kept, axis=0)
    row = idx_ptr + (bh * nqb + I) * NV
    tl.store(row + tl.cumsum(kept, axis=0) - 1, c.to(tl.int32), mask=keep)
    tl.store(row + k, tl.full([NVP], -1, tl.int32), mask=(k >= count) & (k < NV))
    tl.store(count_ptr + bh * nqb + I, count)
    tl.store(before_ptr + bh * nqb + I, tl.sum((keep & (c < m0)).to(tl.int32), axis=0))
    first_drop = tl.min(tl.where((c >= 0) & ~keep, k, NVP), axis=0)
    tl.store(lead_ptr + bh * nqb + I, tl.minimum(first_drop, tl.sum((c >= 0).to(tl.int32), axis=0)))


def _convert_triton(vertical: torch.Tensor, slash: torch.Tensor, n: int, block_m: int, fill_gaps: int) -> VSIndex:
    """:func:`convert_vertical_slash` without the dense fallback in three Triton launches (CUDA
    tensors, or CPU tensors under the interpreter), for ``n >= 1`` and lists of at most
    :data:`LIST_CAP` entries."""
    B, H, NV = vertical.shape
    NS = slash.shape[-1]
    R = max(NS, 1)
    BH = B * H
    dev = slash.device
    nqb = cdiv(n, block_m)
    NSP = next_pow2(R)
    NVP = next_pow2(max(NV, 1))
    NW = BITS_PAD_WORDS + cdiv(n, _WORD) + 1
    i32 = dict(dtype=torch.int32, device=dev)
    run_start, run_end = torch.empty(B, H, R, **i32), torch.empty(B, H, R, **i32)
    run_count = torch.empty(B, H, **i32)
    run_solid = torch.empty(B, H, R, dtype=torch.int8, device=dev)
    cols = torch.empty(B, H, NV, **i32)
    col_mask = torch.zeros(B, H, n, dtype=torch.int8, device=dev)
    diag_mask = torch.empty(B, H, n, dtype=torch.int8, device=dev)
    diag_bits = torch.empty(B, H, NW, dtype=torch.int64, device=dev)
    col_index = torch.empty(B, H, nqb, NV, **i32)
    col_count = torch.empty(B, H, nqb, **i32)
    col_before = torch.empty(B, H, nqb, **i32)
    col_lead = torch.empty(B, H, nqb, **i32)
    W = 5 * NSP + NVP + 1
    work = torch.empty(BH, W, **i32)
    merge = min(max(block_m, fill_gaps + 1), n + 1)  # distances never exceed n - 1: same results
    fill = min(fill_gaps, n)
    if BH > 0:
        _vs_lists_kernel[(BH, 2)](slash.contiguous(), vertical.contiguous(), NS, NV, n, merge, fill, R, W,
                                run_start, run_end, run_count, run_solid, cols, col_mask, work,
                                NSP=NSP, NVP=NVP, num_warps=LISTS_WARPS)
        _vs_diag_kernel[(cdiv(NW, _DIAG_WORDS), BH)](work, diag_mask, diag_bits, n, NW, W, NSP=NSP, NVP=NVP,
                                                             WORDS=_DIAG_WORDS, PAD=BITS_PAD_WORDS, num_warps=4)
        _block_columns_kernel[(nqb, BH)](cols, run_start, run_end, run_count, col_index, col_count, col_before,
                                         col_lead, NV, R, nqb, block_m, NVP=NVP, num_warps=4)
    return VSIndex(block_m=block_m, n=n, run_start=run_start, run_end=run_end, run_count=run_count,
                   run_solid=run_solid, col_index=col_index, col_count=col_count, col_before=col_before,
                   columns=cols, col_lead=col_lead, diag_mask=diag_mask, diag_bits=diag_bits, col_mask=col_mask,
                   dense=torch.zeros(B, H, dtype=torch.bool, device=dev), all_solid=fill_gaps >= block_m - 1)


def _block_columns_torch(c: torch.Tensor, cover: torch.Tensor, nqb: int, block_m: int):
    """The block column lists (``col_index, col_count, col_before, col_lead``) in torch ops from
    the distinct ascending columns ``c [B, H, NV]`` (-1 after them) and ``cover [B, H, span]``
    (``cover[y]``: a column with ``y = m0 + block_m - 1 - c`` lies in a key range of the block at
    ``m0``). Materialises ``[B, H, NQB, NV]`` int64 temporaries (~3 GB of traffic at 128K on the
    GPU)."""
    B, H, NV = c.shape
    span = cover.shape[-1]
    m0 = torch.arange(nqb, device=c.device, dtype=torch.long) * block_m  # [NQB]
    c = c.long()
    y = m0[:, None] - c[..., None, :] + (block_m - 1)  # [B, H, NQB, NV]
    inside = cover[..., None, :].expand(B, H, nqb, span).gather(-1, y.clamp(0, span - 1))
    keep = (c[..., None, :] >= 0) & (y >= 0) & ~inside
    col_index, col_count = _compact(c[..., None, :].expand(B, H, nqb, NV), keep)
    col_before = ((col_index >= 0) & (col_index < m0[:, None])).sum(-1, dtype=torch.int32)
    slot = torch.arange(NV, device=c.device)
    first_drop = F.pad(torch.where((c[..., None, :] >= 0) & ~keep, slot, NV), (0, 1), value=NV).amin(-1)
    col_lead = torch.minimum(first_drop, (c >= 0).sum(-1, keepdim=True)).to(torch.int32)
    return col_index, col_count, col_before, col_lead


#: Chunk of the two-level prefix sum (:func:`_prefix_sum`).
_SCAN_CHUNK = 1024


def _prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive int32 prefix sums of ``x [..., n]`` along the last dim, in two levels: within
    chunks of :data:`_SCAN_CHUNK`, then over the chunk totals. Same integers as ``cumsum``, but
    torch's scan over a few long rows runs about one thread block per row (0.19 ms for 32 rows
    of 128K on the H200)."""
    *lead, n = x.shape
    if n <= _SCAN_CHUNK:
        return x.cumsum(-1, dtype=torch.int32)
    chunks = cdiv(n, _SCAN_CHUNK)
    local = F.pad(x, (0, chunks * _SCAN_CHUNK - n)).view(*lead, chunks, _SCAN_CHUNK).cumsum(-1, dtype=torch.int32)
    totals = local[..., -1]
    local += (totals.cumsum(-1, dtype=torch.int32) - totals)[..., None]  # + everything before the chunk
    return local.view(*lead, chunks * _SCAN_CHUNK)[..., :n]


def _diag_bits(diag_mask: torch.Tensor) -> torch.Tensor:
    """``diag_bits [..., NW]`` int64 of ``diag_mask [..., n]`` (torch ops)."""
    *lead, n = diag_mask.shape
    dev = diag_mask.device
    words = cdiv(n, _WORD)
    padded = F.pad(diag_mask, (BITS_PAD_WORDS * _WORD, (words + 1) * _WORD - n)).view(*lead, -1, _WORD)
    weights = torch.ones(_WORD, dtype=torch.int64, device=dev) << torch.arange(_WORD, device=dev)
    return (padded.to(torch.int64) * weights).sum(-1).contiguous()  # distinct bits: the sum is the OR


def _convert_torch(vertical: torch.Tensor, slash: torch.Tensor, n: int, block_m: int, fill_gaps: int) -> VSIndex:
    """:func:`convert_vertical_slash` without the dense fallback in torch ops (any device)."""
    B, H, NV = vertical.shape
    NS = slash.shape[-1]
    R = max(NS, 1)
    dev = slash.device
    nqb = cdiv(n, block_m)

    # slash runs: a new run starts where the distance to the previous distinct offset exceeds
    # block_m (and exceeds fill_gaps + 1: a filled gap never separates runs)
    merge = max(block_m, fill_gaps + 1)
    s, s_valid, _ = _sorted_set(slash, n)  # [B, H, NS]
    prev = F.pad(s[..., :-1], (1, 0), value=-merge - 1)
    nxt = F.pad(s[..., 1:], (0, 1), value=n)
    starts = s_valid & (s - prev > merge)
    ends = s_valid & ((nxt - s > merge) | (nxt >= n))
    run_id = starts.long().cumsum(-1) - 1
    run_start = torch.full((B, H, R + 1), -1, dtype=torch.int32, device=dev)
    run_start.scatter_(-1, torch.where(starts, run_id, R), s.to(torch.int32))
    run_end = torch.full((B, H, R + 1), -1, dtype=torch.int32, device=dev)
    run_end.scatter_(-1, torch.where(ends, run_id, R), s.to(torch.int32))
    run_count = starts.sum(-1, dtype=torch.int32)

    diag_mask = _membership(s, n)  # [B, H, n]
    if fill_gaps > 0 and n > 0:  # offsets strictly between neighbours a < b with b - a - 1 <= fill_gaps
        gap = s_valid & (nxt < n) & (nxt - s > 1) & (nxt - s - 1 <= fill_gaps)
        fill = torch.zeros(B, H, n + 1, dtype=torch.int32, device=dev)
        fill.scatter_add_(-1, torch.where(gap, s + 1, n), gap.to(torch.int32))
        fill.scatter_add_(-1, torch.where(gap, nxt, n), -gap.to(torch.int32))
        diag_mask |= (_prefix_sum(fill)[..., :n] > 0).to(torch.int8)
    diag_bits = _diag_bits(diag_mask)
    # a run is solid when its chosen offsets count db - da + 1
    prefix = F.pad(_prefix_sum(diag_mask), (1, 0)).long()  # [B, H, n + 1]
    da, db = run_start[..., :R].long(), run_end[..., :R].long()
    live = torch.arange(R, device=dev) < run_count[..., None]
    chosen = prefix.gather(-1, (db + 1).clamp(0, n)) - prefix.gather(-1, da.clamp(0, n))
    run_solid = (live & (chosen == db - da + 1)).to(torch.int8)

    # cover[y], y = m0 - c + block_m - 1: column c lies in a key range of the block at m0
    # iff m0 - c lies in [δa - block_m + 1, δb] for some run, i.e. y in [δa, δb + block_m - 1]
    span = n + block_m
    diff = torch.zeros(B, H, span + 1, dtype=torch.int32, device=dev)
    one = torch.ones_like(s, dtype=torch.int32)
    diff.scatter_add_(-1, torch.where(starts, s, span), one)
    diff.scatter_add_(-1, torch.where(ends, s + block_m, span), -one)
    cover = _prefix_sum(diff)[..., :span] > 0  # [B, H, span]

    c, _, c_first = _sorted_set(vertical, n)  # [B, H, NV]
    col_mask = _membership(c, n)
    columns, _ = _compact(c, c_first)
    col_index, col_count, col_before, col_lead = _block_columns_torch(columns, cover, nqb, block_m)
    return VSIndex(
        block_m=block_m,
        n=n,
        run_start=run_start[..., :R].contiguous(),
        run_end=run_end[..., :R].contiguous(),
        run_count=run_count,
        run_solid=run_solid,
        col_index=col_index,
        col_count=col_count,
        col_before=col_before,
        columns=columns,
        col_lead=col_lead,
        diag_mask=diag_mask,
        diag_bits=diag_bits,
        col_mask=col_mask,
        dense=torch.zeros(B, H, dtype=torch.bool, device=dev),
        all_solid=fill_gaps >= block_m - 1,
    )


def _dense_causal(n: int, block_m: int, R: int, NV: int, device) -> VSIndex:
    """The dense causal index of one head, ``[1, 1]`` leading dims: one run ``[0, n - 1]``, no columns."""
    run_start = torch.full((1, 1, R), -1, dtype=torch.int32, device=device)
    run_end = run_start.clone()
    run_start[..., 0] = 0  # device fills: no host tensor is copied (capturable)
    run_end[..., 0] = n - 1
    run_solid = torch.zeros(1, 1, R, dtype=torch.int8, device=device)
    run_solid[..., 0] = 1
    diag_mask = torch.ones(1, 1, n, dtype=torch.int8, device=device)
    nqb = cdiv(n, block_m)
    return VSIndex(
        block_m=block_m,
        n=n,
        run_start=run_start,
        run_end=run_end,
        run_count=torch.ones(1, 1, dtype=torch.int32, device=device),
        run_solid=run_solid,
        col_index=torch.full((1, 1, nqb, NV), -1, dtype=torch.int32, device=device),
        col_count=torch.zeros(1, 1, nqb, dtype=torch.int32, device=device),
        col_before=torch.zeros(1, 1, nqb, dtype=torch.int32, device=device),
        columns=torch.full((1, 1, NV), -1, dtype=torch.int32, device=device),
        col_lead=torch.zeros(1, 1, nqb, dtype=torch.int32, device=device),
        diag_mask=diag_mask,
        diag_bits=_diag_bits(diag_mask),
        col_mask=torch.zeros(1, 1, n, dtype=torch.int8, device=device),
        dense=torch.ones(1, 1, dtype=torch.bool, device=device),
        all_solid=True,
    )


def _check_dense_over(dense_over: object) -> None:
    if dense_over is None:
        return
    if isinstance(dense_over, bool) or not isinstance(dense_over, (int, float)):
        raise TypeError(f"dense_over must be a float or None, got {type(dense_over).__name__}")
    if not math.isfinite(dense_over) or dense_over < 0:
        raise ValueError(f"dense_over must be a finite number >= 0 (None disables the fallback), got {dense_over}")


def convert_vertical_slash(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    n: int,
    *,
    block_m: int,
    fill_gaps: int = 0,
    dense_over: float | None = None,
    block_n: int = 64,
) -> VSIndex:
    """Logical vertical-slash index -> :class:`VSIndex` for query blocks of ``block_m`` rows.

    Args:
        vertical: ``[B, H, NV]`` int key columns (logical), -1 padded, any order, duplicates ok.
        slash: ``[B, H, NS]`` int offsets ``δ = i - j``, -1 padded, any order, duplicates ok; offset
            0 is not assumed. Entries ``>= n`` are ignored like padding.
        n: sequence length (positions ``0 .. n-1``).
        block_m: query rows per block; must equal the kernel's query tile
            (:func:`minference.kernels.vertical_slash_block_m`).
        fill_gaps: the offsets are first closed over gaps of at most this many missing offsets
            (:func:`minference.index_sets.slash_set`, "Gap filling" in the module docstring).
        dense_over: if given (a finite number ``>= 0``; :data:`DENSE_OVER` is the dispatcher's
            default), a head whose index runs more than ``dense_over`` times the key tiles of the
            dense causal index gets the dense causal index instead (``dense[b, h]`` True; see
            "Dense fallback" in the module docstring). ``None``: never.
        block_n: the kernel's key tile, used only to count tiles for ``dense_over``.

    Returns:
        :class:`VSIndex` on the indices' device. No host synchronisation.
    """
    check_tensor("vertical", vertical, rank=3, dtypes=_INT)
    check_tensor("slash", slash, rank=3, dtypes=_INT)
    if vertical.shape[:2] != slash.shape[:2]:
        raise ValueError(f"vertical and slash must share [B, H], got {tuple(vertical.shape)} and {tuple(slash.shape)}")
    if not same_device(vertical.device, slash.device):
        raise ValueError(f"vertical and slash must be on one device, got {vertical.device} and {slash.device}")
    check_int("n", n, 0)
    check_int("block_m", block_m, 1)
    check_int("block_n", block_n, 1)
    check_fill_gaps(fill_gaps)
    _check_dense_over(dense_over)
    B, H, NV = vertical.shape
    R = max(slash.shape[-1], 1)
    kernels = (slash.is_cuda or interpreting()) and n > 0 and max(R, NV) <= LIST_CAP
    index = (_convert_triton if kernels else _convert_torch)(vertical, slash, n, block_m, fill_gaps)
    if dense_over is None or n == 0:
        return index
    full = _dense_causal(n, block_m, R, NV, slash.device)
    limit = dense_over * vs_physical_tiles(full, block_n).double()  # [1, 1]
    over = vs_physical_tiles(index, block_n).double() > limit  # [B, H]
    picked = {}
    for f in fields(VSIndex):
        value = getattr(index, f.name)
        if isinstance(value, torch.Tensor):
            sel = over.view(B, H, *([1] * (value.dim() - 2)))
            value = torch.where(sel, getattr(full, f.name), value).contiguous()
        picked[f.name] = value
    return VSIndex(**picked)


def vs_index_to_dense(index: VSIndex) -> torch.Tensor:
    """``[B, H, n, n]`` int32: how many times the kernel visits each (query, key) pair.

    The loop of the module docstring, vectorised over positions. For a correct index every
    entry is 0 or 1 and the nonzero pattern equals
    :func:`minference.reference.vertical_slash_mask`, or the causal mask for heads replaced by
    the dense fallback (``index.dense``).
    """
    B, H = index.run_count.shape
    n, bm = index.n, index.block_m
    dev = index.run_count.device
    i = torch.arange(n, device=dev)[:, None]
    j = torch.arange(n, device=dev)[None, :]
    m0 = (i // bm) * bm  # [n, 1]
    causal = j <= i
    delta = (i - j).clamp(min=0)
    visits = torch.zeros(B, H, n, n, dtype=torch.int32, device=dev)
    for b in range(B):
        for h in range(H):
            kept = (index.diag_mask[b, h][delta] != 0) | (index.col_mask[b, h][j] != 0)  # [n, n]
            for r in range(int(index.run_count[b, h])):
                da, db = int(index.run_start[b, h, r]), int(index.run_end[b, h, r])
                in_range = (j >= (m0 - db).clamp(min=0)) & (j <= m0 + bm - 1 - da)
                visits[b, h] += (in_range & causal & kept).int()
            for I in range(cdiv(n, bm)):
                rows = slice(I * bm, min(n, I * bm + bm))
                for c in index.col_index[b, h, I, : int(index.col_count[b, h, I])].tolist():
                    visits[b, h, rows, c] += (torch.arange(n, device=dev)[rows] >= c).int()
    return visits


def vs_physical_tiles(index: VSIndex, block_n: int, seqlen: int | None = None) -> torch.Tensor:
    """``[B, H]`` int64: key tiles of ``block_n`` the kernel runs per head (for physical
    throughput); ``seqlen`` clips the last query block like a row length does."""
    n, bm = index.n, index.block_m
    L = n if seqlen is None else seqlen
    dev = index.run_count.device
    nqb = cdiv(L, bm)
    m0 = torch.arange(nqb, device=dev, dtype=torch.long)[:, None] * bm  # [NQB, 1]
    last = torch.clamp(m0 + bm, max=L) - 1
    valid_run = torch.arange(index.run_start.shape[-1], device=dev) < index.run_count[..., None].long()
    lo = (m0 - index.run_end[..., None, :].long()).clamp(min=0)  # [B, H, NQB, R]
    hi = torch.minimum(m0 + bm - 1 - index.run_start[..., None, :].long(), last) + 1
    ranges = ((hi - lo).clamp(min=0) + block_n - 1) // block_n
    range_tiles = (ranges * valid_run[..., None, :]).sum((-1, -2))
    col_tiles = ((index.col_count[..., :nqb].long() + block_n - 1) // block_n).sum(-1)
    return range_tiles + col_tiles
