"""Sparse prefill patterns: which geometry a head uses, and its budgets.

Every number that is a choice lives here as a named default. Kernels never decide budgets and
patterns never hold kernel tuning (block sizes for tiling, warps, stages).

Candidate sets, for query position ``i`` (0-based, causal ``j <= i``):

* :class:`AShape` ``(sink g, window w)``: ``{0..min(g-1, i)} ∪ {max(0, i-w+1)..i}``.
* :class:`VerticalSlash` with chosen columns ``C`` and offsets ``D``:
  ``{j ∈ C : j <= i} ∪ {i - δ : δ ∈ D, i - δ >= 0}``.
* :class:`BlockSparse` with chosen key blocks ``J(I)`` for the query block ``I = i // block``:
  ``{j : j // block ∈ J(I), j <= i}``.
* :class:`Dense`: ``{0..i}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Union

from minference._checks import check_int

__all__ = [
    "AShape",
    "VerticalSlash",
    "BlockSparse",
    "Dense",
    "Pattern",
    "PATTERN_TYPES",
    "pattern_from_dict",
    "DEFAULT_LAST_Q",
    "DEFAULT_BLOCK_SIZE",
]

#: Query rows used by the vertical-slash estimator (the last ``r`` queries of the prompt).
DEFAULT_LAST_Q = 64
#: Key/query block size of the block-sparse pattern (a routing granularity, not a kernel tile).
DEFAULT_BLOCK_SIZE = 64


def _check_kind(pattern: object, kind: str) -> None:
    if pattern.kind != kind:
        raise ValueError(f"{type(pattern).__name__}.kind must be {kind!r}, got {pattern.kind!r}")


@dataclass(frozen=True)
class AShape:
    """Attention sinks plus a local sliding window (the "A" shape of the attention map).

    Attributes:
        sink: number of initial key positions every query reads (``g``).
        window: width of the local window including the query itself (``w``).
    """

    sink: int = 128
    window: int = 4096
    kind: Literal["a_shape"] = "a_shape"

    def __post_init__(self) -> None:
        _check_kind(self, "a_shape")
        check_int("AShape.sink", self.sink, 0)
        check_int("AShape.window", self.window, 1)


@dataclass(frozen=True)
class VerticalSlash:
    """A few key columns plus a few diagonals, chosen online from the last ``last_q`` queries
    (and optionally ``extra_rows`` earlier ones).

    Attributes:
        vertical: number of key columns kept (``|C|``), forced sinks included.
        slash: number of diagonal offsets kept (``|D|``), forced local diagonals included.
        last_q: query rows (the last of the prompt) whose attention estimates the scores.
        sink_columns: leading key columns always kept (attention sinks).
        local_diagonals: offsets ``0..local_diagonals-1`` always kept (``δ = 0`` is the query
            itself and is always kept even when this is 0).
        aggregation: how the sampled rows' probabilities reduce to one score per column or
            diagonal: ``"sum"`` or ``"max"``.
        extra_rows: further query rows, spread evenly over the part of the prompt before the
            last ``last_q``, that join the estimate (0: the last rows only; the exact rule is in
            :mod:`minference.reference.estimators`).
    """

    vertical: int = 1000
    slash: int = 6096
    last_q: int = DEFAULT_LAST_Q
    sink_columns: int = 30
    local_diagonals: int = 100
    aggregation: Literal["sum", "max"] = "sum"
    extra_rows: int = 0
    kind: Literal["vertical_slash"] = "vertical_slash"

    def __post_init__(self) -> None:
        _check_kind(self, "vertical_slash")
        check_int("VerticalSlash.vertical", self.vertical, 0)
        check_int("VerticalSlash.slash", self.slash, 1)
        check_int("VerticalSlash.last_q", self.last_q, 1)
        check_int("VerticalSlash.sink_columns", self.sink_columns, 0)
        check_int("VerticalSlash.local_diagonals", self.local_diagonals, 0)
        check_int("VerticalSlash.extra_rows", self.extra_rows, 0)
        if self.aggregation not in ("sum", "max"):
            raise ValueError(f"VerticalSlash.aggregation must be 'sum' or 'max', got {self.aggregation!r}")


@dataclass(frozen=True)
class BlockSparse:
    """Top-k key blocks per query block, routed by mean-pooled queries and keys.

    Attributes:
        top_k: key blocks kept per query block, forced blocks included.
        block: block size in tokens, for both queries and keys.
        sink_blocks: leading key blocks always kept.
        force_diagonal: always keep the query block's own (causal-masked) diagonal block.
    """

    top_k: int = 100
    block: int = DEFAULT_BLOCK_SIZE
    sink_blocks: int = 1
    force_diagonal: bool = True
    kind: Literal["block_sparse"] = "block_sparse"

    def __post_init__(self) -> None:
        _check_kind(self, "block_sparse")
        check_int("BlockSparse.top_k", self.top_k, 1)
        check_int("BlockSparse.block", self.block, 1)
        check_int("BlockSparse.sink_blocks", self.sink_blocks, 0)
        if not isinstance(self.force_diagonal, bool):
            raise TypeError("BlockSparse.force_diagonal must be a bool")


@dataclass(frozen=True)
class Dense:
    """Full causal attention (the fallback, and the choice for heads that resist sparsity)."""

    kind: Literal["dense"] = "dense"

    def __post_init__(self) -> None:
        _check_kind(self, "dense")


Pattern = Union[AShape, VerticalSlash, BlockSparse, Dense]
PATTERN_TYPES: dict[str, type] = {
    "a_shape": AShape,
    "vertical_slash": VerticalSlash,
    "block_sparse": BlockSparse,
    "dense": Dense,
}


def pattern_to_dict(pattern: Pattern) -> dict:
    """Plain-JSON form of a pattern (``kind`` plus its fields)."""
    return asdict(pattern)


def pattern_from_dict(data: dict) -> Pattern:
    """Build a pattern from its plain-JSON form, refusing unknown kinds and fields."""
    if not isinstance(data, dict):
        raise TypeError(f"pattern must be a dict, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in PATTERN_TYPES:
        raise ValueError(f"unknown pattern kind {kind!r}; expected one of {sorted(PATTERN_TYPES)}")
    cls = PATTERN_TYPES[kind]
    fields = set(cls.__dataclass_fields__)
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for pattern {kind!r}")
    return cls(**data)
