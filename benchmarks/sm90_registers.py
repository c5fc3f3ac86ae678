"""Registers, spills and shared memory of the attention kernels compiled for sm_90, on a machine
without a GPU (docs/kernels_history.md, "Facts learned": an sm_90 compile on the CPU must specialise like
the GPU's JIT to be read).

Each public kernel entry runs once on CPU tensors with the GPU's tiles and tensor descriptors; its
launch is replaced by a compile through the JIT's own binder (so integer arguments equal to 1 and
pointers / integers divisible by 16 are specialised as on the GPU) for ``GPUTarget("cuda", 90,
32)``, then ``ptxas-blackwell -v -arch=sm_90a`` (shipped with Triton) reads the PTX. Nothing is
executed. The column scratch and the split merge are not compiled (their launches are skipped).

    python benchmarks/sm90_registers.py [--dtype bfloat16] [--head-dim 64] [--ptx-dir DIR]

This CPU machine runs Triton 3.9; the H200 runs 3.6, whose register allocation may differ: a
prediction to compare builds with, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from minference.kernels import _common, ashape, block_sparse, vertical_slash  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from minference import kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def _gpu_tiles_on_cpu() -> None:
    """CPU tensors take the GPU's tiles and descriptors (the launchers test the device type)."""
    _common.interpreting = lambda: True  # CPU tensors accepted, descriptors built for them
    _common.default_tiles = lambda q: _common.GPU_TILES_FP32 if q.dtype == torch.float32 else _common.GPU_TILES
    ashape._tiles = lambda q: ashape.gpu_tiles_2byte(q.shape[-1]) if q.element_size() == 2 else None
    block_sparse._tiles = block_sparse.gpu_tiles
    # the value guard is a kernel launch of its own, which needs a driver: stand-ins of its shape
    _common.value_guard = lambda k, v, checked=False: (k.clone(), v.clone())
    for module in (ashape, vertical_slash, block_sparse):
        module.kv_descriptors = lambda k, v, bn, bd: _common.kv_descriptors(k, v, bn, bd, interpreter=True)

    # builds before the value guard take two scratch descriptors (K, V), the penalty guard three
    # (K, V, v_safe), the poisoned-key guard four (K, V, k_masked, v_safe)
    src = vertical_slash._vs_fwd.src
    n_desc = 4 if "desc_ckm" in src else 3 if "desc_cvs" in src else 2

    def scratch(prep, k, v, index, heads, wide):  # descriptors of an empty scratch, no launch
        ck = torch.zeros(prep.B, prep.Hg, index.columns.shape[-1], prep.D, dtype=k.dtype)
        desc_k, desc_v = _common.kv_descriptors(ck, ck, wide, prep.block_d, interpreter=True)
        return {2: (desc_k, desc_v), 3: (desc_k, desc_v, desc_v), 4: (desc_k, desc_v, desc_k, desc_v)}[n_desc]

    vertical_slash._column_scratch = scratch


def _compiler(results: list, ptx_dir: str):
    backend = make_backend(TARGET)

    def compile_launch(name, jit_fn, device, key, candidates, call):
        tiles = list(candidates)[0]
        grid, args, kwargs = call(tiles)
        binder = jit.create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, spec, options)
        compiled = triton_compile(ASTSource(jit_fn, signature, constexprs, attrs), target=TARGET,
                                  options=options.__dict__)
        path = os.path.join(ptx_dir, f"{name}.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([PTXAS, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True)
        notes = [line.split("info    :")[-1].strip() for line in run.stderr.splitlines()
                 if "registers" in line or "spill" in line]
        results.append([name, tiles, compiled.metadata.shared, notes])
        return tiles

    return compile_launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ptx-dir", default=None, help="keep the PTX files here (default: a temporary dir)")
    args = ap.parse_args()
    ptx_dir = args.ptx_dir or tempfile.mkdtemp()
    os.makedirs(ptx_dir, exist_ok=True)
    _gpu_tiles_on_cpu()
    results: list = []
    compile_launch = _compiler(results, ptx_dir)
    for module in (ashape, vertical_slash, block_sparse):
        module.launch_fitted = compile_launch

    dtype = getattr(torch, args.dtype)
    B, Hq, Hkv, N, D = 1, 4, 2, 1024, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=gen).to(dtype) for H in (Hq, Hkv, Hkv))
    calls = {
        "ashape": lambda: kernels.ashape_attention(q, k, v, 64, 256, validate=False),
        "dense split": lambda: kernels.dense_attention(q[:, :, -128:], k, v, key_split=4, validate=False),
        "vertical-slash (all solid)": lambda: kernels.vertical_slash_attention(
            q, k, v, torch.arange(0, N, 7, dtype=torch.int32).expand(B, Hq, -1).contiguous(),
            torch.arange(0, 300, dtype=torch.int32).expand(B, Hq, -1).contiguous(), fill_gaps=127, validate=False),
        "block-sparse 64": lambda: kernels.block_sparse_attention(
            q, k, v, torch.stack([torch.arange(N // 64), torch.zeros(N // 64, dtype=torch.long)], -1)
            .expand(B, Hq, N // 64, 2).to(torch.int32), block=64, validate=False),
    }
    for label, call in calls.items():
        try:
            call()
        except RuntimeError:  # a launch this script does not replace (the split merge): compiled already
            pass
        results[-1][0] = label
    print(f"sm_90 (Triton {triton.__version__}), {args.dtype}, D = {D}; PTX in {ptx_dir}")
    for label, tiles, shared, notes in results:
        print(f"{label}: {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages, "
              f"{shared} B shared | " + " | ".join(notes))


if __name__ == "__main__":
    sys.exit(main())
