"""The kernel tests' shared recipe (:func:`run_and_check`, :func:`check_sharp`) and its draws.

Every kernel test follows one recipe (:func:`run_and_check`): random inputs quantised to the
kernel dtype, a NaN-poisoned ``out``, the kernel, the float64 reference twin and the same-dtype
twin; then the tolerance rule on every computed row, exact reproduction of ``-inf``
log-sum-exp, the log-sum-exp within float32 accuracy of the float64 one whatever the dtype
(:func:`~minference.testing.assert_stats_close`), and "still NaN" on padding rows and
unselected heads.

On CPU the kernels run in the Triton interpreter (fp16/fp32, small shapes); on a GPU the same
tests draw bf16 too, longer sequences (several 128-row tiles) and every supported head dim."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from minference.reference.attention import query_rows_attention

from minference import kernels
from minference._checks import token_mask
from minference.testing import assert_close_to_reference, assert_not_written, assert_stats_close, poison
from minference.testing.strategies import (
    AttnShape,
    attention_shapes,
    head_subsets,
    layouts,
    qkv,
    query_rows,
    ragged_rows,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def backend_device(backend: str) -> str:
    """Where a dispatcher test of ``backend`` puts its tensors: the Triton backend on CUDA where
    there is one (the interpreter otherwise), the torch backend on the CPU."""
    return DEVICE if backend == "triton" else "cpu"


#: The interpreter computes bf16 wrongly without raising: bf16 is a GPU-only dtype here.
DTYPES = (torch.bfloat16, torch.float16, torch.float32) if CUDA else (torch.float16, torch.float32)
#: Head dims drawn: every supported one on the GPU; on CPU the cheapest plus a padded one.
HEAD_DIMS = kernels.SUPPORTED_HEAD_DIMS if CUDA else (16, 64, 80)
#: Longest sequence drawn: several interpreter tiles (16) on CPU, several 128-row tiles on GPU.
MAX_N = 700 if CUDA else 160
SEED = st.integers(0, 2**31 - 1)


#: ``combo`` parameter of the hypothesis kernel tests: ``(dtype, head dim)``, either may be None
#: (drawn). On the GPU each dtype is its own test case: the GPU tier is compile-bound, so xdist
#: workers compile the dtypes' kernel variants in parallel. One case per (dtype, head dim) pair
#: was tried: 90 cases of ~100 s each, too many for a 10-minute device call. The 2-byte dtypes
#: draw the head dim. float32 takes D = 64 alone: its ieee dots compile to unrolled FMA loops
#: (9-25 s a variant at D = 128 even with 32x32 tiles), so drawing six head dims left its cases
#: compiling past every bound; its FMA lowering is the same code at every D, and the interpreter
#: draws float32 at every head dim on the CPU. On CPU one case draws both. See
#: docs/tuning.md#test-combos.
COMBOS = ([pytest.param((dt, 64 if dt == torch.float32 else None), id=str(dt).removeprefix("torch."))
           for dt in DTYPES] if CUDA else [pytest.param(None, id="drawn")])


def problem(data, *, max_n: int = MAX_N, combo: tuple[torch.dtype | None, int | None] | None = None) -> dict:
    """Draw a whole problem: shape, dtype, layout, ragged rows, head subset, inputs (``combo``
    fixes the dtype and/or head dim, see :data:`COMBOS`)."""
    fixed_dtype, fixed_d = combo if combo is not None else (None, None)
    head_dims = HEAD_DIMS if fixed_d is None else (fixed_d,)
    shape: AttnShape = data.draw(attention_shapes(max_n=max_n, head_dims=head_dims), label="shape")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype") if fixed_dtype is None else fixed_dtype
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N), label="ragged")
    heads = data.draw(head_subsets(shape.Hq), label="heads")
    layout = data.draw(layouts(), label="layout")
    q, k, v = qkv(shape, dtype, DEVICE, data.draw(SEED, label="seed"), layout=layout)
    Hg = shape.Hq if heads is None else heads.numel()
    return dict(shape=shape, dtype=dtype, seqlens=seqlens, seqstarts=seqstarts, heads=heads, Hg=Hg,
                q=q, k=k, v=v)


def torch_converter():
    """The vertical-slash converter on CPU indices through its torch ops, as on a GPU runner, also
    under the interpreter (where CPU indices would take the three Triton launches, seconds a call
    there): for tests whose subject is not the conversion. The Triton converter is held to the
    torch ops field by field (``test_kernel_vertical_slash.py``'s converter tests), and it converts
    the indices of the whole-row kernel tests; on a GPU runner, CUDA indices still take it."""
    from unittest import mock

    from minference.kernels import convert

    return mock.patch.object(convert, "interpreting", lambda: False)


def _dev(x):
    return None if x is None else x.to(DEVICE)


def computed_region(p: dict) -> torch.Tensor:
    """``[B, Hq, N]`` bool: rows of computed heads inside each row's length."""
    s = p["shape"]
    rows = token_mask(p["seqlens"], p["seqstarts"], s.B, s.N, "cpu")  # [B, N]
    head = torch.zeros(s.Hq, dtype=torch.bool)
    head[p["heads"].long() if p["heads"] is not None else slice(None)] = True
    return rows[:, None, :] & head[None, :, None]


def run_and_check(p: dict, kernel, twin, *args, **kwargs) -> None:
    """Run ``kernel`` (poisoned ``out``) and ``twin`` (fp64 and same dtype) on ``args``; check."""
    s, dtype = p["shape"], p["dtype"]
    q, k, v = p["q"], p["k"], p["v"]
    common = dict(seqlens=p["seqlens"], seqstarts=p["seqstarts"], heads=p["heads"])
    out = poison(torch.empty(s.B, s.Hq, s.N, s.D, dtype=dtype, device=DEVICE))
    # padding tokens of q, k, v become NaN: a kernel that reads one into a softmax fails
    pad = ~computed_region(dict(p, heads=None))[:, 0]  # [B, N]
    for x in (q, k, v):
        x.masked_fill_(pad[:, None, :, None].to(x.device), float("nan"))
    dev_args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    res, lse = kernel(q, k, v, *dev_args, **{k_: _dev(x) for k_, x in common.items()}, **kwargs,
                      out=out, return_lse=True)
    assert res.data_ptr() == out.data_ptr()
    cpu = [x.cpu() for x in (q, k, v)]
    ref64, lse64 = twin(*cpu, *args, **common, **kwargs, return_lse=True)
    ref_t, lse_t = twin(*cpu, *args, **common, **kwargs, return_lse=True, compute_dtype=dtype)
    region = computed_region(p)
    assert_close_to_reference(res, ref64, ref_t, where=region[..., None], name="out")
    assert_not_written(res.cpu(), ~region[..., None], name="out")
    assert_close_to_reference(lse, lse64, lse_t, name="lse")
    # softmax statistics in float32 whatever the input dtype (the rule above allows fp16's own error)
    assert_stats_close(lse, lse64, name="lse")


#: ``(dtype, nats, shape, seqlens, seqstarts, heads)`` of the sharp-mask cases of every kernel. A
#: mask applied after the exponential (the running max taken over masked scores too) shows in
#: fp16 once the masked key leads by more than ~17 nats (the kept probabilities underflow the fp16
#: P tile) and in fp32 beyond ~87-103 nats (they underflow fp32 itself): 30 and 150 nats.
SHARP_CASES = [
    pytest.param(torch.float16, 30.0, AttnShape(B=1, Hq=2, Hkv=2, N=49, D=64), None, None, None, id="fp16-30nats"),
    pytest.param(torch.float32, 150.0, AttnShape(B=2, Hq=2, Hkv=1, N=70, D=64), torch.tensor([70, 41]),
                 torch.tensor([0, 23]), None, id="fp32-150nats-ragged-gqa"),
    pytest.param(torch.float16, 150.0, AttnShape(B=2, Hq=4, Hkv=1, N=50, D=64), torch.tensor([38, 50]),
                 torch.tensor([12, 0]), torch.tensor([3, 0], dtype=torch.int32), id="fp16-150nats-left-pad-heads"),
]


def sharp_problem(shape: AttnShape, dtype, kept, *, nats: float, seqlens=None, seqstarts=None, heads=None,
                  seed: int = 0) -> dict:
    """A problem whose every row with a masked key has one masked key leading all kept ones by
    about ``nats`` (after the softmax scale). ``kept(b, g, L)`` is the ``[L, L]`` logical set of
    computed head ``g`` (position in ``heads``) of batch row ``b``. Row ``i`` plants key ``j``
    (the next few keys, causal-masked, on even rows; any masked key otherwise) and takes
    ``q_i = c (K^T K + n I)^-1 k_j`` over its kept keys ``K``, so the kept logits stay small and
    ``s_ij = nats``. The measured lead (on the quantised inputs) is returned as ``p["lead"]``."""
    B, Hq, Hkv, N, D = shape.B, shape.Hq, shape.Hkv, shape.N, shape.D
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=gen, dtype=torch.float64) for H in (Hq, Hkv, Hkv))
    scale = D**-0.5
    lens = seqlens.tolist() if seqlens is not None else [N] * B
    starts = seqstarts.tolist() if seqstarts is not None else [0] * B
    ids = heads.tolist() if heads is not None else list(range(Hq))
    lead = []
    for b in range(B):
        L, s0 = lens[b], starts[b]
        if L == 0:
            continue
        i = torch.arange(L)
        for g, h in enumerate(ids):
            keys = k[b, h // (Hq // Hkv), s0 : s0 + L]  # [L, D]
            m = kept(b, g, L)  # [L, L]
            near = (i[None, :] > i[:, None]) & (i[None, :] <= i[:, None] + 8) & (i[:, None] % 2 == 0)
            # a random masked key per row, one of the next few keys where there is one
            score = torch.rand(L, L, generator=gen, dtype=torch.float64) + 2.0 * near
            score = score.masked_fill(m, -1.0)
            j = score.argmax(1)
            planted = ~m.all(1)
            mk = m.double()
            ridge = mk.sum(1).clamp(min=1)[:, None, None] * torch.eye(D, dtype=torch.float64)
            A = torch.einsum("ij,jd,je->ide", mk, keys, keys) + ridge
            x = torch.linalg.solve(A, keys[j])  # [L, D]
            x = x * (nats / scale / (x * keys[j]).sum(1, keepdim=True))
            q[b, h, s0 : s0 + L][planted] = x[planted]
            # the lead on the inputs the kernel sees (quantised)
            qt, kt = q[b, h, s0 : s0 + L].to(dtype).double(), keys.to(dtype).double()
            logits = qt @ kt.T * scale
            best_kept = logits.masked_fill(~m, -float("inf")).max(1).values
            lead.append((logits.gather(1, j[:, None])[:, 0] - best_kept)[planted])
    q, k, v = (x.to(dtype) for x in (q, k, v))
    lead = torch.cat(lead) if lead else torch.zeros(0)
    return dict(shape=shape, dtype=dtype, seqlens=seqlens, seqstarts=seqstarts, heads=heads,
                Hg=len(ids), q=q.to(DEVICE), k=k.to(DEVICE), v=v.to(DEVICE), lead=lead)


def check_sharp(p: dict, kernel, twin, *args, **kwargs) -> None:
    """The planted keys lead by more than 20 nats in at least 90% of the planted rows (the
    construction cannot silently go soft), then the shared recipe."""
    lead = p["lead"]
    assert lead.numel() >= 20, "too few rows with a masked key"
    assert float((lead > 20).double().mean()) >= 0.9, f"planted keys lead by only {lead.quantile(0.1):.1f} nats"
    run_and_check(p, kernel, twin, *args, **kwargs)


def query_problem(data, combo, max_n: int = MAX_N):
    """A kernel problem (keys, values, ragged rows, heads) plus query rows and their q."""
    p = problem(data, max_n=max_n, combo=combo)
    s = p["shape"]
    Nq, q_seqlens, q_seqstarts, q_lens, q_starts = data.draw(query_rows(s.B, s.N, p["seqlens"], p["seqstarts"]),
                                                             label="query rows")
    g = torch.Generator().manual_seed(data.draw(SEED, label="q seed"))
    q = torch.randn(s.B, s.Hq, Nq, s.D, generator=g, dtype=torch.float64).to(p["dtype"]).to(DEVICE)
    return dict(p, q=q, Nq=Nq, q_seqlens=q_seqlens, q_seqstarts=q_seqstarts, q_lens=torch.tensor(q_lens),
                q_starts=torch.tensor(q_starts))


def run_query_rows(p, kernel, twin, *args, **kwargs):
    s, dtype = p["shape"], p["dtype"]
    q, k, v = p["q"], p["k"], p["v"]
    rows = dict(seqlens=p["seqlens"], seqstarts=p["seqstarts"], q_seqlens=p["q_seqlens"], q_seqstarts=p["q_seqstarts"])
    dev = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in rows.items()}
    # every token no query row may read is NaN: q outside the query rows, k and v outside the rows
    q_rows = token_mask(p["q_lens"], p["q_starts"], s.B, p["Nq"], "cpu")  # [B, Nq]
    k_rows = token_mask(p["seqlens"], p["seqstarts"], s.B, s.N, "cpu")
    q.masked_fill_(~q_rows[:, None, :, None].to(q.device), float("nan"))
    for x in (k, v):
        x.masked_fill_(~k_rows[:, None, :, None].to(x.device), float("nan"))
    out = poison(torch.empty(s.B, s.Hq, p["Nq"], s.D, dtype=dtype, device=DEVICE))
    dev_args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    heads = None if p["heads"] is None else p["heads"].to(DEVICE)
    res, lse = kernel(q, k, v, *dev_args, heads=heads, out=out, return_lse=True, **dev, **kwargs)
    assert res.data_ptr() == out.data_ptr() and res.shape == q.shape and lse.shape == q.shape[:3]
    cpu = [x.cpu() for x in (q, k, v)]
    ref64, lse64 = query_rows_attention(twin, *cpu, *args, heads=p["heads"], **rows, **kwargs)
    ref_t, lse_t = query_rows_attention(twin, *cpu, *args, heads=p["heads"], **rows, **kwargs, compute_dtype=dtype)
    head = torch.zeros(s.Hq, dtype=torch.bool)
    head[p["heads"].long() if p["heads"] is not None else slice(None)] = True
    region = q_rows[:, None, :] & head[None, :, None]  # [B, Hq, Nq]
    assert_close_to_reference(res, ref64, ref_t, where=region[..., None], name="out")
    assert_not_written(res.cpu(), ~region[..., None], name="out")
    assert_stats_close(lse, lse64, where=region, name="lse")
    assert torch.isneginf(lse.cpu()[~region]).all(), "lse outside the query rows must read as empty rows"


