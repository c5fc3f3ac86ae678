"""Offline per-head pattern search: which geometry (and budget) each head uses.

For every calibration prompt the model runs dense attention once while an observer
(:func:`minference.integration.observe_attention`) reads each layer's real queries, keys and
values. Per query head it computes the full causal softmax ``P [n, n]`` and, for every candidate
pattern, the set of keys each query would read — for the dynamic patterns the set the ONLINE index
builder picks from these very ``q, k`` (:mod:`minference.torch_backend`'s builders, which share
their selection with the Triton ones through :mod:`minference.index`) — then

* ``mass``: captured attention mass, ``sum_{(i,j) in set} P[i, j] / n`` (1 = lossless),
* ``density``: the fraction of the ``n (n + 1) / 2`` causal pairs the set holds, and
* ``out_error``: the relative output error of the sparse softmax over the set against the dense
  output, ``||O_set - O|| / ||O||`` per row, averaged (0 = lossless; :func:`head_scores`).

Candidates (:func:`candidate_patterns`) are A-shape, vertical-slash (two vertical/slash
splits) and block-sparse, each with its budget solved so that its worst-case density at the
calibration length is ``target_density`` (comparable cost). Per head the candidate with the
highest mean mass wins; a head whose best mass stays below ``min_mass`` gets
:class:`~minference.patterns.Dense` (broad heads, typically in the first layers). The result is
a :class:`~minference.config.PatternConfig` with provenance (calibration fingerprint, length,
seed, metric, per-head scores and densities, versions, hardware).

The per-prompt tile densities and output errors it also keeps (:attr:`SearchResult.tiles`,
``max_tiles``, ``out_error``) feed the cost-aware frontier (:mod:`minference.app.frontier`,
docs/search.md), whose candidates are :func:`frontier_candidates` and whose worst case is
:func:`flat_tiles`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from minference.config import (
    PatternConfig,
    Provenance,
    _now,
    _version,
    data_fingerprint,
    hardware_string,
    model_signature,
)
from minference.dispatch import FILL_GAPS
from minference.index_sets import scatter_set, slash_set
from minference.patterns import (
    DEFAULT_BLOCK_SIZE,
    AShape,
    BlockSparse,
    Dense,
    Pattern,
    VerticalSlash,
    pattern_from_dict,
    pattern_to_dict,
)
from minference.torch_backend import block_sparse_index, vertical_slash_index

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_TARGET_DENSITY",
    "DEFAULT_MIN_MASS",
    "SearchResult",
    "candidate_patterns",
    "causal_pairs",
    "pattern_sets",
    "pattern_mask",
    "head_scores",
    "plan_coverage",
    "search",
    "adaptive_candidates",
    "tile_density",
    "flat_tiles",
    "frontier_candidates",
    "parse_vs_caps",
    "is_adaptive",
    "SELECTIONS",
    "default_selection",
]

#: Density (fraction of causal pairs) every candidate is budgeted to at the calibration length.
DEFAULT_TARGET_DENSITY = 0.3
#: A head whose best candidate captures less mass than this stays dense.
DEFAULT_MIN_MASS = 0.8
#: A-shape sink width used by the candidates (tokens).
DEFAULT_SINK = 64
#: Fractions of the vertical-slash budget spent on vertical columns (the rest on diagonals).
VS_VERTICAL_SHARES = (0.1, 0.4)
#: Query rows per chunk when scoring a head (bounds memory to ``chunk x n`` per tensor).
ROW_CHUNK = 512
#: The search scores every this-many-th query row (an unbiased row sample; indices still come
#: from the full prompt).
SEARCH_ROW_STRIDE = 4


def causal_pairs(n: int) -> int:
    """Number of causal query-key pairs of an ``n``-token prompt."""
    return n * (n + 1) // 2


def _ashape_pairs(n: int, sink: int, window: int) -> int:
    i = torch.arange(n, dtype=torch.float64)
    win = torch.clamp(i + 1, max=window)  # the window's keys
    extra = torch.clamp(torch.clamp(i + 1 - window, max=sink), min=0)  # sinks left of the window
    return int((win + extra).sum())


def _block_pairs(n: int, top_k: int, block: int) -> int:
    """Worst-case pairs of block-sparse ``top_k`` (every chosen block full below the diagonal)."""
    nb = -(-n // block)
    total = 0
    for qb in range(nb):
        rows = min(block, n - qb * block)
        others = min(top_k, qb + 1) - 1
        total += others * block * rows + rows * (rows + 1) // 2
    return total


def _solve(f: Callable[[int], int], lo: int, hi: int, budget: float) -> int:
    """Largest ``x`` in ``[lo, hi]`` with ``f(x) <= budget`` (``f`` non-decreasing), at least ``lo``."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def candidate_patterns(
    n: int,
    target_density: float = DEFAULT_TARGET_DENSITY,
    *,
    sink: int = DEFAULT_SINK,
    block: int = DEFAULT_BLOCK_SIZE,
    vertical_shares: Sequence[float] = VS_VERTICAL_SHARES,
) -> list[Pattern]:
    """Candidates of comparable cost for an ``n``-token prompt: each one's worst-case density is
    at most ``target_density`` (and as close to it as its budget granularity allows).

    * A-shape ``(sink, window)``: exact pair count, window solved.
    * Vertical-slash ``(v, s)``: worst case ``v`` full columns and the ``s`` longest diagonals,
      ``v n + s n - s (s - 1) / 2`` pairs; ``v`` takes each share of the budget in ``vertical_shares``.
    * Block-sparse ``top_k``: worst case every chosen block full.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not 0 < target_density <= 1:
        raise ValueError(f"target_density must lie in (0, 1], got {target_density!r}")
    budget = target_density * causal_pairs(n)
    out: list[Pattern] = []
    g = min(sink, n)
    window = _solve(lambda w: _ashape_pairs(n, g, w), 1, n, budget)
    out.append(AShape(sink=g, window=window))
    for share in vertical_shares:
        v = max(0, int(share * budget) // n)
        rest = budget - v * n
        s = _solve(lambda s: s * n - s * (s - 1) // 2, 1, n, rest)
        out.append(VerticalSlash(vertical=v, slash=s, sink_columns=min(v, VerticalSlash.sink_columns),
                                 local_diagonals=min(s, VerticalSlash.local_diagonals)))
    top_k = _solve(lambda t: _block_pairs(n, t, block), 1, -(-n // block), budget)
    out.append(BlockSparse(top_k=top_k, block=block))
    return out


#: Largest budgets of the adaptive candidates (bounds of their tile lists): keys per query block
#: (64K: the block-sparse width is ``ADAPTIVE_MAX_BLOCK_TOKENS // block`` blocks), vertical
#: columns, diagonals.
ADAPTIVE_MAX_BLOCK_TOKENS = 65536
ADAPTIVE_MAX_VERTICAL = 2048
ADAPTIVE_MAX_SLASH = 8192
#: Thresholds of the adaptive candidates: γ of the mass rule (FlexPrefill 0.9-0.95, XAttention
#: 0.9) for vertical-slash and α of the relative rule (FlashPrefill 0.08-0.18 on its score) for
#: query-routed blocks. Block-sparse candidates take the relative rule only: its selection runs in
#: one launch (:func:`minference.kernels.select_query_blocks`); the mass rule's sort and
#: prefix sums made most of the index time of the first searched Qwen config at 120K. γ 0.8 is
#: for searches below min_mass 0.9 (a head that needs 0.85 could only take γ 0.9 or a denser
#: pattern otherwise). See docs/tuning.md#adaptive-rules.
ADAPTIVE_GAMMAS = (0.8, 0.9, 0.95)
ADAPTIVE_ALPHAS = (0.3, 0.1, 0.03, 0.01)
#: A-shape candidates (sink, window) next to the adaptive ones.
ADAPTIVE_ASHAPES = ((64, 1024), (128, 4096))
#: Routing block of the adaptive block-sparse candidates: 128 (the query-aware scores cost less than
#: half of block 64's; see docs/tuning.md#adaptive-block).
ADAPTIVE_BLOCK = 128


def adaptive_candidates(
    *,
    gammas: Sequence[float] = ADAPTIVE_GAMMAS,
    alphas: Sequence[float] = ADAPTIVE_ALPHAS,
    ashapes: Sequence[tuple[int, int]] = ADAPTIVE_ASHAPES,
    block: int = ADAPTIVE_BLOCK,
) -> list[Pattern]:
    """Length-independent candidates for ``search(select="cheapest")``: A-shapes, block-sparse
    with the query-aware score under the relative rule (each α), and vertical-slash under the
    mass rule (each γ), the adaptive budgets bounded by :data:`ADAPTIVE_MAX_BLOCK_TOKENS` /
    :data:`ADAPTIVE_MAX_VERTICAL` / :data:`ADAPTIVE_MAX_SLASH`."""
    out: list[Pattern] = [AShape(sink=g, window=w) for g, w in ashapes]
    for alpha in alphas:
        out.append(BlockSparse(top_k=max(1, ADAPTIVE_MAX_BLOCK_TOKENS // block), block=block, rule="relative",
                               threshold=alpha, estimate="query"))
    for gamma in gammas:
        out.append(VerticalSlash(vertical=ADAPTIVE_MAX_VERTICAL, slash=ADAPTIVE_MAX_SLASH, rule="mass",
                                 threshold=gamma))
    return out


#: A-shape candidates of the frontier search (sink, window): the adaptive ones and a wide window.
FRONTIER_ASHAPES = ((64, 1024), (128, 4096), (128, 16384))
#: Caps of the frontier's adaptive block-sparse candidates, as fractions of the target length: a
#: relative-rule head keeps at most ``ceil(f * n / block)`` blocks per query block, so a flat-score
#: input (every block passes the rule) costs at most that many (:func:`flat_tiles`). The cap is part
#: of the candidate: the search scores each (α, cap) pair with the cap in place.
FRONTIER_CAP_FRACTIONS = (1 / 32, 1 / 8, 1 / 2)
#: Caps (columns, diagonals) of the frontier's vertical-slash candidates, one candidate per (γ, cap)
#: pair: by default the adaptive ones alone (``minference search --vs-caps`` adds smaller ones).
FRONTIER_VS_CAPS = ((ADAPTIVE_MAX_VERTICAL, ADAPTIVE_MAX_SLASH),)
#: Routing blocks of the frontier's block-sparse candidates (``--bs-blocks``): one set of (rule,
#: threshold, cap) candidates per block. 64 keeps fewer unused keys per kept block at about four
#: times the query-aware scoring work.
FRONTIER_BS_BLOCKS = (ADAPTIVE_BLOCK,)
#: Scoring rows of the frontier's block-sparse candidates (``--bs-score-rows``): one set of (rule,
#: threshold, cap) candidates per entry; 0 is every query of the block (the full query-aware score),
#: ``r`` the cheaper estimate from ``r`` of them (:attr:`minference.patterns.BlockSparse.score_rows`).
FRONTIER_BS_SCORE_ROWS = (0,)


def parse_vs_caps(values: Sequence[str] | None) -> tuple[tuple[int, int], ...]:
    """``--vs-caps`` values, each ``"V/S"`` (columns / diagonals, positive ints), as ``((V, S),
    ...)``; ``None``: :data:`FRONTIER_VS_CAPS`.

    Raises:
        ValueError: a value that is not two positive ints joined by ``/`` (named).
    """
    if values is None:
        return FRONTIER_VS_CAPS
    caps = []
    for text in values:
        parts = text.split("/")
        if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a vertical-slash cap is COLUMNS/DIAGONALS, two positive ints, got {text!r}")
        caps.append((int(parts[0]), int(parts[1])))
    return tuple(caps)


def frontier_candidates(
    n: int,
    *,
    gammas: Sequence[float] = ADAPTIVE_GAMMAS,
    alphas: Sequence[float] = ADAPTIVE_ALPHAS,
    ashapes: Sequence[tuple[int, int]] = FRONTIER_ASHAPES,
    cap_fractions: Sequence[float] = FRONTIER_CAP_FRACTIONS,
    blocks: Sequence[int] = FRONTIER_BS_BLOCKS,
    bs_gammas: Sequence[float] = (),
    vs_caps: Sequence[tuple[int, int]] = FRONTIER_VS_CAPS,
    score_rows: Sequence[int] = FRONTIER_BS_SCORE_ROWS,
) -> list[Pattern]:
    """Candidates of the cost-aware frontier search for an ``n``-token target length: A-shapes,
    block-sparse with the query-aware score for every routing block in ``blocks`` and every cap,
    under the relative rule (each α) and under the mass rule (each of ``bs_gammas``, none by
    default), each scored with every entry of ``score_rows``; vertical-slash under the mass rule
    for every (γ, ``vs_caps`` entry) pair, and :class:`Dense` (no error, the most expensive
    choice). Candidates equal after the caps are rounded appear once."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    for f in cap_fractions:
        if not 0 < f <= 1:
            raise ValueError(f"cap fractions must lie in (0, 1], got {f!r}")
    if not blocks:
        raise ValueError("blocks needs at least one block-sparse routing block")
    for block in blocks:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"a block-sparse routing block must be a positive int, got {block!r}")
    if not vs_caps:
        raise ValueError("vs_caps needs at least one (columns, diagonals) cap")
    if not score_rows:
        raise ValueError("score_rows needs at least one entry (0: every query of a block)")
    for r in score_rows:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"a block-sparse scoring row count must be an int >= 0, got {r!r}")
    out: list[Pattern] = [AShape(sink=g, window=w) for g, w in ashapes]
    rules: list[tuple[Literal["relative", "mass"], float]] = [("relative", a) for a in alphas]
    rules += [("mass", g) for g in bs_gammas]
    for block in blocks:
        nb = -(-n // block)
        for rule, threshold in rules:
            for f in cap_fractions:
                cap = min(nb, max(2, math.ceil(f * n / block)))
                out += [BlockSparse(top_k=cap, block=block, rule=rule, threshold=threshold, estimate="query",
                                    score_rows=r) for r in score_rows]
    for gamma in gammas:
        for vertical, slash in vs_caps:
            out.append(VerticalSlash(vertical=vertical, slash=slash, rule="mass", threshold=gamma))
    out.append(Dense())
    return list(dict.fromkeys(out))


def is_adaptive(pattern: Pattern) -> bool:
    """Whether ``pattern``'s budget is decided per input (the ``mass`` and ``relative`` rules)."""
    return getattr(pattern, "rule", "top_k") != "top_k"


def _vs_sets(q: torch.Tensor, k: torch.Tensor, p: VerticalSlash, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns [H, n], offsets [H, n])`` bool: the online builder's vertical-slash index for
    ``q, k [H, n, D]``, as the sets the dispatcher runs (offsets closed over gaps of at most
    :data:`~minference.dispatch.FILL_GAPS`)."""
    n = q.shape[1]
    v_idx, s_idx = vertical_slash_index(
        q[None], k[None], p.vertical, p.slash, last_q=p.last_q, sink_columns=p.sink_columns,
        local_diagonals=p.local_diagonals, aggregation=p.aggregation, extra_rows=p.extra_rows, scale=scale,
        rule=p.rule, threshold=p.threshold, min_vertical=p.min_vertical, min_slash=p.min_slash, validate=False)
    return scatter_set(n, v_idx[0]), slash_set(n, s_idx[0], FILL_GAPS)


def _block_sets(q: torch.Tensor, k: torch.Tensor, p: BlockSparse, scale: float) -> torch.Tensor:
    """``[H, NQB, NKB]`` bool: the online builder's block routing for ``q, k [H, n, D]``, as sets."""
    nb = -(-q.shape[1] // p.block)
    blocks = block_sparse_index(
        q[None], k[None], p.top_k, block=p.block, sink_blocks=p.sink_blocks, force_diagonal=p.force_diagonal,
        scale=scale, rule=p.rule, threshold=p.threshold, min_blocks=p.min_blocks, estimate=p.estimate,
        score_rows=p.score_rows, validate=False)
    return scatter_set(nb, blocks[0])


def pattern_sets(pattern: Pattern, q: torch.Tensor, k: torch.Tensor, scale: float):
    """The online choice of ``pattern`` for heads ``q, k [H, n, D]`` (kv expanded), made by
    :func:`minference.torch_backend.vertical_slash_index` / :func:`~minference.torch_backend.block_sparse_index`:
    columns and offsets ``[H, n]`` bool (vertical-slash), chosen blocks ``[H, NQB, NKB]`` bool
    (block-sparse), or ``None`` (static patterns)."""
    if isinstance(pattern, VerticalSlash):
        return _vs_sets(q, k, pattern, scale)
    if isinstance(pattern, BlockSparse):
        return _block_sets(q, k, pattern, scale)
    return None


def _diagonal_rows(offs: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[H, R, n]`` bool ``offs[h, i - j]`` for ``i`` in ``rows`` (False where ``j > i``), built
    from strided views instead of an ``R x n`` gather index."""
    H = offs.shape[0]
    w = torch.zeros(H, 2 * n - 1, dtype=torch.bool, device=offs.device)
    w[:, : n] = offs.flip(-1)  # w[x] = offs[n - 1 - x]
    table = w.as_strided((H, n, n), (w.stride(0), 1, 1))  # [H, n, n]: table[h, r, j] = w[r + j]
    return table[:, (n - 1 - rows).long()]  # row r' = n - 1 - i gives offs[i - j]


def pattern_mask(pattern: Pattern, sets, H: int, n: int, rows: torch.Tensor, device) -> torch.Tensor:
    """``[H, len(rows), n]`` bool: keys each query in ``rows`` reads under ``pattern`` (causal)."""
    rows = rows.to(device)
    i = rows[:, None]
    j = torch.arange(n, device=device)[None, :]
    causal = j <= i
    if isinstance(pattern, Dense):
        m = causal.expand(H, -1, -1)
    elif isinstance(pattern, AShape):
        m = (causal & ((j < pattern.sink) | (j > i - pattern.window))).expand(H, -1, -1)
    elif isinstance(pattern, VerticalSlash):
        cols, offs = sets
        m = (cols[:, None, :] | _diagonal_rows(offs, rows, n)) & causal
    elif isinstance(pattern, BlockSparse):
        per_row = sets[:, (rows // pattern.block).long()]  # [H, R, NKB]
        m = per_row.repeat_interleave(pattern.block, dim=-1)[..., :n] & causal
    else:
        raise TypeError(f"unknown pattern {type(pattern).__name__}")
    return m


#: Key and query tile of the physical cost model (the kernels' 64-wide tiles).
COST_TILE = 64
#: Relative cost of one 64 x 64 tile by head dim (64: ``D <= 64``, 128: the rest) and pattern
#: kind, from each kernel's share of cuDNN's logical throughput at that head dim (H200, bf16):
#: cost ~ 1 / share; ``D <= 64`` is the Qwen testbed's shape, whose dense heads a sparse plan runs
#: through the A-shape kernel. Shares and runs: see docs/tuning.md#tile-cost.
TILE_COST = {128: {"dense": 1.0, "a_shape": 1 / 0.94, "vertical_slash": 1 / 0.92, "block_sparse": 1 / 0.82},
             64: {"dense": 1 / 0.90, "a_shape": 1 / 0.83, "vertical_slash": 1 / 0.68, "block_sparse": 1 / 0.90}}


def tile_cost(kind: str, head_dim: int) -> float:
    """:data:`TILE_COST` of ``kind`` at ``head_dim``."""
    return TILE_COST[64 if head_dim <= 64 else 128][kind]


def tile_density(pattern: Pattern, sets, H: int, n: int, device) -> torch.Tensor:
    """``[H]`` float64: the kernel's work for ``pattern`` as 64 x 64 tiles over the causal tiles.

    * dense: 1; A-shape: every key tile the sinks or the window of a query tile reach;
    * vertical-slash: the key tiles the chosen offsets reach (offset ``δ`` from query tile ``I``
      reaches key tiles ``I - t`` with ``64 t - 63 <= δ <= 64 t + 63``, the same for every ``I``),
      plus the chosen columns left of the query tile as gathered rows (64 columns = one tile);
    * block-sparse: the chosen blocks' area in tiles.
    """
    T = COST_TILE
    nt = -(-n // T)
    qt = torch.arange(nt, device=device, dtype=torch.float64)
    causal = float(nt * (nt + 1) // 2)
    if isinstance(pattern, Dense):
        return torch.ones(H, dtype=torch.float64)
    if isinstance(pattern, AShape):
        i0 = qt * T
        lo = torch.clamp(i0 - pattern.window + 1, min=0)
        window_tiles = qt - torch.div(lo, T, rounding_mode="floor") + 1
        sink_tiles = torch.clamp(torch.minimum(torch.full_like(lo, float(-(-pattern.sink // T))),
                                               torch.div(lo, T, rounding_mode="floor")), min=0)
        return torch.full((H,), float((window_tiles + sink_tiles).sum()) / causal, dtype=torch.float64)
    if isinstance(pattern, VerticalSlash):
        cols, offs = sets
        pad = torch.zeros(H, nt * T + 2 * T, dtype=torch.bool, device=device)
        pad[:, T : T + n] = offs
        # tile offset t is reached by offsets [64t - 63, 64t + 63]: a window of 127 around 64t
        win = torch.nn.functional.max_pool1d(pad[:, None].float(), kernel_size=2 * T - 1, stride=1,
                                             padding=0)[:, 0]  # win[x] = any(pad[x .. x + 2T - 2])
        reach = win[:, (torch.arange(nt, device=device) * T + 1).long()] > 0  # [H, nt]: t = 0..nt-1
        per_query_tile = torch.cumsum(reach.double(), dim=-1)  # tiles reached from query tile I: t <= I
        ranges = per_query_tile.sum(dim=-1)
        col_pos = torch.cumsum(torch.nn.functional.pad(cols, (0, nt * T - n)).view(H, nt, T).sum(-1), -1)
        gathered = col_pos.double().sum(dim=-1) / T
        return ((ranges + gathered) / causal).cpu()
    if isinstance(pattern, BlockSparse):
        area = sets.sum(dim=(-1, -2)).double() * (pattern.block / T) ** 2
        return (area / causal).cpu()
    raise TypeError(f"unknown pattern {type(pattern).__name__}")


def flat_tiles(pattern: Pattern, n: int) -> float:
    """:func:`tile_density` of ``pattern`` on a flat-score input of ``n`` tokens, counted with every
    adaptive count at its cap (``top_k`` / ``vertical`` / ``slash``: on equal scores the relative
    rule keeps everything and the mass rule a γ share, both up to the cap, so this bounds them),
    and equal scores resolved to the lowest positions as the selection does on ties
    (vertical-slash: the first ``vertical`` columns and the offsets ``0 .. slash - 1``, a band;
    block-sparse: ``min(top_k, I + 1)`` blocks of every query block ``I``, whichever they are).
    The worst case of a rule with a cap; static patterns give their own density (the top-k rules
    keep their counts on every input)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    T = COST_TILE
    nt = -(-n // T)
    causal = nt * (nt + 1) // 2
    if isinstance(pattern, (Dense, AShape)):
        return float(tile_density(pattern, None, 1, n, "cpu")[0])
    if isinstance(pattern, BlockSparse):
        nb = -(-n // pattern.block)
        blocks = sum(min(pattern.top_k, I + 1) for I in range(nb))
        return blocks * (pattern.block / T) ** 2 / causal
    if isinstance(pattern, VerticalSlash):
        cols = torch.zeros(1, n, dtype=torch.bool)
        offs = torch.zeros(1, n, dtype=torch.bool)
        cols[:, : min(pattern.vertical, n)] = True
        offs[:, : min(pattern.slash, n)] = True
        return float(tile_density(pattern, (cols, offs), 1, n, "cpu")[0])
    raise TypeError(f"unknown pattern {type(pattern).__name__}")


def _attend(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weights [Hq, R, n] @ v [Hkv, n, D] -> [Hq, R, D]``, query head ``h`` reading kv head
    ``h // (Hq // Hkv)`` (no expanded copy of ``v``)."""
    Hq, R, n = weights.shape
    Hkv = v.shape[0]
    return torch.einsum("kgrn,knd->kgrd", weights.reshape(Hkv, Hq // Hkv, R, n), v).reshape(Hq, R, -1)


def _output_error(probs: torch.Tensor, m: torch.Tensor, kept: torch.Tensor, row_mass: torch.Tensor,
                  dense: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[Hq, R]`` float32 ``||O_c - O|| / ||O||`` per row of a chunk: ``O = dense [Hq, R, D]``, the
    rows' dense output (``probs @ v`` over ``row_mass [Hq, R]``), and ``O_c`` the softmax
    renormalised over the candidate's keys ``m [Hq, R, n]`` (``kept [Hq, R]``: their probability
    sum), as the sparse kernels compute it.

    One product with ``v``, of the smaller side: where the candidate keeps at least half the mass,
    the missed probabilities (``O_c - O = (missed * O - missed_probs @ v) / kept``: a small error
    keeps its float32 precision instead of being the difference of two full outputs, and a
    covering candidate gives exactly 0); elsewhere the kept ones (``O_c = kept_probs @ v / kept``).
    A row whose kept probabilities sum to 0 (an empty set, or kept keys that all underflow, ~100
    nats below the row's largest logit) counts as ``O_c = 0``, the kernels' output of an empty
    row: error 1. A row with ``O = 0`` counts as error 0."""
    use_missed = kept >= 0.5 * row_mass  # [Hq, R]
    part = probs * (m != use_missed[..., None])  # missed probabilities where use_missed, else the kept ones
    weighted = _attend(part, v)  # [Hq, R, D]
    safe = torch.where(kept > 0, kept, torch.ones_like(kept))[..., None]
    diff = torch.where(use_missed[..., None], (part.sum(dim=-1)[..., None] * dense - weighted) / safe,
                       weighted / safe - dense)
    norm = dense.norm(dim=-1)
    return torch.where(norm > 0, diff.norm(dim=-1) / torch.where(norm > 0, norm, 1.0), 0.0)


def head_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    candidates: Sequence[Pattern],
    *,
    scale: float | None = None,
    rows: int | None = None,
    row_stride: int = 1,
    return_tiles: bool = False,
    v: torch.Tensor | None = None,
):
    """Captured mass and density of each candidate for each query head of one prompt, and with
    ``v`` its relative output error.

    Captured mass is the share of each scored row's attention probability that the candidate's
    pairs hold (at most 1, exactly 1 for a candidate that covers the row). Density is the
    candidate's pairs over the causal pairs of the scored queries. Output error is
    ``||O_c - O||_2 / ||O||_2`` per scored row, ``O`` the dense row output ``softmax(causal
    logits) @ v`` and ``O_c`` the sparse one, the softmax renormalised over the candidate's keys
    (what the kernels compute): 0 for a candidate that covers the row, and 0 however much mass is
    missed when the missed keys' values average to the kept ones' (:func:`_output_error` gives
    the edge cases).

    Args:
        q: ``[Hq, n, D]``; k: ``[Hkv, n, D]`` (GQA: head ``h`` reads kv head ``h // (Hq // Hkv)``).
        candidates: patterns to score.
        scale: softmax scale (default ``D ** -0.5``).
        rows: score only the last ``rows`` queries (default all ``n``); the index is still
            chosen from the whole prompt.
        row_stride: score every ``row_stride``-th of those queries, counted back from the last
            (an unbiased sample of the rows: the cost falls by the stride).
        return_tiles: also return :func:`tile_density`.
        v: ``[Hkv, n, D]`` values: also return the output error (one ``[R, n] @ [n, D]`` product
            per head and candidate, and one for the dense output, per chunk of scored rows).

    Returns:
        ``(mass [Hq, C], density [Hq, C])`` float64, averaged over the scored queries; with
        ``return_tiles`` then ``tiles [Hq, C]``: :func:`tile_density` of the whole prompt; with
        ``v`` last ``out_error [Hq, C]`` float64, the mean relative output error over the scored
        queries.
    """
    Hq, n, D = q.shape
    group = Hq // k.shape[0]
    if v is not None and tuple(v.shape[:2]) != tuple(k.shape[:2]):
        raise ValueError(f"v must be [Hkv, n, D] like k {tuple(k.shape)}, got {tuple(v.shape)}")
    scale = D**-0.5 if scale is None else scale
    kx = k.repeat_interleave(group, dim=0) if group > 1 else k
    sets = [pattern_sets(p, q, kx, scale) for p in candidates]
    first = n - (n if rows is None else min(rows, n))
    if isinstance(row_stride, bool) or not isinstance(row_stride, int) or row_stride < 1:
        raise ValueError(f"row_stride must be a positive int, got {row_stride!r}")
    scored = torch.arange(n - 1, first - 1, -row_stride, device=q.device).flip(0)
    mass = torch.zeros(Hq, len(candidates), dtype=torch.float64)
    pairs = torch.zeros(Hq, len(candidates), dtype=torch.float64)
    error = torch.zeros(Hq, len(candidates), dtype=torch.float64)
    qf, kf = q.float(), kx.float()
    vf = None if v is None else v.float()
    for start in range(0, scored.numel(), ROW_CHUNK):
        r = scored[start : start + ROW_CHUNK]
        logits = torch.einsum("hid,hjd->hij", qf[:, r], kf) * scale  # [Hq, R, n]
        causal = torch.arange(n, device=q.device)[None, :] <= r[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        del logits  # one [Hq, R, n] float32 tensor less at the peak
        row_mass = probs.sum(dim=-1)  # [Hq, R]: 1 up to float32 rounding
        dense = None if vf is None else _attend(probs, vf) / row_mass[..., None]  # [Hq, R, D]
        for c, (p, s) in enumerate(zip(candidates, sets)):
            m = pattern_mask(p, s, Hq, n, r, q.device)
            # each row's captured share of its computed mass: the masked sum is the same float32
            # reduction over values that are equal or zero, so it never exceeds row_mass and a
            # mask that covers the row gives exactly 1 (summing raw probabilities gave 1 + 6.6e-9)
            kept = (probs * m).sum(dim=-1)
            mass[:, c] += (kept / row_mass).double().sum(dim=1).cpu()
            pairs[:, c] += m.sum(dim=(1, 2)).double().cpu()
            if dense is not None and vf is not None:
                error[:, c] += _output_error(probs, m, kept, row_mass, dense, vf).double().sum(dim=1).cpu()
    out = [mass / scored.numel(), pairs / float((scored + 1).sum())]
    if return_tiles:
        out.append(torch.stack([tile_density(p, st, Hq, n, q.device) for p, st in zip(candidates, sets)], dim=1))
    if v is not None:
        out.append(error / scored.numel())
    return tuple(out)


def plan_coverage(
    q: torch.Tensor,
    k: torch.Tensor,
    plan: Sequence[Pattern],
    *,
    scale: float | None = None,
    rows: int | None = None,
    row_stride: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Captured mass and density of a per-head plan: head ``h`` of ``q [Hq, n, D]`` uses
    ``plan[h]`` (``k [Hkv, n, D]``, GQA as in :func:`head_scores`).

    Returns:
        ``(mass [Hq], density [Hq])`` float64.
    """
    Hq = q.shape[0]
    if len(plan) != Hq:
        raise ValueError(f"plan must have one pattern per query head ({Hq}), got {len(plan)}")
    group = Hq // k.shape[0]
    mass = torch.zeros(Hq, dtype=torch.float64)
    density = torch.zeros(Hq, dtype=torch.float64)
    for pattern in dict.fromkeys(plan):
        heads = [h for h, p in enumerate(plan) if p == pattern]
        kv = torch.tensor([h // group for h in heads], device=k.device)
        m, d = head_scores(q[heads], k[kv], [pattern], scale=scale, rows=rows, row_stride=row_stride)
        mass[heads], density[heads] = m[:, 0], d[:, 0]
    return mass, density


@dataclass
class SearchResult:
    """A searched config plus every candidate's scores (for reports).

    Attributes:
        config: the chosen patterns with provenance.
        candidates: the candidate patterns, in score-column order.
        mass: ``[L, H, C]`` mean captured mass per layer, global head, candidate.
        density: ``[L, H, C]`` mean density likewise.
        worst_mass: ``[L, H, C]`` the smallest captured mass over the calibration prompts.
        cost: ``[L, H, C]`` mean :func:`tile_density` times the kind's :func:`tile_cost` at the head dim.
        tiles: ``[L, H, C]`` mean :func:`tile_density` (fraction of the causal 64 x 64 tiles).
        max_tiles: ``[L, H, C]`` the largest :func:`tile_density` over the calibration prompts.
        n_tokens: the calibration length; head_dim: the model's.
        out_error: ``[L, H, C]`` mean relative output error (:func:`head_scores` with values) over
            the calibration prompts; ``None`` for results made without it (measurements saved
            before it existed).
        worst_out_error: ``[L, H, C]`` the largest relative output error over the prompts.
    """

    config: PatternConfig
    candidates: list[Pattern]
    mass: torch.Tensor
    density: torch.Tensor
    worst_mass: torch.Tensor | None = None
    cost: torch.Tensor | None = None
    select: str = "best_mass"
    min_mass: float = 0.0
    tiles: torch.Tensor | None = None
    max_tiles: torch.Tensor | None = None
    n_tokens: int | None = None
    head_dim: int | None = None
    out_error: torch.Tensor | None = None
    worst_out_error: torch.Tensor | None = None

    def to_dict(self) -> dict:
        """Plain-JSON form (:data:`MEASUREMENTS_FORMAT`): every measurement the frontier and
        :meth:`rechoose` read, so a family or a min-mass config can be made again without the
        model (``minference search --from-measurements``). A measurement not made is ``null``."""
        def values(t: torch.Tensor | None) -> list | None:
            return None if t is None else t.to(torch.float64).tolist()

        return {"format": MEASUREMENTS_FORMAT, "version": MEASUREMENTS_VERSION, "config": self.config.to_dict(),
                "candidates": [pattern_to_dict(c) for c in self.candidates], "select": self.select,
                "min_mass": self.min_mass, "n_tokens": self.n_tokens, "head_dim": self.head_dim,
                **{name: values(getattr(self, name)) for name in _MEASURED}}

    @classmethod
    def from_dict(cls, data: Any) -> SearchResult:
        """The result :meth:`to_dict` wrote. Raises ``ValueError`` naming what is wrong: another
        format or version, a field of the wrong type (``select`` not one of :data:`SELECTIONS`,
        ``min_mass`` not a number in ``[0, 1]``, ``n_tokens`` / ``head_dim`` not a positive int or
        ``null``), a measurement missing, not numbers, not finite or not ``[layers, heads,
        candidates]`` of the config and candidates it holds. The optional measurements (all but
        ``mass`` and ``density``) may be absent, as in files written before the output error was
        measured."""
        if not isinstance(data, dict) or data.get("format") != MEASUREMENTS_FORMAT:
            raise ValueError(f"not a search measurements file (format {MEASUREMENTS_FORMAT!r})")
        if data.get("version") != MEASUREMENTS_VERSION:
            raise ValueError(f"search measurements version {data.get('version')!r}, expected {MEASUREMENTS_VERSION}")
        missing = [k for k in ("config", "candidates", "select", "min_mass", "mass", "density") if data.get(k) is None]
        if missing:
            raise ValueError(f"search measurements lack {', '.join(map(repr, missing))}")

        def bad(field: str, want: str) -> ValueError:
            got = data[field]
            if field == "candidates" and isinstance(got, list):  # the first entry that is not an object
                got = next((x for x in got if not isinstance(x, dict)), got)
            shown = repr(got) if isinstance(got, (bool, int, float, str)) else f"a {type(got).__name__}"
            return ValueError(f"search measurements: {field!r} must be {want}, got {shown[:60]}")

        if not isinstance(data["config"], dict):
            raise bad("config", "a PatternConfig object")
        if not isinstance(data["candidates"], list) or not all(isinstance(c, dict) for c in data["candidates"]):
            raise bad("candidates", "a list of pattern objects")
        if not isinstance(data["select"], str) or data["select"] not in SELECTIONS:
            raise bad("select", f"one of {', '.join(SELECTIONS)}")
        min_mass = data["min_mass"]
        if isinstance(min_mass, bool) or not isinstance(min_mass, (int, float)) or not 0 <= min_mass <= 1:
            raise bad("min_mass", "a number in [0, 1]")
        for field in ("n_tokens", "head_dim"):
            value = data.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise bad(field, "a positive int or null")
        config = PatternConfig.from_dict(data["config"])  # ConfigError (a ValueError) names the entry
        try:
            candidates = [pattern_from_dict(c) for c in data["candidates"]]
        except (TypeError, ValueError) as err:
            raise ValueError(f"search measurements: a candidate: {err}") from None
        shape = (len(config.layers), config.model.num_heads, len(candidates))
        measured: dict[str, torch.Tensor | None] = {}
        for name in _MEASURED:
            if data.get(name) is None:  # only the optional ones (mass and density are checked above)
                measured[name] = None
                continue
            if not isinstance(data[name], list):
                raise bad(name, "a [layers, heads, candidates] list of numbers")
            try:
                t = torch.tensor(data[name], dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError, OverflowError):  # None or text inside, ragged lists
                raise ValueError(f"search measurement {name!r} is not a [layers, heads, candidates] list of "
                                 "numbers") from None
            if tuple(t.shape) != shape:
                raise ValueError(f"search measurement {name!r} has shape {tuple(t.shape)}, expected {shape} "
                                 "(layers, heads, candidates)")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"search measurement {name!r} holds a non-finite value")
            measured[name] = t
        mass, density = measured.pop("mass"), measured.pop("density")
        assert mass is not None and density is not None  # required above
        return cls(config, candidates, mass, density, select=data["select"], min_mass=float(min_mass),
                   n_tokens=data.get("n_tokens"), head_dim=data.get("head_dim"), **measured)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON (one float list per head); gzip-compressed when ``path``
        ends in ``.gz`` (the 1.5B's 336 heads: 783 KB of JSON, 214 KB compressed)."""
        text = json.dumps(self.to_dict()) + "\n"
        if str(path).endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> SearchResult:
        """:meth:`from_dict` of a JSON file (``.gz``: compressed); ``ValueError`` for a file that is
        not one."""
        try:
            if str(path).endswith(".gz"):
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    data = json.loads(f.read())
            else:
                data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
        except (gzip.BadGzipFile, EOFError, UnicodeDecodeError, zlib.error) as err:  # zlib: a damaged stream
            what = "gzip-compressed JSON" if str(path).endswith(".gz") else "UTF-8 JSON"
            raise ValueError(f"{path}: not {what} ({err})") from None
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}" if str(path) not in str(err) else str(err)) from None

    def rechoose(self, min_mass: float, select: str | None = None) -> PatternConfig:
        """The config this search gives under another ``min_mass`` (and ``select``), from the
        scores already measured: no model run. Provenance as :func:`search` writes it."""
        select = self.select if select is None else select
        _check_choice(min_mass, select)
        if select == "cheapest" and (self.worst_mass is None or self.cost is None):
            raise ValueError("select='cheapest' needs the worst masses and costs of a search()")
        layers, scores, dens = _choose(self.candidates, self.mass, self.density, self.worst_mass, self.cost,
                                       min_mass, select)
        prov = self.config.provenance
        notes = re.sub(r"min_mass [0-9.e+-]+; selection \w+", f"min_mass {min_mass}; selection {select}",
                       prov.notes or "")
        provenance = dataclasses.replace(prov, scores=scores, densities=dens, notes=notes)
        return PatternConfig(self.config.model, layers, provenance)


#: The JSON of :meth:`SearchResult.to_dict` (``minference search --save-measurements``).
MEASUREMENTS_FORMAT = "minference.search_measurements"
MEASUREMENTS_VERSION = 1
#: The ``[L, H, C]`` measurements it holds. The version stays 1 with the output error added: both
#: fields are optional (files without them load, with ``None``), and a reader that predates them
#: ignores them.
_MEASURED = ("mass", "density", "worst_mass", "cost", "tiles", "max_tiles", "out_error", "worst_out_error")

#: How :func:`search` picks a head's pattern: the highest mean mass at the candidates' common
#: budget, or the cheapest candidate whose worst calibration prompt still reaches ``min_mass``.
SELECTIONS = ("best_mass", "cheapest")


def default_selection(candidates: Sequence[Pattern]) -> str:
    """The selection rule that suits ``candidates``: ``"best_mass"`` for candidates of one common
    budget (:func:`candidate_patterns`), ``"cheapest"`` where a candidate's cost is its own — an
    adaptive rule (:func:`adaptive_candidates`: the highest mass is the widest budget) or
    :class:`Dense` (:func:`frontier_candidates`: it captures all the mass, so the highest mass is
    Dense for every head)."""
    return "cheapest" if any(is_adaptive(c) or isinstance(c, Dense) for c in candidates) else "best_mass"


def search(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    *,
    target_density: float = DEFAULT_TARGET_DENSITY,
    min_mass: float = DEFAULT_MIN_MASS,
    candidates: Sequence[Pattern] | None = None,
    model_id: str | None = None,
    seed: int | None = None,
    row_stride: int = SEARCH_ROW_STRIDE,
    progress: bool = True,
    select: str | None = None,
) -> SearchResult:
    """Choose a pattern per (layer, global head) of ``model`` from calibration ``prompts``.

    Args:
        model: a transformers causal LM (not patched).
        prompts: 1-D int64 token id tensors, all of one length ``n``.
        target_density: candidates' budgets (see :func:`candidate_patterns`).
        min_mass: heads whose best mean captured mass is below this stay dense.
        candidates: override the candidate list.
        seed: recorded in the provenance (the prompts were drawn with it).
        row_stride: score every ``row_stride``-th query (see :func:`head_scores`).
        progress: show a tqdm bar over prompts x layers.
        select: ``"best_mass"`` (the candidate with the highest mean mass; heads below
            ``min_mass`` stay dense) or ``"cheapest"`` (among the candidates whose captured mass
            on the WORST calibration prompt is at least ``min_mass``, the one of least
            :func:`tile_density` times :func:`tile_cost`; a head none satisfies stays dense) —
            the rule for adaptive candidates, whose density differs per head and per input.
            ``None``: :func:`default_selection` of the candidates.
    """
    from tqdm.auto import tqdm

    from minference.integration import observe_attention

    if not prompts:
        raise ValueError("prompts must hold at least one calibration prompt")
    lengths = {int(p.numel()) for p in prompts}
    if len(lengths) != 1 or any(p.dim() != 1 for p in prompts):
        raise ValueError(f"prompts must be 1-D token id tensors of one length, got lengths {sorted(lengths)}")
    (n,) = lengths
    cands = list(candidates) if candidates is not None else candidate_patterns(n, target_density)
    select = default_selection(cands) if select is None else select
    _check_choice(min_mass, select)
    signature = model_signature(model, model_id=model_id)
    L, H = signature.num_layers, signature.num_heads
    mass = torch.zeros(L, H, len(cands), dtype=torch.float64)
    density = torch.zeros(L, H, len(cands), dtype=torch.float64)
    worst = torch.ones(L, H, len(cands), dtype=torch.float64)
    cost = torch.zeros(L, H, len(cands), dtype=torch.float64)
    tiles = torch.zeros(L, H, len(cands), dtype=torch.float64)
    max_tiles = torch.zeros(L, H, len(cands), dtype=torch.float64)
    out_error = torch.zeros(L, H, len(cands), dtype=torch.float64)
    worst_out_error = torch.zeros(L, H, len(cands), dtype=torch.float64)
    device = next(model.parameters()).device
    bar = tqdm(total=len(prompts) * L, desc="search", unit="layer", disable=not progress)

    def observer(layer, query, key, value, seqlens, seqstarts):
        scale = getattr(_modules[layer], "scaling", None)
        m, d, t, e = head_scores(query[0], key[0], cands, scale=scale, row_stride=row_stride, return_tiles=True,
                                 v=value[0])
        mass[layer] += m
        density[layer] += d
        worst[layer] = torch.minimum(worst[layer], m)
        cost[layer] += t * torch.tensor([tile_cost(c.kind, query.shape[-1]) for c in cands], dtype=torch.float64)
        tiles[layer] += t
        max_tiles[layer] = torch.maximum(max_tiles[layer], t)
        out_error[layer] += e
        worst_out_error[layer] = torch.maximum(worst_out_error[layer], e)
        bar.update(1)

    from minference.integration import attention_modules

    _modules = attention_modules(model)
    with torch.no_grad(), observe_attention(model, observer):
        for ids in prompts:
            model(ids[None].to(device), use_cache=False, logits_to_keep=1)
    bar.close()
    mass /= len(prompts)
    density /= len(prompts)
    cost /= len(prompts)
    tiles /= len(prompts)
    out_error /= len(prompts)
    layers, scores, dens = _choose(cands, mass, density, worst, cost, min_mass, select)
    provenance = Provenance(
        source="search", package_version=_version(), created=_now(), hardware=hardware_string(),
        calibration_fingerprint=data_fingerprint([p.tolist() for p in prompts]), calibration_lengths=[n],
        seed=seed, metric="captured_mass", target_density=target_density, scores=scores, densities=dens,
        notes=(f"{len(prompts)} prompt(s), every {row_stride}th query row scored; min_mass {min_mass}; "
               f"selection {select}; candidates: {[repr(c) for c in cands]}"),
    )
    config = PatternConfig(signature, layers, provenance)
    return SearchResult(config, cands, mass, density, worst, cost, select, min_mass, tiles, max_tiles, n,
                        signature.head_dim, out_error, worst_out_error)


def _check_choice(min_mass: float, select: str) -> None:
    if not 0 <= min_mass <= 1:
        raise ValueError(f"min_mass must lie in [0, 1], got {min_mass!r}")
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}")


def _choose(cands, mass, density, worst, cost, min_mass: float, select: str):
    """Per (layer, head) the chosen candidate (or Dense), its mean mass and density."""
    L, H = mass.shape[:2]
    layers, scores, dens = [], [], []
    for l in range(L):
        row, srow, drow = [], [], []
        for h in range(H):
            if select == "best_mass":
                best = int(torch.argmax(mass[l, h]))
                ok = float(mass[l, h, best]) >= min_mass
            else:
                eligible = worst[l, h] >= min_mass
                ok = bool(eligible.any())
                best = int(torch.argmin(torch.where(eligible, cost[l, h], float("inf")))) if ok else 0
            if not ok:
                row.append(Dense())
                srow.append(1.0)
                drow.append(1.0)
            else:
                row.append(cands[best])
                srow.append(round(float(mass[l, h, best]), 6))
                drow.append(round(float(density[l, h, best]), 6))
        layers.append(row)
        scores.append(srow)
        dens.append(drow)
    return layers, scores, dens


def expected_density(config: PatternConfig) -> float:
    """Mean recorded density over (layer, head) (``math.nan`` when not recorded)."""
    d = config.provenance.densities
    if not d:
        return math.nan
    flat = [x for row in d for x in row if x is not None]
    return sum(flat) / len(flat) if flat else math.nan
