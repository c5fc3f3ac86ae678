"""Pictures where a picture says more than a table (``minference show``).

* :func:`plot_config`: a layer x global-head grid of a :class:`~minference.config.PatternConfig`,
  coloured by pattern kind and annotated with each head's budget, with the per-layer expected
  density (and search score) from the provenance in a side panel when it was recorded.
* :func:`plot_search_frontier`: the predicted cost against the predicted error of a frontier
  search (:func:`minference.app.frontier.frontier_summary`): the Lagrangian curve, the family's
  configs with their flat-score worst case, and the per-head rule of earlier searches.
* :func:`plot_eval_frontier`: an eval report's median and worst TTFT against accuracy and NLL at
  one length, for dense, the frontier family, the uniform rules and other configs, with the
  config the ship rule picks (:func:`minference.app.frontier.ship_choice`) ringed.
* :func:`plot_head`: for one head, the dense causal attention map (log scale) next to the
  candidate set of a pattern (or an explicit mask), with the kept pairs in blue and the dense
  probability the set misses in red, plus the captured mass of every query. The candidate
  sets are the formulas of :mod:`minference.reference.masks`; for the dynamic patterns the
  index is the one the online builders of :mod:`minference.torch_backend` pick; captured mass
  and density are :mod:`minference.reference.metrics`.

matplotlib is optional (``pip install matplotlib``, or the ``plot`` extra): it is imported
inside the functions, so ``import minference`` and ``import minference.app.plots`` never need it.
Figures are drawn with :class:`matplotlib.figure.Figure` directly (no ``pyplot`` global state,
no display needed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from minference._checks import check_int, check_tensor, default_scale
from minference.dispatch import FILL_GAPS
from minference.patterns import AShape, BlockSparse, Dense, Pattern, VerticalSlash

__all__ = [
    "KIND_COLORS",
    "MATPLOTLIB_HINT",
    "HeadPlot",
    "head_mask",
    "plot_config",
    "plot_head",
    "plot_search_frontier",
    "plot_eval_frontier",
    "config_group",
    "add_cli",
]

#: What to run when matplotlib is missing.
MATPLOTLIB_HINT = "plotting needs matplotlib: pip install matplotlib (or pip install 'minference[plot]')"
#: Cell colour of each pattern kind (colour-blind safe Okabe-Ito hues; dense is grey).
KIND_COLORS = {
    "a_shape": "#E69F00",
    "vertical_slash": "#0072B2",
    "block_sparse": "#009E73",
    "dense": "#BBBBBB",
}
#: Legend / title names of the kinds.
KIND_LABELS = {"a_shape": "A-shape", "vertical_slash": "vertical-slash", "block_sparse": "block-sparse",
               "dense": "dense"}
#: Config grid geometry (inches per cell) and the smallest cell font that is still legible.
CELL_WIDTH_IN = 0.62
CELL_HEIGHT_IN = 0.24
SIDE_PANEL_IN = 2.2
MIN_CELL_FONT_PT = 4.0
MAX_CELL_FONT_PT = 7.0
#: Fraction of a cell's height a budget label may use (points).
CELL_FONT_FILL = 0.55
#: Characters a budget label may have at the cell font before it no longer fits the cell width.
POINTS_PER_INCH = 72.0
CHAR_WIDTH_EM = 0.6
DEFAULT_DPI = 110
#: plot_head: dense probabilities below this are drawn as the floor of the log scale.
PROB_FLOOR = 1e-6
#: plot_head: longest sequence drawn (the float64 ``[N, N]`` probability map is materialised).
MAX_HEAD_TOKENS = 8192
#: plot_head: at most this many pixels per image side; longer sequences are max-pooled.
MAX_DISPLAY_PIXELS = 1024
#: plot_head overlay colours (RGB in [0, 1]): not causal, kept (low -> high probability), missed.
ABOVE_DIAGONAL_RGB = (0.93, 0.93, 0.93)
KEPT_LOW_RGB = (0.80, 0.88, 0.97)
KEPT_HIGH_RGB = (0.03, 0.19, 0.42)
MISSED_RGB = (0.84, 0.10, 0.11)
#: ``minference show head`` defaults.
DEFAULT_HEAD_TOKENS = 1024
DEFAULT_DEPTH = 0.5


def _matplotlib():
    """``(Figure, colors, Patch)`` from matplotlib, or an ImportError naming the install command."""
    try:
        import matplotlib  # noqa: F401  (fails first and clearly when the package is missing)
        from matplotlib import colors
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(f"{MATPLOTLIB_HINT} ({err})") from None
    return Figure, colors, Patch


def _check_path(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    out = Path(path)
    if not out.suffix:
        raise ValueError(f"path must end in an image extension such as .png, got {str(out)!r}")
    if not out.parent.is_dir():
        raise ValueError(f"path's folder {str(out.parent)!r} does not exist")
    return out


# ---------------------------------------------------------------------------------------------
# Config grid.


def budget_label(pattern: Pattern) -> str:
    """Short budget text of a pattern for a grid cell ("" for dense)."""
    if isinstance(pattern, AShape):
        return f"{pattern.sink}+{pattern.window}"
    if isinstance(pattern, VerticalSlash):
        return f"{pattern.vertical}/{pattern.slash}"
    if isinstance(pattern, BlockSparse):
        return f"k{pattern.top_k}"
    return ""


def _row_means(rows: list[list[float | None]] | None, n_layers: int) -> list[float] | None:
    """Per-layer mean of a provenance table, ignoring ``None``; ``None`` when not recorded."""
    if not rows or len(rows) != n_layers:
        return None
    out = []
    for row in rows:
        vals = [x for x in row if x is not None]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out if any(not math.isnan(x) for x in out) else None


def _provenance_summary(config) -> str:
    p = config.provenance
    parts = [f"source {p.source}"]
    if p.created:
        parts.append(p.created[:10])
    if p.metric:
        parts.append(f"metric {p.metric}")
    if p.target_density is not None:
        parts.append(f"target density {p.target_density:g}")
    if p.calibration_lengths:
        parts.append(f"calibrated at {', '.join(str(n) for n in p.calibration_lengths)} tokens")
    return ", ".join(parts)


def plot_config(
    config,
    path: str | os.PathLike,
    *,
    annotate: bool = True,
    side_panel: bool = True,
    dpi: int = DEFAULT_DPI,
) -> Path:
    """Draw ``config`` as a layer x global-head grid coloured by pattern kind and save it.

    Cells carry the budget in small text when it fits: A-shape ``sink+window``, vertical-slash
    ``vertical/slash``, block-sparse ``k<top_k>``. The title names the model and summarises the
    provenance. With ``side_panel`` and densities recorded in the provenance, a panel on the
    right shows each layer's expected density (mean over heads) and, when recorded, its mean
    search score, with the target density as a line.

    Args:
        config: a :class:`minference.config.PatternConfig` (e.g. from
            :func:`minference.config.load_config`).
        path: output image file; the extension picks the format (``.png``, ``.svg``, ``.pdf``).
        annotate: write budgets into the cells when they fit.
        side_panel: add the per-layer density panel when the provenance has densities.
        dpi: raster resolution.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    from minference.config import PatternConfig

    if not isinstance(config, PatternConfig):
        raise TypeError(f"config must be a minference.config.PatternConfig (see load_config), "
                        f"got {type(config).__name__}")
    out = _check_path(path)
    check_int("dpi", dpi, 1)
    Figure, colors, Patch = _matplotlib()

    kinds = list(KIND_COLORS)
    n_layers, n_heads = len(config.layers), config.model.num_heads
    grid = [[kinds.index(p.kind) for p in row] for row in config.layers]
    densities = _row_means(config.provenance.densities, n_layers) if side_panel else None
    scores = _row_means(config.provenance.scores, n_layers) if densities is not None else None

    grid_w = max(n_heads * CELL_WIDTH_IN, 3.0)
    grid_h = max(n_layers * CELL_HEIGHT_IN, 2.0)
    fig_w = grid_w + (SIDE_PANEL_IN if densities is not None else 0.0) + 1.4
    fig = Figure(figsize=(fig_w, grid_h + 1.9), dpi=dpi, layout="constrained")
    if densities is not None:
        ax, side = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [grid_w, SIDE_PANEL_IN]})
    else:
        ax, side = fig.subplots(1, 1), None
    cmap = colors.ListedColormap([KIND_COLORS[k] for k in kinds])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(kinds) - 0.5, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("global query head")
    ax.set_ylabel("layer")
    ax.set_xticks([x - 0.5 for x in range(1, n_heads)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, n_layers)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)

    if annotate:
        cell_w_in = grid_w / n_heads
        cell_h_in = grid_h / n_layers
        font = min(MAX_CELL_FONT_PT, CELL_FONT_FILL * cell_h_in * POINTS_PER_INCH)
        longest = max((len(budget_label(p)) for row in config.layers for p in row), default=0)
        if longest:
            font = min(font, cell_w_in * POINTS_PER_INCH / (CHAR_WIDTH_EM * longest))
        if font >= MIN_CELL_FONT_PT:
            for layer, row in enumerate(config.layers):
                for head, p in enumerate(row):
                    text = budget_label(p)
                    if text:
                        ax.text(head, layer, text, ha="center", va="center", fontsize=font,
                                color="white" if p.kind == "vertical_slash" else "black")

    counts = config.counts()
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="none",
                     label=f"{KIND_LABELS[k]} ({counts[k]})") for k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(kinds), fontsize=8, frameon=False)
    budgets = "cell text: A-shape sink+window, vertical-slash vertical/slash, block-sparse k=top_k"
    fig.suptitle(f"{config.model.model_id}\n{n_layers} layers x {n_heads} heads; "
                 f"{_provenance_summary(config)}\n{budgets}", fontsize=8)

    if side is not None:
        layers = list(range(n_layers))
        side.barh(layers, densities, height=0.7, color="#888888", label="expected density")
        if scores is not None:
            metric = config.provenance.metric or "score"
            side.plot(scores, layers, "o-", color="#CC79A7", markersize=3, linewidth=1, label=f"mean {metric}")
        if config.provenance.target_density is not None:
            side.axvline(config.provenance.target_density, color="black", linestyle=":", linewidth=1,
                         label="target density")
        side.set_xlim(0.0, 1.05)
        side.set_xlabel("per layer (mean over heads)", fontsize=8)
        side.tick_params(labelsize=7)
        side.legend(fontsize=6, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_ylim(n_layers - 0.5, -0.5)  # layer 0 on top (set after sharey plots)
    fig.savefig(out)
    return out


# ---------------------------------------------------------------------------------------------
# One head.


@dataclass(frozen=True)
class HeadPlot:
    """What :func:`plot_head` drew.

    Attributes:
        path: the written image.
        mass: dense probability mass the candidate set captures (mean over queries).
        density: fraction of the ``N (N + 1) / 2`` causal pairs the set keeps.
        label: the pattern (or ``"mask"``) drawn.
    """

    path: Path
    mass: float
    density: float
    label: str


def _head_qk(q: torch.Tensor, k: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(q [1, Hq, N, D], k [1, Hkv, N, D], kv_head)`` from rank-3 or rank-4 inputs, checked."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    check_tensor("q", q, dtypes=floats)
    check_tensor("k", k, dtypes=floats)
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(f"q and k must both be [H, N, D] or [1, H, N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dim() == 3:
        q, k = q[None], k[None]
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"plot_head draws one sequence: batch must be 1, got {q.shape[0]} and {k.shape[0]}")
    _, Hq, N, D = q.shape
    _, Hkv, Nk, Dk = k.shape
    if (Nk, Dk) != (N, D):
        raise ValueError(f"k must be [Hkv, N={N}, D={D}] to match q, got {tuple(k.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    if not 1 <= N <= MAX_HEAD_TOKENS:
        raise ValueError(f"plot_head materialises an N x N map: N must be in [1, {MAX_HEAD_TOKENS}], got {N}")
    check_int("head", head, 0)
    if head >= Hq:
        raise ValueError(f"head must be in [0, {Hq}) for q with {Hq} query heads, got {head}")
    return q, k, head // (Hq // Hkv)


def head_mask(
    q: torch.Tensor, k: torch.Tensor, pattern: Pattern, *, head: int = 0, scale: float | None = None
) -> torch.Tensor:
    """``[N, N]`` bool candidate set of ``pattern`` for query head ``head`` of one sequence.

    Static patterns are the reference formulas; vertical-slash and block-sparse take the index
    the online builders (:mod:`minference.torch_backend`) pick from ``q [1, Hq, N, D]`` and
    ``k [1, Hkv, N, D]`` (rank 3 without the batch axis also accepted), turned into a mask by
    :mod:`minference.reference.masks`.
    """
    from minference import torch_backend as TB
    from minference.reference import masks as M

    q, k, _ = _head_qk(q, k, head)
    N = q.shape[2]
    scale = default_scale(q.shape[-1], scale)
    heads = torch.tensor([head], dtype=torch.int32, device=q.device)
    if isinstance(pattern, Dense):
        return M.causal_mask(N, device=q.device)
    if isinstance(pattern, AShape):
        return M.ashape_mask(N, pattern.sink, pattern.window, device=q.device)
    if isinstance(pattern, VerticalSlash):
        vertical, slash = TB.vertical_slash_index(
            q, k, pattern.vertical, pattern.slash, last_q=pattern.last_q, sink_columns=pattern.sink_columns,
            local_diagonals=pattern.local_diagonals, aggregation=pattern.aggregation, extra_rows=pattern.extra_rows,
            scale=scale, heads=heads)
        return M.vertical_slash_mask(N, vertical[0, 0], slash[0, 0], FILL_GAPS)
    if isinstance(pattern, BlockSparse):
        blocks = TB.block_sparse_index(
            q, k, pattern.top_k, block=pattern.block, sink_blocks=pattern.sink_blocks,
            force_diagonal=pattern.force_diagonal, scale=scale, heads=heads)
        return M.block_sparse_mask(N, blocks[0, 0], pattern.block)
    raise TypeError(f"pattern must be a minference pattern (AShape, VerticalSlash, BlockSparse, Dense), "
                    f"got {type(pattern).__name__}")


def _pool_max(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Max over ``factor x factor`` cells of ``x [N, N]`` (zero padded to a multiple)."""
    if factor == 1:
        return x
    n = x.shape[0]
    m = -(-n // factor) * factor
    padded = torch.zeros(m, m, dtype=x.dtype, device=x.device)
    padded[:n, :n] = x
    return padded.view(m // factor, factor, m // factor, factor).amax(dim=(1, 3))


def _pattern_label(pattern: Pattern) -> str:
    if isinstance(pattern, Dense):
        return "dense"
    if isinstance(pattern, AShape):
        return f"A-shape sink {pattern.sink}, window {pattern.window}"
    if isinstance(pattern, VerticalSlash):
        return f"vertical-slash {pattern.vertical} columns, {pattern.slash} diagonals (online index)"
    return f"block-sparse top-{pattern.top_k} of {pattern.block}-blocks (online index)"


def plot_head(
    q: torch.Tensor,
    k: torch.Tensor,
    pattern: Pattern | torch.Tensor,
    path: str | os.PathLike,
    *,
    head: int = 0,
    scale: float | None = None,
    title: str | None = None,
    dpi: int = DEFAULT_DPI,
) -> HeadPlot:
    """Draw one head's dense attention map next to a candidate set, and save it.

    Left: the dense causal probabilities (float64, log scale). Middle: the candidate set, kept
    pairs in blue (darker = more dense probability), dense probability it misses in red (more
    opaque = more), the non-causal half grey. Right: each query's captured mass. The title gives
    the mean captured mass and the density. Sequences longer than
    :data:`MAX_DISPLAY_PIXELS` are max-pooled for display only; the numbers are exact.

    Args:
        q: ``[1, Hq, N, D]`` (or ``[Hq, N, D]``) queries of one sequence (after RoPE).
        k: ``[1, Hkv, N, D]`` (or ``[Hkv, N, D]``) keys; GQA: head ``h`` reads kv head
            ``h // (Hq // Hkv)``.
        pattern: a pattern (its candidate set for this head, see :func:`head_mask`), or an
            explicit bool mask ``[N, N]`` in logical coordinates.
        path: output image file (extension picks the format).
        head: query head to draw, ``0 <= head < Hq``.
        scale: softmax scale (default ``D ** -0.5``).
        title: first title line (e.g. model, layer and head).

    Returns:
        :class:`HeadPlot` with the captured mass and density drawn in the title.
    """
    from minference.reference import metrics as R
    from minference.reference.attention import dense_attention_probs

    q, k, kv = _head_qk(q, k, head)
    out = _check_path(path)
    check_int("dpi", dpi, 1)
    N = q.shape[2]
    if isinstance(pattern, torch.Tensor):
        check_tensor("pattern", pattern, dtypes=(torch.bool,))
        if pattern.shape[-2:] != (N, N) or pattern.numel() != N * N:
            raise ValueError(f"a mask pattern must be [N, N] = [{N}, {N}] bool, got {tuple(pattern.shape)}")
        mask, label = pattern.reshape(N, N).to(q.device), "explicit mask"
    elif isinstance(pattern, (AShape, VerticalSlash, BlockSparse, Dense)):
        mask, label = head_mask(q, k, pattern, head=head, scale=scale), _pattern_label(pattern)
    else:
        raise TypeError(f"pattern must be a minference pattern or a bool mask tensor, got {type(pattern).__name__}")
    Figure, colors, Patch = _matplotlib()

    probs = dense_attention_probs(q[:, head : head + 1], k[:, kv : kv + 1], scale=scale)  # [1, 1, N, N] f64
    mask4 = mask[None, None]
    mass = float(R.captured_mass(probs, mask4)[0, 0])
    dens = float(R.density(mask4)[0, 0])
    per_query = R.captured_mass_per_query(probs, mask4)[0, 0].cpu()
    p = probs[0, 0].cpu()
    causal = torch.ones(N, N, dtype=torch.bool).tril_()
    kept = mask.cpu() & causal

    factor = -(-N // MAX_DISPLAY_PIXELS)
    shown = _pool_max(p, factor)
    kept_p = _pool_max(torch.where(kept, p, torch.zeros(())), factor)
    missed_p = _pool_max(torch.where(causal & ~kept, p, torch.zeros(())), factor)
    any_kept = _pool_max(kept.double(), factor) > 0
    any_causal = _pool_max(causal.double(), factor) > 0

    lo = math.log10(PROB_FLOOR)

    def level(x: torch.Tensor) -> torch.Tensor:  # log-probability -> [0, 1]
        return ((x.clamp(min=PROB_FLOOR).log10() - lo) / -lo).clamp(0.0, 1.0)

    def rgb(c) -> torch.Tensor:
        return torch.tensor(c, dtype=torch.float64)

    t_kept = level(kept_p)[..., None]
    image = torch.where(any_kept[..., None], rgb(KEPT_LOW_RGB) * (1 - t_kept) + rgb(KEPT_HIGH_RGB) * t_kept,
                        torch.ones(3, dtype=torch.float64))
    alpha = torch.where(missed_p > 0, level(missed_p), torch.zeros(()))[..., None]
    image = image * (1 - alpha) + rgb(MISSED_RGB) * alpha
    image = torch.where(any_causal[..., None], image, rgb(ABOVE_DIAGONAL_RGB))

    fig = Figure(figsize=(15.0, 5.4), dpi=dpi, layout="constrained")
    ax_dense, ax_mask, ax_q = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 1.0, 0.8]})
    extent = (-0.5, N - 0.5, N - 0.5, -0.5)
    dense_img = torch.where(any_causal, shown.clamp(min=PROB_FLOOR), torch.full_like(shown, math.nan))
    im = ax_dense.imshow(dense_img.numpy(), norm=colors.LogNorm(vmin=PROB_FLOOR, vmax=1.0), cmap="magma_r",
                         interpolation="nearest", extent=extent)
    fig.colorbar(im, ax=ax_dense, shrink=0.8, label="dense probability")
    ax_dense.set_title("dense causal attention (log scale)", fontsize=9)
    ax_mask.imshow(image.numpy(), interpolation="nearest", extent=extent)
    ax_mask.set_title(label, fontsize=9)
    for a in (ax_dense, ax_mask):
        a.set_xlabel("key position j")
        a.set_ylabel("query position i")
    ax_mask.legend(handles=[Patch(color=KEPT_HIGH_RGB, label="kept (darker: more probability)"),
                            Patch(color=MISSED_RGB, label="missed dense probability"),
                            Patch(color=ABOVE_DIAGONAL_RGB, label="not causal")],
                   loc="upper right", fontsize=7)
    ax_q.plot(range(N), per_query.numpy(), color=KEPT_HIGH_RGB, linewidth=0.8)
    ax_q.set_ylim(min(0.0, float(per_query.min())), 1.02)
    ax_q.set_xlim(0, max(N - 1, 1))
    ax_q.set_xlabel("query position i")
    ax_q.set_ylabel("captured mass")
    ax_q.set_title("captured mass per query", fontsize=9)
    ax_q.grid(alpha=0.3)
    pooled = f", display max-pooled {factor}x{factor}" if factor > 1 else ""
    head_line = f"head {head} (kv head {kv}), N={N}{pooled}"
    fig.suptitle(f"{title + ': ' if title else ''}{head_line}\n"
                 f"captured mass {mass:.3f}, density {dens:.3f} of causal pairs", fontsize=10)
    fig.savefig(out)
    return HeadPlot(out, mass, dens, label)


# ---------------------------------------------------------------------------------------------
# The frontier: predicted (search) and measured (eval).

#: Marker and colour per group of :func:`config_group`.
GROUP_STYLE = {"dense": ("*", "black"), "family": ("o", "#0072B2"), "uniform": ("s", "#E69F00"),
               "config": ("D", "#009E73")}
GROUP_LABELS = {"dense": "dense", "family": "frontier family", "uniform": "uniform rule", "config": "other config"}
#: What the provenance notes of a family config start with (minference.app.frontier).
FAMILY_NOTE = "frontier point"


def config_group(cfg) -> str:
    """``"dense"``, ``"family"`` (a config file whose provenance notes say it is a frontier point),
    ``"uniform"`` (one pattern for every head) or ``"config"`` (any other file) of an
    :class:`~minference.app.evaluate.EvalConfig`."""
    if cfg.dense:
        return "dense"
    if cfg.kind == "uniform":
        return "uniform"
    notes = ((cfg.config or {}).get("provenance") or {}).get("notes") or ""
    return "family" if notes.startswith(FAMILY_NOTE) else "config"


def plot_search_frontier(summary: dict, path: str | os.PathLike, *, dpi: int = DEFAULT_DPI) -> Path:
    """Draw a frontier summary: modelled prefill (``fixed + cost``) against predicted error (mean
    error per head of the summary's proxy), the Lagrangian curve as a line, each family config as a
    point labelled with its budget and a hollow marker at its flat-score worst case, and the
    per-head min-mass rule's configs as crosses. Returns ``path``."""
    out = _check_path(path)
    check_int("dpi", dpi, 1)
    if not isinstance(summary, dict) or summary.get("format") != "minference.frontier":
        raise ValueError("summary must be a frontier summary (minference.app.frontier.frontier_summary)")
    from minference.app.frontier import PROXIES, summary_proxy

    Figure, _, _ = _matplotlib()
    fig = Figure(figsize=(7.5, 5.0), dpi=dpi, layout="constrained")
    ax = fig.subplots()
    fixed = summary["fixed"]
    curve = summary["curve"]
    ax.plot(curve["error"], [fixed + c for c in curve["cost"]], color="#888888", lw=1.0,
            label="Lagrangian path (no worst-case bound)")
    for p in summary["points"]:
        ax.plot([p["error"]] * 2, [p["prefill"], p["worst_prefill"]], color="#0072B2", lw=0.6, alpha=0.6)
        ax.scatter([p["error"]], [p["worst_prefill"]], facecolors="none", edgecolors="#0072B2", s=30, zorder=3)
        ax.scatter([p["error"]], [p["prefill"]], color="#0072B2", s=40, zorder=4)
        ax.annotate(f"{p['budget']:g}", (p["error"], p["prefill"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    for r in summary["rules"]:
        ax.scatter([r["error"]], [r["prefill"]], marker="x", color="#D55E00", s=40, zorder=4)
        ax.annotate(f"min mass {r['min_mass']:g}", (r["error"], r["prefill"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=7, color="#D55E00")
    ax.axhline(fixed + summary["dense_cost"], color="black", ls=":", lw=1, label="all dense")
    ax.scatter([], [], color="#0072B2", label="family config (budget)")
    ax.scatter([], [], facecolors="none", edgecolors="#0072B2", label="its flat-score worst case")
    ax.scatter([], [], marker="x", color="#D55E00", label="per-head min-mass rule")
    ax.set_xlabel(f"predicted error: {PROXIES[summary_proxy(summary)]}")
    ax.set_ylabel(f"modelled prefill ({summary['unit']}: fixed {fixed:g} + attention + index)")
    ax.set_title(f"{summary['model']['model_id']}\nfrontier at {summary['n_tokens']} tokens ({summary['cost_source']})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(out)
    return out


def plot_eval_frontier(report, path: str | os.PathLike, *, length: int | None = None, ship: str | None = None,
                       dpi: int = DEFAULT_DPI, nll: dict[str, float] | None = None) -> Path:
    """Draw an eval report at one ``length`` (default the longest): per config its median TTFT
    (marker) with a whisker to its worst TTFT, against accuracy (``EvalReport.common_scores``; no
    such panel when only the perplexity task ran) and, when the perplexity task ran, NLL. Dense
    is a black star, the frontier family blue circles joined in TTFT order, uniform rules orange
    squares, other configs green diamonds; ``ship`` (a config name) is ringed. TTFT from
    :func:`minference.app.frontier.ttft_stats`. ``nll`` (config name -> NLL at that length)
    stands in for a report without the perplexity task. Returns ``path``."""
    from minference.app.evals import PERPLEXITY_TASK
    from minference.app.frontier import ttft_stats

    out = _check_path(path)
    check_int("dpi", dpi, 1)
    if not report.lengths:
        raise ValueError("the report has no lengths")
    n = max(report.lengths) if length is None else length
    if n not in report.lengths:
        raise ValueError(f"length {n} is not in the report ({report.lengths})")
    Figure, _, _ = _matplotlib()
    accuracy, shared = report.common_scores(n)
    what = "RULER score / 100" if report.settings.get("suite") == "ruler" else "accuracy"
    acc_label = f"{what} on the {shared} prompts every config ran" if shared else f"{what} (no prompt every config ran)"
    if nll is None:
        nll = {p["config"]: p["nll"] for p in report.perplexity() if p["n_tokens"] == n}
    # no accuracy panel where only the perplexity task ran at this length
    generation = any(r.task != PERPLEXITY_TASK and r.n_tokens == n for r in report.records)
    panels = ([(accuracy, acc_label)] if generation or not nll else []) + (
        [(nll, "mean next-token NLL (nats)")] if nll else [])
    fig = Figure(figsize=(6.5 * len(panels), 4.8), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (values, ylabel) in zip(axes, panels):
        family = []
        seen = set()
        for cfg in report.configs:
            t, y = ttft_stats(report, cfg.name, n), values.get(cfg.name)
            if t is None or y is None:
                continue
            group = config_group(cfg)
            marker, color = GROUP_STYLE[group]
            ax.plot([t.median_ms, t.max_ms], [y, y], color=color, lw=1.2, alpha=0.7)
            ax.scatter([t.max_ms], [y], marker="|", color=color, s=60)
            ax.scatter([t.median_ms], [y], marker=marker, color=color, s=140 if group == "dense" else 45, zorder=3,
                       label=GROUP_LABELS[group] if group not in seen else None)
            seen.add(group)
            if cfg.name == ship:
                ax.scatter([t.median_ms], [y], s=260, facecolors="none", edgecolors="#CC79A7", linewidths=2,
                           zorder=4, label="ship rule's choice")
            ax.annotate(cfg.name, (t.median_ms, y), textcoords="offset points", xytext=(4, 5), fontsize=7)
            if group == "family":
                family.append((t.median_ms, y))
        if len(family) > 1:
            xs, ys = zip(*sorted(family))
            ax.plot(xs, ys, color=GROUP_STYLE["family"][1], lw=0.8, alpha=0.5)
        ax.set_xlabel("TTFT ms: median (marker) to worst (bar)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        ax.set_title(f"{report.model.get('name', '')} at {n} tokens ({report.settings.get('device', '')})", fontsize=9)
    fig.savefig(out)
    return out


# ---------------------------------------------------------------------------------------------
# The ``show`` subcommand.


class _Captured(Exception):
    """Stops the forward pass once the wanted layer's queries and keys are seen."""


def capture_layer_qk(model, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """``(q [1, Hq, N, D], k [1, Hkv, N, D], scale)`` of ``layer``'s dense prefill of ``ids [N]``,
    read through :func:`minference.integration.observe_attention` (later layers are not run)."""
    import minference.integration as integ

    modules = integ.attention_modules(model)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in modules:
        raise ValueError(f"layer must be in [0, {len(modules)}), got {layer!r}")
    seen: dict[str, torch.Tensor] = {}

    def observer(index, query, key, _value, _seqlens, _seqstarts) -> None:
        if index == layer:
            seen["q"], seen["k"] = query.detach().clone(), key.detach().clone()
            raise _Captured

    with integ.observe_attention(model, observer), torch.no_grad():
        try:
            model(ids[None], use_cache=False)
        except _Captured:
            pass
    if "q" not in seen:
        raise RuntimeError(f"layer {layer} saw no prefill call")
    return seen["q"], seen["k"], getattr(modules[layer], "scaling", None)


def _calibrated(config) -> str:
    lengths = config.provenance.calibration_lengths
    return f" (budgets calibrated at {', '.join(str(n) for n in lengths)} tokens)" if lengths else ""


def _show_config_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from minference.config import load_config

    config = load_config(args.path)
    path = plot_config(config, args.out, annotate=not args.no_annotate, dpi=args.dpi)
    print(f"wrote {path}: {config.model.model_id}, {config.counts()}", file=out or sys.stdout)
    return 0


def _show_head_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from minference.app.main_job import check_config_file_model
    from minference.app.models import load_smollm2
    from minference.app.prompts import passkey_prompt
    from minference.config import model_signature

    _check_path(args.out)
    # against SmolLM2's shape before the weights load, against the model itself once it is loaded
    config = check_config_file_model(args.config, "smollm2", allow_mismatch=args.allow_mismatch)
    n_layers, n_heads = len(config.layers), config.model.num_heads
    if not 0 <= args.layer < n_layers:
        raise ValueError(f"argument --layer: must be in [0, {n_layers}) (the config's layers), got {args.layer}")
    if not 0 <= args.head < n_heads:
        raise ValueError(f"argument --head: must be in [0, {n_heads}) (the config's heads), got {args.head}")
    if args.tokens < 1:
        raise ValueError(f"argument --tokens: must be >= 1, got {args.tokens}")
    model, tokenizer = load_smollm2(device=args.device)
    config.check(model_signature(model), allow_mismatch=args.allow_mismatch)
    ids, _ = passkey_prompt(tokenizer, args.tokens, key=None, depth=args.depth, seed=args.seed)
    q, k, scale = capture_layer_qk(model, ids.to(args.device), args.layer)
    pattern = config.plan(args.layer)[args.head]
    result = plot_head(q, k, pattern, args.out, head=args.head, scale=scale,
                       title=f"SmolLM2-135M layer {args.layer}, passkey prompt{_calibrated(config)}")
    print(f"wrote {result.path}: layer {args.layer} head {args.head}, {result.label}; "
          f"captured mass {result.mass:.3f}, density {result.density:.3f}", file=out or sys.stdout)
    return 0


def _read_report_json(path: str) -> dict:
    """The JSON object in ``path`` (a frontier summary or an eval report); a ``ValueError`` naming the
    file otherwise: one line, exit 2 (:func:`minference.app.cli.main`)."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read {path}: not JSON ({err.msg} at line {err.lineno})") from None
    except (OSError, UnicodeDecodeError) as err:
        why = (err.strerror or err) if isinstance(err, OSError) else err
        raise ValueError(f"cannot read {path}: {why}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a frontier summary or an eval report (a JSON {type(data).__name__})")
    return data


def _eval_report(path: str, data: dict):
    from minference.app.evaluate import EvalReport

    try:
        return EvalReport.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _show_frontier_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from minference.app.evaluate import merge_reports
    from minference.app.frontier import ship_choice

    out = out or sys.stdout
    _check_path(args.out)
    data = [_read_report_json(p) for p in args.paths]
    if data[0].get("format") == "minference.frontier":
        if len(data) > 1:
            raise ValueError("one frontier summary at a time")
        path = plot_search_frontier(data[0], args.out)
        print(f"wrote {path}", file=out)
        return 0
    reports = [_eval_report(p, d) for p, d in zip(args.paths, data)]
    report = reports[0] if len(reports) == 1 else merge_reports(reports, names=args.paths)
    companions = [_eval_report(p, _read_report_json(p)) for p in args.nll]
    decision = ship_choice(report, length=args.length, nll_reports=companions)  # FrontierError: a ValueError
    print(decision.text(), file=out)
    path = plot_eval_frontier(report, args.out, length=decision.length, ship=decision.chosen, nll=decision.nll or None)
    print(f"wrote {path}", file=out)
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``minference show config``, ``show head`` and ``show frontier`` (need matplotlib)."""
    from minference.app.main_job import DEFAULT_CONFIG

    show = subparsers.add_parser("show", help="pictures: a config's pattern grid, one head's attention vs its mask",
                                 description="Draw pictures (needs matplotlib: pip install matplotlib).")
    show.set_defaults(check=lambda args: _matplotlib())  # before any model runs (minference.app.cli.main)
    kinds = show.add_subparsers(dest="picture", metavar="PICTURE", title="pictures", required=True)
    cfg = kinds.add_parser("config", help="layer x head grid of a PatternConfig, coloured by pattern kind",
                           description=(plot_config.__doc__ or "").split("\n\n")[0])  # python -OO: no docstrings
    cfg.add_argument("path", help="PatternConfig (native or MInference JSON)")
    cfg.add_argument("--out", required=True, help="image file to write (.png, .svg, .pdf)")
    cfg.add_argument("--no-annotate", action="store_true", help="no budget text in the cells")
    cfg.add_argument("--dpi", type=int, default=DEFAULT_DPI, help="raster resolution")
    cfg.set_defaults(func=_show_config_cmd)
    head = kinds.add_parser(
        "head", help="one SmolLM2 head: dense attention map vs its configured pattern's candidate set",
        description="Run SmolLM2-135M densely on a passkey prompt, capture one layer's queries and keys, and draw "
                    "one head's dense attention (log scale) next to the candidate set its configured pattern picks "
                    "(the online index for vertical-slash and block-sparse), with captured mass and density.")
    head.add_argument("--layer", type=int, required=True, help="layer index")
    head.add_argument("--head", type=int, required=True, help="global query head index")
    head.add_argument("--tokens", type=int, default=DEFAULT_HEAD_TOKENS, help="prompt length (N x N map is drawn)")
    head.add_argument("--out", required=True, help="image file to write")
    head.add_argument("--config", default=str(DEFAULT_CONFIG), help="PatternConfig giving the head's pattern")
    head.add_argument("--depth", type=float, default=DEFAULT_DEPTH, help="needle depth, 0 (start) .. 1 (end)")
    head.add_argument("--seed", type=int, default=0, help="prompt seed")
    head.add_argument("--device", default="cpu", help="torch device")
    head.add_argument("--allow-mismatch", action="store_true", help="use a config made for another model")
    head.set_defaults(func=_show_head_cmd)
    front = kinds.add_parser(
        "frontier", help="a frontier search's summary, or eval reports' TTFT (median, worst) vs accuracy and NLL",
        description="With a frontier summary (minference search --frontier): predicted cost vs predicted error. "
                    "With eval reports (merged when several): median and worst TTFT against accuracy and NLL for "
                    "dense, the frontier family and the uniform rules, and the config the ship rule picks "
                    "(printed, with why each faster config was rejected).")
    front.add_argument("paths", nargs="+", help="frontier summary JSON, or eval report JSON(s)")
    front.add_argument("--out", required=True, help="image file to write")
    front.add_argument("--length", type=int, default=None, help="eval: the length to draw and rank (default longest)")
    front.add_argument("--nll", nargs="+", default=[], metavar="REPORT",
                       help="eval: NLL reports of the same configs (matched by pattern data, at a length within "
                       "3%%) for reports without the perplexity task, e.g. RULER's; may come from another GPU")
    front.set_defaults(func=_show_frontier_cmd)
