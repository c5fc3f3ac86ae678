"""Input validation shared by kernels, references and the dispatcher.

Shape, dtype and device checks never synchronise with the device. Value checks (index ranges,
sequence lengths) read tensor values, so they run only when ``values=True`` and never while a
CUDA graph is being captured.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)
#: Largest budget a kernel or builder computes with (positions are int32): any count at least
#: the prompt length means "all of them", so larger ints and int64 entries are clamped to this
#: (never wrapped, never an overflow error).
BUDGET_MAX = 2**31 - 1


def capturing() -> bool:
    """True while a CUDA graph is being captured (value checks would synchronise). Nothing can
    be capturing before CUDA is initialised, and that test is a flag read where
    ``torch.cuda.is_available()`` costs a driver query on every call."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as a plain int (bools refused) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_key_split(key_split: object) -> int | None:
    """``key_split`` of the dense kernel: ``None`` (chosen from the shapes) or a positive int."""
    if key_split is not None and (isinstance(key_split, bool) or not isinstance(key_split, int) or key_split < 1):
        raise ValueError(f"key_split must be None or a positive int, got {key_split!r}")
    return key_split


def same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tensor(name: str, x: object, *, rank: int | None = None, dtypes=None) -> torch.Tensor:
    """``x`` if it is a torch tensor with data (a meta tensor is refused here, at the edge: it has
    a shape and no values, and would fail deep inside torch at the first value read), of ``rank``
    and one of ``dtypes`` when given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without data); pass a tensor on a real device")
    if rank is not None and x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    return x


def check_qkv(q, k, v, *, dtypes=_FLOAT_DTYPES) -> tuple[int, int, int, int, int]:
    """Validate ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]``; return ``(B, Hq, Hkv, N, D)``."""
    B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, v, dtypes=dtypes)
    if Nq != N:
        raise ValueError(f"k must be [B={B}, Hkv, N={Nq}, D={D}] to match q, got {tuple(k.shape)}")
    return B, Hq, Hkv, N, D


def check_out(out: object, q: torch.Tensor) -> torch.Tensor:
    """A caller's ``out`` for the attention of ``q``: a tensor of q's dtype, shape and device."""
    out = check_tensor("out", out, rank=4, dtypes=(q.dtype,))
    if out.shape != q.shape:
        raise ValueError(f"out must have shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if out.device != q.device:
        raise ValueError(f"out must be on {q.device}, got {out.device}")
    return out


def check_qkv_rows(q, k, v, *, dtypes=_FLOAT_DTYPES) -> tuple[int, int, int, int, int, int]:
    """Validate ``q [B,Hq,Nq,D]``, ``k, v [B,Hkv,N,D]`` with ``Nq <= N`` (queries that are a part
    of the key rows: a chunk after a cache, or chosen rows); return ``(B, Hq, Hkv, Nq, N, D)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, rank=4, dtypes=dtypes)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Nq, D = q.shape
    if D < 1:
        raise ValueError(f"q, k, v must have a head dim D >= 1, got shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, N, Dk = k.shape
    if Bk != B or Dk != D or N < Nq:
        raise ValueError(
            f"k must be [B={B}, Hkv, N >= {Nq}, D={D}] to match q, got {tuple(k.shape)}"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    return B, Hq, Hkv, Nq, N, D


def check_query_rows(q_seqlens, q_seqstarts, lens: torch.Tensor, starts: torch.Tensor, Nq: int, N: int,
                     *, given_rows: bool, values: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The query rows of a call whose queries are part of the key rows (docs/kernels.md, "query
    rows"): ``None`` when every key row is its own query row (``Nq == N`` and no ``q_seqlens``),
    else int32 ``(q_lens, q_starts) [B]``.

    Row ``b``'s queries are the last ``q_lens[b]`` tokens of its key row (logical positions
    ``lens[b] - q_lens[b] .. lens[b] - 1``), held in ``q`` at ``q_starts[b] ..``. Defaults with
    ``Nq < N`` and full key rows: every row's queries are its last ``Nq`` tokens, from 0. With
    ragged key rows (``given_rows``) and ``Nq < N``, ``q_seqlens`` must be given: no placement
    is guessed. ``q_seqstarts`` defaults to the queries' own places when ``q`` has the key rows'
    length (``Nq == N``: ``starts + lens - q_lens``, the rows computed in place), else 0. An int
    ``q_seqlens = c`` means ``min(c, lens[b])`` for every row (a fixed count of last tokens, at
    most the row); a tensor is used as given.
    """
    B = lens.shape[0]
    if q_seqlens is None and q_seqstarts is not None:
        raise ValueError("q_seqstarts needs q_seqlens")
    if isinstance(q_seqlens, bool):
        raise TypeError("q_seqlens must be an int or a 1-D int tensor, got bool")
    if isinstance(q_seqlens, int):
        check_int("q_seqlens", q_seqlens, 0)
    uniform = uniform_query_rows(q_seqlens, q_seqstarts, Nq, N, given_rows=given_rows)
    if uniform is not None:  # host-known and in range: constants, no op and nothing to check
        count, start = uniform
        return int32_constant(B, count, lens.device), int32_constant(B, start, lens.device)
    if isinstance(q_seqlens, int):
        q_seqlens = torch.clamp(lens, max=min(q_seqlens, Nq))
    if q_seqlens is None:
        if Nq == N:
            return None
        if given_rows:
            raise ValueError(f"q has {Nq} rows and the key rows {N}: with seqlens/seqstarts, give q_seqlens "
                             "(how many of each key row's last tokens q holds)")
        q_seqlens = int32_constant(B, Nq, lens.device)
    if q_seqstarts is None and Nq == N:
        q_seqstarts = starts + lens - q_seqlens.to(lens.dtype)
    q_lens, q_starts = check_ragged(q_seqlens, q_seqstarts, B, Nq, lens.device, values=values, names=(
        "q_seqlens", "q_seqstarts"))
    if values and not capturing() and bool((q_lens > lens).any()):
        raise ValueError(f"q_seqlens must not exceed the key rows' lengths, got {q_lens.tolist()} for key "
                         f"rows {lens.tolist()}")
    return q_lens, q_starts


def uniform_query_rows(q_seqlens, q_seqstarts, Nq: int, N: int, *, given_rows: bool) -> tuple[int, int] | None:
    """``(count, start)`` when the query rows of :func:`check_query_rows` are the same for every
    batch row and known on the host: full key rows (no ``seqlens`` / ``seqstarts``:
    ``given_rows`` False), ``q_seqlens`` ``None`` or an int and no ``q_seqstarts``, and query
    rows at all (``None`` for the ordinary call, ``Nq == N`` without ``q_seqlens``). Every row's
    queries are then its last ``count`` tokens, held in ``q`` from row ``start`` (``N - count``
    in place when ``Nq == N``, else 0): the chunk after a cache and the dense tail."""
    if given_rows or q_seqstarts is not None or not (q_seqlens is None or isinstance(q_seqlens, int)):
        return None
    if isinstance(q_seqlens, bool) or (isinstance(q_seqlens, int) and q_seqlens < 0):
        return None  # refused by check_query_rows
    if q_seqlens is None:
        if Nq == N:
            return None
        count = Nq
    else:
        count = min(q_seqlens, Nq, N)
    return count, (N - count if Nq == N else 0)


def query_rows_bound(q_seqlens, Nq: int) -> int:
    """The most query rows any batch row can have (host-known, no sync): an int ``q_seqlens``
    bounds them, a tensor only by ``Nq``. Launch grids follow it, so a call on a row's last
    ``c`` tokens (an int) launches for ``c`` rows, not for the whole row."""
    if isinstance(q_seqlens, int) and not isinstance(q_seqlens, bool):
        return max(0, min(q_seqlens, Nq))
    return Nq


def check_ragged(seqlens, seqstarts, B: int, N: int, device, *, values: bool = True,
                 names: tuple[str, str] = ("seqlens", "seqstarts")):
    """Validate optional ``seqlens [B]`` / ``seqstarts [B]``; return int32 tensors on ``device``.

    Row ``b`` holds its tokens at ``seqstarts[b] .. seqstarts[b] + seqlens[b] - 1`` of the
    ``N`` axis (right padding: starts 0; left padding: starts ``N - seqlens``).
    """
    out = []
    n_len, n_start = names
    for name, x, default in ((n_len, seqlens, N), (n_start, seqstarts, 0)):
        if x is None:
            x = int32_constant(B, default, device)
        else:
            check_tensor(name, x, rank=1, dtypes=_INT_DTYPES)
            if x.shape[0] != B:
                raise ValueError(f"{name} must have shape [B={B}], got {tuple(x.shape)}")
            if not same_device(x.device, device):
                raise ValueError(f"{name} must be on {device}, got {x.device}")
            x = x.to(device=device, dtype=torch.int32)
        out.append(x)
    lens, starts = out
    if values and not capturing() and (seqlens is not None or seqstarts is not None):
        if bool((lens < 0).any()) or bool((lens > N).any()):
            raise ValueError(f"{n_len} must lie in [0, N={N}], got {lens.tolist()}")
        if bool((starts < 0).any()) or bool((starts + lens > N).any()):
            raise ValueError(f"{n_start} + {n_len} must lie in [0, N={N}], got starts {starts.tolist()}")
    return lens, starts


def int32_constant(size: int, value: int, device) -> torch.Tensor:
    """``[size]`` int32 filled with ``value`` on ``device``, made once per ``(size, value, device)``
    outside CUDA-graph capture (default row lengths and starts, constant kernel budgets: an eager
    prefill otherwise pays a fill launch for each). Read-only: nothing may write into it."""
    if capturing():
        return torch.full((size,), value, dtype=torch.int32, device=device)
    return _int32_constant(size, value, torch.device(device))


@lru_cache(maxsize=256)
def _int32_constant(size: int, value: int, device: torch.device) -> torch.Tensor:
    return torch.full((size,), value, dtype=torch.int32, device=device)


def arange_constant(n: int, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.arange(n, dtype=dtype, device=device)`` without an op per call outside CUDA-graph
    capture: a view of one cached ``arange`` per ``(dtype, device)``, grown (doubled) when a
    longer one is asked for (position and head ids of every call: masks, gathers, kernel head
    lists). Under capture a fresh ``arange`` (recorded in the graph; the cache is never touched
    there, so no graph reads a tensor the cache may drop). Read-only: nothing may write into it."""
    if capturing():
        return torch.arange(n, dtype=dtype, device=device)
    key = (dtype, torch.device(device))
    base = _ARANGES.get(key)
    if base is None or base.shape[0] < n:
        base = _ARANGES[key] = torch.arange(max(n, 2 * (0 if base is None else base.shape[0]), 64), dtype=dtype,
                                            device=device)
    return base if base.shape[0] == n else base[:n]


_ARANGES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def check_index(name: str, idx, *, rank: int, lead: tuple[int, ...], device, upper: int,
                values: bool = True) -> torch.Tensor:
    """Validate an int index tensor padded with -1 whose entries must lie in ``[-1, upper)``.

    ``lead`` gives the required leading sizes; a ``-1`` entry in ``lead`` means "at least the
    head count", checked by the caller.
    """
    check_tensor(name, idx, rank=rank, dtypes=_INT_DTYPES)
    if not same_device(idx.device, device):
        raise ValueError(f"{name} must be on {device}, got {idx.device}")
    for axis, want in enumerate(lead):
        if want >= 0 and idx.shape[axis] != want:
            raise ValueError(f"{name} axis {axis} must have size {want}, got shape {tuple(idx.shape)}")
    if values and not capturing() and idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= upper:
            raise ValueError(f"{name} entries must lie in [-1, {upper}) (-1 is padding), got [{lo}, {hi}]")
    return idx


def check_head_offset(head_offset: int, Hq: int, H_index: int, name: str) -> None:
    if isinstance(head_offset, bool) or not isinstance(head_offset, int):
        raise TypeError(f"head_offset must be an int, got {type(head_offset).__name__}")
    if head_offset < 0 or head_offset + Hq > H_index:
        raise ValueError(
            f"head_offset {head_offset} + local heads {Hq} exceeds the {H_index} heads of {name}"
        )


def token_mask(seqlens, seqstarts, B: int, N: int, device, *, values: bool = True) -> torch.Tensor:
    """``[B, N]`` bool: position ``t`` of the N axis holds one of row ``b``'s tokens
    (``seqstarts[b] <= t < seqstarts[b] + seqlens[b]``; defaults: full rows)."""
    lens, starts = check_ragged(seqlens, seqstarts, B, N, device, values=values)
    pos = torch.arange(N, device=lens.device)[None, :]
    return (pos >= starts[:, None]) & (pos < (starts + lens)[:, None])


def check_finite_rows(tensors: dict, lens: torch.Tensor, starts: torch.Tensor, *, heads: dict | None = None,
                      rows: torch.Tensor | None = None) -> None:
    """Raise if a ``[B, H, N, D]`` tensor holds NaN or inf on a token inside its row, naming the
    tensor, the batch row, the head and the token (its position on the N axis).

    Padding tokens (outside ``starts[b] .. starts[b] + lens[b] - 1``) may hold anything: they are
    never read. ``rows``: an optional ``[B, N]`` bool mask of the positions to check instead (the
    query rows an estimator samples); ``heads``: by tensor name, a 1-D int tensor of the heads
    to check (the computed ones; default all). One reduction over D per tensor (in float32, or
    float64 for float32/64 inputs, so a finite row never overflows; no copy of the tensor), then
    one host read.
    """
    for name, x in tensors.items():
        ids = None if heads is None else heads.get(name)
        hit = _first_non_finite(x, lens, starts, ids, rows)
        if hit is not None:
            b, h, t = hit
            raise ValueError(f"{name} holds NaN or inf at batch row {b}, token {t} (head {h}; token "
                             f"{t - int(starts[b])} of the row, inside its length)")


def check_finite_kv(tensors: dict, lens: torch.Tensor, starts: torch.Tensor, *, group: int,
                    query_heads: torch.Tensor | None = None) -> None:
    """Raise if a key or value tensor ``[B, Hkv, N, D]`` holds NaN or inf on a token inside its
    row in a kv head that a computed query head reads, naming the tensor, the batch row, the token,
    the kv head and the query heads that read it (GQA: query head ``h`` reads kv head
    ``h // group``, ``group = Hq // Hkv``). ``query_heads``: a 1-D int tensor of the computed
    query heads (default all): kv heads none of them reads are not checked, and only computed
    heads are named. Cost as :func:`check_finite_rows`."""
    kv = None if query_heads is None else query_heads.long() // group
    for name, x in tensors.items():
        hit = _first_non_finite(x, lens, starts, kv, None)
        if hit is not None:
            b, j, t = hit
            readers = (list(range(j * group, (j + 1) * group)) if query_heads is None
                       else sorted({h for h in query_heads.tolist() if h // group == j}))
            raise ValueError(f"{name} holds NaN or inf at batch row {b}, token {t} (kv head {j}, read by query "
                             f"heads {readers}; token {t - int(starts[b])} of the row, inside its length)")


def _first_non_finite(x: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor | None,
                      rows: torch.Tensor | None) -> tuple[int, int, int] | None:
    """``(batch row, head, token)`` of the first non-finite element of ``x [B, H, N, D]`` on a
    checked token (``rows [B, N]``, default the tokens inside each row) of a checked head
    (``ids``, default all; the head named is ``x``'s own id), or ``None``."""
    B, _, N, _ = x.shape
    check = token_mask(lens, starts, B, N, x.device, values=False) if rows is None else rows  # [B, N]
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    total = x.sum(dim=-1, dtype=acc)  # [B, H, N]
    if ids is not None:
        total = total.index_select(1, ids.long())
    hit = ~torch.isfinite(total) & check[:, None]  # [B, H or len(ids), N]
    if not bool(hit.any()):
        return None
    b, h, t = (int(i) for i in hit.nonzero()[0])
    return b, (h if ids is None else int(ids[h])), t


def check_merge(out_a: object, lse_a: object, out_b: object, lse_b: object) -> torch.dtype:
    """The arguments of ``merge_attention`` (both implementations): ``out_a, out_b [..., D]``
    floating tensors of one shape and dtype, ``lse_a, lse_b [...]`` floating tensors of the
    outputs' leading shape, all four on one device. Returns the dtype to merge in: float64 when
    any of them is float64, else float32 (an integer output would be truncated: refused)."""
    out_a, lse_a, out_b, lse_b = (check_tensor(name, x, dtypes=_FLOAT_DTYPES) for name, x in
                                  (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)))
    if not (out_a.device == lse_a.device == out_b.device == lse_b.device):
        raise ValueError(f"merge_attention needs its four tensors on one device, got {out_a.device}, {lse_a.device}, "
                         f"{out_b.device}, {lse_b.device}")
    if out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share a dtype, got {out_a.dtype} and {out_b.dtype}")
    if (out_a.dim() < 1 or out_a.shape != out_b.shape or lse_a.shape != lse_b.shape
            or tuple(out_a.shape[:-1]) != tuple(lse_a.shape)):
        raise ValueError(f"merge_attention needs outputs [..., D] and log-sum-exps [...] of one shape, got "
                         f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}")
    wide = torch.float64 in (out_a.dtype, lse_a.dtype, lse_b.dtype)
    return torch.float64 if wide else torch.float32


def check_budget(name: str, value: object, *, total: int, minimum: int, values: bool,
                 read: torch.Tensor | None = None) -> int | torch.Tensor:
    """Check a budget given as an int or a 1-D int tensor indexed by global head id; return the
    int clamped to :data:`BUDGET_MAX`, or the tensor as given (:func:`clamp_budget` bounds it).

    Ints must be ``>= minimum``. A tensor must hold at least ``total`` entries (the global heads
    ``head_offset + Hq`` a call covers; checked from its shape, no sync); with ``values`` the
    entries the call reads (the global ids ``read`` of its computed heads, default the first
    ``total``) must be ``>= minimum`` too (a host read, skipped under CUDA-graph capture): other
    ranks' and other groups' heads may hold anything.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a 1-D int tensor, got bool")
    if isinstance(value, int):
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return min(value, BUDGET_MAX)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int or a 1-D int tensor, got {type(value).__name__}")
    check_tensor(name, value, rank=1, dtypes=_INT_DTYPES)
    if value.shape[0] < total:
        raise ValueError(f"{name} has {value.shape[0]} entries, fewer than the {total} global heads needed "
                         f"(one entry per global head id head_offset + h)")
    if values and not capturing():
        picked = value[:total] if read is None else value[read.to(device=value.device, dtype=torch.long)]
        lo = int(picked.min()) if picked.numel() else minimum
        if lo < minimum:
            raise ValueError(f"{name} entries must be >= {minimum}, got {lo}")
    return value


def clamp_budget(value: torch.Tensor, minimum: int, device) -> torch.Tensor:
    """A checked budget tensor as int64 on ``device`` with its entries clamped to ``[minimum,
    BUDGET_MAX]`` (on the device, no sync: with validation off, entries below the minimum act as
    the minimum and int64 entries beyond int32 as "all", never wrapped)."""
    return value.to(device=device, dtype=torch.int64).clamp(min=minimum, max=BUDGET_MAX)


def check_row_sampling(last_q: object, extra_rows: object, aggregation: object) -> None:
    """The vertical-slash estimators' sampling arguments (the builders and their naive twin).
    Any size is accepted; the builders sample at most the prompt's rows (work and memory follow
    the prompt length, not these counts)."""
    if isinstance(last_q, bool) or not isinstance(last_q, int) or last_q < 1:
        raise ValueError(f"last_q must be a positive int, got {last_q!r}")
    if isinstance(extra_rows, bool) or not isinstance(extra_rows, int) or extra_rows < 0:
        raise ValueError(f"extra_rows must be a non-negative int, got {extra_rows!r}")
    if aggregation not in ("sum", "max"):
        raise ValueError(f"aggregation must be 'sum' or 'max', got {aggregation!r}")


def default_scale(D: int, scale: float | None) -> float:
    """The softmax scale: ``D ** -0.5`` by default, else ``scale``, which must be a finite
    positive number (an int or a float; bools refused)."""
    if isinstance(D, bool) or not isinstance(D, int) or D < 1:
        raise ValueError(f"head dim D must be an int >= 1, got {D!r}")
    if scale is None:
        return D ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or not scale > 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return float(scale)
