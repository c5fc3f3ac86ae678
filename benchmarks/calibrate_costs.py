"""Cost table of the frontier search (docs/search.md): each attention kernel's time for one layer
against the tiles it computes, and each online index builder's time, at one model's head dim,
head counts and target length.

    python benchmarks/calibrate_costs.py --tokens 120000 --head-dim 64 --heads 14 --kv-heads 2 \
        --layers 24 --out $OUT/h200_costs_qwen0.5b_120k.json

On CUDA every call is timed by ``triton.testing.do_bench`` (median, warm-up and compilation
excluded) on random bf16 inputs (never zeros), with one value guard made per layer as the
dispatcher does (its time recorded apart: a per-layer constant that no plan changes). On a CPU the
kernels run in the Triton interpreter (``TRITON_INTERPRET=1``), once each: that checks the
script, its times mean nothing.

What is timed, ``H`` = ``--heads`` query heads in one call each (budgets scale with ``n``):

* ``dense``: :func:`minference.kernels.dense_attention` (how a sparse plan runs its dense heads);
  cuDNN SDPA alongside as a reference (CUDA only);
* ``a_shape``: sink 128, windows ``n / 64``, ``n / 16``, ``n / 4``;
* ``vertical_slash``: slashes the band ``0 .. s - 1`` (what the estimator keeps on real heads)
  with ``s = n / 64, n / 16, n / 4`` and ``s / 4`` columns (30 sinks, the rest evenly spread),
  plus one clustered geometry (100 local offsets and 16 random clusters, ``s = n / 16``); the
  call includes the logical-to-physical conversion with the dispatcher's gap filling;
* ``block_sparse@B`` (B = 128, 64): per query block the diagonal, block 0 and random earlier
  blocks, ``k = nb / 32, nb / 8, nb / 2`` of them (``nb = ceil(n / B)``);
* the index builders (``minference.kernels``) of the patterns the searches use, one
  key of :func:`minference.app.frontier.index_key` each, on random inputs (flat scores: the
  adaptive rules keep their caps, the costliest selection).

Each attention kind is fitted ``ms = intercept + ms_per_tile * tiles`` (least squares, intercept
>= 0; tiles: 64 x 64 tiles of :func:`minference.app.search.tile_density`, summed over heads),
which :class:`minference.app.frontier.CostModel` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

from minference.app.frontier import COST_TABLE_FORMAT, COST_TABLE_VERSION, causal_tiles, fit_line, index_key
from minference.app.search import ADAPTIVE_MAX_SLASH, ADAPTIVE_MAX_VERTICAL, tile_density
from minference.config import hardware_string
from minference.dispatch import FILL_GAPS
from minference.index_sets import scatter_set, slash_set
from minference.patterns import AShape, BlockSparse, VerticalSlash

#: do_bench budgets (ms of warm-up and of timed repetitions).
WARMUP_MS = 25
REP_MS = 100
#: Budgets of the timed points as fractions of the length (windows, slashes) or of the query
#: blocks (block-sparse blocks per row).
WINDOW_FRACTIONS = (1 / 64, 1 / 16, 1 / 4)
SLASH_FRACTIONS = (1 / 64, 1 / 16, 1 / 4)
BLOCK_FRACTIONS = (1 / 32, 1 / 8, 1 / 2)
A_SINK = 128
VS_SINK_COLUMNS = 30
VS_LOCAL = 100
VS_CLUSTERS = 16
#: Block sizes whose kernel is fitted apart.
BLOCKS = (128, 64)
#: Scoring rows of the cheaper query-aware estimate (``minference search --bs-score-rows``), timed
#: beside the full score (0) for each block and rule.
SCORE_ROWS = (32, 16)


def index_patterns(n: int) -> list:
    """One pattern per index key the searches use: the adaptive and frontier candidates'
    vertical-slash mass rule and block-sparse query-aware relative and mass rules (at each block
    of :data:`BLOCKS` and with each of :data:`SCORE_ROWS` scoring rows or all: ``minference search
    --bs-blocks``, ``--bs-gammas``, ``--bs-score-rows``), the top-k forms of
    both, and the pooled top-k routing of the budgeted candidates."""
    nb128, nb64 = -(-n // 128), -(-n // 64)
    routed = [BlockSparse(top_k=max(2, -(-n // b) // 2), block=b, rule=rule, threshold=t, estimate="query",
                          score_rows=r)
              for b in BLOCKS for rule, t in (("relative", 0.1), ("mass", 0.9)) for r in (0, *SCORE_ROWS)]
    return [
        VerticalSlash(vertical=ADAPTIVE_MAX_VERTICAL, slash=ADAPTIVE_MAX_SLASH, rule="mass", threshold=0.9),
        VerticalSlash(vertical=1000, slash=6096),
        VerticalSlash(vertical=ADAPTIVE_MAX_VERTICAL, slash=ADAPTIVE_MAX_SLASH, rule="relative", threshold=0.1),
        *routed,
        BlockSparse(top_k=max(2, nb128 // 8), block=128, estimate="query"),
        BlockSparse(top_k=max(2, nb64 // 8), block=64),
    ]


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        import triton.testing

        def bench(fn):
            fn()  # compile outside the timing
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))

        return bench

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def _band(n: int, H: int, s: int, v: int, g: torch.Generator, clustered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vertical [1, H, v], slash [1, H, s])`` int32: the band ``0 .. s-1`` (or local offsets plus
    random clusters) and 30 sink columns plus evenly spread ones."""
    s, v = min(s, n), min(max(v, 1), n)
    if clustered:
        local = torch.arange(min(VS_LOCAL, s)).expand(H, -1)
        per = -(-(s - local.shape[1]) // VS_CLUSTERS)
        base = torch.randint(0, max(n - per, 1), (H, VS_CLUSTERS, 1), generator=g)
        far = (base + torch.arange(per)).reshape(H, -1)[:, : s - local.shape[1]].clamp(max=n - 1)
        slash = torch.cat([local, far], -1)
    else:
        slash = torch.arange(s).expand(H, -1)
    sinks = torch.arange(min(VS_SINK_COLUMNS, v))
    spread = torch.linspace(sinks.numel(), n - 1, v - sinks.numel()).long()
    vertical = torch.cat([sinks, spread]).expand(H, -1)
    return vertical[None].to(torch.int32).contiguous(), slash[None].to(torch.int32).contiguous()


def _blocks(n: int, H: int, block: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``[1, H, nb, k]`` int32: per query block its diagonal, block 0 and random earlier blocks."""
    nb = -(-n // block)
    I = torch.arange(nb)[:, None]
    pick = (torch.rand(H, nb, max(k - 2, 0), generator=g) * I).long()
    blocks = torch.cat([I.expand(H, nb, 1), torch.zeros(H, nb, 1, dtype=torch.long), pick], -1)[..., :k]
    return blocks[None].to(torch.int32).contiguous()


def calibrate(n: int, head_dim: int, heads: int, kv_heads: int, *, device: str | None = None, seed: int = 0,
              progress: bool = True) -> dict:
    """Measure every point and the index builders; return the cost table (plain JSON)."""

    from minference import kernels

    if heads % kv_heads:
        raise SystemExit(f"calibrate_costs: --heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if head_dim not in kernels.SUPPORTED_HEAD_DIMS:
        raise SystemExit(f"calibrate_costs: --head-dim must be one of {kernels.SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if n < 128:
        raise SystemExit(f"calibrate_costs: --tokens must be >= 128 (one 128-block), got {n}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, head_dim, generator=g).to(dev, dtype)
    k = torch.randn(1, kv_heads, n, head_dim, generator=g).to(dev, dtype)
    v = torch.randn(1, kv_heads, n, head_dim, generator=g).to(dev, dtype)
    bench = _timer(dev)
    causal = causal_tiles(n)
    guard = kernels.value_guard(k, v)
    guard_ms = bench(lambda: kernels.value_guard(k, v))
    attention: dict[str, list[dict]] = {}

    def point(key: str, label: str, tiles: float, fn) -> None:
        ms = bench(fn)
        attention.setdefault(key, []).append({"label": label, "tiles": tiles, "ms": ms})
        if progress:
            print(f"  {key:18s} {label:34s} tiles {tiles:14.0f}  {ms:10.3f} ms", file=sys.stderr)

    point("dense", "dense", float(heads * causal),
          lambda: kernels.dense_attention(q, k, v, validate=False, value_guard=guard))
    for f in WINDOW_FRACTIONS:
        w = max(1, int(f * n))
        tiles = float(tile_density(AShape(sink=A_SINK, window=w), None, 1, n, "cpu")[0]) * causal * heads
        point("a_shape", f"sink {A_SINK} window {w}", tiles,
              lambda w=w: kernels.ashape_attention(q, k, v, A_SINK, w, validate=False, value_guard=guard))
    vs_points = [(max(1, int(f * n)), False) for f in SLASH_FRACTIONS] + [(max(1, int(n / 16)), True)]
    for s, clustered in vs_points:
        vertical, slash = _band(n, heads, s, s // 4, g, clustered)
        sets = (scatter_set(n, vertical[0]), slash_set(n, slash[0], FILL_GAPS))
        pattern = VerticalSlash(vertical=vertical.shape[-1], slash=slash.shape[-1])
        tiles = float(tile_density(pattern, sets, heads, n, "cpu").sum()) * causal
        vd, sd = vertical.to(dev), slash.to(dev)
        point("vertical_slash", f"{'clustered' if clustered else 'band'} v {vertical.shape[-1]} s {slash.shape[-1]}",
              tiles, lambda vd=vd, sd=sd: kernels.vertical_slash_attention(
                  q, k, v, vd, sd, fill_gaps=FILL_GAPS, validate=False, value_guard=guard))
    for block in BLOCKS:
        nb = -(-n // block)
        for f in BLOCK_FRACTIONS:
            kk = min(nb, max(2, int(f * nb)))
            blocks = _blocks(n, heads, block, kk, g)
            sets = scatter_set(nb, blocks[0])
            tiles = float(tile_density(BlockSparse(top_k=kk, block=block), sets, heads, n, "cpu").sum()) * causal
            bd = blocks.to(dev)
            point(f"block_sparse@{block}", f"{kk} blocks of {block}", tiles,
                  lambda bd=bd, block=block: kernels.block_sparse_attention(
                      q, k, v, bd, block=block, validate=False, value_guard=guard))
    index: dict[str, dict] = {}
    for p in index_patterns(n):
        if isinstance(p, VerticalSlash):
            fn = lambda p=p: kernels.vertical_slash_index(  # noqa: E731
                q, k, p.vertical, p.slash, last_q=p.last_q, sink_columns=p.sink_columns,
                local_diagonals=p.local_diagonals, aggregation=p.aggregation, rule=p.rule, threshold=p.threshold,
                validate=False)
        else:
            fn = lambda p=p: kernels.block_sparse_index(  # noqa: E731
                q, k, p.top_k, block=p.block, sink_blocks=p.sink_blocks, force_diagonal=p.force_diagonal,
                rule=p.rule, threshold=p.threshold, estimate=p.estimate, score_rows=p.score_rows, validate=False)
        ms = bench(fn)
        index[index_key(p)] = {"ms": ms, "pattern": repr(p)}
        if progress:
            print(f"  index {index_key(p):34s} {ms:10.3f} ms", file=sys.stderr)
    reference = {"value_guard_ms": guard_ms}
    if dev.type == "cuda":  # a reference only: a failure is recorded, not raised
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kx, vx = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                reference["cudnn_sdpa_ms"] = bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True))
        except RuntimeError as err:
            reference["cudnn_sdpa_error"] = str(err).splitlines()[0][:200]
    fits = {}
    for key, pts in attention.items():
        a, b = fit_line([p["tiles"] for p in pts], [p["ms"] for p in pts])
        worst = max(abs(a + b * p["tiles"] - p["ms"]) / p["ms"] for p in pts) if all(p["ms"] > 0 for p in pts) else None
        fits[key] = {"intercept_ms": a, "ms_per_tile": b, "max_rel_residual": worst, "points": pts}
    return {"format": COST_TABLE_FORMAT, "version": COST_TABLE_VERSION, "unit": "ms",
            "shape": {"n_tokens": n, "head_dim": head_dim, "num_heads": heads, "num_kv_heads": kv_heads,
                      "dtype": str(dtype).removeprefix("torch."), "tile": 64},
            "attention": fits, "index": index, "reference": reference, "provenance": _provenance(dev)}


def _provenance(dev: torch.device) -> dict:
    import triton

    from minference import __version__

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hardware": hardware_string(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "minference": __version__, "commit": commit,
            "interpreted": os.environ.get("TRITON_INTERPRET") == "1" and dev.type == "cpu",
            "command": " ".join(shlex.quote(a) for a in sys.argv)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, required=True, help="target length (the search's and the eval's)")
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True, help="query heads per layer")
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--layers", type=int, default=None, help="recorded only (the table is per layer)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu (interpreter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="cost table JSON to write")
    args = parser.parse_args(argv)
    if not Path(args.out).parent.is_dir():
        raise SystemExit(f"calibrate_costs: the folder of --out ({Path(args.out).parent}) does not exist")
    table = calibrate(args.tokens, args.head_dim, args.heads, args.kv_heads, device=args.device, seed=args.seed)
    table["shape"]["num_layers"] = args.layers
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    for key, fit in table["attention"].items():
        residual = "n/a" if fit["max_rel_residual"] is None else f"{fit['max_rel_residual']:.3f}"
        print(f"{key:18s} {fit['intercept_ms']:.4f} ms + {fit['ms_per_tile'] * 1e6:.3f} ns/tile "
              f"(max relative residual {residual})")
    for key, idx in table["index"].items():
        print(f"index {key:34s} {idx['ms']:.3f} ms per call ({args.heads} heads)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
