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

How many columns, diagonals or blocks a head keeps is its *budget rule* (``rule``, the same for
the columns and the diagonals of a vertical-slash head): ``"top_k"`` keeps exactly the budget
(``vertical``, ``slash``, ``top_k``); ``"mass"`` keeps the fewest best-scoring candidates whose
share of the estimated weight reaches ``threshold`` (γ, FlexPrefill / XAttention); ``"relative"``
keeps every candidate whose weight is at least ``threshold`` (α) times the largest (FlashPrefill).
The adaptive counts are bounded by ``min_*`` below and the budget above, so the kernels keep a
bounded tile list. The exact rule is in :mod:`minference.reference.estimators`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
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
    "canonical_pattern_dict",
    "canonical_layers",
    "DEFAULT_LAST_Q",
    "DEFAULT_BLOCK_SIZE",
    "RULES",
    "BLOCK_ESTIMATES",
    "check_budget_rule",
    "check_score_rows",
]

#: Query rows used by the vertical-slash estimator (the last ``r`` queries of the prompt).
DEFAULT_LAST_Q = 64
#: Key/query block size of the block-sparse pattern (a routing granularity, not a kernel tile).
DEFAULT_BLOCK_SIZE = 64


#: Block-sparse routing scores (the first is the default).
BLOCK_ESTIMATES = ("pooled", "query")
#: Budget rules of the vertical-slash and block-sparse patterns (the first is the default).
RULES = ("top_k", "mass", "relative")


def check_score_rows(name: str, score_rows: object, estimate: str) -> int:
    """Validate block-sparse scoring rows (an int ``>= 0``, above 0 only with the query-aware
    estimate, which alone reads single queries); ``name`` is the field's name in the messages
    (``BlockSparse.score_rows``, or ``score_rows`` for builder arguments)."""
    rows = check_int(name, score_rows, 0)
    if rows and estimate != "query":
        raise ValueError(f"{name}={rows} needs estimate='query' (the pooled estimate reads every query)")
    return rows


def check_budget_rule(name: str, rule: object, threshold: object) -> float | None:
    """Validate a budget rule and its threshold; return the threshold as a float (``None`` for
    ``"top_k"``, which takes none). ``name`` (a pattern class, or empty for builder arguments)
    prefixes the field names in the messages."""
    prefix = f"{name}." if name else ""
    if rule not in RULES:
        raise ValueError(f"{prefix}rule must be one of {list(RULES)}, got {rule!r}")
    if rule == "top_k":
        if threshold is not None:
            raise ValueError(f"{prefix}threshold is for the 'mass' and 'relative' rules; leave it None with "
                             f"'top_k', got {threshold!r}")
        return None
    if threshold is None:
        raise ValueError(f"{prefix}threshold is required with rule {rule!r} (a fraction in (0, 1])")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"{prefix}threshold must be a float, got {type(threshold).__name__}")
    if not math.isfinite(threshold) or not 0 < threshold <= 1:
        raise ValueError(f"{prefix}threshold must be finite and in (0, 1], got {threshold!r}")
    return float(threshold)


def _check_minimum(name: str, field: str, minimum: object, bound: str, maximum: int) -> None:
    if check_int(f"{name}.{field}", minimum, 0) > maximum:
        raise ValueError(f"{name}.{field} must be <= {bound} ({maximum}), got {minimum}")


def _check_kind(pattern: object, kind: str) -> None:
    actual = getattr(pattern, "kind", None)
    if actual != kind:
        raise ValueError(f"{type(pattern).__name__}.kind must be {kind!r}, got {actual!r}")


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
        rule: budget rule of both the columns and the diagonals (module docstring): ``"top_k"``
            keeps ``vertical`` / ``slash`` of them; ``"mass"`` and ``"relative"`` decide per
            input, with ``vertical`` / ``slash`` as the maximum.
        threshold: γ of ``"mass"`` (share of the column, resp. diagonal, score total) or α of
            ``"relative"`` (fraction of the largest score), in ``(0, 1]``; ``None`` for ``"top_k"``.
        min_vertical, min_slash: fewest columns / diagonals the adaptive rules keep (the forced
            ones are kept anyway); at most ``vertical`` / ``slash``.
    """

    vertical: int = 1000
    slash: int = 6096
    last_q: int = DEFAULT_LAST_Q
    sink_columns: int = 30
    local_diagonals: int = 100
    aggregation: Literal["sum", "max"] = "sum"
    extra_rows: int = 0
    rule: Literal["top_k", "mass", "relative"] = "top_k"
    threshold: float | None = None
    min_vertical: int = 0
    min_slash: int = 0
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
        object.__setattr__(self, "threshold", check_budget_rule("VerticalSlash", self.rule, self.threshold))
        _check_minimum("VerticalSlash", "min_vertical", self.min_vertical, "vertical", self.vertical)
        _check_minimum("VerticalSlash", "min_slash", self.min_slash, "slash", self.slash)


@dataclass(frozen=True)
class BlockSparse:
    """Top-k key blocks per query block, routed by mean-pooled queries and keys.

    Attributes:
        top_k: key blocks kept per query block, forced blocks included (the maximum of the
            adaptive rules).
        block: block size in tokens, for both queries and keys.
        sink_blocks: leading key blocks always kept.
        force_diagonal: always keep the query block's own (causal-masked) diagonal block.
        rule: budget rule per query block (module docstring); the weights are the softmax
            numerators ``exp(s - max s)`` of the pooled block logits ``s``.
        threshold: γ of ``"mass"`` or α of ``"relative"``, in ``(0, 1]``; ``None`` for ``"top_k"``.
        min_blocks: fewest blocks the adaptive rules keep per query block (at most ``top_k``).
        estimate: the routing score: ``"pooled"``, ``scale * mean(q in I) · mean(k in J)``
            (weights ``exp(s - max s)``), or ``"query"``, every query of ``I`` against the block
            means, softmaxed per query over ``J <= I`` and maxed over the block's queries (the
            weights themselves; one query that needs a far block is not averaged away). Exact
            definitions in :mod:`minference.reference.estimators`.
        score_rows: with ``estimate="query"``, how many of a block's queries score it: 0 all of
            them, ``0 < r < block`` at most ``r`` spaced ``block // r`` apart back from its last
            query (the cheaper estimate: ``block / r`` times less score work; a needle only an
            unsampled query reads is missed).
    """

    top_k: int = 100
    block: int = DEFAULT_BLOCK_SIZE
    sink_blocks: int = 1
    force_diagonal: bool = True
    rule: Literal["top_k", "mass", "relative"] = "top_k"
    threshold: float | None = None
    min_blocks: int = 0
    estimate: Literal["pooled", "query"] = "pooled"
    score_rows: int = 0
    kind: Literal["block_sparse"] = "block_sparse"

    def __post_init__(self) -> None:
        _check_kind(self, "block_sparse")
        check_int("BlockSparse.top_k", self.top_k, 1)
        check_int("BlockSparse.block", self.block, 1)
        check_int("BlockSparse.sink_blocks", self.sink_blocks, 0)
        if not isinstance(self.force_diagonal, bool):
            raise TypeError("BlockSparse.force_diagonal must be a bool")
        object.__setattr__(self, "threshold", check_budget_rule("BlockSparse", self.rule, self.threshold))
        _check_minimum("BlockSparse", "min_blocks", self.min_blocks, "top_k", self.top_k)
        if self.estimate not in BLOCK_ESTIMATES:
            raise ValueError(f"BlockSparse.estimate must be one of {list(BLOCK_ESTIMATES)}, got {self.estimate!r}")
        check_score_rows("BlockSparse.score_rows", self.score_rows, self.estimate)
        if self.score_rows >= self.block:  # one form for "every row": one group, one cost key
            raise ValueError(f"BlockSparse.score_rows={self.score_rows} is every query of a {self.block}-token block: "
                             "use 0")


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


def canonical_pattern_dict(data: dict) -> dict:
    """``data`` (a pattern's plain-JSON form, checked by :func:`pattern_from_dict`) without the
    fields at their defaults, ``kind`` kept: two writers' dicts of one pattern compare equal in this
    form whatever fields the older one did not know (reports written before
    ``BlockSparse.score_rows`` lack it)."""
    pattern = pattern_from_dict(data)
    default = type(pattern)()
    return {k: v for k, v in pattern_to_dict(pattern).items() if k == "kind" or v != getattr(default, k)}


def canonical_layers(layers: list | None) -> list | None:
    """A PatternConfig dict's ``layers`` (lists of pattern dicts) with every pattern in its
    :func:`canonical_pattern_dict` form."""
    return None if layers is None else [[canonical_pattern_dict(p) for p in layer] for layer in layers]


def pattern_from_dict(data: dict) -> Pattern:
    """Build a pattern from its plain-JSON form, refusing unknown kinds and fields."""
    if not isinstance(data, dict):
        raise TypeError(f"pattern must be a dict, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in PATTERN_TYPES:
        raise ValueError(f"unknown pattern kind {kind!r}; expected one of {sorted(PATTERN_TYPES)}")
    cls = PATTERN_TYPES[kind]
    fields = {f.name for f in dataclass_fields(cls)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for pattern {kind!r}")
    return cls(**data)
