"""The speed/quality frontier: cost model, per-head options, allocation, config family, ship rule.

The search (:func:`minference.app.search.search`) measures, per (layer, head) and candidate
pattern, at the target length, the captured attention mass on every calibration prompt and the
physical tiles the kernel would run (:func:`~minference.app.search.tile_density`). This module
turns those measurements into configs along the frontier:

* **Cost** (:class:`CostModel`): modelled time of one head in one layer at the target length,
  ``intercept / H + ms_per_tile * tiles + index / H`` per pattern kind, from a cost table that
  ``benchmarks/calibrate_costs.py`` measures on the GPU (``H`` query heads per calibrated call:
  launch intercepts and index builds are per call, shared by the heads). Without a table the
  physical tile count is the proxy (:meth:`CostModel.proxy`): tiles times
  :data:`~minference.app.search.TILE_COST`, plus :data:`INDEX_PROXY` for the online index.
* **Error** (:func:`head_options`, ``proxy``): the proxy of end-task damage is, by default
  (``"mass"``), the missed attention mass, ``1 - captured mass``, averaged over the calibration
  prompts; a head's output error is at most its missed mass times twice the largest value norm
  (the sparse output is the dense one with the missed keys' share moved onto the kept keys), and
  the heads' errors enter the residual stream additively to first order, so the per-head errors
  add up. docs/search.md says how it was checked against the NLL. ``"output"``: the head's
  measured relative output error (:attr:`~minference.app.search.SearchResult.out_error`), which
  sees the values the mass ignores. Measured on the 1.5B at 130K, it predicts the NLL worse: at
  equal cost its configs lost two to three times the NLL (docs/search.md).
* **Worst case**: adaptive heads (mass and relative rules) decide their budget per input, up to
  their cap. A flat-score input drives every count to its cap
  (:func:`~minference.app.search.flat_tiles`); that is the config's worst case. The allocation
  keeps ``fixed + worst <= worst_ratio * (fixed + cost)`` (``fixed``: the model's time outside
  attention), so no input can make the prefill slower than that multiple of the modelled one.
* **Allocation** (:func:`allocate`): minimise the total modelled cost subject to the total error
  ``<= budget * heads`` (a multiple-choice knapsack). Per head, the lower convex hull of its
  (error, cost) options; all hull segments sorted by cost saved per error added give the exact
  Lagrangian path (each prefix minimises ``cost + λ error`` for its λ, so no assignment of at most
  its error is cheaper); a second multiplier ``μ`` on ``worst - R cost`` handles the worst-case
  constraint. A budget takes the cheapest path point within it: at most one head's step costlier
  than the knapsack optimum.
* **Family** (:func:`frontier_family`, :func:`write_family`): one config per budget, their
  predicted cost and error in the provenance notes, and a summary (JSON, markdown, plot).
* **Ship rule** (:func:`ship_choice`): over eval reports, the fastest config whose every task is
  within one sample of dense (at least 10 samples per cell), NLL within +0.02 nats and worst
  TTFT (of at least 10 timed prefills) at most 1.2 times its median, at every length, each with
  a dense run to compare with; every faster config is named with the reasons it failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from minference.app.search import COST_TILE, SearchResult, flat_tiles, is_adaptive, tile_cost
from minference.config import PatternConfig
from minference.patterns import BlockSparse, Dense, Pattern, VerticalSlash, canonical_layers, canonical_pattern_dict

__all__ = [
    "COST_TABLE_FORMAT",
    "FRONTIER_FORMAT",
    "INDEX_PROXY",
    "DEFAULT_BUDGETS",
    "DEFAULT_WORST_RATIO",
    "FrontierError",
    "CostModel",
    "fit_line",
    "causal_tiles",
    "attention_key",
    "index_key",
    "PROXIES",
    "check_proxy",
    "HeadOptions",
    "head_options",
    "Allocation",
    "allocate",
    "lagrangian_path",
    "FrontierPoint",
    "frontier_family",
    "frontier_summary",
    "summary_proxy",
    "format_summary",
    "family_config_path",
    "family_summary_stem",
    "write_family",
    "check_family_args",
    "TTFTStats",
    "ttft_stats",
    "ShipDecision",
    "ship_choice",
    "NLLPair",
    "nll_pairs",
    "rank_agreement",
]

COST_TABLE_FORMAT = "minference.cost_table"
COST_TABLE_VERSION = 1
FRONTIER_FORMAT = "minference.frontier"
FRONTIER_VERSION = 1
#: A cost table serves search lengths within this relative distance of its own: time per tile and
#: index time per head change with the length, so the table is measured at the target length.
COST_LENGTH_TOLERANCE = 0.1
#: Online index cost of the tile proxy, per head, as a fraction of that head's dense causal
#: attention at the same length (H200 measurements, the only ones there are): vertical-slash the
#: whole index against cuDNN at 128K, block-sparse the query-aware scores at block 128 against
#: dense attention per layer at 120K (see docs/tuning.md#index-proxy). The pooled estimate
#: was not measured alone and is charged as the query-aware one.
INDEX_PROXY = {"vertical_slash": 0.0085, "block_sparse": 0.023}
#: The allocation's per-head error (``proxy``), each with what its budget means.
PROXIES = {"mass": "mean missed attention mass per head", "output": "mean relative output error per head"}
#: Error budgets of a family when none are given: mean missed attention mass per head.
DEFAULT_BUDGETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.08)
#: The allocation's default bound on the flat-score worst case over the modelled prefill (the
#: ship rule's TTFT bound).
DEFAULT_WORST_RATIO = 1.2
#: Fractions of ``1 / worst_ratio`` tried for the worst-case multiplier ``μ`` (0: unconstrained).
MU_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
#: Slack of the budget comparisons (sums of float64 errors over a few hundred heads).
BUDGET_EPS = 1e-12


class FrontierError(ValueError):
    """A frontier that cannot be built as asked (bad cost table, budgets, options)."""


# ---------------------------------------------------------------------------------------------
# The cost model.


def causal_tiles(n: int) -> int:
    """Causal 64 x 64 tiles of one head of an ``n``-token prompt (the tile model's unit)."""
    nt = -(-n // COST_TILE)
    return nt * (nt + 1) // 2


def attention_key(pattern: Pattern) -> str:
    """Cost-table key of ``pattern``'s kernel: ``dense``, ``a_shape``, ``vertical_slash`` or
    ``block_sparse@<block>`` (block-sparse tiles cost differently per block size)."""
    if isinstance(pattern, BlockSparse):
        return f"block_sparse@{pattern.block}"
    return pattern.kind


def index_key(pattern: Pattern) -> str | None:
    """Cost-table key of ``pattern``'s online index build (``None``: A-shape and dense build none):
    ``vertical_slash:<rule>`` or ``block_sparse:<estimate>:<rule>@<block>``, the estimate written
    ``query/<r>`` when ``r`` scoring rows (``score_rows``) score each block."""
    if isinstance(pattern, VerticalSlash):
        return f"vertical_slash:{pattern.rule}"
    if isinstance(pattern, BlockSparse):
        estimate = pattern.estimate + (f"/{pattern.score_rows}" if pattern.score_rows else "")
        return f"block_sparse:{estimate}:{pattern.rule}@{pattern.block}"
    return None


def fit_line(tiles: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``ms = intercept + slope * tiles`` with ``intercept >= 0`` and ``slope >= 0``
    (refit through the origin when the free fit's intercept is negative, as a constant, the mean
    time, when its slope is: timing noise over tile counts too close to tell apart, as in the
    interpreter at tiny lengths, must not price a tile below nothing; one point: through the
    origin)."""
    if len(tiles) != len(ms) or not tiles:
        raise FrontierError(f"fit_line needs as many times as tile counts (at least one), got {len(tiles)} "
                            f"and {len(ms)}")
    t = torch.tensor(tiles, dtype=torch.float64)
    y = torch.tensor(ms, dtype=torch.float64)
    if len(tiles) > 1 and float(t.var()) > 0:
        slope = float(((t - t.mean()) * (y - y.mean())).sum() / ((t - t.mean()) ** 2).sum())
        intercept = float(y.mean() - slope * t.mean())
        if slope < 0:
            return float(y.mean()), 0.0
        if intercept >= 0:
            return intercept, slope
    return 0.0, float((t * y).sum() / (t * t).sum())


@dataclass
class CostModel:
    """Modelled time of one head in one layer, per pattern, at one length.

    Attributes:
        unit: ``"ms"`` (a calibrated table) or ``"dense_tiles"`` (the proxy: one head's causal
            tiles weighted by :data:`~minference.app.search.TILE_COST`; a dense head costs
            ``TILE_COST[dense]``).
        attention: :func:`attention_key` -> ``(intercept, per_tile)``: one call over
            ``num_heads`` heads costs ``intercept + per_tile * tiles`` (tiles summed over heads).
        index: :func:`index_key` -> the index build of one call over ``num_heads`` heads.
        num_heads, num_kv_heads, head_dim, n_tokens: the calibrated shape.
        source: where the figures come from (a table's path, or ``"tile proxy"``).
        provenance: the table's provenance (GPU, versions, date).
    """

    unit: str
    attention: dict[str, tuple[float, float]]
    index: dict[str, float]
    num_heads: int
    head_dim: int
    n_tokens: int
    num_kv_heads: int | None = None
    source: str = ""
    provenance: dict = field(default_factory=dict)

    @classmethod
    def proxy(cls, head_dim: int, n_tokens: int, num_heads: int = 1) -> CostModel:
        """The tile-count proxy (no calibration): each kind's tiles times its ``TILE_COST`` at
        ``head_dim``, and :data:`INDEX_PROXY` of a dense head per index build. The proxy's cost
        is linear in tiles at every length, so any ``n_tokens`` may use it."""
        per = 1.0 / causal_tiles(n_tokens)
        attention = {k: (0.0, tile_cost(k, head_dim) * per) for k in ("dense", "a_shape", "vertical_slash")}
        for block in (16, 32, 64, 128):
            attention[f"block_sparse@{block}"] = (0.0, tile_cost("block_sparse", head_dim) * per)
        dense_head = tile_cost("dense", head_dim)
        index = {}
        for rule in ("top_k", "mass", "relative"):
            index[f"vertical_slash:{rule}"] = INDEX_PROXY["vertical_slash"] * dense_head * num_heads
            for est in ("pooled", "query"):
                for block in (16, 32, 64, 128):
                    index[f"block_sparse:{est}:{rule}@{block}"] = INDEX_PROXY["block_sparse"] * dense_head * num_heads
        return cls("dense_tiles", attention, index, num_heads, head_dim, n_tokens, source="tile proxy")

    @property
    def calibrated(self) -> bool:
        return self.unit == "ms"

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> CostModel:
        """Read a cost table (the JSON ``benchmarks/calibrate_costs.py`` writes)."""
        if not isinstance(data, dict) or data.get("format") != COST_TABLE_FORMAT:
            raise FrontierError(f"{source or 'cost table'}: not a cost table (format "
                                f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r})")
        if data.get("version") != COST_TABLE_VERSION:
            raise FrontierError(f"{source}: cost table version {data.get('version')!r}, this code reads "
                                f"{COST_TABLE_VERSION}")
        try:
            shape = data["shape"]
            attention = {k: (float(v["intercept_ms"]), float(v["ms_per_tile"])) for k, v in data["attention"].items()}
            index = {k: float(v["ms"]) for k, v in data["index"].items()}
            model = cls("ms", attention, index, int(shape["num_heads"]), int(shape["head_dim"]),
                        int(shape["n_tokens"]), shape.get("num_kv_heads"), source, dict(data.get("provenance", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise FrontierError(f"{source or 'cost table'}: malformed ({type(err).__name__}: {err})") from None
        bad = [k for k, (a, b) in attention.items() if not (math.isfinite(a + b) and a >= 0 and b >= 0)]
        bad += [k for k, v in index.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise FrontierError(f"{source}: costs must be finite and >= 0, not at {bad}")
        return model

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise FrontierError(f"cannot read cost table {path}: {err}") from None
        return cls.from_dict(data, source=str(path))

    def check(self, candidates: Sequence[Pattern], *, head_dim: int, num_heads: int, n_tokens: int) -> None:
        """Raise :class:`FrontierError` unless this model covers ``candidates`` at that shape."""
        if self.head_dim != head_dim or self.num_heads != num_heads:
            raise FrontierError(f"cost table {self.source} is for head dim {self.head_dim} and {self.num_heads} query "
                                f"heads; the model has {head_dim} and {num_heads}")
        if self.calibrated and abs(n_tokens - self.n_tokens) > COST_LENGTH_TOLERANCE * self.n_tokens:
            raise FrontierError(f"cost table {self.source} was measured at {self.n_tokens} tokens; the search runs at "
                                f"{n_tokens} (more than {COST_LENGTH_TOLERANCE:.0%} apart): calibrate at the target "
                                "length")
        missing = sorted({k for c in candidates for k in (attention_key(c), index_key(c))
                          if k is not None and k not in self.attention and k not in self.index})
        if missing:
            raise FrontierError(f"cost table {self.source} has no figure for {missing} (it has attention "
                                f"{sorted(self.attention)}, index {sorted(self.index)})")

    def head_cost(self, pattern: Pattern, tiles: torch.Tensor | float, n: int) -> torch.Tensor:
        """Modelled cost of heads that run ``pattern`` over ``tiles`` (fractions of the causal
        tiles of an ``n``-token prompt, any shape): attention plus index, each call's intercept
        and index build shared by its ``num_heads`` heads."""
        intercept, per_tile = self.attention[attention_key(pattern)]
        key = index_key(pattern)
        index = 0.0 if key is None else self.index[key]
        t = torch.as_tensor(tiles, dtype=torch.float64)
        return (intercept + index) / self.num_heads + per_tile * t * causal_tiles(n)


# ---------------------------------------------------------------------------------------------
# Per-head options.


@dataclass
class HeadOptions:
    """Every (layer, head)'s candidates with their modelled cost and error.

    Attributes:
        candidates: the patterns, in column order (the last may be :class:`Dense`, appended).
        cost: ``[L, H, C]`` modelled cost (``unit``) of each head under each candidate.
        error: ``[L, H, C]`` the ``proxy``'s error, mean over the calibration prompts: missed
            attention mass (``"mass"``) or relative output error (``"output"``).
        worst_error: ``[L, H, C]`` that error on the worst calibration prompt.
        worst_cost: ``[L, H, C]`` cost on a flat-score input (adaptive rules at their cap) or
            on the costliest calibration prompt, whichever is more.
        mass, density: ``[L, H, C]`` mean captured mass and logical density (for provenance).
        allowed: ``[L, H, C]`` bool: the candidates the allocation may pick.
        unit: the cost unit; n_tokens: the length.
        proxy: the error's kind, a key of :data:`PROXIES`.
        floor: the per-head floor ``allowed`` holds: no candidate whose captured mass on the
            worst calibration prompt is below it (0: none).
    """

    candidates: list[Pattern]
    cost: torch.Tensor
    error: torch.Tensor
    worst_error: torch.Tensor
    worst_cost: torch.Tensor
    mass: torch.Tensor
    density: torch.Tensor
    allowed: torch.Tensor
    unit: str
    n_tokens: int
    proxy: str = "mass"
    floor: float = 0.0

    @property
    def heads(self) -> int:
        return self.cost.shape[0] * self.cost.shape[1]

    def dense_index(self) -> int:
        return self.candidates.index(Dense())

    def totals(self, choice: torch.Tensor) -> tuple[float, float, float]:
        """``(cost, error, worst)`` summed over heads for ``choice [L, H]`` (candidate indices)."""
        pick = choice.long()[..., None]
        cost, error, worst = (float(x.gather(-1, pick).sum()) for x in (self.cost, self.error, self.worst_cost))
        return cost, error, worst


def _search_shape(result: SearchResult) -> tuple[int, int]:
    """``(n_tokens, head_dim)`` of the search, which the frontier's costs are computed at."""
    if result.n_tokens is None:
        raise FrontierError("the frontier needs a search() result with per-prompt tiles and masses")
    head_dim = result.head_dim or result.config.model.head_dim
    if head_dim is None:
        raise FrontierError("the frontier needs the model's head dim (neither the search result nor its config "
                            "records one)")
    return result.n_tokens, head_dim


def check_proxy(proxy: str, result: SearchResult | None = None) -> None:
    """Raise :class:`FrontierError` unless ``proxy`` is one of :data:`PROXIES` that ``result`` (when
    given) measured: ``"output"`` needs its output errors."""
    if proxy not in PROXIES:
        raise FrontierError(f"the error proxy must be one of {sorted(PROXIES)}, got {proxy!r}")
    if proxy == "output" and result is not None and (result.out_error is None or result.worst_out_error is None):
        raise FrontierError("the output-error proxy needs measurements with the output error (this search has "
                            "none: measured before the search recorded it); use the mass proxy or search again")


def _proxy_errors(result: SearchResult, proxy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(error, worst_error)`` ``[L, H, C]`` of the search's candidates under ``proxy``."""
    check_proxy(proxy, result)
    if proxy == "output":
        assert result.out_error is not None and result.worst_out_error is not None  # checked
        return result.out_error.to(torch.float64), result.worst_out_error.to(torch.float64)
    assert result.worst_mass is not None  # head_options checks it
    return (1 - result.mass).clamp(min=0), (1 - result.worst_mass).clamp(min=0)


def head_options(result: SearchResult, cost_model: CostModel, *, min_mass: float = 0.0,
                 proxy: str = "mass") -> HeadOptions:
    """The per-head options of a search (its candidates, plus :class:`Dense` when missing), costed
    by ``cost_model``, their error the ``proxy``'s (:data:`PROXIES`: missed mass, or the measured
    relative output error). ``min_mass``: a candidate whose captured mass on the worst calibration
    prompt is below this is not allowed (dense always is)."""
    if result.tiles is None or result.max_tiles is None or result.worst_mass is None or result.n_tokens is None:
        raise FrontierError("the frontier needs a search() result with per-prompt tiles and masses")
    if not 0 <= min_mass <= 1:
        raise FrontierError(f"min_mass must lie in [0, 1], got {min_mass!r}")
    n, head_dim = _search_shape(result)
    error, worst_error = _proxy_errors(result, proxy)
    cands = list(result.candidates)
    mass, worst_mass, density = result.mass, result.worst_mass, result.density
    tiles, max_tiles = result.tiles, result.max_tiles
    if Dense() not in cands:
        cands.append(Dense())
        ones = torch.ones(*mass.shape[:2], 1, dtype=torch.float64)
        mass, worst_mass, density, tiles, max_tiles = (torch.cat([x, ones], -1) for x in
                                                       (mass, worst_mass, density, tiles, max_tiles))
        error, worst_error = (torch.cat([x, torch.zeros_like(ones)], -1) for x in (error, worst_error))
    sig = result.config.model
    cost_model.check(cands, head_dim=head_dim, num_heads=sig.num_heads, n_tokens=n)
    cost = torch.stack([cost_model.head_cost(c, tiles[..., i], n) for i, c in enumerate(cands)], -1)
    worst_tiles = torch.stack([torch.clamp(max_tiles[..., i], min=flat_tiles(c, n)) if is_adaptive(c)
                               else max_tiles[..., i] for i, c in enumerate(cands)], -1)
    worst_cost = torch.stack([cost_model.head_cost(c, worst_tiles[..., i], n) for i, c in enumerate(cands)], -1)
    allowed = worst_mass >= min_mass
    allowed[..., cands.index(Dense())] = True
    bad = allowed & ~(torch.isfinite(error) & torch.isfinite(worst_error))
    if bad.any():
        layer, head, c = (int(x) for x in bad.nonzero()[0])
        raise FrontierError(f"the {proxy} error of {cands[c]} at layer {layer}, head {head} is not finite "
                            f"({int(bad.sum())} such entries): the measurements are corrupt")
    return HeadOptions(cands, cost, error, worst_error, worst_cost, mass, density, allowed, cost_model.unit, n, proxy,
                       float(min_mass))


# ---------------------------------------------------------------------------------------------
# Allocation.


@dataclass
class Allocation:
    """One assignment of a candidate to every head.

    Attributes:
        choice: ``[L, H]`` candidate index per (layer, head).
        cost, error, worst: totals over heads (modelled cost, the proxy's error, flat-score cost).
        lam: the Lagrange multiplier of the error (cost saved per unit of error at the last step).
        mu: the worst-case multiplier (0: the constraint was not binding).
    """

    choice: torch.Tensor
    cost: float
    error: float
    worst: float
    lam: float = 0.0
    mu: float = 0.0


@dataclass
class _Path:
    """A Lagrangian path: ``start [M]`` then steps ``(heads[s], choices[s])``; ``cost``, ``error``,
    ``worst`` ``[S + 1]`` are the totals after each prefix, ``rate [S]`` each step's λ."""

    start: torch.Tensor
    heads: torch.Tensor
    choices: torch.Tensor
    cost: torch.Tensor
    error: torch.Tensor
    worst: torch.Tensor
    rate: torch.Tensor

    def choice(self, k: int) -> torch.Tensor:
        """``[M]`` the assignment after the first ``k`` steps (a head's steps run in hull order)."""
        out = self.start.clone()
        for m, q in zip(self.heads[:k].tolist(), self.choices[:k].tolist()):
            out[m] = q
        return out


def _hull(cost: list[float], error: list[float], allowed: list[bool]) -> list[int]:
    """Indices on the lower convex hull of one head's ``(error, cost)`` options, from the least
    error (least cost among equals) to the least cost: error increases, cost decreases."""
    order = sorted((i for i in range(len(cost)) if allowed[i]), key=lambda i: (error[i], cost[i], i))
    pts: list[int] = []
    for i in order:  # drop dominated options: a larger error must buy a smaller cost
        if not pts or cost[i] < cost[pts[-1]]:
            pts.append(i)
    hull: list[int] = []
    for i in pts:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the chord a-i (slope a->b shallower than b->i): not on the lower hull
            if (cost[b] - cost[a]) * (error[i] - error[b]) > (cost[i] - cost[b]) * (error[b] - error[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def lagrangian_path(cost: torch.Tensor, error: torch.Tensor, allowed: torch.Tensor, *,
                    worst: torch.Tensor | None = None, objective: torch.Tensor | None = None) -> _Path:
    """The exact Lagrangian path of the multiple-choice knapsack ``min sum cost s.t. sum error
    <= E`` over heads (rows of ``[M, C]`` tensors). Start: every head at its least-error option;
    then every head's hull segment, in decreasing order of cost saved per error added. Each
    prefix minimises ``objective + λ error`` over all assignments for its λ (the step's rate), so
    no assignment of at most its error has a smaller objective. ``objective`` (default ``cost``)
    is what the hulls are built on; the path's totals are always of ``cost``, ``error`` and
    ``worst`` (default ``cost``)."""
    M, C = cost.shape
    obj = cost if objective is None else objective
    worst = cost if worst is None else worst
    start = torch.zeros(M, dtype=torch.long)
    segments: list[tuple[float, int, int, int]] = []  # (-rate, head, order on the head's hull, to)
    o, e, a = obj.tolist(), error.tolist(), allowed.tolist()
    for m in range(M):
        if not any(a[m]):
            raise FrontierError(f"head {m} has no allowed option")
        hull = _hull(o[m], e[m], a[m])
        start[m] = hull[0]
        rate = math.inf
        for j in range(len(hull) - 1):
            p, q = hull[j], hull[j + 1]
            # non-increasing along the hull; the min keeps collinear steps in order despite rounding
            rate = min(rate, (o[m][p] - o[m][q]) / (e[m][q] - e[m][p]))
            segments.append((-rate, m, j, q))
    segments.sort()
    heads = torch.tensor([s[1] for s in segments], dtype=torch.long)
    choices = torch.tensor([s[3] for s in segments], dtype=torch.long)
    prev = start.clone()
    d_cost, d_err, d_worst = [], [], []
    for m, q in zip(heads.tolist(), choices.tolist()):
        p = int(prev[m])
        d_cost.append(float(cost[m, q] - cost[m, p]))
        d_err.append(float(error[m, q] - error[m, p]))
        d_worst.append(float(worst[m, q] - worst[m, p]))
        prev[m] = q

    def totals(x: torch.Tensor, deltas: list[float]) -> torch.Tensor:
        first = float(x.gather(1, start[:, None]).sum())
        return torch.cumsum(torch.tensor([first] + deltas, dtype=torch.float64), 0)

    rates = torch.tensor([-s[0] for s in segments], dtype=torch.float64)
    return _Path(start, heads, choices, totals(cost, d_cost), totals(error, d_err), totals(worst, d_worst), rates)


def _check_budget(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FrontierError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_worst_ratio(worst_ratio: float | None) -> float | None:
    """``worst_ratio`` as a float (``None``: no worst-case bound); a ratio must be finite and >= 1."""
    if worst_ratio is None:
        return None
    if _check_budget("worst_ratio", worst_ratio) < 1:
        raise FrontierError(f"worst_ratio must be >= 1, got {worst_ratio!r}")
    return float(worst_ratio)


def _paths(options: HeadOptions, worst_ratio: float | None) -> list[tuple[float, _Path]]:
    """``(μ, path)`` for each worst-case multiplier tried (one unconstrained path without a ratio).
    With a ratio ``R``, the last is ``μ = ∞``: the worst-case slack ``worst - R cost`` alone, whose
    start (every head at its least error) has the least slack of the least-error assignments, so
    it meets the bound whenever one of them does (all-dense always does)."""
    M = options.heads
    cost = options.cost.reshape(M, -1)
    error = options.error.reshape(M, -1)
    worst = options.worst_cost.reshape(M, -1)
    allowed = options.allowed.reshape(M, -1)
    out = []
    for t in (MU_GRID if worst_ratio is not None else (0.0,)):
        mu = t / worst_ratio if worst_ratio is not None else 0.0
        # the penalty mu * (worst - R cost) rescaled so the cost keeps weight 1
        objective = cost if worst_ratio is None or mu == 0 else cost + mu / (1 - mu * worst_ratio) * worst
        out.append((mu, lagrangian_path(cost, error, allowed, worst=worst, objective=objective)))
    if worst_ratio is not None:
        out.append((math.inf, lagrangian_path(cost, error, allowed, worst=worst, objective=worst - worst_ratio * cost)))
    return out


def allocate(options: HeadOptions, budget: float, *, worst_ratio: float | None = None, fixed: float = 0.0,
             _paths_cache: list | None = None) -> Allocation:
    """The cheapest assignment on the Lagrangian paths whose mean error per head (missed mass or
    output error: ``options.proxy``) is at most ``budget`` and, with ``worst_ratio`` ``R``, whose
    flat-score worst case keeps ``fixed + worst <= R * (fixed + cost)`` (``fixed``: the model's
    time outside attention, in the cost unit).

    Without ``worst_ratio`` the result minimises the cost over every assignment of at most its
    own error (exact), and is at most one head's step costlier than the knapsack optimum at
    ``budget``. With it, the multiplier ``μ`` of the worst-case constraint is searched on
    :data:`MU_GRID`; the result then minimises the cost over the assignments of at most its
    error and its worst-case slack. The last path, ``μ = ∞``, minimises the slack alone: an
    assignment is found whenever one of the least error meets the bound (all-dense does).

    Raises:
        FrontierError: bad arguments, or no assignment on the paths satisfies both constraints.
    """
    budget = _check_budget("budget", budget)
    fixed = _check_budget("fixed", fixed)
    worst_ratio = _check_worst_ratio(worst_ratio)
    M = options.heads
    limit = budget * M + BUDGET_EPS * max(1, M)
    best: tuple | None = None
    for mu, path in (_paths_cache if _paths_cache is not None else _paths(options, worst_ratio)):
        ok = path.error <= limit
        if worst_ratio is not None:
            ok &= fixed + path.worst <= worst_ratio * (fixed + path.cost) + BUDGET_EPS * max(1.0, float(path.cost[0]))
        if not bool(ok.any()):
            continue
        costs = torch.where(ok, path.cost, torch.full_like(path.cost, math.inf))
        k = int(torch.argmin(costs))  # the first (least error) of equal costs
        key = (float(path.cost[k]), float(path.error[k]), mu)
        if best is None or key < best[0]:
            best = (key, mu, path, k)
    if best is None:
        bound = ("" if worst_ratio is None else
                 f" and a flat-score worst case within {worst_ratio:g}x the modelled prefill")
        raise FrontierError(f"no assignment has {PROXIES[options.proxy]} <= {budget:g}{bound}")
    _, mu, path, k = best
    L, H = options.cost.shape[:2]
    lam = float(path.rate[k - 1]) if k else math.inf
    return Allocation(path.choice(k).reshape(L, H), float(path.cost[k]), float(path.error[k]), float(path.worst[k]),
                      lam, mu)


# ---------------------------------------------------------------------------------------------
# The family of configs.


@dataclass
class FrontierPoint:
    """One config of the family: its budget, allocation and config (``path`` once written)."""

    budget: float
    allocation: Allocation
    config: PatternConfig
    path: str | None = None


def _notes(options: HeadOptions, point: Allocation, budget: float, cost_source: str, worst_ratio, fixed: float,
           base_notes: str | None) -> str:
    M = options.heads
    ratio = "none" if worst_ratio is None else f"{worst_ratio:g}"
    meaning = PROXIES[options.proxy]
    floor = f"; head floor {options.floor:g} (captured mass on the worst prompt)" if options.floor else ""
    return (f"frontier point: error budget {budget:g} ({meaning}; error proxy {options.proxy}{floor}); predicted cost "
            f"{point.cost:.6g} {options.unit} (attention + index, summed over layers and heads; {cost_source}); "
            f"predicted error {point.error / M:.6g} ({meaning}); flat-score worst case "
            f"{point.worst:.6g} {options.unit}; worst ratio {ratio} with fixed {fixed:g} {options.unit}; "
            f"lambda {point.lam:.6g}, mu {point.mu:.6g}; length {options.n_tokens}. Search: {base_notes or ''}")


def frontier_family(result: SearchResult, options: HeadOptions, budgets: Sequence[float], *,
                    worst_ratio: float | None = DEFAULT_WORST_RATIO, fixed: float = 0.0,
                    cost_source: str = "") -> list[FrontierPoint]:
    """One config per error budget (mean error per head of ``options.proxy``), each allocated by
    :func:`allocate` from ``options``; provenance as the search's, with the chosen heads' masses
    and densities and the budget, error proxy, predicted cost, error and worst case in the notes."""
    if not budgets:
        raise FrontierError("budgets must hold at least one error budget")
    for b in budgets:
        _check_budget("budget", b)
    paths = _paths(options, _check_worst_ratio(worst_ratio))
    base = result.config.provenance
    points = []
    for b in budgets:
        alloc = allocate(options, b, worst_ratio=worst_ratio, fixed=fixed, _paths_cache=paths)
        layers = [[options.candidates[int(c)] for c in row] for row in alloc.choice]
        pick = alloc.choice[..., None]
        scores = options.mass.gather(-1, pick)[..., 0].tolist()
        dens = options.density.gather(-1, pick)[..., 0].tolist()
        provenance = dataclasses.replace(
            base, scores=[[round(x, 6) for x in row] for row in scores],
            densities=[[round(x, 6) for x in row] for row in dens], target_density=None,
            notes=_notes(options, alloc, b, cost_source, worst_ratio, fixed, base.notes))
        points.append(FrontierPoint(b, alloc, PatternConfig(result.config.model, layers, provenance)))
    return points


def _rule_choice(options: HeadOptions, config: PatternConfig) -> torch.Tensor:
    return torch.tensor([[options.candidates.index(p) for p in row] for row in config.layers], dtype=torch.long)


def frontier_summary(result: SearchResult, options: HeadOptions, points: Sequence[FrontierPoint], *,
                     worst_ratio: float | None, fixed: float, cost_source: str,
                     rule_masses: Sequence[float] = (0.85, 0.9, 0.95), curve_points: int = 200) -> dict:
    """Plain-JSON summary of a family: its error proxy; every point's budget, predicted cost (and
    modelled prefill ``fixed + cost``, speed-up over all-dense), error, worst case and pattern counts; the
    unconstrained Lagrangian curve; and for comparison the per-head rule of earlier searches
    (cheapest candidate whose worst prompt keeps ``min_mass``) at ``rule_masses``."""
    M = options.heads
    dense = torch.full(options.cost.shape[:2], options.dense_index(), dtype=torch.long)
    dense_cost = options.totals(dense)[0]

    def entry(choice: torch.Tensor, cost: float, error: float, worst: float) -> dict:
        counts = {k: 0 for k in ("a_shape", "vertical_slash", "block_sparse", "dense")}
        for c in choice.flatten().tolist():
            counts[options.candidates[c].kind] += 1
        speedup = (fixed + dense_cost) / (fixed + cost) if fixed + cost else None
        return {"cost": cost, "error": error / M, "worst": worst, "prefill": fixed + cost,
                "worst_prefill": fixed + worst, "speedup": speedup, "counts": counts}

    out_points = []
    for p in points:
        a = p.allocation
        out_points.append({"budget": p.budget, "config": p.path, **entry(a.choice, a.cost, a.error, a.worst),
                           "lambda": a.lam, "mu": a.mu})
    path = lagrangian_path(options.cost.reshape(M, -1), options.error.reshape(M, -1), options.allowed.reshape(M, -1),
                           worst=options.worst_cost.reshape(M, -1))
    keep = torch.unique(torch.linspace(0, len(path.cost) - 1, min(curve_points, len(path.cost))).round().long())
    rules = []
    if result.worst_mass is not None and result.cost is not None:
        for m in rule_masses:
            choice = _rule_choice(options, result.rechoose(m, "cheapest"))
            rules.append({"min_mass": m, **entry(choice, *options.totals(choice))})
    sig = result.config.model
    return {"format": FRONTIER_FORMAT, "version": FRONTIER_VERSION, "model": dataclasses.asdict(sig),
            "n_tokens": options.n_tokens, "unit": options.unit, "cost_source": cost_source, "fixed": fixed,
            "proxy": options.proxy, "floor": options.floor,
            "worst_ratio": worst_ratio, "heads": M, "dense_cost": dense_cost,
            "candidates": [repr(c) for c in options.candidates], "points": out_points, "rules": rules,
            "curve": {"error": (path.error[keep] / M).tolist(), "cost": path.cost[keep].tolist(),
                      "worst": path.worst[keep].tolist()}}


def summary_proxy(summary: dict) -> str:
    """The error proxy a :func:`frontier_summary` was allocated on (summaries written before the
    output proxy existed hold none: they are of the missed mass)."""
    return summary.get("proxy", "mass")


def format_summary(summary: dict) -> str:
    """Markdown table of a :func:`frontier_summary`."""
    u = summary["unit"]
    proxy = summary_proxy(summary)
    floor = f" (head floor {summary['floor']:g})" if summary.get("floor") else ""
    lines = [f"## Frontier: {summary['model']['model_id']} at {summary['n_tokens']} tokens", "",
             f"error proxy {proxy}{floor}; cost unit {u} ({summary['cost_source']}); fixed (outside attention) "
             f"{summary['fixed']:g}; worst ratio {summary['worst_ratio']}; all-dense cost {summary['dense_cost']:.4g}; "
             f"{summary['heads']} heads", "",
             "| config | budget | predicted error | cost | prefill | × all-dense | flat-score worst prefill | "
             "A / VS / BS / dense |", "|---|---|---|---|---|---|---|---|"]

    def row(name: str, budget: str, p: dict) -> str:
        c = p["counts"]
        speed = "-" if p["speedup"] is None else f"{p['speedup']:.2f}"
        return (f"| {name} | {budget} | {p['error']:.4f} | {p['cost']:.4g} | {p['prefill']:.4g} | {speed} | "
                f"{p['worst_prefill']:.4g} | {c['a_shape']} / {c['vertical_slash']} / {c['block_sparse']} / "
                f"{c['dense']} |")

    for p in summary["points"]:
        lines.append(row(Path(p["config"]).name if p["config"] else "-", f"{p['budget']:g}", p))
    for r in summary["rules"]:
        lines.append(row(f"rule min_mass {r['min_mass']:g}", "-", r))
    lines += ["", f"predicted error: {PROXIES[proxy]} on the calibration prompts; cost: modelled "
              "attention + index summed over layers and heads; prefill: fixed + cost; flat-score worst: every "
              "adaptive head at its cap. Rule rows: the per-head min-mass rule of earlier searches, for comparison."]
    return "\n".join(lines)


def check_family_args(args, signature=None, *, candidates: Sequence[Pattern] | None = None,
                      n_tokens: int | None = None) -> str | None:
    """What is wrong with ``minference search --frontier`` arguments (``None``: nothing), checked
    before the slow work: budgets, ``{budget}`` in ``--out``, the ratio, ``--fixed-ms`` without a
    cost table, and the cost table itself (readable, covering the candidates at ``--tokens``;
    with the model's ``signature`` also its head dim and head count). ``candidates``: the search's
    (``--candidates``; ``None``: its budgeted default), or those of saved measurements
    (``--from-measurements``, with their ``n_tokens`` instead of ``--tokens``)."""
    from minference.app import search as S

    if "{budget}" not in args.out:
        return "--frontier writes one config per budget: --out must hold '{budget}'"
    proxy = getattr(args, "proxy", "mass")
    if proxy not in PROXIES:
        return f"--proxy must be one of {sorted(PROXIES)}, got {proxy!r}"
    if not args.frontier or any(not (math.isfinite(b) and 0 <= b <= 1) for b in args.frontier):
        return f"--frontier budgets ({PROXIES[proxy]}) must lie in [0, 1], got {args.frontier}"
    if args.worst_ratio is not None and not (math.isfinite(args.worst_ratio) and args.worst_ratio >= 1):
        return f"--worst-ratio must be >= 1, got {args.worst_ratio}"
    if not (math.isfinite(args.fixed_ms) and args.fixed_ms >= 0):
        return f"--fixed-ms must be >= 0, got {args.fixed_ms}"
    if args.fixed_ms and not args.cost_table:
        return "--fixed-ms is in ms: it needs a calibrated --cost-table (the proxy's unit is tiles)"
    if not args.cost_table:
        return None
    try:
        model = CostModel.load(args.cost_table)
        n = args.tokens if n_tokens is None else n_tokens
        if candidates is not None:
            cands = list(candidates)
        else:  # the search's own default: budgeted candidates at the target density
            cands = S.candidate_patterns(n, args.target_density or S.DEFAULT_TARGET_DENSITY)
        cands = [*cands, Dense()]
        if signature is None:
            model.check(cands, head_dim=model.head_dim, num_heads=model.num_heads, n_tokens=n)
        else:
            model.check(cands, head_dim=signature.head_dim, num_heads=signature.num_heads, n_tokens=n)
    except FrontierError as err:
        return str(err)
    return None


def family_config_path(out: str, budget: float) -> str:
    """Where :func:`write_family` writes the config of ``budget``: ``out`` with ``{budget}`` filled."""
    return out.replace("{budget}", f"{budget:g}")


def family_summary_stem(out: str) -> str:
    """The summary's path without its extension (``.json``, ``.md``, ``.png``): ``out`` with
    ``{budget}`` replaced by ``frontier``, less a ``.json`` ending."""
    stem = out.replace("{budget}", "frontier")
    return stem[: -len(".json")] if stem.endswith(".json") else stem


def write_family(result: SearchResult, budgets: Sequence[float], out: str, *, cost_table: str | None = None,
                 worst_ratio: float | None = DEFAULT_WORST_RATIO, fixed: float = 0.0, floor: float = 0.0,
                 proxy: str = "mass", stream: TextIO | None = None) -> tuple[list[FrontierPoint], dict]:
    """Write one config per budget (``out`` with ``{budget}`` replaced by the budget) and the
    summary (``{budget}`` replaced by ``frontier``: ``.json``, ``.md``, ``.png`` when matplotlib
    is installed), allocated on the error ``proxy`` (:data:`PROXIES`); ``floor``: no head takes a
    candidate that keeps less of the mass on its worst calibration prompt (:func:`head_options`'
    ``min_mass``)."""
    if "{budget}" not in out:
        raise FrontierError("a frontier family needs '{budget}' in the output path")
    check_proxy(proxy, result)
    n, head_dim = _search_shape(result)  # before the tile proxy, which needs both
    model = CostModel.load(cost_table) if cost_table else CostModel.proxy(head_dim, n, result.config.model.num_heads)
    if fixed and not model.calibrated:
        raise FrontierError("a fixed time outside attention is in ms: it needs a calibrated --cost-table")
    options = head_options(result, model, min_mass=floor, proxy=proxy)
    points = frontier_family(result, options, budgets, worst_ratio=worst_ratio, fixed=fixed, cost_source=model.source)
    for p in points:
        p.path = family_config_path(out, p.budget)
        p.config.save(p.path)
        if stream is not None:
            print(f"wrote {p.path}: {p.config.counts()}, predicted cost {p.allocation.cost:.4g} {model.unit}, "
                  f"error {p.allocation.error / options.heads:.4g} ({proxy})", file=stream)
    summary = frontier_summary(result, options, points, worst_ratio=worst_ratio, fixed=fixed, cost_source=model.source)
    stem = family_summary_stem(out)
    Path(stem + ".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    Path(stem + ".md").write_text(format_summary(summary) + "\n", encoding="utf-8")
    written = [stem + ".json", stem + ".md"]
    try:
        from minference.app.plots import plot_search_frontier

        plot_search_frontier(summary, stem + ".png")
        written.append(stem + ".png")
    except ImportError:
        pass
    if stream is not None:
        print(f"wrote {', '.join(written)}", file=stream)
    return points, summary


# ---------------------------------------------------------------------------------------------
# The frontier in eval: TTFT statistics and the ship rule.


@dataclass(frozen=True)
class TTFTStats:
    """Median and worst TTFT (ms) of one (config, length) and how many prefills they cover."""

    median_ms: float
    max_ms: float
    count: int


def ttft_stats(report, config: str, n_tokens: int) -> TTFTStats | None:
    """TTFT of ``config`` at ``n_tokens`` in an eval report: median and max over its timed
    prefills, ``None`` when none was timed. The one place that reads them: from the report's
    ``ttft_summary()`` row of task ``"all"`` (every timed prompt of the (config, length), the
    ``ruler`` branch's per-task TTFT) where the report has one, else from ``RunStats.ttft_s``
    (one timed prefill per sample)."""
    summary = getattr(report, "ttft_summary", None)
    if callable(summary):
        row = next((t for t in summary() if (t["config"], t["task"], t["n_tokens"]) == (config, "all", n_tokens)),
                   None)
        if row is not None and row.get("ttft_median_ms") is not None:
            return TTFTStats(float(row["ttft_median_ms"]), float(row["ttft_max_ms"]), int(row["prompts"]))
    run = report.run(config, n_tokens)
    values = [t for t in (run.ttft_s if run is not None else []) if t is not None]
    if not values:
        return None
    return TTFTStats(statistics.median(values) * 1e3, max(values) * 1e3, len(values))


@dataclass
class ShipDecision:
    """What :func:`ship_choice` decided.

    Attributes:
        chosen: the config to ship (``None``: none passes; ship dense).
        length: the length whose median TTFT ranks the configs.
        dense: the dense baseline's name.
        ranking: ``(name, median ms)`` of every sparse config, fastest first.
        rejected: per config the rule's failures (empty list: passes); the configs faster than
            ``chosen`` all have some.
        nll: per config (dense included) the NLL at ``length`` the rule read (:func:`nll_pairs`:
            the report's own or a companion report's); configs without one are absent.
    """

    chosen: str | None
    length: int
    dense: str
    ranking: list[tuple[str, float | None]]
    rejected: dict[str, list[str]]
    nll: dict[str, float] = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"ship: {self.chosen or f'{self.dense} (no sparse config passes)'} (ranked by median TTFT at "
                 f"{self.length} tokens)"]
        for name, med in self.ranking:
            timing = "n/a" if med is None else f"{med:.1f} ms"
            if name == self.chosen:
                lines.append(f"  {name}: {timing}, passes")
                break
            lines.append(f"  {name}: {timing}, rejected: " + "; ".join(self.rejected[name]))
        return "\n".join(lines)


#: The ship rule's defaults (issue 32): samples per task cell, samples a cell may lose against
#: dense, NLL increase (nats), worst TTFT over median.
SHIP_MIN_SAMPLES = 10
SHIP_SAMPLE_SLACK = 1
SHIP_NLL_TOLERANCE = 0.02
SHIP_WORST_RATIO = 1.2
#: A companion report's NLL length stands for a report length within this share of it (RULER's
#: nominal 131072 holds prompts of 129,097-130,695 tokens; the NLL prompts ran at 130,000).
NLL_LENGTH_TOLERANCE = 0.03


@dataclass
class NLLPair:
    """A config's NLL at one length and its dense baseline's from the same run; ``source`` names a
    companion report it came from (``None``: the ranked report's own perplexity task)."""

    nll: float
    dense: float
    source: str | None = None


def _identity(c) -> str:
    """What makes two reports' configs the same config: its pattern data, not its name."""
    if c.dense:
        return "dense"
    if c.config is not None:
        return json.dumps({"model": c.config.get("model"), "layers": canonical_layers(c.config.get("layers"))},
                          sort_keys=True)
    return json.dumps(canonical_pattern_dict(c.pattern), sort_keys=True) if c.pattern is not None else f"spec:{c.spec}"


def nll_pairs(report, companions: Sequence = (), *, tolerance: float = NLL_LENGTH_TOLERANCE
              ) -> dict[tuple[str, int], NLLPair]:
    """``(config, length) -> NLLPair`` for ``report``: its own perplexity task where it ran (with
    its dense's), else a companion report's (an NLL run beside a RULER report, whose suite has no
    perplexity task). A companion's config stands for one of ``report``'s when their pattern data
    are equal (names may differ), at a companion length within ``tolerance`` of the report's; the
    dense NLL is the companion's own, so the difference holds across machines. The first companion
    that has a pair wins."""
    own = {(p["config"], p["n_tokens"]): p["nll"] for p in report.perplexity()}
    dense = next((c.name for c in report.configs if c.dense), None)
    out: dict[tuple[str, int], NLLPair] = {}
    for c in report.configs:
        for n in report.lengths:
            if (c.name, n) in own and (dense, n) in own:
                out[(c.name, n)] = NLLPair(own[(c.name, n)], own[(dense, n)])
    for comp in companions:
        theirs = {(p["config"], p["n_tokens"]): p["nll"] for p in comp.perplexity()}
        base = next((c.name for c in comp.configs if c.dense), None)
        names = {_identity(c): c.name for c in comp.configs}
        gpu = comp.machine.get("gpu") or comp.machine.get("hardware") or "?"
        for c in report.configs:
            other = names.get(_identity(c))
            if other is None:
                continue
            for n in report.lengths:
                m = next((m for m in comp.lengths if abs(m - n) <= tolerance * n
                          and (other, m) in theirs and (base, m) in theirs), None)
                if m is not None and (c.name, n) not in out:
                    out[(c.name, n)] = NLLPair(theirs[(other, m)], theirs[(base, m)],
                                               f"{other!r} of the NLL report at {m} tokens on {gpu}")
    return out


def _failures(report, name: str, dense: str, *, min_samples: int, slack: int, nll_tolerance: float,
              worst_ratio: float, nll: dict[tuple[str, int], NLLPair]) -> list[str]:
    acc = {(a["config"], a["task"], a["n_tokens"]): a for a in report.accuracy()}
    out = []
    for n in report.lengths:
        if report.run(dense, n) is None:
            out.append(f"dense not run at {n}: nothing to compare with")
            continue
        if report.run(name, n) is None:
            out.append(f"not run at {n}")
            continue
        for (cfg, task, length), d in acc.items():
            if cfg != dense or length != n:
                continue
            a = acc.get((name, task, n))
            if a is None:
                out.append(f"{task} at {n}: no samples")
            elif a["total"] < min_samples:
                out.append(f"{task} at {n}: {a['total']} samples < {min_samples}")
            elif a["total"] != d["total"]:
                out.append(f"{task} at {n}: {a['total']} samples, dense {d['total']}")
            elif a["correct"] < d["correct"] - slack:
                out.append(f"{task} at {n}: {a['correct']}/{a['total']} vs dense {d['correct']}/{d['total']} "
                           f"({d['correct'] - a['correct']} samples short)")
        pair = nll.get((name, n))
        if pair is None:
            out.append(f"NLL at {n}: not measured")
        elif not (pair.nll - pair.dense <= nll_tolerance + 1e-12):  # NaN fails
            out.append(f"NLL at {n}: {pair.nll:.3f} vs dense {pair.dense:.3f} (+{pair.nll - pair.dense:.3f} > "
                       f"+{nll_tolerance:g})" + (f", from {pair.source}" if pair.source else ""))
        t, td = ttft_stats(report, name, n), ttft_stats(report, dense, n)
        if t is None:
            out.append(f"TTFT at {n}: not timed")
            continue
        if t.count < min_samples:
            out.append(f"TTFT at {n}: {t.count} timed prefills < {min_samples}")
        if not (t.max_ms <= worst_ratio * t.median_ms):  # NaN fails
            out.append(f"TTFT at {n}: worst {t.max_ms:.1f} ms > {worst_ratio:g} x median {t.median_ms:.1f} ms")
        if td is None:
            out.append(f"TTFT at {n}: dense not timed")
        elif not (t.median_ms < td.median_ms):
            out.append(f"TTFT at {n}: median {t.median_ms:.1f} ms not faster than dense {td.median_ms:.1f} ms")
    return out


def ship_choice(reports, *, length: int | None = None, min_samples: int = SHIP_MIN_SAMPLES,
                sample_slack: int = SHIP_SAMPLE_SLACK, nll_tolerance: float = SHIP_NLL_TOLERANCE,
                worst_ratio: float = SHIP_WORST_RATIO, nll_reports: Sequence = ()) -> ShipDecision:
    """The config to ship from eval reports (several are merged by
    :func:`minference.app.evaluate.merge_reports`): the fastest sparse config (median TTFT at
    ``length``, default the longest; equal medians: lower NLL there, then name) that passes, at
    every length of the report: dense ran there (a length without dense fails every config; none
    at ``length`` raises); every generation task within ``sample_slack`` samples of dense on the
    same number of samples, at least ``min_samples``; NLL at most ``nll_tolerance`` above dense's
    (a NaN fails); at least ``min_samples`` timed prefills, worst TTFT at most ``worst_ratio``
    times their median, median below dense's (dense timed). NLL where the reports lack it comes
    from ``nll_reports`` (:func:`nll_pairs`: the same configs' NLL run)."""
    from minference.app.evaluate import EvalReport, merge_reports

    report = reports if isinstance(reports, EvalReport) else merge_reports(list(reports))
    dense = next((c.name for c in report.configs if c.dense), None)
    if dense is None:
        raise FrontierError("the ship rule compares with dense: the report has no dense config")
    if not report.lengths:
        raise FrontierError("the report has no lengths")
    at = max(report.lengths) if length is None else length
    if at not in report.lengths:
        raise FrontierError(f"length {at} is not in the report ({report.lengths})")
    if report.run(dense, at) is None:
        raise FrontierError(f"dense ({dense!r}) has no run at the ranking length {at}: nothing to compare with")
    nll = nll_pairs(report, nll_reports)
    ranking = []
    for c in report.configs:
        if c.dense:
            continue
        t = ttft_stats(report, c.name, at)
        ranking.append((c.name, None if t is None else t.median_ms))
    nll_at = {name: p.nll for (name, n), p in nll.items() if n == at}
    ranking.sort(key=lambda r: (math.inf if r[1] is None else r[1], nll_at.get(r[0], math.inf), r[0]))
    rejected = {name: _failures(report, name, dense, min_samples=min_samples, slack=sample_slack,
                                nll_tolerance=nll_tolerance, worst_ratio=worst_ratio, nll=nll)
                for name, _ in ranking}
    chosen = next((name for name, _ in ranking if not rejected[name]), None)
    return ShipDecision(chosen, at, dense, ranking, rejected, nll_at)


def _ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank (1 = the smallest), tied values sharing their ranks' mean."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start  # order[start..end]: one run of equal values
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_agreement(x: Sequence[float], y: Sequence[float]) -> float:
    """How alike two measurements order the same items (an error proxy and the damage measured,
    two prompts' per-head damage): the Spearman rank correlation of two equal-length sequences
    (tied values get their ranks' mean), +1 when both order the items alike, -1 when reversed, ~0
    when unrelated; NaN for fewer than 3 values or a constant sequence. ``ValueError`` when the
    lengths differ."""
    if len(x) != len(y):
        raise ValueError(f"rank agreement of sequences of different lengths ({len(x)} and {len(y)})")
    if len(x) < 3:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    mean = (len(x) + 1) / 2  # the mean rank of either
    sxy = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mean) ** 2 for a in rx), sum((b - mean) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
