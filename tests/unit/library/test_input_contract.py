"""The input contract of the public entry points (docs/contract.md, issue 19): every bad input a
clear error, or a correct result.

Three classes: non-finite q, k, v (validation on: an error naming tensor, batch row, head and
token; validation off: the index builders keep their forced entries and a NaN score never
empties a selection); budgets in every form (negative, zero under a minimum, per-head tensors
too short, beyond int32, ``last_q`` / ``extra_rows`` far beyond the prompt: work and memory
follow the prompt); ``scale`` and head dim 0. Tiny shapes: the Triton builders run in the
interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from minference.reference import attention as ref
from minference.reference import estimators as naive

import minference.torch_backend as tb
from minference import kernels
from minference.dispatch import dense_prefill, sparse_prefill
from minference.index import select_top
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing.ops import RecordOps

pytestmark = pytest.mark.interpret

B, H, N, D = 1, 2, 64, 16
NAN, INF = float("nan"), float("inf")


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


VS_BUILDERS = {"triton": kernels.vertical_slash_index, "torch": tb.vertical_slash_index}
BS_BUILDERS = {"triton": kernels.block_sparse_index, "torch": tb.block_sparse_index}
VS_ARGS = dict(vertical=6, slash=6, last_q=16, sink_columns=2, local_diagonals=2)


# --------------------------------------------------------------------------------------------
# 1. non-finite inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VS_BUILDERS))
def test_vs_builder_refuses_non_finite_rows_it_reads(name):
    """Validation on: a NaN in a sampled query row (a last row, an extra row) or in a key is an
    error naming tensor, batch row, head and token; a NaN in a query row it never samples is
    not its business (the attention kernels check those)."""
    build = VS_BUILDERS[name]
    q, k, _ = _qkv()
    for tensor, head, token, kw in (("q", 1, N - 1, {}), ("q", 0, 32, dict(extra_rows=2)), ("k", 1, 5, {})):
        bad = {"q": q.clone(), "k": k.clone()}
        bad[tensor][0, head, token, 3] = NAN
        named = f"head {head};" if tensor == "q" else f"kv head {head}, read by query heads \\[{head}\\];"
        with pytest.raises(ValueError, match=f"{tensor} holds NaN or inf at batch row 0, token {token} \\({named}"):
            build(bad["q"], bad["k"], **VS_ARGS, **kw)
    q_mid = q.clone()
    q_mid[0, 0, 10] = NAN  # not sampled: last 16 rows, no extra rows
    build(q_mid, k, **VS_ARGS)
    # heads=: only the computed heads (and their kv heads) are read, and named by their real id
    q_h = q.clone()
    q_h[0, 1, N - 1] = INF
    build(q_h, k, **VS_ARGS, heads=torch.tensor([0]))
    with pytest.raises(ValueError, match="head 1;"):
        build(q_h, k, **VS_ARGS, heads=torch.tensor([1]))


@pytest.mark.parametrize("name", sorted(BS_BUILDERS))
def test_bs_builder_refuses_non_finite_inputs(name):
    q, k, _ = _qkv()
    for tensor in ("q", "k"):
        bad = {"q": q.clone(), "k": k.clone()}
        bad[tensor][0, 1, 33, 0] = -INF
        named = "head 1;" if tensor == "q" else "kv head 1, read by query heads \\[1\\];"
        with pytest.raises(ValueError, match=f"{tensor} holds NaN or inf at batch row 0, token 33 \\({named}"):
            BS_BUILDERS[name](bad["q"], bad["k"], 2, block=16)


def _vs_forced_ok(v_idx, s_idx, sinks: int, locs: int, head: int):
    cols = set(v_idx[0, head].tolist()) - {-1}
    offs = set(s_idx[0, head].tolist()) - {-1}
    assert set(range(sinks)) <= cols, cols
    assert set(range(locs)) <= offs, offs


def test_vs_definition_keeps_forced_entries_on_nan_scores():
    """The naive twin (the definition): a NaN in a sampled query row makes every score of that
    head NaN; the forced columns and diagonals stay, nothing unscored is chosen."""
    q, k, _ = _qkv()
    q[0, 0, N - 1, 3] = NAN
    v_idx, s_idx = naive.vertical_slash_index(q, k, **VS_ARGS)
    _vs_forced_ok(v_idx, s_idx, 2, 2, head=0)
    assert (v_idx[0, 0] >= 0).sum() == 2 and (s_idx[0, 0] >= 0).sum() == 2
    clean = naive.vertical_slash_index(_qkv()[0], k, **VS_ARGS)
    assert torch.equal(v_idx[0, 1], clean[0][0, 1]) and torch.equal(s_idx[0, 1], clean[1][0, 1])


@pytest.mark.parametrize("rule", ["top_k", "mass"])
@pytest.mark.parametrize("name", [
    "torch",
    "triton",
])
def test_vs_builder_keeps_forced_entries_with_validation_off(name, rule):
    """Validation off: one NaN in a sampled query row of head 0 no longer empties its index
    (before: no column, no diagonal, not even δ = 0). Head 1 is untouched. The adaptive rules
    go through the shared torch selection on both builders."""
    if name == "triton" and rule != "top_k":
        pytest.skip("the adaptive rules use select_top on the Triton builder too (the torch case covers it)")
    q, k, _ = _qkv()
    q[0, 0, N - 1, 3] = NAN
    kw = {} if rule == "top_k" else dict(rule="mass", threshold=0.9)
    v_idx, s_idx = VS_BUILDERS[name](q, k, **VS_ARGS, **kw, validate=False)
    _vs_forced_ok(v_idx, s_idx, 2, 2, head=0)
    assert (v_idx[0, 0] >= 0).sum() == 2 and (s_idx[0, 0] >= 0).sum() == 2  # NaN scores: nothing else
    _vs_forced_ok(v_idx, s_idx, 2, 2, head=1)


def test_vs_builder_adaptive_triton_keeps_forced_entries():
    q, k, _ = _qkv()
    q[0, 0, N - 1, 3] = NAN
    v_idx, s_idx = kernels.vertical_slash_index(q, k, **VS_ARGS, rule="relative", threshold=0.5, validate=False)
    _vs_forced_ok(v_idx, s_idx, 2, 2, head=0)


@pytest.mark.parametrize("name,estimate_by", [
    ("torch", "pooled"), ("torch", "query"), ("triton", "pooled"), ("triton", "query"),
])
def test_bs_builder_keeps_forced_blocks_with_validation_off(name, estimate_by):
    """A NaN query in block 3 (pooled: the block's mean query is NaN; query-aware: that
    query's row): the forced sink and diagonal blocks stay; other query blocks are as on clean
    inputs; a NaN key's block is chosen only where forced."""
    q, k, _ = (x[:, :, :32] for x in _qkv())
    kw = dict(block=8, sink_blocks=1, estimate=estimate_by, validate=False)
    clean = BS_BUILDERS[name](q, k, 2, **kw)
    q[0, 0, 31, 3] = NAN
    got = BS_BUILDERS[name](q, k, 2, **kw)
    assert set(got[0, 0, 3].tolist()) == {0, 3}
    for I in range(3):
        assert set(got[0, 0, I].tolist()) == set(clean[0, 0, I].tolist())
    k[0, 1, 10, 0] = NAN  # key block 1 of head 1 (kv head 1)
    got = BS_BUILDERS[name](q, k, 2, **kw)
    assert set(got[0, 1, 1].tolist()) == {0, 1}  # its own diagonal
    if estimate_by == "pooled":
        assert all(1 not in got[0, 1, I].tolist() for I in (2, 3))


def test_select_top_nan_is_a_candidate_without_score():
    """The shared selection: NaN / +inf scores are kept only when forced and never take a
    scored candidate's place (before: a forced NaN was dropped, and topk let NaN use up budget
    slots)."""
    s = torch.tensor([[[NAN, 0.1, NAN, 0.3, INF, 0.2, -INF]]])
    got = select_top(s, torch.tensor([1]), torch.tensor([3]), 3)
    assert set(got[0, 0].tolist()) == {0, 3, 5}
    want = naive.select_row(s[0, 0], {0}, 3)
    assert set(want) == {0, 3, 5}
    forced = torch.zeros(7, dtype=torch.bool)
    forced[6] = True  # a forced non-candidate (-inf) stays out
    assert set(select_top(s, forced[None, None], torch.tensor([2]), 2)[0, 0].tolist()) == {3, 5}


def test_dispatcher_refuses_non_finite_and_validate_off_keeps_forced_entries():
    """sparse_prefill checks q, k, v once (validation on); with validate=False a NaN in the last
    query of head 0 gives a NaN output row there only, and every other row of head 0 attends to
    the forced sinks and local diagonals (before: an empty index, rows of zeros)."""
    q, k, v = _qkv()
    plan = [VerticalSlash(vertical=4, slash=4, last_q=16, sink_columns=2, local_diagonals=2)] * H
    for name in ("q", "k", "v"):
        bad = dict(q=q.clone(), k=k.clone(), v=v.clone())
        bad[name][0, 1, 40, 2] = NAN
        named = "head 1;" if name == "q" else "kv head 1, read by query heads \\[1\\];"
        with pytest.raises(ValueError, match=f"{name} holds NaN or inf at batch row 0, token 40 \\({named}"):
            sparse_prefill(bad["q"], bad["k"], bad["v"], plan, dense_threshold=0, backend="torch")
        with pytest.raises(ValueError, match=f"{name} holds NaN or inf"):
            dense_prefill(bad["q"], bad["k"], bad["v"])
    qn = q.clone()
    qn[0, 0, N - 1, 3] = NAN
    out = sparse_prefill(qn, k, v, plan, dense_threshold=0, backend="torch", validate=False)
    assert torch.isnan(out[0, 0, N - 1]).all()
    assert torch.isfinite(out[0, 0, : N - 1]).all() and torch.isfinite(out[0, 1]).all()
    forced = torch.tensor([[[0, 1]]], dtype=torch.int32)
    want = ref.vertical_slash_attention(q[:, :1], k[:, :1], v[:, :1], forced, forced)
    torch.testing.assert_close(out[0, 0, : N - 1].double(), want[0, 0, : N - 1], rtol=1e-4, atol=1e-5)


#: Grouped heads (issue 34): Hq / Hkv >= 2 and more than one kv head, so that the kv head of
#: query head h (h // group) differs from h % Hkv and from h // Hkv.
GQA_SHAPES = [(6, 2), (6, 3)]


def _gqa_qkv(Hq: int, Hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g)
    return q, torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)


def _readers(j: int, group: int, computed=None) -> str:
    heads = [h for h in range(j * group, (j + 1) * group) if computed is None or h in computed]
    return f"kv head {j}, read by query heads \\[{', '.join(map(str, heads))}\\];"


@pytest.mark.parametrize("Hq,Hkv", GQA_SHAPES)
def test_grouped_heads_a_bad_key_or_value_names_its_kv_head_and_query_heads(Hq, Hkv):
    """The dispatcher (validation on) and the torch builders, a NaN key or value in each kv head
    in turn: the error names that kv head and exactly the query heads that read it; a builder
    computing one query head refuses it iff that head reads the bad kv head."""
    group = Hq // Hkv
    q, k, v = _gqa_qkv(Hq, Hkv)
    plan = [VerticalSlash(vertical=4, slash=4, last_q=16, sink_columns=2, local_diagonals=2)] * Hq
    for j in range(Hkv):
        for name in ("k", "v"):
            bad = dict(q=q, k=k.clone(), v=v.clone())
            bad[name][0, j, 21, 5] = NAN
            with pytest.raises(ValueError, match=f"{name} holds NaN or inf at batch row 0, token 21 "
                                                 f"\\({_readers(j, group)}"):
                sparse_prefill(bad["q"], bad["k"], bad["v"], plan, dense_threshold=0, backend="torch")
            with pytest.raises(ValueError, match=_readers(j, group)):
                dense_prefill(bad["q"], bad["k"], bad["v"])
        bad_k = k.clone()
        bad_k[0, j, 21, 5] = INF
        with pytest.raises(ValueError, match=f"k holds NaN or inf at batch row 0, token 21 \\({_readers(j, group)}"):
            tb.vertical_slash_index(q, bad_k, **VS_ARGS)
        for h in range(Hq):
            one = torch.tensor([h])
            if h // group == j:
                with pytest.raises(ValueError, match=_readers(j, group, computed={h})):
                    tb.vertical_slash_index(q, bad_k, **VS_ARGS, heads=one)
                with pytest.raises(ValueError, match=_readers(j, group, computed={h})):
                    tb.block_sparse_index(q, bad_k, 2, block=16, heads=one)
            else:  # the bad kv head is not read: no error
                tb.vertical_slash_index(q, bad_k, **VS_ARGS, heads=one)
                tb.block_sparse_index(q, bad_k, 2, block=16, heads=one)
        last = torch.tensor([(j + 1) * group - 1, Hq - 1] if j + 1 < Hkv else [Hq - 1])
        with pytest.raises(ValueError, match=_readers(j, group, computed={(j + 1) * group - 1})):
            tb.block_sparse_index(q, bad_k, 2, block=16, heads=last)


def test_grouped_heads_kernels_and_triton_builders_name_the_query_heads_that_read_it():
    """The same rule at the Triton entry points (interpreter): a kernel or builder computing some
    query heads refuses a NaN value / key only in a kv head one of them reads, naming those."""
    Hq, Hkv = 6, 2
    group = Hq // Hkv
    q, k, v = _gqa_qkv(Hq, Hkv, seed=1)
    for j in range(Hkv):
        bad_v, bad_k = v.clone(), k.clone()
        bad_v[0, j, 9, 0] = -INF
        bad_k[0, j, 9, 0] = NAN
        with pytest.raises(ValueError, match=f"v holds NaN or inf at batch row 0, token 9 \\({_readers(j, group)}"):
            kernels.ashape_attention(q, k, bad_v, 1, 4)
        mine, other = torch.tensor([j * group + 1]), torch.tensor([(1 - j) * group])
        with pytest.raises(ValueError, match=_readers(j, group, computed={j * group + 1})):
            kernels.dense_attention(q, k, bad_v, heads=mine)
        with pytest.raises(ValueError, match=_readers(j, group, computed={j * group + 1})):
            kernels.vertical_slash_index(q, bad_k, **VS_ARGS, heads=mine)
        out = kernels.dense_attention(q, k, bad_v, heads=other)  # reads the other kv head only
        assert torch.isfinite(out).all()


def test_kernels_keep_a_non_finite_value_to_the_rows_that_read_it():
    """Validation off, v[token 0] = NaN: only the rows whose candidate set holds token 0 may be
    non-finite (A-shape window 4: rows 0..3; vertical-slash δ = 0 only: row 0)."""
    q, k, v = (x[:, :1] for x in _qkv())
    v[0, 0, 0, 0] = NAN
    a = kernels.ashape_attention(q, k, v, 0, 4, validate=False)
    self_only = torch.tensor([[[0]]], dtype=torch.int32)
    vs = kernels.vertical_slash_attention(q, k, v, -self_only - 1, self_only, validate=False)
    for out, rows in ((a, [0, 1, 2, 3]), (vs, [0])):
        assert (~torch.isfinite(out[0, 0])).any(-1).nonzero().flatten().tolist() == rows


def _bad_rows(out: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]`` bool: the output rows with a non-finite element."""
    return (~torch.isfinite(out)).any(-1)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_every_kernel_keeps_non_finite_values_to_the_rows_whose_set_holds_them(bad):
    """Validation off, non-finite values planted in a few value rows (inside masked and unmasked
    tiles of every kind: the A-shape window edge and sinks, vertical-slash diagonals, gathered
    columns and masked column tiles, the block-sparse diagonal block, the dense kernel's causal
    tile with and without a key split): the non-finite output rows are exactly the rows whose
    candidate set (``reference.masks``) holds one of them; every other row equals the finite
    reference computed with those value rows zeroed (which no such row reads)."""
    from minference.reference import masks

    q, k, v = _qkv(3)
    planted = [1, 21, 37, 50]  # interpreter tiles are 16 keys wide: several tiles, several kinds
    vb = v.clone()
    for n in planted:
        vb[:, :, n, n % D] = bad
    v0 = v.clone()
    v0[:, :, planted] = 0.0
    hit = torch.zeros(N, dtype=torch.bool)
    hit[planted] = True

    vertical = torch.tensor([[[1, 21, 40, -1]] * H], dtype=torch.int32)
    slash = torch.tensor([[[0, 3, 13, 29]] * H], dtype=torch.int32)
    blocks = torch.tensor([[[[0, -1], [0, 1], [1, 2], [0, 3]]] * H], dtype=torch.int32)
    cases = {
        "ashape": (lambda vv: kernels.ashape_attention(q, k, vv, 2, 9, validate=False), masks.ashape_mask(N, 2, 9)),
        "vertical_slash": (lambda vv: kernels.vertical_slash_attention(q, k, vv, vertical, slash, validate=False),
                           masks.vertical_slash_mask(N, vertical, slash)),
        "block_sparse": (lambda vv: kernels.block_sparse_attention(q, k, vv, blocks, block=16, validate=False),
                         masks.block_sparse_mask(N, blocks, 16)),
        "dense": (lambda vv: kernels.dense_attention(q, k, vv, validate=False), masks.causal_mask(N)),
        "dense split": (lambda vv: kernels.dense_attention(q, k, vv, key_split=3, validate=False),
                        masks.causal_mask(N)),
    }
    for name, (call, mask) in cases.items():
        want_bad = (mask.expand(B, H, N, N) & hit).any(-1)
        out = call(vb)
        assert torch.equal(_bad_rows(out), want_bad), name
        ok = ~want_bad
        torch.testing.assert_close(out[ok], call(v0)[ok], rtol=0, atol=0, msg=name)


def _planted(v: torch.Tensor, planted: list[int], bad: float):
    """``(v with one element of each planted value row set to bad, v with those rows zeroed, [N]
    bool of the planted tokens)``."""
    vb, v0 = v.clone(), v.clone()
    for n in planted:
        vb[:, :, n, n % D] = bad
    v0[:, :, planted] = 0.0
    hit = torch.zeros(v.shape[2], dtype=torch.bool)
    hit[planted] = True
    return vb, v0, hit


@pytest.mark.parametrize("bad", [NAN, -INF])
def test_descriptor_paths_keep_non_finite_values_to_the_rows_whose_set_holds_them(bad, monkeypatch):
    """The same rule where unmasked tiles read K/V through tensor descriptors (the GPU's path,
    forced here under the interpreter): A-shape window interior tiles, the dense kernel with and
    without a key split, block-sparse off-diagonal blocks, and the vertical-slash column scratch.
    The scratch case puts the non-finite value in a column (40) that block 2 (rows 32..47) holds
    in its list but after its first row, so that block reads it only as a padding slot of its one
    masked scratch tile (columns 1 and 5 are its lead): those slots read the k_masked / v_safe
    scratches (a NaN key masked to -inf, a zero value), and the rows 48.. whose lead holds column
    40 get NaN from its NaN key row. Fails if the masked scratch tile reads the plain V scratch
    (rows 32..47 NaN: p = 0 times inf) or the plain K scratch (rows 48.. finite)."""
    from minference.kernels import _common, ashape, block_sparse, vertical_slash
    from minference.reference import masks

    built, scratch = [], []

    def forced(k, v, block_n, block_d):
        pair = _common.kv_descriptors(k, v, block_n, block_d, interpreter=True)
        built.append(pair[0] is not None)
        return pair

    def recorded(*args, _real=vertical_slash._column_scratch, **kwargs):
        scratch.append(True)
        return _real(*args, **kwargs)

    for module in (ashape, block_sparse, vertical_slash):
        monkeypatch.setattr(module, "kv_descriptors", forced)
    monkeypatch.setattr(vertical_slash, "_column_scratch", recorded)
    q, k, v = _qkv(5)
    blocks = torch.tensor([[[[0, -1], [0, 1], [1, 2], [0, 3]]] * H], dtype=torch.int32)
    cases = {
        "ashape": (lambda vv: kernels.ashape_attention(q, k, vv, 2, 40, validate=False), masks.ashape_mask(N, 2, 40),
                   [1, 21, 37, 50]),
        "dense": (lambda vv: kernels.dense_attention(q, k, vv, validate=False), masks.causal_mask(N), [1, 21, 37, 50]),
        "dense split": (lambda vv: kernels.dense_attention(q, k, vv, key_split=3, validate=False),
                        masks.causal_mask(N), [21, 50]),
        "block_sparse": (lambda vv: kernels.block_sparse_attention(q, k, vv, blocks, block=16, validate=False),
                         masks.block_sparse_mask(N, blocks, 16), [1, 21, 37, 50]),
    }
    vertical = torch.tensor([[[1, 5, 40]] * H], dtype=torch.int32)
    slash = torch.tensor([[[0]] * H], dtype=torch.int32)
    cases["vertical_slash scratch"] = (
        lambda vv: kernels.vertical_slash_attention(q, k, vv, vertical, slash, validate=False),
        masks.vertical_slash_mask(N, vertical, slash), [40])
    for name, (call, mask, planted) in cases.items():
        vb, v0, hit = _planted(v, planted, bad)
        want_bad = (mask.expand(B, H, N, N) & hit).any(-1)
        assert want_bad.any() and not want_bad.all(), name
        out = call(vb)
        assert torch.equal(_bad_rows(out), want_bad), name
        ok = ~want_bad
        torch.testing.assert_close(out[ok], call(v0)[ok], rtol=0, atol=0, msg=name)
    assert built and all(built), "the descriptor path did not run"
    assert scratch, "the vertical-slash column scratch was not built"


@pytest.mark.parametrize("bad", [NAN, INF])
def test_a_non_finite_key_reads_as_without_the_guard(bad):
    """Validation off, a non-finite KEY row (finite values): the guard leaves key rows as they
    are, so every kernel gives bit for bit the output of the same call with the guard off
    (``value_guard=(k, v)``: the unguarded kernels' reads), NaN rows at the same places."""
    q, k, v = _qkv(6)
    kb = k.clone()
    for n in (1, 21, 37, 50):
        kb[:, :, n, n % D] = bad
    vertical = torch.tensor([[[1, 21, 40, -1]] * H], dtype=torch.int32)
    slash = torch.tensor([[[0, 3, 13, 29]] * H], dtype=torch.int32)
    blocks = torch.tensor([[[[0, -1], [0, 1], [1, 2], [0, 3]]] * H], dtype=torch.int32)
    cases = {
        "ashape": lambda **g: kernels.ashape_attention(q, kb, v, 2, 9, validate=False, **g),
        "vertical_slash": lambda **g: kernels.vertical_slash_attention(q, kb, v, vertical, slash, validate=False, **g),
        "block_sparse": lambda **g: kernels.block_sparse_attention(q, kb, v, blocks, block=16, validate=False, **g),
        "dense": lambda **g: kernels.dense_attention(q, kb, v, validate=False, **g),
        "dense split": lambda **g: kernels.dense_attention(q, kb, v, key_split=3, validate=False, **g),
    }
    for name, call in cases.items():
        out, plain = call(), call(value_guard=(kb, v))
        assert _bad_rows(out).any(), name
        torch.testing.assert_close(out, plain, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_value_guard_flags_every_row_with_a_non_finite_element(dtype):
    """``kernels.value_guard``: a token whose value row has NaN, +inf or -inf in any element
    (first, middle, last) gets a NaN key row in ``k_masked`` and a zero value row in ``v_safe``;
    other tokens (the dtype's largest values too) keep their key and value rows as they are, a
    NaN or inf in a key row included (the key rows are not what the guard looks at)."""
    k, v = (x.to(dtype) for x in _qkv(1)[1:])
    v[0, 0, 3] = torch.finfo(dtype).max
    v[0, 1, 4] = -torch.finfo(dtype).max
    k[0, 0, 6, 1] = NAN  # a bad key with a finite value: kept as it is
    k[0, 1, 8, 0] = -INF
    bad = {(0, 5, 0): NAN, (0, 9, D - 1): INF, (1, 9, 7): -INF, (1, 63, 2): NAN, (1, 0, D - 1): -INF}
    for (h, n, d), x in bad.items():
        v[0, h, n, d] = x
    k_masked, v_safe = kernels.value_guard(k, v)
    flagged = torch.zeros(B, H, N, dtype=torch.bool)
    for h, n, _ in bad:
        flagged[0, h, n] = True
    assert k_masked.dtype == dtype and k_masked.shape == k.shape
    assert bool(torch.isnan(k_masked[flagged]).all())
    assert torch.equal(k_masked[~flagged].isnan(), k[~flagged].isnan())
    assert torch.equal(k_masked[~flagged].nan_to_num(), k[~flagged].nan_to_num())
    assert v_safe.dtype == dtype and v_safe.shape == v.shape
    assert bool((v_safe[flagged] == 0).all()) and torch.equal(v_safe[~flagged], v[~flagged])
    # strided views (the kernels pass the pair's own strides)
    kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    k_masked_t, v_safe_t = kernels.value_guard(kt, vt)
    assert torch.equal(v_safe_t, v_safe) and torch.equal(k_masked_t.nan_to_num(), k_masked.nan_to_num())
    assert torch.equal(k_masked_t.isnan(), k_masked.isnan())


def test_value_guard_checked_is_k_and_v_without_a_device_op():
    """``checked=True`` (values validated by the caller): ``(k, v)`` themselves, no tensor op."""
    _, k, v = _qkv(2)
    v[0, 1, 7, 3] = NAN  # not read: checked is the caller's promise
    with RecordOps() as ops:
        k_masked, v_safe = kernels.value_guard(k, v, checked=True)
    assert ops.names == []
    assert k_masked is k and v_safe is v
    with pytest.raises(TypeError, match="checked must be a bool"):
        kernels.value_guard(k, v, checked=1)
    with pytest.raises(ValueError, match="v must have rank 4"):
        kernels.value_guard(k, v[0])
    with pytest.raises(ValueError, match="k and v must have one shape"):
        kernels.value_guard(k[:, :, 1:], v)


def test_a_bad_value_guard_argument_is_a_clear_error():
    """``value_guard=`` of every kernel entry and of the dense tail: a pair shaped as
    ``kernels.value_guard(k, v)`` makes it, else a ``ValueError`` naming what is wrong."""
    from minference.dispatch import dense_tail_attention

    q, k, v = _qkv()
    k_masked, v_safe = kernels.value_guard(k, v)
    idx = torch.zeros(B, H, 1, dtype=torch.int32)
    blocks = torch.zeros(B, H, 4, 1, dtype=torch.int32)
    entries = {
        "ashape": lambda g: kernels.ashape_attention(q, k, v, 1, 4, value_guard=g),
        "dense": lambda g: kernels.dense_attention(q, k, v, value_guard=g),
        "dense split": lambda g: kernels.dense_attention(q, k, v, key_split=2, value_guard=g),
        "vertical_slash": lambda g: kernels.vertical_slash_attention(q, k, v, idx, idx, value_guard=g),
        "block_sparse": lambda g: kernels.block_sparse_attention(q, k, v, blocks, block=16, value_guard=g),
        "dense tail": lambda g: dense_tail_attention(q, k, v, 8, out=torch.zeros_like(q), backend="triton",
                                                     value_guard=g),
        "dense tail torch": lambda g: dense_tail_attention(q, k, v, 8, out=torch.zeros_like(q), backend="torch",
                                                           value_guard=g),
    }
    meta = torch.empty(B, H, N, D, device="meta")
    wrong = [
        (v_safe, "a pair \\(k_masked, v_safe\\)"),
        ((k_masked, v_safe, v_safe), "a pair \\(k_masked, v_safe\\)"),
        ((k_masked.numpy(), v_safe), "k_masked must be a torch.Tensor"),
        ((k_masked, v_safe.numpy()), "v_safe must be a torch.Tensor"),
        ((k_masked[:, :, :-1], v_safe), "k_masked must match k"),
        ((k_masked.half(), v_safe), "k_masked must match k"),
        ((k_masked, v_safe[:, :, :-1]), "v_safe must match v"),
        ((k_masked, v_safe.half()), "v_safe must match v"),
        ((meta.float(), v_safe), "k_masked must be on k's device"),
        ((k_masked, meta.float()), "v_safe must be on v's device"),
    ]
    for name, call in entries.items():
        for guard, needle in wrong:
            with pytest.raises(ValueError, match=needle):
                call(guard)
        if name != "dense tail torch":  # the right pair is taken as given
            call((k_masked, v_safe))


@pytest.mark.parametrize("validate", [False, True])
def test_the_dispatcher_makes_one_value_guard_for_all_its_kernels(validate, monkeypatch):
    """``sparse_prefill`` on Triton makes the guard once per call (not per group, kernel or the
    dense tail) and hands every kernel that pair; with ``validate=True`` the values are checked,
    so the pair is ``(k, v)`` themselves (no pass over them). ``dense_prefill`` on query rows likewise."""
    made, seen = [], []
    real_guard = kernels.value_guard

    def guard(k, v, checked=False):
        made.append(real_guard(k, v, checked=checked))
        return made[-1]

    monkeypatch.setattr(kernels, "value_guard", guard)
    for name in ("ashape_attention", "vertical_slash_attention_physical", "block_sparse_attention",
                 "dense_attention"):
        real = getattr(kernels, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append((_name, kw["value_guard"]))
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, name, spy)
    q, k, v = _qkv(4)
    plan = [AShape(sink=2, window=8), VerticalSlash(vertical=4, slash=4, last_q=16), BlockSparse(top_k=2, block=16),
            Dense()]
    qh, kh, vh = (torch.cat([x, x], 1) for x in (q, k, v))  # 4 heads: one of each kind
    out = sparse_prefill(qh, kh, vh, plan, dense_threshold=0, backend="triton", dense_tail=8, validate=validate)
    assert len(made) == 1 and {n for n, _ in seen} == {"ashape_attention", "vertical_slash_attention_physical",
                                                       "block_sparse_attention", "dense_attention"}
    assert len(seen) == 5 and all(g is made[0] for _, g in seen)  # the dense tail too
    assert (made[0][0] is kh) == validate and (made[0][1] is vh) == validate
    assert torch.isfinite(out).all()
    made.clear(), seen.clear()
    dense_prefill(q[:, :, -20:], k, v, backend="triton", validate=validate)
    assert len(made) == 1 and seen == [("dense_attention", made[0])]


# --------------------------------------------------------------------------------------------
# 2. budgets
# --------------------------------------------------------------------------------------------


def _calls(q, k, v, budget):
    """Every builder and kernel entry that takes a per-global-head budget, with ``budget`` in one
    slot."""
    return {
        "vs triton": lambda: kernels.vertical_slash_index(q, k, budget, 6),
        "vs torch": lambda: tb.vertical_slash_index(q, k, 6, budget),
        "vs sinks": lambda: kernels.vertical_slash_index(q, k, 6, 6, sink_columns=budget),
        "vs min": lambda: tb.vertical_slash_index(q, k, 6, 6, rule="mass", threshold=0.5, min_vertical=budget),
        "bs triton": lambda: kernels.block_sparse_index(q, k, budget, block=16),
        "bs torch": lambda: tb.block_sparse_index(q, k, 2, block=16, sink_blocks=budget),
        "ashape sink": lambda: kernels.ashape_attention(q, k, v, budget, 8),
        "ashape window": lambda: kernels.ashape_attention(q, k, v, 2, budget),
        "naive vs": lambda: naive.vertical_slash_index(q, k, budget, 6),
    }


def test_per_head_budget_tensor_too_short_is_a_clear_error():
    q, k, v = _qkv()
    for call in _calls(q, k, v, torch.tensor([3])).values():  # 1 entry, 2 heads
        with pytest.raises(ValueError, match="entries|is needed"):
            call()
    # with head_offset the tensor must reach head_offset + Hq
    with pytest.raises(ValueError, match="fewer than the 3 global heads"):
        kernels.block_sparse_index(q, k, torch.tensor([2, 2]), block=16, head_offset=1)


def test_negative_and_zero_budgets_are_clear_errors():
    q, k, v = _qkv()
    for call in _calls(q, k, v, torch.tensor([-1, 3])).values():
        with pytest.raises(ValueError, match=">= 0|>= 1"):
            call()
    for call in _calls(q, k, v, -1).values():
        with pytest.raises(ValueError, match=">= 0|>= 1"):
            call()
    for call in (lambda: kernels.vertical_slash_index(q, k, 6, torch.tensor([1, 0])),  # slash >= 1
                 lambda: tb.block_sparse_index(q, k, torch.tensor([0, 1]), block=16),  # top_k >= 1
                 lambda: kernels.ashape_attention(q, k, v, 2, torch.tensor([0, 4]))):  # window >= 1
        with pytest.raises(ValueError, match=">= 1"):
            call()
    # validation off: tensor entries under the minimum act as the minimum (no sync, no crash)
    got = kernels.vertical_slash_index(q, k, torch.tensor([-5, -5]), 6, validate=False)[0]
    assert (got == -1).all()


def test_budgets_beyond_int32_mean_all():
    """Ints and int64 entries past int32 are "the whole row": the result of a budget of N
    (before: OverflowError / RuntimeError from torch, or an int64 -> int32 wrap)."""
    q, k, v = (x[:, :, :16] for x in _qkv())
    n = q.shape[2]
    want_vs = kernels.vertical_slash_index(q, k, n, n, sink_columns=n, local_diagonals=n)
    want_bs = kernels.block_sparse_index(q, k, 2, block=8, sink_blocks=2)
    want_a = kernels.ashape_attention(q, k, v, n, n)
    for budget in (2**70, torch.tensor([2**32 + 1] * H)):  # an int past int64, int64 entries past int32
        got = kernels.vertical_slash_index(q, k, budget, budget, sink_columns=budget, local_diagonals=budget)
        assert all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(got, want_vs))
        got = tb.block_sparse_index(q, k, budget, block=8, sink_blocks=budget)
        assert torch.equal(got.sort(-1).values, want_bs.sort(-1).values)
        torch.testing.assert_close(kernels.ashape_attention(q, k, v, budget, budget), want_a)
    # through patterns and the dispatcher (per-plan tensors: before, AShape's int32 overflowed)
    dense = ref.dense_attention(q, k, v)
    out = sparse_prefill(q, k, v, [AShape(sink=2**40, window=2**40)] * H, dense_threshold=0, backend="triton")
    torch.testing.assert_close(out.double(), dense, rtol=1e-4, atol=1e-5)
    plan = [VerticalSlash(vertical=2**40, slash=2**70, sink_columns=2**40), BlockSparse(top_k=2**40, block=8)]
    out = sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch")
    torch.testing.assert_close(out.double(), dense, rtol=1e-4, atol=1e-5)


class _Record(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("name", sorted(VS_BUILDERS))
def test_last_q_and_extra_rows_far_beyond_the_prompt_follow_the_prompt(name, monkeypatch):
    """``last_q`` / ``extra_rows`` of 10**9 on a 16-token prompt: the same index as ``N``, and no
    tensor or Triton grid larger than a few times the prompt's (before: buffers and grids of
    ``last_q`` rows)."""
    from triton.runtime.interpreter import InterpretedFunction

    q, k, _ = (x[:, :, :16] for x in _qkv())
    n = q.shape[2]
    build = VS_BUILDERS[name]
    want = build(q, k, 6, 6, last_q=n, extra_rows=n)
    grids = []
    run = InterpretedFunction.__getitem__

    def record(self, grid):
        grids.append(grid)
        size = 1
        for g in grid:
            size *= g
        assert size <= 64 * B * H * n, (self.fn.__name__, grid)  # never launched: it would not finish
        return run(self, grid)

    monkeypatch.setattr(InterpretedFunction, "__getitem__", record)
    with _Record() as rec:
        got = build(q, k, 6, 6, last_q=10**9, extra_rows=10**9)
    assert rec.largest <= 16 * B * H * n * D, rec.largest
    assert all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(got, want))
    got = naive.vertical_slash_index(q, k, 6, 6, last_q=10**6, extra_rows=10**6)  # O(n), not O(extra_rows)
    assert all(torch.equal(a.sort(-1).values, b.sort(-1).values)
               for a, b in zip(got, naive.vertical_slash_index(q, k, 6, 6, last_q=n, extra_rows=n)))


# --------------------------------------------------------------------------------------------
# 3. scale and head dim
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [INF, -INF, NAN, 0.0, -0.5, True])
def test_scale_must_be_finite_and_positive(scale):
    q, k, v = _qkv()
    blocks = torch.zeros(B, H, 4, 1, dtype=torch.int32)
    idx = torch.zeros(B, H, 1, dtype=torch.int32)
    for call in (lambda: sparse_prefill(q, k, v, [VerticalSlash()] * H, scale=scale),
                 lambda: dense_prefill(q, k, v, scale=scale),
                 lambda: kernels.vertical_slash_index(q, k, 4, 4, scale=scale),
                 lambda: tb.block_sparse_index(q, k, 2, block=16, scale=scale),
                 lambda: kernels.query_block_scores(q, k, block=16, scale=scale),
                 lambda: kernels.ashape_attention(q, k, v, 1, 4, scale=scale),
                 lambda: kernels.vertical_slash_attention(q, k, v, idx, idx, scale=scale),
                 lambda: kernels.block_sparse_attention(q, k, v, blocks, block=16, scale=scale),
                 lambda: naive.block_sparse_index(q, k, 2, block=16, scale=scale),
                 lambda: ref.dense_attention(q, k, v, scale=scale)):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            call()


def test_head_dim_zero_is_a_clear_error():
    z = torch.zeros(B, H, 8, 0)
    for call in (lambda: sparse_prefill(z, z, z, [VerticalSlash()] * H),
                 lambda: dense_prefill(z, z, z),
                 lambda: kernels.vertical_slash_index(z, z, 2, 2),
                 lambda: tb.block_sparse_index(z, z, 1, block=4),
                 lambda: kernels.ashape_attention(z, z, z, 1, 4),
                 lambda: naive.vertical_slash_index(z, z, 2, 2),
                 lambda: ref.dense_attention(z, z, z)):
        with pytest.raises(ValueError, match="head dim D >= 1"):
            call()


# --------------------------------------------------------------------------------------------
# 4. meta tensors (a shape without data): refused at the edge, naming the tensor (issue 34)
# --------------------------------------------------------------------------------------------


def _entry_points(q, k, v, *, budget=2, seqlens=None, idx=None, blocks=None):
    """Every public entry point that takes q, k, v, called on these tensors."""
    rows = {} if seqlens is None else dict(seqlens=seqlens)
    idx = torch.zeros(B, H, 1, dtype=torch.int32) if idx is None else idx
    blocks = torch.zeros(B, H, N // 16, 1, dtype=torch.int32) if blocks is None else blocks
    plan = [VerticalSlash(vertical=4, slash=4, last_q=16)] * H
    calls = {f"{name} vertical_slash_index": (lambda m=mod: m.vertical_slash_index(q, k, budget, 4, **rows))
             for name, mod in (("torch", tb), ("triton", kernels))}
    calls.update({f"{name} block_sparse_index": (lambda m=mod: m.block_sparse_index(q, k, budget, block=16, **rows))
                  for name, mod in (("torch", tb), ("triton", kernels))})
    calls.update({
        "torch ashape_attention": lambda: tb.ashape_attention(q, k, v, 1, budget, **rows),
        "torch vertical_slash_attention": lambda: tb.vertical_slash_attention(q, k, v, idx, idx, **rows),
        "torch block_sparse_attention": lambda: tb.block_sparse_attention(q, k, v, blocks, block=16, **rows),
        "torch dense_attention": lambda: tb.dense_attention(q, k, v, **rows),
        "triton ashape_attention": lambda: kernels.ashape_attention(q, k, v, 1, budget, **rows),
        "triton vertical_slash_attention": lambda: kernels.vertical_slash_attention(q, k, v, idx, idx, **rows),
        "triton block_sparse_attention": lambda: kernels.block_sparse_attention(q, k, v, blocks, block=16, **rows),
        "triton dense_attention": lambda: kernels.dense_attention(q, k, v, **rows),
        "sparse_prefill torch": lambda: sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch", **rows),
        "sparse_prefill torch unvalidated": lambda: sparse_prefill(q, k, v, plan, dense_threshold=0, backend="torch",
                                                                   validate=False, **rows),
        "sparse_prefill triton": lambda: sparse_prefill(q, k, v, plan, dense_threshold=0, backend="triton", **rows),
        "dense_prefill": lambda: dense_prefill(q, k, v, **rows),
        "dense_prefill unvalidated": lambda: dense_prefill(q, k, v, validate=False, **rows),
    })
    return calls


@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
def test_meta_q_k_v_are_refused_at_every_entry_point_with_their_name(which):
    """Before: 'Tensor.item() cannot be called on meta tensors' or 'Cannot copy out of meta
    tensor' from inside torch (the torch backend, the builders, the dispatcher)."""
    qkv_ = dict(zip("qkv", _qkv()))
    for name in ("qkv" if which == "all" else which):
        qkv_[name] = qkv_[name].to("meta")
    first = "q" if which == "all" else which
    for entry, call in _entry_points(qkv_["q"], qkv_["k"], qkv_["v"]).items():
        if first == "v" and "index" in entry:
            continue  # the builders read no v
        with pytest.raises(ValueError, match=f"^{first} is a meta tensor"):
            call()
            pytest.fail(f"{entry} took a meta {first}")


def test_meta_index_budget_and_row_tensors_are_refused_with_their_name():
    q, k, v = _qkv()
    meta_lens = torch.full((B,), N, dtype=torch.int32, device="meta")
    for call in _entry_points(q, k, v, seqlens=meta_lens).values():
        with pytest.raises(ValueError, match="^seqlens is a meta tensor"):
            call()
    budget = torch.full((H,), 4, dtype=torch.int64, device="meta")
    for entry, call in _entry_points(q, k, v, budget=budget).items():
        if "ashape" in entry or "index" in entry:
            with pytest.raises(ValueError, match="^(window|vertical|top_k) (is a meta tensor|must be on cpu, got meta)"
                               ):
                call()
    idx = torch.zeros(B, H, 1, dtype=torch.int32, device="meta")
    blocks = torch.zeros(B, H, N // 16, 1, dtype=torch.int32, device="meta")
    for entry, call in _entry_points(q, k, v, idx=idx, blocks=blocks).items():
        if "vertical_slash_attention" in entry:
            with pytest.raises(ValueError, match="^vertical is a meta tensor"):
                call()
        elif "block_sparse_attention" in entry:
            with pytest.raises(ValueError, match="^blocks is a meta tensor"):
                call()
    with pytest.raises(ValueError, match="^heads is a meta tensor"):
        tb.vertical_slash_index(q, k, 4, 4, heads=torch.tensor([0], device="meta"))
