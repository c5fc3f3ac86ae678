"""End-to-end sparse prefill on the GPU: index build + conversion + kernel, next to cuDNN dense
attention in the same run.

``python benchmarks/bench_end_to_end.py --lengths 8192 32768 131072 --json out.json``
(script: the breakdown table), or ``python -m pytest benchmarks/bench_end_to_end.py -m bench
--benchmark-only`` (pytest-benchmark: end to end only, smooth inputs).

Shape of record: B=1, Hq=32, Hkv=8, D=128, bf16. Vertical-slash uses the
published budgets (1000 columns, 6096 diagonals, last 64 queries, 30 sink columns, 100 local
diagonals); every head gets the same pattern. For each length the table gives, median ms:

* ``index``: :func:`minference.kernels.vertical_slash_index` (two Triton passes, the
  log-sum-exp merge and the GPU top-k);
* ``convert``: :func:`minference.kernels.convert_vertical_slash`;
* ``kernel``: :func:`minference.kernels.vertical_slash_attention_physical` on the converted
  index with the dispatcher's gap filling (:data:`minference.dispatch.FILL_GAPS`);
  ``kernel_nofill`` on the estimator's exact set (holes inside runs masked);
* ``e2e``: :func:`minference.dispatch.sparse_prefill` (all of the above plus allocation);
* ``e2e_graph``: the same call captured once in a CUDA graph and replayed (the dispatcher never
  synchronises with the host, so it captures): the GPU work without the host's launch cost,
  which dominates the index build and the conversion at short lengths;
* ``e2e_b2b`` and ``dense_b2b``: mean per call of eager calls issued back to back with no
  synchronisation in between (:func:`time_back_to_back_ms`), as the layers of a prefill follow
  one another: the host's work for a call overlaps the GPU's for the previous one. ``e2e`` and
  ``dense`` time each call alone from an idle GPU (the host's time to the first launch counts);
* ``dense``: ``scaled_dot_product_attention`` under the cuDNN backend (kv heads expanded to 32
  outside the timing, since cuDNN's GQA support varies), causal.

Inputs (``--inputs``):

* ``random``: q, k, v standard normal. Attention is flat, so the estimator's 6096 best
  diagonals are scattered over the whole prompt and the kernel touches nearly every key tile:
  the worst case (dense cost through a sparse kernel).
* ``smooth``: structured like a real head (see :func:`smooth_qkv`): q and k share a slowly
  varying latent (random Fourier features of a Gaussian kernel of width ``SMOOTH_LENGTH``
  tokens, peak logit bias ``SMOOTH_STRENGTH``) over noise of std ``SMOOTH_NOISE``, plus
  ``SINKS`` sink keys every query likes. The estimator then picks a few clustered diagonal runs
  (about 120 key tiles per query block at every length from 16K to 1M, measured on the CPU with
  the torch builder) and the sink columns.

``--patterns-at`` adds A-shape (128, 4096) and block-sparse (top 100 of 64-blocks) end to end;
``--adaptive-at`` the budget rules of :data:`ADAPTIVE`, each with its captured attention mass
(up to :data:`MASS_MAX` tokens), in a second table per length.
Dense is measured only up to ``--dense-max`` (a 1M-token dense call alone takes ~19 s); beyond
it the table says ``n/a`` and the docs extrapolate (causal attention cost grows as N^2).

Timing: CUDA events around each call after one warm-up (compilation) call, median of
``reps`` calls, ``reps`` chosen so one measurement takes about ``--budget-ms``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F
from minference.kernels import convert as convert_module
from minference.kernels import estimate_vs
from minference.kernels import select as kernel_select

from minference import kernels
from minference.dispatch import FILL_GAPS, sparse_prefill
from minference.patterns import AShape, BlockSparse, VerticalSlash

HQ, HKV, HEAD_DIM = 32, 8, 128
VS = VerticalSlash(vertical=1000, slash=6096)
ASHAPE = AShape(sink=128, window=4096)
BLOCKS = BlockSparse(top_k=100)
#: ``--adaptive-at``: the budget rules of the adaptive-budget issue, each end to end with its
#: captured attention mass (the search's quality measure): vertical-slash under the mass rule
#: (gamma 0.9, the search's candidate caps) and block-sparse with the query-aware score under the
#: relative rule (FlashPrefill's alpha 0.1, and 0.03), block 128, at most 512 blocks a query block.
ADAPTIVE = {
    "vs_mass90": VerticalSlash(vertical=2048, slash=8192, rule="mass", threshold=0.9),
    "bs_rel10": BlockSparse(top_k=512, block=128, rule="relative", threshold=0.1, estimate="query"),
    "bs_rel03": BlockSparse(top_k=512, block=128, rule="relative", threshold=0.03, estimate="query"),
}
#: Captured mass is scored on ~MASS_ROWS query rows, and only up to MASS_MAX tokens (the scoring
#: holds a [Hq, rows, N] float32 score block).
MASS_ROWS, MASS_MAX = 128, 131072
#: Timed calls per measurement are chosen to fill about this many milliseconds (at least MIN_REPS).
BUDGET_MS = 300.0
MIN_REPS, MAX_REPS = 3, 50
#: ``smooth`` inputs: latent correlation length (tokens), peak logit bias, noise std, sink keys
#: and their logit bias, random Fourier features of the latent.
SMOOTH_LENGTH = 2048.0
SMOOTH_STRENGTH = 6.0
SMOOTH_NOISE = 0.5
SINKS = 4
SINK_LOGIT = 4.0
SMOOTH_FEATURES = 256


def smooth_qkv(N: int, seed: int, *, device="cuda", dtype=torch.bfloat16):
    """``q [1,HQ,N,D]``, ``k, v [1,HKV,N,D]`` with local + sink structure (module docstring)."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = HEAD_DIM ** -0.5
    omega = torch.randn(HKV, 1, SMOOTH_FEATURES, generator=g, device=device) / SMOOTH_LENGTH
    phase = torch.rand(HKV, 1, SMOOTH_FEATURES, generator=g, device=device) * 2 * math.pi
    mix = torch.randn(HKV, SMOOTH_FEATURES, HEAD_DIM, generator=g, device=device) * math.sqrt(2.0 / SMOOTH_FEATURES)
    t = torch.arange(N, device=device, dtype=torch.float32)[None, :, None]
    z = torch.matmul(torch.cos(t * omega + phase), mix)  # [HKV, N, D]: E z_i.z_j = D exp(-(i-j)^2 / 2L^2)
    a = math.sqrt(SMOOTH_STRENGTH / (HEAD_DIM * scale))
    sink_dir = torch.randn(HKV, HEAD_DIM, generator=g, device=device)
    sink_dir = sink_dir / sink_dir.norm(dim=-1, keepdim=True) * math.sqrt(SINK_LOGIT / scale)
    group = HQ // HKV
    q = torch.randn(1, HQ, N, HEAD_DIM, generator=g, device=device) * SMOOTH_NOISE
    q += (a * z + sink_dir[:, None, :]).repeat_interleave(group, 0)[None]
    k = torch.randn(1, HKV, N, HEAD_DIM, generator=g, device=device) * SMOOTH_NOISE
    k += a * z[None]
    k[:, :, :SINKS] += sink_dir[None, :, None, :]
    del z
    v = torch.randn(1, HKV, N, HEAD_DIM, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


#: Calls longer than this (dense attention at 1M: ~19 s) are timed once after the warm-up.
ONCE_MS = 2000.0


def _first_call(fn, budget_ms: float) -> tuple[float, int]:
    """One warm-up (compilation) call, then one CUDA-event-timed call: its ms, and how many timed
    calls fill about ``budget_ms`` (0 when that one call is over :data:`ONCE_MS`)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    if first > ONCE_MS:
        return first, 0
    return first, int(min(MAX_REPS, max(MIN_REPS, budget_ms // max(first, 1e-3))))


def time_ms(fn, budget_ms: float = BUDGET_MS) -> float:
    """Median ms of ``fn()`` after one warm-up call (CUDA events); a call over :data:`ONCE_MS`
    is timed once."""
    first, reps = _first_call(fn, budget_ms)
    if reps == 0:
        return first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_back_to_back_ms(fn, budget_ms: float = BUDGET_MS) -> float:
    """Mean ms per call of ``fn()`` called back to back with no synchronisation in between (CUDA
    events around the whole loop, after one warm-up call): how layers follow one another in a
    model's prefill, where the host prepares the next call while the GPU runs the previous one,
    so host time hides behind GPU time unless it is the longer of the two."""
    first, reps = _first_call(fn, budget_ms)
    if reps == 0:
        return first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after a warm-up call on a side stream); returns the
    replay. Times the same GPU work without the host's per-launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def profile(N: int, *, inputs: str) -> str:
    """Top CUDA-time ops of one index build and one conversion at length ``N`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, _ = qkv_inputs(N, inputs)
    block_m = kernels.vertical_slash_block_m(q)

    def step():
        vertical, slash = vs_index(q, k)
        return kernels.convert_vertical_slash(vertical, slash, N, block_m=block_m, fill_gaps=FILL_GAPS)

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


#: (key tile, warps) of the vertical-slash estimator compared by ``--index-sweep``.
INDEX_SWEEP = [(64, 2), (64, 4), (64, 8), (128, 4)]
#: Gap fillings of the converter compared by ``--fill-sweep`` (the dispatcher's is FILL_GAPS).
FILL_SWEEP = [127, 255, 383, 511, 767, 1023]
#: Converter variants compared by ``--convert-sweep``: warps of its sorting launch, or ``None`` for
#: the torch-ops path (what every call took before the Triton launches).
CONVERT_SWEEP = [None, 4, 8, 16, 32]
#: Selections compared by ``--select-sweep``: (scores per step, warps) of the selection kernel,
#: or ``None`` for the torch ops (``torch.topk``) it replaced.
SELECT_SWEEP = [None, (4096, 8), (16384, 16)]


def index_sweep(N: int, *, inputs: str, budget_ms: float) -> str:
    """The index build at length ``N`` under each :data:`INDEX_SWEEP` configuration of the
    estimator (ms, and whether its column / diagonal scores match the default's)."""
    q, k, _ = qkv_inputs(N, inputs)
    default = estimate_vs.VS_KEY_TILE, estimate_vs.VS_WARPS

    def scores():
        return vs_index(q, k, return_scores=True)[2:]

    base = scores()
    lines = [f"| VS index (N={N}) key tile, warps | ms | scores match default |", "|---|---|---|"]
    try:
        for tile, warps in INDEX_SWEEP:
            estimate_vs.VS_KEY_TILE, estimate_vs.VS_WARPS = tile, warps
            col, diag = scores()
            same = all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip((col, diag), base))
            lines.append(f"| {tile}, {warps} | {time_ms(lambda: vs_index(q, k), budget_ms):.3f} | {same} |")
    finally:
        estimate_vs.VS_KEY_TILE, estimate_vs.VS_WARPS = default
    return "\n".join(lines)


def fill_sweep(N: int, *, inputs: str, budget_ms: float) -> str:
    """The VS kernel at length ``N`` on the estimated index converted under each gap filling of
    :data:`FILL_SWEEP` (ms, key tiles, runs per head)."""
    q, k, v = qkv_inputs(N, inputs)
    vertical, slash = vs_index(q, k)
    block_m = kernels.vertical_slash_block_m(q)
    out = torch.empty_like(q)
    lines = [f"| VS kernel (N={N}) fill_gaps | ms | key tiles | runs per head |", "|---|---|---|---|"]
    for gaps in FILL_SWEEP:
        phys = kernels.convert_vertical_slash(vertical, slash, N, block_m=block_m, fill_gaps=gaps)
        ms = time_ms(lambda: kernels.vertical_slash_attention_physical(q, k, v, phys, out=out,  # noqa: B023
                                                                       validate=False), budget_ms)
        tiles = int(kernels.vs_physical_tiles(phys, 64).sum())
        lines.append(f"| {gaps} | {ms:.2f} | {tiles} | {phys.run_count.float().mean():.1f} |")
    return "\n".join(lines)


def convert_sweep(N: int, *, inputs: str, budget_ms: float) -> str:
    """The conversion of the estimated index at length ``N`` under each :data:`CONVERT_SWEEP`
    variant, eager and replayed from a CUDA graph (ms), and whether it equals the default's."""
    q, k, _ = qkv_inputs(N, inputs)
    vertical, slash = vs_index(q, k)
    block_m = kernels.vertical_slash_block_m(q)

    def convert():
        return kernels.convert_vertical_slash(vertical, slash, N, block_m=block_m, fill_gaps=FILL_GAPS)

    base = convert()
    lines = [f"| VS convert (N={N}) variant | eager ms | graph ms | equals default |", "|---|---|---|---|"]
    default = convert_module.LISTS_WARPS, convert_module.LIST_CAP
    try:
        for warps in CONVERT_SWEEP:
            if warps is None:
                convert_module.LIST_CAP = 0
            else:
                convert_module.LISTS_WARPS, convert_module.LIST_CAP = warps, default[1]
            got = convert()
            same = all(torch.equal(getattr(got, f.name), getattr(base, f.name)) for f in dataclasses.fields(got)
                       if isinstance(getattr(got, f.name), torch.Tensor))
            eager, graph = time_ms(convert, budget_ms), time_ms(graphed(convert), budget_ms)
            name = "torch ops" if warps is None else f"lists kernel, {warps} warps"
            lines.append(f"| {name} | {eager:.3f} | {graph:.3f} | {same} |")
    finally:
        convert_module.LISTS_WARPS, convert_module.LIST_CAP = default
    return "\n".join(lines)


def select_sweep(N: int, *, inputs: str, budget_ms: float) -> str:
    """The whole index build at length ``N`` under each :data:`SELECT_SWEEP` selection, eager and
    replayed from a CUDA graph (ms), and whether its sets equal the default's."""
    q, k, _ = qkv_inputs(N, inputs)

    def sets():
        return [torch.sort(x.clamp(min=-1), dim=-1).values for x in vs_index(q, k)]

    base = sets()
    lines = [f"| VS index (N={N}) selection | eager ms | graph ms | same sets |", "|---|---|---|---|"]
    default = kernel_select.SELECT_MAX_N, kernel_select.SELECT_CHUNK, kernel_select.SELECT_WARPS
    try:
        for variant in SELECT_SWEEP:
            if variant is None:
                kernel_select.SELECT_MAX_N = 0
            else:
                kernel_select.SELECT_MAX_N = N
                kernel_select.SELECT_CHUNK, kernel_select.SELECT_WARPS = variant
            same = all(torch.equal(a, b) for a, b in zip(sets(), base))
            eager = time_ms(lambda: vs_index(q, k), budget_ms)
            graph = time_ms(graphed(lambda: vs_index(q, k)), budget_ms)
            name = "torch ops (topk)" if variant is None else f"kernel, {variant[0]} per step, {variant[1]} warps"
            lines.append(f"| {name} | {eager:.3f} | {graph:.3f} | {same} |")
    finally:
        kernel_select.SELECT_MAX_N, kernel_select.SELECT_CHUNK, kernel_select.SELECT_WARPS = default
    return "\n".join(lines)


def host_profile(N: int, *, inputs: str, calls: int = 50) -> str:
    """Where the host's time goes in ``sparse_prefill`` at length ``N``: cProfile of ``calls``
    eager calls (the GPU runs ahead; the host is what the eager short lengths wait for)."""
    import cProfile
    import io
    import pstats

    q, k, v = qkv_inputs(N, inputs)
    plan = [VS] * HQ
    for _ in range(3):
        sparse_prefill(q, k, v, plan, dense_threshold=0, validate=False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        sparse_prefill(q, k, v, plan, dense_threshold=0, validate=False)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    return f"host profile of {calls} sparse_prefill calls at N={N}:\n{text.getvalue()}"


def cudnn_dense(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)

    return run


def qkv_inputs(N: int, inputs: str):
    """q, k, v of the shape of record: :func:`smooth_qkv`, or standard normal (``random``)."""
    if inputs == "smooth":
        return smooth_qkv(N, seed=N)
    g = torch.Generator(device="cuda").manual_seed(N)
    q = torch.randn(1, HQ, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HKV, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def vs_index(q, k, return_scores: bool = False):
    """The dispatcher's vertical-slash index build for :data:`VS` (sync-free)."""
    return kernels.vertical_slash_index(
        q, k, VS.vertical, VS.slash, last_q=VS.last_q, sink_columns=VS.sink_columns,
        local_diagonals=VS.local_diagonals, aggregation=VS.aggregation, extra_rows=VS.extra_rows,
        vertical_width=VS.vertical, slash_width=VS.slash, return_scores=return_scores, validate=False)


def captured_mass(q, k, pattern) -> tuple[float, float]:
    """Mean captured attention mass and logical density of ``pattern`` over the heads, on every
    ``N // MASS_ROWS``-th query row (``minference.app.search.head_scores``)."""
    from minference.app.search import head_scores

    mass, density = head_scores(q[0], k[0], [pattern], row_stride=max(1, q.shape[2] // MASS_ROWS))
    return float(mass.mean()), float(density.mean())


def measure(N: int, *, inputs: str, dense_max: int, patterns: bool, budget_ms: float,
            adaptive: bool = False) -> dict:
    q, k, v = qkv_inputs(N, inputs)
    row: dict = {"N": N, "inputs": inputs}

    vertical, slash = vs_index(q, k)
    block_m = kernels.vertical_slash_block_m(q)

    def convert(fill_gaps=FILL_GAPS):
        return kernels.convert_vertical_slash(vertical, slash, N, block_m=block_m, fill_gaps=fill_gaps)

    phys = convert()
    out = torch.empty_like(q)
    row["index"] = time_ms(lambda: vs_index(q, k), budget_ms)
    row["convert"] = time_ms(convert, budget_ms)
    row["kernel"] = time_ms(lambda: kernels.vertical_slash_attention_physical(q, k, v, phys, out=out, validate=False),
                            budget_ms)
    exact = convert(0)  # the estimator's exact set, holes masked (what the dispatcher ran before filling)
    row["kernel_nofill"] = time_ms(
        lambda: kernels.vertical_slash_attention_physical(q, k, v, exact, out=out, validate=False), budget_ms)
    exact = None  # free it before the end-to-end runs
    # the model's path: no value checks (they sync once per call; the integration skips them too)
    def e2e(pattern):
        return lambda: sparse_prefill(q, k, v, [pattern] * HQ, dense_threshold=0, validate=False)

    row["e2e"] = time_ms(e2e(VS), budget_ms)
    row["e2e_graph"] = time_ms(graphed(e2e(VS)), budget_ms)
    row["e2e_b2b"] = time_back_to_back_ms(e2e(VS), budget_ms)
    row["tiles"] = int(kernels.vs_physical_tiles(phys, 64).sum())
    if patterns:
        row["ashape_e2e"] = time_ms(e2e(ASHAPE), budget_ms)
        row["block_e2e"] = time_ms(e2e(BLOCKS), budget_ms)
    if adaptive:
        for name, pattern in {"vs": VS, **ADAPTIVE}.items():
            if name != "vs":
                row[f"{name}_e2e"] = time_ms(e2e(pattern), budget_ms)
            if N <= MASS_MAX:
                row[f"{name}_mass"], row[f"{name}_density"] = captured_mass(q, k, pattern)
                torch.cuda.empty_cache()
    if N <= dense_max:
        try:
            row["dense"] = time_ms(cudnn_dense(q, k, v), budget_ms)
            row["dense_b2b"] = time_back_to_back_ms(cudnn_dense(q, k, v), budget_ms)
        except RuntimeError as err:  # cuDNN refused the shape: record the default SDPA instead
            print(f"cuDNN SDPA failed at N={N}: {err}", file=sys.stderr)
            row["dense_default_sdpa"] = time_ms(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), budget_ms)
    return row


def adaptive_table(row: dict) -> str:
    """The ``--adaptive-at`` results of one length: end to end ms, x dense, captured mass, density."""
    lines = [f"adaptive rules at N={row['N']} ({row['inputs']} inputs)",
             "| pattern | e2e ms | dense / e2e | captured mass | logical density |", "|---|---|---|---|---|"]
    for name in ("vs", *ADAPTIVE):
        ms = row["e2e"] if name == "vs" else row[f"{name}_e2e"]
        speed = f"{row['dense'] / ms:.2f}" if "dense" in row else "n/a"
        mass, dens = row.get(f"{name}_mass"), row.get(f"{name}_density")
        cells = [f"{x:.4f}" if x is not None else "n/a" for x in (mass, dens)]
        lines.append(f"| {name} | {ms:.2f} | {speed} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


#: The ``--*-sweep`` options, in the order they run: flag -> (function of ``(N, *, inputs,
#: budget_ms)`` returning a table, what it times).
SWEEPS = {
    "select-sweep": (select_sweep, "the index build under each selection variant"),
    "convert-sweep": (convert_sweep, "the conversion under each converter variant"),
    "fill-sweep": (fill_sweep, "the VS kernel under each gap filling of the converter"),
    "index-sweep": (index_sweep, "the VS index build under each estimator configuration"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 131072])
    parser.add_argument("--dense-max", type=int, default=131072)
    parser.add_argument("--inputs", choices=("random", "smooth"), default="smooth")
    parser.add_argument("--patterns-at", type=int, nargs="*", default=[],
                        help="lengths at which A-shape and block-sparse run end to end too")
    parser.add_argument("--adaptive-at", type=int, nargs="*", default=[],
                        help="lengths at which the ADAPTIVE budget rules run end to end too, with captured mass")
    parser.add_argument("--budget-ms", type=float, default=BUDGET_MS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="first print the top CUDA-time ops of index + conversion at these lengths")
    for flag, (_, help_) in SWEEPS.items():
        parser.add_argument(f"--{flag}", type=int, nargs="*", default=[], help=f"first time {help_} at these lengths")
    parser.add_argument("--host-profile", type=int, nargs="*", default=[],
                        help="first print a cProfile of eager sparse_prefill calls at these lengths")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for N in args.host_profile:
        print(host_profile(N, inputs=args.inputs), file=sys.stderr, flush=True)
    for flag, (sweep, _) in SWEEPS.items():
        for N in getattr(args, flag.replace("-", "_")):
            print(sweep(N, inputs=args.inputs, budget_ms=args.budget_ms), flush=True)
    for N in args.profile:
        print(f"profile of index build + conversion at N={N}:\n{profile(N, inputs=args.inputs)}", file=sys.stderr,
              flush=True)
    rows = []
    cols = ["inputs", "N", "index", "convert", "kernel", "kernel_nofill", "e2e", "e2e_graph", "e2e_b2b", "dense",
            "dense_b2b", "ashape_e2e", "block_e2e", "tiles"]
    print("| " + " | ".join(cols) + " | index/e2e | dense/e2e | dense_b2b/e2e_b2b |")
    print("|" + "---|" * (len(cols) + 3))
    for N in args.lengths:
        row = measure(N, inputs=args.inputs, dense_max=args.dense_max, patterns=N in args.patterns_at,
                      budget_ms=args.budget_ms, adaptive=N in args.adaptive_at)
        rows.append(row)
        cells = [f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, "n/a")) for c in cols]
        ratio = row["index"] / row["e2e"]
        speed = f"{row['dense'] / row['e2e']:.2f}" if "dense" in row else "n/a"
        speed_b2b = f"{row['dense_b2b'] / row['e2e_b2b']:.2f}" if "dense_b2b" in row else "n/a"
        print("| " + " | ".join(cells) + f" | {ratio:.1%} | {speed} | {speed_b2b} |", flush=True)
        torch.cuda.empty_cache()
        if N in args.adaptive_at:
            print(adaptive_table(row), flush=True)
        if args.json:  # after every length, so a run stopped at its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                          indent=1)


@pytest.mark.bench
@pytest.mark.gpu
@pytest.mark.parametrize("N", [32768, 131072])
def test_bench_vertical_slash_end_to_end(benchmark, N: int) -> None:
    """pytest-benchmark: VS (1000, 6096) ``sparse_prefill`` end to end on smooth inputs."""
    q, k, v = smooth_qkv(N, seed=N)
    plan = [VS] * HQ

    def run():
        sparse_prefill(q, k, v, plan, dense_threshold=0, validate=False)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)


if __name__ == "__main__":
    main()
