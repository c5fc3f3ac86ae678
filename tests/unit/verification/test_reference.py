"""Pin the float64 references to the method's definition.

Hand-worked examples are computed here from the formulas (never read back from the code under
test); masks are compared with brute-force loops over the set definitions on hypothesis-drawn
indices; masked attention is compared with a per-query softmax written out in the test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from minference.reference.attention import (
    ashape_attention,
    block_sparse_attention,
    dense_attention,
    dense_attention_probs,
    masked_attention,
    vertical_slash_attention,
)
from minference.reference.estimators import vertical_slash_index
from minference.reference.masks import (
    ashape_mask,
    block_sparse_mask,
    causal_mask,
    length_mask,
    slash_set,
    vertical_slash_mask,
)

from minference.testing.strategies import (
    ashape_budgets,
    attention_shapes,
    block_sparse_indices,
    head_subsets,
    qkv,
    ragged_rows,
    vertical_slash_indices,
)

F64 = torch.float64
I32 = torch.int32


def _t(x, dtype=I32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


# --- the worked example ---------------------------------------------------------------------

def _worked_example():
    """n = 8, one head, D = 2, with q6, k1, k4, k6, v1, v4, v6 as in the method's write-up."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 2, generator=g, dtype=F64)
    k = torch.randn(1, 1, 8, 2, generator=g, dtype=F64)
    v = torch.randn(1, 1, 8, 2, generator=g, dtype=F64)
    q[0, 0, 6] = _t([1.0, 1.0], F64)
    k[0, 0, 1], k[0, 0, 4], k[0, 0, 6] = _t([2.0, 0.0], F64), _t([0.0, 1.0], F64), _t([1.0, 1.0], F64)
    v[0, 0, 1], v[0, 0, 4], v[0, 0, 6] = _t([1.0, 0.0], F64), _t([0.0, 2.0], F64), _t([2.0, 1.0], F64)
    return q, k, v


def test_worked_example_candidate_set() -> None:
    mask = vertical_slash_mask(8, _t([[[1]]]), _t([[[0, 2]]]))[0, 0]
    assert [j for j in range(8) if mask[6, j]] == [1, 4, 6]
    for i in range(8):  # every row, straight from the definition
        want = {j for j in (1,) if j <= i} | {i - d for d in (0, 2) if i - d >= 0}
        assert {j for j in range(8) if mask[i, j]} == want


@pytest.mark.parametrize(
    "vertical, slash",
    [
        ([1], [0, 2]),
        ([1, 1, -1], [2, -1, 0, 2, 0]),  # duplicates and padding anywhere
        ([6, 1, 4], [0, 2]),  # verticals already reached by the slashes
        ([-1, 1], [2, 0, -1]),
    ],
)
def test_worked_example_output(vertical, slash) -> None:
    q, k, v = _worked_example()
    e = math.e
    z = 2 * e**2 + e  # scores q6.k1 = 2, q6.k4 = 1, q6.k6 = 2 at scale 1
    w1, w4, w6 = e**2 / z, e / z, e**2 / z
    assert (round(w1, 3), round(w4, 3)) == (0.422, 0.155)
    want = (w1 * 1 + w4 * 0 + w6 * 2, w1 * 0 + w4 * 2 + w6 * 1)
    assert abs(want[0] - 1.266) < 2e-3 and abs(want[1] - 0.732) < 2e-3  # 3e / (2e + 1) = 1.2670...
    out, lse = vertical_slash_attention(q, k, v, _t([[vertical]]), _t([[slash]]), scale=1.0, return_lse=True)
    assert torch.allclose(out[0, 0, 6], _t(want, F64), rtol=1e-12, atol=0)
    assert math.isclose(float(lse[0, 0, 6]), math.log(z), rel_tol=1e-12)


# --- pair counts ---------------------------------------------------------------------------

def test_ashape_pair_count() -> None:
    mask = ashape_mask(8, 1, 2)
    assert int(mask.sum()) == 21  # row 0: {0}; row 1: {0, 1}; rows 2..7: {0, i-1, i}
    assert [j for j in range(8) if mask[5, j]] == [0, 4, 5]


def test_two_vertical_columns_pair_count() -> None:
    mask = vertical_slash_mask(1024, _t([[0, 512]]), _t([[-1]]))
    assert int(mask.sum()) == 1024 + 512


# --- the last-rows estimate can miss what a middle query needs -------------------------------

def test_last_rows_proxy_misses_a_middle_query() -> None:
    """The last two queries look at key 1; query 3 looks at key 2. An estimate from the last two
    rows with a budget of one column keeps column 1, and query 3 loses almost all its mass."""
    n, big = 6, 10.0
    q = torch.zeros(1, 1, n, 3, dtype=F64)
    k = torch.zeros(1, 1, n, 3, dtype=F64)
    k[0, 0, 1, 0] = big
    k[0, 0, 2, 1] = big
    q[0, 0, 4:, 0] = 1.0
    q[0, 0, 3, 1] = 1.0
    vertical, slash = vertical_slash_index(q, k, 1, 1, last_q=2, local_diagonals=1, scale=1.0)
    assert vertical.tolist() == [[[1]]] and slash.tolist() == [[[0]]]
    # the same choice from an explicit softmax of the last two rows
    col = [0.0] * n
    for i in (4, 5):
        logits = [float(q[0, 0, i] @ k[0, 0, j]) for j in range(i + 1)]
        zi = sum(math.exp(x) for x in logits)
        for j, x in enumerate(logits):
            col[j] += math.exp(x) / zi
    assert max(range(n), key=col.__getitem__) == 1
    # query 3 reads {1, 3}; densely it puts e^10 / (e^10 + 3) on key 2
    mask = vertical_slash_mask(n, vertical, slash)[0, 0]
    assert [j for j in range(n) if mask[3, j]] == [1, 3]
    dense = dense_attention_probs(q, k, scale=1.0)[0, 0]
    assert math.isclose(float(dense[3, 2]), math.exp(big) / (math.exp(big) + 3), rel_tol=1e-12)
    kept = float(dense[3][mask[3]].sum())
    assert math.isclose(kept, 2 / (math.exp(big) + 3), rel_tol=1e-12) and kept < 1e-3
    # while the sampled rows themselves keep nearly everything
    assert float(dense[5][mask[5]].sum()) > 0.99


# --- masks vs brute-force loops ------------------------------------------------------------

def _rows(x: torch.Tensor) -> list[list[int]]:
    return x.reshape(-1, x.shape[-1]).tolist()


@given(st.data())
def test_vertical_slash_mask_brute_force(data) -> None:
    n = data.draw(st.integers(1, 40))
    vertical, slash = data.draw(vertical_slash_indices(2, 2, n, max_vertical=6, max_slash=6))
    mask = vertical_slash_mask(n, vertical, slash).reshape(4, n, n)
    for r, (cols, offs) in enumerate(zip(_rows(vertical), _rows(slash))):
        for i in range(n):
            want = {j for j in cols if 0 <= j <= i} | {i - d for d in offs if d >= 0 and i - d >= 0}
            assert {j for j in range(n) if mask[r, i, j]} == want


@given(st.data())
def test_block_sparse_mask_brute_force(data) -> None:
    n = data.draw(st.integers(1, 40))
    block = data.draw(st.sampled_from((1, 3, 8, 16, 64)))
    blocks = data.draw(block_sparse_indices(1, 2, n, block, max_k=4))
    mask = block_sparse_mask(n, blocks, block).reshape(2, n, n)
    for h in range(2):
        for i in range(n):
            chosen = {int(x) for x in blocks[0, h, i // block] if x >= 0}
            assert {j for j in range(n) if mask[h, i, j]} == {j for j in range(i + 1) if j // block in chosen}


@given(st.integers(0, 40), st.integers(0, 45), st.integers(1, 45))
def test_ashape_mask_brute_force(n: int, sink: int, window: int) -> None:
    mask = ashape_mask(n, sink, window)
    for i in range(n):
        want = set(range(min(sink - 1, i) + 1)) | set(range(max(0, i - window + 1), i + 1))
        assert {j for j in range(n) if mask[i, j]} == want


def test_causal_and_length_masks() -> None:
    assert causal_mask(0).shape == (0, 0)
    assert causal_mask(4).tolist() == [[j <= i for j in range(4)] for i in range(4)]
    lm = length_mask(4, _t([2, 0]))
    assert lm.shape == (2, 1, 4, 4)
    assert lm[0, 0].tolist() == [[i < 2 and j < 2 for j in range(4)] for i in range(4)] and not lm[1].any()


# --- masked attention vs an explicit per-query softmax ---------------------------------------

def _brute_attention(q, k, v, keys_of, scale, seqlens, seqstarts, heads):
    """Per query: softmax over the listed keys, written out. ``keys_of(b, g, i, n)`` gives the
    logical keys of local query ``i`` for computed head index ``g``."""
    B, Hq, N, D = q.shape
    group = Hq // k.shape[1]
    lens = [N] * B if seqlens is None else seqlens.tolist()
    starts = [0] * B if seqstarts is None else seqstarts.tolist()
    ids = list(range(Hq)) if heads is None else heads.tolist()
    out = torch.zeros(B, Hq, N, D, dtype=F64)
    lse = torch.full((B, Hq, N), float("-inf"), dtype=F64)
    for b in range(B):
        s, n = starts[b], lens[b]
        for g, h in enumerate(ids):
            for i in range(n):
                keys = sorted(keys_of(b, g, i, n))
                if not keys:
                    continue
                qi = q[b, h, s + i].double()
                kk = torch.stack([k[b, h // group, s + j].double() for j in keys])
                vv = torch.stack([v[b, h // group, s + j].double() for j in keys])
                logits = (kk @ qi) * scale
                w = torch.softmax(logits, 0)
                out[b, h, s + i] = w @ vv
                lse[b, h, s + i] = torch.logsumexp(logits, 0)
    return out, lse


def _problem(data, max_n=24):
    shape = data.draw(attention_shapes(max_n=max_n, head_dims=(4, 8)))
    seqlens, seqstarts = data.draw(ragged_rows(shape.B, shape.N))
    heads = data.draw(head_subsets(shape.Hq))
    q, k, v = qkv(shape, F64, "cpu", seed=data.draw(st.integers(0, 1000)), sharpness=2.0)
    Hg = shape.Hq if heads is None else len(heads)
    return shape, q, k, v, seqlens, seqstarts, heads, Hg


def _check_against_brute(res, brute) -> None:
    (out, lse), (bout, blse) = res, brute
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.allclose(out, bout, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(blse))
    assert torch.allclose(lse[torch.isfinite(blse)], blse[torch.isfinite(blse)], rtol=1e-10, atol=1e-12)


@given(st.data())
def test_vertical_slash_attention_brute_force(data) -> None:
    shape, q, k, v, seqlens, seqstarts, heads, Hg = _problem(data)
    vertical, slash = data.draw(vertical_slash_indices(shape.B, Hg, shape.N, max_vertical=5, max_slash=5))
    scale = shape.D**-0.5

    def keys_of(b, g, i, n):
        return {j for j in vertical[b, g].tolist() if 0 <= j <= i} | {
            i - d for d in slash[b, g].tolist() if d >= 0 and i - d >= 0
        }

    res = vertical_slash_attention(q, k, v, vertical, slash, seqlens=seqlens, seqstarts=seqstarts, heads=heads,
                                   return_lse=True)
    _check_against_brute(res, _brute_attention(q, k, v, keys_of, scale, seqlens, seqstarts, heads))


@given(st.data())
def test_block_sparse_attention_brute_force(data) -> None:
    shape, q, k, v, seqlens, seqstarts, heads, Hg = _problem(data)
    block = data.draw(st.sampled_from((1, 4, 16)))
    blocks = data.draw(block_sparse_indices(shape.B, Hg, shape.N, block, max_k=3))

    def keys_of(b, g, i, n):
        chosen = {x for x in blocks[b, g, i // block].tolist() if x >= 0}
        return {j for j in range(i + 1) if j // block in chosen}

    res = block_sparse_attention(q, k, v, blocks, block=block, seqlens=seqlens, seqstarts=seqstarts, heads=heads,
                                 return_lse=True)
    _check_against_brute(res, _brute_attention(q, k, v, keys_of, shape.D**-0.5, seqlens, seqstarts, heads))


@given(st.data())
def test_ashape_attention_brute_force(data) -> None:
    shape, q, k, v, seqlens, seqstarts, heads, Hg = _problem(data)
    offset = data.draw(st.integers(0, 3))
    sink, window = data.draw(ashape_budgets(offset + shape.Hq, max_n=shape.N))
    ids = list(range(shape.Hq)) if heads is None else heads.tolist()

    def budget(x, g):
        return x if isinstance(x, int) else int(x[offset + ids[g]])

    def keys_of(b, g, i, n):
        s, w = budget(sink, g), budget(window, g)
        return set(range(min(s, i + 1))) | set(range(max(0, i - w + 1), i + 1))

    res = ashape_attention(q, k, v, sink, window, seqlens=seqlens, seqstarts=seqstarts, heads=heads,
                           head_offset=offset, return_lse=True)
    _check_against_brute(res, _brute_attention(q, k, v, keys_of, shape.D**-0.5, seqlens, seqstarts, heads))


@given(st.data())
def test_dense_attention_and_probs_brute_force(data) -> None:
    shape, q, k, v, seqlens, seqstarts, heads, Hg = _problem(data)

    def keys_of(b, g, i, n):
        return set(range(i + 1))

    res = dense_attention(q, k, v, seqlens=seqlens, seqstarts=seqstarts, heads=heads, return_lse=True)
    _check_against_brute(res, _brute_attention(q, k, v, keys_of, shape.D**-0.5, seqlens, seqstarts, heads))
    probs = dense_attention_probs(q, k, seqlens=seqlens, seqstarts=seqstarts)
    lens = [shape.N] * shape.B if seqlens is None else seqlens.tolist()
    for b in range(shape.B):
        n = lens[b]
        rows = probs[b, :, :n, :n].sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows)) and not probs[b, :, n:].any() and not probs[b, ..., n:].any()
        assert not probs[b, :, :n, :n].triu(1).any()


# --- policies: empty rows, GQA, ragged, heads ------------------------------------------------

def test_empty_rows_are_zero_with_minus_inf_lse() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=F64) for _ in range(3))
    none = torch.full((1, 2, 2), -1, dtype=I32)
    out, lse = vertical_slash_attention(q, k, v, none, none, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # a vertical column only: rows before it are empty, rows after it copy its value
    out, lse = vertical_slash_attention(q, k, v, _t([[[3, -1], [3, -1]]]), none, return_lse=True)
    assert not out[..., :3, :].any() and torch.isneginf(lse[..., :3]).all()
    assert torch.equal(out[..., 3:, :], v[..., 3:4, :].expand(1, 2, 2, 4))
    blocks = torch.full((1, 2, 2, 1), -1, dtype=I32)
    out, lse = block_sparse_attention(q, k, v, blocks, block=4, return_lse=True)
    assert not out.any() and torch.isneginf(lse).all()
    # zero-length rows and padding tokens: zeros and -inf whatever the pattern
    out, lse = dense_attention(q, k, v, seqlens=_t([0]), return_lse=True)
    assert not out.any() and torch.isneginf(lse).all()
    out, lse = ashape_attention(q, k, v, 1, 2, seqlens=_t([3]), seqstarts=_t([1]), return_lse=True)
    assert not out[..., [0, 4], :].any() and torch.isneginf(lse[..., [0, 4]]).all()
    assert torch.isfinite(lse[..., 1:4]).all()


def test_gqa_query_head_reads_its_group_kv_head() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 6, 7, 4, generator=g, dtype=F64)
    k = torch.randn(1, 2, 7, 4, generator=g, dtype=F64)
    v = torch.randn(1, 2, 7, 4, generator=g, dtype=F64)
    out = dense_attention(q, k, v)
    for h in range(6):
        kv = h // 3  # heads 0, 1, 2 -> kv 0; heads 3, 4, 5 -> kv 1
        single = dense_attention(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1])
        assert torch.equal(out[:, h : h + 1], single)
        other = dense_attention(q[:, h : h + 1], k[:, 1 - kv : 2 - kv], v[:, 1 - kv : 2 - kv])
        assert not torch.allclose(out[:, h : h + 1], other)


def test_ragged_row_equals_the_row_alone() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g, dtype=F64) for _ in range(3))
    vertical, slash = _t([[[0, 4]] * 2] * 2), _t([[[0, 1]] * 2] * 2)
    lens, starts = _t([5, 9]), _t([3, 0])
    out = vertical_slash_attention(q, k, v, vertical, slash, seqlens=lens, seqstarts=starts)
    alone = vertical_slash_attention(q[:1, :, 3:8], k[:1, :, 3:8], v[:1, :, 3:8], vertical[:1], slash[:1])
    assert torch.equal(out[:1, :, 3:8], alone)  # indices are logical: column 4 is the row's 5th token
    assert not out[0, :, :3].any() and not out[0, :, 8:].any()
    full = vertical_slash_attention(q[1:], k[1:], v[1:], vertical[1:], slash[1:])
    assert torch.equal(out[1:], full)


def test_heads_subset_leaves_other_heads_zero() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 6, 4, generator=g, dtype=F64) for _ in range(3))
    heads = _t([2, 0])
    vertical, slash = _t([[[1], [5]]]), _t([[[0], [1]]])
    out = vertical_slash_attention(q, k, v, vertical, slash, heads=heads)
    assert not out[:, [1, 3]].any()
    want2 = vertical_slash_attention(q[:, 2:3], k[:, 2:3], v[:, 2:3], vertical[:, :1], slash[:, :1])
    want0 = vertical_slash_attention(q[:, :1], k[:, :1], v[:, :1], vertical[:, 1:], slash[:, 1:])
    assert torch.equal(out[:, 2:3], want2) and torch.equal(out[:, :1], want0)
    empty = _t([])
    assert not ashape_attention(q, k, v, 1, 2, heads=empty).any()
    assert not vertical_slash_attention(q, k, v, vertical[:, :0], slash[:, :0], heads=empty).any()


def test_same_dtype_reference_is_close_but_not_exact() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 33, 16, generator=g).half() for _ in range(3))
    mask = causal_mask(33)
    ref64, _ = masked_attention(q, k, v, mask)
    ref16, _ = masked_attention(q, k, v, mask, compute_dtype=torch.float16)
    err = float((ref16 - ref64).abs().max())
    assert 0 < err < 1e-2


# --- input validation ----------------------------------------------------------------------

def _small():
    g = torch.Generator().manual_seed(6)
    return (torch.randn(1, 2, 5, 4, generator=g, dtype=F64), torch.randn(1, 1, 5, 4, generator=g, dtype=F64),
            torch.randn(1, 1, 5, 4, generator=g, dtype=F64))


def _vs(q, k, v, vertical=None, slash=None, **kw):
    vertical = _t([[[0], [1]]]) if vertical is None else vertical
    slash = _t([[[0], [0]]]) if slash is None else slash
    return vertical_slash_attention(q, k, v, vertical, slash, **kw)


def test_qkv_errors() -> None:
    q, k, v = _small()
    for fn in (lambda *a, **kw: dense_attention(*a, **kw), _vs,
               lambda *a, **kw: ashape_attention(*a, 1, 2, **kw),
               lambda *a, **kw: block_sparse_attention(*a, _t([[[[0]], [[0]]]]), block=8, **kw)):
        with pytest.raises(ValueError, match="rank"):
            fn(q[0], k, v)
        with pytest.raises(TypeError, match="dtype"):
            fn(q.int(), k, v)
        with pytest.raises(TypeError, match="share a dtype"):
            fn(q.float(), k, v)
        with pytest.raises(ValueError, match="multiple of kv heads"):
            fn(q[:, :1], torch.cat([k, k], 1), torch.cat([v, v], 1))
        with pytest.raises(ValueError, match="k must be"):
            fn(q, k[:, :, :4], v[:, :, :4])
        with pytest.raises(ValueError, match="same shape"):
            fn(q, k, v[..., :3])
        with pytest.raises(ValueError, match="k is a meta tensor"):  # refused before the device check
            fn(q, k.to("meta"), v)
        if torch.cuda.is_available():
            with pytest.raises(ValueError, match="one device"):
                fn(q, k.cuda(), v)
        with pytest.raises(TypeError, match="torch.Tensor"):
            fn(q.tolist(), k, v)
        with pytest.raises(ValueError, match="scale"):
            fn(q, k, v, scale=-1.0)
        with pytest.raises(ValueError, match="seqlens"):
            fn(q, k, v, seqlens=_t([6]))
        with pytest.raises(ValueError, match="seqlens"):
            fn(q, k, v, seqlens=_t([-1]))
        with pytest.raises(ValueError, match="seqstarts"):
            fn(q, k, v, seqlens=_t([3]), seqstarts=_t([3]))
        with pytest.raises(ValueError, match="seqlens"):
            fn(q, k, v, seqlens=_t([3, 3]))
        with pytest.raises(TypeError, match="seqlens"):
            fn(q, k, v, seqlens=_t([3.0], F64))
        with pytest.raises(ValueError, match="heads"):
            fn(q, k, v, heads=_t([0, 0]))
        with pytest.raises(ValueError, match="heads"):
            fn(q, k, v, heads=_t([2]))


def test_index_errors() -> None:
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"vertical entries must lie in \[-1, 5\)"):
        _vs(q, k, v, vertical=_t([[[5], [0]]]))
    with pytest.raises(ValueError, match="slash entries"):
        _vs(q, k, v, slash=_t([[[-2], [0]]]))
    with pytest.raises(ValueError, match="vertical axis 1"):
        _vs(q, k, v, vertical=_t([[[0]]]))
    with pytest.raises(ValueError, match="vertical axis 1"):  # one row per computed head
        _vs(q, k, v, heads=_t([1]))
    with pytest.raises(ValueError, match="rank 3"):
        _vs(q, k, v, slash=_t([[0, 0]]))
    with pytest.raises(TypeError, match="slash must have dtype"):
        _vs(q, k, v, slash=torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="vertical is a meta tensor"):
        _vs(q, k, v, vertical=_t([[[0], [1]]]).to("meta"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="vertical must be on"):
            _vs(q, k, v, vertical=_t([[[0], [1]]]).cuda())
    with pytest.raises(ValueError, match="blocks entries"):
        block_sparse_attention(q, k, v, _t([[[[1]], [[0]]]]), block=8)
    with pytest.raises(ValueError, match="blocks axis 2"):
        block_sparse_attention(q, k, v, _t([[[[0]], [[0]]]]), block=2)
    with pytest.raises(ValueError, match="block"):
        block_sparse_attention(q, k, v, _t([[[[0]], [[0]]]]), block=0)


def test_budget_errors() -> None:
    q, k, v = _small()
    with pytest.raises(ValueError, match="sink must be >= 0"):
        ashape_attention(q, k, v, -1, 2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        ashape_attention(q, k, v, 1, 0)
    with pytest.raises(TypeError, match="sink"):
        ashape_attention(q, k, v, True, 2)
    with pytest.raises(TypeError, match="window"):
        ashape_attention(q, k, v, 1, 2.5)
    with pytest.raises(ValueError, match="global head 3"):
        ashape_attention(q, k, v, _t([1, 1, 1]), 2, head_offset=2)
    with pytest.raises(ValueError, match="head_offset"):
        ashape_attention(q, k, v, _t([1, 1]), 2, head_offset=-1)
    with pytest.raises(ValueError, match="sink must be >= 0"):
        ashape_attention(q, k, v, _t([1, -1]), 2)


def test_mask_function_errors() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        causal_mask(-1)
    with pytest.raises(TypeError, match="n must be an int"):
        ashape_mask(4.0, 1, 1)
    with pytest.raises(ValueError, match="share leading dims"):
        vertical_slash_mask(4, _t([[0]]), _t([[0], [0]]))
    with pytest.raises(TypeError, match="vertical"):
        vertical_slash_mask(4, torch.zeros(1, 1), _t([[0]]))
    with pytest.raises(ValueError, match="NQB=2"):
        block_sparse_mask(4, _t([[[0]]]), 2)
    with pytest.raises(ValueError, match="block must be a positive int"):
        block_sparse_mask(4, _t([[0]]), -2)
    with pytest.raises(TypeError, match="seqlens"):
        length_mask(4, _t([1.0], F64))
    q, k, v = _small()
    with pytest.raises(TypeError, match="mask must be a bool"):
        masked_attention(q, k, v, causal_mask(5).int())
    with pytest.raises(ValueError, match="mask"):
        masked_attention(q, k, v, causal_mask(5).to("meta"))
    with pytest.raises(ValueError, match="mask"):
        masked_attention(q, k, v, causal_mask(4))


def test_slash_set_fills_short_gaps_only():
    """Brute force: x is added iff its nearest chosen neighbours a < x < b have b - a - 1 <= G."""
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(1, 60, (1,), generator=g))
        slash = torch.randint(-1, n + 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        G = trial % 7
        chosen = {int(x) for x in slash if 0 <= int(x) < n}
        want = set(chosen)
        for x in range(n):
            below = [a for a in chosen if a < x]
            above = [b for b in chosen if b > x]
            if below and above and min(above) - max(below) - 1 <= G:
                want.add(x)
        got = slash_set(n, slash, G)
        assert {i for i in range(n) if got[i]} == want, (n, slash.tolist(), G)
    assert torch.equal(slash_set(10, torch.tensor([2, 7]), 3), slash_set(10, torch.tensor([2, 7]), 0))
    assert slash_set(10, torch.tensor([2, 7]), 4)[2:8].all()
    with pytest.raises(ValueError, match="fill_gaps"):
        slash_set(10, torch.tensor([2]), -1)
