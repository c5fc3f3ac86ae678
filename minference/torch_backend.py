"""Portable PyTorch attention over the package's index formats (no Triton, any device).

The path for real-model runs on the CPU: same signatures and semantics as the Triton kernels
in :mod:`minference.kernels` (and their float64 twins in :mod:`minference.reference`), exact on
the chosen set, and doing only the chosen work:

* **fused path** (finite keys and values on the CPU): per query head, the set is cut into pieces
  that the CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
  what ``scaled_dot_product_attention`` runs; it also returns the log-sum-exp) takes without
  copying keys: vertical-slash and A-shape are their columns (gathered once, a stride-0 view
  over the query tiles) plus clusters of diagonal offsets (a cluster ``[a, b]`` gives the tile of
  rows ``lo..lo+R-1`` the consecutive keys ``lo-b .. lo+R-1-a``: an overlapping strided view,
  with one ``[R, b-a+R]`` mask for all tiles); block-sparse is the causal diagonal block (a view)
  plus the gathered blocks below it; dense is the causal kernel. Pieces merge exactly by
  log-sum-exp; every pair is in one piece. Work per row: the chosen keys plus up to ``R - 1`` per
  cluster, memory: the chosen set (never ``n^2``).
* **gathered path** (any other input: a non-finite key or value, another device): per chunk of
  query tiles, the union of the tile's candidate keys gathered and one exact softmax
  (:func:`_manual`) masked before the running max, so a non-finite key or value reaches only the
  rows whose set holds it (the definition); the fused kernel would add the mask to a NaN logit
  and multiply every value it loads.

Non-finite inputs (docs/contract.md): with ``validate=True`` (default) the attention functions
refuse NaN or inf in ``q`` (computed heads, query rows) and in ``k`` / ``v`` (the kv heads of the
computed heads) inside the rows, with the Triton kernels' one-line errors
(:func:`minference._checks.check_finite_kv` names the kv head and its query heads). With
``validate=False`` a non-finite key or value reaches exactly the rows whose set holds it: there
each element is the definition's (a NaN value element gives NaN in that element of the output,
the row's other elements stay exact), and every other row is exact.

The candidate sets are those of :mod:`minference.reference.masks` (``*_rows_mask`` below
evaluates them for a range of rows; the tests prove them equal to the reference masks). Every
entry point reads the row lengths on the host, so this backend synchronises on CUDA tensors: it
is for portability, not for graph capture.

The index builders :func:`vertical_slash_index` and :func:`block_sparse_index` share validation,
budgets, budget rules and the selection with the Triton builders (:mod:`minference.builders`,
used by :mod:`minference.kernels.estimate_vs` and :mod:`minference.kernels.estimate_bs`); only
the score computation differs: here each head's ``[r, n]`` probabilities of the sampled rows are
materialised (fine on the host at the lengths this backend is for; one head per worker) and
reduced with ``scatter_reduce``, and blocks are pooled with reshapes.
Rows outside a sequence and rows with an empty candidate set come out as zeros (log-sum-exp
``-inf``); heads not listed in ``heads`` are left untouched in ``out``.

The attention functions also take queries that are only part of the key rows (``q_seqlens``,
``q_seqstarts``; docs/kernels.md, "query rows": a chunk after a cache, or a row's last tokens):
the tiles stay those of the whole row, in its positions, and only the tiles holding queries run
(from ``lo // R``, ``lo`` the first query's position), so a chunk of ``C`` queries costs ``C``
times its chosen keys. Dense splits such a chunk into the keys before it (all visible) and its
causal square, merged by log-sum-exp like every other pair of pieces.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from minference._checks import (
    check_finite_kv,
    check_finite_rows,
    check_index,
    check_int,
    check_out,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    check_tensor,
    default_scale,
)
from minference.builders import scoring_rows
from minference.index import blocks_from_slots, build_block_sparse_index, build_vertical_slash_index, scorer_rows
from minference.index_sets import check_fill_gaps, head_ids, per_head_budget, scatter_set, slash_set
from minference.patterns import DEFAULT_BLOCK_SIZE, DEFAULT_LAST_Q

__all__ = [
    "ashape_attention",
    "vertical_slash_attention",
    "block_sparse_attention",
    "dense_attention",
    "ashape_rows_mask",
    "vertical_slash_rows_mask",
    "block_sparse_rows_mask",
    "causal_rows_mask",
    "vertical_slash_index",
    "block_sparse_index",
    "query_block_scores",
    "CHUNK_ELEMENTS",
]

#: Upper bound on the mask / score elements of one query chunk (``Hg * rows * keys``).
CHUNK_ELEMENTS = 1 << 24

_INT = (torch.int32, torch.int64)


def _positions(i0: int, i1: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(i0, i1, device=device)[:, None], torch.arange(n, device=device)[None, :]


def causal_rows_mask(i0: int, i1: int, n: int, device=None) -> torch.Tensor:
    """Rows ``i0..i1-1`` of :func:`minference.reference.masks.causal_mask`: ``[i1-i0, n]``."""
    i, j = _positions(i0, i1, n, device)
    return j <= i


def ashape_rows_mask(i0: int, i1: int, n: int, sink: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Rows ``i0..i1-1`` of the A-shape mask for per-head ``sink, window [H]``: ``[H, i1-i0, n]``."""
    i, j = _positions(i0, i1, n, sink.device)
    g, w = sink[:, None, None], window[:, None, None]
    return (j <= i) & ((j < g) | (j > i - w))


def vertical_slash_rows_mask(i0: int, i1: int, n: int, vertical: torch.Tensor, slash: torch.Tensor,
                             fill_gaps: int = 0) -> torch.Tensor:
    """Rows ``i0..i1-1`` of :func:`minference.reference.masks.vertical_slash_mask` over keys
    ``0..n-1``: ``vertical [..., NV]``, ``slash [..., NS]`` -> ``[..., i1-i0, n]``."""
    i, j = _positions(i0, i1, n, vertical.device)
    width = max(n, i1)
    cols = scatter_set(width, vertical)[..., :n]  # [..., n]
    diags = slash_set(width, slash, fill_gaps)  # [..., width]
    offset = (i - j).clamp(min=0)  # [rows, n]
    return (diags[..., offset] | cols[..., None, :]) & (j <= i)


def block_sparse_rows_mask(i0: int, i1: int, n: int, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Rows ``i0..i1-1`` of :func:`minference.reference.masks.block_sparse_mask` over keys
    ``0..n-1``: ``blocks [..., NQB, K]`` -> ``[..., i1-i0, n]``."""
    i, j = _positions(i0, i1, n, blocks.device)
    nqb = blocks.shape[-2]
    chosen = scatter_set(nqb, blocks)  # [..., NQB, NQB]
    qb = (i // block).clamp(max=nqb - 1)
    kb = (j // block).clamp(max=nqb - 1)
    return chosen[..., qb, kb] & (j <= i) & (j // block < nqb)


#: Query rows per tile on the vertical-slash, A-shape and dense paths (block-sparse tiles are its
#: blocks). Each tile gathers the union of its rows' candidate keys, so a tile of ``R`` rows reads
#: each slash run's keys plus ``R - 1`` (see docs/tuning.md#tile-rows).
TILE_ROWS = 64

_INF = float("-inf")
#: The CPU flash-attention operator behind ``scaled_dot_product_attention``: it takes an additive
#: mask and also returns the log-sum-exp (the public function does not).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :data:`_FLASH_CPU` (read at each call); the fused path that calls it runs
    only where the operator exists."""
    op = _FLASH_CPU
    assert op is not None, "the fused path needs the CPU flash-attention operator"
    out = op(*args, **kwargs)
    return out[0], out[1]


class _Tiles:
    """One batch row's candidate sets for one pattern, cut into query tiles.

    ``rows`` query rows per tile; ``count`` tiles (the last one may be short); ``live [Hg, n]``
    whether a row's set is non-empty; ``keys(c0, c1)`` gives tiles ``c0..c1-1``'s gathered key
    positions ``pos [Hg, C, L]`` (ascending, padded with 0), their row selector ``sel [Hg, C, L]``
    (0: member where ``i - j`` is a chosen offset, 1: member where ``j <= i``, 2: padding) and
    ``cnt [Hg, C]``. ``windows [Hg or 1, 3, n + rows + 1, rows]`` (a strided view of a 3-row
    table over offsets ``x = i - j``, shifted by ``rows``) turns a key's selector and base offset
    ``lo - j`` into its additive mask over the tile's rows: one gather of ``rows`` contiguous
    entries per gathered key, never an elementwise ``[rows, L]`` formula.
    """

    def __init__(self, rows: int, n: int, live: torch.Tensor, keys, diags: torch.Tensor | None, dtype):
        self.rows, self.n, self.live, self.keys = rows, n, live, keys
        self.count = -(-n // rows)
        H = 1 if diags is None else diags.shape[0]
        table = torch.full((H, 3, n + 2 * rows), _INF, dtype=dtype, device=live.device)
        if diags is not None:
            table[:, 0, rows : rows + n].masked_fill_(diags, 0)
        table[:, 1, rows:] = 0
        self.windows = table.unfold(-1, rows, 1)

    def mask(self, c0: int, pos: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Additive mask ``[Hg, C, rows, L]`` (0 for a candidate pair, -inf otherwise)."""
        Hg, C, L = pos.shape
        lo = torch.arange(c0, c0 + C, device=pos.device)[None, :, None] * self.rows
        h = torch.arange(Hg, device=pos.device)[:, None, None] if self.windows.shape[0] > 1 else 0
        return self.windows[h, sel, lo - pos + self.rows].transpose(-1, -2)


def _compact(need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``need [Hg, C, K]`` bool -> positions of its set bits ``[Hg, C, L]`` (ascending, padded with
    0) and ``cnt [Hg, C]``, ``L = max cnt``."""
    cnt = need.sum(-1)
    width = int(cnt.max()) if cnt.numel() else 0
    slot = (need.cumsum(-1) - 1).masked_fill_(~need, width)
    pos = torch.zeros(*need.shape[:-1], width + 1, dtype=torch.long, device=need.device)
    pos.scatter_(-1, slot, torch.arange(need.shape[-1], device=need.device).expand_as(slot))
    return pos[..., :width], cnt


def _band_tiles(cols: torch.Tensor, diags: torch.Tensor, n: int, dtype, rows: int | None = None) -> _Tiles:
    """Tiles of the set ``{j in cols: j <= i} ∪ {i - δ: δ in diags}`` (``cols, diags [Hg, n]``
    bool): vertical-slash, and A-shape as columns ``j < sink`` with offsets ``δ < window``."""
    rows = TILE_ROWS if rows is None else rows
    dev = cols.device
    # reach[x + rows - 1]: some chosen offset lies in x .. x + rows - 1 (x = lo - j of a key)
    cum = F.pad(diags.to(torch.int32).cumsum(-1), (1, 0))
    x = torch.arange(-(rows - 1), n, device=dev)
    reach = (cum[:, (x + rows).clamp(0, n)] - cum[:, x.clamp(0, n)]) > 0  # [Hg, n + rows - 1]
    either = cols | diags  # row i is non-empty iff a column or an offset is <= i
    first = torch.where(either.any(-1), either.int().argmax(-1), n)
    live = torch.arange(n, device=dev)[None, :] >= first[:, None]

    def keys(c0: int, c1: int):
        lo = torch.arange(c0, c1, device=dev)[:, None] * rows  # [C, 1]
        kmax = min(n, c1 * rows)  # later keys are causal for no row of these tiles
        j = torch.arange(kmax, device=dev)[None, :]
        off = lo - j + rows - 1  # index of x = lo - j in reach; < 0: the key is after every row
        need = cols[:, None, :kmax] & (j < lo + rows)[None]
        need |= reach[:, off.clamp(min=0)] & (off >= 0)[None]
        pos, cnt = _compact(need)
        sel = torch.where(cols.gather(-1, pos.flatten(1)).view_as(pos), 1, 0)
        return pos, sel, cnt

    return _Tiles(rows, n, live, keys, diags, dtype)


def _chosen_blocks(blocks: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``blocks [Hg, NQB, K]`` of one batch row -> ``(blk [Hg, nb, K], big, nvalid [Hg, nb])``: per
    query block of the row its chosen key blocks on or below the diagonal, each once, ascending,
    then ``big`` (none)."""
    nb = -(-n // block)
    big = nb + 1
    blk = blocks[:, :nb].long()
    ok = (blk >= 0) & (blk <= torch.arange(nb, device=blk.device)[:, None])  # above the diagonal: nothing
    blk = torch.where(ok, blk, big).sort(-1).values
    blk[..., 1:].masked_fill_(blk[..., 1:] == blk[..., :-1], big)  # duplicates count once
    blk = blk.sort(-1).values
    return blk, big, (blk < big).sum(-1)


def _block_tiles(blocks: torch.Tensor, n: int, block: int, dtype) -> _Tiles:
    """Tiles of block-sparse: one tile per query block, its chosen key blocks on or below the
    diagonal, each once (``blocks [Hg, NQB, K]`` of one batch row)."""
    blk, big, nvalid = _chosen_blocks(blocks, n, block)
    live = (nvalid > 0).repeat_interleave(block, -1)[:, :n]
    offs = torch.arange(block, device=blk.device)

    def keys(c0: int, c1: int):
        width = int(nvalid[:, c0:c1].max()) if nvalid.numel() else 0
        b = blk[:, c0:c1, :width]
        pos = (b[..., None] * block + offs).flatten(-2)  # [Hg, C, width * block]
        real = (b < big).repeat_interleave(block, -1) & (pos < n)
        return pos.masked_fill_(~real, 0), torch.where(real, 1, 2), real.sum(-1)

    return _Tiles(block, n, live, keys, None, dtype)


def _manual(qt, kt, vt, mask, scale):
    """Exact softmax of one chunk of tiles whatever the values: a key or value outside a row's set
    never reaches it (masked before the running max; values outside the set contribute an exact
    zero instead of ``0 * nan``). Returns ``out [Hg, C, R, D]`` (unnormalised rows of empty sets
    aside) and ``lse [Hg, C, R]`` in float32 (float64 for float64 inputs)."""
    dt = torch.promote_types(qt.dtype, torch.float32)
    member = mask == 0
    s = torch.matmul(qt.to(dt), kt.to(dt).transpose(-1, -2)).mul_(scale).masked_fill_(~member, _INF)
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == _INF, 0)  # empty rows: exp(-inf) = 0 below, not nan
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    vf = vt.to(dt)
    bad = ~torch.isfinite(vf).all(-1, keepdim=True)  # [Hg, C, L, 1]: a value row with a non-finite element
    if bool(bad.any()):  # only these rows need care: 0 * inf = nan would leak to every row
        h, c, l = bad[..., 0].nonzero(as_tuple=True)
        # the whole row out of the product (not only its bad elements): the term below adds all of
        # it, finite elements included, to the rows whose set holds the key (issue 34)
        o = torch.matmul(p, vf.masked_fill(bad, 0))
        keep = member[h, c, :, l][..., None]  # [nbad, R, 1]
        o.index_put_((h, c), torch.where(keep, p[h, c, :, l][..., None] * vf[h, c, l][:, None, :], 0),
                     accumulate=True)
    else:
        o = torch.matmul(p, vf)
    return o / den, (m + den.log()).squeeze(-1)


# --- The fused path: finite inputs on the CPU ---------------------------------------------------
#
# Per query head, a set is split into pieces that the CPU flash kernel runs without copying keys:
# a vertical-slash (or A-shape) set is its columns (gathered once, shared by every tile through a
# stride-0 view) plus clusters of its diagonal offsets (offsets closer than a tile merge); a
# cluster [a, b] gives tile ``c`` the consecutive keys ``c*R - b .. c*R + R - 1 - a``, an
# overlapping strided view of the keys, with one ``[R, W]`` mask shared by all tiles. Block-sparse
# is the diagonal block (causal, a view) plus the gathered blocks below it. Each piece returns its
# rows' output and log-sum-exp; pieces merge exactly by log-sum-exp. A pair is in exactly one
# piece (columns exclude the pairs on chosen offsets).


def _merge(acc_o, acc_l, r0, o, l, empty) -> None:
    """Add one piece (``o [..., rows, D]``, ``l [..., rows]``; ``empty`` rows contribute nothing)
    to rows ``r0..`` of the accumulators ``acc_o [..., R, D]``, ``acc_l [..., R]``."""
    r1 = r0 + l.shape[-1]
    l, o = l.to(acc_l.dtype), o.to(acc_o.dtype)
    if bool(empty.any()):  # most pieces have none: no two full copies of the piece
        l, o = l.masked_fill(empty, _INF), o.masked_fill(empty[..., None], 0)
    old = acc_l[..., r0:r1]
    if bool((old == _INF).all()):  # the rows' first piece
        acc_o[..., r0:r1, :], acc_l[..., r0:r1] = o, l
        return
    new = torch.logaddexp(old, l)
    safe = new.masked_fill(new == _INF, 0)
    acc_o[..., r0:r1, :].mul_(torch.exp(old - safe)[..., None]).add_(o * torch.exp(l - safe)[..., None])
    acc_l[..., r0:r1] = new


def _tile_chunks(first: int, last: int, per_tile: int):
    """Tile ranges ``[c0, c1)`` covering ``first..last-1`` with ``per_tile * (c1 - c0)`` elements
    at most :data:`CHUNK_ELEMENTS` (at least one tile)."""
    step = max(1, CHUNK_ELEMENTS // max(1, per_tile))
    return [(c, min(last, c + step)) for c in range(first, last, step)]


def _clusters(diags: torch.Tensor, gap: int) -> list[tuple[int, int]]:
    """Offsets of ``diags [n]`` as ``(a, b)`` clusters: runs closer than ``gap`` missing offsets merge."""
    d = diags.nonzero().flatten()
    if d.numel() == 0:
        return []
    cut = ((d[1:] - d[:-1]) > gap).nonzero().flatten()
    lo = torch.cat([d[:1], d[cut + 1]]).tolist()
    hi = torch.cat([d[cut], d[-1:]]).tolist()
    return list(zip(lo, hi))


class _Band:
    """One head's vertical-slash set ``{j in cols: j <= i} ∪ {i - δ: δ in diags}`` prepared once for
    :func:`_fused_band` (every part of the head's rows reuses it): ``cols`` 1-D key positions and
    their keys and values ``kc, vc [NV, D]``, the offset table of the columns' masks, ``solid``
    (offsets ``0..solid-1`` all chosen; 0 if offset 0 is not) and the clusters ``(a, b, band [R, W])``
    of the offsets with their masks. ``kpad, vpad [pad + count*R, D]`` hold key ``j`` at row ``pad + j``."""

    def __init__(self, cols: torch.Tensor, diags: torch.Tensor, n: int, R: int, kpad, vpad, pad: int, dt):
        dev = diags.device
        self.n, self.R, self.cols = n, R, cols
        self.solid = 0
        if n and bool(diags[0]):
            self.solid = int((~diags).int().argmax()) if not bool(diags.all()) else n
        if cols.numel():
            # columns off the chosen offsets: x = i - j >= 0 and x not in diags (those pairs are a cluster's)
            table = torch.full((n + 2 * R,), _INF, dtype=dt, device=dev)
            table[R : R + n].masked_fill_(~diags, 0)
            table[R + n :] = 0
            self.windows = table.unfold(0, R, 1)  # windows[u] = table[u : u + R], offsets u - R ..
            self.kc, self.vc = kpad[pad + cols], vpad[pad + cols]
        self.clusters = []
        for a, b in _clusters(diags, R):
            W = b - a + R
            r = torch.arange(R, device=dev)[:, None]
            x = b - torch.arange(W, device=dev)[None, :] + r  # offset of (row r, window key l)
            inside = (x >= a) & (x <= b)
            band = torch.full((R, W), _INF, dtype=dt, device=dev).masked_fill_(inside & diags[x.clamp(a, b)], 0)
            self.clusters.append((a, b, band))


def _fused_band(acc_o, acc_l, qh, kpad, vpad, pad, band: _Band, scale, t0=0) -> None:
    """One head's vertical-slash set (``band``) on a part of its rows into the accumulators:
    ``qh [(count-t0)*R, D]`` holds the rows of tiles ``t0..count-1`` (tile ``c``: rows ``c*R ..``;
    ``count`` the part's end, not necessarily the row's; the accumulators likewise), ``kpad, vpad``
    hold key ``j`` at row ``pad + j`` with zeros around it, to the row's last tile."""
    n, R, cols = band.n, band.R, band.cols
    count, D = t0 + qh.shape[0] // R, qh.shape[1]
    dev = qh.device
    q4 = qh.view(1, count - t0, R, D)
    # A solid run of offsets from 0 (every offset 0..b chosen: the local diagonals, closed by gap
    # filling; an A-shape window): a row i <= b reads exactly the keys 0..i, so the tiles wholly
    # inside it are one causal call (no mask, no per-tile chunks); no column and no other offset
    # adds to them (a column j <= i lies on a chosen offset, other offsets exceed i). From a tile
    # t0 > 0 (a part of the rows, or query rows): the causal square of the tiles' own keys (the
    # kernel aligns its queries with the first keys it gets) merged with the keys before them.
    causal = min(count, band.solid // R)  # tiles t0..causal-1 done by the causal call
    if causal > t0:
        r0, rows = t0 * R, (causal - t0) * R
        qs = q4.view(1, 1, -1, D)[:, :, :rows]
        o, l = _flash(qs, kpad[None, None, pad + r0 : pad + r0 + rows],
                      vpad[None, None, pad + r0 : pad + r0 + rows], is_causal=True, scale=scale)
        acc_o[:rows] = o.reshape(rows, D)
        acc_l[:rows] = l.reshape(rows)
        if r0:  # the keys before the first tile: every row sees all of them (a part of the rows)
            o, l = _flash(qs, kpad[None, None, pad : pad + r0], vpad[None, None, pad : pad + r0], scale=scale)
            _merge(acc_o, acc_l, 0, o.reshape(rows, D), l.reshape(rows),
                   torch.zeros(rows, dtype=torch.bool, device=dev))
    if cols.numel() and causal < count:
        for c0, c1 in _tile_chunks(max(t0, causal), count, R * cols.numel()):
            lo = torch.arange(c0, c1, device=dev)[:, None] * R
            mask = band.windows[(lo - cols + R).clamp(0, n + R)].transpose(-1, -2)  # [C, R, NV]
            nt = c1 - c0
            o, l = _flash(q4[:, c0 - t0 : c1 - t0], band.kc.expand(1, nt, -1, -1), band.vc.expand(1, nt, -1, -1),
                          attn_mask=mask[None], scale=scale)
            _merge(acc_o, acc_l, (c0 - t0) * R, o.reshape(-1, D), l.reshape(-1), (mask.amax(-1) == _INF).flatten())
    for a, b, mask_ab in band.clusters:
        W = b - a + R
        first = max(t0, a // R, causal)  # tiles before a // R have no row i >= a
        body = min(count, max(first, -(-b // R)))  # tiles before `body` reach keys < 0

        def window(c0, c1, t, skip=0, W=W, b=b):  # tiles c0..c1-1, window keys skip..W-1
            start = pad + c0 * R - b + skip  # key c0*R - b + skip >= -pad: inside the padding (masked)
            assert start >= 0, (pad, c0, b, skip)
            return t.as_strided((1, c1 - c0, W - skip, D), (0, R * D, D, 1), t.storage_offset() + start * D)

        c0 = first
        while c0 < body:
            # Tile c's keys before l = b - c*R are < 0 (masked). Chunks grow with the useful width
            # c*R + R - a, so the keys skipped by the last tile only, and masked for the others,
            # stay under a quarter of it.
            c1 = min(body, c0 + max(1, (c0 * R + R - a) // (4 * R)), c0 + max(1, CHUNK_ELEMENTS // (R * W)))
            skip = max(0, b - (c1 - 1) * R)
            jpos = torch.arange(c0, c1, device=dev)[:, None] * R - b + torch.arange(skip, W, device=dev)[None, :]
            mask = mask_ab[:, skip:].expand(c1 - c0, R, W - skip).masked_fill((jpos < 0)[:, None, :], _INF)
            o, l = _flash(q4[:, c0 - t0 : c1 - t0], window(c0, c1, kpad, skip), window(c0, c1, vpad, skip),
                          attn_mask=mask[None], scale=scale)
            _merge(acc_o, acc_l, (c0 - t0) * R, o.reshape(-1, D), l.reshape(-1), (mask.amax(-1) == _INF).flatten())
            c0 = c1
        if body < count:  # every row of these tiles has its keys r .. r + b - a of the window
            o, l = _flash(q4[:, body - t0 :], window(body, count, kpad), window(body, count, vpad),
                          attn_mask=mask_ab[None, None], scale=scale)
            rows = (count - body) * R
            _merge(acc_o, acc_l, (body - t0) * R, o.reshape(-1, D), l.reshape(-1),
                   torch.zeros(rows, dtype=torch.bool, device=dev))


def _fused_blocks(acc_o, acc_l, qh, kpad, vpad, pad, blk, big, scale, R, t0=0) -> None:
    """One head's block-sparse set: ``blk [count, K]`` its chosen key blocks per query block
    (each once, on or below the diagonal, ``big`` = none), tile = block = ``R`` rows; ``qh`` and
    the accumulators hold query blocks ``t0..count-1`` (as :func:`_fused_band`)."""
    count, D = t0 + qh.shape[0] // R, qh.shape[1]
    dev = qh.device
    q4 = qh.view(1, count - t0, R, D)
    tiles = torch.arange(t0, count, device=dev)
    kblocks = kpad[pad : pad + count * R].view(count, R, D)
    vblocks = vpad[pad : pad + count * R].view(count, R, D)
    blk = blk[t0:count]  # the query blocks of these tiles
    diag = (blk == tiles[:, None]).any(-1)
    if bool(diag.any()):  # the diagonal block: causal inside, a view of the keys
        o, l = _flash(q4, kblocks[None, t0:], vblocks[None, t0:], is_causal=True, scale=scale)
        _merge(acc_o, acc_l, 0, o.reshape(-1, D), l.reshape(-1), (~diag).repeat_interleave(R))
    below = torch.where(blk < tiles[:, None], blk, big).sort(-1).values
    nbelow = (below < big).sum(-1)
    width = int(nbelow.max()) if nbelow.numel() else 0
    if width == 0:
        return
    below = below[:, :width]
    for c0, c1 in _tile_chunks(0, count - t0, width * R * D):  # local query blocks
        ids = below[c0:c1].clamp(max=count - 1)
        nt = c1 - c0
        # one contiguous [R * D] row per block: index_select of rows (a copy per block) is several
        # times faster on the CPU than advanced indexing of [count, R, D] (per-element gather)
        kg = kblocks.view(count, R * D).index_select(0, ids.flatten()).view(1, nt, width * R, D)
        vg = vblocks.view(count, R * D).index_select(0, ids.flatten()).view(1, nt, width * R, D)
        real = (below[c0:c1] < big).repeat_interleave(R, -1)  # [C, width * R]
        mask = torch.zeros(nt, width * R, dtype=qh.dtype, device=dev).masked_fill_(~real, _INF)
        o, l = _flash(q4[:, c0:c1], kg, vg, attn_mask=mask[None, :, None, :], scale=scale)
        _merge(acc_o, acc_l, c0 * R, o.reshape(-1, D), l.reshape(-1), (nbelow[c0:c1] == 0).repeat_interleave(R))


def _band_fused(cols: torch.Tensor, diags: torch.Tensor):
    """``fused_of`` of a band set (``cols, diags [Hg, n]`` bool)."""
    n, R = cols.shape[-1], TILE_ROWS
    mid = (torch.arange(-(-n // R), device=cols.device) * R + R // 2).clamp(max=max(n - 1, 0))
    # a tile's keys, estimated at its middle row: the chosen offsets and columns up to it
    work = diags.int().cumsum(-1)[:, mid] + cols.int().cumsum(-1)[:, mid] if n else cols.new_zeros(cols.shape[0], 0)

    prepared: dict[int, _Band] = {}  # per head, for all its parts (two parts may both make it: same result)

    def run(g, acc_o, acc_l, qh, kpad, vpad, pad, scale, R, t0):
        band = prepared.get(g)
        if band is None:
            band = prepared[g] = _Band(cols[g].nonzero().flatten(), diags[g], n, R, kpad, vpad, pad, qh.dtype)
        _fused_band(acc_o, acc_l, qh, kpad, vpad, pad, band, scale, t0)

    # the windows reach keys down to -b for the largest chosen offset b: the keys' padding before key 0
    chosen = diags.any(0).nonzero()
    return R, run, work, int(chosen[-1]) if chosen.numel() else 0


def _blocks_fused(blocks: torch.Tensor, n: int, block: int):
    """``fused_of`` of block-sparse (``blocks [Hg, NQB, K]`` of one batch row)."""
    blk, big, nvalid = _chosen_blocks(blocks, n, block)

    def run(g, acc_o, acc_l, qh, kpad, vpad, pad, scale, R, t0):
        _fused_blocks(acc_o, acc_l, qh, kpad, vpad, pad, blk[g], big, scale, R, t0)

    return block, run, nvalid * block, 0


#: The heads' rows are cut into parts of about ``1 / (PARTS_PER_THREAD * T)`` of a call's work
#: for its ``T`` head workers (:func:`_parts`), so that the workers end together: with one task
#: per head, 9 heads on 2 workers leave one idle for a head's time (a tenth), and one head (a
#: group of one dense or A-shape head) runs on one core while the other waits.
PARTS_PER_THREAD = 8  # see docs/tuning.md#parts-per-thread


def _parts(work: torch.Tensor, threads: int) -> list[tuple[int, int, int]]:
    """Tasks ``(g, c0, c1)``: local head ``g``'s tiles ``c0..c1-1`` of ``work [Hg, tiles]``
    (estimated cost per tile), longest first. ``threads <= 1``: one task per head, in order."""
    Hg, count = work.shape
    if threads <= 1 or count == 0:
        return [(g, 0, count) for g in range(Hg)]
    cum = (work.double() + 1).cumsum(-1)  # + 1: a tile costs something even with no key
    piece = float(cum[:, -1].sum()) / (PARTS_PER_THREAD * threads)
    tasks = []
    for g in range(Hg):
        total = float(cum[g, -1])
        P = max(1, min(count, round(total / piece)))
        cuts = torch.searchsorted(cum[g], cum.new_tensor([total * p / P for p in range(1, P)])) + 1
        bounds = sorted({0, count, *(c for c in cuts.tolist() if 0 < c < count)})
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            tasks.append((float(cum[g, c1 - 1] - (cum[g, c0 - 1] if c0 else 0)), g, c0, c1))
    tasks.sort(key=lambda t: -t[0])
    return [t[1:] for t in tasks]


#: The head workers (:func:`_each_task`): ``(size, executor, pid)``, made on first use, made larger
#: when a call wants more threads (the smaller pool is left to finish, never shut down under a
#: concurrent call), made anew in a forked child (the parent's threads do not exist there).
_WORKERS: list = [0, None, 0]
_WORKERS_LOCK = threading.Lock()


def _single_thread() -> None:
    torch.set_num_threads(1)  # this worker's OpenMP / MKL threads (per thread; the caller's stay)


def _executor(threads: int) -> ThreadPoolExecutor:
    with _WORKERS_LOCK:
        size, executor, pid = _WORKERS
        if executor is None or size < threads or pid != os.getpid():
            executor = ThreadPoolExecutor(threads, thread_name_prefix="minference-head", initializer=_single_thread)
            _WORKERS[:] = [threads, executor, os.getpid()]
        return executor


def _each_task(fn, tasks: list, threads: int) -> None:
    """``fn(*task)`` for each task, on at most ``threads`` head workers (the parts of heads of the
    fused and dense paths, :func:`_parts`; the heads' vertical-slash scores).

    With ``T = torch.get_num_threads() > 1`` intra-op threads, ``T`` runners on the shared
    executor take the tasks in order (longest first) from this call's queue, each running its
    tasks' ops single-threaded (the CPU flash kernel and the other ops release the GIL): one task
    per worker at a time instead of an OpenMP fork-join over ``T`` threads in every one of the
    many small ops of a head. On a machine shared with other jobs a descheduled worker delays only
    its own task (issue 30: the fork-joins made the sparse prefill 5x slower than dense at a load
    of 2.4-4.2 on 2 cores); idle, the tasks run side by side. After a task raises, the runners take
    no new task, and the first error is raised here once all runners have stopped (no task of the
    call still writes). Runners enter the caller's grad and inference mode (both are per thread).
    ``T = 1`` (or one task): a plain loop in this thread. ``threads``: the caller's ``T`` (read
    before :func:`_one_thread`)."""
    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            fn(*task)
        return
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    queue = collections.deque(tasks)
    errors: list[BaseException] = []

    def runner() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while not errors:
                try:
                    task = queue.popleft()
                except IndexError:
                    return
                try:
                    fn(*task)
                except BaseException as error:  # re-raised in the caller
                    errors.append(error)

    executor = _executor(threads)
    futures.wait([executor.submit(runner) for _ in range(min(threads, len(tasks)))])
    if errors:
        raise errors[0]


@contextlib.contextmanager
def _one_thread():
    """The calling thread's ops single-threaded inside (yields its intra-op thread count ``T``
    from before, restored after): on a shared machine each OpenMP fork-join of a small op waits
    for a descheduled thread (issue 30: 2 threads under three busy loops, sparse 0.49x dense), so
    the backend's own ops run in one thread and its parallelism is the heads' (:func:`_each_task`).
    Autocast is off inside, as it is in the head workers (it is per thread): the backend chooses
    its compute dtypes itself, so a result never depends on the thread count."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield threads
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _attend(*args, **kwargs):
    """:func:`_attend_rows` with this thread's ops single-threaded and the heads on ``T`` workers."""
    with _one_thread() as threads:
        return _attend_rows(*args, threads=threads, **kwargs)


def _attend_rows(q, k, v, ids, tiles_of, fused_of=None, *, scale, seqlens, seqstarts, out, return_lse, validate,
                 threads=1, dense=False, q_seqlens=None, q_seqstarts=None, checked=False):
    """Attention on heads ``ids`` over the candidate sets of batch row ``b`` (``n`` tokens).

    Queries may be part of the key rows (docs/kernels.md, "query rows"): ``q [B,Hq,Nq,D]``, row
    ``b``'s queries its last ``c = q_lens[b]`` tokens (logical ``lo = n - c .. n - 1``), held in
    ``q`` from ``q_starts[b]``; ``out`` and ``lse`` have ``q``'s rows. Only the query tiles
    (``lo // R ..``) are computed; tiles, sets and index values stay in the row's positions.

    Finite keys and values on the CPU take the fused path: ``fused_of(b, n) -> (R, run, work,
    reach)``. ``run(g, acc_o, acc_l, qh, kpad, vpad, pad, scale, R, t0)`` adds local head ``g``'s
    pieces for the tiles ``t0 .. t0 + len(qh) / R - 1`` (:func:`_fused_band`,
    :func:`_fused_blocks`; ``kpad`` holds key ``j`` at row ``pad + j`` with zeros around it,
    ``reach`` rows of them before key 0); ``work [Hg, tiles]`` estimates each tile's cost, and
    the heads' tiles are cut into parts of about equal cost for the head workers
    (:func:`_parts`). ``dense`` runs the causal kernel instead, per part of the rows (its causal
    square merged with the keys before it: a chunk after a cache, or a later part). Any other
    input takes the exact gathered path: ``tiles_of(b, n, dtype) -> _Tiles``, per chunk of query
    tiles the union of the tile's candidate keys gathered and one small softmax (:func:`_manual`).
    ``checked``: the caller validated the form of the arguments (the row arguments' values are
    read here whatever it says: this backend reads them on the host)."""
    if checked:
        (B, Hq, Nq, D), (Hkv, N) = q.shape, k.shape[1:3]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        # the CPU flash kernel gives no gradient of its log-sum-exp, which the merges of pieces use
        raise RuntimeError("the torch backend is for inference: its gradients are not implemented; call it under "
                           "torch.no_grad() or torch.inference_mode(), or detach q, k and v")
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                            given_rows=seqlens is not None or seqstarts is not None)
    q_lens, q_starts = rows if rows is not None else (lens, starts)
    if not checked and not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    if validate and ids:  # the Triton kernels' rule (kernels._common.prepare), with their messages
        computed = None if ids == list(range(Hq)) else torch.tensor(ids, device=q.device)
        check_finite_rows({"q": q}, q_lens, q_starts, heads=None if computed is None else {"q": computed})
        check_finite_kv({"k": k, "v": v}, lens, starts, group=Hq // Hkv, query_heads=computed)
    if out is None:
        out = torch.zeros_like(q)
    elif not checked:
        check_out(out, q)
    lse = torch.full((B, Hq, Nq), _INF, dtype=torch.float32, device=q.device) if return_lse else None
    if not ids:
        return (out, lse) if return_lse else out
    hq = torch.tensor(ids, device=q.device)
    kv_ids = [h // (Hq // Hkv) for h in ids]
    Hg = len(ids)
    heads = torch.arange(Hg, device=q.device)[:, None, None]
    dt = torch.promote_types(q.dtype, torch.float32)  # half inputs run in float32
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    for b, (s, n, qs, c) in enumerate(zip(starts.tolist(), lens.tolist(), q_starts.tolist(), q_lens.tolist())):
        if c == 0:
            continue
        lo = n - c  # the queries' first logical position
        used = sorted(set(kv_ids))
        # The fused CPU kernel adds the mask to the logits and multiplies every value it loads, so
        # a non-finite key or value would reach rows outside its set: such rows take _manual.
        fused = _FLASH_CPU is not None and q.device.type == "cpu" and all(
            _finite(x[b, j, s : s + n]) for x in (k, v) for j in used)
        if dense and fused:
            R = TILE_ROWS
            count, t0 = -(-n // R), lo // R
            tiles = torch.arange(t0, count, device=q.device)[None] * R + R // 2  # a tile's keys

            def dense_part(g, c0, c1, b=b, s=s, n=n, qs=qs, lo=lo, t0=t0, R=R):  # views of q, k, v: no copies
                h, hv = ids[g], kv_ids[g]
                a, e = max((t0 + c0) * R, lo), min((t0 + c1) * R, n)  # the part's logical query rows
                qh = q[b, h, qs + a - lo : qs + e - lo][None, None]  # [1, 1, e - a, D]
                kh, vh = k[b, hv, s : s + n][None, None], v[b, hv, s : s + n][None, None]
                o, l = _flash(qh, kh[:, :, a:e], vh[:, :, a:e], is_causal=True, scale=scale)
                o, l = o[0, 0], l[0, 0]
                if a:  # the keys before the part: every one of its queries sees all of them
                    o, l = o.to(acc_dt), l.to(acc_dt)
                    oc, lc = _flash(qh, kh[:, :, :a], vh[:, :, :a], scale=scale)
                    _merge(o, l, 0, oc[0, 0], lc[0, 0], torch.zeros(e - a, dtype=torch.bool, device=q.device))
                out[b, h, qs + a - lo : qs + e - lo] = o.to(q.dtype)
                if lse is not None:
                    lse[b, h, qs + a - lo : qs + e - lo] = l.float()

            _each_task(dense_part, _parts(tiles.expand(Hg, -1), threads), threads)
            continue
        if fused and fused_of is not None:
            R, run, work, pad = fused_of(b, n)
            count, t0 = -(-n // R), lo // R
            kpad = torch.empty(Hkv, pad + count * R, D, dtype=dt, device=q.device)
            vpad = torch.empty_like(kpad)
            for x, src in ((kpad, k), (vpad, v)):  # key j at row pad + j, zeros around it (read kv heads only)
                for j in used:
                    x[j, :pad].zero_()
                    x[j, pad : pad + n] = src[b, j, s : s + n]
                    x[j, pad + n :].zero_()

            def part(g, c0, c1, b=b, qs=qs, n=n, R=R, t0=t0, lo=lo, run=run, kpad=kpad, vpad=vpad, pad=pad):
                h, hv = ids[g], kv_ids[g]  # tiles t0 + c0 .. t0 + c1 - 1 of head g
                rows, r0 = (c1 - c0) * R, (t0 + c0) * R
                a, e = max(r0, lo), min(r0 + rows, n)  # the part's logical query rows
                qh = torch.empty(rows, D, dtype=dt, device=q.device)  # its tiles' rows, zeros around the queries
                qh[: a - r0].zero_()
                qh[a - r0 : e - r0] = q[b, h, qs + a - lo : qs + e - lo]
                qh[e - r0 :].zero_()
                acc_o = torch.zeros(rows, D, dtype=acc_dt, device=q.device)
                acc_l = torch.full((rows,), _INF, dtype=acc_dt, device=q.device)
                run(g, acc_o, acc_l, qh, kpad[hv], vpad[hv], pad, scale, R, t0 + c0)
                out[b, h, qs + a - lo : qs + e - lo] = acc_o[a - r0 : e - r0].to(q.dtype)  # disjoint rows
                if lse is not None:
                    lse[b, h, qs + a - lo : qs + e - lo] = acc_l[a - r0 : e - r0].float()

            _each_task(part, _parts(work[:, t0:], threads), threads)
            continue
        qb = _take_heads(q[b, :, qs : qs + c], ids)  # [Hg, c, D]
        kb = _take_heads(k[b, :, s : s + n], kv_ids)  # [Hg, n, D]
        vb = _take_heads(v[b, :, s : s + n], kv_ids)
        t = tiles_of(b, n, q.dtype)
        R = t.rows
        t0 = lo // R
        first = lo - t0 * R
        qt = F.pad(qb, (0, 0, first, (t.count - t0) * R - first - c)).view(Hg, t.count - t0, R, D)
        step = max(1, CHUNK_ELEMENTS // (Hg * n))  # tiles whose [Hg, C, keys] selection fits
        for c0 in range(t0, t.count, step):
            c1 = min(t.count, c0 + step)
            pos, sel, cnt = t.keys(c0, c1)
            if pos.shape[-1] == 0:  # no tile has a key (their rows are empty): one padding key, no 0-length call
                pos, sel = F.pad(pos, (0, 1)), F.pad(sel, (0, 1), value=2)
            sel = sel.masked_fill_(torch.arange(pos.shape[-1], device=q.device) >= cnt[..., None], 2)
            widest = cnt.amax(0).tolist()  # per tile
            a = 0
            while a < c1 - c0:  # sub-chunks whose [Hg, C, R, L] scores fit
                e, width = a + 1, max(1, widest[a])
                while e < c1 - c0 and Hg * (e + 1 - a) * R * max(width, widest[e]) <= CHUNK_ELEMENTS:
                    width = max(width, widest[e])
                    e += 1
                p, sl = pos[:, a:e, :width], sel[:, a:e, :width]
                mask = t.mask(c0 + a, p, sl)
                kt, vt = kb[heads, p], vb[heads, p]
                qc = qt[:, c0 + a - t0 : c0 + e - t0]
                if fused:
                    o, l = _flash(qc, kt, vt, attn_mask=mask, scale=scale)
                else:
                    o, l = _manual(qc, kt, vt, mask, scale)
                r0, r1 = (c0 + a) * R, min(n, (c0 + e) * R)  # logical rows of these tiles
                w0 = max(r0, lo)  # the first of them that is a query
                live = t.live[:, w0:r1]
                o = o.reshape(Hg, -1, D)[:, w0 - r0 : r1 - r0].masked_fill(~live[..., None], 0)
                out[b, hq, qs + w0 - lo : qs + r1 - lo] = o.to(q.dtype)
                if lse is not None:
                    l = l.reshape(Hg, -1)[:, w0 - r0 : r1 - r0].float().masked_fill(~live, _INF)
                    lse[b, hq, qs + w0 - lo : qs + r1 - lo] = l
                a = e
    return (out, lse) if return_lse else out


def _finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: one sum (a NaN or inf makes it non-finite; a
    finite tensor whose sum overflows is then checked element by element)."""
    total = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(x).all())


def _take_heads(x: torch.Tensor, ids: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [H, ...]``'s entries ``ids`` stacked into a new contiguous ``[len(ids), ...]`` tensor (in
    ``dtype``): one strided copy per head. ``index_select`` on the model's transposed ``[H, N, D]``
    views (strides ``(D, H * D, 1)``) gathers element by element: 6 ms against 1 ms for 9 heads
    of 4096 x 64 on one core."""
    out = torch.empty((len(ids), *x.shape[1:]), dtype=x.dtype if dtype is None else dtype, device=x.device)
    for g, h in enumerate(ids):
        out[g].copy_(x[h])
    return out


def _ids(heads, Hq, checked: bool = False) -> list[int]:
    if checked:  # the caller's distinct ids in range
        return list(range(Hq)) if heads is None else heads.tolist()
    if heads is not None:
        check_tensor("heads", heads, rank=1, dtypes=_INT)
    return head_ids(heads, Hq)


def _entry(q, k, v, heads, checked: bool) -> list[int]:
    """The attention functions' entry: the form of ``q, k, v`` and ``heads`` checked, the local
    heads to compute returned. ``checked`` (internal): the caller, the dispatcher's torch backend,
    validated the arguments at its edge; the entry checks of the attention functions (forms of
    q, k, v, heads, index tensors and their values, ``fill_gaps``, block, ``out``) are skipped,
    and ``validate`` then governs only the finite checks of q, k, v."""
    if not checked:
        check_qkv_rows(q, k, v)
    return _ids(heads, q.shape[1], checked)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True, q_seqlens: torch.Tensor | int | None = None, q_seqstarts: torch.Tensor | None = None,
    checked: bool = False,
):
    """Causal dense attention (the ``Dense`` pattern): ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]`` ->
    ``out [B,Hq,N,D]`` (and ``lse [B,Hq,N]`` fp32).

    ``q_seqlens``, ``q_seqstarts``: queries that are part of the key rows, ``q [B,Hq,Nq,D]`` with
    ``Nq <= N`` (docs/kernels.md, "query rows"); the output has ``q``'s rows.
    ``checked``: internal (:func:`_entry`)."""
    ids = _entry(q, k, v, heads, checked)

    def tiles(b, n, dtype):  # only for inputs the fused causal kernel cannot take
        every = torch.ones(len(ids), n, dtype=torch.bool, device=q.device)
        return _band_tiles(~every, every, n, dtype)

    return _attend(q, k, v, ids, tiles, scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out,
                   return_lse=return_lse, validate=validate, dense=True, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts,
                   checked=checked)


def ashape_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: int | torch.Tensor, window: int | torch.Tensor, *,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, head_offset: int = 0, out: torch.Tensor | None = None,
    return_lse: bool = False, validate: bool = True, q_seqlens: torch.Tensor | int | None = None,
    q_seqstarts: torch.Tensor | None = None, checked: bool = False,
):
    """A-shape attention; ``sink``, ``window``: ints or 1-D int tensors indexed by global head
    ``head_offset + h``. Shapes as :func:`minference.kernels.ashape_attention`.

    ``q_seqlens``, ``q_seqstarts``: queries that are part of the key rows, ``q [B,Hq,Nq,D]`` with
    ``Nq <= N`` (docs/kernels.md, "query rows"); the output has ``q``'s rows.
    ``checked``: internal (:func:`_entry`)."""
    ids = _entry(q, k, v, heads, checked)
    sinks = torch.tensor(per_head_budget("sink", sink, ids, head_offset, 0), device=q.device)
    windows = torch.tensor(per_head_budget("window", window, ids, head_offset, 1), device=q.device)

    def sets(n):  # columns j < sink, offsets i - j < window
        pos = torch.arange(n, device=q.device)
        return pos < sinks[:, None], pos < windows[:, None]

    def tiles(b, n, dtype):
        cols, diags = sets(n)
        return _band_tiles(cols, diags, n, dtype)

    return _attend(q, k, v, ids, tiles, lambda b, n: _band_fused(*sets(n)), scale=scale, seqlens=seqlens,
                   seqstarts=seqstarts, out=out, return_lse=return_lse, validate=validate, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, checked=checked)


def vertical_slash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vertical: torch.Tensor, slash: torch.Tensor, *,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True, fill_gaps: int = 0, q_seqlens: torch.Tensor | int | None = None,
    q_seqstarts: torch.Tensor | None = None, checked: bool = False,
):
    """Vertical-slash attention on logical ``vertical [B,Hg,NV]`` / ``slash [B,Hg,NS]`` (-1 padded),
    offsets closed over gaps of at most ``fill_gaps``. Shapes as
    :func:`minference.kernels.vertical_slash_attention`.

    ``q_seqlens``, ``q_seqstarts``: queries that are part of the key rows, ``q [B,Hq,Nq,D]`` with
    ``Nq <= N`` (docs/kernels.md, "query rows"); the output has ``q``'s rows.
    ``checked``: internal (:func:`_entry`)."""
    ids = _entry(q, k, v, heads, checked)
    B, N = q.shape[0], k.shape[2]
    if not checked:
        for name, idx in (("vertical", vertical), ("slash", slash)):
            check_index(name, idx, rank=3, lead=(B, len(ids)), device=q.device, upper=max(N, 1), values=validate)
        check_fill_gaps(fill_gaps)
    cols = scatter_set(N, vertical)  # [B, Hg, N]: the same sets as the reference, over the whole N
    diags = slash_set(N, slash, fill_gaps)
    return _attend(q, k, v, ids, lambda b, n, dtype: _band_tiles(cols[b, :, :n], diags[b, :, :n], n, dtype),
                   lambda b, n: _band_fused(cols[b, :, :n], diags[b, :, :n]), scale=scale, seqlens=seqlens,
                   seqstarts=seqstarts, out=out, return_lse=return_lse, validate=validate, q_seqlens=q_seqlens,
                   q_seqstarts=q_seqstarts, checked=checked)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *, block: int = DEFAULT_BLOCK_SIZE,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True, q_seqlens: torch.Tensor | int | None = None, q_seqstarts: torch.Tensor | None = None,
    checked: bool = False,
):
    """Block-sparse attention on ``blocks [B,Hg,ceil(N/block),K]`` (-1 padded, any block size).
    Shapes as :func:`minference.kernels.block_sparse_attention`.

    ``q_seqlens``, ``q_seqstarts``: queries that are part of the key rows, ``q [B,Hq,Nq,D]`` with
    ``Nq <= N`` (docs/kernels.md, "query rows"); the output has ``q``'s rows.
    ``blocks`` has one row per query block of the key row (``ceil(N / block)``).
    ``checked``: internal (:func:`_entry`)."""
    ids = _entry(q, k, v, heads, checked)
    B, N = q.shape[0], k.shape[2]
    if not checked:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        nqb = -(-N // block)
        check_index("blocks", blocks, rank=4, lead=(B, len(ids), nqb), device=q.device, upper=max(nqb, 1),
                    values=validate)
    return _attend(q, k, v, ids, lambda b, n, dtype: _block_tiles(blocks[b], n, block, dtype),
                   lambda b, n: _blocks_fused(blocks[b], n, block),
                   scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out, return_lse=return_lse,
                   validate=validate, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, checked=checked)


def _vs_scores_torch(q, k, hs, lens, starts, last_q: int, rows: torch.Tensor | None, scale: float,
                     aggregation: str, qrows=None, *, threads: int = 1):
    """Column and diagonal scores ``[B, Hg, N]`` float32 from the materialised sampled rows (the
    last ``last_q`` of each batch row plus its extra rows ``rows [B, E]``, -1 = none). Query rows
    ``qrows`` (:class:`minference.index.QueryRows`): only positions from the row's first query
    ``q_lo`` on are sampled, position ``p`` read at q's row ``q_starts + p - q_lo``. The heads
    run on ``threads`` head workers (:func:`_each_task`), each one head's products at a time."""
    B, Hq, _, _ = q.shape
    N = k.shape[2]
    hq = hs.long()
    hk = hq // (Hq // k.shape[1])
    col = torch.zeros(B, len(hq), N, dtype=torch.float32, device=q.device)
    diag = torch.zeros(B, len(hq), N, dtype=torch.float32, device=q.device)
    reduce = "sum" if aggregation == "sum" else "amax"
    q_heads, kv_heads = hq.tolist(), hk.tolist()
    q_lens: list[int] = [] if qrows is None else qrows.lens.tolist()
    q_starts: list[int] = [] if qrows is None else qrows.starts.tolist()
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        if n == 0:
            continue
        if qrows is None:
            sampled = torch.arange(n - min(last_q, n), n, device=q.device)
            row0 = s
        else:
            q_lo = n - q_lens[b]
            sampled = torch.arange(max(n - last_q, q_lo), n, device=q.device)
            row0 = q_starts[b] - q_lo
        if rows is not None:
            sampled = torch.cat([rows[b][rows[b] >= 0].to(q.device), sampled])
        R = sampled.shape[0]
        if R == 0:  # a row without queries samples nothing: zero scores
            continue
        i = sampled[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        later = j > i
        delta = (i - j).clamp(min=0).flatten()  # [R * n]; j > i carry p = 0

        def head(g, b=b, s=s, n=n, row0=row0, sampled=sampled, later=later, delta=delta):
            qs = q[b, q_heads[g], row0 + sampled].float()  # [R, D]
            ks = k[b, kv_heads[g], s : s + n].float()  # [n, D]
            probs = torch.softmax((qs @ ks.T).mul_(scale).masked_fill_(later, float("-inf")), dim=-1)  # [R, n]
            col[b, g, :n] = probs.sum(0) if aggregation == "sum" else probs.amax(0)
            diag[b, g, :n].scatter_reduce_(-1, delta, probs.flatten(), reduce=reduce)

        _each_task(head, [(g,) for g in range(len(hq))], threads)
    return col, diag


def _pool_torch(x: torch.Tensor, block: int, lens: torch.Tensor, starts: torch.Tensor,
                heads: torch.Tensor | None, qrows=None) -> torch.Tensor:
    """Mean of the valid tokens of each block: ``[B, H, N, D]`` -> ``[B, Hs, ceil(N/block), D]`` fp32.
    Query rows ``qrows`` (``x`` is q): the means of each block's query positions in the slot
    layout ``[B, Hs, S, D]`` (:meth:`minference.index.QueryRows.slots`)."""
    if qrows is not None:
        return _pool_query_rows(x, block, lens, heads, qrows)
    B, H, N, D = x.shape
    hs = torch.arange(H, device=x.device) if heads is None else heads.long()
    nqb = -(-N // block)
    out = torch.zeros(B, len(hs), nqb, D, dtype=torch.float32, device=x.device)
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        nb = -(-n // block)
        if nb == 0:
            continue
        rows = _take_heads(x[b, :, s : s + n], hs.tolist(), torch.float32)
        rows = F.pad(rows, (0, 0, 0, nb * block - n)).view(len(hs), nb, block, D)
        counts = torch.clamp(n - torch.arange(nb, device=x.device) * block, max=block).float()
        out[b, :, :nb] = rows.sum(2) / counts[:, None]
    return out


def _query_blocks(n: int, c: int, block: int) -> tuple[int, int, int]:
    """A row of length ``n`` whose last ``c`` positions are queries: ``(q_lo, first, count)``,
    its first query, the query block of slot 0 and how many query blocks it has."""
    q_lo = n - c
    first = q_lo // block
    return q_lo, first, (0 if c == 0 else (n - 1) // block - first + 1)


def _query_block_rows(x: torch.Tensor, b: int, hs: torch.Tensor, n: int, c: int, q_start: int, block: int):
    """The query rows of batch row ``b`` (heads ``hs``; ``c > 0`` of them) as ``[Hs, count, block,
    D]`` float32 query blocks (zeros outside the queries) and the ``[count, block]`` mask of the
    query positions."""
    q_lo, first, count = _query_blocks(n, c, block)
    rows = x[b, :, q_start : q_start + c].index_select(0, hs).float()  # positions q_lo .. n - 1
    rows = F.pad(rows, (0, 0, q_lo - first * block, (first + count) * block - n))
    pos = first * block + torch.arange(count * block, device=x.device)
    return rows.view(len(hs), count, block, x.shape[-1]), ((pos >= q_lo) & (pos < n)).view(count, block)


def _pool_query_rows(x: torch.Tensor, block: int, lens: torch.Tensor, heads: torch.Tensor | None,
                     qrows) -> torch.Tensor:
    """:func:`_pool_torch` on query rows: ``[B, Hs, S, D]`` means of the query positions."""
    B, H, _, D = x.shape
    hs = torch.arange(H, device=x.device) if heads is None else heads.long()
    out = torch.zeros(B, len(hs), qrows.slots(block), D, dtype=torch.float32, device=x.device)
    for b, (n, c, qs) in enumerate(zip(lens.tolist(), qrows.lens.tolist(), qrows.starts.tolist())):
        if c == 0:
            continue
        rows, ok = _query_block_rows(x, b, hs, n, c, qs, block)
        out[b, :, : ok.shape[0]] = rows.sum(2) / ok.sum(1).float()[:, None]
    return out


def vertical_slash_index(
    q: torch.Tensor, k: torch.Tensor, vertical: int | torch.Tensor, slash: int | torch.Tensor, *,
    last_q: int = DEFAULT_LAST_Q, extra_rows: int = 0, sink_columns: int | torch.Tensor = 0,
    local_diagonals: int | torch.Tensor = 1,
    aggregation: str = "sum", scale: float | None = None, seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None, heads: torch.Tensor | None = None, head_offset: int = 0,
    return_scores: bool = False, vertical_width: int | None = None, slash_width: int | None = None,
    validate: bool = True, resolved: tuple | None = None, rule: str | torch.Tensor = "top_k",
    threshold: float | torch.Tensor | None = None, min_vertical: int | torch.Tensor = 0,
    min_slash: int | torch.Tensor = 0, resolved_rules: tuple | None = None, q_seqlens=None,
    q_seqstarts: torch.Tensor | None = None, checked: bool = False,
):
    """Vertical-slash index in plain PyTorch; same arguments (query rows ``q_seqlens``,
    ``q_seqstarts`` and the internal ``checked`` included) and result as
    :func:`minference.kernels.estimate_vs.vertical_slash_index`."""
    with _one_thread() as threads:  # small ops: no fork-joins (issue 30); the heads' scores on workers
        return build_vertical_slash_index(
            functools.partial(_vs_scores_torch, threads=threads), q, k, vertical, slash, last_q=last_q,
            extra_rows=extra_rows, sink_columns=sink_columns, local_diagonals=local_diagonals,
            aggregation=aggregation, scale=scale, seqlens=seqlens,
            seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=return_scores,
            vertical_width=vertical_width, slash_width=slash_width, validate=validate, resolved=resolved, rule=rule,
            threshold=threshold, min_vertical=min_vertical, min_slash=min_slash, resolved_rules=resolved_rules,
            q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, checked=checked)


def block_sparse_index(
    q: torch.Tensor, k: torch.Tensor, top_k: int | torch.Tensor, *, block: int = DEFAULT_BLOCK_SIZE,
    sink_blocks: int | torch.Tensor = 0, force_diagonal: bool = True, scale: float | None = None,
    seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, head_offset: int = 0, return_scores: bool = False,
    top_k_width: int | None = None, validate: bool = True, resolved: tuple | None = None,
    rule: str | torch.Tensor = "top_k", threshold: float | torch.Tensor | None = None,
    min_blocks: int | torch.Tensor = 0, resolved_rules: tuple | None = None, estimate: str = "pooled",
    q_seqlens=None, q_seqstarts: torch.Tensor | None = None, score_rows: int = 0, checked: bool = False,
):
    """Block-sparse routing in plain PyTorch; same arguments (query rows ``q_seqlens``,
    ``q_seqstarts`` and the internal ``checked`` included) and result as
    :func:`minference.kernels.estimate_bs.block_sparse_index`."""
    with _one_thread():  # small ops: no fork-joins (issue 30)
        return build_block_sparse_index(
            _pool_torch, q, k, top_k, block=block, sink_blocks=sink_blocks, force_diagonal=force_diagonal,
            scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=head_offset,
            return_scores=return_scores, top_k_width=top_k_width, validate=validate, resolved=resolved, rule=rule,
            threshold=threshold, min_blocks=min_blocks, resolved_rules=resolved_rules, estimate=estimate,
            scorer=functools.partial(query_block_scores, checked=True) if checked else query_block_scores,
            q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, score_rows=score_rows, checked=checked)


def query_block_scores(q: torch.Tensor, k: torch.Tensor, *, block: int, scale: float | None = None,
                       seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
                       heads: torch.Tensor | None = None, q_seqlens=None, q_seqstarts: torch.Tensor | None = None,
                       slots=None, score_rows: int = 0, checked: bool = False) -> torch.Tensor:
    """Query-aware block scores in plain PyTorch (float32): every query against the block-mean
    keys, softmaxed over its block-causal key blocks, maxed over the query block's rows. Same
    arguments and result as :func:`minference.kernels.estimate_bs.query_block_scores` (definition:
    :func:`minference.reference.estimators.query_block_scores`; query rows ``q_seqlens``,
    ``q_seqstarts``, the builder's ``slots`` and ``score_rows`` included).

    ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]`` -> ``scores [B, Hg, NQB, NQB]`` float32 (``-inf``
    above the diagonal and outside the row). Query blocks are taken in chunks so that one
    chunk's ``[Hg, C, block, keys]`` probabilities stay within :data:`CHUNK_ELEMENTS`.
    ``checked``: internal: the caller (the builder of a checked call) validated the arguments' form.
    """
    if checked:
        (B, Hq, Nq, D), (Hkv, N) = q.shape, k.shape[1:3]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, k)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        check_int("score_rows", score_rows, 0)
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    qr = scorer_rows(slots, q_seqlens, q_seqstarts, lens, starts, Nq, N, seqlens is not None or seqstarts is not None)
    ids = _ids(heads, Hq, checked)
    nqb = -(-N // block)
    if qr is not None:
        out = _query_block_scores_rows(q, k, block, scale, lens, starts, ids, qr, score_rows)
        return out if slots is not None else blocks_from_slots(out, lens, qr, block, nqb, float("-inf"))
    out = torch.full((B, len(ids), nqb, nqb), float("-inf"), dtype=torch.float32, device=q.device)
    if not ids:
        return out
    hq = torch.tensor(ids, device=q.device)
    hk = hq // (Hq // Hkv)
    km_all = _pool_torch(k, block, lens, starts, None)  # [B, Hkv, NQB, D]
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        nb = -(-n // block)
        if nb == 0:
            continue
        km = km_all[b, :, :nb].index_select(0, hk)  # [Hg, nb, D]
        qb = F.pad(_take_heads(q[b, :, s : s + n], ids, torch.float32), (0, 0, 0, nb * block - n))
        qb = qb.view(len(ids), nb, block, D)
        row_ok = scoring_rows((torch.arange(nb * block, device=q.device) < n).view(nb, block), 0, n, block,
                              score_rows)
        J = torch.arange(nb, device=q.device)
        chunk = max(1, CHUNK_ELEMENTS // (len(ids) * block * nb))
        for lo in range(0, nb, chunk):
            hi = min(nb, lo + chunk)
            causal = J[None, :hi] <= J[lo:hi, None]  # [C, hi]
            logits = torch.matmul(qb[:, lo:hi], km[:, None, :hi].transpose(-1, -2)) * scale  # [Hg, C, block, hi]
            probs = torch.softmax(logits.masked_fill_(~causal[None, :, None], float("-inf")), dim=-1)
            best = probs.masked_fill_(~row_ok[None, lo:hi, :, None], float("-inf")).amax(2)  # [Hg, C, hi]
            out[b, :, lo:hi, :hi] = best.masked_fill_(~causal[None], float("-inf"))
    return out


def _query_block_scores_rows(q, k, block: int, scale: float, lens, starts, ids: list[int], qr,
                             score_rows: int) -> torch.Tensor:
    """:func:`query_block_scores` on query rows ``qr``, in their slot layout ``[B, Hg, S, NQB]``
    (slot ``s`` = query block ``q_lo // block + s``): each query block from its query positions."""
    B, Hq, Hkv, N = q.shape[0], q.shape[1], k.shape[1], k.shape[2]
    nqb = -(-N // block)
    out = torch.full((B, len(ids), qr.slots(block), nqb), float("-inf"), dtype=torch.float32, device=q.device)
    if not ids:
        return out
    hq = torch.tensor(ids, device=q.device)
    hk = hq // (Hq // Hkv)
    km_all = _pool_torch(k, block, lens, starts, None)  # [B, Hkv, NQB, D]
    for b, (n, c, qs) in enumerate(zip(lens.tolist(), qr.lens.tolist(), qr.starts.tolist())):
        _, first, count = _query_blocks(n, c, block)
        if count == 0:
            continue
        nb = first + count  # the row's blocks
        km = km_all[b, :, :nb].index_select(0, hk)  # [Hg, nb, D]
        qb, row_ok = _query_block_rows(q, b, hq, n, c, qs, block)  # [Hg, count, block, D], [count, block]
        row_ok = scoring_rows(row_ok, first, n, block, score_rows)
        J = torch.arange(nb, device=q.device)
        chunk = max(1, CHUNK_ELEMENTS // (len(ids) * block * nb))
        for lo in range(0, count, chunk):
            hi = min(count, lo + chunk)
            causal = J[None, : first + hi] <= J[first + lo : first + hi, None]  # [C, first + hi]
            logits = torch.matmul(qb[:, lo:hi], km[:, None, : first + hi].transpose(-1, -2)) * scale
            probs = torch.softmax(logits.masked_fill_(~causal[None, :, None], float("-inf")), dim=-1)
            best = probs.masked_fill_(~row_ok[None, lo:hi, :, None], float("-inf")).amax(2)  # [Hg, C, first + hi]
            out[b, :, lo:hi, : first + hi] = best.masked_fill_(~causal[None], float("-inf"))
    return out
