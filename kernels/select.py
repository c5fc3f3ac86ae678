"""One-launch selections of the index builders: the radix take shared by the vertical-slash top-k
(columns and diagonals) and the block selection on query-aware scores.

Both pick the same sets as the torch selection :func:`minference.builders.select_top` (ties to
the lowest position), written ascending, without a sort and without a host sync; which rows they
take is decided on the host from the heads' budget rules (:class:`minference.builders.SelectionRule`),
and everything else falls back to the torch selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minference.kernels._common import next_pow2

from minference.builders import RULE_CODES, select_vertical_slash

__all__ = ["select_vertical_slash_triton", "select_query_blocks", "block_index_ascending"]

#: Scores per loop step of the selection kernel (:func:`_select_kernel`).
SELECT_CHUNK = 4096
#: Warps of the selection kernel.
SELECT_WARPS = 8
#: Longest row the selection kernel takes; longer rows keep ``torch.topk``
#: (:func:`minference.index.select_vertical_slash`). One program walks a whole row five times,
#: which is latency-bound on long rows: the kernel beats topk up to 32K and loses from 64K (see
#: docs/tuning.md#select-max-n).
SELECT_MAX_N = 32768
#: Scores per loop step of the fused block selection (:func:`_block_select_kernel`).
BLOCK_SELECT_CHUNK = 1024
#: Warps per program of the fused block selection.
BLOCK_SELECT_WARPS = 4
_TOP_K_CODE = 0  # minference.index.RULE_CODES["top_k"], checked in select_query_blocks
_RELATIVE_CODE = 2  # minference.index.RULE_CODES["relative"]


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


# the widths are the budgets clipped to the length: they follow it where a budget exceeds the prompt; diag_ptr
# as in _vs_scores_kernel
@triton.jit(do_not_specialize=["N", "width_v", "width_s"], do_not_specialize_on_alignment=["diag_ptr"])
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


def select_vertical_slash_triton(col, diag, lens, sinks, locs, nv, ns, width_v: int, width_s: int, rules=None, *,
                                 full_rows=False):
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


# width: top_k clipped to the key blocks, so it follows the length below top_k x block tokens (on the H100 a
# 63,468-token prompt, the first with 496 blocks of 128, compiled a variant at its first token: 1995 ms, not 750)
@triton.jit(do_not_specialize=["NQB", "NS", "width"])
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
                                            CHUNK=block_select_chunk(nqb),
                                            num_warps=BLOCK_SELECT_WARPS)
    return out


def block_select_chunk(nqb: int) -> int:
    """The chunk (a constexpr) of :func:`_block_select_kernel` for rows of ``nqb`` query blocks:
    :data:`BLOCK_SELECT_CHUNK` from ``nqb > BLOCK_SELECT_CHUNK // 4`` on (every length that runs
    sparse: 384 blocks of 128 at the dense threshold), the next power of two (at least 16) below.
    It was ``min(BLOCK_SELECT_CHUNK, next_pow2(nqb))``: 512 for blocks of 128 up to 64K tokens, so
    the first longer prompt compiled a second variant. The selection does not depend on the chunk
    (integer histograms, masked loads past the diagonal)."""
    return BLOCK_SELECT_CHUNK if nqb > BLOCK_SELECT_CHUNK // 4 else max(16, next_pow2(nqb))


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
