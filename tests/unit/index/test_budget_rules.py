"""Budget rules (``top_k``, ``mass``, ``relative``) of the vertical-slash and block-sparse builders.

The selection is checked as EXACT sets (ties included) against the naive twin
:func:`minference.reference.estimators.select_row`: the torch selection
(:func:`minference.index.select_top`) on drawn weights (flat, spiky, random and quantised
rows), and every builder (Triton in the interpreter, PyTorch) on the scores it returns. That the
scores themselves agree with the float64 twin's within float32 rounding is checked here too (and
in ``test_estimators.py``); a set built from scores that differ by rounding can only be compared
up to ties, so the end-to-end comparison with the naive builder is exact on planted structure.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minference.reference import estimators as naive

import minference.torch_backend as portable
from minference import config as C
from minference import kernels as triton_builders
from minference.backend import get_backend
from minference.index import (
    block_sparse_rules,
    build_group_index,
    prepare_plan,
    select_top,
    select_vertical_slash,
    vertical_slash_rules,
)
from minference.patterns import RULES, BlockSparse, VerticalSlash, pattern_from_dict, pattern_to_dict
from minference.testing.ops import RecordOps
from minference.testing.strategies import AttnShape, attention_shapes, head_subsets, qkv, ragged_rows
from tests.unit.index.cases import (
    THRESHOLDS,
    _naive,
    _picked,
    check_block_rule,
    check_vertical_slash_rule,
    draw_score_rows,
    rule_kwargs,
)

IMPLS = [pytest.param(triton_builders, id="triton", marks=pytest.mark.interpret), pytest.param(portable, id="torch")]
#: The CPU suite's budget: the interpreted builders run a few examples, the selection many.
FEW = settings(max_examples=min(settings().max_examples, 8))
SHAPES = attention_shapes(max_batch=2, max_kv_heads=2, max_group=3, max_n=90, head_dims=(16,))
SCORE_RTOL, SCORE_ATOL = 1e-4, 1e-5


def _rows(data, shape: tuple[int, ...], logits: bool) -> torch.Tensor:
    """float32 scores ``shape``; each row flat (all equal), spiky (one dominant entry), random or
    quantised to three levels (many exact ties). Non-negative unless ``logits``."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    M = shape[-1]
    flat = torch.full(shape, data.draw(st.sampled_from((0.0, 1 / 3, 1.0, -2.5 if logits else 0.25))))
    spike = torch.rand(shape, generator=g) * 1e-3
    spike.scatter_(-1, torch.randint(0, M, shape[:-1] + (1,), generator=g), 30.0 if logits else 1.0)
    rand = torch.randn(shape, generator=g) * 3 if logits else torch.rand(shape, generator=g) ** 3
    levels = torch.randint(0, 3, shape, generator=g).float() / 3
    kind = torch.randint(0, 4, shape[:-1] + (1,), generator=g)
    return torch.stack((flat, spike, rand, levels)).gather(0, kind.expand(shape)[None])[0].float()


def _head_rules(data, Hg: int, budgets: list[int]):
    codes = data.draw(st.lists(st.integers(0, 2), min_size=Hg, max_size=Hg), label="rules")
    thresholds = [data.draw(THRESHOLDS) for _ in range(Hg)]
    minima = [data.draw(st.integers(0, b)) for b in budgets]
    return codes, thresholds, minima


def _rule(codes, thresholds, minima):
    """The heads' rules, on the deterministic path (every rule possible) even when all are top_k."""
    return block_sparse_rules(torch.tensor(codes), torch.tensor(thresholds, dtype=torch.float64),
                              torch.tensor(minima), torch.arange(len(codes), dtype=torch.int32), 0)[0]


@given(st.data())
def test_selection_is_the_naive_rule_vertical(data) -> None:
    """``[B, Hg, M]`` rows with a row length (columns / diagonals), forced prefixes, per-head
    mixed rules: the same positions in the same order as the naive rule, ties to the lowest."""
    B, Hg, M = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 70))
    scores = _rows(data, (B, Hg, M), logits=False)
    lens = [data.draw(st.integers(0, M)) for _ in range(B)]
    scores = scores.masked_fill(torch.arange(M)[None, None] >= torch.tensor(lens)[:, None, None], float("-inf"))
    budgets = [data.draw(st.integers(1, M + 3)) for _ in range(Hg)]
    forced = [data.draw(st.integers(0, b)) for b in budgets]
    codes, thresholds, minima = _head_rules(data, Hg, budgets)
    width = min(max(budgets) + data.draw(st.integers(-1, 2)), M)
    got = select_top(scores, torch.tensor(forced), torch.tensor(budgets), width, _rule(codes, thresholds, minima))
    assert got.dtype == torch.int32 and got.shape == (B, Hg, width)
    for b in range(B):
        for h in range(Hg):
            want = _naive(scores[b, h], range(forced[h]), budgets[h], codes[h], thresholds[h], minima[h], False,
                          width)
            assert _picked(got[b, h].tolist()) == want, (b, h, RULES[codes[h]], thresholds[h])


@given(st.data())
def test_joint_vertical_slash_selection_is_two_selections(data) -> None:
    """:func:`select_vertical_slash` selects columns and diagonals in one ``select_top`` when a
    rule may be adaptive: the same lists as two calls, ragged or full rows, mixed or single rules;
    its cached joint per-head tensors follow an in-place change of a budget."""
    B, Hg, M = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 70))
    col, diag = _rows(data, (B, Hg, M), logits=False), _rows(data, (B, Hg, M), logits=False)
    full = data.draw(st.booleans())
    lens = torch.full((B,), M, dtype=torch.int32) if full else torch.tensor(
        [data.draw(st.integers(0, M)) for _ in range(B)], dtype=torch.int32)
    nv = torch.tensor([data.draw(st.integers(0, M + 3)) for _ in range(Hg)])
    ns = torch.tensor([data.draw(st.integers(1, M + 3)) for _ in range(Hg)])
    sinks = torch.minimum(torch.tensor([data.draw(st.integers(0, 5)) for _ in range(Hg)]), nv)
    locs = torch.minimum(torch.tensor([data.draw(st.integers(1, 5)) for _ in range(Hg)]), ns)
    single = data.draw(st.sampled_from((None, "mass", "relative")))
    heads = torch.arange(Hg, dtype=torch.int32)
    if single is None:
        codes, thresholds, _ = _head_rules(data, Hg, [M] * Hg)
        rule, threshold = torch.tensor(codes), torch.tensor(thresholds, dtype=torch.float64)
    else:
        rule, threshold = single, data.draw(THRESHOLDS)
    mins = (torch.tensor([data.draw(st.integers(0, M)) for _ in range(Hg)]),
            torch.tensor([data.draw(st.integers(0, M)) for _ in range(Hg)]))
    rules = vertical_slash_rules(rule, threshold, *mins, heads, 0)
    width_v, width_s = min(int(nv.max()), M), min(int(ns.max()), M)

    def separate():
        inside = (torch.arange(M)[None, :] < lens[:, None])[:, None]
        v = select_top(torch.where(inside, col, float("-inf")), sinks, nv, width_v, rules[0])
        s = select_top(torch.where(inside, diag, float("-inf")), locs, ns, width_s, rules[1])
        return v, s

    for _ in range(2):  # the second call takes the cached joint tensors
        got = select_vertical_slash(col, diag, lens, sinks, locs, nv, ns, width_v, width_s, rules, full_rows=full)
        for g, w in zip(got, separate()):
            assert g.dtype == w.dtype and g.is_contiguous() and torch.equal(g, w)
        sinks.clamp_(max=0)  # in place: the next call must not reuse the joint tensors made before


@given(st.data())
def test_selection_is_the_naive_rule_blocks(data) -> None:
    """``[B, Hg, NQB, NQB]`` block logits (any sign), block-causal, rows past a length, sink
    blocks and the diagonal forced by a mask, weights ``exp(s - max)``."""
    B, Hg, nqb = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 24))
    scores = _rows(data, (B, Hg, nqb, nqb), logits=True)
    nb = [data.draw(st.integers(0, nqb)) for _ in range(B)]
    J = torch.arange(nqb)
    ok = (J[None, None, :] <= J[None, :, None]) & (J[None, :, None] < torch.tensor(nb)[:, None, None])
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    budgets = [data.draw(st.integers(1, nqb + 2)) for _ in range(Hg)]
    diagonal = data.draw(st.booleans())
    sinks = [data.draw(st.integers(0, b - diagonal)) for b in budgets]
    forced = (J[None, None, :] < torch.tensor(sinks)[:, None, None]) | (diagonal & (J[None, :] == J[:, None]))[None]
    codes, thresholds, minima = _head_rules(data, Hg, budgets)
    width = min(max(budgets), nqb)
    got = select_top(scores, forced[None], torch.tensor(budgets), width, _rule(codes, thresholds, minima), logits=True)
    for b in range(B):
        for h in range(Hg):
            for I in range(nqb):
                f = {j for j in range(nqb) if forced[h, I, j]}
                want = _naive(scores[b, h, I], f, budgets[h], codes[h], thresholds[h], minima[h], True, width)
                assert _picked(got[b, h, I].tolist()) == want, (b, h, I, RULES[codes[h]], thresholds[h])


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_signed_zeros_tie_and_nan_is_no_candidate(dev) -> None:
    """-0.0 and +0.0 are one score (ties by position, as the twin compares floats); NaN is no
    candidate."""
    z = torch.tensor([[[0.0, -0.0, 0.0, -0.0, float("nan"), -0.0, 0.0, 0.0]]], device=dev)
    for code in (1, 2):
        one = torch.zeros(1, dtype=torch.int32, device=dev)
        rule = block_sparse_rules(one.long() + code, one.double() + 1.0, one.long(), one, 0)[0]
        got = select_top(z, torch.tensor([0], device=dev), torch.tensor([5], device=dev), 6, rule, logits=True)
        assert got[0, 0].tolist() == [0, 1, 2, 3, 5, -1]
        assert _naive(z[0, 0].cpu(), (), 5, code, 1.0, 0, True, 6) == [0, 1, 2, 3, 5]


def _old_select_top(scores, forced, budget, width):
    """The selection before budget rules (float topk), kept to show that ``top_k`` did not change."""
    pos = torch.arange(scores.shape[-1])
    scores = torch.where((pos[None, :] < forced[:, None])[None] & (scores > float("-inf")), float("inf"), scores)
    values, idx = torch.topk(scores, width, dim=-1, sorted=True)
    keep = (torch.arange(width)[None, :] < budget[:, None])[None] & (values > float("-inf"))
    return torch.where(keep, idx, -1).to(torch.int32)


@given(st.data())
def test_top_k_is_unchanged(data) -> None:
    """On tie-free scores the ``top_k`` selection is the previous one, as sets."""
    B, Hg, M = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 80))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    scores = torch.randperm(B * Hg * M, generator=g).float().view(B, Hg, M) - B * Hg * M / 2
    scores[..., M - data.draw(st.integers(0, M)):] = float("-inf")
    budget = torch.randint(1, M + 3, (Hg,), generator=g)
    forced = torch.minimum(torch.randint(0, 6, (Hg,), generator=g), budget)
    width = min(int(budget.max()), M)
    new, old = select_top(scores, forced, budget, width), _old_select_top(scores, forced, budget, width)
    for a, b in zip(new.view(-1, width).tolist(), old.view(-1, width).tolist()):
        assert sorted(_picked(a)) == sorted(x for x in b if x >= 0)


def _qk(data, shape: AttnShape, dtype=torch.float32):
    """q, k that give random, flat (zero queries: equal logits) or spiky (one key every query
    likes) attention."""
    q, k, _ = qkv(shape, dtype, "cpu", data.draw(st.integers(0, 2**31 - 1)),
                  sharpness=data.draw(st.sampled_from((0.5, 3.0))))
    mode = data.draw(st.sampled_from(("random", "flat", "spiky")), label="scores")
    if mode == "flat":
        q.zero_()
    elif mode == "spiky":
        hot = data.draw(st.integers(0, shape.N - 1))
        q[..., 0], k[..., 0] = 2.0, 0.0
        k[:, :, hot, 0] = 6.0
    return q, k, mode


@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_vertical_slash_builders_keep_the_rule(fast, data) -> None:
    """GQA, ragged rows, head subsets, a TP offset: every row's columns and offsets are the naive
    rule's on the builder's own scores, within ``[min, max]``; the scores match the float64 twin."""
    shape = data.draw(SHAPES)
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    offset = data.draw(st.sampled_from((0, shape.Hq)))
    q, k, mode = _qk(data, shape)
    vertical, slash = data.draw(st.integers(0, 30)), data.draw(st.integers(1, 30))
    kw = dict(last_q=1 if mode == "flat" else data.draw(st.integers(1, 24)), sink_columns=data.draw(st.integers(0, 4)),
              local_diagonals=data.draw(st.integers(0, 4)), aggregation=data.draw(st.sampled_from(("sum", "max"))),
              seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=offset, return_scores=True,
              **rule_kwargs(data, offset + shape.Hq, ("min_vertical", "min_slash"),
                         {"min_vertical": vertical, "min_slash": slash}))
    lens = seqlens.tolist() if seqlens is not None else [shape.N] * shape.B
    check_vertical_slash_rule(fast, q, k, vertical, slash, kw, heads, offset, shape.Hq, lens)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpret),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@settings(max_examples=min(settings().max_examples, 8), deadline=None)
@given(data=st.data())
def test_fused_block_selection_is_the_naive_rule(device, data) -> None:
    """The one-launch block selection (``select_query_blocks``: radix select, no sort) on
    query-aware scores in ``[0, 1]`` with ties: per head ``"top_k"`` or ``"relative"``, minima,
    budgets, sinks, the diagonal, rows past a length, a NaN score (kept only where forced): exactly the
    naive rule's sets (ties to the lowest position), ascending, -1 after; a ``"mass"`` head
    hands the selection back (``None``)."""
    B, Hg, nqb = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 24))
    block = data.draw(st.sampled_from((1, 16, 64)))
    scores = _rows(data, (B, Hg, nqb, nqb), logits=False)
    nb = [data.draw(st.integers(0, nqb)) for _ in range(B)]
    lens = [max(0, data.draw(st.integers((n - 1) * block + 1, n * block))) if n else 0 for n in nb]
    J = torch.arange(nqb)
    ok = (J[None, None, :] <= J[None, :, None]) & (J[None, :, None] < torch.tensor(nb)[:, None, None])
    if data.draw(st.booleans(), label="nan"):  # a candidate without a score: kept where forced
        scores[0, 0, -1, 0] = float("nan")
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    budgets = [data.draw(st.integers(1, nqb + 2)) for _ in range(Hg)]
    diagonal = data.draw(st.booleans())
    sinks = [data.draw(st.integers(0, b - diagonal)) for b in budgets]
    codes = [2 * data.draw(st.integers(0, 1)) for _ in range(Hg)]  # top_k or relative
    thresholds = [data.draw(THRESHOLDS) for _ in range(Hg)]
    minima = [data.draw(st.integers(0, b)) for b in budgets]
    width = min(max(budgets) + data.draw(st.integers(-1, 1)), nqb)
    rule = _rule(codes, thresholds, minima)
    to = lambda x: x.to(device)  # noqa: E731
    dev_rule = type(rule)(to(rule.code), to(rule.threshold), to(rule.minimum), rule.rules - {"mass"})
    got = triton_builders.select_query_blocks(
        to(scores), to(torch.tensor(lens, dtype=torch.int32)), to(torch.tensor(sinks)), to(torch.tensor(budgets)),
        dev_rule, block=block, force_diagonal=diagonal, width=width).cpu()
    assert got.dtype == torch.int32 and got.shape == (B, Hg, nqb, width)
    for b in range(B):
        for h in range(Hg):
            for I in range(nqb):
                f = {j for j in range(I + 1) if j < sinks[h] or (diagonal and j == I)}
                want = _naive(scores[b, h, I], f, budgets[h], codes[h], thresholds[h], minima[h], False, width)
                picked = _picked(got[b, h, I].tolist())
                assert picked == sorted(want), (b, h, I, RULES[codes[h]], thresholds[h], picked, sorted(want))
    assert triton_builders.select_query_blocks(to(scores), to(torch.tensor(lens, dtype=torch.int32)),
                                               to(torch.tensor(sinks)), to(torch.tensor(budgets)), _rule(
                                                   [1] * Hg, thresholds, minima), block=block,
                                               force_diagonal=diagonal, width=width) is None


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpret),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_block_selection_boundaries(device) -> None:
    """Rows where the rule's boundary falls on ties: all scores equal with alpha 1 (every block
    reaches alpha * max), three levels with alpha 2/3 exactly on a level, top-k cutting a run of
    equal scores (lowest positions win), a minimum above the relative count, a budget below it."""
    nqb = 12
    flat = torch.full((nqb,), 0.25)
    levels = (torch.arange(nqb) % 3).float() / 3 + 1 / 3  # 1/3, 2/3, 1, ...
    scores = torch.stack([flat, levels, flat, levels, levels])[None, :, None].expand(1, 5, nqb, nqb).clone()
    scores = scores.masked_fill(torch.arange(nqb)[None, None, None] > torch.arange(nqb)[None, None, :, None],
                                float("-inf"))
    codes, thresholds = [2, 2, 0, 2, 2], [1.0, 2 / 3, 1.0, 1.0, 0.1]
    budgets, minima, sinks = [nqb, nqb, 5, nqb, 3], [0, 0, 0, 7, 0], [1, 0, 0, 0, 1]
    rule = _rule(codes, thresholds, minima)
    rule = type(rule)(rule.code.to(device), rule.threshold.to(device), rule.minimum.to(device), frozenset({"top_k",
                                                                                                           "relative"}))
    got = triton_builders.select_query_blocks(
        scores.to(device), torch.tensor([nqb * 16], dtype=torch.int32, device=device),
        torch.tensor(sinks, device=device), torch.tensor(budgets, device=device), rule, block=16,
        force_diagonal=True, width=nqb).cpu()
    for h in range(5):
        for I in range(nqb):
            f = {j for j in range(I + 1) if j < sinks[h] or j == I}
            want = _naive(scores[0, h, I], f, budgets[h], codes[h], thresholds[h], minima[h], False, nqb)
            assert _picked(got[0, h, I].tolist()) == sorted(want), (h, I)
    assert _picked(got[0, 0, nqb - 1].tolist()) == list(range(nqb))  # alpha 1 on a flat row: all


@pytest.mark.parametrize("estimate", ["pooled", "query"])
@pytest.mark.parametrize("fast", IMPLS)
@FEW
@given(st.data())
def test_block_sparse_builders_keep_the_rule(fast, estimate, data) -> None:
    shape = data.draw(SHAPES)
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    offset = data.draw(st.sampled_from((0, shape.Hq)))
    q, k, _ = _qk(data, shape)
    block, top_k = data.draw(st.sampled_from((5, 8, 16))), data.draw(st.integers(1, 12))
    kw = dict(block=block, sink_blocks=data.draw(st.integers(0, 2)), force_diagonal=data.draw(st.booleans()),
              seqlens=seqlens, seqstarts=seqstarts, heads=heads, head_offset=offset, return_scores=True,
              estimate=estimate, score_rows=draw_score_rows(data, estimate),
              **rule_kwargs(data, offset + shape.Hq, ("min_blocks",), {"min_blocks": top_k}))
    check_block_rule(fast, q, k, top_k, kw, heads, offset, shape.Hq, estimate)


def _planted(N=96, D=64, hot=(3, 41), lag=7):
    """Two columns every query reads and one diagonal (logits 5 against about 0 +- 0.7 elsewhere):
    margins that no rounding moves."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, N, D, generator=g) * 0.02, torch.randn(1, 1, N, D, generator=g) * 0.02
    q[0, 0, :, 0] = 2.5
    for j in hot:
        k[0, 0, j, 0] = 2.0
    code = torch.sign(torch.randn(N, D - 16, generator=g)) * math.sqrt(5 / (D - 16))
    q[0, 0, :, 16:] = code
    k[0, 0, : N - lag, 16:] = code[lag:]  # key j matches query j + lag
    return q, k


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param(naive, id="naive")])
def test_adaptive_rules_find_planted_structure(impl) -> None:
    """With generous maxima the adaptive rules keep the few dominant columns and diagonals (and
    grow for a flatter head), where ``top_k`` spends its whole budget; every implementation alike."""
    q, k = _planted()
    kw = dict(last_q=32, sink_columns=0, local_diagonals=1, scale=1.0)
    v, s = impl.vertical_slash_index(q, k, 20, 20, **kw)
    assert (v >= 0).sum() == 20 and (s >= 0).sum() == 20
    v, s = impl.vertical_slash_index(q, k, 20, 20, rule="relative", threshold=0.3, **kw)
    assert set(_picked(v[0, 0].tolist())) == {3, 41} and set(_picked(s[0, 0].tolist())) == {0, 7}
    v, s = impl.vertical_slash_index(q, k, 20, 20, rule="relative", threshold=0.3, min_vertical=4, min_slash=3, **kw)
    assert {3, 41} <= set(_picked(v[0, 0].tolist())) and len(_picked(v[0, 0].tolist())) == 4
    assert len(_picked(s[0, 0].tolist())) == 3
    v, _ = impl.vertical_slash_index(q, k, 20, 20, rule="mass", threshold=0.5, **kw)
    assert set(_picked(v[0, 0].tolist())) <= {3, 41}
    v, _ = impl.vertical_slash_index(q, k, 20, 20, rule="mass", threshold=1.0, **kw)
    assert len(_picked(v[0, 0].tolist())) == 20  # every column holds some mass: the maximum
    flat = impl.vertical_slash_index(torch.zeros_like(q), k, 20, 20, rule="mass", threshold=0.5, last_q=1,
                                     sink_columns=0, local_diagonals=1)[0]
    assert _picked(flat[0, 0].tolist()) == list(range(20))  # all equal: the lowest positions, up to the max


def test_mixed_rules_share_a_group() -> None:
    """Heads with different rules in one group (per-head tensors) build what each head's pattern
    builds alone; a top_k-only group keeps no rule tensors (the one-launch selection)."""
    shape = AttnShape(B=2, Hq=6, Hkv=2, N=77, D=16)
    q, k, _ = qkv(shape, torch.float32, "cpu", seed=5, sharpness=3.0)
    vs = [VerticalSlash(vertical=12, slash=16, last_q=16, sink_columns=1, local_diagonals=2),
          VerticalSlash(vertical=12, slash=9, last_q=16, rule="mass", threshold=0.9, min_vertical=2, min_slash=3),
          VerticalSlash(vertical=20, slash=16, last_q=16, rule="relative", threshold=0.12, sink_columns=2)]
    bs = [BlockSparse(top_k=4, block=8), BlockSparse(top_k=6, block=8, rule="mass", threshold=0.95, min_blocks=2),
          BlockSparse(top_k=5, block=8, rule="relative", threshold=0.08, sink_blocks=0)]
    seqlens = torch.tensor([77, 50], dtype=torch.int32)
    groups = prepare_plan(vs + bs, 6, 0, "cpu")
    assert [len(g.group.heads) for g in groups] == [3, 3]
    assert all(g.rules is not None and g.rules[0].rules == frozenset(RULES) for g in groups)
    assert prepare_plan([vs[0]] * 2, 2, 0, "cpu")[0].rules is None
    for builders in (portable, triton_builders):
        for g in groups:
            backend = get_backend("torch" if builders is portable else "triton")
            got = build_group_index(backend, g, q, k, scale=None, seqlens=seqlens, seqstarts=None, head_offset=0)
            for r, h in enumerate(g.group.heads):
                p, one = (vs + bs)[h], torch.tensor([h], dtype=torch.int32)
                if isinstance(p, VerticalSlash):
                    want = builders.vertical_slash_index(
                        q, k, p.vertical, p.slash, last_q=p.last_q, sink_columns=p.sink_columns,
                        local_diagonals=p.local_diagonals, rule=p.rule, threshold=p.threshold,
                        min_vertical=p.min_vertical, min_slash=p.min_slash, heads=one, seqlens=seqlens)
                    for a, w in zip(got, want):
                        assert all(set(a[b, r].tolist()) - {-1} == set(w[b, 0].tolist()) - {-1} for b in range(2))
                else:
                    want = builders.block_sparse_index(q, k, p.top_k, block=p.block, sink_blocks=p.sink_blocks,
                                                       rule=p.rule, threshold=p.threshold, min_blocks=p.min_blocks,
                                                       heads=one, seqlens=seqlens)
                    for b in range(2):
                        for I in range(got.shape[2]):
                            assert set(got[b, r, I].tolist()) - {-1} == set(want[b, 0, I].tolist()) - {-1}


def test_adaptive_selection_never_syncs() -> None:
    """Once a plan with adaptive rules is prepared, building its index runs no op that reads a
    tensor value on the host (what would break CUDA-graph capture)."""
    q, k, _ = qkv(AttnShape(B=1, Hq=2, Hkv=1, N=64, D=16), torch.float32, "cpu", seed=0)
    plan = [VerticalSlash(vertical=8, slash=12, last_q=16, rule="mass", threshold=0.9),
            BlockSparse(top_k=3, block=16, rule="relative", threshold=0.1)]
    for g in prepare_plan(plan, 2, 0, "cpu"):
        with RecordOps() as ops:
            build_group_index(get_backend("torch"), g, q, k, scale=None, seqlens=None, seqstarts=None, head_offset=0)
        assert not set(ops.names) & {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "tolist"}
        assert "sort" in ops.names  # the adaptive path ran


@pytest.mark.triton
def test_triton_builders_on_device(device) -> None:
    """The Triton builders on the device fixture's device (the GPU when present) with adaptive
    rules, against the naive rule on their own scores."""
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=200, D=64 if device == "cuda" else 16)
    q, k, _ = qkv(shape, torch.float16, device, seed=2, sharpness=3.0)
    seqlens = torch.tensor([200, 130], dtype=torch.int32, device=device)
    rule = torch.tensor([0, 1, 2, 1], device=device)
    thr = torch.tensor([1.0, 0.9, 0.12, 0.5], dtype=torch.float64, device=device)
    v, s, col, diag = triton_builders.vertical_slash_index(
        q, k, 40, 60, last_q=32, sink_columns=2, local_diagonals=4, rule=rule, threshold=thr, min_vertical=3,
        min_slash=5, seqlens=seqlens, return_scores=True)
    blocks, bsc = triton_builders.block_sparse_index(q, k, 6, block=16, sink_blocks=1, rule=rule, threshold=thr,
                                                     min_blocks=2, seqlens=seqlens, return_scores=True)
    v, s, col, diag, blocks, bsc = (x.cpu() for x in (v, s, col, diag, blocks, bsc))
    thr = thr.tolist()
    for b, n in enumerate((200, 130)):
        for h in range(4):
            c = int(rule[h])
            assert set(_picked(v[b, h].tolist())) == set(_naive(col[b, h, :n], range(2), 40, c, thr[h], 3, False, 40))
            assert set(_picked(s[b, h].tolist())) == set(_naive(diag[b, h, :n], range(4), 60, c, thr[h], 5, False, 60))
            for I in range(math.ceil(n / 16)):
                want = _naive(bsc[b, h, I], {0, I}, 6, c, thr[h], 2, True, 6)
                assert set(_picked(blocks[b, h, I].tolist())) == set(want)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: VerticalSlash(rule="mass", threshold=0.0), ValueError, r"threshold must be finite and in \(0, 1\]"),
        (lambda: VerticalSlash(rule="mass", threshold=1.5), ValueError, r"in \(0, 1\]"),
        (lambda: VerticalSlash(rule="relative", threshold=float("nan")), ValueError, "finite"),
        (lambda: BlockSparse(rule="relative", threshold=float("inf")), ValueError, "finite"),
        (lambda: BlockSparse(rule="mass", threshold=-0.5), ValueError, r"in \(0, 1\]"),
        (lambda: BlockSparse(rule="mass"), ValueError, "threshold is required"),
        (lambda: VerticalSlash(rule="mass", threshold=True), TypeError, "threshold must be a float"),
        (lambda: VerticalSlash(rule="mass", threshold="0.9"), TypeError, "threshold must be a float"),
        (lambda: VerticalSlash(threshold=0.9), ValueError, "leave it None with 'top_k'"),
        (lambda: VerticalSlash(rule="gamma", threshold=0.9), ValueError, "rule must be one of"),
        (lambda: VerticalSlash(vertical=10, min_vertical=11), ValueError, r"min_vertical must be <= vertical \(10\)"),
        (lambda: VerticalSlash(slash=4, min_slash=5), ValueError, r"min_slash must be <= slash \(4\)"),
        (lambda: VerticalSlash(min_slash=-1), ValueError, "min_slash must be >= 0"),
        (lambda: VerticalSlash(min_vertical=1.0), TypeError, "min_vertical must be an int"),
        (lambda: BlockSparse(top_k=3, min_blocks=4), ValueError, r"min_blocks must be <= top_k \(3\)"),
        (lambda: BlockSparse(min_blocks=-2), ValueError, "min_blocks must be >= 0"),
    ],
)
def test_invalid_rule_fields(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make()


def test_rule_fields_round_trip_and_config() -> None:
    """Defaults keep top_k; the fields survive JSON, the schema and the config; the MInference
    format cannot express an adaptive rule; bad values in a file name their place."""
    assert (VerticalSlash().rule, VerticalSlash().threshold, VerticalSlash().min_vertical) == ("top_k", None, 0)
    assert (BlockSparse().rule, BlockSparse().threshold, BlockSparse().min_blocks) == ("top_k", None, 0)
    p = VerticalSlash(rule="mass", threshold=1, min_vertical=5, min_slash=7)
    assert p.threshold == 1.0 and isinstance(p.threshold, float)
    for pattern in (p, BlockSparse(rule="relative", threshold=0.12, min_blocks=3)):
        data = json.loads(json.dumps(pattern_to_dict(pattern)))
        assert pattern_from_dict(data) == pattern
    sig = C.ModelSignature(model_id="m", architecture=None, num_layers=1, num_heads=2)
    cfg = C.PatternConfig(sig, [[p, BlockSparse(rule="relative", threshold=0.12)]])
    back = C.load_config(json.loads(json.dumps(cfg.to_dict())))
    assert back.layers == cfg.layers
    with pytest.raises(C.ConfigError, match="no MInference-format equivalent"):
        C.to_minference(cfg)
    for field, value, match in (("threshold", 0.0, r"layers\[0\]\[0\].*threshold"),
                                ("threshold", 2.0, r"layers\[0\]\[0\]\.threshold: must be <= 1"),
                                ("rule", "tau", r"layers\[0\]\[0\]\.rule"),
                                ("min_vertical", -1, r"layers\[0\]\[0\]\.min_vertical")):
        bad = cfg.to_dict()
        bad["layers"][0][0][field] = value
        with pytest.raises(C.ConfigError, match=match):
            C.load_config(bad)


def test_builder_rule_argument_errors() -> None:
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16)
    for impl in (triton_builders, portable, naive):
        with pytest.raises(ValueError, match="rule must be one of"):
            impl.vertical_slash_index(q, k, 2, 2, rule="tau", threshold=0.9)
        with pytest.raises(ValueError, match="threshold is required"):
            impl.block_sparse_index(q, k, 2, rule="mass")
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            impl.block_sparse_index(q, k, 2, rule="relative", threshold=0.0)
        with pytest.raises(ValueError, match="leave it None"):
            impl.vertical_slash_index(q, k, 2, 2, threshold=0.5)
        with pytest.raises(ValueError, match="min_slash must be >= 0"):
            impl.vertical_slash_index(q, k, 2, 2, rule="mass", threshold=0.9, min_slash=-1)
