"""How fast can a Triton attention inner loop run on this GPU? The ceiling behind every kernel.

One program per ``(query block, head)`` walks ``W`` keys of *unmasked*, contiguous K/V tiles ending
at its first row (the interior of an A-shape window or a solid slash run: no diagonal tile, no
mask), so the time is pure loop: two MMAs, the online softmax and the loads. Variants:

* ``load``: ``ptr`` (pointer arithmetic with strides, what the kernels use today) or ``desc``
  (device-side tensor descriptors, TMA loads on Hopper);
* ``ws``: ``tl.range(..., warp_specialize=True)`` (producer/consumer warp groups);
* ``fma``: the softmax in the Triton-tutorial form (row max taken on the raw product, scale and
  max subtraction fused in one multiply-add) instead of scaling every score first;
* tiles ``BM x BN``, warps, stages.

Every variant is checked against a float32 PyTorch reference on a small problem before it is
timed; a variant that fails to compile or to match is reported, not timed.

``python benchmarks/loop_ceiling.py --n 131072 --window 4096 --json out.json`` (H200: bf16,
H=32, D=128). FLOPs are ``4 * D * (rows x keys actually visited)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _ceiling_fwd(Q, K, V, O, N, W, qk_scale, sqh, sqn, skh, skn, svh, svn, soh, son,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DESC: tl.constexpr, WS: tl.constexpr, FMA: tl.constexpr):
    qblk = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    m0 = qblk * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    h64 = h.to(tl.int64)
    q = tl.load(Q + h64 * sqh + (m0 + offs_m).to(tl.int64)[:, None] * sqn + offs_d[None, :])
    k_base = K + h64 * skh
    v_base = V + h64 * svh
    lo = tl.maximum(m0 - W, 0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DESC:
        kd = tl.make_tensor_descriptor(k_base, shape=[N, HEAD_DIM], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        vd = tl.make_tensor_descriptor(v_base, shape=[N, HEAD_DIM], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    for t in tl.range(lo, m0, BLOCK_N, warp_specialize=WS):
        if DESC:
            k = kd.load([t, 0])
            v = vd.load([t, 0])
        else:
            cols = (t + offs_n).to(tl.int64)
            k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if FMA:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        else:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            m_new = m_use
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + h64 * soh + (m0 + offs_m).to(tl.int64)[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty))


def launch(q, k, v, out, W: int, cfg: dict):
    H, N, D = q.shape
    grid = (N // cfg["bm"], H)
    _ceiling_fwd[grid](q, k, v, out, N, W, D ** -0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=cfg["bm"],
                       BLOCK_N=cfg["bn"], DESC=cfg["load"] == "desc", WS=cfg["ws"], FMA=cfg["fma"],
                       num_warps=cfg["warps"], num_stages=cfg["stages"])


def reference(q, k, v, W: int, bm: int) -> torch.Tensor:
    H, N, D = q.shape
    i = torch.arange(N, device=q.device)
    m0 = (i // bm) * bm
    j = torch.arange(N, device=q.device)
    keep = (j[None, :] < m0[:, None]) & (j[None, :] >= (m0 - W).clamp(min=0)[:, None])
    s = (q.float() @ k.float().transpose(1, 2)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v.float()


def pairs(N: int, W: int, bm: int) -> int:
    return sum(bm * (m0 - max(m0 - W, 0)) for m0 in range(0, N, bm))


def variants() -> list[dict]:
    base = dict(load="ptr", ws=False, fma=False, bm=128, bn=64, warps=8, stages=3)
    rows = [base]
    for load in ("ptr", "desc"):
        for ws in (False, True):
            for bn, stages_list in ((64, (2, 3)), (128, (2, 3))):
                for stages in stages_list:
                    for warps in ((4, 8) if ws else (8,)):
                        rows.append(dict(load=load, ws=ws, fma=True, bm=128, bn=bn, warps=warps, stages=stages))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = "cuda"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    D = 128
    g = torch.Generator(device=dev).manual_seed(0)
    small = [torch.randn(2, 1024, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    big = [torch.randn(args.heads, args.n, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    flops = 4 * D * args.heads * pairs(args.n, args.window, 128)
    results = []
    print("| load | ws | fma | BMxBN | warps | stages | ms | TFLOP/s | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cfg in variants():
        row = dict(cfg)
        try:
            out = torch.empty_like(small[0])
            launch(*small, out, 256, cfg)
            err = (out.float() - reference(*small, 256, cfg["bm"])).abs().max().item()
            row["max_err"] = err
            if not err < 2e-2:
                row["status"] = f"mismatch {err:.3g}"
            else:
                o = torch.empty_like(big[0])
                ms = triton.testing.do_bench(lambda: launch(*big, o, args.window, cfg), warmup=50, rep=300)  # noqa: B023
                row["ms"] = ms
                row["tflops"] = flops / ms / 1e9
                row["status"] = "ok"
        except Exception as exc:  # a variant this Triton cannot compile is a result, not a crash
            row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            traceback.print_exc(file=sys.stderr)
        results.append(row)
        ms = f"{row['ms']:.2f}" if "ms" in row else "-"
        tf = f"{row['tflops']:.0f}" if "tflops" in row else "-"
        print(f"| {cfg['load']} | {cfg['ws']} | {cfg['fma']} | {cfg['bm']}x{cfg['bn']} | {cfg['warps']} | "
              f"{cfg['stages']} | {ms} | {tf} | {row['status']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "n": args.n, "heads": args.heads, "window": args.window,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
