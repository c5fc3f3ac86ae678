"""Portable PyTorch attention over the package's index formats (no Triton, any device).

The path for real-model runs on the CPU: same signatures and semantics as the Triton kernels
in :mod:`minference.kernels` (and their float64 twins in :mod:`minference.reference`), computed
in the input dtype with ``torch.nn.functional.scaled_dot_product_attention`` over query chunks
so memory stays bounded (``[Hg, chunk, n]`` masks and scores at a time).

The candidate sets are the formulas of :mod:`minference.reference.masks`, evaluated for a range
of query rows instead of the whole square (``*_rows_mask`` below; the tests prove them equal to
the reference masks row for row). Every entry point reads the row lengths on the host, so this
backend synchronises on CUDA tensors: it is for portability, not for speed or graph capture.

The index builders :func:`vertical_slash_index` and :func:`block_sparse_index` share validation,
budgets, budget rules and the selection with the Triton builders (:mod:`minference.kernels.estimate`); only
the score computation differs: here the ``[Hg, r, n]`` probabilities of the sampled rows are
materialised (fine on the host at the lengths this backend is for) and reduced with
``scatter_reduce``, and blocks are pooled with reshapes.
Rows outside a sequence and rows with an empty candidate set come out as zeros (log-sum-exp
``-inf``); heads not listed in ``heads`` are left untouched in ``out``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minference._checks import check_index, check_qkv, check_ragged, check_tensor, default_scale
from minference.index import build_block_sparse_index, build_vertical_slash_index
from minference.patterns import DEFAULT_BLOCK_SIZE, DEFAULT_LAST_Q
from minference.reference.attention import head_ids, per_head_budget
from minference.reference.masks import _scatter_set, check_fill_gaps, slash_set

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
    cols = _scatter_set(width, vertical)[..., :n]  # [..., n]
    diags = slash_set(width, slash, fill_gaps)  # [..., width]
    offset = (i - j).clamp(min=0)  # [rows, n]
    return (diags[..., offset] | cols[..., None, :]) & (j <= i)


def block_sparse_rows_mask(i0: int, i1: int, n: int, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Rows ``i0..i1-1`` of :func:`minference.reference.masks.block_sparse_mask` over keys
    ``0..n-1``: ``blocks [..., NQB, K]`` -> ``[..., i1-i0, n]``."""
    i, j = _positions(i0, i1, n, blocks.device)
    nqb = blocks.shape[-2]
    chosen = _scatter_set(nqb, blocks)  # [..., NQB, NQB]
    qb = (i // block).clamp(max=nqb - 1)
    kb = (j // block).clamp(max=nqb - 1)
    return chosen[..., qb, kb] & (j <= i) & (j // block < nqb)


#: ``(b, i0, i1) -> [Hg, i1 - i0, i1]``: candidates of rows ``i0..i1-1`` of batch row ``b`` over
#: keys ``0..i1-1`` (later keys are never causal for these rows).
RowsMask = Callable[[int, int, int], torch.Tensor]


def _attend(q, k, v, ids, rows_mask: RowsMask, *, scale, seqlens, seqstarts, out, return_lse):
    """Chunked masked attention on heads ``ids`` with candidates from ``rows_mask``."""
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    if out is None:
        out = torch.zeros_like(q)
    else:
        check_tensor("out", out, rank=4, dtypes=(q.dtype,))
        if out.shape != q.shape or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} on {q.device}, got {tuple(out.shape)} on {out.device}")
    lse = torch.full((B, Hq, N), float("-inf"), dtype=torch.float32, device=q.device) if return_lse else None
    if not ids:
        return (out, lse) if return_lse else out
    hq = torch.tensor(ids, device=q.device)
    hk = hq // (Hq // Hkv)
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        if n == 0:
            continue
        kb = k[b, :, s : s + n].index_select(0, hk)  # [Hg, n, D]
        vb = v[b, :, s : s + n].index_select(0, hk)
        chunk = max(1, CHUNK_ELEMENTS // (len(ids) * n))
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            mask = rows_mask(b, i0, i1)  # [Hg, C, i1]
            qc = q[b, :, s + i0 : s + i1].index_select(0, hq)  # [Hg, C, D]
            # 4-D operands reach the fused CPU kernel; 3-D ones fall back to the unfused math path.
            o = F.scaled_dot_product_attention(qc[None], kb[None, :, :i1], vb[None, :, :i1], attn_mask=mask[None],
                                               scale=scale)[0]
            out[b, hq, s + i0 : s + i1] = o.masked_fill_(~mask.any(-1, keepdim=True), 0)
            if lse is not None:
                logits = torch.matmul(qc.float(), kb[:, :i1].float().transpose(-1, -2)) * scale
                lse[b, hq, s + i0 : s + i1] = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return (out, lse) if return_lse else out


def _ids(heads, Hq):
    if heads is not None:
        check_tensor("heads", heads, rank=1, dtypes=_INT)
    return head_ids(heads, Hq)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True,
):
    """Causal dense attention (the ``Dense`` pattern): ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]`` ->
    ``out [B,Hq,N,D]`` (and ``lse [B,Hq,N]`` fp32)."""
    check_qkv(q, k, v)
    ids = _ids(heads, q.shape[1])
    return _attend(q, k, v, ids, lambda b, i0, i1: causal_rows_mask(i0, i1, i1, q.device).expand(len(ids), -1, -1),
                   scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out, return_lse=return_lse)


def ashape_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: int | torch.Tensor, window: int | torch.Tensor, *,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, head_offset: int = 0, out: torch.Tensor | None = None,
    return_lse: bool = False, validate: bool = True,
):
    """A-shape attention; ``sink``, ``window``: ints or 1-D int tensors indexed by global head
    ``head_offset + h``. Shapes as :func:`minference.kernels.ashape_attention`."""
    check_qkv(q, k, v)
    ids = _ids(heads, q.shape[1])
    sinks = torch.tensor(per_head_budget("sink", sink, ids, head_offset, 0), device=q.device)
    windows = torch.tensor(per_head_budget("window", window, ids, head_offset, 1), device=q.device)
    return _attend(q, k, v, ids, lambda b, i0, i1: ashape_rows_mask(i0, i1, i1, sinks, windows),
                   scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out, return_lse=return_lse)


def vertical_slash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vertical: torch.Tensor, slash: torch.Tensor, *,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True, fill_gaps: int = 0,
):
    """Vertical-slash attention on logical ``vertical [B,Hg,NV]`` / ``slash [B,Hg,NS]`` (-1 padded),
    offsets closed over gaps of at most ``fill_gaps``. Shapes as
    :func:`minference.kernels.vertical_slash_attention`."""
    B, Hq, _, N, _ = check_qkv(q, k, v)
    ids = _ids(heads, Hq)
    for name, idx in (("vertical", vertical), ("slash", slash)):
        check_index(name, idx, rank=3, lead=(B, len(ids)), device=q.device, upper=max(N, 1), values=validate)
    check_fill_gaps(fill_gaps)
    return _attend(q, k, v, ids,
                   lambda b, i0, i1: vertical_slash_rows_mask(i0, i1, i1, vertical[b], slash[b], fill_gaps),
                   scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out, return_lse=return_lse)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *, block: int = DEFAULT_BLOCK_SIZE,
    scale: float | None = None, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
    validate: bool = True,
):
    """Block-sparse attention on ``blocks [B,Hg,ceil(N/block),K]`` (-1 padded, any block size).
    Shapes as :func:`minference.kernels.block_sparse_attention`."""
    B, Hq, _, N, _ = check_qkv(q, k, v)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    ids = _ids(heads, Hq)
    nqb = -(-N // block)
    check_index("blocks", blocks, rank=4, lead=(B, len(ids), nqb), device=q.device, upper=max(nqb, 1),
                values=validate)
    return _attend(q, k, v, ids, lambda b, i0, i1: block_sparse_rows_mask(i0, i1, i1, blocks[b], block),
                   scale=scale, seqlens=seqlens, seqstarts=seqstarts, out=out, return_lse=return_lse)


def _vs_scores_torch(q, k, hs, lens, starts, last_q: int, rows: torch.Tensor | None, scale: float,
                     aggregation: str):
    """Column and diagonal scores ``[B, Hg, N]`` float32 from the materialised sampled rows (the
    last ``last_q`` of each batch row plus its extra rows ``rows [B, E]``, -1 = none)."""
    B, Hq, N, _ = q.shape
    hq = hs.long()
    hk = hq // (Hq // k.shape[1])
    col = torch.zeros(B, len(hq), N, dtype=torch.float32, device=q.device)
    diag = torch.zeros(B, len(hq), N, dtype=torch.float32, device=q.device)
    reduce = "sum" if aggregation == "sum" else "amax"
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        if n == 0:
            continue
        sampled = torch.arange(n - min(last_q, n), n, device=q.device)
        if rows is not None:
            sampled = torch.cat([rows[b][rows[b] >= 0].to(q.device), sampled])
        R = sampled.shape[0]
        qs = q[b, :, s + sampled].index_select(0, hq).float()  # [Hg, R, D]
        ks = k[b, :, s : s + n].index_select(0, hk).float()  # [Hg, n, D]
        i = sampled[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        logits = torch.matmul(qs, ks.transpose(-1, -2)) * scale  # [Hg, R, n]
        probs = torch.softmax(logits.masked_fill(j > i, float("-inf")), dim=-1)
        col[b, :, :n] = probs.sum(1) if aggregation == "sum" else probs.amax(1)
        delta = (i - j).clamp(min=0).expand(len(hq), R, n).reshape(len(hq), R * n)  # j > i carry p = 0
        diag[b, :, :n].scatter_reduce_(-1, delta, probs.reshape(len(hq), R * n), reduce=reduce)
    return col, diag


def _pool_torch(x: torch.Tensor, block: int, lens: torch.Tensor, starts: torch.Tensor,
                heads: torch.Tensor | None) -> torch.Tensor:
    """Mean of the valid tokens of each block: ``[B, H, N, D]`` -> ``[B, Hs, ceil(N/block), D]`` fp32."""
    B, H, N, D = x.shape
    hs = torch.arange(H, device=x.device) if heads is None else heads.long()
    nqb = -(-N // block)
    out = torch.zeros(B, len(hs), nqb, D, dtype=torch.float32, device=x.device)
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        nb = -(-n // block)
        if nb == 0:
            continue
        rows = x[b, :, s : s + n].index_select(0, hs).float()
        rows = F.pad(rows, (0, 0, 0, nb * block - n)).view(len(hs), nb, block, D)
        counts = torch.clamp(n - torch.arange(nb, device=x.device) * block, max=block).float()
        out[b, :, :nb] = rows.sum(2) / counts[:, None]
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
    min_slash: int | torch.Tensor = 0, resolved_rules: tuple | None = None,
):
    """Vertical-slash index in plain PyTorch; same arguments and result as
    :func:`minference.kernels.estimate.vertical_slash_index`."""
    return build_vertical_slash_index(
        _vs_scores_torch, q, k, vertical, slash, last_q=last_q, extra_rows=extra_rows, sink_columns=sink_columns,
        local_diagonals=local_diagonals, aggregation=aggregation, scale=scale, seqlens=seqlens,
        seqstarts=seqstarts, heads=heads, head_offset=head_offset, return_scores=return_scores,
        vertical_width=vertical_width, slash_width=slash_width, validate=validate, resolved=resolved, rule=rule,
        threshold=threshold, min_vertical=min_vertical, min_slash=min_slash, resolved_rules=resolved_rules)


def block_sparse_index(
    q: torch.Tensor, k: torch.Tensor, top_k: int | torch.Tensor, *, block: int = DEFAULT_BLOCK_SIZE,
    sink_blocks: int | torch.Tensor = 0, force_diagonal: bool = True, scale: float | None = None,
    seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
    heads: torch.Tensor | None = None, head_offset: int = 0, return_scores: bool = False,
    top_k_width: int | None = None, validate: bool = True, resolved: tuple | None = None,
    rule: str | torch.Tensor = "top_k", threshold: float | torch.Tensor | None = None,
    min_blocks: int | torch.Tensor = 0, resolved_rules: tuple | None = None, estimate: str = "pooled",
):
    """Block-sparse routing in plain PyTorch; same arguments and result as
    :func:`minference.kernels.estimate.block_sparse_index`."""
    return build_block_sparse_index(
        _pool_torch, q, k, top_k, block=block, sink_blocks=sink_blocks, force_diagonal=force_diagonal,
        scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=head_offset,
        return_scores=return_scores, top_k_width=top_k_width, validate=validate, resolved=resolved, rule=rule,
        threshold=threshold, min_blocks=min_blocks, resolved_rules=resolved_rules, estimate=estimate,
        scorer=query_block_scores)


def query_block_scores(q: torch.Tensor, k: torch.Tensor, *, block: int, scale: float | None = None,
                       seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
                       heads: torch.Tensor | None = None) -> torch.Tensor:
    """Query-aware block scores in plain PyTorch (float32): every query against the block-mean
    keys, softmaxed over its block-causal key blocks, maxed over the query block's rows. Same
    arguments and result as :func:`minference.kernels.estimate.query_block_scores` (definition:
    :func:`minference.reference.estimators.query_block_scores`).

    ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]`` -> ``scores [B, Hg, NQB, NQB]`` float32 (``-inf``
    above the diagonal and outside the row). Query blocks are taken in chunks so that one
    chunk's ``[Hg, C, block, keys]`` probabilities stay within :data:`CHUNK_ELEMENTS`.
    """
    B, Hq, Hkv, N, D = check_qkv(q, k, k)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    ids = _ids(heads, Hq)
    nqb = -(-N // block)
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
        qb = F.pad(q[b, :, s : s + n].index_select(0, hq).float(), (0, 0, 0, nb * block - n))
        qb = qb.view(len(ids), nb, block, D)
        row_ok = (torch.arange(nb * block, device=q.device) < n).view(nb, block)
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
