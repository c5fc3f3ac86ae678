"""Shared draws and checks of the index-builder tests: the fast builders (Triton, torch) against
the float64 oracle on the same draws, and the budget rules' selection against its definition."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from minference.reference import estimators as naive

from minference.builders import RULE_CODES
from minference.patterns import RULES

#: Float32 score error allowed against the float64 twin (products of fp16/fp32 inputs summed
#: over at most a few hundred terms: a few ulps of the largest score).
SCORE_RTOL = 1e-4
SCORE_ATOL = 1e-5


def draw_budget(data, H_global: int, lo: int, hi: int):
    """An int, or a per-global-head int32 tensor of budgets in ``[lo, hi]``."""
    if data.draw(st.booleans()):
        return data.draw(st.integers(lo, hi))
    return torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=H_global, max_size=H_global)),
                        dtype=torch.int32)


def assert_same_selection(fast_idx: torch.Tensor, naive_idx: torch.Tensor, scores: torch.Tensor,
                          name: str) -> None:
    """Rows of ``fast_idx`` and ``naive_idx`` ``[..., K]`` hold the same sets, except that elements
    whose naive score ties (within TIE_TOL) the weakest naive pick may be swapped for each other."""
    assert fast_idx.shape == naive_idx.shape, f"{name}: shapes {fast_idx.shape} vs {naive_idx.shape}"
    if fast_idx.numel() == 0:
        return
    f_rows = fast_idx.reshape(-1, fast_idx.shape[-1]).tolist()
    n_rows = naive_idx.reshape(-1, naive_idx.shape[-1]).tolist()
    s_rows = scores.reshape(-1, scores.shape[-1]).double()
    for r, (f, n) in enumerate(zip(f_rows, n_rows)):
        fs, ns = {x for x in f if x >= 0}, {x for x in n if x >= 0}
        assert len(fs) == sum(x >= 0 for x in f), f"{name} row {r}: duplicates in {f}"
        assert len(fs) == len(ns), f"{name} row {r}: {len(fs)} picks vs {len(ns)}"
        diff = fs ^ ns
        if not diff:
            continue
        free = [float(s_rows[r, x]) for x in ns if torch.isfinite(s_rows[r, x])]
        boundary = min(free) if free else float("nan")
        far = [x for x in diff if not abs(float(s_rows[r, x]) - boundary) <= TIE_TOL]
        assert not far, f"{name} row {r}: fast {sorted(fs)} vs naive {sorted(ns)} (boundary {boundary})"


def assert_same_vs_index(fast_out, naive_out) -> None:
    """A builder's ``(vertical, slash, col, diag)`` (``return_scores=True``) against the float64
    twin's: scores within rounding, int32 indices, the same selections."""
    fv, fs, fcol, fdiag = fast_out
    nv, ns, ncol, ndiag = naive_out
    assert fcol.shape == ncol.shape and fdiag.shape == ndiag.shape
    torch.testing.assert_close(fcol.double(), ncol, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    torch.testing.assert_close(fdiag.double(), ndiag, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert fv.dtype == torch.int32 and fs.dtype == torch.int32
    assert_same_selection(fv, nv, ncol, "vertical")
    assert_same_selection(fs, ns, ndiag, "slash")


def rule_kwargs(data, H_global: int, budget_names: tuple[str, ...], maxima: dict):
    """Builder rule arguments: one rule by name, or per global head rule codes and thresholds."""
    if data.draw(st.booleans(), label="per-head rules"):
        codes = data.draw(st.lists(st.integers(0, 2), min_size=H_global, max_size=H_global))
        kw = dict(rule=torch.tensor(codes), threshold=torch.tensor([data.draw(THRESHOLDS) for _ in codes]))
    else:
        rule = data.draw(st.sampled_from(RULES))
        kw = dict(rule=rule, threshold=None if rule == "top_k" else data.draw(THRESHOLDS))
    for name in budget_names:
        kw[name] = data.draw(st.integers(0, maxima[name]))
    return kw


def check_vertical_slash_rule(fast, q, k, vertical: int, slash: int, kw: dict, heads, offset: int, Hq: int,
                              lens: list[int], *, bounds: bool = True) -> None:
    """``fast.vertical_slash_index`` against the float64 twin: the same scores, and per row (of key
    length ``lens[b]``) the columns and offsets the head's rule picks from them, within ``[min,
    max]`` (``top_k``: exactly its budget) when ``bounds``."""
    fv, fs, fcol, fdiag = fast.vertical_slash_index(q, k, vertical, slash, **kw)
    _, _, ncol, ndiag = naive.vertical_slash_index(q, k, vertical, slash, **kw)
    torch.testing.assert_close(fcol.double(), ncol, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    torch.testing.assert_close(fdiag.double(), ndiag, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    ids = heads.tolist() if heads is not None else list(range(Hq))
    codes, thresholds = _per_head(kw, ids, offset)
    for b, n in enumerate(lens):
        for g in range(len(ids)):
            for idx, sc, forced, budget, minimum in (
                    (fv, fcol, min(kw["sink_columns"], vertical), vertical, kw["min_vertical"]),
                    (fs, fdiag, min(max(kw["local_diagonals"], 1), slash), slash, kw["min_slash"])):
                got = set(_picked(idx[b, g].tolist()))
                want = _naive(sc[b, g, :n], range(forced), budget, codes[g], thresholds[g], minimum, False,
                              idx.shape[-1])
                _assert_selection(got, want, sc[b, g], _adaptive_call(kw), (b, g, RULES[codes[g]], thresholds[g]))
                if bounds and codes[g]:
                    assert min(max(minimum, forced), n) <= len(got) <= min(budget, n)
                elif bounds:
                    assert len(got) == min(budget, n)


def draw_score_rows(data, estimate: str) -> int:
    """``score_rows`` for a block-sparse call: the query-aware estimate draws every row (half the
    time), one, or three (the pooled estimate takes only 0)."""
    return data.draw(st.sampled_from((0, 0, 1, 3)), label="score rows") if estimate == "query" else 0


def check_block_rule(fast, q, k, top_k: int, kw: dict, heads, offset: int, Hq: int, estimate: str,
                     rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast.block_sparse_index`` against the float64 twin: the same finite scores, and per query
    block the set the head's rule picks from them (``rows``: only the query blocks that hold a
    query, :func:`test_index_query_rows`). Returns the fast ``(blocks, scores)``."""
    fb, fscores = fast.block_sparse_index(q, k, top_k, **kw)
    _, nscores = naive.block_sparse_index(q, k, top_k, **kw)
    fin = torch.isfinite(nscores)
    assert torch.equal(torch.isfinite(fscores), fin)
    torch.testing.assert_close(fscores.double()[fin], nscores[fin], rtol=SCORE_RTOL, atol=SCORE_ATOL)
    ids = heads.tolist() if heads is not None else list(range(Hq))
    codes, thresholds = _per_head(kw, ids, offset)
    n_sink = min(kw["sink_blocks"], top_k - kw["force_diagonal"])
    for b in range(fb.shape[0]):
        for g in range(len(ids)):
            for I in range(fb.shape[2]):
                forced = set(range(min(n_sink, I + 1))) | ({I} if kw["force_diagonal"] else set())
                got = set(_picked(fb[b, g, I].tolist()))
                want = _naive(fscores[b, g, I], forced, top_k, codes[g], thresholds[g], kw["min_blocks"],
                              estimate == "pooled", fb.shape[-1])
                _assert_selection(got, want, fscores[b, g, I], _adaptive_call(kw),
                                  (b, g, I, RULES[codes[g]], thresholds[g]))
                if want and codes[g] and rows is None:
                    assert min(max(kw["min_blocks"], len(forced)), I + 1) <= len(got) <= min(top_k, I + 1)
    return fb, fscores


#: Thresholds: the published settings (FlexPrefill γ 0.9-0.95, FlashPrefill α 0.08-0.18,
#: XAttention τ 0.9), the ends of the range and anything in between.
THRESHOLDS = st.one_of(st.sampled_from((0.08, 0.12, 0.18, 0.5, 0.9, 0.95, 1.0)),
                       st.floats(1e-3, 1.0, exclude_min=True))


def _naive(row, forced, budget, code, threshold, minimum, logits, width):
    rule = RULES[code]
    return naive.select_row(row, forced, budget, rule=rule, threshold=None if rule == "top_k" else threshold,
                            minimum=minimum, logits=logits)[:width]


def _assert_selection(got: set[int], want: list[int], scores, exact: bool, where) -> None:
    """``got == set(want)``; where not ``exact`` (a top_k-only selection: ``torch.topk`` breaks
    ties), entries may differ among those tied with the naive twin's last pick."""
    if exact or got == set(want):
        assert got == set(want), (where, sorted(got), sorted(want))
        return
    boundary = float(scores[want[-1]])
    assert len(got) == len(want) and all(float(scores[j]) == boundary for j in got ^ set(want)), (
        where, sorted(got), sorted(want))


def _picked(row: list[int]) -> list[int]:
    picked = [x for x in row if x >= 0]
    assert row == picked + [-1] * (len(row) - len(picked)), row
    return picked


def _adaptive_call(kw) -> bool:
    """Whether the builder call takes the deterministic (adaptive) selection path."""
    return not (isinstance(kw["rule"], str) and kw["rule"] == "top_k")


def _per_head(kw, ids, offset) -> tuple[list[int], list[float]]:
    rule, thr = kw["rule"], kw["threshold"]
    if isinstance(rule, torch.Tensor):
        return [int(rule[offset + h]) for h in ids], [float(thr[offset + h]) for h in ids]
    return [RULE_CODES[rule]] * len(ids), [thr] * len(ids)


#: Two naive scores closer than this count as a tie: either side of the boundary may be chosen.
TIE_TOL = 1e-4


