"""Tier-2 measurement helpers: dense vs sparse on captured real layers (captured mass by query
region, output error, geometry-oracle gap). Used by test_layer_quality.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import minference.torch_backend as tb
from minference.dispatch import sparse_prefill
from minference.index import select_top
from minference.patterns import AShape, Pattern, VerticalSlash

#: Name the capturing attention function is registered under with transformers.
CAPTURE_IMPLEMENTATION = "minference_layer_capture"
#: Query regions for captured mass: equal thirds of the prompt.
REGIONS = ("start", "middle", "end")


class _AllCaptured(Exception):
    """Raised by the capturing attention once the last asked-for layer is captured."""


def capture_layers(model, input_ids: torch.Tensor, layers: tuple[int, ...]) -> dict[int, tuple]:
    """Run ``model`` densely on ``input_ids [1, n]`` and return ``{layer: (q, k, v, scale)}`` with
    ``q [1, Hq, n, D]``, ``k, v [1, Hkv, n, D]`` as the attention saw them (after RoPE). The
    forward pass stops at the last asked-for layer's attention (the later layers cannot change
    what the earlier ones saw)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if module.layer_idx in layers:
            captured[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone(),
                                          float(scaling))
            if len(captured) == len(set(layers)):
                raise _AllCaptured
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, capture)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        with torch.no_grad():
            model(input_ids)
    except _AllCaptured:
        pass
    finally:
        model.set_attn_implementation(previous)
    assert sorted(captured) == sorted(set(layers)), f"captured layers {sorted(captured)}, asked for {layers}"
    return captured


def dense_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax ``[Hq, n, n]`` float32 of one batch row (GQA by index)."""
    group = q.shape[1] // k.shape[1]
    kx = k[0].repeat_interleave(group, dim=0).float()
    logits = torch.matmul(q[0].float(), kx.transpose(-1, -2)) * scale
    n = q.shape[2]
    return torch.softmax(logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril_(), float("-inf")), dim=-1)


def online_mask(pattern: Pattern, q, k, scale: float) -> torch.Tensor:
    """``[Hq, n, n]`` candidate set the online builder picks (every head with ``pattern``)."""
    n, Hq = q.shape[2], q.shape[1]
    if isinstance(pattern, AShape):
        full = torch.full((Hq,), 0, dtype=torch.long)
        return tb.ashape_rows_mask(0, n, n, full + pattern.sink, full + pattern.window)
    if isinstance(pattern, VerticalSlash):
        v, s = tb.vertical_slash_index(q, k, pattern.vertical, pattern.slash, last_q=pattern.last_q,
                                       sink_columns=pattern.sink_columns, local_diagonals=pattern.local_diagonals,
                                       aggregation=pattern.aggregation, scale=scale)
        return tb.vertical_slash_rows_mask(0, n, n, v[0], s[0])
    blocks = tb.block_sparse_index(q, k, pattern.top_k, block=pattern.block, sink_blocks=pattern.sink_blocks,
                                   force_diagonal=pattern.force_diagonal, scale=scale)
    return tb.block_sparse_rows_mask(0, n, n, blocks[0], pattern.block)


def oracle_mask(pattern: Pattern, probs: torch.Tensor) -> torch.Tensor:
    """``[Hq, n, n]`` geometry oracle: the same pattern and budgets, ranked on the FULL attention
    matrix instead of the online estimate (column / diagonal mass summed over all rows; block
    mass per query block), with the same forced sinks, local diagonals and diagonal blocks."""
    H, n, _ = probs.shape
    ones = torch.ones(H, dtype=torch.long)
    if isinstance(pattern, AShape):
        return tb.ashape_rows_mask(0, n, n, ones * pattern.sink, ones * pattern.window)
    if isinstance(pattern, VerticalSlash):
        col = probs.sum(1)[None]  # [1, H, n]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        delta = (i - j).clamp(min=0).expand(H, n, n).reshape(H, n * n)
        diag = torch.zeros(H, n).scatter_add_(-1, delta, probs.reshape(H, n * n))[None]
        v = select_top(col, torch.minimum(ones * pattern.sink_columns, ones * pattern.vertical),
                       ones * pattern.vertical, min(pattern.vertical, n))
        s = select_top(diag, torch.minimum(ones * max(pattern.local_diagonals, 1), ones * pattern.slash),
                       ones * pattern.slash, min(pattern.slash, n))
        return tb.vertical_slash_rows_mask(0, n, n, v[0], s[0])
    block = pattern.block
    nb = math.ceil(n / block)
    padded = torch.nn.functional.pad(probs, (0, nb * block - n, 0, nb * block - n))
    mass = padded.view(H, nb, block, nb, block).sum((2, 4))  # [H, NQB, NKB]
    I = torch.arange(nb)[:, None]
    J = torch.arange(nb)[None, :]
    mass = mass.masked_fill(J > I, float("-inf"))
    forced = (J == I) if pattern.force_diagonal else torch.zeros(nb, nb, dtype=torch.bool)
    forced = forced | (J < min(pattern.sink_blocks, pattern.top_k - int(pattern.force_diagonal)))
    mass = torch.where(forced & (J <= I), float("inf"), mass)
    width = min(pattern.top_k, nb)
    val, idx = torch.topk(mass, width, dim=-1)
    idx = torch.where(val > float("-inf"), idx, -1)
    return tb.block_sparse_rows_mask(0, n, n, idx, block)


@dataclass(frozen=True)
class HeadRow:
    layer: int
    head: int
    pattern: str
    density: float
    mass: tuple[float, float, float]  # per region
    oracle: float
    rel_err: float
    cosine: float

    @property
    def online(self) -> float:
        return sum(self.mass) / len(self.mass)

    @property
    def gap(self) -> float:
        return self.oracle - self.online


def region_mass(probs: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Mean captured mass per query row, per region: ``[H]`` each."""
    per_row = (probs * mask).sum(-1)  # [H, n]
    n = probs.shape[1]
    cuts = [0, n // 3, 2 * n // 3, n]
    return [per_row[:, a:b].mean(-1) for a, b in zip(cuts, cuts[1:])]


def measure_layer(layer: int, q, k, v, scale: float, pattern: Pattern, name: str, *,
                  probs: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> list[HeadRow]:
    """Per-head quality of ``pattern`` on one captured layer (torch backend, float32). The sets
    are the builders' exact ones (``fill_gaps=0``), so mass, oracle gap and output error all
    describe the same candidates; the dispatcher's default gap filling only adds to them.
    ``probs`` (:func:`dense_probs`) and ``dense`` (the dense output) of the layer may be given,
    to compute them once for several patterns."""
    n, Hq = q.shape[2], q.shape[1]
    probs = dense_probs(q, k, scale) if probs is None else probs
    online = online_mask(pattern, q, k, scale)
    oracle = oracle_mask(pattern, probs)
    causal = n * (n + 1) / 2
    dense = tb.dense_attention(q, k, v, scale=scale) if dense is None else dense
    sparse = sparse_prefill(q, k, v, [pattern] * Hq, scale=scale, dense_threshold=0, backend="torch", fill_gaps=0)
    masses = region_mass(probs, online)
    oracle_mass = torch.stack(region_mass(probs, oracle)).mean(0)
    rows = []
    for h in range(Hq):
        d, s = dense[0, h].double(), sparse[0, h].double()
        rows.append(HeadRow(
            layer=layer, head=h, pattern=name,
            density=float(online[h].sum()) / causal,
            mass=tuple(float(m[h]) for m in masses),
            oracle=float(oracle_mass[h]),
            rel_err=float((s - d).norm() / d.norm()),
            cosine=float(torch.nn.functional.cosine_similarity(s, d, dim=-1).mean()),
        ))
    return rows


def table(rows: list[HeadRow]) -> str:
    lines = ["layer head pattern        density  mass(start mid end)   oracle  gap     rel_err cosine"]
    for r in rows:
        lines.append(f"{r.layer:5d} {r.head:4d} {r.pattern:14s} {r.density:7.3f}  "
                     f"{r.mass[0]:.3f} {r.mass[1]:.3f} {r.mass[2]:.3f}   {r.oracle:.3f}  {r.gap:+.3f}  "
                     f"{r.rel_err:.3f}   {r.cosine:.4f}")
    return "\n".join(lines)
