"""The frontier search (minference.app.frontier): the allocation against brute force over every
assignment, monotone in the budget, the worst-case bound; the cost model; per-head options; the
family files; the ship rule on synthetic eval reports; the cost-calibration script in the
interpreter."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from minference.app import frontier as F
from minference.app import search as S
from minference.app.evaluate import EvalConfig, EvalReport, RunStats, SampleRecord
from minference.config import ModelSignature, PatternConfig, Provenance, load_config
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------------
# Allocation against brute force.


def options(cost, error, worst=None, allowed=None) -> F.HeadOptions:
    """HeadOptions of one layer with ``M`` heads from ``[M, C]`` tables."""
    cost = torch.as_tensor(cost, dtype=torch.float64)
    error = torch.as_tensor(error, dtype=torch.float64)
    worst = cost if worst is None else torch.as_tensor(worst, dtype=torch.float64)
    allowed = torch.ones_like(cost, dtype=torch.bool) if allowed is None else torch.as_tensor(allowed)
    C = cost.shape[1]
    cands = [AShape(sink=0, window=i + 1) for i in range(C)]
    return F.HeadOptions(cands, cost[None], error[None], error[None], worst[None], 1 - error[None], error[None] * 0,
                         allowed[None], "ms", 1000)


def random_instance(seed: int, M: int = 4, C: int = 4):
    g = torch.Generator().manual_seed(seed)
    cost = torch.rand(M, C, generator=g, dtype=torch.float64) * 10
    error = torch.rand(M, C, generator=g, dtype=torch.float64) * 0.2
    error[:, 0] = 0.0  # a lossless option per head (dense)
    cost[:, 0] = 10.0
    worst = cost * (1 + 3 * torch.rand(M, C, generator=g, dtype=torch.float64) * (torch.arange(C) % 2 == 1))
    allowed = torch.rand(M, C, generator=g) > 0.2
    allowed[:, 0] = True
    if seed % 3 == 0:  # exact ties of error and of cost between options
        error[:, 2] = error[:, 1]
        cost[:, 3] = cost[:, 1]
    return cost, error, worst, allowed


def assignments(allowed):
    return itertools.product(*[[c for c in range(allowed.shape[1]) if allowed[m, c]] for m in range(allowed.shape[0])])


def totals(x, a):
    return sum(float(x[m, c]) for m, c in enumerate(a))


def brute_min_cost(cost, error, allowed, max_error, worst=None, max_slack=None, ratio=None):
    best = math.inf
    for a in assignments(allowed):
        if totals(error, a) > max_error + 1e-12:
            continue
        if max_slack is not None and totals(worst, a) - ratio * totals(cost, a) > max_slack + 1e-9:
            continue
        best = min(best, totals(cost, a))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_every_path_point_is_the_cheapest_assignment_of_at_most_its_error(seed):
    cost, error, worst, allowed = random_instance(seed)
    path = F.lagrangian_path(cost, error, allowed, worst=worst)
    assert len(path.cost) > 1
    for k in range(len(path.cost)):
        choice = path.choice(k)
        assert all(bool(allowed[m, c]) for m, c in enumerate(choice.tolist()))
        assert float(path.cost[k]) == pytest.approx(totals(cost, choice.tolist()))
        assert float(path.error[k]) == pytest.approx(totals(error, choice.tolist()))
        assert float(path.worst[k]) == pytest.approx(totals(worst, choice.tolist()))
        assert float(path.cost[k]) == pytest.approx(brute_min_cost(cost, error, allowed, float(path.error[k])))
    assert float(path.error[0]) == pytest.approx(float(torch.where(allowed, error, math.inf).min(1).values.sum()))
    assert bool((path.cost[1:] <= path.cost[:-1] + 1e-12).all()) and bool((path.error[1:] >= path.error[:-1]).all())


def test_collinear_steps_of_a_head_stay_in_hull_order():
    # exactly collinear in the hull test, but float rounding makes the second rate the larger
    # (71.19999999999999 < 71.2): the path must still take the first step first
    cost = torch.tensor([[10.0, 8.7896, 6.8672], [10.0, 9.0, 9.5]], dtype=torch.float64)
    error = torch.tensor([[0.0, 0.017, 0.044], [0.0, 0.05, 0.3]], dtype=torch.float64)
    path = F.lagrangian_path(cost, error, torch.ones(2, 3, dtype=torch.bool))
    assert path.choice(len(path.heads)).tolist() == [2, 1]
    assert path.heads.tolist()[:2] == [0, 0] and path.choices.tolist()[:2] == [1, 2]


@pytest.mark.parametrize("seed", range(12))
def test_allocation_within_a_budget_is_optimal_up_to_one_step(seed):
    cost, error, worst, allowed = random_instance(seed)
    opts = options(cost, error, worst, allowed)
    path = F.lagrangian_path(cost, error, allowed)
    step = float((path.cost[:-1] - path.cost[1:]).max())
    M = cost.shape[0]
    for budget in torch.linspace(0, 0.2, 17).tolist():
        a = F.allocate(opts, budget)
        assert a.error <= budget * M + 1e-9
        choice = a.choice[0].tolist()
        assert a.cost == pytest.approx(totals(cost, choice)) and a.error == pytest.approx(totals(error, choice))
        best = brute_min_cost(cost, error, allowed, budget * M)
        assert best - 1e-9 <= a.cost <= best + step + 1e-9
        # exact for its own error: nothing of at most that error is cheaper
        assert a.cost == pytest.approx(brute_min_cost(cost, error, allowed, a.error))


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_monotone_in_the_budget(seed):
    cost, error, worst, allowed = random_instance(seed, M=5)
    opts = options(cost, error, worst, allowed)
    budgets = torch.linspace(0, 0.25, 26).tolist()
    free = [F.allocate(opts, b) for b in budgets]
    assert all(b.cost <= a.cost + 1e-12 and b.error >= a.error - 1e-12 for a, b in zip(free, free[1:]))
    bounded = [F.allocate(opts, b, worst_ratio=1.5, fixed=5.0) for b in budgets]
    assert all(b.cost <= a.cost + 1e-12 for a, b in zip(bounded, bounded[1:]))


def test_allocation_respects_the_worst_case_bound():
    # per head: dense (lossless), an adaptive option cheap on the calibration prompts but costly on
    # flat scores, a static option in between
    M = 4
    cost = torch.tensor([[10.0, 1.0, 4.0]] * M)
    error = torch.tensor([[0.0, 0.01, 0.02]] * M)
    worst = torch.tensor([[10.0, 30.0, 4.0]] * M)
    opts = options(cost, error, worst)
    free = F.allocate(opts, 0.05)
    assert free.choice[0].tolist() == [1] * M  # unbounded, the adaptive option everywhere
    assert free.worst > 1.2 * free.cost  # ... whose flat-score worst case is 30x
    for fixed in (0.0, 20.0):
        a = F.allocate(opts, 0.05, worst_ratio=1.2, fixed=fixed)
        assert fixed + a.worst <= 1.2 * (fixed + a.cost) + 1e-9
        best = brute_min_cost(cost, error, torch.ones(M, 3, dtype=torch.bool), 0.05 * M, worst,
                              (1.2 - 1) * fixed, 1.2)
        assert a.cost >= best - 1e-9
        assert a.cost <= best + 6.0 + 1e-9  # at most one head's step from the constrained optimum
        # optimal among assignments of at most its error and its worst-case slack
        slack = a.worst - 1.2 * a.cost
        assert a.cost == pytest.approx(brute_min_cost(cost, error, torch.ones(M, 3, dtype=torch.bool), a.error,
                                                      worst, slack, 1.2))
    # more time outside attention leaves adaptive heads more room
    assert F.allocate(opts, 0.05, worst_ratio=1.2, fixed=200.0).choice[0].tolist().count(1) > \
        F.allocate(opts, 0.05, worst_ratio=1.2).choice[0].tolist().count(1)


@pytest.mark.parametrize("seed", range(8))
def test_bounded_allocation_against_brute_force(seed):
    cost, error, worst, allowed = random_instance(seed)
    opts = options(cost, error, worst, allowed)
    for budget in (0.02, 0.05, 0.1, 0.3):
        a = F.allocate(opts, budget, worst_ratio=1.3, fixed=3.0)
        assert 3.0 + a.worst <= 1.3 * (3.0 + a.cost) + 1e-9 and a.error <= budget * 4 + 1e-9
        best = brute_min_cost(cost, error, allowed, budget * 4, worst, 0.3 * 3.0, 1.3)
        assert a.cost >= best - 1e-9
        assert a.cost == pytest.approx(brute_min_cost(cost, error, allowed, a.error, worst,
                                                      a.worst - 1.3 * a.cost, 1.3))


def test_allocation_errors():
    opts = options([[1.0, 2.0]], [[0.0, 0.1]], worst=[[2.0, 4.0]])
    with pytest.raises(F.FrontierError, match="budget"):
        F.allocate(opts, -0.1)
    with pytest.raises(F.FrontierError, match="worst_ratio"):
        F.allocate(opts, 0.1, worst_ratio=0.5)
    with pytest.raises(F.FrontierError, match="no assignment"):
        F.allocate(opts, 0.1, worst_ratio=1.2)  # every option's worst case is twice its cost
    with pytest.raises(F.FrontierError, match="no allowed option"):
        F.allocate(options([[1.0]], [[0.0]], allowed=[[False]]), 0.1)
    # without a ratio the message names the error budget only
    with pytest.raises(F.FrontierError, match=r"no assignment has .* per head <= 0$"):
        F.allocate(options([[1.0, 2.0]], [[0.01, 0.1]]), 0.0)


def test_a_family_checks_its_worst_ratio_before_building_paths(tmp_path):
    """``worst_ratio=0`` raised a ZeroDivisionError from the paths: the family checks it as
    ``allocate`` does."""
    with pytest.raises(F.FrontierError, match="worst_ratio must be >= 1, got 0"):
        F.write_family(fake_result(), [0.05], str(tmp_path / "z_{budget}.json"), worst_ratio=0)
    opts = F.head_options(fake_result(), F.CostModel.from_dict(table()))
    for bad in (0.5, math.inf):
        with pytest.raises(F.FrontierError, match="worst_ratio"):
            F.frontier_family(fake_result(), opts, [0.05], worst_ratio=bad)


def test_bounded_allocation_keeps_all_dense_when_a_cheaper_lossless_option_breaks_the_bound():
    # dense (cost 10, worst 10) and an adaptive option that misses nothing on the calibration
    # prompts (cost 4, flat-score worst 8 > 1.2 x 4): only all-dense meets the bound
    opts = options([[10.0, 4.0]], [[0.0, 0.0]], worst=[[10.0, 8.0]])
    for budget in (0.0, 0.05):
        a = F.allocate(opts, budget, worst_ratio=1.2)
        assert a.choice.tolist() == [[0]] and (a.cost, a.error, a.worst) == (10.0, 0.0, 10.0)


def test_bounded_allocation_finds_an_assignment_whenever_one_of_the_least_error_meets_the_bound():
    """Exhaustive over tiny instances (errors in hundredths: many ties): whenever an assignment of
    the least total error meets the worst-case bound (all-dense always does), ``allocate`` returns
    one within both constraints at every budget of at least that error."""
    found = 0
    for seed in range(150):
        g = torch.Generator().manual_seed(seed)
        M, C = 3, 4
        cost = torch.randint(1, 9, (M, C), generator=g).double()
        error = torch.randint(0, 5, (M, C), generator=g).double() / 100
        worst = cost * torch.randint(1, 4, (M, C), generator=g).double()
        allowed = torch.rand(M, C, generator=g) > 0.25
        allowed[:, 0] = True
        if seed % 2:  # a dense option per head: lossless, no worse on flat scores
            error[:, 0], cost[:, 0], worst[:, 0] = 0.0, 10.0, 10.0
        least = torch.where(allowed, error, math.inf).min(1).values
        opts = options(cost, error, worst, allowed)
        for ratio, fixed in ((1.2, 0.0), (1.5, 2.0)):
            feasible = any(all(float(error[m, c]) == float(least[m]) for m, c in enumerate(a))
                           and fixed + totals(worst, a) <= ratio * (fixed + totals(cost, a)) + 1e-9
                           for a in assignments(allowed))
            assert feasible or seed % 2 == 0  # all-dense is
            if not feasible:
                continue
            found += 1
            for extra in (0.0, 0.01, 0.05):
                budget = float(least.sum()) / M + extra
                a = F.allocate(opts, budget, worst_ratio=ratio, fixed=fixed)
                choice = a.choice[0].tolist()
                assert all(bool(allowed[m, c]) for m, c in enumerate(choice))
                assert a.error <= budget * M + 1e-9 and fixed + a.worst <= ratio * (fixed + a.cost) + 1e-9
    assert found > 150  # the check ran on most instances


# ---------------------------------------------------------------------------------------------
# Cost model.


def table(n=1000, heads=2, head_dim=16) -> dict:
    return {"format": F.COST_TABLE_FORMAT, "version": 1, "unit": "ms",
            "shape": {"n_tokens": n, "head_dim": head_dim, "num_heads": heads, "num_kv_heads": 1},
            "attention": {"dense": {"intercept_ms": 0.2, "ms_per_tile": 0.01},
                          "a_shape": {"intercept_ms": 0.1, "ms_per_tile": 0.012},
                          "vertical_slash": {"intercept_ms": 0.4, "ms_per_tile": 0.015},
                          "block_sparse@64": {"intercept_ms": 0.3, "ms_per_tile": 0.011}},
            "index": {"vertical_slash:mass": {"ms": 0.5}, "block_sparse:query:relative@64": {"ms": 0.6}},
            "provenance": {"gpu": "test"}}


def test_fit_line():
    a, b = F.fit_line([10, 20, 40], [1.5, 2.5, 4.5])
    assert a == pytest.approx(0.5) and b == pytest.approx(0.1)
    a, b = F.fit_line([10, 20, 40], [0.5, 1.9, 4.1])  # free fit's intercept < 0: through the origin
    assert a == 0.0 and b == pytest.approx((5 + 38 + 164) / (100 + 400 + 1600))
    assert F.fit_line([8], [2.0]) == (0.0, 0.25)
    # times falling with the tile count (noise): no negative price per tile, the mean time instead
    a, b = F.fit_line([10, 20, 40], [3.0, 2.0, 1.5])
    assert a == pytest.approx(6.5 / 3) and b == 0.0
    with pytest.raises(F.FrontierError):
        F.fit_line([1, 2], [1.0])


def test_cost_model_from_table_and_proxy():
    m = F.CostModel.from_dict(table(), source="t.json")
    assert m.calibrated and m.unit == "ms"
    n, ct = 1000, F.causal_tiles(1000)
    bs = BlockSparse(top_k=4, block=64, rule="relative", threshold=0.1, estimate="query")
    assert float(m.head_cost(bs, 0.5, n)) == pytest.approx((0.3 + 0.6) / 2 + 0.011 * 0.5 * ct)
    assert float(m.head_cost(Dense(), 1.0, n)) == pytest.approx(0.1 + 0.01 * ct)
    m.check([bs, Dense(), AShape()], head_dim=16, num_heads=2, n_tokens=1050)
    with pytest.raises(F.FrontierError, match="measured at 1000 tokens"):
        m.check([Dense()], head_dim=16, num_heads=2, n_tokens=2000)
    with pytest.raises(F.FrontierError, match="head dim"):
        m.check([Dense()], head_dim=64, num_heads=2, n_tokens=1000)
    with pytest.raises(F.FrontierError, match=r"block_sparse@128"):
        m.check([BlockSparse(top_k=4, block=128)], head_dim=16, num_heads=2, n_tokens=1000)
    # the cheaper estimate is its own index cost, never the full score's
    assert F.index_key(bs) == "block_sparse:query:relative@64"
    fewer = BlockSparse(top_k=4, block=64, rule="relative", threshold=0.1, estimate="query", score_rows=16)
    assert F.index_key(fewer) == "block_sparse:query/16:relative@64"
    with pytest.raises(F.FrontierError, match=r"block_sparse:query/16:relative@64"):
        m.check([fewer], head_dim=16, num_heads=2, n_tokens=1000)
    bad = table()
    bad["attention"]["dense"]["ms_per_tile"] = -1
    with pytest.raises(F.FrontierError, match="finite and >= 0"):
        F.CostModel.from_dict(bad)
    with pytest.raises(F.FrontierError, match="not a cost table"):
        F.CostModel.from_dict({"format": "x"})
    del bad["index"]
    with pytest.raises(F.FrontierError, match="malformed"):
        F.CostModel.from_dict(bad)
    p = F.CostModel.proxy(64, n, num_heads=14)
    assert not p.calibrated
    assert float(p.head_cost(Dense(), 1.0, n)) == pytest.approx(S.tile_cost("dense", 64))
    assert float(p.head_cost(bs, 0.25, n)) == pytest.approx(
        0.25 * S.tile_cost("block_sparse", 64) + F.INDEX_PROXY["block_sparse"] * S.tile_cost("dense", 64))
    assert float(p.head_cost(AShape(), 0.1, n)) == pytest.approx(0.1 * S.tile_cost("a_shape", 64))


def fake_result(n=1000) -> S.SearchResult:
    """A search result of one layer, two heads, over three candidates (no Dense among them)."""
    vs = VerticalSlash(vertical=64, slash=128, rule="mass", threshold=0.9)
    bs = BlockSparse(top_k=4, block=64, rule="relative", threshold=0.1, estimate="query")
    cands = [AShape(sink=4, window=64), vs, bs]
    t = lambda rows: torch.tensor([rows], dtype=torch.float64)  # noqa: E731
    sig = ModelSignature("tiny", "llama", 1, 2, 1, 16)
    config = PatternConfig(sig, [[Dense(), Dense()]], Provenance(source="search", notes="2 prompt(s)"))
    return S.SearchResult(config, cands, mass=t([[0.9, 0.95, 0.97], [0.5, 0.99, 0.8]]),
                          density=t([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]),
                          worst_mass=t([[0.85, 0.9, 0.96], [0.4, 0.98, 0.7]]),
                          cost=t([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]), select="cheapest",
                          tiles=t([[0.1, 0.05, 0.02], [0.1, 0.06, 0.03]]),
                          max_tiles=t([[0.1, 0.07, 0.025], [0.1, 0.08, 0.035]]), n_tokens=n, head_dim=16)


def test_head_options_costs_errors_and_worst_cases():
    res = fake_result()
    m = F.CostModel.from_dict(table())
    opts = F.head_options(res, m, min_mass=0.6)
    assert opts.candidates == res.candidates + [Dense()]
    n = res.n_tokens
    for i, c in enumerate(opts.candidates):
        tiles = res.tiles[..., i] if i < 3 else torch.ones(1, 2, dtype=torch.float64)
        assert torch.allclose(opts.cost[..., i], m.head_cost(c, tiles, n))
    assert torch.allclose(opts.error[..., :3], 1 - res.mass) and bool((opts.error[..., 3] == 0).all())
    assert torch.allclose(opts.worst_error[..., :3], 1 - res.worst_mass)
    # static: the costliest prompt; adaptive: at least the flat-score input (every count at its cap)
    assert torch.allclose(opts.worst_cost[..., 0], m.head_cost(res.candidates[0], res.max_tiles[..., 0], n))
    for i in (1, 2):
        flat = S.flat_tiles(res.candidates[i], n)
        want = m.head_cost(res.candidates[i], torch.clamp(res.max_tiles[..., i], min=flat), n)
        assert torch.allclose(opts.worst_cost[..., i], want)
        assert bool((opts.worst_cost[..., i] >= opts.cost[..., i]).all())
    # min_mass 0.6: head 1's A-shape (worst 0.4) is out, dense always in
    assert opts.allowed[0].tolist() == [[True, True, True, True], [False, True, True, True]]
    with pytest.raises(F.FrontierError, match="head dim"):
        F.head_options(res, F.CostModel.from_dict(table(head_dim=64)))


def test_head_options_on_the_output_error_proxy():
    """``proxy="output"``: the errors are the measured output errors (Dense appended at 0), the rest
    as with the mass proxy; the mass proxy's errors are ``1 - mass`` exactly; a search without
    output errors or an unknown proxy is refused."""
    res = fake_result()
    t = lambda rows: torch.tensor([rows], dtype=torch.float64)  # noqa: E731
    out = dataclasses.replace(res, out_error=t([[0.2, 0.01, 0.05], [0.3, 0.02, 0.1]]),
                              worst_out_error=t([[0.3, 0.02, 0.06], [0.5, 0.03, 0.2]]))
    m = F.CostModel.from_dict(table())
    mass = F.head_options(out, m, min_mass=0.6)
    opts = F.head_options(out, m, min_mass=0.6, proxy="output")
    assert (mass.proxy, opts.proxy) == ("mass", "output")
    assert torch.equal(mass.error[..., :3], (1 - res.mass).clamp(min=0))
    assert torch.equal(opts.error[..., :3], out.out_error) and bool((opts.error[..., 3] == 0).all())
    assert torch.equal(opts.worst_error[..., :3], out.worst_out_error) and bool((opts.worst_error[..., 3] == 0).all())
    for name in ("cost", "worst_cost", "mass", "density", "allowed"):  # the proxy changes the error only
        assert torch.equal(getattr(opts, name), getattr(mass, name)), name
    with pytest.raises(F.FrontierError, match="needs measurements with the output error"):
        F.head_options(res, m, proxy="output")
    with pytest.raises(F.FrontierError, match="error proxy must be one of"):
        F.head_options(out, m, proxy="nll")
    nan = out.out_error.clone()
    nan[0, 1, 2] = float("nan")  # an allowed candidate: the allocation would silently go around it
    with pytest.raises(F.FrontierError, match=r"layer 0, head 1 is not finite \(1 such"):
        F.head_options(dataclasses.replace(out, out_error=nan), m, min_mass=0.6, proxy="output")


def test_the_mass_proxy_is_the_default_and_an_output_error_equal_to_the_missed_mass_allocates_alike(tmp_path):
    """The allocation reads the proxy's error table only: ``proxy="mass"`` is the default, and an
    output error equal to the missed mass gives the same family (costs, errors, configs)."""
    res = fake_result()
    same = dataclasses.replace(res, out_error=(1 - res.mass).clamp(min=0),
                               worst_out_error=(1 - res.worst_mass).clamp(min=0))
    budgets = [0.0, 0.03, 0.1, 0.3]
    default, s0 = F.write_family(res, budgets, str(tmp_path / "a_{budget}.json"), worst_ratio=None)
    mass, s1 = F.write_family(same, budgets, str(tmp_path / "b_{budget}.json"), worst_ratio=None, proxy="mass")
    output, s2 = F.write_family(same, budgets, str(tmp_path / "c_{budget}.json"), worst_ratio=None, proxy="output")
    for a, b, c in zip(default, mass, output):
        assert a.config.layers == b.config.layers == c.config.layers
        assert torch.equal(a.allocation.choice, b.allocation.choice) and torch.equal(a.allocation.choice,
                                                                                     c.allocation.choice)
        assert (a.allocation.cost, a.allocation.error) == (b.allocation.cost, b.allocation.error)
        assert (a.allocation.cost, a.allocation.error) == (c.allocation.cost, c.allocation.error)
        assert "error proxy mass" in a.config.provenance.notes and "error proxy output" in c.config.provenance.notes
    assert (s0["proxy"], s1["proxy"], s2["proxy"]) == ("mass", "mass", "output")
    assert [p["cost"] for p in s0["points"]] == [p["cost"] for p in s2["points"]]
    assert "mean relative output error per head" in F.format_summary(s2)
    assert "mean missed attention mass per head" in F.format_summary(s0)
    legacy = {k: v for k, v in s0.items() if k != "proxy"}  # a summary written before the proxy existed
    assert F.summary_proxy(legacy) == "mass" and F.format_summary(legacy) == F.format_summary(s0)


def test_a_head_floor_keeps_every_chosen_head_at_its_mass_and_meets_the_rule_at_a_loose_budget(tmp_path):
    """``floor``: no head takes a candidate whose worst prompt keeps less mass (Dense always may);
    at a budget the floor already meets, the family is the per-head rule's cheapest choice at that
    mass; the floor is in the notes and the summary."""
    res = fake_result()
    cands = [*res.candidates, Dense()]
    table_path = tmp_path / "t.json"
    table_path.write_text(json.dumps(table()))
    budgets = [0.0, 0.02, 0.05, 1.0]
    free, _ = F.write_family(res, budgets, str(tmp_path / "a_{budget}.json"), cost_table=str(table_path),
                             worst_ratio=None)
    floored, summary = F.write_family(res, budgets, str(tmp_path / "b_{budget}.json"), cost_table=str(table_path),
                                      worst_ratio=None, floor=0.95)
    worst = torch.cat([res.worst_mass, torch.ones(1, 2, 1, dtype=torch.float64)], -1)
    for p in floored:
        kept = worst[0].gather(-1, p.allocation.choice[0][:, None])[:, 0]
        assert bool((kept >= 0.95).all()), (p.budget, p.allocation.choice)
        assert "head floor 0.95" in p.config.provenance.notes
    # without the floor the loosest budget takes head 1's A-shape (worst 0.4): the floor is what binds
    assert free[-1].config.layers[0][1] == cands[0] and floored[-1].config.layers[0][1] != cands[0]
    rule = res.rechoose(0.95, "cheapest")
    assert floored[-1].config.layers == rule.layers
    assert summary["floor"] == 0.95 and "head floor 0.95" in F.format_summary(summary)
    assert "head floor" not in free[0].config.provenance.notes


def test_a_search_without_its_length_or_head_dim_is_refused_before_the_proxy(tmp_path):
    """The tile proxy is made at the search's length and head dim: without them, write_family refuses
    with a FrontierError (it raised a TypeError inside the proxy before)."""
    out = str(tmp_path / "fam_{budget}.json")
    with pytest.raises(F.FrontierError, match="tiles and masses"):
        F.write_family(fake_result(n=None), [0.1], out)
    res = fake_result()
    res = dataclasses.replace(res, head_dim=None, config=dataclasses.replace(
        res.config, model=dataclasses.replace(res.config.model, head_dim=None)))
    with pytest.raises(F.FrontierError, match="head dim"):
        F.write_family(res, [0.1], out)


# ---------------------------------------------------------------------------------------------
# The family on a tiny model.


def test_family_files_load_and_record_their_prediction(tmp_path, tiny_llama):
    pytest.importorskip("matplotlib")
    model, prompts = tiny_llama(512)
    cands = S.frontier_candidates(512, blocks=(64,))
    res = S.search(model, prompts, candidates=cands, select="cheapest", min_mass=0.9, progress=False, row_stride=8)
    budgets = [0.0, 0.05, 0.2, 0.5]
    points, summary = F.write_family(res, budgets, str(tmp_path / "fam_{budget}.json"))
    assert [p.path for p in points] == [str(tmp_path / f"fam_{b:g}.json") for b in budgets]
    costs = []
    for p, s in zip(points, summary["points"]):
        loaded = load_config(p.path, model)  # the model check passes: the search's signature
        assert loaded.layers == p.config.layers
        assert loaded.provenance.notes.startswith("frontier point: error budget")
        assert "(mean missed attention mass per head; error proxy mass)" in loaded.provenance.notes
        assert f"predicted cost {p.allocation.cost:.6g}" in loaded.provenance.notes
        assert s["cost"] == p.allocation.cost and s["error"] == pytest.approx(p.allocation.error / 8)
        assert s["error"] <= p.budget + 1e-9 and s["config"] == p.path
        # the recorded scores are the chosen candidates' masses
        for l, row in enumerate(loaded.layers):
            for h, pat in enumerate(row):
                c = cands.index(pat)
                assert loaded.provenance.scores[l][h] == pytest.approx(float(res.mass[l, h, c]), abs=1e-6)
        costs.append(s["cost"])
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]  # the budgets bought something
    # budget 0: no sparse candidate at 512 tokens both misses no mass and costs less than dense
    assert points[0].config.layers == [[Dense()] * 4] * 2
    assert summary["points"][0]["error"] == 0.0 and summary["points"][0]["cost"] == summary["dense_cost"]
    for ext in (".json", ".md", ".png"):
        assert (tmp_path / f"fam_frontier{ext}").is_file()
    assert json.loads((tmp_path / "fam_frontier.json").read_text())["points"][1]["budget"] == 0.05
    with pytest.raises(F.FrontierError, match="budget"):
        F.write_family(res, budgets, str(tmp_path / "no_placeholder.json"))


# ---------------------------------------------------------------------------------------------
# The ship rule.

TASKS = ("single_needle", "multi_key")


def report(configs: dict, *, lengths=(1000,), dense_correct=(8, 5), samples=10) -> EvalReport:
    """``configs``: name -> dict(ttft=[s...], correct=(c1, c2), nll=x, length=n: overrides)."""
    spec = {"dense": dict(ttft=[1.0] * samples, correct=dense_correct, nll=2.0), **configs}
    cfgs = [EvalConfig(name, name if name == "dense" else f"{name}.json", "dense" if name == "dense" else "file")
            for name in spec]
    records, runs = [], []
    for n in lengths:
        for name, s in spec.items():
            s = {**s, **s.get(n, {})}
            if s.get("skip"):
                continue
            count = s.get("samples", samples)
            runs.append(RunStats(name, n, ttft_s=list(s["ttft"])))
            for task, correct in zip(TASKS, s["correct"]):
                for i in range(count):
                    records.append(SampleRecord(name, task, n, i, 0, None, ["1"], i < correct, "", None))
            if s.get("nll") is not None:
                records.append(SampleRecord(name, "perplexity", n, 0, 0, None, [], None, None, None,
                                            nll=s["nll"], nll_buckets=[s["nll"]]))
    return EvalReport(model={"name": "m", "dtype": "bf16", "model_id": "m"}, machine={}, settings={"device": "cuda"},
                      configs=cfgs, lengths=list(lengths), tasks=[*TASKS, "perplexity"], records=records, runs=runs)


def ttft(median: float, worst: float | None = None, samples: int = 10) -> list[float]:
    values = [median] * samples
    if worst is not None:
        values[-1] = worst
    return values


def test_ship_rule_picks_the_fastest_passing_config_and_says_why_faster_ones_failed():
    rep = report({
        "tasks_short": dict(ttft=ttft(0.30), correct=(6, 5), nll=2.0),  # 2 samples short on one task
        "worst_only": dict(ttft=ttft(0.35, worst=0.50), correct=(8, 5), nll=2.0),  # 0.50 > 1.2 x 0.35
        "nll_high": dict(ttft=ttft(0.40), correct=(8, 5), nll=2.03),
        "tie_a": dict(ttft=ttft(0.50), correct=(7, 4), nll=2.015),  # one sample short each: passes
        "tie_b": dict(ttft=ttft(0.50), correct=(8, 6), nll=2.005),  # same median, lower NLL: first
        "slow_ok": dict(ttft=ttft(0.80, worst=0.95), correct=(8, 5), nll=2.0),
    })
    d = F.ship_choice(rep)
    assert d.chosen == "tie_b" and d.length == 1000 and d.dense == "dense"
    assert [r[0] for r in d.ranking] == ["tasks_short", "worst_only", "nll_high", "tie_b", "tie_a", "slow_ok"]
    assert len(d.rejected["tasks_short"]) == 1 and "single_needle at 1000: 6/10 vs dense 8/10" in \
        d.rejected["tasks_short"][0]
    assert len(d.rejected["worst_only"]) == 1 and "worst 500.0 ms > 1.2 x median 350.0 ms" in \
        d.rejected["worst_only"][0]
    assert len(d.rejected["nll_high"]) == 1 and "+0.030 > +0.02" in d.rejected["nll_high"][0]
    assert d.rejected["tie_a"] == [] and d.rejected["slow_ok"] == []
    text = d.text()
    assert "ship: tie_b" in text and "worst_only" in text and "slow_ok" not in text
    # the worst-case rule alone decides: without it the faster config ships
    assert F.ship_choice(rep, worst_ratio=2.0).chosen == "worst_only"
    # ties broken by NLL, then by name
    same = report({"b": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.01),
                   "a": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.01)})
    assert F.ship_choice(same).chosen == "a"


def test_ship_rule_rejections():
    rep = report({
        "few": dict(ttft=ttft(0.3, samples=9), correct=(8, 5), nll=2.0, samples=9),
        "no_nll": dict(ttft=ttft(0.4), correct=(8, 5), nll=None),
        "slower": dict(ttft=ttft(1.2), correct=(8, 5), nll=2.0),
        "other_length": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.0) | {2000: dict(correct=(5, 5))},
    }, lengths=(1000, 2000))
    d = F.ship_choice(rep)
    assert d.chosen is None and d.length == 2000
    assert any("9 samples < 10" in r for r in d.rejected["few"])
    assert any("NLL at 1000: not measured" in r for r in d.rejected["no_nll"])
    assert any("not faster than dense" in r for r in d.rejected["slower"])
    assert d.rejected["other_length"] == ["single_needle at 2000: 5/10 vs dense 8/10 (3 samples short)"]
    assert "no sparse config passes" in d.text()
    with pytest.raises(F.FrontierError, match="length 5"):
        F.ship_choice(rep, length=5)
    missing = report({"x": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.0) | {2000: dict(skip=True)}},
                     lengths=(1000, 2000))
    assert F.ship_choice(missing, length=1000).rejected["x"] == ["not run at 2000"]


def test_ship_rule_needs_dense_at_every_length():
    """Without dense at a length nothing is compared there: that length fails every config, and
    the ranking length without dense is an error (every config passed every check before)."""
    no_dense = report({"bad": dict(ttft=ttft(0.3), correct=(0, 0), nll=9.0, samples=1),
                       "dense": dict(ttft=ttft(1.0), correct=(8, 5), nll=2.0, skip=True)})
    with pytest.raises(F.FrontierError, match=r"^dense \('dense'\) has no run at the ranking length 1000"):
        F.ship_choice(no_dense)
    dense_at = {"ok": dict(ttft=ttft(0.3), correct=(8, 5), nll=2.0) | {1000: dict(correct=(0, 0), nll=9.0)},
                "dense": dict(ttft=ttft(1.0), correct=(8, 5), nll=2.0)}
    rep = report(dense_at | {"dense": dense_at["dense"] | {1000: dict(skip=True)}}, lengths=(1000, 2000))
    d = F.ship_choice(rep)
    assert d.chosen is None and d.rejected["ok"] == ["dense not run at 1000: nothing to compare with"]
    with pytest.raises(F.FrontierError, match="ranking length 1000"):
        F.ship_choice(rep, length=1000)
    rep = report(dense_at | {"dense": dense_at["dense"] | {2000: dict(skip=True)}}, lengths=(1000, 2000))
    with pytest.raises(F.FrontierError, match="ranking length 2000"):
        F.ship_choice(rep)
    assert F.ship_choice(rep, length=1000).rejected["ok"][-1] == "dense not run at 2000: nothing to compare with"
    # a decision whose chosen config has no timing prints n/a (it raised a TypeError)
    text = F.ShipDecision("x", 1000, "dense", [("x", None)], {"x": []}).text()
    assert text.splitlines()[1] == "  x: n/a, passes"


def test_ship_rule_rejects_a_nan_nll_or_ttft():
    nan = float("nan")
    d = F.ship_choice(report({"x": dict(ttft=ttft(0.3), correct=(8, 5), nll=nan)}))
    assert d.chosen is None and d.rejected["x"] == ["NLL at 1000: nan vs dense 2.000 (+nan > +0.02)"]
    d = F.ship_choice(report({"x": dict(ttft=ttft(nan), correct=(8, 5), nll=2.0)}))
    assert d.chosen is None and d.rejected["x"] == ["TTFT at 1000: worst nan ms > 1.2 x median nan ms",
                                                    "TTFT at 1000: median nan ms not faster than dense 1000.0 ms"]


def test_ship_rule_needs_enough_timed_prefills_and_a_timed_dense():
    d = F.ship_choice(report({"one": dict(ttft=[0.3], correct=(8, 5), nll=2.0)}))
    assert d.chosen is None and d.rejected["one"] == ["TTFT at 1000: 1 timed prefills < 10"]
    assert F.ship_choice(report({"one": dict(ttft=[0.3], correct=(8, 5), nll=2.0)}), min_samples=1).chosen == "one"
    d = F.ship_choice(report({"slow": dict(ttft=ttft(5.0), correct=(8, 5), nll=2.0),
                              "dense": dict(ttft=[], correct=(8, 5), nll=2.0)}))
    assert d.chosen is None and d.rejected["slow"] == ["TTFT at 1000: dense not timed"]


def test_ship_rule_merges_reports_and_needs_dense():
    a = report({"x": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.0)}, lengths=(1000,))
    b = report({"x": dict(ttft=ttft(0.5), correct=(8, 5), nll=2.0)}, lengths=(2000,))
    assert F.ship_choice([a, b]).chosen == "x"
    no_dense = report({})
    no_dense.configs = [c for c in no_dense.configs if not c.dense]
    with pytest.raises(F.FrontierError, match="no dense"):
        F.ship_choice(no_dense)


def test_ttft_stats_from_the_timed_prefills():
    rep = report({"x": dict(ttft=[0.3, 0.1, 0.2, 0.9], correct=(8, 5), nll=2.0)})
    t = F.ttft_stats(rep, "x", 1000)
    assert (t.median_ms, t.max_ms, t.count) == (pytest.approx(250.0), pytest.approx(900.0), 4)
    assert F.ttft_stats(rep, "x", 5) is None


def test_ttft_stats_read_the_per_task_summary_when_the_report_has_one():
    class WithSummary(EvalReport):  # the ruler branch's EvalReport.ttft_summary(), task "all" pooled
        def ttft_summary(self):
            return [dict(config="x", task="all", n_tokens=1000, prompts=30, ttft_median_ms=420.0, ttft_max_ms=480.0),
                    dict(config="x", task="multi_key", n_tokens=1000, prompts=10, ttft_median_ms=1.0,
                         ttft_max_ms=2.0)]

    base = report({"x": dict(ttft=[0.3] * 10, correct=(8, 5), nll=2.0)})
    rep = WithSummary(**{f: getattr(base, f) for f in ("model", "machine", "settings", "configs", "lengths", "tasks",
                                                          "records", "runs")})
    assert F.ttft_stats(rep, "x", 1000) == F.TTFTStats(420.0, 480.0, 30)
    assert F.ttft_stats(rep, "dense", 1000) == F.TTFTStats(1000.0, 1000.0, 10)  # no row: the timed prefills


# ---------------------------------------------------------------------------------------------
# The cost-calibration script.


def test_calibrate_costs_runs_at_a_tiny_length_in_the_interpreter(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("calibrate_costs", ROOT / "benchmarks" / "calibrate_costs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "costs.json"
    n = 128
    assert script.main(["--tokens", str(n), "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--layers", "3",
                        "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["attention"]) == {"dense", "a_shape", "vertical_slash", "block_sparse@128", "block_sparse@64"}
    for fit in data["attention"].values():
        assert all(p["tiles"] > 0 and p["ms"] > 0 for p in fit["points"])
        assert fit["intercept_ms"] >= 0 and fit["ms_per_tile"] >= 0
    dense = data["attention"]["dense"]["points"][0]
    assert dense["tiles"] == 2 * F.causal_tiles(n)
    assert data["shape"] == {"n_tokens": n, "head_dim": 16, "num_heads": 2, "num_kv_heads": 1, "dtype": "float32",
                             "tile": 64, "num_layers": 3}
    prov = data["provenance"]
    assert prov["interpreted"] is True and prov["torch"] == torch.__version__ and prov["created"]
    model = F.CostModel.load(out)
    # the table covers every candidate of the frontier search and the adaptive one at its length
    model.check([*S.frontier_candidates(n, blocks=(128, 64), bs_gammas=(0.9,), score_rows=(0, *script.SCORE_ROWS)),
                 *S.adaptive_candidates()], head_dim=16, num_heads=2, n_tokens=n)
    assert "wrote" in capsys.readouterr().out


def test_ship_rule_takes_nll_from_a_companion_report_of_the_same_configs():
    """A RULER report has no perplexity task: the NLL comes from an NLL run of the same configs
    (matched by pattern data, not name), at a length within 3%, against that run's own dense."""
    ruler = report({"a": dict(ttft=ttft(0.4), correct=(8, 5), nll=None),
                    "b": dict(ttft=ttft(0.5), correct=(8, 5), nll=None)})
    layers = {"a": [[{"kind": "a_shape", "sink": 64, "window": 1024}]],
              "b": [[{"kind": "dense"}]]}
    for c in ruler.configs:
        c.config = None if c.dense else {"model": {"name": "m"}, "layers": layers[c.name]}
    assert F.ship_choice(ruler).chosen is None  # no NLL: nothing passes

    def companion(n, nll_a, nll_b, names=("x", "y")):
        comp = report({names[0]: dict(ttft=ttft(0.4), correct=(8, 5), nll=nll_a),
                       names[1]: dict(ttft=ttft(0.5), correct=(8, 5), nll=nll_b)}, lengths=(n,))
        for c, key in zip(comp.configs[1:], ("a", "b")):
            c.config = {"model": {"name": "m"}, "layers": layers[key]}
        comp.machine = {"gpu": "other GPU"}
        return comp

    near = companion(1020, 2.03, 2.01)  # 'x' is a's pattern (+0.03), 'y' is b's (+0.01)
    d = F.ship_choice(ruler, nll_reports=[near])
    assert d.chosen == "b" and d.rejected["b"] == []
    assert d.nll == {"dense": 2.0, "a": 2.03, "b": 2.01}  # what the plot draws
    assert d.rejected["a"] == ["NLL at 1000: 2.030 vs dense 2.000 (+0.030 > +0.02), from 'x' of the NLL report "
                               "at 1020 tokens on other GPU"]
    pairs = F.nll_pairs(ruler, [near])
    assert pairs[("b", 1000)] == F.NLLPair(2.01, 2.0, "'y' of the NLL report at 1020 tokens on other GPU")
    # too far in length, or the same names with other patterns: not used
    assert F.ship_choice(ruler, nll_reports=[companion(1040, 2.0, 2.0)]).chosen is None
    swapped = companion(1000, 2.0, 2.0, names=("b", "a"))  # 'b' there holds a's pattern
    assert F.nll_pairs(ruler, [swapped])[("a", 1000)].source.startswith("'b' of the NLL report")
    # the report's own perplexity task wins over a companion
    own = report({"a": dict(ttft=ttft(0.4), correct=(8, 5), nll=2.001)})
    own.configs[1].config = {"model": {"name": "m"}, "layers": layers["a"]}
    assert F.nll_pairs(own, [near])[("a", 1000)] == F.NLLPair(2.001, 2.0, None)


def test_show_frontier_reads_nll_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from minference.app.cli import main

    ruler = report({"a": dict(ttft=ttft(0.4), correct=(8, 5), nll=None)})
    comp = report({"a": dict(ttft=ttft(0.4), correct=(8, 5), nll=2.01)}, lengths=(990,))
    ruler.save(tmp_path / "r.json")
    comp.save(tmp_path / "n.json")
    assert main(["show", "frontier", str(tmp_path / "r.json"), "--out", str(tmp_path / "f.png")]) == 0
    assert "NLL at 1000: not measured" in capsys.readouterr().out
    assert main(["show", "frontier", str(tmp_path / "r.json"), "--nll", str(tmp_path / "n.json"),
                 "--out", str(tmp_path / "g.png")]) == 0
    assert "ship: a" in capsys.readouterr().out and (tmp_path / "g.png").stat().st_size > 0
    assert main(["show", "frontier", str(tmp_path / "r.json"), "--nll", str(tmp_path / "none.json"),
                 "--out", str(tmp_path / "h.png")]) == 2  # the usual one-line error, naming the file
    assert f"minference show frontier: error: cannot read {tmp_path / 'none.json'}" in capsys.readouterr().err


def test_layer_ablation_restricts_a_config_to_each_layer_group(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("layer_ablation", ROOT / "benchmarks" / "layer_ablation.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    assert ab.layer_groups(28, 4) == [(0, 6), (7, 13), (14, 20), (21, 27)]
    assert ab.layer_groups(30, 4) == [(0, 7), (8, 15), (16, 22), (23, 29)]
    with pytest.raises(ValueError, match="groups must lie in"):
        ab.layer_groups(3, 4)
    config = load_config(ROOT / "fixtures" / "configs" / "qwen2.5-coder-1.5b.json")
    assert ab.main([str(ROOT / "fixtures" / "configs" / "qwen2.5-coder-1.5b.json"), "--groups", "4",
                    "--out", str(tmp_path)]) == 0
    specs = capsys.readouterr().out.split()
    assert [s.split("=")[0] for s in specs] == ["L0-6", "L7-13", "L14-20", "L21-27"]
    for s, (first, last) in zip(specs, ab.layer_groups(28, 4)):
        part = load_config(s.split("=", 1)[1])
        for l, row in enumerate(part.layers):
            assert row == (config.layers[l] if first <= l <= last else [Dense()] * len(row))
        assert part.model == config.model and f"layers {first}-{last} as searched" in part.provenance.notes
    assert ab.main([str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "layer_ablation:" in capsys.readouterr().err


def test_layer_ablation_sets_one_head_and_refuses_a_bad_one_in_a_line(tmp_path, capsys):
    """``--set-head L H PATTERN``: one config, that head replaced (JSON or 'dense'), every other head
    as it was, a note naming the change; a head outside the config, non-integer coordinates or an
    invalid pattern are refused in one line, writing nothing."""
    spec = importlib.util.spec_from_file_location("layer_ablation", ROOT / "benchmarks" / "layer_ablation.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    src = ROOT / "fixtures" / "configs" / "qwen2.5-coder-0.5b.json"
    config = load_config(src)
    wide = '{"kind": "a_shape", "sink": 128, "window": 16384}'
    assert ab.main([str(src), "--out", str(tmp_path), "--set-head", "9", "8", wide]) == 0
    name, path = capsys.readouterr().out.strip().split("=", 1)
    changed = load_config(path)
    assert name == "L9H8" and changed.layers[9][8] == AShape(sink=128, window=16384)
    assert all(changed.layers[l][h] == config.layers[l][h] for l in range(len(config.layers))
               for h in range(len(config.layers[l])) if (l, h) != (9, 8))
    assert "head ablation: layer 9, head 8" in changed.provenance.notes and changed.model == config.model
    assert ab.main([path, "--out", str(tmp_path / "back"), "--set-head", "9", "8", "dense"]) == 0
    assert load_config(capsys.readouterr().out.strip().split("=", 1)[1]).layers == config.layers
    for bad, why in ((["30", "8", "dense"], "no head 8 in layer 30"), (["9", "x", "dense"], "must be integers"),
                     (["9", "8", '{"kind": "a_shape", "sink": -1}'], "sink"), (["9", "8", "[1]"], "is not a pattern")):
        assert ab.main([str(src), "--out", str(tmp_path / "bad"), "--set-head", *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and why in err, err
    assert not (tmp_path / "bad").exists()


def test_rank_agreement_is_spearmans_with_tied_ranks_averaged():
    assert F.rank_agreement([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert F.rank_agreement([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1]) == pytest.approx(-1.0)
    assert F.rank_agreement([1, 2, 3, 4, 5], [1, 8, 27, 64, 1e6]) == pytest.approx(1.0)  # ranks, not values
    # d = (1, 1, 1, 1, 0): 1 - 6 * 4 / (5 * 24) = 0.8
    assert F.rank_agreement([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # x's ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4), both centred on 2.5: 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    assert F.rank_agreement([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9 ** 0.5)
    # ties in both: ranks (2.5, 2.5, 1, 4) and (3, 3, 3, 1); sum of products -3, squares 4.5 and 3
    assert F.rank_agreement([2, 2, 1, 3], [4, 4, 4, 1]) == pytest.approx(-3 / (4.5 * 3) ** 0.5)
    for x, y in (([1, 2], [1, 2]), ([], []), ([1, 1, 1], [1, 2, 3]), ([1, 2, 3], [5, 5, 5])):
        assert F.rank_agreement(x, y) != F.rank_agreement(x, y)  # NaN
    with pytest.raises(ValueError, match="different lengths"):
        F.rank_agreement([1, 2, 3], [1, 2])
