"""The index builders' shared half: validation, query rows, per-head budgets and budget rules,
and the one selection of columns, diagonals and blocks.

:func:`build_vertical_slash_index` and :func:`build_block_sparse_index` validate a builder call,
resolve its per-head budgets (:func:`vertical_slash_budgets`, :func:`block_sparse_budgets`) and
rules, and select with forced entries and budget rules (:func:`select_top`); the score
computation is plugged in by each backend's builders: the Triton ones in
:mod:`minference.kernels` (``estimate_vs``, ``estimate_bs``) and the PyTorch ones in
:mod:`minference.torch_backend`. :class:`QueryRows` describes the query rows of a call whose
queries are part of the key rows (docs/kernels.md, "query rows").

Budget rules (``rule``, ``threshold``, ``min_*`` of the patterns; definitions in
:mod:`minference.reference.estimators`) become per computed head tensors, a
:class:`SelectionRule` per selection, made once per plan like the budgets
(:func:`minference.index.prepare_plan`). Heads with different rules share a group; which counts
a selection computes is decided on the host from the rules the plan holds
(:attr:`SelectionRule.rules`), never from tensor values, so the adaptive rules keep the
dispatcher capturable in a CUDA graph.

Layer: below the kernels (``tests/unit/project/test_layering.py``): this module imports only
:mod:`minference._checks` and :mod:`minference.patterns`, so the Triton builders in
:mod:`minference.kernels` can use it without importing the plan side (:mod:`minference.index`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minference._checks import (
    arange_constant,
    capturing,
    check_budget,
    check_finite_kv,
    check_finite_rows,
    check_int,
    check_qkv_rows,
    check_query_rows,
    check_ragged,
    check_row_sampling,
    check_tensor,
    clamp_budget,
    default_scale,
    query_rows_bound,
    token_mask,
    uniform_query_rows,
)
from minference.patterns import BLOCK_ESTIMATES, RULES, check_budget_rule, check_score_rows

__all__ = [
    "SelectionRule",
    "RULE_CODES",
    "QueryRows",
    "query_rows",
    "scorer_rows",
    "scoring_rows",
    "blocks_from_slots",
    "heads_tensor",
    "budget_tensor",
    "vertical_slash_rules",
    "block_sparse_rules",
    "select_top",
    "select_vertical_slash",
    "extra_row_positions",
    "vertical_slash_budgets",
    "block_sparse_budgets",
    "build_vertical_slash_index",
    "build_block_sparse_index",
    "ROUTING_CHUNK_ELEMENTS",
]

#: Upper bound on the elements of one chunk of block-routing scores (bounds temporary memory).
ROUTING_CHUNK_ELEMENTS = 1 << 27
_INT = (torch.int32, torch.int64)
#: Budget rule -> its code in :attr:`SelectionRule.code` (and in rule tensors given to builders).
RULE_CODES = {rule: code for code, rule in enumerate(RULES)}
_NAN = float("nan")


@dataclass(frozen=True)
class SelectionRule:
    """The budget rule of one selection (columns, diagonals or blocks) per computed head.

    Attributes:
        code: ``[Hg]`` int64 rule of each head (:data:`RULE_CODES`).
        threshold: ``[Hg]`` float64 γ (``"mass"``) or α (``"relative"``); unused for ``"top_k"``.
        minimum: ``[Hg]`` int64 fewest entries the adaptive rules keep.
        rules: the rules that may occur among the heads, known on the host: the counts a
            selection computes (a ``"top_k"``-only set is the plain top-k path).
    """

    code: torch.Tensor
    threshold: torch.Tensor
    minimum: torch.Tensor
    rules: frozenset[str]


@dataclass(frozen=True)
class QueryRows:
    """The query rows of a builder call whose queries are part of the key rows (a chunk after a
    cache, or a row's last tokens: docs/kernels.md, "query rows"), checked by
    :func:`query_rows`.

    Row ``b``'s queries are the logical positions ``lens[b] - q_lens[b] .. lens[b] - 1`` of its
    key row, held in ``q`` at ``q_starts[b] ..`` (position ``p`` at row ``q_starts[b] + p -
    q_lo[b]``, ``q_lo = lens - q_lens``).

    Attributes:
        lens: ``[B]`` int32 ``q_lens``.
        starts: ``[B]`` int32 ``q_starts``.
        bound: host-known upper bound of every ``q_lens[b]``
            (:func:`minference._checks.query_rows_bound`): launch grids and the slot count follow it.
        N: the key rows' length (k's N axis).
        first: every row's first query position ``q_lo`` when it is the same for all rows and
            known on the host (full key rows, ``q_seqlens`` ``None`` or an int:
            :func:`minference._checks.uniform_query_rows`), else ``None``.
    """

    lens: torch.Tensor
    starts: torch.Tensor
    bound: int
    N: int
    first: int | None = None

    def slots(self, block: int) -> int:
        """Query blocks a row's queries can touch (the *slot* layout of the block builders: slot
        ``s`` of row ``b`` is query block ``q_lo[b] // block + s``): ``c`` consecutive positions
        span at most ``(c + block - 2) // block + 1`` blocks; at most ``ceil(N / block)``."""
        return 0 if self.bound == 0 else min(-(-self.N // block), (self.bound + block - 2) // block + 1)


def query_rows(q_seqlens, q_seqstarts, lens: torch.Tensor, starts: torch.Tensor, Nq: int, N: int, *,
               given_rows: bool, validate: bool) -> QueryRows | None:
    """:func:`minference._checks.check_query_rows` as a :class:`QueryRows`, or ``None`` for the
    ordinary call (every key row is its own query row: ``Nq == N`` and no ``q_seqlens``)."""
    rows = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N, given_rows=given_rows,
                            values=validate)
    if rows is None:
        return None
    uniform = uniform_query_rows(q_seqlens, q_seqstarts, Nq, N, given_rows=given_rows)
    return QueryRows(rows[0], rows[1], query_rows_bound(q_seqlens, Nq), N,
                     None if uniform is None else N - uniform[0])


def scorer_rows(slots: QueryRows | None, q_seqlens, q_seqstarts, lens: torch.Tensor, starts: torch.Tensor,
                Nq: int, N: int, given_rows: bool) -> QueryRows | None:
    """The query rows of a block scorer (``query_block_scores``, Triton and torch): the builder's
    already checked ``slots``, or ``q_seqlens`` / ``q_seqstarts`` checked here (not both)."""
    if slots is None:
        return query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N, given_rows=given_rows, validate=True)
    if q_seqlens is not None or q_seqstarts is not None:
        raise ValueError("give query rows either as q_seqlens / q_seqstarts or as slots, not both")
    return slots


def scoring_rows(ok: torch.Tensor, first: int, n: int, block: int, score_rows: int) -> torch.Tensor:
    """``ok [C, block]`` (the valid query positions of query blocks ``first .. first + C - 1`` of a
    row of length ``n``) narrowed to those that score their block under ``score_rows``: at most
    that many, ``max(1, block // score_rows)`` apart, counted back from the block's last position
    (:func:`minference.reference.estimators.scoring_positions`; 0: ``ok`` itself)."""
    if score_rows == 0 or score_rows >= block:
        return ok
    step = block // score_rows
    blocks = first + torch.arange(ok.shape[0], device=ok.device)[:, None]  # [C, 1]
    back = (blocks * block + block).clamp(max=n) - 1 - (blocks * block + torch.arange(block, device=ok.device))
    return ok & (back % step == 0) & (back < step * score_rows)


def blocks_from_slots(x: torch.Tensor, key_lens: torch.Tensor, qrows: QueryRows, block: int, nqb: int,
                      fill: float) -> torch.Tensor:
    """``x [B, Hg, S, W]`` in the slot layout (:meth:`QueryRows.slots`) -> ``[B, Hg, nqb, W]`` by
    query block, ``fill`` in the rows of query blocks no slot holds. One gather, no host sync; one
    pad when every row's first query is known on the host (``qrows.first``)."""
    B, Hg, S, W = x.shape
    if qrows.first is not None:  # slot 0 is query block first // block in every row: pad (or crop) to place it
        lead = qrows.first // block
        return torch.nn.functional.pad(x, (0, 0, lead, nqb - lead - S), value=fill)
    first = (key_lens - qrows.lens) // block  # [B] query block of slot 0
    # row 1 + slot of x padded with a fill row on either side: slots outside [0, S) clamp onto one
    at = (arange_constant(nqb + 1, x.device)[1:][None, :] - first[:, None]).clamp_(0, S + 1)  # [B, nqb]
    padded = torch.nn.functional.pad(x, (0, 0, 1, 1), value=fill)  # [B, Hg, S + 2, W]
    return padded.gather(2, at[:, None, :, None].expand(B, Hg, nqb, W))




def heads_tensor(heads: torch.Tensor | None, Hq: int, device) -> torch.Tensor:
    if heads is None:
        return arange_constant(Hq, device, torch.int32)
    check_tensor("heads", heads, rank=1, dtypes=_INT)
    if heads.device != torch.device(device) and torch.device(device).type != heads.device.type:
        raise ValueError(f"heads must be on {device}, got {heads.device}")
    return heads.to(device=device, dtype=torch.int32)


def budget_tensor(name: str, value: int | torch.Tensor, heads: torch.Tensor, head_offset: int,
                  minimum: int, *, total: int | None = None, validate: bool = False) -> torch.Tensor:
    """Per computed head budget ``[Hg]`` int64 on the heads' device, from an int or a 1-D int
    tensor indexed by global head id ``head_offset + h`` (no host sync for device tensors unless
    ``validate``).

    ``total``: the global heads the call covers (``head_offset + Hq``); a tensor with fewer
    entries is refused from its shape (``None``: not checked). ``validate``: tensor entries
    below ``minimum`` raise (a host read); otherwise they act as ``minimum``. Values beyond
    int32 act as :data:`~minference._checks.BUDGET_MAX` ("all": no row is that long)."""
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    value = check_budget(name, value, total=0 if total is None else total, minimum=minimum, values=validate,
                         read=heads.long() + head_offset if validate else None)
    if isinstance(value, int):
        return torch.full(heads.shape, value, dtype=torch.int64, device=heads.device)
    return clamp_budget(value, minimum, heads.device)[heads.long() + head_offset]


def _width(name: str, value: int | torch.Tensor, per_head: torch.Tensor, given: int | None, cap: int) -> int:
    """Output index width: ``given``, else the largest budget of the computed heads (a host read
    for tensor budgets), capped at ``cap``."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise ValueError(f"{name}_width must be a non-negative int, got {given!r}")
        return min(given, cap)
    top = value if isinstance(value, int) else int(per_head.max()) if per_head.numel() else 0
    return min(top, cap)


def _per_global_head(name: str, x: torch.Tensor, total: int | None) -> None:
    if total is not None and x.shape[0] < total:
        raise ValueError(f"{name} has {x.shape[0]} entries, fewer than the {total} global heads needed "
                         f"(one entry per global head id head_offset + h)")


def _rule_tensor(rule: str | torch.Tensor, heads: torch.Tensor, head_offset: int, total: int | None = None,
                 validate: bool = False) -> torch.Tensor:
    """Per computed head rule codes ``[Hg]`` int64 from a rule name or a 1-D int tensor of
    :data:`RULE_CODES` indexed by global head (codes read only with ``validate``)."""
    if isinstance(rule, torch.Tensor):
        check_tensor("rule", rule, rank=1, dtypes=_INT)
        _per_global_head("rule", rule, total)
        if validate and total and not capturing():
            lo, hi = int(rule[:total].min()), int(rule[:total].max())
            if lo < 0 or hi >= len(RULES):
                raise ValueError(f"rule codes must lie in [0, {len(RULES)}) ({list(RULES)}), got [{lo}, {hi}]")
        return rule.to(device=heads.device, dtype=torch.int64)[heads.long() + head_offset]
    return torch.full(heads.shape, RULE_CODES[rule], dtype=torch.int64, device=heads.device)


def _threshold_tensor(threshold: float | torch.Tensor, heads: torch.Tensor, head_offset: int,
                      total: int | None = None, validate: bool = False) -> torch.Tensor:
    if isinstance(threshold, torch.Tensor):
        check_tensor("threshold", threshold, rank=1, dtypes=(torch.float32, torch.float64))
        _per_global_head("threshold", threshold, total)
        if validate and total and not capturing():
            t = threshold[:total]
            if not bool(((t > 0) & (t <= 1)).all()):
                raise ValueError(f"threshold entries must be finite and in (0, 1], got {t.tolist()}")
        return threshold.to(device=heads.device, dtype=torch.float64)[heads.long() + head_offset]
    return torch.full(heads.shape, threshold, dtype=torch.float64, device=heads.device)


def _selection_rules(rule, threshold, minima: dict, heads: torch.Tensor, head_offset: int,
                     rules: frozenset[str] | None, total: int | None = None,
                     validate: bool = False) -> tuple[SelectionRule, ...] | None:
    """One :class:`SelectionRule` per entry of ``minima`` (name -> minimum), sharing the rule and
    threshold; ``None`` when ``rule`` is ``"top_k"``."""
    for name, value in minima.items():
        if not isinstance(value, torch.Tensor):
            check_int(name, value, 0)
    if isinstance(rule, torch.Tensor):
        used = frozenset(RULES) if rules is None else frozenset(rules)
        if not used <= set(RULES):
            raise ValueError(f"rules must be a subset of {list(RULES)}, got {sorted(used)}")
        if not isinstance(threshold, torch.Tensor):
            if threshold is None and used != {"top_k"}:
                raise ValueError("threshold is required with the rules 'mass' and 'relative'")
            threshold = 1.0 if threshold is None else check_budget_rule("", "mass", threshold)
    else:
        if isinstance(threshold, torch.Tensor):
            raise TypeError("a threshold tensor needs a rule tensor (per-head rules)")
        threshold = check_budget_rule("", rule, threshold)
        if rule == "top_k":
            return None
        used = frozenset((rule,))
    code = _rule_tensor(rule, heads, head_offset, total, validate)
    thr = _threshold_tensor(threshold, heads, head_offset, total, validate)
    return tuple(SelectionRule(code, thr, budget_tensor(name, value, heads, head_offset, 0, total=total,
                                                        validate=validate), used)
                 for name, value in minima.items())


def vertical_slash_rules(rule, threshold, min_vertical, min_slash, heads: torch.Tensor, head_offset: int, *,
                         rules: frozenset[str] | None = None, total: int | None = None,
                         validate: bool = False) -> tuple[SelectionRule, SelectionRule] | None:
    """The per computed head budget rules of a vertical-slash build: ``(columns, diagonals)``,
    one rule and threshold for both, or ``None`` when ``rule`` is ``"top_k"``.

    ``rule``: a name of :data:`~minference.patterns.RULES` or a 1-D int tensor of
    :data:`RULE_CODES` per global head ``head_offset + h`` (then ``rules`` names the codes it may
    hold, default all: the host decides the work from it); ``threshold``: a float (required by
    the adaptive rules), or a 1-D float tensor per global head (with a rule tensor);
    ``min_vertical``, ``min_slash``: ints or 1-D int tensors per global head. ``total``,
    ``validate``: as :func:`budget_tensor` (tensor lengths; codes, thresholds and minima read)."""
    made = _selection_rules(rule, threshold, {"min_vertical": min_vertical, "min_slash": min_slash}, heads,
                            head_offset, rules, total, validate)
    if made is None:
        return None
    columns, diagonals = made  # one rule per entry of the minima
    return columns, diagonals


def block_sparse_rules(rule, threshold, min_blocks, heads: torch.Tensor, head_offset: int, *,
                       rules: frozenset[str] | None = None, total: int | None = None,
                       validate: bool = False) -> tuple[SelectionRule] | None:
    """The per computed head budget rule of a block-sparse build, ``(blocks,)``, or ``None`` when
    ``rule`` is ``"top_k"``; arguments as :func:`vertical_slash_rules`."""
    made = _selection_rules(rule, threshold, {"min_blocks": min_blocks}, heads, head_offset, rules, total, validate)
    if made is None:
        return None
    (blocks,) = made  # one rule per entry of the minima
    return (blocks,)


def select_top(scores: torch.Tensor, forced: torch.Tensor, budget: torch.Tensor, width: int,
               rule: SelectionRule | None = None, *, logits: bool = False) -> torch.Tensor:
    """The selection of columns, diagonals and blocks (definition:
    :func:`minference.reference.estimators.select_row`).

    Args:
        scores: ``[B, Hg, ..., M]`` candidate scores, ``-inf`` = not a candidate. Any other
            non-finite score (NaN, ``+inf``: non-finite inputs) is a candidate with no score: kept
            when forced, never chosen otherwise, weight 0 (so one NaN never empties a selection).
        forced: ``[Hg]`` int count (positions ``< forced`` are forced) or a bool mask that
            broadcasts to ``scores``; forced candidates come first.
        budget: ``[Hg]`` int64: the count of ``"top_k"``, the maximum of the adaptive rules.
        width: output width (at most ``M``).
        rule: the heads' budget rules; ``None`` (or ``"top_k"`` only): every head keeps its budget.
        logits: the weights of the adaptive rules are ``exp(scores - max)`` over the row's
            candidates (block logits); else the scores themselves (``>= 0``).

    Returns:
        ``[B, Hg, ..., width]`` int32 positions, -1 padded. Per row ``min(max(count, minimum,
        forced), budget, candidates, width)`` entries, ``count`` from the head's rule (the budget
        for ``"top_k"``). Torch ops only, no host sync, fixed shapes.

    Two paths, chosen on the host from ``rule.rules``: every head ``"top_k"``: one
    ``torch.topk`` (forced entries as ``+inf``), entries in no particular order, ties at the
    budget's boundary as ``torch.topk`` breaks them. Otherwise the whole selection order by one
    stable descending sort (forced first in position order, then score descending, ties to the
    lowest position), the rules' counts from float64 weights (prefix sums along that order for
    ``"mass"``), entries in selection order: exactly the twin's, ties included. H200, ``[1, 32,
    2048, 2048]`` block logits (128K tokens, block 64): the topk 3.6 ms, the sort 3.7 ms, an int64
    (score, position) key topk 8.9 ms; at 512K the sort is 4.5x the topk per chunk.
    """
    lead = scores.shape[:-1]
    M = scores.shape[-1]
    if width == 0:
        return torch.empty(*lead, 0, dtype=torch.int32, device=scores.device)
    view = (1, -1) + (1,) * (scores.dim() - 2)  # [Hg] -> broadcast over [B, Hg, ..., M]
    candidate = scores != float("-inf")  # NaN and +inf too: candidates without a score
    ranked = scores.nan_to_num(nan=float("-inf"), posinf=float("-inf"), neginf=float("-inf"))  # finite ones rank
    if forced.dtype == torch.bool:
        forced = forced & candidate
    else:
        forced = (arange_constant(M, scores.device) < forced.reshape(view)) & candidate
    x = torch.where(forced, float("inf"), ranked)
    budget = budget.reshape(view)
    if rule is None or rule.rules == {"top_k"}:
        values, idx = torch.topk(x, width, dim=-1, sorted=True)
        keep = (arange_constant(width, scores.device) < budget) & (values > float("-inf"))
        return torch.where(keep, idx, -1).to(torch.int32)
    valid = ranked > float("-inf")  # the candidates with a (finite) score
    x = x.add_(0.0)  # -0.0 -> +0.0 (one zero, ties by position)
    values, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [B, Hg, ..., M]
    w = ranked.double()  # [B, Hg, ..., M] float64: the finite scores, -inf elsewhere
    if logits:  # no candidate: exp(-inf) = 0
        w = torch.exp(w - w.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).min))
    else:
        w = w.nan_to_num_(neginf=0.0)  # weight 0 where no finite score
    code, threshold = rule.code.reshape(view), rule.threshold.reshape(view)
    n_forced = forced.sum(-1, keepdim=True)
    count = budget
    # a rule that is the only one the heads may hold needs no per-head choice (rule.rules is a promise)
    if "relative" in rule.rules:
        above = (valid & ~forced & (w >= threshold * w.amax(-1, keepdim=True))).sum(-1, keepdim=True)
        count = n_forced + above if rule.rules == {"relative"} else torch.where(
            code == RULE_CODES["relative"], n_forced + above, count)
    if "mass" in rule.rules:
        cum = torch.gather(w, -1, order).cumsum_(-1)  # [B, Hg, ..., M] along the order
        reached = (cum < threshold * cum[..., -1:]).sum(-1, keepdim=True) + 1
        count = reached if rule.rules == {"mass"} else torch.where(code == RULE_CODES["mass"], reached, count)
    count = torch.maximum(count, rule.minimum.reshape(view))
    count = torch.minimum(torch.maximum(count, n_forced), budget)
    keep = (arange_constant(width, scores.device) < count) & (values[..., :width] > float("-inf"))
    return torch.where(keep, order[..., :width], -1).to(torch.int32)


def extra_row_positions(lens: torch.Tensor, N: int, last_q: int, extra_rows: int,
                        qrows: QueryRows | None = None) -> torch.Tensor:
    """The extra sampled query rows of each batch row (see
    :mod:`minference.reference.estimators`): ``[B, E]`` int64 logical positions, -1 for none.

    For a row of length ``n`` with ``m = n - min(last_q, n)`` earlier rows, entry ``k`` is
    ``floor((k + 1) * m / (extra_rows + 1))`` unless it repeats entry ``k - 1`` (tiny rows) or
    ``m = 0``. ``E = min(extra_rows, N)``, used in place of ``extra_rows``: both are ``>= m``
    when they differ (``m < N``), and any count ``>= m`` samples every earlier row (the points
    are less than one apart), so the set is the same and the tensor stays ``O(N)`` wide. Tensor
    ops on the lengths' device; no host sync.

    With query rows ``qrows`` the points spread over the earlier *query* positions ``[q_lo, n -
    min(last_q, n))`` instead (``m`` their count, entries offset by ``q_lo``), and ``E =
    min(extra_rows, N, qrows.bound)`` (no row has more than ``bound`` queries).
    """
    if qrows is not None:
        E = min(extra_rows, N, qrows.bound)
        n = lens.long()
        q_lo = n - qrows.lens.long()  # [B]
        m = (n - n.clamp(max=last_q) - q_lo).clamp(min=0)
        pos = arange_constant(E + 1, lens.device)[1:][None, :] * m[:, None] // (E + 1)  # [B, E]
        keep = pos < m[:, None]
        keep[:, 1:] &= pos[:, 1:] != pos[:, :-1]
        return torch.where(keep, pos + q_lo[:, None], -1)
    E = min(extra_rows, N)
    m = lens.long() - lens.long().clamp(max=last_q)  # [B]
    pos = arange_constant(E + 1, lens.device)[1:][None, :] * m[:, None] // (E + 1)  # [B, E]
    keep = pos < m[:, None]
    keep[:, 1:] &= pos[:, 1:] != pos[:, :-1]
    return torch.where(keep, pos, -1)


def select_vertical_slash(col: torch.Tensor, diag: torch.Tensor, lens: torch.Tensor, sinks: torch.Tensor,
                          locs: torch.Tensor, nv: torch.Tensor, ns: torch.Tensor, width_v: int,
                          width_s: int, rules: tuple[SelectionRule, SelectionRule] | None = None, *,
                          full_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns and offsets of a vertical-slash index from their scores ``[B, Hg, N]`` (torch
    ops, :func:`select_top`): positions past a row's length ``lens [B]`` never, the forced ones
    (``< sinks``, ``< locs`` per head) first, then the best-scoring ones, as many as the heads'
    ``rules`` (:func:`vertical_slash_rules`; ``None``: ``nv`` / ``ns``) keep. ``full_rows``: every
    row is ``N`` long (no ``seqlens`` / ``seqstarts``, known on the host): no position to mask."""
    rule_v, rule_s = (None, None) if rules is None else rules
    if rule_v is not None and rule_v.rules != {"top_k"} and rule_s is not None and rule_s.rules == rule_v.rules:
        # the sort path: one selection over the columns' and the diagonals' rows together (every
        # row is selected on its own, so the lists are the same; half the ops of two calls)
        Hg = col.shape[1]
        scores = torch.cat((col, diag), 1)  # [B, 2 Hg, N]
        if not full_rows:
            scores = torch.where(_inside(lens, scores.shape[-1]), scores, float("-inf"))
        forced, budget, rule = _joint_heads(sinks, locs, nv, ns, rule_v, rule_s)
        both = select_top(scores, forced, budget, max(width_v, width_s), rule)  # [B, 2 Hg, max width]
        return both[:, :Hg, :width_v].contiguous(), both[:, Hg:, :width_s].contiguous()
    if not full_rows:
        inside = _inside(lens, col.shape[-1])
        col, diag = torch.where(inside, col, float("-inf")), torch.where(inside, diag, float("-inf"))
    v_idx = select_top(col, sinks, nv, width_v, rule_v)
    s_idx = select_top(diag, locs, ns, width_s, rule_s)
    return v_idx, s_idx


def _inside(lens: torch.Tensor, N: int) -> torch.Tensor:
    """``[B, 1, N]`` bool: the position lies inside the row (``< lens [B]``)."""
    return (arange_constant(N, lens.device)[None, :] < lens[:, None])[:, None]


#: Joint per-head tensors of :func:`select_vertical_slash` (columns' heads, then the diagonals')
#: by the identity and version of their parts; bounded (a plan's groups reuse their tensors on
#: every call, so a few entries serve a model).
_JointKey = tuple[tuple[tuple[int, int], ...], frozenset[str]]
_Joint = tuple[torch.Tensor, torch.Tensor, SelectionRule]
_JOINT: dict[_JointKey, tuple[tuple[torch.Tensor, ...], _Joint]] = {}
_JOINT_SIZE = 64


def _joint_heads(sinks: torch.Tensor, locs: torch.Tensor, nv: torch.Tensor, ns: torch.Tensor,
                 rule_v: SelectionRule, rule_s: SelectionRule) -> tuple[torch.Tensor, torch.Tensor, SelectionRule]:
    """``(forced [2 Hg], budget [2 Hg], rule)`` of the joint selection: the columns' per-head
    tensors followed by the diagonals'. Made once per set of input tensors outside CUDA-graph
    capture (keyed by identity and version counter, so an in-place change of any part makes a new
    entry; inference tensors have no version counter and are concatenated on every call)."""
    parts = (sinks, locs, nv, ns, rule_v.code, rule_s.code, rule_v.threshold, rule_s.threshold, rule_v.minimum,
             rule_s.minimum)
    cache = not capturing() and not any(t.is_inference() for t in parts)
    key: _JointKey | None = (tuple((id(t), t._version) for t in parts), rule_v.rules) if cache else None
    hit = _JOINT.get(key) if key is not None else None
    if hit is not None and all(a is b for a, b in zip(hit[0], parts)):
        return hit[1]
    forced, budget, code, threshold, minimum = (torch.cat(parts[i : i + 2]) for i in range(0, 10, 2))
    joint = (forced, budget, SelectionRule(code, threshold, minimum, rule_v.rules))
    if key is not None:
        if len(_JOINT) >= _JOINT_SIZE:
            _JOINT.pop(next(iter(_JOINT)))  # the oldest entry
        _JOINT[key] = (parts, joint)  # the parts are kept alive: their ids stay theirs
    return joint


def vertical_slash_budgets(vertical, slash, sink_columns, local_diagonals, heads: torch.Tensor,
                           head_offset: int, *, total: int | None = None,
                           validate: bool = False) -> tuple[torch.Tensor, ...]:
    """The per computed head ``[Hg]`` int64 budgets of a vertical-slash build: ``(nv, ns, sinks,
    locs)``, the forced counts capped by their budgets and at least one local diagonal (``δ =
    0``). Each argument is an int or a 1-D tensor indexed by global head ``head_offset + h``;
    ``total``, ``validate``: as :func:`budget_tensor`."""
    def budget(name: str, value: int | torch.Tensor, minimum: int) -> torch.Tensor:
        return budget_tensor(name, value, heads, head_offset, minimum, total=total, validate=validate)

    nv = budget("vertical", vertical, 0)
    ns = budget("slash", slash, 1)
    sinks = torch.minimum(budget("sink_columns", sink_columns, 0), nv)
    locs = torch.minimum(budget("local_diagonals", local_diagonals, 0).clamp(min=1), ns)
    return nv, ns, sinks, locs


def block_sparse_budgets(top_k, sink_blocks, force_diagonal: bool, heads: torch.Tensor,
                         head_offset: int, *, total: int | None = None,
                         validate: bool = False) -> tuple[torch.Tensor, ...]:
    """The per computed head ``[Hg]`` int64 budgets of a block-sparse build: ``(tops, sinks)``,
    the sink blocks capped so that the forced diagonal still fits; ``total``, ``validate``: as
    :func:`budget_tensor`."""
    tops = budget_tensor("top_k", top_k, heads, head_offset, 1, total=total, validate=validate)
    sinks = torch.minimum(budget_tensor("sink_blocks", sink_blocks, heads, head_offset, 0, total=total,
                                        validate=validate),
                          tops - int(force_diagonal))
    return tops, sinks


def build_vertical_slash_index(scorer, q, k, vertical, slash, *, last_q, extra_rows, sink_columns,
                               local_diagonals, aggregation, scale, seqlens, seqstarts, heads, head_offset,
                               return_scores, vertical_width, slash_width, validate,
                               selector=select_vertical_slash, resolved=None, rule="top_k", threshold=None,
                               min_vertical=0, min_slash=0, resolved_rules=None, q_seqlens=None, q_seqstarts=None,
                               checked=False):
    """Validation, per-head budgets and selection around ``scorer`` (which computes the
    column and diagonal scores): shared by the Triton builders (:mod:`minference.kernels`) and
    :mod:`minference.torch_backend`.

    ``scorer(q, k, heads, lens, starts, last_q, rows, scale, aggregation, qrows=None)`` gets the
    extra sampled rows as ``rows [B, E]`` (:func:`extra_row_positions`), or ``None`` when
    ``extra_rows`` is 0, and the query rows ``qrows`` (:class:`QueryRows`; ``None``: the ordinary
    call, every key row its own query row): then only query positions are sampled (the last
    ``min(last_q, q_lens)`` and the extra rows among the earlier queries), read from ``q`` at
    their query rows; scores stay ``[B, Hg, N]`` in the key rows' positions.
    ``selector`` has the signature of :func:`select_vertical_slash` (the Triton builder passes
    its one-launch selection). ``resolved``: :func:`vertical_slash_budgets` of these budgets and
    heads, made ahead (the dispatcher keeps it per plan: no tensor op per call for budgets);
    ``resolved_rules``: :func:`vertical_slash_rules` of ``rule``, ``threshold``, ``min_vertical``,
    ``min_slash``, made ahead likewise (``None`` with ``rule="top_k"``). ``checked``: the caller
    validated the arguments' form at its own edge (the dispatcher: q and k, int32 ``heads``, the
    plan's ``resolved`` budgets and rules); those checks are skipped and the row arguments only
    converted.
    """
    if checked:
        B, Hq, Nq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, k)
        check_row_sampling(last_q, extra_rows, aggregation)
    last_q = max(1, min(last_q, N))  # a row samples at most its own rows: work follows the prompt
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=validate)
    qr = query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                    given_rows=seqlens is not None or seqstarts is not None, validate=validate)
    hs = _heads(heads, Hq, q.device, checked)
    total = head_offset + Hq if isinstance(head_offset, int) and not isinstance(head_offset, bool) else None
    if resolved is None:
        resolved = vertical_slash_budgets(vertical, slash, sink_columns, local_diagonals, hs, head_offset,
                                          total=total, validate=validate)
    nv, ns, sinks, locs = resolved if checked else _check_resolved(resolved, 4, hs)
    if resolved_rules is None:
        resolved_rules = vertical_slash_rules(rule, threshold, min_vertical, min_slash, hs, head_offset,
                                              total=total, validate=validate)
    rules = resolved_rules if checked else _check_rules(resolved_rules, 2, hs)
    width_v = _width("vertical", vertical, nv, vertical_width, N)
    width_s = _width("slash", slash, ns, slash_width, N)
    rows = extra_row_positions(lens, N, last_q, extra_rows, qr) if extra_rows and N else None
    if validate and not capturing():
        _check_finite_inputs(q, k, hs, lens, starts, _sampled_mask(lens, starts, N, last_q, rows, qr, Nq))
    col, diag = scorer(q, k, hs, lens, starts, last_q, rows, scale, aggregation, qrows=qr)
    v_idx, s_idx = selector(col, diag, lens, sinks, locs, nv, ns, width_v, width_s, rules,
                            full_rows=seqlens is None and seqstarts is None)
    return (v_idx, s_idx, col, diag) if return_scores else (v_idx, s_idx)


def _sampled_mask(lens: torch.Tensor, starts: torch.Tensor, N: int, last_q: int,
                  rows: torch.Tensor | None, qrows: QueryRows | None, Nq: int) -> torch.Tensor:
    """``[B, Nq]`` bool: the positions of q's N axis whose query rows a vertical-slash estimate
    samples (the last ``min(last_q, n)`` of each row, with query rows ``qrows`` only those that
    are queries, and its extra rows ``rows [B, E]``)."""
    if qrows is None:
        pos = torch.arange(N, device=lens.device)[None, :] - starts.long()[:, None]  # [B, N] logical
        n = lens.long()[:, None]
        mask = (pos >= n - n.clamp(max=last_q)) & (pos < n)
        if rows is not None and rows.shape[1] > 0:  # extra rows; -1 (none) lands in a dropped column N
            at = torch.where(rows >= 0, starts.long()[:, None] + rows, N)
            extra = torch.zeros(mask.shape[0], N + 1, dtype=torch.bool, device=mask.device)
            mask |= extra.scatter_(1, at, True)[:, :N]
        return mask
    n = lens.long()[:, None]
    q_lo = n - qrows.lens.long()[:, None]
    row0 = qrows.starts.long()[:, None] - q_lo  # position p sits at q row q_starts + p - q_lo
    pos = torch.arange(Nq, device=lens.device)[None, :] - row0  # [B, Nq] logical
    mask = (pos >= torch.maximum(n - n.clamp(max=last_q), q_lo)) & (pos < n)
    if rows is not None and rows.shape[1] > 0:
        at = torch.where(rows >= 0, row0 + rows, Nq)
        extra = torch.zeros(mask.shape[0], Nq + 1, dtype=torch.bool, device=mask.device)
        mask |= extra.scatter_(1, at, True)[:, :Nq]
    return mask


def _check_finite_inputs(q: torch.Tensor, k: torch.Tensor, hs: torch.Tensor, lens: torch.Tensor,
                         starts: torch.Tensor, q_rows: torch.Tensor | None) -> None:
    """Refuse NaN or inf in what a builder reads: the query rows ``q_rows [B, N]`` (``None``:
    every token of the row) of the computed heads ``hs``, and every key of the row of their kv
    heads (a host read; the caller skips it under capture)."""
    check_finite_rows({"q": q}, lens, starts, heads={"q": hs}, rows=q_rows)
    check_finite_kv({"k": k}, lens, starts, group=q.shape[1] // k.shape[1], query_heads=hs)


def _heads(heads: torch.Tensor | None, Hq: int, device, checked: bool) -> torch.Tensor:
    """:func:`heads_tensor`, or with ``checked`` (the caller's int32 device tensor) the heads as given."""
    if checked and heads is not None:
        return heads
    return heads_tensor(heads, Hq, device)


def _check_resolved(resolved, count: int, heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``resolved`` budgets: ``count`` int64 tensors ``[Hg]`` on the heads' device."""
    if not isinstance(resolved, tuple) or len(resolved) != count:
        raise TypeError(f"resolved budgets must be a tuple of {count} tensors")
    for x in resolved:
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or tuple(x.shape) != tuple(heads.shape)
                or x.device != heads.device):
            raise ValueError(f"resolved budgets must be int64 tensors of shape {tuple(heads.shape)} on {heads.device}")
    return resolved


def _check_rules(rules, count: int, heads: torch.Tensor) -> tuple[SelectionRule, ...] | None:
    """``rules``: ``None`` or ``count`` :class:`SelectionRule` with ``[Hg]`` tensors on the heads' device."""
    if rules is None:
        return None
    if not isinstance(rules, tuple) or len(rules) != count or not all(isinstance(r, SelectionRule) for r in rules):
        raise TypeError(f"resolved budget rules must be None or a tuple of {count} SelectionRule")
    for r in rules:
        for x, dtype in ((r.code, torch.int64), (r.threshold, torch.float64), (r.minimum, torch.int64)):
            if x.dtype != dtype or tuple(x.shape) != tuple(heads.shape) or x.device != heads.device:
                raise ValueError(f"resolved budget rules must hold [{heads.shape[0]}] tensors on {heads.device} "
                                 "(int64 codes and minima, float64 thresholds)")
    return rules


def build_block_sparse_index(pooler, q, k, top_k, *, block, sink_blocks, force_diagonal, scale, seqlens,
                             seqstarts, heads, head_offset, return_scores, top_k_width, validate, resolved=None,
                             rule="top_k", threshold=None, min_blocks=0, resolved_rules=None, estimate="pooled",
                             scorer=None, selector=None, q_seqlens=None, q_seqstarts=None, score_rows=0,
                             checked=False):
    """Validation, pooled scores, masks and selection around ``pooler`` (which mean-pools blocks):
    shared by the Triton builders (:mod:`minference.kernels`) and :mod:`minference.torch_backend`.
    ``resolved``: :func:`block_sparse_budgets` of these budgets and heads, made ahead;
    ``resolved_rules``: :func:`block_sparse_rules` of ``rule``, ``threshold``, ``min_blocks``.
    ``estimate="query"`` routes by ``scorer`` (the builders' ``query_block_scores``, same
    arguments, ``score_rows`` of them scoring each query block) instead of the pooled logits; its
    scores are the selection weights. ``selector``
    (the Triton builder's ``select_query_blocks``) then takes the whole selection in one launch
    where the heads' rules allow (``None`` from it: the chunked :func:`select_top` runs).

    Query rows (``q_seqlens``, ``q_seqstarts``; docs/kernels.md): query blocks stay in the key
    rows' positions, but only those holding a query are scored and selected, each from its query
    positions only; the others get no blocks (-1) and ``-inf`` scores. The work runs in the slot
    layout (:meth:`QueryRows.slots`: ``pooler(q, ..., qrows)``, ``scorer(..., slots=qrows)`` and
    ``selector(..., q_lens=)`` return or read ``[B, Hg, S, ...]``, slot ``s`` = query block
    ``q_lo // block + s``), so it follows the query blocks, not ``ceil(N / block)``; one gather
    (:func:`blocks_from_slots`) puts the result back by query block. ``checked``: as
    :func:`build_vertical_slash_index` (``block``, ``force_diagonal`` and ``estimate`` included)."""
    if checked:
        B, Hq, Nq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
    else:
        B, Hq, Hkv, Nq, N, D = check_qkv_rows(q, k, k)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        if not isinstance(force_diagonal, bool):
            raise TypeError("force_diagonal must be a bool")
    scale = default_scale(D, scale)
    lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=validate)
    qr = query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N,
                    given_rows=seqlens is not None or seqstarts is not None, validate=validate)
    hs = _heads(heads, Hq, q.device, checked)
    Hg = hs.shape[0]
    total = head_offset + Hq if isinstance(head_offset, int) and not isinstance(head_offset, bool) else None
    if resolved is None:
        resolved = block_sparse_budgets(top_k, sink_blocks, force_diagonal, hs, head_offset, total=total,
                                        validate=validate)
    tops, sinks = resolved if checked else _check_resolved(resolved, 2, hs)
    if resolved_rules is None:
        resolved_rules = block_sparse_rules(rule, threshold, min_blocks, hs, head_offset, total=total,
                                            validate=validate)
    (rule_b,) = (resolved_rules if checked else _check_rules(resolved_rules, 1, hs)) or (None,)
    nqb = math.ceil(N / block)
    width = _width("top_k", top_k, tops, top_k_width, nqb)
    if not checked:
        if estimate not in BLOCK_ESTIMATES:
            raise ValueError(f"estimate must be one of {list(BLOCK_ESTIMATES)}, got {estimate!r}")
        check_score_rows("score_rows", score_rows, estimate)
    query = estimate == "query"
    if validate and not capturing():
        _check_finite_inputs(q, k, hs, lens, starts,
                             None if qr is None else token_mask(qr.lens, qr.starts, B, Nq, q.device, values=False))
    if qr is not None:
        return _block_sparse_query_rows(pooler, scorer, selector, q, k, qr, lens, starts, hs, tops, sinks, rule_b,
                                        block=block, force_diagonal=force_diagonal, scale=scale, seqlens=seqlens,
                                        seqstarts=seqstarts, nqb=nqb, width=width, query=query,
                                        return_scores=return_scores, score_rows=score_rows)
    if query:  # [B, Hg, NQB, NQB] weights, -inf where not a candidate
        weights = scorer(q, k, block=block, scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=hs,
                         score_rows=score_rows)
    else:
        qm = pooler(q, block, lens, starts, hs)  # [B, Hg, NQB, D]
        km = pooler(k, block, lens, starts, None)[:, hs.long() // (Hq // Hkv)]  # [B, Hg, NQB, D]
    if query and selector is not None and width > 0:
        out = selector(weights, lens, sinks, tops, rule_b, block=block, force_diagonal=force_diagonal, width=width)
        if out is not None:
            return (out, weights) if return_scores else out
    nb = (lens.long() + block - 1) // block  # [B] valid blocks per row
    J = arange_constant(nqb, q.device)
    out = torch.empty(B, Hg, nqb, width, dtype=torch.int32, device=q.device)
    all_scores = (torch.empty(B, Hg, nqb, nqb, dtype=torch.float32, device=q.device)
                  if return_scores else None)
    chunk = max(1, ROUTING_CHUNK_ELEMENTS // max(1, B * Hg * nqb))
    for lo in range(0, nqb, chunk):
        hi = min(nqb, lo + chunk)
        I = J[lo:hi]
        if query:
            s = weights[:, :, lo:hi]
        else:
            s = torch.matmul(qm[:, :, lo:hi], km.transpose(-1, -2)) * scale  # [B, Hg, C, NQB]
        ok = (J[None, :] <= I[:, None])[None] & (I[None, :, None] < nb[:, None, None])  # [B, C, NQB]
        # -inf marks "no candidate"; a candidate's non-finite score (non-finite inputs) is NaN:
        # kept when forced, never ranked (select_top)
        s = torch.where(ok[:, None], s.nan_to_num(nan=_NAN, posinf=_NAN, neginf=_NAN), float("-inf"))
        if all_scores is not None:
            all_scores[:, :, lo:hi] = s
        forced = (J[None, None, :] < sinks[:, None, None]) | (force_diagonal & (J[None, :] == I[:, None]))[None]
        if width == 0:
            continue
        out[:, :, lo:hi] = select_top(s, forced[None], tops, width, rule_b, logits=not query)
    return (out, all_scores) if return_scores else out


def _block_sparse_query_rows(pooler, scorer, selector, q, k, qr: QueryRows, lens, starts, hs, tops, sinks, rule_b, *,
                             block, force_diagonal, scale, seqlens, seqstarts, nqb, width, query, return_scores,
                             score_rows):
    """:func:`build_block_sparse_index` on query rows, in the slot layout (see there)."""
    B, Hq, Hkv = q.shape[0], q.shape[1], k.shape[1]
    Hg = hs.shape[0]
    S = qr.slots(block)
    dev = q.device
    if query:  # [B, Hg, S, NQB] weights, -inf where not a candidate
        weights = scorer(q, k, block=block, scale=scale, seqlens=seqlens, seqstarts=seqstarts, heads=hs, slots=qr,
                         score_rows=score_rows)
    else:
        qm = pooler(q, block, lens, starts, hs, qr)  # [B, Hg, S, D]: the query positions' means
        km = pooler(k, block, lens, starts, None)[:, hs.long() // (Hq // Hkv)]  # [B, Hg, NQB, D]

    def back(out, scores):
        out = blocks_from_slots(out, lens, qr, block, nqb, -1)
        if not return_scores:
            return out
        return out, blocks_from_slots(scores, lens, qr, block, nqb, float("-inf"))

    if query and selector is not None and width > 0:
        out = selector(weights, lens, sinks, tops, rule_b, block=block, force_diagonal=force_diagonal, width=width,
                       q_lens=qr.lens)
        if out is not None:
            return back(out, weights)
    # a query block holds a query when it lies inside the row (past q_lo // block by construction)
    # and the row has queries at all
    nb = torch.where(qr.lens > 0, (lens.long() + block - 1) // block, 0)  # [B]
    first = (lens.long() - qr.lens.long()) // block  # [B] query block of slot 0
    J = arange_constant(nqb, dev)
    slots = arange_constant(S, dev)
    out = torch.empty(B, Hg, S, width, dtype=torch.int32, device=dev)
    all_scores = torch.empty(B, Hg, S, nqb, dtype=torch.float32, device=dev) if return_scores else None
    chunk = max(1, ROUTING_CHUNK_ELEMENTS // max(1, B * Hg * nqb))
    for lo in range(0, S, chunk):
        hi = min(S, lo + chunk)
        I = first[:, None] + slots[None, lo:hi]  # [B, C] query blocks
        if query:
            s = weights[:, :, lo:hi]
        else:
            s = torch.matmul(qm[:, :, lo:hi], km.transpose(-1, -2)) * scale  # [B, Hg, C, NQB]
        ok = (J <= I[..., None]) & (I[..., None] < nb[:, None, None])  # [B, C, NQB]
        s = torch.where(ok[:, None], s.nan_to_num(nan=_NAN, posinf=_NAN, neginf=_NAN), float("-inf"))
        if all_scores is not None:
            all_scores[:, :, lo:hi] = s
        if width == 0:
            continue
        forced = (J[None, None, None, :] < sinks[None, :, None, None]) | (force_diagonal & (J == I[..., None]))[:, None]
        out[:, :, lo:hi] = select_top(s, forced, tops, width, rule_b, logits=not query)
    return back(out, all_scores)
