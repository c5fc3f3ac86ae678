"""Fuzz each kernel (the key-split dense kernel included; on whole rows and on query rows) and both
index builders on small random shapes once (meant to run under ``compute-sanitizer --tool memcheck`` with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, so every tensor is its own allocation and an out-of-bounds
read or write is caught). Also checks each result
(the builders' scores) against the float64 twin."""

from __future__ import annotations

import sys

import torch
from minference.reference import estimators as naive

from minference import kernels
from minference import reference as ref

CASES = 4


def dense_attention_split3(q, k, v, **kw):
    """The key-split dense kernel with 3 splits forced (split and merge kernels, scratch rows)."""
    return kernels.dense_attention(q, k, v, key_split=3, **kw)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: run with TRITON_INTERPRET=1
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def main(seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    worst = 0.0

    def record(case: int, name: str, err: float, shape: str) -> None:
        nonlocal worst
        worst = err if err != err else max(worst, err)  # keep a NaN
        print(f"case {case} {name}: {shape} max err {err:.2e}", flush=True)

    for case in range(CASES):
        B, Hkv, group = 2, 1 + case % 2, 1 + case % 3
        Hq = Hkv * group
        N = int(torch.randint(100, 400, (1,), generator=g))
        D = (64, 80, 96, 128)[case % 4]
        q, k, v = (torch.randn(B, N, h, D, generator=g).to(DEVICE, DTYPE).transpose(1, 2) for h in (Hq, Hkv, Hkv))
        lens = torch.randint(0, N + 1, (B,), generator=g, dtype=torch.int32)
        starts = (N - lens) * (torch.rand(B, generator=g) < 0.5)
        starts = starts.to(torch.int32)
        heads = torch.randperm(Hq, generator=g)[: max(1, Hq - 1)].to(torch.int32)
        Hg = heads.numel()
        vert = torch.randint(-1, N, (B, Hg, 40), generator=g, dtype=torch.int32)
        slash = torch.randint(-1, N, (B, Hg, 40), generator=g, dtype=torch.int32)
        nqb = -(-N // 64)
        blocks = torch.randint(-1, nqb, (B, Hg, nqb, 6), generator=g, dtype=torch.int32)
        shape = f"N={N} D={D} Hq={Hq} Hkv={Hkv}"
        kw = dict(seqlens=lens, seqstarts=starts, heads=heads)
        # odd cases skip the input checks, as the integration does: the kernels then read the
        # value guard's copies in their masked tiles (docs/contract.md), which memcheck must see too
        kw_dev = {k_: x.to(DEVICE) for k_, x in kw.items()} | {"validate": case % 2 == 0}
        # many columns, gap-filled over block_m - 1: the all-solid build of the VS kernel
        many = torch.randint(-1, N, (B, Hg, 300), generator=g, dtype=torch.int32)
        runs = [
            (kernels.ashape_attention, ref.ashape_attention, (7, 33), {}),
            (kernels.vertical_slash_attention, ref.vertical_slash_attention, (vert, slash), {}),
            (kernels.vertical_slash_attention, ref.vertical_slash_attention, (many, slash), {"fill_gaps": 127}),
            (kernels.block_sparse_attention, ref.block_sparse_attention, (blocks,), {}),
            (dense_attention_split3, ref.dense_attention, (), {}),
        ]
        for fast, twin, args, extra in runs:
            out = fast(q, k, v, *[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args], **kw_dev, **extra)
            want = twin(q.cpu().float(), k.cpu().float(), v.cpu().float(), *args, **kw, **extra)
            record(case, fast.__name__ + (" (filled)" if extra else ""), float((out.cpu().double() - want).abs().max()),
                   shape)
        # the same kernels on query rows: a chunk of C queries after each row's cache (q's rows
        # at q_starts, so q's row of position 0 lies before q's storage: pointer offsets go negative)
        C = max(1, N // 3)
        q_lens = torch.clamp(lens, max=C)
        q_kw = dict(q_seqlens=q_lens, q_seqstarts=((C - q_lens) * (case % 2)).to(torch.int32))
        qc = q[:, :, :C]
        for fast, twin, args, extra in runs:
            out = fast(qc, k, v, *[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args], **kw_dev,
                       **{n: x.to(DEVICE) for n, x in q_kw.items()}, **extra)
            want, _ = ref.query_rows_attention(twin, qc.cpu().float(), k.cpu().float(), v.cpu().float(), *args, **kw,
                                               **q_kw, **extra)
            record(case, fast.__name__ + " (query rows)" + (" (filled)" if extra else ""),
                   float((out.cpu().double() - want).abs().max()), shape + f" C={C}")
        # index builders: column / diagonal scores, block scores (finite entries) vs the twins
        vs_kw = dict(last_q=1 + case * 13, extra_rows=case, return_scores=True)
        got = kernels.vertical_slash_index(q, k, 8, 8, **vs_kw, **kw_dev)[2:]
        want = naive.vertical_slash_index(q.cpu().float(), k.cpu().float(), 8, 8, **vs_kw, **kw)[2:]
        got_b = kernels.block_sparse_index(q, k, 3, block=32, return_scores=True, **kw_dev)[1]
        want_b = naive.block_sparse_index(q.cpu().float(), k.cpu().float(), 3, block=32, return_scores=True, **kw)[1]
        finite = torch.isfinite(want_b)
        errs = [float((a.cpu().double() - b).abs().max()) for a, b in zip(got, want)]
        errs.append(float((got_b.cpu().double()[finite] - want_b[finite]).abs().max()) if finite.any() else 0.0)
        for name, err in zip(("vs column scores", "vs diagonal scores", "block scores"), errs):
            record(case, name, err, shape)
    print(f"sanitize_fuzz done, worst error {worst:.2e} ({DTYPE})")
    if not worst <= 0.1:  # NaN fails too
        sys.exit(1)


if __name__ == "__main__":
    main()
