"""Compile time of the kernels on the GPU: the first call of each kernel variant (compile + run)
against the second (run only), per dtype and head dim.

The GPU test tier is compile-bound (every new head dim, dtype or flag is a new variant), so this
is the number that says what a test example or a user's first prefill waits for. Run it with an
empty Triton cache, or every variant after the first run is a cache hit:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/compile_time.py --dtypes float32 --head-dims 128

On the H200 at D = 128: fp32 with 64x32 ieee tiles took 22.8 s (A-shape) and 68.4 s
(vertical-slash) a variant, with 32x32 tiles 9.2 and 24.7 s, bf16 4.8 and 7.9 s
(``benchmarks/results/h200_s13_run2_sweep_d64.md``, measured by this script's first version;
docs/tuning.md#fp32-tiles). Several processes with their own cache dirs run in parallel on a many-core host.
"""

from __future__ import annotations

import argparse
import time

import torch

from minference import kernels

N = 300


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cases(D: int, dtype: torch.dtype) -> dict:
    """The kernel variants timed: each pattern kernel, with and without the log-sum-exp or query
    rows, on a small problem (4 query heads, 2 kv heads, ``N`` tokens)."""
    dev = "cuda"
    q = torch.randn(1, 4, N, D, device=dev, dtype=dtype)
    k, v = (torch.randn(1, 2, N, D, device=dev, dtype=dtype) for _ in range(2))
    vert = torch.tensor([[[0, 5, 77, 150, N - 1]] * 4], device=dev, dtype=torch.int32)
    slash = torch.tensor([[[0, 1, 2, 40, 100]] * 4], device=dev, dtype=torch.int32)
    blocks = torch.tensor([[[[0, 1]] * -(-N // 64)] * 4], device=dev, dtype=torch.int32)
    return {
        "ashape": lambda: kernels.ashape_attention(q, k, v, 4, 64),
        "ashape lse": lambda: kernels.ashape_attention(q, k, v, 4, 64, return_lse=True),
        "vertical_slash": lambda: kernels.vertical_slash_attention(q, k, v, vert, slash),
        "block_sparse 64": lambda: kernels.block_sparse_attention(q, k, v, blocks, block=64),
        "block_sparse 64 query rows": lambda: kernels.block_sparse_attention(q, k, v, blocks, block=64,
                                                                            q_seqlens=100),
        "dense, 3 key splits": lambda: kernels.dense_attention(q, k, v, key_split=3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=kernels.SUPPORTED_HEAD_DIMS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the interpreter compiles nothing)")
    print("| D | dtype | kernel variant | first call s | second call ms |")
    print("|---|---|---|---|---|")
    for D in args.head_dims:
        for name in args.dtypes:
            for case, fn in cases(D, getattr(torch, name)).items():
                first = _timed(fn)
                second = _timed(fn)
                print(f"| {D} | {name} | {case} | {first:.2f} | {second * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
