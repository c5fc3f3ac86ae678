"""Hypothesis strategies for fuzzing attention kernels, index builders and converters.

Every strategy here draws *hard* cases on purpose: lengths that are not multiples of any tile,
indices that are duplicated, unsorted, padded in the middle, above the diagonal or before the
start of a row. Bulk index values come from a ``torch.Generator`` seeded by a hypothesis-drawn
integer, while the *features* of a draw (sizes, whether offset 0 is present, where padding
goes, ...) are separate hypothesis draws, so shrinking still walks towards small, plain cases
and every feature is guaranteed to appear often instead of by luck.

Strategies (all return CPU tensors; move them with ``.to(device)``):

``attention_shapes(*, max_batch, max_kv_heads, max_group, min_n, max_n, head_dims)``
    :class:`AttnShape` ``(B, Hq, Hkv, N, D)`` with ``Hq = Hkv * group``. ``N`` is drawn from
    :data:`ODD_LENGTHS` (1, 17, 63, 65, 97, ...) half of the time, otherwise uniformly.
``ragged_rows(B, N)``
    ``(seqlens, seqstarts)``: ``(None, None)`` (every row full), ``(seqlens, None)`` (right
    padding, starts default to 0) or both int32 ``[B]``. Each row is independently full,
    empty (length 0), right-padded, left-padded or at an arbitrary offset.
``head_subsets(Hq, *, allow_empty=False)``
    ``None`` (all heads) or an int32 ``[Hg]`` tensor of distinct local heads, sometimes unsorted.
``vertical_slash_indices(B, Hg, N, *, max_vertical=24, max_slash=24)``
    ``(vertical [B,Hg,NV], slash [B,Hg,NS])`` int32, values in ``[-1, N)``, -1 padded (at the
    tail, in the middle, or whole rows), with duplicates, unsorted, verticals placed on slash
    diagonals, large offsets that run off the start of early rows, offset 0 present in every
    row / absent everywhere / random, and ``NV`` or ``NS`` possibly 1.
``block_sparse_indices(B, Hg, N, block, *, max_k=8)``
    ``blocks [B,Hg,ceil(N/block),K]`` int32 in ``[-1, NQB)``: duplicates, blocks above the
    diagonal, -1 padding (including all-padding rows), diagonal block forced / removed / random.
``ashape_budgets(H_global, *, max_n=160)``
    ``(sink, window)``: Python ints, or int32 ``[H_global]`` tensors (per global head). Covers
    sink 0, window 1, sink inside the window, sink beyond the window, and both larger than
    ``max_n``.
``tp_offsets(H_local, *, max_world=4)``
    ``(head_offset, H_global)`` of a tensor-parallel rank: ``rank * H_local``, ``world * H_local``.
``layouts()``
    A memory layout name for :func:`qkv` (see :data:`LAYOUTS`).

Plain functions:

``qkv(shape, dtype, device, seed, *, sharpness=1.0, layout="contiguous")``
    Deterministic ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]``: standard normal (never zeros) drawn in
    float64 on the CPU, quantised to ``dtype`` and moved to ``device``. ``sharpness`` multiplies
    ``q`` so the softmax logits have standard deviation about ``sharpness`` (peaky attention for
    values above 1). ``layout`` returns non-contiguous views: ``"transposed"`` stores
    ``[B, N, H, D]`` (the layout after a linear projection) and returns its ``transpose(1, 2)``;
    ``"padded"`` stores extra heads and a wider head dimension and returns a slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

__all__ = [
    "AttnShape",
    "ODD_LENGTHS",
    "LAYOUTS",
    "attention_shapes",
    "ragged_rows",
    "query_rows",
    "head_subsets",
    "vertical_slash_indices",
    "block_sparse_indices",
    "ashape_budgets",
    "tp_offsets",
    "layouts",
    "qkv",
]

#: Sequence lengths that straddle the usual tile sizes (16, 32, 64, 128) on purpose.
ODD_LENGTHS = (1, 2, 15, 17, 31, 33, 63, 64, 65, 97, 113, 127, 128, 129, 150, 160, 193, 255, 257)
#: Memory layouts :func:`qkv` can return.
LAYOUTS = ("contiguous", "transposed", "padded")
#: Slack added by the ``"padded"`` layout: extra heads and extra head-dimension elements.
_PAD_HEADS = 1
_PAD_DIM = 8
#: Offsets below this are "local" diagonals; half of the slash offsets are drawn from them.
_LOCAL_OFFSETS = 8
_SEED_MAX = 2**31 - 1
#: Probability that an entry becomes -1 padding when padding is scattered through a row.
_PAD_PROB = 0.3
#: Tri-state feature: forced into every row, removed from every row, or left to chance.
_TRISTATE = ("present", "absent", "random")


@dataclass(frozen=True)
class AttnShape:
    """Attention problem size: ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]``."""

    B: int
    Hq: int
    Hkv: int
    N: int
    D: int

    @property
    def group(self) -> int:
        """Query heads per kv head (``Hq // Hkv``)."""
        return self.Hq // self.Hkv


@st.composite
def attention_shapes(
    draw,
    *,
    max_batch: int = 2,
    max_kv_heads: int = 2,
    max_group: int = 3,
    min_n: int = 1,
    max_n: int = 160,
    head_dims: tuple[int, ...] = (16, 32, 64),
) -> AttnShape:
    """Strategy for :class:`AttnShape`; ``N`` is often one of :data:`ODD_LENGTHS` in range."""
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    odd = [n for n in ODD_LENGTHS if min_n <= n <= max_n]
    lengths = st.integers(min_n, max_n)
    N = draw(st.one_of(st.sampled_from(odd), lengths) if odd else lengths)
    D = draw(st.sampled_from(head_dims))
    return AttnShape(B=B, Hq=Hkv * group, Hkv=Hkv, N=N, D=D)


@st.composite
def ragged_rows(draw, B: int, N: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Strategy for ``(seqlens, seqstarts)`` int32 ``[B]`` tensors, ``(seqlens, None)`` or ``(None, None)``."""
    form = draw(st.sampled_from(("none", "lens_only", "both")))
    if form == "none":
        return None, None
    lens, starts = [], []
    for _ in range(B):
        if form == "lens_only":
            mode = draw(st.sampled_from(("full", "empty", "right")))
        else:
            mode = draw(st.sampled_from(("full", "empty", "right", "left", "offset")))
        if mode == "full":
            n, s = N, 0
        elif mode == "empty":
            n = 0
            s = 0 if form == "lens_only" else draw(st.integers(0, N))
        else:
            n = draw(st.integers(0, N))
            fixed = {"right": 0, "left": N - n}.get(mode)
            s = draw(st.integers(0, N - n)) if fixed is None else fixed
        lens.append(n)
        starts.append(s)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return (seqlens, None) if form == "lens_only" else (seqlens, torch.tensor(starts, dtype=torch.int32))


@st.composite
def query_rows(draw, B: int, N: int, seqlens, seqstarts):
    """Strategy for query rows that are part of the key rows (docs/kernels.md) of length ``N``
    (``seqlens``/``seqstarts`` as drawn by :func:`ragged_rows`): ``(Nq, q_seqlens, q_seqstarts,
    q_lens, q_starts)``, a call's query-row arguments and the rows they mean (host lists), written
    out here from the contract, independently of :func:`minference._checks.check_query_rows`.

    Forms: ``chunk`` (full key rows, ``Nq < N`` queries, no ``q_seqlens``: the last ``Nq`` tokens
    of every row; ``N = 1``: the ordinary call), ``explicit`` (any ``Nq``, ``q_seqlens`` a tensor with 0 and whole
    rows likely, or an int ``c``: ``min(c, row)``; ``q_seqstarts`` given or 0) and ``in_place``
    (``Nq == N``, ``q_seqlens`` given, ``q_seqstarts`` given or the queries' own places)."""
    lens = [N] * B if seqlens is None else seqlens.tolist()
    starts = [0] * B if seqstarts is None else seqstarts.tolist()
    ragged = seqlens is not None or seqstarts is not None
    form = draw(st.sampled_from(("explicit", "in_place") if ragged else ("chunk", "chunk", "explicit", "in_place")))
    if form == "chunk":
        Nq = draw(st.integers(1, N - 1)) if N > 1 else 1
        if Nq == N:  # the ordinary call: every key row is its own query row
            return Nq, None, None, lens, starts
        return Nq, None, None, [Nq] * B, [0] * B
    Nq = N if form == "in_place" else draw(st.integers(1, N))
    if draw(st.booleans()):
        c = draw(st.integers(0, Nq + 2))
        q_seqlens, q_lens = c, [min(c, n, Nq) for n in lens]
    else:
        q_lens = [draw(st.sampled_from((0, min(n, Nq), draw(st.integers(0, min(n, Nq)))))) for n in lens]
        q_seqlens = torch.tensor(q_lens, dtype=torch.int32)
    if draw(st.booleans()):  # the default places
        places = [s + n - c for s, n, c in zip(starts, lens, q_lens)] if Nq == N else [0] * B
        return Nq, q_seqlens, None, q_lens, places
    q_starts = [draw(st.integers(0, Nq - c)) for c in q_lens]
    return Nq, q_seqlens, torch.tensor(q_starts, dtype=torch.int32), q_lens, q_starts


@st.composite
def head_subsets(draw, Hq: int, *, allow_empty: bool = False) -> torch.Tensor | None:
    """Strategy for ``None`` or an int32 ``[Hg]`` tensor of distinct heads in ``[0, Hq)``."""
    if draw(st.booleans()):
        return None
    order = draw(st.permutations(range(Hq)))
    size = draw(st.integers(0 if allow_empty else 1, Hq))
    chosen = list(order[:size])
    if draw(st.booleans()):
        chosen.sort()
    return torch.tensor(chosen, dtype=torch.int32)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _add_duplicates(x: torch.Tensor, g: torch.Generator) -> None:
    """Copy random entries of the last axis over other entries of the same row (in place)."""
    k = x.shape[-1]
    if k < 2:
        return
    src = torch.randint(0, k, x.shape, generator=g)
    take = torch.rand(x.shape, generator=g) < 0.5
    x.copy_(torch.where(take, torch.gather(x, -1, src), x))


def _add_padding(x: torch.Tensor, g: torch.Generator, mode: str) -> None:
    """Write -1 padding into ``x [..., K]`` (in place): at the tail, scattered, or whole rows."""
    if mode == "none":
        return
    k = x.shape[-1]
    if mode == "tail":
        keep = torch.randint(0, k + 1, x.shape[:-1], generator=g)
        pad = torch.arange(k) >= keep[..., None]
    elif mode == "scattered":
        pad = torch.rand(x.shape, generator=g) < _PAD_PROB
    else:  # "rows": some rows entirely padding
        pad = (torch.rand(x.shape[:-1], generator=g) < _PAD_PROB)[..., None].expand(x.shape)
    x.masked_fill_(pad, -1)


def _force(x: torch.Tensor, value: torch.Tensor, g: torch.Generator) -> None:
    """Write ``value`` (broadcastable to ``x[..., 0]``) at one random position of each row."""
    pos = torch.randint(0, x.shape[-1], (*x.shape[:-1], 1), generator=g)
    x.scatter_(-1, pos, torch.broadcast_to(value, x.shape[:-1])[..., None].to(x.dtype))


def _remove(x: torch.Tensor, value: torch.Tensor) -> None:
    """Replace every occurrence of ``value`` (broadcastable to ``x[..., :1]``) by -1 padding."""
    x.masked_fill_(x == value, -1)


@st.composite
def vertical_slash_indices(
    draw, B: int, Hg: int, N: int, *, max_vertical: int = 24, max_slash: int = 24
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strategy for ``(vertical [B,Hg,NV], slash [B,Hg,NS])`` int32 logical indices, -1 padded."""
    if N < 1:
        raise ValueError(f"N must be >= 1, got {N}")
    NV = draw(st.integers(1, max_vertical))
    NS = draw(st.integers(1, max_slash))
    g = _generator(draw(st.integers(0, _SEED_MAX)))
    vertical = torch.randint(0, N, (B, Hg, NV), generator=g, dtype=torch.int32)
    local = torch.randint(0, min(N, _LOCAL_OFFSETS), (B, Hg, NS), generator=g, dtype=torch.int32)
    far = torch.randint(0, N, (B, Hg, NS), generator=g, dtype=torch.int32)
    slash = torch.where(torch.rand(B, Hg, NS, generator=g) < 0.5, local, far)
    if draw(st.booleans()):  # the longest offset: runs off the start of every row but the last
        _force(slash, torch.tensor(N - 1), g)
    if draw(st.booleans()):  # attention sink column
        _force(vertical, torch.tensor(0), g)
    if draw(st.booleans()):  # verticals lying on a slash diagonal, seen from some query row
        row = torch.randint(0, N, (B, Hg, NV), generator=g)
        pick = torch.gather(slash, -1, torch.randint(0, NS, (B, Hg, NV), generator=g))
        on_diag = (row - pick).clamp(min=0).to(torch.int32)
        vertical = torch.where(torch.rand(B, Hg, NV, generator=g) < 0.5, on_diag, vertical)
    zero = draw(st.sampled_from(_TRISTATE))
    if zero == "absent":
        _remove(slash, torch.tensor(0))
    if draw(st.booleans()):
        _add_duplicates(vertical, g)
    if draw(st.booleans()):
        _add_duplicates(slash, g)
    _add_padding(vertical, g, draw(st.sampled_from(("none", "tail", "scattered", "rows"))))
    _add_padding(slash, g, draw(st.sampled_from(("none", "tail", "scattered", "rows"))))
    if zero == "present":  # after padding, so that no row loses it
        _force(slash, torch.tensor(0), g)
    if draw(st.booleans()):
        vertical = vertical.sort(dim=-1).values
        slash = slash.sort(dim=-1).values
    return vertical.contiguous(), slash.contiguous()


@st.composite
def block_sparse_indices(draw, B: int, Hg: int, N: int, block: int, *, max_k: int = 8) -> torch.Tensor:
    """Strategy for ``blocks [B, Hg, ceil(N/block), K]`` int32 key-block ids in ``[-1, NQB)``."""
    if N < 1 or block < 1:
        raise ValueError(f"N and block must be >= 1, got N={N}, block={block}")
    nqb = -(-N // block)
    K = draw(st.integers(1, max_k))
    g = _generator(draw(st.integers(0, _SEED_MAX)))
    blocks = torch.randint(0, nqb, (B, Hg, nqb, K), generator=g, dtype=torch.int32)
    diag = torch.arange(nqb, dtype=torch.int32)[:, None]  # [NQB, 1]
    diagonal = draw(st.sampled_from(_TRISTATE))
    if diagonal == "absent":
        _remove(blocks, diag)
    if draw(st.booleans()):  # sink block
        _force(blocks, torch.tensor(0), g)
    if draw(st.booleans()):
        _add_duplicates(blocks, g)
    _add_padding(blocks, g, draw(st.sampled_from(("none", "tail", "scattered", "rows"))))
    if diagonal == "present":
        _force(blocks, diag[:, 0].to(torch.int32), g)
    if draw(st.booleans()):
        blocks = blocks.sort(dim=-1).values
    return blocks.contiguous()


def _budget_pair(max_n: int):
    """Strategy for one ``(sink, window)`` pair of ints."""
    big = max_n + _LOCAL_OFFSETS
    sink = st.one_of(st.just(0), st.integers(0, _LOCAL_OFFSETS), st.integers(0, big))
    window = st.one_of(st.just(1), st.integers(1, _LOCAL_OFFSETS * 2), st.integers(1, big), st.just(big))
    return st.tuples(sink, window)


@st.composite
def ashape_budgets(draw, H_global: int, *, max_n: int = 160) -> tuple[int | torch.Tensor, int | torch.Tensor]:
    """Strategy for ``(sink, window)``: ints, or int32 ``[H_global]`` tensors indexed by global head."""
    pair = _budget_pair(max_n)
    if draw(st.booleans()):
        return draw(pair)
    pairs = draw(st.lists(pair, min_size=H_global, max_size=H_global))
    sink = torch.tensor([p[0] for p in pairs], dtype=torch.int32)
    window = torch.tensor([p[1] for p in pairs], dtype=torch.int32)
    return sink, window


@st.composite
def tp_offsets(draw, H_local: int, *, max_world: int = 4) -> tuple[int, int]:
    """Strategy for ``(head_offset, H_global)`` of a tensor-parallel rank owning ``H_local`` heads."""
    world = draw(st.integers(1, max_world))
    rank = draw(st.integers(0, world - 1))
    return rank * H_local, world * H_local


def layouts() -> st.SearchStrategy[str]:
    """Strategy for a :func:`qkv` memory layout name."""
    return st.sampled_from(LAYOUTS)


def _view(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Return a copy of contiguous ``x [B,H,N,D]`` in ``layout`` (same values, other strides)."""
    B, H, N, D = x.shape
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    store = torch.zeros(B, H + _PAD_HEADS, N, D + _PAD_DIM, dtype=x.dtype, device=x.device)
    store[:, :H, :, :D] = x
    return store[:, :H, :, :D]


def qkv(
    shape: AttnShape,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    *,
    sharpness: float = 1.0,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic random ``q [B,Hq,N,D]``, ``k, v [B,Hkv,N,D]`` in ``dtype`` on ``device``.

    Values are standard normal drawn in float64 on the CPU (``seed`` fixes them), then quantised
    to ``dtype``. ``q`` is multiplied by ``sharpness`` so that with the default scale
    ``D ** -0.5`` the logits have standard deviation about ``sharpness``. ``layout`` is one of
    :data:`LAYOUTS`.
    """
    if not isinstance(shape, AttnShape):
        raise TypeError(f"shape must be an AttnShape, got {type(shape).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not sharpness > 0:
        raise ValueError(f"sharpness must be positive, got {sharpness!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    g = _generator(seed)
    q = torch.randn(shape.B, shape.Hq, shape.N, shape.D, generator=g, dtype=torch.float64) * sharpness
    k = torch.randn(shape.B, shape.Hkv, shape.N, shape.D, generator=g, dtype=torch.float64)
    v = torch.randn(shape.B, shape.Hkv, shape.N, shape.D, generator=g, dtype=torch.float64)
    return _view(q.to(dtype=dtype).to(device), layout), _view(k.to(dtype=dtype).to(device), layout), _view(
        v.to(dtype=dtype).to(device), layout)
