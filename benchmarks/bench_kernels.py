"""Kernel benchmarks on the GPU: the three sparse kernels next to cuDNN SDPA (dense causal) and
FlexAttention with the equivalent BlockMask, built from the same indices, in the same run.

Two modes:

* script: ``python benchmarks/bench_kernels.py --lengths 32768 131072 --hkv 32 8`` prints a
  markdown table (``--json`` also writes every number);
* pytest-benchmark: ``python -m pytest benchmarks/bench_kernels.py -m bench --benchmark-only``.

Timing: ``triton.testing.do_bench`` median (events, warm-up excluded), bf16 random inputs,
B=1, Hq=32, D=128. Each sparse row reports the logical pairs ``E`` (the exact candidate sets
summed over heads) and the physical key tiles the kernel actually runs, both as TFLOP/s
(``4 * D * pairs / time``), so they compare directly with the dense kernel's causal TFLOP/s.

Index geometries (documented, reproducible from ``--seed``):

* ``vs-local``: slashes = the ``NS`` most local offsets ``0 .. NS-1`` (the band MInference's
  estimator usually keeps, and what makes the published times scale linearly in ``N``);
  verticals = 30 sink columns + random columns. One merged run per head.
* ``vs-clustered``: 100 local offsets + the rest in 16 random clusters of contiguous offsets.
* ``vs-scattered``: 100 local offsets + the rest uniform in ``[0, N)`` (worst case: nearly every
  key tile of every query block is touched, so the physical cost approaches dense).
* ``bs-top100``: per query block of 64, the diagonal, block 0 and random earlier blocks, 100
  in all (fewer near the start).
* ``ashape``: 128 sinks, 4096 window, every head.
* ``dense-triton``: our dense causal attention (the A-shape kernel with a window as long as the
  row), to compare per pair with cuDNN at the same shape.
* ``tail``: the dispatcher's dense tail, the last 128 rows against every key (not in the default
  methods), twice: with the automatic key split (its count in the label) and unsplit
  (``key_split=1``, the A-shape kernel's one program per query block and head).
* ``guard``: the value guard alone (``kernels.value_guard``, docs/contract.md), its one Triton
  pass next to the six torch ops it replaced (the first guard's formula: one ``aminmax`` over ``v``, ``lt``, ``gt``,
  ``and``, two ``where``), with the bytes each moves as GB/s (not in the default methods).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pytest
import torch
from minference.kernels import ashape as _ashape
from minference.kernels._common import GPU_TILES
from minference.kernels.block_sparse import normalize_blocks

from minference import kernels

#: Shape of record (Llama-3-8B attention, and Hkv=32 for published comparisons).
HQ = 32
HEAD_DIM = 128
#: Published budgets the targets are stated for.
VS_VERTICAL = 1000
VS_SLASH = 6096
VS_SINK_COLUMNS = 30
VS_LOCAL = 100
VS_CLUSTERS = 16
BS_TOP_K = 100
BS_BLOCK = 64
A_SINK = 128
A_WINDOW = 4096
#: Rows of the dense tail (``patch(dense_tail=...)``) the ``tail`` method times: the testbed's.
TAIL = 128
#: The kernels' GPU tiles (for physical tile counts): minference.kernels._common.GPU_TILES for
#: vertical-slash, the A-shape kernel's own 2-byte tiles for the head dim (``_a_tiles``).
VS_BLOCK_N = GPU_TILES.block_n
#: FlexAttention's block size for the vertical-slash and A-shape masks (its default).
FLEX_BLOCK = 128
#: do_bench budgets (milliseconds of warm-up and of timed repetitions).
WARMUP_MS = 25
REP_MS = 200
#: Calls longer than this are timed directly (LONG_CALL_REPS event-timed runs, median).
LONG_CALL_MS = 500.0
LONG_CALL_REPS = 3


def _flex():
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    return BlockMask, torch.compile(flex_attention, dynamic=False)


# --------------------------------------------------------------------------------------------
# index geometries (logical indices, int32, on the GPU)
# --------------------------------------------------------------------------------------------


def vs_indices(geometry: str, N: int, H: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    ns, nv = min(VS_SLASH, N), min(VS_VERTICAL, N)
    local = torch.arange(min(VS_LOCAL, ns))
    if geometry == "local":
        slash = torch.arange(ns).expand(H, ns)
    elif geometry == "scattered":
        far = torch.randint(0, N, (H, ns - local.numel()), generator=g)
        slash = torch.cat([local.expand(H, -1), far], -1)
    elif geometry == "clustered":
        per = -(-(ns - local.numel()) // VS_CLUSTERS)
        base = torch.randint(0, max(N - per, 1), (H, VS_CLUSTERS, 1), generator=g)
        clusters = (base + torch.arange(per)).reshape(H, -1)[:, : ns - local.numel()].clamp(max=N - 1)
        slash = torch.cat([local.expand(H, -1), clusters], -1)
    else:
        raise ValueError(f"unknown vertical-slash geometry {geometry!r}")
    sinks = torch.arange(min(VS_SINK_COLUMNS, nv)).expand(H, -1)
    vertical = torch.cat([sinks, torch.randint(0, N, (H, nv - sinks.shape[-1]), generator=g)], -1)
    return vertical[None].to(torch.int32).to(device), slash[None].to(torch.int32).to(device)


def bs_indices(N: int, H: int, g: torch.Generator, device) -> torch.Tensor:
    nqb = -(-N // BS_BLOCK)
    I = torch.arange(nqb)[:, None]
    pick = (torch.rand(H, nqb, BS_TOP_K - 2, generator=g) * I).long()  # random earlier blocks (rare repeats)
    blocks = torch.cat([I.expand(H, nqb, 1), torch.zeros(H, nqb, 1, dtype=torch.long), pick], -1)
    return blocks[None].to(torch.int32).to(device)


# --------------------------------------------------------------------------------------------
# logical pairs and physical tiles (exact counts, vectorised)
# --------------------------------------------------------------------------------------------


def dense_pairs(N: int) -> int:
    return N * (N + 1) // 2


def vs_pairs(vertical: torch.Tensor, slash: torch.Tensor, N: int) -> int:
    """``sum_i |N_VS(i)|`` over heads: slashes + columns - (column, offset) pairs that coincide."""
    d = torch.zeros(*slash.shape[:-1], N + 1, dtype=torch.int64, device=slash.device)
    d.scatter_(-1, torch.where(slash < 0, N, slash.long()), 1)  # padding lands in slot N, dropped
    d[..., N] = 0
    c = torch.zeros_like(d)
    c.scatter_(-1, torch.where(vertical < 0, N, vertical.long()), 1)
    c[..., N] = 0
    pos = torch.arange(N + 1, device=slash.device)
    per_offset = (N - pos).clamp(min=0)
    slash_pairs = (d * per_offset).sum()
    col_pairs = (c * per_offset).sum()
    prefix = torch.cumsum(d, -1)  # prefix[x] = |{δ in D: δ <= x}|
    overlap = (c[..., :N] * prefix.gather(-1, (N - 1 - pos[:N]).expand_as(c[..., :N]))).sum()
    return int(slash_pairs + col_pairs - overlap)


def bs_pairs(blocks: torch.Tensor, N: int) -> tuple[int, int]:
    off, count, diag = normalize_blocks(blocks)
    tiles = int(count.sum() + diag.sum())
    nqb = blocks.shape[-2]
    full = N % BS_BLOCK == 0 and N // BS_BLOCK == nqb
    assert full, "benchmark lengths are multiples of the block"
    return int(count.sum()) * BS_BLOCK**2 + int(diag.sum()) * BS_BLOCK * (BS_BLOCK + 1) // 2, tiles


def ashape_pairs(N: int, sink: int, window: int) -> int:
    i = torch.arange(N, dtype=torch.int64)
    return int((torch.minimum(i + 1, torch.tensor(window)) + (i - window + 1).clamp(min=0).clamp(max=sink)).sum())


def ashape_tiles(N: int, sink: int, window: int, bm: int, bn: int) -> int:
    total = 0
    for m0 in range(0, N, bm):
        last = min(m0 + bm, N) - 1
        total += math.ceil(max(min(sink, last - window + 1), 0) / bn)
        lo = max(m0 - window + 1, 0)
        total += math.ceil((last + 1 - lo) / bn)
    return total


# --------------------------------------------------------------------------------------------
# FlexAttention block masks built from the same indices
# --------------------------------------------------------------------------------------------


def _block_mask(BlockMask, partial: torch.Tensor, full: torch.Tensor, mask_mod, N: int, block: int):
    def to_idx(x):
        num = x.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~x).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, idx

    kv_num, kv_idx = to_idx(partial)
    full_num, full_idx = to_idx(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(N, N), compute_q_blocks=False)


def flex_vs_mask(BlockMask, vertical, slash, N: int):
    idx = kernels.convert_vertical_slash(vertical, slash, N, block_m=FLEX_BLOCK)
    B, H = idx.run_count.shape
    nqb = -(-N // FLEX_BLOCK)
    dev = vertical.device
    touched = torch.zeros(B, H, nqb, nqb + 1, dtype=torch.int32, device=dev)
    R = int(idx.run_count.max())
    m0 = torch.arange(nqb, device=dev)[:, None] * FLEX_BLOCK
    da = idx.run_start[..., None, :R].long()
    db = idx.run_end[..., None, :R].long()
    lo = (m0 - db).clamp(min=0)
    hi = torch.minimum(m0 + FLEX_BLOCK - 1 - da, m0 + FLEX_BLOCK - 1)
    ok = (hi >= lo) & (da >= 0)
    one = torch.ones_like(lo, dtype=torch.int32)
    touched.scatter_add_(-1, torch.where(ok, lo // FLEX_BLOCK, nqb), one)
    touched.scatter_add_(-1, torch.where(ok, hi // FLEX_BLOCK + 1, nqb), -one)
    touched = touched.cumsum(-1)[..., :nqb] > 0
    cols = idx.col_index.long()
    hit = torch.zeros(B, H, nqb, nqb + 1, dtype=torch.bool, device=dev)
    hit.scatter_(-1, torch.where(cols >= 0, cols // FLEX_BLOCK, nqb), True)
    touched |= hit[..., :nqb]
    J = torch.arange(nqb, device=dev)
    span_lo = (m0 - J * FLEX_BLOCK - FLEX_BLOCK + 1).clamp(min=0)
    span_hi = (m0 + FLEX_BLOCK - 1 - J * FLEX_BLOCK).clamp(min=0, max=N - 1)
    pre = torch.nn.functional.pad(idx.diag_mask.long().cumsum(-1), (1, 0))  # chosen offsets below each
    covered = pre.gather(-1, (span_hi + 1).reshape(1, 1, -1).expand(B, H, -1)) - pre.gather(
        -1, span_lo.reshape(1, 1, -1).expand(B, H, -1))
    full = (covered.reshape(B, H, nqb, nqb) == 2 * FLEX_BLOCK - 1) & (J[None, :] < m0 // FLEX_BLOCK)
    full &= touched
    diag, colm = idx.diag_mask, idx.col_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((diag[b, h, (q_idx - kv_idx).clamp(min=0)] != 0) | (colm[b, h, kv_idx] != 0))

    return _block_mask(BlockMask, touched & ~full, full, mask_mod, N, FLEX_BLOCK)


def flex_bs_mask(BlockMask, blocks, N: int):
    off, count, diag = normalize_blocks(blocks)
    B, H, nqb, _ = blocks.shape
    dev = blocks.device
    full = torch.zeros(B, H, nqb, nqb + 1, dtype=torch.bool, device=dev)
    full.scatter_(-1, torch.where(off >= 0, off.long(), nqb), True)
    partial = torch.zeros(B, H, nqb, nqb, dtype=torch.bool, device=dev)
    partial |= torch.eye(nqb, dtype=torch.bool, device=dev) & (diag[..., None] != 0)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return _block_mask(BlockMask, partial, full[..., :nqb], causal, N, BS_BLOCK)


def flex_ashape_mask(BlockMask, N: int, sink: int, window: int, device):
    nqb = -(-N // FLEX_BLOCK)
    I = torch.arange(nqb, device=device)[:, None]
    J = torch.arange(nqb, device=device)[None, :]
    m0 = I * FLEX_BLOCK
    touched = (J <= I) & ((J * FLEX_BLOCK < sink) | (J * FLEX_BLOCK + FLEX_BLOCK - 1 > m0 - window))
    full = (J < I) & ((J * FLEX_BLOCK + FLEX_BLOCK <= sink) | (J * FLEX_BLOCK > m0 + FLEX_BLOCK - 1 - window))

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sink) | (kv_idx > q_idx - window))

    return _block_mask(BlockMask, (touched & ~full)[None, None], full[None, None], mask_mod, N, FLEX_BLOCK)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    N: int
    Hkv: int
    method: str
    ms: float | None
    logical_pairs: int
    physical_pairs: int | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def tflops(self, pairs: int | None) -> float | None:
        if self.ms is None or pairs is None:
            return None
        return 4 * HEAD_DIM * pairs * HQ / (self.ms * 1e-3) / 1e12


def _bench(fn: Callable[[], object]) -> float:
    """Median ms: ``do_bench`` for calls under :data:`LONG_CALL_MS`; longer calls (dense at 512K
    takes seconds) are timed :data:`LONG_CALL_REPS` times with CUDA events after one warm-up."""
    import triton.testing

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end)
    if once < LONG_CALL_MS:
        return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
    times = [once]
    for _ in range(LONG_CALL_REPS - 1):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def _try(fn: Callable[[], float]) -> tuple[float | None, str]:
    try:
        return fn(), ""
    except Exception as exc:  # a baseline that fails to build is reported, not fatal
        return None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def run(lengths: list[int], hkvs: list[int], methods: list[str], seed: int, flex: bool) -> list[Row]:
    rows: list[Row] = []
    flex_api = _flex() if flex else None
    for N in lengths:
        for Hkv in hkvs:
            print(f"# N={N} Hkv={Hkv}", file=sys.stderr, flush=True)
            rows += _case(N, Hkv, methods, seed, flex_api)
            torch.cuda.empty_cache()
            print(table(rows), file=sys.stderr, flush=True)  # a run cut short still leaves its rows
    return rows


def _case(N: int, Hkv: int, methods: list[str], seed: int, flex_api) -> list[Row]:
    """Every requested method at one ``(N, Hkv)`` on shared random inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev = "cuda"
    rows: list[Row] = []
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, N, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, N, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, Hkv, N, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    gqa = Hkv != HQ

    def flex_row(name: str, build, pairs: int, block: int = FLEX_BLOCK) -> None:
        if flex_api is None:
            return
        BlockMask, flex_attention = flex_api
        # flex's kernel tile must divide the mask's block (its default 128 does not divide 64)
        options = None if block == FLEX_BLOCK else {"BLOCK_M": block, "BLOCK_N": block}

        def timed() -> float:
            bmask = build(BlockMask)
            return _bench(lambda: flex_attention(q, k, v, block_mask=bmask, enable_gqa=gqa, kernel_options=options))

        ms, note = _try(timed)
        rows.append(Row(N, Hkv, f"FlexAttention {name}", ms, pairs, None, note))

    if "dense" in methods:
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

        ms, note = _try(lambda: _bench(cudnn))
        if ms is None and gqa:  # cuDNN without native GQA: same FLOPs on repeated k, v
            kr, vr = k.repeat_interleave(HQ // Hkv, 1), v.repeat_interleave(HQ // Hkv, 1)

            def cudnn_rep():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return sdpa(q, kr, vr, is_causal=True)

            ms, note2 = _try(lambda: _bench(cudnn_rep))
            note = "k/v repeated (no native GQA)" if ms is not None else note + "; " + note2
        rows.append(Row(N, Hkv, "cuDNN SDPA dense causal", ms, dense_pairs(N), dense_pairs(N), note))

    def vs_rows(geom: str) -> None:
        vertical, slash = vs_indices(geom, N, HQ, g, dev)
        bm = kernels.vertical_slash_block_m(q)
        # the local band has no gaps: filling over bm - 1 keeps its set and tells the kernel that
        # every run is hole-free (as the dispatcher's filling does); the other geometries keep
        # their exact, unfilled sets
        fill = bm - 1 if geom == "local" else 0
        conv_ms = _bench(lambda: kernels.convert_vertical_slash(vertical, slash, N, block_m=bm, fill_gaps=fill))
        index = kernels.convert_vertical_slash(vertical, slash, N, block_m=bm, fill_gaps=fill)
        pairs = vs_pairs(vertical, slash, N) // HQ
        phys = int(kernels.vs_physical_tiles(index, VS_BLOCK_N).sum()) // HQ * bm * VS_BLOCK_N
        ms = _bench(lambda: kernels.vertical_slash_attention_physical(q, k, v, index, out=out, validate=False))
        rows.append(Row(N, Hkv, f"minference VS {geom} (kernel)", ms, pairs, phys, extra={"convert_ms": conv_ms}))
        rows.append(Row(N, Hkv, f"minference VS {geom} (convert + kernel)", ms + conv_ms, pairs, phys))
        flex_row(f"VS {geom}", lambda BM: flex_vs_mask(BM, vertical, slash, N), pairs)

    for geom in [m[3:] for m in methods if m.startswith("vs-")]:
        vs_rows(geom)

    if "bs" in methods:
        blocks = bs_indices(N, HQ, g, dev)
        pairs, tiles = bs_pairs(blocks, N)
        ms = _bench(lambda: kernels.block_sparse_attention(q, k, v, blocks, block=BS_BLOCK, out=out, validate=False))
        rows.append(Row(N, Hkv, "minference block-sparse top-100", ms, pairs // HQ, tiles * BS_BLOCK**2 // HQ))
        flex_row("block-sparse top-100", lambda BM: flex_bs_mask(BM, blocks, N), pairs // HQ, BS_BLOCK)

    if "dense-triton" in methods:  # our dense kernel: A-shape with a window as long as the row
        ms = _bench(lambda: kernels.ashape_attention(q, k, v, 0, N, out=out, validate=False))
        t = _ashape.gpu_tiles_2byte(HEAD_DIM)
        phys = ashape_tiles(N, 0, N, t.block_m, t.block_n) * t.block_m * t.block_n
        rows.append(Row(N, Hkv, "minference dense (A-shape kernel, window N)", ms, dense_pairs(N), phys))

    if "tail" in methods:  # the dispatcher's dense tail: the last TAIL rows against every key
        from minference.dispatch import dense_tail_attention

        pairs = dense_pairs(N) - dense_pairs(N - TAIL)
        split = _ashape._auto_key_split(q, k, None, TAIL, None)
        ms = _bench(lambda: dense_tail_attention(q, k, v, TAIL, out=out, backend="triton"))
        rows.append(Row(N, Hkv, f"minference dense tail, last {TAIL} rows (key split auto: {split})", ms, pairs,
                        None))
        ms = _bench(lambda: dense_tail_attention(q, k, v, TAIL, out=out, backend="triton", key_split=1))
        rows.append(Row(N, Hkv, f"minference dense tail, last {TAIL} rows (unsplit, key_split=1)", ms, pairs, None))

    if "guard" in methods:  # the value guard: read k and v once, write k_masked and v_safe
        moved = 4 * k.numel() * k.element_size()

        def torch_formula():
            lo, hi = torch.aminmax(v, dim=-1)
            finite = ((hi < float("inf")) & (lo > float("-inf")))[..., None]
            return torch.where(finite, k, float("nan")), torch.where(finite, v, 0)

        for name, fn in (("value guard, one Triton pass", lambda: kernels.value_guard(k, v)),
                         ("value guard, torch formula (aminmax + 5 ops)", torch_formula)):
            ms = _bench(fn)
            rows.append(Row(N, Hkv, name, ms, 0, None, f"{ms * 1e3:.1f} us, {moved / ms / 1e6:.0f} GB/s (4 k-sizes)"))

    if "ashape" in methods:
        pairs = ashape_pairs(N, A_SINK, A_WINDOW)
        ms = _bench(lambda: kernels.ashape_attention(q, k, v, A_SINK, A_WINDOW, out=out, validate=False))
        t = _ashape.gpu_tiles_2byte(HEAD_DIM)
        phys = ashape_tiles(N, A_SINK, A_WINDOW, t.block_m, t.block_n) * t.block_m * t.block_n
        rows.append(Row(N, Hkv, "minference A-shape", ms, pairs, phys))
        flex_row("A-shape", lambda BM: flex_ashape_mask(BM, N, A_SINK, A_WINDOW, dev), pairs)
    return rows


#: Tile configurations the ``--sweep`` mode compares (block_m, block_n, warps, stages).
SWEEP = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4),
         (128, 128, 4, 3), (64, 64, 4, 4)]
#: Stages of the vertical-slash gathered column loops compared by ``--sweep``.
COL_SWEEP = [1, 2, 4, 5]
#: Block-sparse (warps, stages) compared by ``--sweep`` (its query tile is the routing block).
BS_SWEEP = [(4, 2), (4, 3), (4, 5), (4, 6), (8, 2), (8, 3), (8, 4), (8, 5)]
#: Key tiles per routing block compared by ``--sweep`` (``block_sparse._KEY_SPLIT``).
BS_SPLITS = (1, 2)


SWEEP_PARTS = ("tiles", "columns", "bs", "paths")


def sweep(N: int, Hkv: int, seed: int, parts=SWEEP_PARTS) -> str:
    """Tuning aid. ``tiles``: A-shape and VS-local under each tile configuration of
    :data:`SWEEP`; ``columns``: VS-local without its gathered column tiles, and its column loops
    under each stage count of :data:`COL_SWEEP`; ``bs``: block-sparse under :data:`BS_SWEEP`;
    ``paths``: VS-local through each compiled path of its kernel (:func:`_paths_sweep`)."""
    from minference.kernels import _common

    q = torch.randn(1, HQ, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, Hkv, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    vertical, slash = vs_indices("local", N, HQ, torch.Generator().manual_seed(seed), "cuda")
    default, default_a = _common.GPU_TILES, dict(_ashape._GPU_TILES_2BYTE)
    lines = [f"| tiles (N={N}, Hkv={Hkv}) | A-shape ms | dense (A-shape kernel) ms | VS local kernel ms |",
             "|---|---|---|---|"] if "tiles" in parts else []
    try:
        for bm, bn, warps, stages in SWEEP if "tiles" in parts else []:
            _common.GPU_TILES = _common.Tiles(bm, bn, warps, stages)
            _ashape._GPU_TILES_2BYTE.update({d: _common.GPU_TILES for d in default_a})
            _common._FITTED.clear()  # the fitted tiles are remembered per kernel key, not per preference
            index = kernels.convert_vertical_slash(vertical, slash, N, block_m=bm)
            a, _ = _try(lambda: _bench(lambda: kernels.ashape_attention(q, k, v, A_SINK, A_WINDOW, validate=False)))
            d, _ = _try(lambda: _bench(lambda: kernels.ashape_attention(q, k, v, 0, N, validate=False)))
            b, note = _try(lambda: _bench(  # noqa: B023
                lambda: kernels.vertical_slash_attention_physical(q, k, v, index, validate=False)))  # noqa: B023
            fmt = lambda x: "failed" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(f"| {bm}x{bn} w{warps} s{stages} | {fmt(a)} | {fmt(d)} | {fmt(b)} {note[:60]} |")
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        _common.GPU_TILES = default
        _ashape._GPU_TILES_2BYTE.update(default_a)
        _common._FITTED.clear()
    if "columns" in parts:
        lines += _column_sweep(q, k, v, vertical, slash, N, default)
    if "bs" in parts:
        lines += _bs_sweep(q, k, v, N, seed)
    if "paths" in parts:
        lines += _paths_sweep(q, k, v, vertical, slash, N, default)
    return "\n".join(lines)


def _without_columns(index):
    """``index`` with no leftover column tiles (its range part alone)."""
    return dataclasses.replace(index, col_count=torch.zeros_like(index.col_count),
                               col_before=torch.zeros_like(index.col_before))


def _paths_sweep(q, k, v, vertical, slash, N: int, default) -> list[str]:
    """VS-local through each compiled path of the kernel: the bitmap path compiled (an unfilled
    index) or not (the all-solid build: an index filled over ``block_m - 1``, the same set, every
    run hole-free); the all-solid build without any column tiles; and A-shape with no sinks and a
    window of ``NS`` (VS-local's band alone, the ceiling of its range part)."""
    bm = default.block_m
    lines = ["", f"| VS local, kernel paths (N={N}, Hkv={k.shape[1]}) | ms |", "|---|---|"]

    def row(name, fn):
        t, note = _try(lambda: _bench(fn))
        lines.append(f"| {name} | {'failed' if t is None else f'{t:.2f}'} {note} |")
        print(lines[-1], file=sys.stderr, flush=True)

    plain = kernels.convert_vertical_slash(vertical, slash, N, block_m=bm)
    filled = kernels.convert_vertical_slash(vertical, slash, N, block_m=bm, fill_gaps=bm - 1)
    for name, idx in (("unfilled (bitmap path compiled)", plain), ("all-solid", filled),
                      ("all-solid, without its column tiles", _without_columns(filled))):
        row(name, lambda idx=idx: kernels.vertical_slash_attention_physical(q, k, v, idx, validate=False))
    row(f"A-shape, no sinks, window {slash.shape[-1]} (VS-local's band alone)",
        lambda: kernels.ashape_attention(q, k, v, 0, slash.shape[-1], validate=False))
    return lines


def _column_sweep(q, k, v, vertical, slash, N: int, default) -> list[str]:
    """VS-local at the default tiles, without its leftover (gathered) column tiles, and with its
    column loops pipelined in each stage count of :data:`COL_SWEEP`."""
    lines = []
    index = kernels.convert_vertical_slash(vertical, slash, N, block_m=default.block_m)
    no_cols = _without_columns(index)
    from minference.kernels import vertical_slash

    stages0 = vertical_slash.COLUMN_STAGES
    try:
        for name, idx, col_stages in (("VS local, default tiles", index, stages0),
                                      ("VS local without its gathered column tiles", no_cols, stages0),
                                      *((f"VS local, column loops in {s} stages", index, s) for s in COL_SWEEP)):
            vertical_slash.COLUMN_STAGES = col_stages
            t, note = _try(lambda: _bench(lambda: kernels.vertical_slash_attention_physical(  # noqa: B023
                q, k, v, idx, validate=False)))  # noqa: B023
            tiles = int(kernels.vs_physical_tiles(idx, default.block_n).sum())
            lines.append(f"| {name}: {tiles} key tiles | | {'failed' if t is None else f'{t:.2f}'} {note} |")
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        vertical_slash.COLUMN_STAGES = stages0
    return lines


def _bs_band(N: int, H: int, device) -> torch.Tensor:
    """Block-sparse index of :data:`BS_TOP_K` contiguous blocks per query block: the diagonal and
    the blocks just before it (an A-shape window without sinks in block form), as many as
    :func:`bs_indices` picks but each read by the neighbouring query blocks too (L2 reuse)."""
    nqb = -(-N // BS_BLOCK)
    blocks = torch.arange(nqb)[:, None] - torch.arange(BS_TOP_K)[None, :]
    return blocks.clamp(min=-1).expand(1, H, nqb, BS_TOP_K).to(torch.int32).contiguous().to(device)


def _bs_sweep(q, k, v, N: int, seed: int) -> list[str]:
    """Block-sparse under each (warps, stages, key split) of :data:`BS_SWEEP` x
    :data:`BS_SPLITS`, on two indices of the same size: random blocks (:func:`bs_indices`) and a
    contiguous band (:func:`_bs_band`); ns per 64 x 64 tile computed (the diagonal block whole),
    beside the dense kernel's at this shape. The stages column is what the launcher fitted (it
    drops stages until the program fits shared memory)."""
    from minference.kernels import _common, block_sparse

    H = q.shape[1]
    indices = {"random": bs_indices(N, H, torch.Generator().manual_seed(seed), "cuda"),
               "band": _bs_band(N, H, "cuda")}
    per_block = (BS_BLOCK // 64) ** 2

    def tiles64(blocks) -> float:
        _, count, diag = normalize_blocks(blocks)
        return float(count.sum() + diag.sum()) * per_block

    dense_ms, note = _try(lambda: _bench(lambda: kernels.dense_attention(q, k, v, validate=False)))
    dense_tiles = H * (N // 64) * (N // 64 + 1) / 2
    lines = ["", f"| block-sparse {BS_BLOCK}, top {BS_TOP_K} (N={N}, Hq={H}, Hkv={k.shape[1]}, D={q.shape[-1]}) "
             "| fitted tiles | random ms | random ns/tile | band ms | band ns/tile |", "|---|---|---|---|---|---|",
             f"| dense kernel | | {'failed' if dense_ms is None else f'{dense_ms:.2f}'} {note} | "
             f"{'' if dense_ms is None else f'{dense_ms * 1e6 / dense_tiles:.3f}'} | | |"]
    saved = (dict(block_sparse._GPU_WARPS), dict(block_sparse._GPU_STAGES), dict(block_sparse._GPU_SMALL_D),
             dict(block_sparse._KEY_SPLIT))
    block_sparse._GPU_SMALL_D.clear()  # the sweep's (warps, stages) at every head dim
    try:
        for split in BS_SPLITS:
            for warps, stages in BS_SWEEP:
                block_sparse._GPU_WARPS[BS_BLOCK], block_sparse._GPU_STAGES[BS_BLOCK] = warps, stages
                block_sparse._KEY_SPLIT[BS_BLOCK] = split
                _common._FITTED.clear()
                cells, fitted = [], ""
                for blocks in indices.values():
                    c, note = _try(lambda: _bench(lambda: kernels.block_sparse_attention(  # noqa: B023
                        q, k, v, blocks, block=BS_BLOCK, validate=False)))  # noqa: B023
                    cells += ["failed " + note if c is None else f"{c:.2f}",
                              "" if c is None else f"{c * 1e6 / tiles64(blocks):.3f}"]
                    fitted = fitted or " ".join(f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
                                                for key, t in _common._FITTED.items() if key[0] == "block_sparse")
                lines.append(f"| w{warps} s{stages} split {split} | {fitted} | " + " | ".join(cells) + " |")
                print(lines[-1], file=sys.stderr, flush=True)
    finally:
        for table_, old in zip((block_sparse._GPU_WARPS, block_sparse._GPU_STAGES, block_sparse._GPU_SMALL_D,
                                block_sparse._KEY_SPLIT), saved):
            table_.clear()
            table_.update(old)
        _common._FITTED.clear()
    return lines


def table(rows: list[Row]) -> str:
    lines = ["| N | Hkv | method | ms | logical TFLOP/s | physical TFLOP/s | logical pairs/head | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "—" if r.ms is None else f"{r.ms:.2f}"
        lt = r.tflops(r.logical_pairs)
        pt = r.tflops(r.physical_pairs)
        note = r.note + (f" convert {r.extra['convert_ms']:.2f} ms" if "convert_ms" in r.extra else "")
        lines.append(f"| {r.N // 1024}K | {r.Hkv} | {r.method} | {ms} | {'—' if lt is None else f'{lt:.0f}'} | "
                     f"{'—' if pt is None else f'{pt:.0f}'} | {r.logical_pairs:.3e} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    global HQ, HEAD_DIM, BS_BLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--hkv", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--methods", nargs="+",
                    default=["dense", "vs-local", "vs-clustered", "vs-scattered", "bs", "ashape"])
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baselines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--sweep", nargs="*", choices=SWEEP_PARTS, default=None,
                    help="first compare configurations at the first length (all parts when none named)")
    ap.add_argument("--hq", type=int, default=HQ, help=f"query heads (default {HQ}; the Qwen testbed: 14)")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM, choices=kernels.SUPPORTED_HEAD_DIMS,
                    help=f"head dim (default {HEAD_DIM}; the Qwen testbed: 64)")
    ap.add_argument("--bs-block", type=int, default=BS_BLOCK, choices=(64, 128),
                    help=f"block-sparse routing block (default {BS_BLOCK}; the bundled Qwen config: 128)")
    args = ap.parse_args(argv)
    if args.hq < 1 or any(args.hq % h for h in args.hkv):
        ap.error(f"--hq {args.hq} must be a positive multiple of every --hkv {args.hkv}")
    HQ, HEAD_DIM, BS_BLOCK = args.hq, args.head_dim, args.bs_block
    if args.sweep is not None:
        print(sweep(args.lengths[0], args.hkv[0], args.seed, args.sweep or SWEEP_PARTS), flush=True)
    rows = run(args.lengths, args.hkv, args.methods, args.seed, flex=not args.no_flex)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 Hq={HQ} D={HEAD_DIM} bf16, "
          f"do_bench median")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


# --------------------------------------------------------------------------------------------
# pytest-benchmark mode
# --------------------------------------------------------------------------------------------

BENCH_N = 32768


def _inputs(N: int, Hkv: int):
    return [torch.randn(1, h, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for h in (HQ, Hkv, Hkv)]


def _timed(benchmark, fn):
    def call():
        fn()
        torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    benchmark.pedantic(call, rounds=20, warmup_rounds=3)


@pytest.mark.bench
@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [32, 8])
@pytest.mark.parametrize("geometry", ["local", "scattered"])
def test_bench_vertical_slash(benchmark, Hkv, geometry):
    q, k, v = _inputs(BENCH_N, Hkv)
    vertical, slash = vs_indices(geometry, BENCH_N, HQ, torch.Generator().manual_seed(0), "cuda")
    _timed(benchmark, lambda: kernels.vertical_slash_attention(q, k, v, vertical, slash, validate=False))


@pytest.mark.bench
@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [32, 8])
def test_bench_block_sparse(benchmark, Hkv):
    q, k, v = _inputs(BENCH_N, Hkv)
    blocks = bs_indices(BENCH_N, HQ, torch.Generator().manual_seed(0), "cuda")
    _timed(benchmark, lambda: kernels.block_sparse_attention(q, k, v, blocks, block=BS_BLOCK, validate=False))


@pytest.mark.bench
@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [32, 8])
def test_bench_ashape(benchmark, Hkv):
    q, k, v = _inputs(BENCH_N, Hkv)
    _timed(benchmark, lambda: kernels.ashape_attention(q, k, v, A_SINK, A_WINDOW, validate=False))


@pytest.mark.bench
@pytest.mark.gpu
@pytest.mark.parametrize("Hkv", [32, 8])
def test_bench_cudnn_dense(benchmark, Hkv):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v = _inputs(BENCH_N, Hkv)
    k, v = k.repeat_interleave(HQ // Hkv, 1), v.repeat_interleave(HQ // Hkv, 1)

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(q, k, v, is_causal=True)
    _timed(benchmark, dense)


if __name__ == "__main__":
    main()
