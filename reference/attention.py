"""Masked attention in float64: the definition every kernel is measured against.

Twins of the kernels in :mod:`minference.kernels` with the same signatures. All of them return
float64 outputs (and log-sum-exp) in the layout ``[B, Hq, N, D]`` / ``[B, Hq, N]``. Rows outside
a sequence's length, and rows whose candidate set is empty, come out as zeros with log-sum-exp
``-inf``, never NaN.
"""

from __future__ import annotations

import torch
from minference.reference.masks import (
    ashape_mask,
    block_sparse_mask,
    causal_mask,
    vertical_slash_mask,
)

from minference._checks import (
    check_index,
    check_merge,
    check_qkv,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    default_scale,
    same_device,
)
from minference.index_sets import head_ids, per_head_budget

__all__ = [
    "masked_attention",
    "dense_attention_probs",
    "dense_attention",
    "ashape_attention",
    "vertical_slash_attention",
    "block_sparse_attention",
    "query_rows_attention",
    "merge_attention",
]


def _rows(q, k, v, seqlens, seqstarts):
    """Yield ``(b, start, length)`` for each batch row, with values on the host."""
    B, _, _, N, _ = check_qkv(q, k, v)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    return [(b, int(s), int(n)) for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist()))]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to ``mask``, computed in float64 (or in ``compute_dtype``).

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (GQA: query head ``h`` reads kv head
            ``h // (Hq // Hkv)``).
        mask: bool, broadcastable to ``[B, Hq, N, N]``, in logical coordinates of each row (entry
            ``[b, h, i, j]`` for the row's ``i``-th and ``j``-th tokens). Not intersected with
            causality here: callers pass causal masks.
        scale: softmax scale, default ``D ** -0.5``.
        seqlens, seqstarts: ``[B]`` ragged rows (see :func:`minference._checks.check_ragged`).
        compute_dtype: arithmetic dtype; float64 is the reference, the kernel's own dtype gives
            the *same-dtype reference* of the tolerance rule.

    Returns:
        ``(out [B, Hq, N, D], lse [B, Hq, N])`` in float64; padding rows and empty rows are 0 /
        ``-inf``.
    """
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor")
    if not same_device(mask.device, q.device):
        raise ValueError(f"mask must be on {q.device}, got {mask.device}")
    try:
        mask = torch.broadcast_to(mask, (B, Hq, N, N))
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, Hq, N, N] = "
                         f"{[B, Hq, N, N]}") from None
    scale = default_scale(D, scale)
    group = Hq // Hkv
    out = torch.zeros(B, Hq, N, D, dtype=torch.float64, device=q.device)
    lse = torch.full((B, Hq, N), float("-inf"), dtype=torch.float64, device=q.device)
    for b, s, n in _rows(q, k, v, seqlens, seqstarts):
        if n == 0:
            continue
        qb = q[b, :, s : s + n].to(compute_dtype)
        kb = k[b, :, s : s + n].to(compute_dtype).repeat_interleave(group, dim=0)
        vb = v[b, :, s : s + n].to(compute_dtype).repeat_interleave(group, dim=0)
        m = mask[b, :, :n, :n]
        scores = torch.einsum("hid,hjd->hij", qb, kb) * scale
        scores = scores.masked_fill(~m, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
        finite_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp(scores - finite_lse[..., None])
        probs = torch.where(m, probs, torch.zeros_like(probs))
        out[b, :, s : s + n] = torch.einsum("hij,hjd->hid", probs, vb).double()
        lse[b, :, s : s + n] = row_lse.double()
    return out, lse


def dense_attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    seqlens: torch.Tensor | None = None,
    seqstarts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention probabilities ``[B, Hq, N, N]`` in float64, logical coordinates per row
    (zeros outside each row's length)."""
    B, Hq, Hkv, N, D = check_qkv(q, k, k)
    scale = default_scale(D, scale)
    group = Hq // Hkv
    probs = torch.zeros(B, Hq, N, N, dtype=torch.float64, device=q.device)
    for b, s, n in _rows(q, k, k, seqlens, seqstarts):
        if n == 0:
            continue
        qb = q[b, :, s : s + n].double()
        kb = k[b, :, s : s + n].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hid,hjd->hij", qb, kb) * scale
        scores = scores.masked_fill(~causal_mask(n, q.device), float("-inf"))
        probs[b, :, :n, :n] = torch.softmax(scores, dim=-1)
    return probs


def _finish(out_lse, return_lse):
    out, lse = out_lse
    return (out, lse) if return_lse else out


def _run(q, k, v, head_masks, ids, scale, seqlens, seqstarts, compute_dtype, return_lse):
    """Attention with ``head_masks [B or 1, len(ids), N, N]`` on heads ``ids``, nothing elsewhere."""
    B, Hq, _, N, _ = check_qkv(q, k, v)
    mask = torch.zeros(max(B, head_masks.shape[0]), Hq, N, N, dtype=torch.bool, device=q.device)
    mask[:, ids] = head_masks
    res = masked_attention(
        q, k, v, mask, scale=scale, seqlens=seqlens, seqstarts=seqstarts, compute_dtype=compute_dtype
    )
    return _finish(res, return_lse)


def dense_attention(
    q, k, v, *, scale=None, seqlens=None, seqstarts=None, heads=None, compute_dtype=torch.float64,
    return_lse=False,
):
    """Causal dense attention in float64 (the ``Dense`` pattern)."""
    _, Hq, _, N, _ = check_qkv(q, k, v)
    ids = head_ids(heads, Hq)
    masks = causal_mask(N, q.device).expand(1, len(ids), N, N)
    return _run(q, k, v, masks, ids, scale, seqlens, seqstarts, compute_dtype, return_lse)


def ashape_attention(
    q, k, v, sink, window, *, scale=None, seqlens=None, seqstarts=None, heads=None, head_offset=0,
    compute_dtype=torch.float64, return_lse=False,
):
    """A-shape attention in float64.

    Args:
        sink, window: ints, or 1-D int tensors indexed by global head ``head_offset + h``.
        heads: local query heads to compute (default all); other heads come out as zeros.
    """
    _, Hq, _, N, _ = check_qkv(q, k, v)
    ids = head_ids(heads, Hq)
    sinks = per_head_budget("sink", sink, ids, head_offset, 0)
    windows = per_head_budget("window", window, ids, head_offset, 1)
    masks = [ashape_mask(N, g, w, device=q.device) for g, w in zip(sinks, windows)]
    masks = torch.stack(masks) if masks else torch.zeros(0, N, N, dtype=torch.bool, device=q.device)
    return _run(q, k, v, masks[None], ids, scale, seqlens, seqstarts, compute_dtype, return_lse)


def vertical_slash_attention(
    q, k, v, vertical, slash, *, scale=None, seqlens=None, seqstarts=None, heads=None,
    compute_dtype=torch.float64, return_lse=False, fill_gaps=0,
):
    """Vertical-slash attention in float64.

    Args:
        vertical: ``[B, Hg, NV]`` int key columns (logical positions), -1 padded, one row per
            computed head (``Hg = len(heads)`` or ``Hq``).
        slash: ``[B, Hg, NS]`` int diagonal offsets ``δ = i - j``, -1 padded.
        fill_gaps: the offsets are closed over gaps of at most this many offsets
            (:func:`minference.index_sets.slash_set`).
    """
    B, Hq, _, N, _ = check_qkv(q, k, v)
    ids = head_ids(heads, Hq)
    check_index("vertical", vertical, rank=3, lead=(B, len(ids)), device=q.device, upper=N)
    check_index("slash", slash, rank=3, lead=(B, len(ids)), device=q.device, upper=N)
    masks = vertical_slash_mask(N, vertical, slash, fill_gaps)
    return _run(q, k, v, masks, ids, scale, seqlens, seqstarts, compute_dtype, return_lse)


def block_sparse_attention(
    q, k, v, blocks, *, block=64, scale=None, seqlens=None, seqstarts=None, heads=None,
    compute_dtype=torch.float64, return_lse=False,
):
    """Block-sparse attention in float64.

    Args:
        blocks: ``[B, Hg, NQB, K]`` key-block ids per query block, ``NQB = ceil(N / block)``, -1
            padded; blocks above the diagonal contribute nothing.
        block: block size for queries and keys.
    """
    B, Hq, _, N, _ = check_qkv(q, k, v)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    ids = head_ids(heads, Hq)
    nb = -(-N // block)
    check_index("blocks", blocks, rank=4, lead=(B, len(ids), nb), device=q.device, upper=max(nb, 1))
    masks = block_sparse_mask(N, blocks, block)
    return _run(q, k, v, masks, ids, scale, seqlens, seqstarts, compute_dtype, return_lse)


def query_rows_attention(fn, q, k, v, *args, q_seqlens=None, q_seqstarts=None, seqlens=None, seqstarts=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of a call whose queries are part of the key rows (a chunk after a cache,
    or a row's last tokens): the rows of the full-prompt call ``fn`` (one of this module's
    functions) at the query positions.

    ``q [B, Hq, Nq, D]``, ``k, v [B, Hkv, N, D]``; row ``b``'s queries are the last
    ``q_lens[b]`` tokens of its key row (:func:`minference._checks.check_query_rows`). The query
    rows are scattered into a zero query tensor of the key rows' length at those positions, ``fn``
    runs on it (indices and budgets in the row's positions, as for the full prompt), and its rows
    come back to ``q``'s layout. Returns ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` in float64;
    rows of ``q`` outside every row's queries are 0 / ``-inf``.
    """
    B, Hq, _, Nq, N, D = check_qkv_rows(q, k, v)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device)
    given = seqlens is not None or seqstarts is not None
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N, given_rows=given)
    q_lens, q_starts = rows if rows is not None else (lens, starts)
    full = torch.zeros(B, Hq, N, D, dtype=q.dtype, device=q.device)
    pairs = []
    for b in range(B):
        n, c, s, qs = int(lens[b]), int(q_lens[b]), int(starts[b]), int(q_starts[b])
        full[b, :, s + n - c : s + n] = q[b, :, qs : qs + c]
        pairs.append((b, s + n - c, qs, c))
    out_full, lse_full = fn(full, k, v, *args, seqlens=seqlens, seqstarts=seqstarts, return_lse=True, **kwargs)
    out = torch.zeros(B, Hq, Nq, D, dtype=out_full.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("-inf"), dtype=lse_full.dtype, device=q.device)
    for b, p, qs, c in pairs:
        out[b, :, qs : qs + c] = out_full[b, :, p : p + c]
        lse[b, :, qs : qs + c] = lse_full[b, :, p : p + c]
    return out, lse


def merge_attention(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each set's ``(out, lse)``, in
    float64: weights ``exp(lse_a - lse)`` and ``exp(lse_b - lse)`` with ``lse =
    log(exp(lse_a) + exp(lse_b))``; a row empty in both stays 0 / ``-inf``. The arguments are
    checked as for :func:`minference.dispatch.merge_attention` (``_checks.check_merge``)."""
    check_merge(out_a, lse_a, out_b, lse_b)
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, float("-inf")))
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa[..., None] * out_a.double() + wb[..., None] * out_b.double()) / safe[..., None]
    return out, lse
