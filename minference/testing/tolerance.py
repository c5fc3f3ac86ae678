"""The FlashAttention tolerance rule, and NaN poisoning of outputs.

A fast result ``out`` in dtype ``t`` passes against the float64 reference ``ref64`` when

    max |out - ref64|  <=  ATOL_FACTOR * max |ref_t - ref64|  +  floor(t)

over the compared region, where ``ref_t`` is the *same-dtype reference*: the naive masked
attention computed with dtype-``t`` arithmetic (:func:`minference.reference.masked_attention`
with ``compute_dtype=t``). It measures how much error the dtype itself forces, so the bound
tightens automatically for float32 and widens for bf16. Inputs are quantised to ``t`` before
either reference sees them. ``floor(t)`` only keeps the bound positive where the same-dtype
reference happens to be exact. NaN in the compared region never passes, and a non-finite
reference value (``-inf`` log-sum-exp of an empty row) must be reproduced exactly.

Softmax statistics (the log-sum-exp) are held to a stricter, dtype-independent bound
(:func:`assert_stats_close`): the kernels keep the running max and denominator in float32 for
every input dtype, so ``|lse - lse64| <= STATS_RTOL * (1 + |lse64|)``, which float32
accumulation meets with a wide margin and 16-bit accumulation (one rounding of the denominator
to fp16 is ~5e-4) does not. The same-dtype rule cannot see that: for fp16 inputs its own
log-sum-exp error is ~3e-3.
"""

from __future__ import annotations

import torch

__all__ = ["ATOL_FACTOR", "FLOORS", "STATS_RTOL", "assert_close_to_reference", "assert_stats_close", "poison",
           "assert_not_written"]

#: Multiple of the same-dtype reference's own error a kernel may make (FlashAttention uses 2).
ATOL_FACTOR = 2.0

#: Absolute floor per output dtype: well below one unit in the last place at magnitude 1.
FLOORS = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-4}


def assert_close_to_reference(
    out: torch.Tensor,
    ref64: torch.Tensor,
    ref_same: torch.Tensor,
    *,
    where: torch.Tensor | None = None,
    name: str = "output",
    floor: float | None = None,
) -> None:
    """Assert the tolerance rule for ``out`` on the elements selected by ``where``.

    Args:
        out: the fast result (its dtype picks the floor).
        ref64: float64 reference, same shape.
        ref_same: same-dtype reference, same shape.
        where: bool mask broadcastable to ``out`` (default: everything).
        floor: override of ``FLOORS[out.dtype]``.
    """
    if out.shape != ref64.shape or out.shape != ref_same.shape:
        raise AssertionError(
            f"{name}: shapes differ: out {tuple(out.shape)}, ref64 {tuple(ref64.shape)}, "
            f"ref_same {tuple(ref_same.shape)}"
        )
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref64.detach().to(device="cpu", dtype=torch.float64)
    rs = ref_same.detach().to(device="cpu", dtype=torch.float64)
    if where is not None:
        region = torch.broadcast_to(where.detach().cpu(), o.shape)
        o, r, rs = o[region], r[region], rs[region]
    if torch.isnan(o).any():
        raise AssertionError(f"{name}: {int(torch.isnan(o).sum())} NaN value(s) in the compared region")
    finite = torch.isfinite(r)
    mismatch = (~finite) & (o != r)
    if mismatch.any():
        raise AssertionError(f"{name}: {int(mismatch.sum())} non-finite reference value(s) not reproduced")
    if (~torch.isfinite(o[finite])).any():
        raise AssertionError(f"{name}: non-finite value(s) where the reference is finite")
    o, r, rs = o[finite], r[finite], rs[finite]
    if o.numel() == 0:
        return
    if not torch.isfinite(rs).all():
        # a NaN or inf bound would let anything pass
        raise AssertionError(f"{name}: the same-dtype reference is non-finite where ref64 is finite; "
                             "the tolerance rule cannot be applied (inputs overflow the dtype?)")
    if floor is None and out.dtype not in FLOORS:
        raise AssertionError(f"{name}: no tolerance floor for dtype {out.dtype}; pass floor=")
    err = (o - r).abs()
    allowed = ATOL_FACTOR * float((rs - r).abs().max()) + (FLOORS[out.dtype] if floor is None else floor)
    if float(err.max()) > allowed:
        worst = int(torch.argmax(err))
        raise AssertionError(
            f"{name}: max |out - ref64| = {float(err[worst]):.3e} exceeds {ATOL_FACTOR} x same-dtype "
            f"error + floor = {allowed:.3e} (out {float(o[worst]):.6g}, ref {float(r[worst]):.6g}, "
            f"{int((err > allowed).sum())}/{err.numel()} elements over)"
        )


#: Relative bound on softmax statistics, ``|lse - lse64| <= STATS_RTOL * (1 + |lse64|)``, for every
#: input dtype. Measured under the interpreter (fp16 and fp32 inputs, all three kernels, |lse| up
#: to 20): at most 4e-7 relative; a denominator kept in fp16 is off by ~2^-11 = 4.9e-4.
STATS_RTOL = 1e-5


def assert_stats_close(
    lse: torch.Tensor,
    lse64: torch.Tensor,
    *,
    where: torch.Tensor | None = None,
    name: str = "lse",
    rtol: float = STATS_RTOL,
) -> None:
    """Assert ``|lse - lse64| <= rtol * (1 + |lse64|)`` on ``where`` (float32 statistics).

    Non-finite reference values (``-inf`` of an empty row) must be reproduced exactly; NaN never
    passes. Independent of the input dtype: see the module docstring.
    """
    if lse.shape != lse64.shape:
        raise AssertionError(f"{name}: shapes differ: {tuple(lse.shape)} vs ref64 {tuple(lse64.shape)}")
    o = lse.detach().to(device="cpu", dtype=torch.float64)
    r = lse64.detach().to(device="cpu", dtype=torch.float64)
    if where is not None:
        region = torch.broadcast_to(where.detach().cpu(), o.shape)
        o, r = o[region], r[region]
    if torch.isnan(o).any():
        raise AssertionError(f"{name}: {int(torch.isnan(o).sum())} NaN value(s) in the compared region")
    finite = torch.isfinite(r)
    if ((~finite) & (o != r)).any():
        bad = int(((~finite) & (o != r)).sum())
        raise AssertionError(f"{name}: {bad} non-finite reference value(s) not reproduced")
    o, r = o[finite], r[finite]
    if (~torch.isfinite(o)).any():
        raise AssertionError(f"{name}: non-finite value(s) where the reference is finite")
    if o.numel() == 0:
        return
    excess = (o - r).abs() / (1 + r.abs())
    worst = int(torch.argmax(excess))
    if float(excess[worst]) > rtol:
        raise AssertionError(
            f"{name}: |lse - lse64| / (1 + |lse64|) = {float(excess[worst]):.3e} exceeds {rtol:.1e} "
            f"(lse {float(o[worst]):.8g}, ref {float(r[worst]):.8g}, {int((excess > rtol).sum())}/{o.numel()} over): "
            "softmax statistics are not kept in float32"
        )


def poison(x: torch.Tensor) -> torch.Tensor:
    """Fill a freshly allocated output with NaN (in place) so an unwritten element cannot pass."""
    return x.fill_(float("nan"))


def assert_not_written(out: torch.Tensor, where: torch.Tensor, name: str = "output") -> None:
    """Assert every element of ``out`` selected by ``where`` still holds the NaN poison."""
    region = torch.broadcast_to(where.to(out.device), out.shape)
    written = ~torch.isnan(out[region])
    if written.any():
        raise AssertionError(f"{name}: {int(written.sum())} element(s) written where nothing should be")
