"""The quality guard (minference.guard, docs/guard.md): checked rows, captured mass and output
error against a float64 reference, observe / enforce on a planted needle, no alarm where the
config covers the input, the sampling rate, the per-call records (JSON lines), flagging, the
config's runtime settings, and nothing added to an unchecked call."""

from __future__ import annotations

import io
import json
import logging
import math

import pytest
import torch
from minference.reference import masks as M
from minference.reference.attention import dense_attention_probs
from torch.utils._python_dispatch import TorchDispatchMode

import minference.integration as integ
from minference import dispatch
from minference import guard as guard_module
from minference.config import (
    ConfigError,
    GuardSettings,
    PatternConfig,
    Provenance,
    RuntimeSettings,
    load_config,
    model_signature,
)
from minference.dispatch import sparse_prefill
from minference.guard import LOGGER_NAME, QualityGuard, _GroupSets, check_positions, format_summary, shadow_rows
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing.ops import RecordOps
from minference.testing.strategies import AttnShape, qkv
from tests.unit.library.cases import MIXED_PLAN

#: The dispatcher tests' plan with its last block-sparse head routed by query-aware scores.
PLAN = [*MIXED_PLAN[:-1], BlockSparse(top_k=4, block=16, sink_blocks=2, estimate="query")]
BACKENDS = [pytest.param("triton", marks=pytest.mark.interpret), "torch"]


# ---- the definitions the guard is checked against --------------------------------------------


def expected_positions(n: int, c: int, tail_rows: int, spread_rows: int, dense_tail: int) -> list[int]:
    """The checked rows of one batch row (docs/guard.md), written out: the last ``tail_rows`` rows
    the pattern computes and ``spread_rows`` evenly spread points before them."""
    q_lo, hi = n - c, n - min(dense_tail, c)
    tail = [i for i in range(hi - tail_rows, hi) if i >= q_lo]
    spread_hi = max(hi - tail_rows, q_lo)
    m = spread_hi - q_lo
    spread = []
    for k in range(spread_rows):
        x = (k + 1) * m // (spread_rows + 1)
        if x < m and (not spread or q_lo + x != spread[-1]):
            spread.append(q_lo + x)
    return spread + tail


class Spy:
    """Wraps a guard's layer checks to keep the index each group handed over."""

    def __init__(self, guard: QualityGuard):
        self.guard, self.indices = guard, {}

    def check(self, layer: int = 0):
        shadow = self.guard.layer_check(layer)
        if shadow is not None:
            add = shadow.add_index

            def spy(dg, **index):
                self.indices[dg.group.heads] = (dg, index)
                add(dg, **index)

            shadow.add_index = spy
        return shadow


def reference_masks(plan, indices: dict, Hq: int, B: int, N: int, fill_gaps: int) -> torch.Tensor:
    """``[B, Hq, N, N]`` bool: each head's key sets from the definitions of
    :mod:`minference.reference.masks` on the index the dispatcher built."""
    out = torch.zeros(B, Hq, N, N, dtype=torch.bool)
    for heads, (dg, index) in indices.items():
        for col, h in enumerate(heads):
            for b in range(B):
                if dg.group.kind == "vertical_slash":
                    m = M.vertical_slash_mask(N, index["vertical"][b, col].cpu(), index["slash"][b, col].cpu(),
                                              fill_gaps)
                    if index["dense"] is not None and bool(index["dense"][b, col]):
                        m = M.causal_mask(N)
                else:
                    m = M.block_sparse_mask(N, index["blocks"][b, col].cpu(), dg.group.key[0])
                out[b, h] = m
    for h, p in enumerate(plan[:Hq]):
        if isinstance(p, AShape):
            out[:, h] = M.ashape_mask(N, p.sink, p.window)
        elif isinstance(p, Dense):
            out[:, h] = M.causal_mask(N)
    return out


def reference_stats(q, k, v, out, masks, rows: list[list[int]], *, seqlens=None, seqstarts=None, q_first=0):
    """Float64 per batch row and head (``[B][Hq]`` lists): mean and least captured mass over that
    batch row's checked rows, and ``‖out − dense‖ / ‖dense‖`` over them (``out`` row of logical
    position ``i``: ``starts + i - q_first``)."""
    B, Hq, N, G = k.shape[0], q.shape[1], k.shape[2], q.shape[1] // k.shape[1]
    full_q = q if q.shape[2] == N else torch.cat([torch.zeros(B, Hq, N - q.shape[2], q.shape[3]), q], dim=2)
    probs = dense_attention_probs(full_q.double(), k.double(), seqlens=seqlens, seqstarts=seqstarts)
    starts = [0] * B if seqstarts is None else [int(s) for s in seqstarts]
    mean, low, error = [], [], []
    for b in range(B):
        vb = v[b].double()
        masses = [[] for _ in range(Hq)]
        err, ref = [0.0] * Hq, [0.0] * Hq
        for h in range(Hq):
            for i in rows[b]:
                p = probs[b, h, i]  # [N] logical keys
                masses[h].append(float((p * masks[b, h, i]).sum()))
                dense = p[:i + 1] @ vb[h // G, starts[b]:starts[b] + i + 1]
                o = out[b, h, starts[b] + i - q_first].double()
                err[h] += float((o - dense).square().sum())
                ref[h] += float(dense.square().sum())
        mean.append([sum(m) / len(m) for m in masses])
        low.append([min(m) for m in masses])
        error.append([math.sqrt(e / r) for e, r in zip(err, ref)])
    return mean, low, error


def assert_layer_matches(layer: dict, mean, low, error, *, mass_abs: float = 2e-5, error_rel: float = 1e-3,
                         error_abs: float = 1e-5) -> None:
    """A layer record against :func:`reference_stats`: per batch row, and per head over the rows
    (the lowest row mean, the lowest row, the largest row error)."""
    for b in range(len(mean)):
        assert layer["row_mass"][b] == pytest.approx(mean[b], abs=mass_abs)
        assert layer["row_error"][b] == pytest.approx(error[b], rel=error_rel, abs=error_abs)
    assert layer["mass"] == pytest.approx([min(col) for col in zip(*mean)], abs=mass_abs)
    assert layer["mass_min"] == pytest.approx([min(col) for col in zip(*low)], abs=mass_abs)
    assert layer["error"] == pytest.approx([max(col) for col in zip(*error)], rel=error_rel, abs=error_abs)


def _settings(**kw) -> GuardSettings:
    return GuardSettings(**{"mode": "observe", "sample_rate": 1.0, "tail_rows": 5, "spread_rows": 7, **kw})


# ---- checked rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("lens, q_lens, tail, spread, dense_tail", [
    ([160, 97, 12, 0, 3], None, 5, 7, 0),
    ([160, 97, 12, 0, 3], None, 5, 7, 20),  # the dense tail's rows are never checked
    ([160, 97, 12, 40], [64, 97, 5, 40], 4, 9, 8),  # query rows (chunks after a cache)
    ([50, 50], None, 0, 60, 0),  # more spread rows than rows: every row once
    ([50, 9], None, 16, 0, 0),
])
def test_checked_rows_are_the_definition(lens, q_lens, tail, spread, dense_tail) -> None:
    n = torch.tensor(lens, dtype=torch.int32)
    c = n if q_lens is None else torch.tensor(q_lens, dtype=torch.int32)
    N = max(lens)
    pos = check_positions(n, c, tail_rows=tail, spread_rows=spread, dense_tail=dense_tail, N=N, bound=N)
    for b in range(len(lens)):
        got = [int(x) for x in pos[b] if x >= 0]
        assert got == expected_positions(lens[b], int(c[b]), tail, spread, dense_tail)
        assert all(0 <= i < lens[b] - min(dense_tail, int(c[b])) for i in got)


# ---- mass and error against float64 ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ragged", [False, True])
def test_mass_and_error_equal_a_float64_reference(backend, ragged) -> None:
    """The guard's per-head mean and least mass and relative error of the checked rows equal a
    float64 computation from the reference masks on the index the call built, for every kind, GQA,
    ragged rows (NaN padding), gap filling and a dense tail."""
    B, Hq, Hkv, N, D = 2, 9, 3, 160, 16
    q, k, v = qkv(AttnShape(B=B, Hq=Hq, Hkv=Hkv, N=N, D=D), torch.float32, "cpu", seed=3, sharpness=3.0)
    rows = dict(seqlens=torch.tensor([N, 117], dtype=torch.int32), seqstarts=torch.tensor([0, 29], dtype=torch.int32)) \
        if ragged else {}
    if ragged:
        for x in (q, k, v):
            x[1, :, :29] = float("nan")
            x[1, :, 29 + 117:] = float("nan")
    lens = [N, 117] if ragged else [N, N]
    s = _settings()
    spy = Spy(QualityGuard(s))
    records = []
    spy.guard.on_record = records.append
    with spy.guard.call("p"):
        out = sparse_prefill(q, k, v, PLAN, dense_threshold=0, backend=backend, fill_gaps=7, dense_tail=6,
                             validate=False, shadow=spy.check(), **rows)
    (layer,) = records[0]["layers"]
    masks = reference_masks(PLAN, spy.indices, Hq, B, N, 7)
    checked = [expected_positions(n, n, s.tail_rows, s.spread_rows, 6) for n in lens]
    assert layer["rows"] == [len(r) for r in checked]
    mean, low, error = reference_stats(q, k, v, out, masks, checked, **rows)
    assert_layer_matches(layer, mean, low, error)
    assert layer["mass"][4] == pytest.approx(1.0) and layer["error"][4] < 1e-5  # the dense head
    assert min(layer["mass"]) < 0.9  # the plan is really sparse on these inputs


def test_row_chunks_and_key_blocks_keep_the_float64_result(monkeypatch) -> None:
    """A chunk budget small enough for several row chunks and key blocks (the online softmax over
    key blocks, ragged rows with NaN padding gathered per block) gives the float64 reference's
    statistics, as the one-block computation does."""
    B, Hq, Hkv, N, D = 2, 9, 3, 160, 16
    q, k, v = qkv(AttnShape(B=B, Hq=Hq, Hkv=Hkv, N=N, D=D), torch.float32, "cpu", seed=3, sharpness=3.0)
    rows = dict(seqlens=torch.tensor([N, 117], dtype=torch.int32), seqstarts=torch.tensor([0, 29], dtype=torch.int32))
    for x in (q, k, v):
        x[1, :, :29] = float("nan")
        x[1, :, 29 + 117:] = float("nan")
    monkeypatch.setattr(guard_module, "SHADOW_CHUNK_ELEMENTS", 3 * B * Hq * N)  # 3 rows a chunk, 26 keys a block
    spy = Spy(QualityGuard(_settings()))
    records = []
    spy.guard.on_record = records.append
    with spy.guard.call("p"):
        out = sparse_prefill(q, k, v, PLAN, dense_threshold=0, backend="torch", fill_gaps=7, dense_tail=6,
                             validate=False, shadow=spy.check(), **rows)
    (layer,) = records[0]["layers"]
    masks = reference_masks(PLAN, spy.indices, Hq, B, N, 7)
    checked = [expected_positions(n, n, 5, 7, 6) for n in (N, 117)]
    assert_layer_matches(layer, *reference_stats(q, k, v, out, masks, checked, **rows))


class _LargestFloat(TorchDispatchMode):
    """Records the largest float32 tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                self.largest = max(self.largest, x.numel())
        return result


@pytest.mark.parametrize("ragged", [False, True])
def test_the_shadow_computation_never_upcasts_whole_keys(ragged) -> None:
    """The shadow computation's float32 tensors stay within its chunk budget: k and v are upcast
    one key block at a time (bfloat16 inputs whose whole k of one kv head, ``N * D`` float32,
    is 16 times the budget)."""
    B, Hq, Hkv, N, D, budget = 1, 4, 2, 4096, 64, 1 << 14
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv))
    out = torch.randn_like(q)
    lens, starts = torch.tensor([N], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    pos = check_positions(lens, lens, tail_rows=4, spread_rows=4, dense_tail=0, N=N, bound=N)
    groups = [_GroupSets("a_shape", torch.arange(Hq), sink=torch.full((Hq,), 4), window=torch.full((Hq,), 256))]
    kw = dict(scale=D ** -0.5, lens=lens, starts=starts, q_lens=lens, q_starts=starts, ragged=ragged, fill_gaps=0)
    with _LargestFloat() as seen:
        mass, err2, ref2 = shadow_rows(q, k, v, out, pos, groups, chunk_elements=budget, **kw)
    assert seen.largest <= budget < N * D
    whole = shadow_rows(q, k, v, out, pos, groups, chunk_elements=1 << 30, **kw)  # one block
    for got, want in zip((mass, err2, ref2), whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.interpret
def test_heads_the_converter_made_dense_count_every_key() -> None:
    """``dense_over`` (Triton): a vertical-slash head the converter replaced by dense attention
    captures all its mass and matches dense; the guard reads the converter's flags."""
    q, k, v = qkv(AttnShape(B=1, Hq=9, Hkv=3, N=160, D=16), torch.float32, "cpu", seed=4, sharpness=3.0)
    spy = Spy(QualityGuard(_settings()))
    records = []
    spy.guard.on_record = records.append
    with spy.guard.call():
        out = sparse_prefill(q, k, v, PLAN, dense_threshold=0, backend="triton", dense_over=0.0, validate=False,
                             shadow=spy.check())
    (layer,) = records[0]["layers"]
    masks = reference_masks(PLAN, spy.indices, 9, 1, 160, dispatch.FILL_GAPS)
    checked = [expected_positions(160, 160, 5, 7, 0)]
    for h in (0, 3, 5):  # the vertical-slash heads
        assert layer["mass"][h] == pytest.approx(1.0, abs=1e-5) and layer["error"][h] < 1e-4
    assert_layer_matches(layer, *reference_stats(q, k, v, out, masks, checked))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunk_after_a_cache_is_checked_on_its_own_rows(backend) -> None:
    """Query rows (q holds the last 96 of 160 positions): the checked rows lie in the chunk and
    their mass is measured against every key of the prompt."""
    N, C = 160, 96
    q_full, k, v = qkv(AttnShape(B=1, Hq=9, Hkv=3, N=N, D=16), torch.float32, "cpu", seed=5, sharpness=3.0)
    q = q_full[:, :, N - C:]
    spy = Spy(QualityGuard(_settings()))
    records = []
    spy.guard.on_record = records.append
    with spy.guard.call():
        out = sparse_prefill(q, k, v, PLAN, dense_threshold=0, backend=backend, validate=False, shadow=spy.check())
    (layer,) = records[0]["layers"]
    masks = reference_masks(PLAN, spy.indices, 9, 1, N, dispatch.FILL_GAPS)
    checked = [expected_positions(N, C, 5, 7, 0)]
    assert min(checked[0]) >= N - C
    assert_layer_matches(layer, *reference_stats(q, k, v, out, masks, checked, q_first=N - C))


# ---- the policy on a planted needle ----------------------------------------------------------

NEEDLE_AT = 60


def needle_case(needle: bool = True, N: int = 256, seed: int = 0):
    """Local attention (q and k share smooth positional features: every row reads its last few
    keys) in 4 heads over 2 kv heads; with ``needle``, kv head 0 holds a key at NEEDLE_AT that the
    rows from 200 on (queries of heads 0 and 1) attend to almost wholly."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(N, dtype=torch.float64)
    freqs = torch.logspace(math.log10(0.03), math.log10(1.5), 12, dtype=torch.float64)
    feats = torch.cat([torch.cos(pos[:, None] * freqs), torch.sin(pos[:, None] * freqs)], dim=1)  # [N, 24]
    D = 32
    k = torch.zeros(1, 2, N, D, dtype=torch.float64)
    k[..., :24] = feats
    k[..., 24:] = 0.1 * torch.randn(1, 2, N, 8, generator=g, dtype=torch.float64)
    q = torch.zeros(1, 4, N, D, dtype=torch.float64)
    q[..., :24] = 10.0 * feats
    v = torch.randn(1, 2, N, D, generator=g, dtype=torch.float64)
    if needle:
        k[0, 0, NEEDLE_AT, 24:] = 4.0
        q[0, :2, 200:, 24:] = 4.0
    return q.float(), k.float(), v.float()


NEEDLE_PLAN = [AShape(sink=2, window=32)] * 4


def _run(q, k, v, guard: QualityGuard | None, backend: str = "torch"):
    if guard is None:
        return sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0, backend=backend, validate=False)
    with guard.call():
        return sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0, backend=backend, validate=False,
                              shadow=guard.layer_check(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_observe_reports_a_missed_needle_and_changes_nothing(backend) -> None:
    q, k, v = needle_case()
    records = []
    guard = QualityGuard(_settings(min_mass=0.8, tail_rows=8, spread_rows=8), on_record=records.append)
    out = _run(q, k, v, guard, backend)
    assert torch.equal(out, _run(q, k, v, None, backend))
    (layer,) = records[0]["layers"]
    assert layer["below"] == [0, 1] and layer["fallback"] == []  # the needle's heads, and only them
    assert max(layer["mass"][:2]) < 0.8 < min(layer["mass"][2:])
    assert guard.below_floor == 2 and guard.fallbacks == 0 and guard.calls_below_floor == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_enforce_recomputes_the_heads_below_the_floor_densely(backend) -> None:
    q, k, v = needle_case()
    records = []
    guard = QualityGuard(_settings(mode="enforce", min_mass=0.8, tail_rows=8, spread_rows=8), on_record=records.append)
    out = _run(q, k, v, guard, backend)
    plain = _run(q, k, v, None, backend)
    dense = dispatch.dense_prefill(q, k, v)
    (layer,) = records[0]["layers"]
    assert layer["fallback"] == [0, 1] and guard.fallbacks == 2
    torch.testing.assert_close(out[:, :2], dense[:, :2], atol=2e-5, rtol=1e-5)  # the needle is read again
    assert torch.equal(out[:, 2:], plain[:, 2:])  # the heads above the floor keep their sparse output
    assert (plain[:, :2, 200:] - dense[:, :2, 200:]).abs().max() > 0.1  # sparse really missed it


def _batch(bad_row: int, B: int):
    """``B`` batch rows of the needle case, the needle (missed by heads 0 and 1) in ``bad_row`` only."""
    bad, good = needle_case(True), needle_case(False)
    return tuple(torch.cat([bad[i] if b == bad_row else good[i] for b in range(B)]) for i in range(3))


@pytest.mark.parametrize("B, bad_row", [(2, 1), (4, 2)])
@pytest.mark.parametrize("mode", ["observe", "enforce"])
def test_one_bad_prompt_in_a_batch_is_judged_on_its_own(B, bad_row, mode) -> None:
    """A prompt whose heads miss the needle is not averaged away by clean batch-mates: its heads
    are below the floor (enforce: recomputed densely, for the whole batch), and the events, the
    metrics and the saved prompt ids name that batch row only."""
    q, k, v = _batch(bad_row, B)
    records = []
    guard = QualityGuard(_settings(mode=mode, min_mass=0.8, tail_rows=8, spread_rows=8), on_record=records.append)
    with guard.call([f"req-{b}" for b in range(B)]):
        out = sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0, backend="torch", validate=False,
                             shadow=guard.layer_check(0))
    (layer,) = records[0]["layers"]
    assert layer["below"] == [0, 1] and layer["rows"] == [16] * B
    assert layer["row_below"] == [[0, 1] if b == bad_row else [] for b in range(B)]
    assert max(layer["row_mass"][bad_row][:2]) < 0.8
    assert min(min(m) for b, m in enumerate(layer["row_mass"]) if b != bad_row) > 0.95
    assert layer["mass"][:2] == layer["row_mass"][bad_row][:2]  # per head: the lowest batch row
    assert records[0]["below_rows"] == [bad_row] and records[0]["below_floor"] == guard.below_floor == 2
    assert guard.saved_prompts == [f"req-{bad_row}"] and guard.calls_below_floor == 1
    heads = guard.heads
    assert heads[(0, 0)].checked == B and heads[(0, 0)].below_floor == 1 and heads[(0, 2)].below_floor == 0
    dense = dispatch.dense_prefill(q, k, v)
    if mode == "enforce":
        assert layer["fallback"] == [0, 1] and guard.fallbacks == 2 and heads[(0, 0)].fallbacks == 1
        torch.testing.assert_close(out[:, :2], dense[:, :2], atol=2e-5, rtol=1e-5)  # every batch row's heads 0, 1
    else:
        assert layer["fallback"] == [] and (out[bad_row, :2, 200:] - dense[bad_row, :2, 200:]).abs().max() > 0.1
    one_id = QualityGuard(_settings(min_mass=0.8))
    with one_id.call("batch-7"):  # one id for the whole batch: kept whole
        sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0, backend="torch", validate=False,
                       shadow=one_id.layer_check(0))
    assert one_id.saved_prompts == ["batch-7"]


def test_a_call_whose_layers_run_dense_is_drawn_but_not_checked() -> None:
    """A drawn call whose layers take the dispatcher's dense path (N below the default
    threshold) checks nothing: it is no checked call, records nothing, and stays out of the flag
    rate's denominator."""
    assert dispatch.DENSE_THRESHOLD > 256
    q, k, v = needle_case()
    records = []
    guard = QualityGuard(_settings(min_mass=0.8, flag_rate=0.5, flag_min_calls=2), on_record=records.append)
    for i in range(6):
        with guard.call(i):
            sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0 if i < 2 else None, backend="torch",
                           validate=False, shadow=guard.layer_check(0))
    assert guard.calls == 6 and guard.sampled == len(records) == 2 and guard.calls_below_floor == 2
    assert guard.flagged  # 2 of 2 checked calls, not 2 of 6
    assert "2 of 6 prefill calls checked" in format_summary(guard.summary())


def test_no_alarm_where_the_config_covers_the_input() -> None:
    """Local attention under an A-shape window that holds it: nothing below the floor, in
    observe or enforce, and the output is untouched."""
    q, k, v = needle_case(needle=False)
    for mode in ("observe", "enforce"):
        guard = QualityGuard(_settings(mode=mode, min_mass=0.8, tail_rows=8, spread_rows=8))
        out = _run(q, k, v, guard)
        assert guard.below_floor == 0 and guard.fallbacks == 0 and guard.sampled == 1
        assert torch.equal(out, _run(q, k, v, None))
        assert min(guard.heads[(0, h)].mass_min for h in range(4)) > 0.95


def test_flagged_after_enough_calls_with_the_prompts_that_triggered_it(caplog) -> None:
    q, k, v = needle_case()
    lines = io.StringIO()
    guard = QualityGuard(_settings(min_mass=0.8, flag_min_calls=6, flag_rate=0.5, max_saved_prompts=3),
                         jsonl=lines, name="planted")
    clean = needle_case(needle=False)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for i in range(10):
            guard.prompt_id = f"p{i}"
            with guard.call(f"p{i}"):
                x = (q, k, v) if i % 2 == 0 else clean  # half the calls miss the needle
                sparse_prefill(*x, NEEDLE_PLAN, dense_threshold=0, backend="torch", validate=False,
                               shadow=guard.layer_check(0))
            assert guard.flagged == (i >= 5)
    summary = guard.summary()
    assert summary["flagged"] and summary["calls_below_floor"] == 5 and summary["checked_calls"] == 10
    assert summary["prompts"] == ["p0", "p2", "p4"]  # bounded, first seen kept
    assert [h["head"] for h in summary["worst_heads"][:2]] == [0, 1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flagged for re-search" in warnings[0].getMessage()
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 5  # one per call below the floor
    text = format_summary(summary)
    assert "FLAGGED for re-search" in text and "p4" in text and "L0H0" in text
    records = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert [r["prompt"] for r in records] == [f"p{i}" for i in range(10)]
    assert [r["below_floor"] for r in records] == [2, 0] * 5
    metrics = guard.metrics()["heads"]["0:0"]
    assert metrics["checked"] == 10 and metrics["below_floor"] == 5 and sum(metrics["mass_hist"]) == 10


# ---- sampling --------------------------------------------------------------------------------


def test_the_sampling_rate_is_honoured() -> None:
    def draws(rate, seed=0, calls=1600):
        guard = QualityGuard(GuardSettings(mode="observe", sample_rate=rate, seed=seed))
        picked = []
        for _ in range(calls):
            guard.begin_call()
            picked.append(guard.layer_check(0) is not None)
            assert (guard.layer_check(1) is not None) == picked[-1]  # one decision per call, every layer
            guard.end_call()
        assert guard.calls == calls and guard.sampled == 0  # drawn, but no layer checked anything
        return picked

    k = sum(draws(1 / 16))
    sd = math.sqrt(1600 * (1 / 16) * (15 / 16))
    assert abs(k - 100) <= 5 * sd, k
    assert sum(draws(0.0)) == 0 and sum(draws(1.0)) == 1600
    assert draws(0.25, seed=1) == draws(0.25, seed=1) != draws(0.25, seed=2)
    off = QualityGuard(GuardSettings(mode="off", sample_rate=1.0))
    off.begin_call()
    assert off.layer_check(0) is None and off.calls == 0


def test_layers_without_a_call_open_one_per_pass() -> None:
    """Direct layer calls without begin_call: a layer index that does not increase starts a call."""
    guard = QualityGuard(GuardSettings(mode="observe", sample_rate=1.0))
    for _ in range(3):
        for layer in range(4):
            guard.layer_check(layer)
    guard.flush()
    assert guard.calls == 3


# ---- the patched model --------------------------------------------------------------------


def _tiny(layers: int = 2):
    """A random-weight Llama (4 query / 2 kv heads of 16) with one head of each kind per layer."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             pad_token_id=0, eos_token_id=1, bos_token_id=1)).eval()
    plan = [AShape(sink=1, window=4), VerticalSlash(vertical=4, slash=6, last_q=8), BlockSparse(top_k=2, block=16),
            Dense()]
    config = PatternConfig(model_signature(model), [list(plan) for _ in range(layers)], Provenance(package_version="t"))
    return model, config, layers


def test_patched_model_writes_one_json_line_per_checked_forward(tmp_path) -> None:
    model, config, layers = _tiny()
    path = tmp_path / "guard.jsonl"
    guard = QualityGuard(GuardSettings(mode="observe", sample_rate=0.5, seed=3), jsonl=path, name="tiny")
    integ.patch(model, config, dense_threshold=0, backend="torch", guard=guard)
    assert integ.guard_of(model) is guard
    ids = torch.randint(2, 100, (1, 64))
    try:
        with torch.no_grad():
            for i in range(12):
                guard.prompt_id = i
                model(ids)
            model.generate(ids, max_new_tokens=3, do_sample=False)  # decode steps are no prefill calls
    finally:
        integ.unpatch(model)
        guard.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert guard.calls == 13 and 0 < guard.sampled < 13 and len(records) == guard.sampled
    for r in records:
        assert r["v"] == 2 and r["guard"] == "tiny" and r["mode"] == "observe"
        assert [x["layer"] for x in r["layers"]] == list(range(layers))
        for lay in r["layers"]:
            assert len(lay["mass"]) == len(lay["error"]) == len(lay["heads"]) and lay["rows"][0] > 0
            assert all(0 <= m <= 1 + 1e-6 for m in lay["mass"])
    assert [r["prompt"] for r in records[:-1]] == sorted(r["prompt"] for r in records[:-1])
    with torch.no_grad():
        model(ids)  # unpatched: the hooks are gone
    assert guard.calls == 13


def test_an_unchecked_call_adds_no_op(monkeypatch) -> None:
    """A patched model whose guard checks no call (rate 0) dispatches exactly the aten ops of one
    without a guard: no tensor, no device work, no host sync on the hot path."""
    model, config, _ = _tiny()
    ids = torch.randint(2, 100, (1, 64))

    def ops(guard):
        integ.patch(model, config, dense_threshold=0, backend="torch", guard=guard)
        try:
            with torch.no_grad(), RecordOps() as rec:
                model(ids)
        finally:
            integ.unpatch(model)
        return rec.names

    guard = QualityGuard(GuardSettings(mode="enforce", sample_rate=0.0))
    assert ops(guard) == ops(None) and guard.calls == 1 and guard.sampled == 0
    assert len(ops(QualityGuard(GuardSettings(mode="observe", sample_rate=1.0)))) > len(ops(None))


def test_patch_takes_the_guard_from_the_config_runtime_settings() -> None:
    model, config, _ = _tiny()
    integ.patch(model, config, backend="torch")
    assert integ.guard_of(model) is None  # mode "off" by default
    config.runtime = RuntimeSettings(GuardSettings(mode="enforce", sample_rate=1.0, min_mass=0.3))
    integ.patch(model, config, dense_threshold=0, backend="torch")
    guard = integ.guard_of(model)
    try:
        assert guard.settings.min_mass == 0.3 and guard.mode == "enforce"
        with torch.no_grad():
            model(torch.randint(2, 100, (1, 64)))
        assert guard.sampled == 1 and len(guard.heads) > 0
    finally:
        integ.unpatch(model)
    with pytest.raises(TypeError, match="guard must be"):
        integ.patch(model, config, guard="observe")


# ---- settings and errors --------------------------------------------------------------------


def test_runtime_settings_round_trip_and_stay_out_of_default_files(tmp_path) -> None:
    model, config, _ = _tiny()
    assert "runtime" not in config.to_dict()
    config.runtime = RuntimeSettings(GuardSettings(mode="observe", min_mass=0.65, tail_rows=8))
    data = config.to_dict()
    assert data["runtime"] == {"guard": {"mode": "observe", "min_mass": 0.65, "tail_rows": 8}}
    config.save(tmp_path / "c.json")
    loaded = load_config(tmp_path / "c.json", model)
    assert loaded.runtime == config.runtime and loaded.layers == config.layers


@pytest.mark.parametrize("guard, message", [
    ({"mode": "strict"}, "$.runtime.guard.mode: must be one of"),
    ({"min_mass": 1.5}, "$.runtime.guard.min_mass: must be <= 1"),
    ({"tail_rows": -1}, "$.runtime.guard.tail_rows: must be >= 0"),
    ({"samples": 3}, "unknown field 'samples'"),
    ({"tail_rows": 0, "spread_rows": 0}, "$.runtime.guard.tail_rows + guard.spread_rows must be >= 1"),
])
def test_bad_runtime_settings_name_their_path(guard, message) -> None:
    model, config, _ = _tiny()
    data = config.to_dict()
    data["runtime"] = {"guard": guard}
    with pytest.raises(ConfigError) as err:
        load_config(data, model)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw, exc, message", [
    ({"mode": "on"}, ValueError, "guard.mode must be one of"),
    ({"sample_rate": float("nan")}, ValueError, "guard.sample_rate must be a number in [0, 1]"),
    ({"flag_min_calls": 0}, ValueError, "guard.flag_min_calls must be an int in [1,"),
    ({"seed": True}, ValueError, "guard.seed must be an int"),
])
def test_guard_settings_errors(kw, exc, message) -> None:
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("(", r"\(")):
        GuardSettings(**kw)


def test_argument_errors() -> None:
    with pytest.raises(TypeError, match="settings must be a GuardSettings"):
        QualityGuard({"mode": "observe"})
    with pytest.raises(TypeError, match="on_record must be callable"):
        QualityGuard(on_record=3)
    with pytest.raises(TypeError, match="jsonl must be a path or a text file"):
        QualityGuard(jsonl=3)
    q, k, v = needle_case()
    with pytest.raises(TypeError, match="shadow must be a minference.guard.ShadowCheck"):
        sparse_prefill(q, k, v, NEEDLE_PLAN, dense_threshold=0, backend="torch", shadow=object())


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_unchecked_calls_never_sync_and_bf16_mass_matches_float64() -> None:
    """On CUDA: a patched-path layer call that is not checked runs under
    ``set_sync_debug_mode("error")``; a checked one (bf16 inputs) gives the float64 reference's mass."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = qkv(AttnShape(B=2, Hq=9, Hkv=3, N=1024, D=64), torch.bfloat16, "cuda", seed=7, sharpness=3.0)
    guard = QualityGuard(_settings(sample_rate=0.0))
    sparse_prefill(q, k, v, PLAN, dense_threshold=0, validate=False)  # compiles, fills the plan cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with guard.call():
            sparse_prefill(q, k, v, PLAN, dense_threshold=0, validate=False, shadow=guard.layer_check(0))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    spy = Spy(QualityGuard(_settings()))
    records = []
    spy.guard.on_record = records.append
    with spy.guard.call():
        out = sparse_prefill(q, k, v, PLAN, dense_threshold=0, validate=False, shadow=spy.check())
    masks = reference_masks(PLAN, spy.indices, 9, 2, 1024, dispatch.FILL_GAPS)
    checked = [expected_positions(1024, 1024, 5, 7, 0)] * 2
    (layer,) = records[0]["layers"]
    assert_layer_matches(layer, *reference_stats(q.cpu(), k.cpu(), v.cpu(), out.cpu(), masks, checked),
                         mass_abs=1e-4, error_rel=1e-2, error_abs=1e-3)
