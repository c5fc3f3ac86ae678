"""Offline search: vectorised online-index rules vs the naive estimators, masses vs the fp64
reference masks, candidate budgets, and a search on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from minference.reference import estimators as E
from minference.reference.attention import dense_attention_probs
from minference.reference.masks import ashape_mask, block_sparse_mask, slash_set, vertical_slash_mask

from minference.app import search as S
from minference.config import PatternConfig, load_config, validate_schema
from minference.dispatch import FILL_GAPS
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash


def qk(n=97, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, n, d, generator=g), torch.randn(hkv, n, d, generator=g) * 2


@pytest.mark.parametrize("agg", ["sum", "max"])
@pytest.mark.parametrize("v, s, sink, local, last_q", [(10, 7, 3, 2, 16), (0, 1, 0, 0, 97), (40, 30, 30, 0, 5)])
def test_vertical_slash_choice_matches_reference(agg, v, s, sink, local, last_q):
    q, k = qk()
    p = VerticalSlash(vertical=v, slash=s, last_q=last_q, sink_columns=sink, local_diagonals=local, aggregation=agg)
    cols, offs = S.pattern_sets(p, q, k.repeat_interleave(2, dim=0), q.shape[-1] ** -0.5)
    v_idx, s_idx = E.vertical_slash_index(q[None], k[None], v, s, last_q=last_q, sink_columns=sink,
                                          local_diagonals=local, aggregation=agg)
    for h in range(q.shape[0]):
        assert set(torch.nonzero(cols[h]).flatten().tolist()) == {x for x in v_idx[0, h].tolist() if x >= 0}
        filled = slash_set(q.shape[1], s_idx[0, h], FILL_GAPS)  # the set the dispatcher runs
        assert set(torch.nonzero(offs[h]).flatten().tolist()) == set(torch.nonzero(filled).flatten().tolist())


@pytest.mark.parametrize("top_k, sink, diag", [(3, 1, True), (1, 0, True), (4, 2, False), (20, 0, True)])
def test_block_choice_matches_reference(top_k, sink, diag):
    q, k = qk()
    p = BlockSparse(top_k=top_k, block=16, sink_blocks=sink, force_diagonal=diag)
    chosen = S.pattern_sets(p, q, k.repeat_interleave(2, dim=0), q.shape[-1] ** -0.5)
    ref = E.block_sparse_index(q[None], k[None], top_k, block=16, sink_blocks=sink, force_diagonal=diag)
    for h in range(q.shape[0]):
        for I in range(chosen.shape[1]):
            assert set(torch.nonzero(chosen[h, I]).flatten().tolist()) == {x for x in ref[0, h, I].tolist() if x >= 0}


def test_masses_equal_reference_masks():
    n = 97
    q, k = qk(n)
    probs = dense_attention_probs(q[None], k[None])[0]  # [H, n, n] fp64
    cands = [AShape(sink=4, window=20), VerticalSlash(vertical=8, slash=10, last_q=16), BlockSparse(top_k=3, block=16),
             Dense()]
    mass, dens = S.head_scores(q, k, cands)
    v_idx, s_idx = E.vertical_slash_index(q[None], k[None], 8, 10, last_q=16, sink_columns=30, local_diagonals=100)
    blocks = E.block_sparse_index(q[None], k[None], 3, block=16, sink_blocks=1)
    masks = [ashape_mask(n, 4, 20).expand(4, n, n), vertical_slash_mask(n, v_idx, s_idx, FILL_GAPS)[0],
             block_sparse_mask(n, blocks, 16)[0], torch.ones(n, n, dtype=torch.bool).tril().expand(4, n, n)]
    for c, m in enumerate(masks):
        want = (probs * m).sum(dim=(1, 2)) / n
        assert torch.allclose(mass[:, c], want, atol=1e-5), (c, mass[:, c], want)
        assert torch.allclose(dens[:, c], m.sum(dim=(1, 2)).double() / S.causal_pairs(n))
    # a share of each row's computed mass: exactly 1 for the dense candidate, never above 1
    assert torch.equal(mass[:, 3], torch.ones(4, dtype=torch.float64)) and bool((mass <= 1).all())


def qkv(n=97, hq=4, hkv=2, d=16, seed=0):
    q, k = qk(n, hq, hkv, d, seed)
    return q, k, torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(seed + 100))


def output_error_reference(q, k, v, masks, rows):
    """``[Hq, C]`` float64: mean over ``rows`` of ``||O_c - O|| / ||O||``, every product in float64,
    ``O_c`` the softmax renormalised over ``masks[c] [Hq, n, n]`` (kv expanded by hand)."""
    group = q.shape[0] // k.shape[0]
    kx, vx = (x.double().repeat_interleave(group, dim=0) for x in (k, v))
    probs = dense_attention_probs(q.double()[None], kx[None])[0][:, rows]  # [Hq, R, n]
    dense = probs @ vx
    out = []
    for m in masks:
        kept = probs * m[:, rows]
        sparse = (kept @ vx) / kept.sum(dim=-1, keepdim=True)
        out.append(((sparse - dense).norm(dim=-1) / dense.norm(dim=-1)).mean(dim=-1))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("rows, stride", [(None, 1), (40, 3)])
def test_output_error_equals_the_fp64_reference(rows, stride):
    """GQA (4 query heads on 2 kv heads): the search's float32 output error against products in
    float64, for the dynamic candidates the sets the reference builders choose; Dense exactly 0."""
    n = 97
    q, k, v = qkv(n)
    cands = [AShape(sink=4, window=20), VerticalSlash(vertical=8, slash=10, last_q=16), BlockSparse(top_k=3, block=16),
             Dense()]
    mass, dens, err = S.head_scores(q, k, cands, v=v, rows=rows, row_stride=stride)
    assert torch.equal(S.head_scores(q, k, cands, rows=rows, row_stride=stride)[0], mass)  # the mass is unchanged
    v_idx, s_idx = E.vertical_slash_index(q[None], k[None], 8, 10, last_q=16, sink_columns=30, local_diagonals=100)
    blocks = E.block_sparse_index(q[None], k[None], 3, block=16, sink_blocks=1)
    masks = [ashape_mask(n, 4, 20).expand(4, n, n), vertical_slash_mask(n, v_idx, s_idx, FILL_GAPS)[0],
             block_sparse_mask(n, blocks, 16)[0], torch.ones(n, n, dtype=torch.bool).tril().expand(4, n, n)]
    scored = torch.arange(n - 1, n - 1 - (n if rows is None else rows), -stride).flip(0)
    want = output_error_reference(q, k, v, masks, scored)
    assert err.dtype == torch.float64 and err.shape == (4, 4)
    torch.testing.assert_close(err[:, :3], want[:, :3], rtol=1e-6, atol=0)
    assert bool((want[:, :3] > 0.05).all())  # errors of a size the comparison means something at
    assert torch.equal(err[:, 3], torch.zeros(4, dtype=torch.float64))  # covering: exactly 0


def test_a_small_output_error_keeps_its_precision():
    """A candidate that misses one or three keys of a long row: its small error (2-5%) is measured to
    1e-6 of itself (3e-7 here), not to float32's precision of the two full outputs it would be the
    difference of (computed as ``O_c - O`` it is a few 1e-6 off)."""
    n = 2000
    q, k, v = qkv(n, d=64)
    cands = [AShape(sink=0, window=n - 1), AShape(sink=0, window=n - 3)]
    _, _, err = S.head_scores(q * 0.125, k, cands, v=v, rows=1)
    j = torch.arange(n)
    masks = [(j > 0).expand(4, n, n), (j > 2).expand(4, n, n)]
    want = output_error_reference(q * 0.125, k, v, masks, torch.tensor([n - 1]))
    assert bool((want < 0.05).all())  # 1.7-4.7%
    torch.testing.assert_close(err, want, rtol=1e-6, atol=0)


def test_output_error_sees_the_values():
    """Missed mass is not output error: keys whose values equal the kept ones' cost nothing, and a
    head whose dense output is 0 counts 0 (no NaN)."""
    n = 97
    q, k, _ = qkv(n)
    cands = [AShape(sink=2, window=8), BlockSparse(top_k=2, block=16), Dense()]
    same = torch.randn(2, 1, 16).expand(2, n, 16)  # every key of a kv head holds the same value
    mass, _, err = S.head_scores(q, k, cands, v=same)
    assert bool((mass[:, :2] < 0.9).all()) and float(err.max()) < 1e-6
    _, _, err = S.head_scores(q, k, cands, v=torch.zeros(2, n, 16))
    assert torch.equal(err, torch.zeros(4, 3, dtype=torch.float64))


def test_a_set_whose_kept_mass_underflows_counts_as_error_one():
    """Only the diagonal kept while key 0 takes all the float32 probability (300 nats above): the
    kept mass is exactly 0, the row counts as the kernels' empty-row output (O_c = 0), error 1."""
    n = 20
    q = torch.ones(2, n, 1)
    k = torch.zeros(1, n, 1)
    k[0, 0] = 300.0
    v = torch.randn(1, n, 4, generator=torch.Generator().manual_seed(3))
    _, _, err = S.head_scores(q, k, [AShape(sink=0, window=1)], v=v, scale=1.0, rows=n - 1)
    assert torch.equal(err, torch.ones(2, 1, dtype=torch.float64))


@pytest.mark.parametrize("n", [300, 1000])
def test_every_frontier_candidate_reads_the_diagonal(n):
    """So its kept mass is positive on every row (error 1 for a zero kept mass only by underflow)."""
    q, k = qk(n, d=32)
    kx = k.repeat_interleave(2, dim=0)
    rows = torch.arange(n)
    for p in S.frontier_candidates(n):
        m = S.pattern_mask(p, S.pattern_sets(p, q, kx, 32**-0.5), 4, n, rows, "cpu")
        assert bool(m[:, rows, rows].all()), p


def test_head_scores_checks_the_values_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="v must be"):
        S.head_scores(q, k, [Dense()], v=v[:1])


def test_last_rows_only():
    n = 97
    q, k = qk(n)
    probs = dense_attention_probs(q[None], k[None])[0]
    mass, _ = S.head_scores(q, k, [AShape(sink=2, window=8)], rows=10)
    want = (probs[:, -10:] * ashape_mask(n, 2, 8)[-10:]).sum(dim=(1, 2)) / 10
    assert torch.allclose(mass[:, 0], want, atol=1e-5)


@pytest.mark.parametrize("n, rho", [(4096, 0.3), (2048, 0.2), (1000, 0.5), (300, 0.9)])
def test_candidates_have_comparable_worst_case_cost(n, rho):
    cands = S.candidate_patterns(n, rho)
    kinds = [c.kind for c in cands]
    assert kinds == ["a_shape", "vertical_slash", "vertical_slash", "block_sparse"]
    budget = rho * S.causal_pairs(n)
    a = cands[0]
    a_pairs = int(ashape_mask(n, a.sink, a.window).sum())
    assert a_pairs <= budget < int(ashape_mask(n, a.sink, a.window + 1).sum())
    for vs in cands[1:3]:
        worst = vs.vertical * n + vs.slash * n - vs.slash * (vs.slash - 1) // 2
        assert worst <= budget
        assert worst + n > budget  # one more diagonal would not fit
    bs = cands[3]
    nb = -(-n // bs.block)
    full = torch.arange(nb)[None, :].expand(nb, nb).contiguous()
    worst_blocks = torch.where(full <= torch.arange(nb)[:, None], full, -1)
    # worst case for top_k: the top_k blocks nearest the diagonal, all full
    lo = (torch.arange(nb)[:, None] - bs.top_k + 1).clamp(min=0)
    keep = torch.where(full >= lo, worst_blocks, -1)
    assert int(block_sparse_mask(n, keep, bs.block).sum()) <= budget


def test_search_on_tiny_model_picks_patterns_and_writes_valid_config(tiny_llama):
    model, prompts = tiny_llama(160)
    res = S.search(model, prompts, target_density=0.4, min_mass=0.0, seed=7, progress=False)
    assert model.config._attn_implementation == "sdpa"  # the observer is gone again
    assert not any(hasattr(m, "minference_observer") for m in model.modules())
    assert res.mass.shape == (2, 4, 4)
    assert bool((res.mass <= 1 + 1e-6).all()) and bool((res.mass > 0).all())
    chosen = res.config.layers
    for l in range(2):
        for h in range(4):
            best = int(torch.argmax(res.mass[l, h]))
            assert chosen[l][h] == res.candidates[best]
            assert res.config.provenance.scores[l][h] == pytest.approx(float(res.mass[l, h, best]), abs=1e-6)
    validate_schema(res.config.to_dict())
    assert PatternConfig.from_dict(res.config.to_dict()).layers == chosen
    prov = res.config.provenance
    assert prov.seed == 7 and prov.calibration_lengths == [160] and prov.metric == "captured_mass"
    # a head that cannot reach min_mass stays dense
    strict = S.search(model, prompts[:1], target_density=0.05, min_mass=0.999, progress=False)
    assert all(isinstance(p, Dense) for row in strict.config.layers for p in row)


def test_row_stride_scores_the_sampled_rows():
    n = 97
    q, k = qk(n)
    probs = dense_attention_probs(q[None], k[None])[0]
    mass, dens = S.head_scores(q, k, [AShape(sink=2, window=8)], row_stride=3)
    rows = torch.arange(n - 1, -1, -3)
    m = ashape_mask(n, 2, 8)[rows]
    assert torch.allclose(mass[:, 0], (probs[:, rows] * m).sum(dim=(1, 2)) / rows.numel(), atol=1e-5)
    assert torch.allclose(dens[:, 0], m.sum().double() / (rows + 1).sum().double())


def test_plan_coverage_uses_each_heads_pattern():
    q, k = qk()
    plan = [AShape(sink=2, window=8), Dense(), AShape(sink=2, window=8), BlockSparse(top_k=2, block=16)]
    mass, dens = S.plan_coverage(q, k, plan)
    for h, p in enumerate(plan):
        m, d = S.head_scores(q[h : h + 1], k[h // 2 : h // 2 + 1], [p])
        assert float(mass[h]) == pytest.approx(float(m[0, 0])) and float(dens[h]) == pytest.approx(float(d[0, 0]))
    assert float(mass[1]) == pytest.approx(1.0) and float(dens[1]) == pytest.approx(1.0)


def test_default_candidates_choose_what_the_reference_builders_choose():
    """The dynamic candidates the search scores (default fields, GQA kv) pick the reference sets."""
    n = 160
    q, k = qk(n, seed=3)
    for p in S.candidate_patterns(n, 0.3, block=16):
        sets = S.pattern_sets(p, q, k.repeat_interleave(2, dim=0), q.shape[-1] ** -0.5)
        if isinstance(p, VerticalSlash):
            v_idx, s_idx = E.vertical_slash_index(q[None], k[None], p.vertical, p.slash, last_q=p.last_q,
                                                  sink_columns=p.sink_columns, local_diagonals=p.local_diagonals,
                                                  aggregation=p.aggregation)
            for h in range(q.shape[0]):
                assert set(torch.nonzero(sets[0][h]).flatten().tolist()) == {x for x in v_idx[0, h].tolist() if x >= 0}
                assert set(torch.nonzero(sets[1][h]).flatten().tolist()) == {x for x in s_idx[0, h].tolist() if x >= 0}
        elif isinstance(p, BlockSparse):
            ref = E.block_sparse_index(q[None], k[None], p.top_k, block=p.block, sink_blocks=p.sink_blocks,
                                       force_diagonal=p.force_diagonal)
            for h in range(q.shape[0]):
                for I in range(sets.shape[1]):
                    assert set(torch.nonzero(sets[h, I]).flatten().tolist()) == {x for x in ref[0, h, I].tolist()
                                                                                 if x >= 0}
        else:
            assert sets is None


def _touched_tiles(mask: torch.Tensor) -> torch.Tensor:
    """Brute force: 64 x 64 tiles of ``mask [H, n, n]`` holding a chosen pair, over the causal tiles."""
    H, n, _ = mask.shape
    nt = -(-n // S.COST_TILE)
    pad = torch.nn.functional.pad(mask, (0, nt * 64 - n, 0, nt * 64 - n))
    return pad.view(H, nt, 64, nt, 64).any(-1).any(2).sum((1, 2)).double() / (nt * (nt + 1) // 2)


def test_search_cli_candidate_options_reach_the_candidates():
    """``--vs-caps``, ``--bs-blocks`` and ``--bs-gammas`` become the frontier search's candidates
    (``main_job._candidates``): at 130K, the 19 default ones plus two vertical-slash caps (× 3 γ),
    block 64's relative set (4 α × 3 caps) and the mass rule at both blocks (3 caps each); the
    blocks ``--bs-blocks`` takes are the kernels' own."""
    from minference import kernels
    from minference.app import main_job
    from minference.app.cli import build_parser

    assert main_job.KERNEL_BLOCKS == kernels.BLOCK_SIZES
    args = build_parser().parse_args(["search", "--out", "c.json", "--candidates", "frontier", "--tokens", "130000",
                                      "--vs-caps", "2048/8192", "1024/4096", "512/2048", "--bs-blocks", "128", "64",
                                      "--bs-gammas", "0.9"])
    cands = main_job._candidates(args)
    assert len(S.frontier_candidates(130000)) == 19 and len(cands) == 19 + 6 + 12 + 6
    bs = [c for c in cands if isinstance(c, BlockSparse)]
    assert {(c.block, c.rule) for c in bs} == {(b, r) for b in (128, 64) for r in ("relative", "mass")}
    assert {c.threshold for c in bs if c.rule == "mass"} == {0.9}
    vs = [c for c in cands if isinstance(c, VerticalSlash)]
    assert {(c.vertical, c.slash) for c in vs} == {(2048, 8192), (1024, 4096), (512, 2048)}
    # --bs-blocks replaces the default block; without the options, the defaults
    only64 = main_job._candidates(build_parser().parse_args(["search", "--out", "c.json", "--candidates", "frontier",
                                                             "--tokens", "130000", "--bs-blocks", "64"]))
    assert {c.block for c in only64 if isinstance(c, BlockSparse)} == {64}
    plain = build_parser().parse_args(["search", "--out", "c.json", "--candidates", "frontier", "--tokens", "130000"])
    assert main_job._candidates(plain) == S.frontier_candidates(130000)
    # --bs-score-rows: one block-sparse set per scoring-row count, the full score (0) only if named
    rows = main_job._candidates(build_parser().parse_args(["search", "--out", "c.json", "--candidates", "frontier",
                                                           "--tokens", "130000", "--bs-score-rows", "0", "32"]))
    bs_rows = [c for c in rows if isinstance(c, BlockSparse)]
    assert len(rows) == 19 + 12 and {c.score_rows for c in bs_rows} == {0, 32}
    assert [c for c in bs_rows if c.score_rows == 0] == [c for c in S.frontier_candidates(130000)
                                                        if isinstance(c, BlockSparse)]


@pytest.mark.parametrize("n", [640, 1000])
@pytest.mark.parametrize("pattern", [AShape(sink=64, window=200), AShape(sink=10, window=1), AShape(sink=0, window=700),
                                     BlockSparse(top_k=4, block=64), BlockSparse(top_k=3, block=32), Dense()])
def test_tile_density_counts_the_tiles_the_mask_touches(n, pattern):
    q, k = qk(n)
    kx = k.repeat_interleave(2, dim=0)
    sets = S.pattern_sets(pattern, q, kx, 0.25)
    mask = S.pattern_mask(pattern, sets, 4, n, torch.arange(n), "cpu")
    if isinstance(pattern, BlockSparse) and pattern.block < 64:
        # 32-blocks: a tile is charged for the blocks' area, not touched as a whole
        area = S.tile_density(pattern, sets, 4, n, "cpu")
        assert torch.all(area <= _touched_tiles(mask) + 1e-12)
        return
    assert torch.allclose(S.tile_density(pattern, sets, 4, n, "cpu"), _touched_tiles(mask))


@pytest.mark.parametrize("offsets", [[0, 1, 2, 3, 63, 64, 65], [0, 200, 201, 202], [0], [0, 127, 128, 129, 511]])
def test_tile_density_of_slashes_counts_their_key_tiles(offsets):
    n = 640  # whole tiles: the count is exact (a partial last tile is over-charged by at most one tile)
    H = 1
    offs = torch.zeros(H, n, dtype=torch.bool)
    offs[:, offsets] = True
    cols = torch.zeros(H, n, dtype=torch.bool)
    p = VerticalSlash(vertical=0, slash=8, sink_columns=0, local_diagonals=1)
    mask = S.pattern_mask(p, (cols, offs), H, n, torch.arange(n), "cpu")
    assert torch.allclose(S.tile_density(p, (cols, offs), H, n, "cpu"), _touched_tiles(mask))
    # 64 chosen columns cost one tile in every query tile right of them
    cols[:, :64] = True
    extra = S.tile_density(p, (cols, offs), H, n, "cpu") - _touched_tiles(mask)
    assert extra.item() == pytest.approx(10 / (10 * 11 / 2))


def test_cheapest_selection_takes_the_least_costly_candidate_that_holds_on_the_worst_prompt(tiny_llama):
    model, prompts = tiny_llama(1024)
    cands = [AShape(sink=16, window=128), AShape(sink=16, window=512), BlockSparse(top_k=8, block=64), Dense()]
    res = S.search(model, prompts, candidates=cands, min_mass=0.5, select="cheapest", progress=False, row_stride=8)
    assert res.worst_mass.shape == res.cost.shape == (2, 4, 4)
    assert torch.all(res.worst_mass <= res.mass + 1e-12)
    assert torch.allclose(res.worst_mass[..., 3], torch.ones(2, 4, dtype=torch.float64))  # dense holds everything
    for l in range(2):
        for h in range(4):
            ok = [c for c in range(4) if res.worst_mass[l, h, c] >= 0.5]
            best = min(ok, key=lambda c: float(res.cost[l, h, c]))
            assert res.config.layers[l][h] == cands[best]
    chosen = {p for row in res.config.layers for p in row}
    assert chosen != {Dense()}  # the test must exercise a real choice
    with pytest.raises(ValueError, match="select"):
        S.search(model, prompts, candidates=cands, select="fastest", progress=False)
    # another min_mass from the same scores: what a search with it would choose, no model run
    for mass in (0.5, 0.9, 0.99):
        again = res.rechoose(mass)
        for l in range(2):
            for h in range(4):
                ok = [c for c in range(4) if res.worst_mass[l, h, c] >= mass]
                assert again.layers[l][h] == cands[min(ok, key=lambda c: float(res.cost[l, h, c]))]
        assert f"min_mass {mass}; selection cheapest" in again.provenance.notes
    assert res.rechoose(0.5).layers == res.config.layers
    with pytest.raises(ValueError, match="min_mass"):
        res.rechoose(1.5)


def test_search_cli_takes_several_min_masses(capsys, monkeypatch):
    """``--min-mass`` with several values writes one config per value from one search; ``--out``
    must then name them (checked before any model loads)."""
    from minference.app import models
    from minference.app.cli import build_parser, main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    args = build_parser().parse_args(["search", "--out", "c.json", "--min-mass", "0.9", "0.95"])
    assert args.min_mass == [0.9, 0.95]
    assert main(["search", "--out", "c.json", "--min-mass", "0.9", "0.95"]) == 2  # main_job._check_search
    assert "{min_mass}" in capsys.readouterr().err


def test_frontier_candidates():
    n = 120000
    cands = S.frontier_candidates(n)
    assert cands[-1] == Dense() and len(cands) == len(set(cands))
    kinds = [c.kind for c in cands]
    assert kinds.count("a_shape") == len(S.FRONTIER_ASHAPES)
    assert kinds.count("vertical_slash") == len(S.ADAPTIVE_GAMMAS)
    bs = [c for c in cands if isinstance(c, BlockSparse)]
    assert len(bs) == len(S.ADAPTIVE_ALPHAS) * len(S.FRONTIER_CAP_FRACTIONS)
    assert {c.top_k for c in bs} == {-(-int(f * n) // 128) for f in S.FRONTIER_CAP_FRACTIONS} == {30, 118, 469}
    assert all(c.rule == "relative" and c.estimate == "query" and S.is_adaptive(c) for c in bs)
    assert not S.is_adaptive(AShape()) and not S.is_adaptive(BlockSparse(top_k=4))
    # at a short length the caps collapse onto one candidate per threshold
    short = [c for c in S.frontier_candidates(300) if isinstance(c, BlockSparse)]
    assert len(short) == len(S.ADAPTIVE_ALPHAS) and {c.top_k for c in short} == {2}
    with pytest.raises(ValueError, match="cap fractions"):
        S.frontier_candidates(1000, cap_fractions=(0.0,))
    # smaller vertical-slash caps: one candidate per (threshold, cap), the adaptive cap by default
    assert S.parse_vs_caps(None) == S.FRONTIER_VS_CAPS == ((S.ADAPTIVE_MAX_VERTICAL, S.ADAPTIVE_MAX_SLASH),)
    caps = S.parse_vs_caps(["2048/8192", "512/2048"])
    vs = [c for c in S.frontier_candidates(n, vs_caps=caps) if isinstance(c, VerticalSlash)]
    assert [(c.vertical, c.slash, c.threshold) for c in vs] == [
        (v, sl, g) for g in S.ADAPTIVE_GAMMAS for v, sl in ((2048, 8192), (512, 2048))]
    assert all(c.rule == "mass" for c in vs)
    with pytest.raises(ValueError, match="at least one"):
        S.frontier_candidates(n, vs_caps=())
    for bad in ("512x2048", "0/2048", "512/", "1/2/3", "a/b"):
        with pytest.raises(ValueError, match=f"COLUMNS/DIAGONALS, two positive ints, got '{bad}'"):
            S.parse_vs_caps(["1024/4096", bad])
    # block-sparse at more routing blocks and under the mass rule: one candidate per (block, rule, cap)
    more = [c for c in S.frontier_candidates(n, blocks=(128, 64), bs_gammas=(0.9,)) if isinstance(c, BlockSparse)]
    per_block = (len(S.ADAPTIVE_ALPHAS) + 1) * len(S.FRONTIER_CAP_FRACTIONS)
    assert len(more) == 2 * per_block and all(c.estimate == "query" for c in more)
    assert {c.top_k for c in more if c.block == 64} == {-(-int(f * n) // 64) for f in S.FRONTIER_CAP_FRACTIONS}
    assert [(c.block, c.threshold, c.top_k) for c in more if c.rule == "mass"] == [
        (b, 0.9, -(-int(f * n) // b)) for b in (128, 64) for f in S.FRONTIER_CAP_FRACTIONS]
    assert more[:len(bs)] == bs  # block 128's relative candidates first, as by default
    with pytest.raises(ValueError, match="at least one block-sparse routing block"):
        S.frontier_candidates(n, blocks=())


def test_search_cli_checks_vs_caps_before_any_work(capsys, monkeypatch):
    """``--vs-caps``, ``--bs-blocks`` and ``--bs-gammas`` are refused in one line before any model
    loads: a malformed cap, a block or threshold the patterns refuse, or any of them without
    ``--candidates frontier`` (or with a saved search, which keeps its own candidates)."""
    from minference.app import models
    from minference.app.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    malformed = "argument --vs-caps: a vertical-slash cap is COLUMNS/DIAGONALS, two positive ints, got '512x2048'"
    frontier = ["--candidates", "frontier"]
    cases = [([*frontier, "--vs-caps", "512x2048"], malformed),
             (["--vs-caps", "512/2048"], "--vs-caps sets the candidates of a --candidates frontier search"),
             (["--bs-gammas", "0.9"], "--bs-gammas sets the candidates of a --candidates frontier search"),
             (["--bs-blocks", "64"], "--bs-blocks sets the candidates of a --candidates frontier search"),
             ([*frontier, "--bs-gammas", "1.5"], "the frontier candidates: BlockSparse.threshold must be finite and "
                                                   "in (0, 1], got 1.5"),
             ([*frontier, "--bs-blocks", "48"], "argument --bs-blocks: invalid choice: 48 (choose from 16, 32, 64, "
                                                  "128)"),
             (["--bs-score-rows", "32"], "--bs-score-rows sets the candidates of a --candidates frontier search"),
             ([*frontier, "--bs-score-rows", "-1"], "the frontier candidates: a block-sparse scoring row count must be "
                                                      "an int >= 0, got -1")]
    for extra, message in cases:
        try:
            rc = main(["search", "--out", "c.json", *extra])
        except SystemExit as exit_:  # argparse's own checks (--bs-blocks' choices) exit
            rc = exit_.code
        assert rc == 2
        err = capsys.readouterr().err
        assert err.startswith("minference search: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("n", [640, 1000])
@pytest.mark.parametrize("pattern", [
    BlockSparse(top_k=3, block=64, rule="relative", threshold=0.1, estimate="query", sink_blocks=1),
    BlockSparse(top_k=5, block=32, rule="relative", threshold=0.3, sink_blocks=0),
    VerticalSlash(vertical=40, slash=150, sink_columns=4, local_diagonals=8, rule="relative", threshold=0.1),
    VerticalSlash(vertical=70, slash=300, sink_columns=0, local_diagonals=1, rule="relative", threshold=0.5),
])
def test_flat_tiles_is_what_the_builders_pick_on_flat_scores(n, pattern):
    """On equal logits (zero queries) the relative rule keeps every candidate up to the cap, ties
    resolved to the lowest positions: the sets the builders choose cost exactly flat_tiles."""
    q = torch.zeros(2, n, 16)
    k = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(1))
    sets = S.pattern_sets(pattern, q, k, 0.25)
    got = S.tile_density(pattern, sets, 2, n, "cpu")
    assert torch.allclose(got, torch.full((2,), S.flat_tiles(pattern, n), dtype=torch.float64))
    if isinstance(pattern, BlockSparse):
        # a block head's cost is its block count: no input costs more than the flat one. (Not so for
        # vertical-slash: scattered offsets reach more tiles than the band; docs/search.md.)
        peaked = S.tile_density(pattern, S.pattern_sets(pattern, torch.randn(2, n, 16) * 4, k, 0.25), 2, n, "cpu")
        assert bool((peaked <= S.flat_tiles(pattern, n) + 1e-12).all())


def test_flat_tiles_of_static_patterns_and_caps():
    n = 1000
    assert S.flat_tiles(Dense(), n) == 1.0
    a = AShape(sink=64, window=200)
    assert S.flat_tiles(a, n) == float(S.tile_density(a, None, 1, n, "cpu")[0])
    caps = [S.flat_tiles(BlockSparse(top_k=k, block=64, rule="relative", threshold=0.1), n) for k in (1, 2, 4, 16)]
    assert caps == sorted(caps) and caps[-1] == 1.0  # 16 blocks of 64 cover 1000 tokens
    with pytest.raises(ValueError, match="n must"):
        S.flat_tiles(Dense(), 0)


def test_search_records_tiles_per_prompt(tiny_llama):
    model, prompts = tiny_llama(256)
    cands = [AShape(sink=8, window=64), BlockSparse(top_k=2, block=32, rule="relative", threshold=0.3), Dense()]
    res = S.search(model, prompts, candidates=cands, min_mass=0.5, select="cheapest", progress=False, row_stride=4)
    assert res.n_tokens == 256 and res.head_dim == 16
    assert res.tiles.shape == res.max_tiles.shape == (2, 4, 3)
    assert bool((res.max_tiles >= res.tiles - 1e-12).all())
    cost_ratio = torch.tensor([S.tile_cost(c.kind, 16) for c in cands], dtype=torch.float64)
    assert torch.allclose(res.cost, res.tiles * cost_ratio)
    assert torch.equal(res.tiles[..., 2], torch.ones(2, 4, dtype=torch.float64))
    # the output error: mean and largest over the prompts, 0 for Dense, the largest at least the mean
    assert res.out_error.shape == res.worst_out_error.shape == (2, 4, 3)
    assert torch.equal(res.out_error[..., 2], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.equal(res.worst_out_error[..., 2], torch.zeros(2, 4, dtype=torch.float64))
    assert bool((res.worst_out_error >= res.out_error - 1e-12).all()) and bool((res.out_error[..., :2] > 0).all())


def _search_args(*extra):
    from minference.app.cli import build_parser

    return build_parser().parse_args(["search", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--out", "c.json", "--frontier", "0.01"], "{budget}"),
    (["--out", "c_{budget}.json", "--frontier", "0.01", "1.5"], "in [0, 1]"),
    (["--out", "c_{budget}.json", "--frontier", "0.01", "--fixed-ms", "270"], "needs a calibrated --cost-table"),
    (["--out", "c_{budget}.json", "--frontier", "0.01", "--worst-ratio", "0.9"], "--worst-ratio"),
    (["--out", "c_{budget}.json", "--frontier", "0.01", "--cost-table", "/nonexistent.json"], "cannot read"),
])
def test_search_cli_frontier_arguments_are_checked_before_the_model_loads(capsys, monkeypatch, extra, message):
    from minference.app import models
    from minference.app.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["search", *extra]) == 2  # the CLI's checks, before any load
    assert message in capsys.readouterr().err


def test_search_cli_checks_the_cost_table_against_the_model_before_searching(tmp_path, capsys, monkeypatch, tiny_llama):
    import json

    from minference.app import models
    from minference.app.cli import main
    from minference.app.frontier import COST_TABLE_FORMAT

    table = {"format": COST_TABLE_FORMAT, "version": 1, "unit": "ms",
             "shape": {"n_tokens": 512, "head_dim": 64, "num_heads": 4, "num_kv_heads": 2},
             "attention": {k: {"intercept_ms": 0.0, "ms_per_tile": 1.0}
                           for k in ("dense", "a_shape", "vertical_slash", "block_sparse@128")},
             "index": {"vertical_slash:mass": {"ms": 1.0}, "block_sparse:query:relative@128": {"ms": 1.0}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    model, _ = tiny_llama(8)  # head dim 16, not the table's 64
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(S, "search", lambda *a, **k: pytest.fail("searched"))
    argv = ["search", "--out", str(tmp_path / "c_{budget}.json"), "--frontier", "0.01", "--tokens", "512",
            "--candidates", "frontier", "--cost-table", str(path)]
    assert main(argv) == 2  # the table's shape against the model's, after the load, before the search
    assert "head dim 64" in capsys.readouterr().err


def test_saved_measurements_make_the_same_configs_without_the_model(tmp_path, capsys, monkeypatch, tiny_llama):
    """``--save-measurements`` then ``--from-measurements``: the same family and min-mass configs as
    from the search itself, with no model loaded; a file that is not one is refused on one line."""
    import json

    from minference.app import frontier as F
    from minference.app import models
    from minference.app.cli import main

    model, prompts = tiny_llama(512)
    res = S.search(model, prompts, candidates=S.frontier_candidates(512, blocks=(64,)), select="cheapest",
                   min_mass=0.9, progress=False, row_stride=8)
    path = tmp_path / "m.json"
    res.save(path)
    back = S.SearchResult.load(path)
    for name in ("mass", "density", "worst_mass", "cost", "tiles", "max_tiles", "out_error", "worst_out_error"):
        assert torch.equal(getattr(back, name), getattr(res, name).float()), name
    assert back.candidates == res.candidates and back.config.to_dict() == res.config.to_dict()
    assert (back.n_tokens, back.head_dim, back.select, back.min_mass) == (512, res.head_dim, "cheapest", 0.9)
    assert back.rechoose(0.8).layers == res.rechoose(0.8).layers
    packed = tmp_path / "m.json.gz"  # a name ending in .gz: gzip-compressed both ways
    res.save(packed)
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and S.SearchResult.load(packed).to_dict() == back.to_dict()
    (tmp_path / "plain.gz").write_text("{}")
    with pytest.raises(ValueError, match="not gzip-compressed JSON"):
        S.SearchResult.load(tmp_path / "plain.gz")

    direct, _ = F.write_family(res, [0.05], str(tmp_path / "a_{budget}.json"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("loaded a tokenizer"))
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "b_{budget}.json"),
                 "--frontier", "0.05"]) == 0
    assert load_config(tmp_path / "b_0.05.json").layers == direct[0].config.layers
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "r_{min_mass}.json"),
                 "--min-mass", "0.8", "0.95"]) == 0
    assert load_config(tmp_path / "r_0.8.json").layers == res.rechoose(0.8).layers
    capsys.readouterr()

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    assert main(["search", "--from-measurements", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "not a search measurements file" in capsys.readouterr().err
    assert main(["search", "--from-measurements", str(path), "--save-measurements", str(bad),
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "drop --save-measurements" in capsys.readouterr().err
    data = res.to_dict()
    data["tiles"] = data["tiles"][:-1]  # a layer short
    with pytest.raises(ValueError, match="'tiles' has shape"):
        S.SearchResult.from_dict(data)
    with pytest.raises(ValueError, match="lack 'config', 'mass'"):
        S.SearchResult.from_dict({k: v for k, v in res.to_dict().items() if k not in ("config", "mass")})
    with pytest.raises(ValueError, match="a candidate: unknown pattern kind"):
        S.SearchResult.from_dict({**res.to_dict(), "candidates": [{"kind": "nosuch"}]})


def test_measurements_without_the_output_error_load_and_the_output_proxy_needs_it(tmp_path, capsys, monkeypatch,
                                                                                  tiny_llama):
    """Files written before the output error (version 1, no such fields) still load, with ``None``;
    ``--proxy output`` makes a family from measurements that have it and refuses, on one line,
    those that do not; ``--proxy`` without ``--frontier`` is refused."""
    import json

    from minference.app import frontier as F
    from minference.app import models
    from minference.app.cli import main

    model, prompts = tiny_llama(256)
    res = S.search(model, prompts, candidates=S.frontier_candidates(256, blocks=(64,)), select="cheapest",
                   min_mass=0.9, progress=False, row_stride=8)
    old = {k: v for k, v in res.to_dict().items() if k not in ("out_error", "worst_out_error")}
    assert old["version"] == 1
    before = S.SearchResult.from_dict(old)
    assert before.out_error is None and before.worst_out_error is None
    assert before.to_dict()["out_error"] is None  # written back as null, read back as None
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert S.SearchResult.load(tmp_path / "old.json").to_dict() == before.to_dict()
    path = tmp_path / "m.json"
    res.save(path)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))

    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "o_{budget}.json"),
                 "--frontier", "0.05", "--proxy", "output"]) == 0
    direct, summary = F.write_family(S.SearchResult.load(path), [0.05], str(tmp_path / "d_{budget}.json"),
                                     proxy="output")
    config = load_config(tmp_path / "o_0.05.json")
    assert config.layers == direct[0].config.layers
    assert "error proxy output" in config.provenance.notes and "mean relative output error" in config.provenance.notes
    assert json.loads((tmp_path / "o_frontier.json").read_text())["proxy"] == "output" == summary["proxy"]
    assert "error proxy output" in (tmp_path / "o_frontier.md").read_text()
    capsys.readouterr()

    argv = ["search", "--from-measurements", str(tmp_path / "old.json"), "--out", str(tmp_path / "x_{budget}.json"),
            "--frontier", "0.05"]
    assert main([*argv, "--proxy", "output"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "old.json" in err and "output error" in err
    assert not list(tmp_path.glob("x_*"))
    assert main(argv) == 0  # the mass proxy reads it as before
    capsys.readouterr()
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "y.json"), "--min-mass", "0.8",
                 "--proxy", "output"]) == 2
    assert "needs --frontier" in capsys.readouterr().err
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "y.json"), "--min-mass", "0.8",
                 "--head-floor", "0.9"]) == 2
    assert "needs --frontier" in capsys.readouterr().err
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "z_{budget}.json"),
                 "--frontier", "0.05", "--head-floor", "1.5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--head-floor" in err and not list(tmp_path.glob("z_*"))
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "f_{budget}.json"),
                 "--frontier", "0.05", "--head-floor", "0.9"]) == 0
    assert "head floor 0.9" in load_config(tmp_path / "f_0.05.json").provenance.notes
    assert json.loads((tmp_path / "f_frontier.json").read_text())["floor"] == 0.9


# ---- the selection rule follows the candidates; damaged measurement files (review of session 22) ----


def _dense_choice_result(select="best_mass", with_dense=True) -> S.SearchResult:
    """One layer, two heads; the candidates' masses all below Dense's 1, so best_mass over them picks
    Dense everywhere, while cheapest picks the cheap A-shape where its worst prompt holds."""
    from minference.config import ModelSignature, Provenance

    cands = [AShape(sink=4, window=64), AShape(sink=4, window=256)] + ([Dense()] if with_dense else [])
    t = lambda rows: torch.tensor([[r[: len(cands)] for r in rows]], dtype=torch.float64)  # noqa: E731
    sig = ModelSignature("tiny", "llama", 1, 2, 1, 16)
    res = S.SearchResult(PatternConfig(sig, [[Dense(), Dense()]], Provenance(
                             source="search", notes=f"1 prompt(s); min_mass 0.9; selection {select}")),
                         cands, mass=t([[0.95, 0.97, 1.0], [0.5, 0.93, 1.0]]),
                         density=t([[0.1, 0.3, 1.0], [0.1, 0.3, 1.0]]),
                         worst_mass=t([[0.92, 0.96, 1.0], [0.4, 0.91, 1.0]]),
                         cost=t([[0.1, 0.3, 1.0], [0.1, 0.3, 1.0]]), select=select, min_mass=0.9,
                         tiles=t([[0.1, 0.3, 1.0], [0.1, 0.3, 1.0]]), max_tiles=t([[0.1, 0.3, 1.0], [0.1, 0.3, 1.0]]),
                         n_tokens=1000, head_dim=16)
    res.config = res.rechoose(0.9)  # what that search saved
    return res


def test_the_selection_rule_follows_the_candidates(monkeypatch, capsys, tiny_llama):
    """Before: --select defaulted to best_mass whatever --candidates said: over the frontier
    candidates (Dense among them, mass 1) every head came out dense, over the adaptive ones each
    took its widest budget."""
    from minference.app import models
    from minference.app.cli import build_parser, check_arguments, main

    assert S.default_selection(S.candidate_patterns(512)) == "best_mass"
    assert S.default_selection(S.adaptive_candidates()) == "cheapest"
    assert S.default_selection(S.frontier_candidates(512)) == "cheapest"
    assert S.default_selection([AShape(), Dense()]) == "cheapest"
    model, prompts = tiny_llama(256)
    res = S.search(model, prompts, candidates=S.frontier_candidates(256, blocks=(64,)), min_mass=0.5, progress=False,
                   row_stride=8)
    assert res.select == "cheapest" and "selection cheapest" in res.config.provenance.notes
    assert res.config.layers == res.rechoose(0.5, "cheapest").layers

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("loaded a tokenizer"))
    parser = build_parser()
    for extra, want in (([], "best_mass"), (["--candidates", "budgeted"], "best_mass"),
                        (["--candidates", "adaptive"], "cheapest"), (["--candidates", "frontier"], "cheapest"),
                        (["--candidates", "adaptive", "--select", "best_mass"], "best_mass"),
                        (["--candidates", "budgeted", "--select", "cheapest"], "cheapest"),
                        (["--candidates", "frontier", "--select", "best_mass", "--frontier", "0.05"], "best_mass")):
        args = parser.parse_args(["search", "--out", "c_{budget}.json", *extra])
        check_arguments(parser, args)
        assert args.select == want, extra
    capsys.readouterr()
    assert main(["search", "--out", "c.json", "--candidates", "frontier", "--select", "best_mass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--select best_mass with --candidates frontier picks Dense for every head" in err


def test_from_measurements_takes_select_and_never_keeps_best_mass_over_dense(tmp_path, capsys, monkeypatch):
    """Before: --from-measurements --min-mass rechose with the saved selection, --select was ignored,
    and a frontier search saved with best_mass (the old default) gave all-dense configs (335 of
    336 heads for benchmarks/results/h100_s22_qwen15_measurements_130k.json.gz)."""
    from minference.app import models
    from minference.app.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    saved = _dense_choice_result("best_mass")
    assert all(p == Dense() for row in saved.config.layers for p in row)  # what the old default saved
    path = tmp_path / "m.json"
    saved.save(path)
    cheapest = saved.rechoose(0.9, "cheapest")
    assert cheapest.layers == [[AShape(sink=4, window=64), AShape(sink=4, window=256)]]

    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "a_{min_mass}.json"),
                 "--min-mass", "0.9"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note:" in err and "saved with select best_mass" in err and "cheapest" in err
    assert load_config(tmp_path / "a_0.9.json").layers == cheapest.layers
    assert "selection cheapest" in load_config(tmp_path / "a_0.9.json").provenance.notes
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "b.json")]) == 0  # no --min-mass
    assert load_config(tmp_path / "b.json").layers == cheapest.layers
    capsys.readouterr()
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "c.json"), "--min-mass", "0.9",
                 "--select", "best_mass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "picks Dense for every head" in err and not (tmp_path / "c.json").exists()

    # without Dense among the candidates: the saved selection stays, an explicit --select is used
    plain = _dense_choice_result("best_mass", with_dense=False)
    path = tmp_path / "p.json"
    plain.save(path)
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "d.json"),
                 "--min-mass", "0.9"]) == 0
    assert load_config(tmp_path / "d.json").layers == plain.rechoose(0.9, "best_mass").layers
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "e.json"), "--min-mass", "0.9",
                 "--select", "cheapest"]) == 0
    assert load_config(tmp_path / "e.json").layers == plain.rechoose(0.9, "cheapest").layers
    assert plain.rechoose(0.9, "cheapest").layers != plain.rechoose(0.9, "best_mass").layers
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "f.json"),
                 "--select", "cheapest"]) == 0  # the saved min_mass, the asked selection
    assert load_config(tmp_path / "f.json").layers == plain.rechoose(0.9, "cheapest").layers
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("field, value, message", [
    ("min_mass", [1], "'min_mass' must be a number in [0, 1], got a list"),
    ("min_mass", "x", "'min_mass' must be a number in [0, 1], got 'x'"),
    ("min_mass", 1.5, "'min_mass' must be a number in [0, 1]"),
    ("candidates", [1, 2, 3], "'candidates' must be a list of pattern objects, got 1"),
    ("candidates", {"a": 1}, "'candidates' must be a list of pattern objects, got a dict"),
    ("candidates", "abc", "'candidates' must be a list of pattern objects, got 'abc'"),
    ("config", [1], "'config' must be a PatternConfig object, got a list"),
    ("config", "x", "'config' must be a PatternConfig object, got 'x'"),
    ("mass", {"a": 1}, "'mass' must be a [layers, heads, candidates] list of numbers, got a dict"),
    ("mass", 3, "'mass' must be a [layers, heads, candidates] list of numbers, got 3"),
    ("mass", [[[0.5, None, 1.0], [0.5, 0.9, 1.0]]], "measurement 'mass' is not a [layers, heads, candidates] list"),
    ("mass", [[[0.5, "x", 1.0], [0.5, 0.9, 1.0]]], "measurement 'mass' is not a [layers, heads, candidates] list"),
    ("cost", [[[0.5, float("nan"), 1.0], [0.5, 0.9, 1.0]]], "measurement 'cost' holds a non-finite value"),
    ("n_tokens", "x", "'n_tokens' must be a positive int or null, got 'x'"),
    ("n_tokens", 256.5, "'n_tokens' must be a positive int or null, got 256.5"),
    ("n_tokens", 0, "'n_tokens' must be a positive int or null, got 0"),
    ("head_dim", "x", "'head_dim' must be a positive int or null, got 'x'"),
    ("head_dim", True, "'head_dim' must be a positive int or null, got True"),
    ("select", "zzz", "'select' must be one of best_mass, cheapest, got 'zzz'"),
    ("select", 3, "'select' must be one of best_mass, cheapest, got 3"),
])
def test_a_damaged_measurements_file_is_refused_naming_the_field(tmp_path, capsys, field, value, message):
    """Before: TypeError tracebacks (wrong field types), or bad n_tokens / head_dim / select reaching
    the frontier code (a config written from a select of 3)."""
    import json

    from minference.app.cli import main

    data = _dense_choice_result("cheapest").to_dict()
    data[field] = value
    with pytest.raises(ValueError) as err:
        S.SearchResult.from_dict(data)
    assert message in str(err.value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))  # NaN is written as JSON's NaN, which json.loads reads back
    for extra in (["--min-mass", "0.8", "--out", str(tmp_path / "o.json")],
                  ["--frontier", "0.05", "--out", str(tmp_path / "o_{budget}.json")]):
        assert main(["search", "--from-measurements", str(path), *extra]) == 2
        err_text = capsys.readouterr().err
        assert err_text.count("\n") == 1 and str(path) in err_text and message in err_text, err_text
    assert not list(tmp_path.glob("o*"))


def test_a_corrupt_compressed_measurements_file_is_refused_on_one_line(tmp_path, capsys):
    """Before: zlib.error (a damaged deflate stream) ended in a traceback."""
    from minference.app.cli import main

    path = tmp_path / "m.json.gz"
    _dense_choice_result("cheapest").save(path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = b"\xff" * 8  # inside the deflate stream
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not gzip-compressed JSON"):
        S.SearchResult.load(path)
    assert main(["search", "--from-measurements", str(path), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "m.json.gz: not gzip-compressed JSON" in err
