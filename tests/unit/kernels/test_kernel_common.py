"""The argument checks every kernel shares (they raise before any launch), the sync-free path,
the descriptor path, and the tile fitting to a device's shared memory. The recipe every kernel
test follows lives in :mod:`tests.unit.kernels.cases`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from minference.kernels import _common as C
from minference.kernels import block_sparse

from minference import kernels
from minference import reference as ref
from minference.testing.strategies import AttnShape, qkv
from tests.unit.kernels.cases import CUDA, DEVICE, run_and_check

pytestmark = pytest.mark.triton


# --------------------------------------------------------------------------------------------
# argument checks shared by the three kernels: they raise before any launch
# --------------------------------------------------------------------------------------------


def _small(D=64, dtype=torch.float16, N=20):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, N, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(1, 1, N, D, generator=g).to(DEVICE, dtype)
    return q, k, k.clone()


def _calls(q, k, v, **kw):
    """One call of each kernel with valid indices for ``q``."""
    B, H, N, _ = q.shape
    vert = torch.zeros(B, H, 2, dtype=torch.int32, device=q.device)
    sl = torch.zeros(B, H, 2, dtype=torch.int32, device=q.device)
    blocks = torch.zeros(B, H, -(-N // 16), 1, dtype=torch.int32, device=q.device)
    return [
        lambda: kernels.ashape_attention(q, k, v, 2, 4, **kw),
        lambda: kernels.vertical_slash_attention(q, k, v, vert, sl, **kw),
        lambda: kernels.block_sparse_attention(q, k, v, blocks, block=16, **kw),
    ]


@pytest.mark.parametrize("which", range(3))
def test_unsupported_head_dim(which):
    q, k, v = _small(D=48)
    with pytest.raises(ValueError, match="head dim"):
        _calls(q, k, v)[which]()


@pytest.mark.parametrize("which", range(3))
def test_mixed_devices(which):
    q, k, v = _small()
    with pytest.raises(ValueError, match="k is a meta tensor"):  # refused before the device check
        _calls(q, k.to("meta"), v)[which]()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            _calls(q.cuda(), k.cpu(), v.cuda())[which]()


@pytest.mark.parametrize("which", range(3))
def test_bad_dtypes(which):
    q, k, v = _small()
    with pytest.raises(TypeError, match="dtype"):
        _calls(q.double(), k.double(), v.double())[which]()
    with pytest.raises(TypeError, match="share a dtype"):
        _calls(q, k.float(), v)[which]()


@pytest.mark.parametrize("which", range(3))
def test_bad_out_and_heads(which):
    q, k, v = _small()
    with pytest.raises(ValueError, match="out must have shape"):
        _calls(q, k, v, out=torch.empty(1, 2, 19, 64, dtype=q.dtype, device=DEVICE))[which]()
    with pytest.raises(TypeError, match="out must have dtype"):
        _calls(q, k, v, out=torch.empty(1, 2, 20, 64, device=DEVICE))[which]()
    with pytest.raises(ValueError, match="distinct"):
        _calls(q, k, v, heads=torch.tensor([1, 1], device=DEVICE))[which]()
    with pytest.raises(ValueError, match="heads must lie"):
        _calls(q, k, v, heads=torch.tensor([2], device=DEVICE))[which]()
    with pytest.raises(TypeError, match="heads must have dtype"):
        _calls(q, k, v, heads=torch.tensor([0.0], device=DEVICE))[which]()


@pytest.mark.parametrize("which", range(3))
def test_bad_ragged(which):
    q, k, v = _small()
    with pytest.raises(ValueError, match="seqlens"):
        _calls(q, k, v, seqlens=torch.tensor([21], device=DEVICE))[which]()
    with pytest.raises(ValueError, match="seqstarts"):
        lens, starts = torch.tensor([10], device=DEVICE), torch.tensor([11], device=DEVICE)
        _calls(q, k, v, seqlens=lens, seqstarts=starts)[which]()
    with pytest.raises(ValueError, match="seqlens must have shape"):
        _calls(q, k, v, seqlens=torch.tensor([10, 10], device=DEVICE))[which]()


@pytest.mark.parametrize("which", range(3))
def test_nan_or_inf_inside_a_row_is_refused(which):
    q, k, v = _small()
    for name, value in (("q", float("nan")), ("k", float("inf")), ("v", float("-inf"))):
        bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        bad[name][0, 0, 7, 3] = value
        with pytest.raises(ValueError, match=f"{name} holds NaN or inf at batch row 0, token 7"):
            _calls(bad["q"], bad["k"], bad["v"])[which]()
    # padding tokens may hold anything: they are never read, so they are not checked
    lens, starts = torch.tensor([12], device=DEVICE), torch.tensor([4], device=DEVICE)
    pad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    for x in pad.values():
        x[:, :, :4] = float("nan")
        x[:, :, 16:] = float("nan")
    out = _calls(pad["q"], pad["k"], pad["v"], seqlens=lens, seqstarts=starts)[which]()
    assert torch.isfinite(out[:, :, 4:16]).all()
    # an unselected query head is not checked either
    q_bad = q.clone()
    q_bad[0, 1] = float("nan")
    sel = torch.tensor([0], device=DEVICE)
    vert = torch.zeros(1, 1, 2, dtype=torch.int32, device=DEVICE)
    blocks = torch.zeros(1, 1, 2, 1, dtype=torch.int32, device=DEVICE)
    calls = [
        lambda: kernels.ashape_attention(q_bad, k, v, 2, 4, heads=sel),
        lambda: kernels.vertical_slash_attention(q_bad, k, v, vert, vert, heads=sel),
        lambda: kernels.block_sparse_attention(q_bad, k, v, blocks, block=16, heads=sel),
    ]
    assert torch.isfinite(calls[which]()[:, 0]).all()


def test_gqa_ratio_and_scale():
    q, k, v = _small()
    q4, k3 = torch.randn(1, 4, 20, 64, device=DEVICE).half(), torch.randn(1, 3, 20, 64, device=DEVICE).half()
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kernels.ashape_attention(q4, k3, k3, 2, 4)
    with pytest.raises(ValueError, match="scale"):
        kernels.ashape_attention(q, k, v, 2, 4, scale=-1.0)


@pytest.mark.gpu
def test_sync_free_without_validation():
    """validate=False: no host synchronisation anywhere (conversion, normalisation, launch)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N = 1000
    q = torch.randn(2, 4, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 2, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vert = torch.randint(0, N, (2, 4, 50), device="cuda", dtype=torch.int32, generator=g)
    blocks = torch.randint(-1, -(-N // 64), (2, 4, -(-N // 64), 8), device="cuda", dtype=torch.int32, generator=g)
    lens = torch.tensor([N, 700], device="cuda", dtype=torch.int32)
    budgets = torch.tensor([4, 8, 16, 32], device="cuda", dtype=torch.int32)
    calls = [
        lambda: kernels.ashape_attention(q, k, k, budgets, budgets * 8, seqlens=lens, validate=False, return_lse=True),
        lambda: kernels.vertical_slash_attention(q, k, k, vert, vert, seqlens=lens, validate=False, return_lse=True),
        lambda: kernels.block_sparse_attention(q, k, k, blocks, seqlens=lens, validate=False, return_lse=True),
    ]
    for call in calls:  # compile first: the steady state is what must not synchronise
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# the descriptor (TMA) load path, forced under the interpreter on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["ashape", "vertical_slash", "block_sparse"])
def test_descriptor_path_matches_reference(which, monkeypatch):
    """Unmasked tiles read K/V through tensor descriptors on the GPU (contiguous, aligned inputs,
    so every GPU kernel test covers that path there). On CPU the path is forced here: a ragged,
    GQA, head-subset problem whose unmasked tiles exist, checked by the shared recipe, and the
    descriptors must actually have been built."""
    from minference.kernels import _common
    from minference.reference import attention as ref

    from minference.testing.strategies import AttnShape

    module = __import__(f"minference.kernels.{which}", fromlist=["_"])
    built = []

    scratch = []

    def forced(k, v, block_n, block_d):
        pair = _common.kv_descriptors(k, v, block_n, block_d, interpreter=not CUDA)
        built.append(pair[0] is not None)
        scratch.append(k.shape[1] == 3)  # the VS column scratch [B, Hg, NV, D] (k has 2 heads)
        return pair

    monkeypatch.setattr(module, "kv_descriptors", forced)
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=200 if not CUDA else 700, D=64)
    q, k, v = qkv(shape, torch.float16, DEVICE, 7)
    seqlens, seqstarts = torch.tensor([shape.N, shape.N - 60]), torch.tensor([0, 35])
    p = dict(shape=shape, dtype=torch.float16, seqlens=seqlens, seqstarts=seqstarts,
             heads=torch.tensor([3, 0, 2], dtype=torch.int32), q=q, k=k, v=v)
    if which == "ashape":
        run_and_check(p, kernels.ashape_attention, ref.ashape_attention, 5, 70)
    elif which == "vertical_slash":
        vert = torch.tensor([[[1, 90, 17], [3, -1, 60], [0, 0, 150]]] * 2, dtype=torch.int32)
        sl = torch.cat([torch.arange(0, 80).expand(2, 3, 80), torch.full((2, 3, 1), 130)], -1).to(torch.int32)
        run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vert, sl)
        # a run not starting at offset 0 (its last key tile overhangs the range on causal keys)
        # and columns in that overhang, which belong to the column lists, not to the range
        vert = torch.arange(27, 200, 16, dtype=torch.int32).expand(2, 3, -1).contiguous()
        sl = torch.arange(5, 41, dtype=torch.int32).expand(2, 3, -1).contiguous()
        run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vert, sl)
        # gap-filled over block_m - 1: the all-solid build (no bitmap path) through descriptors,
        # with duplicated, unsorted columns and a second run far from the diagonal
        vert = torch.cat([torch.arange(0, shape.N, 3), torch.arange(60, 0, -7)]).to(torch.int32)
        vert = vert.expand(2, 3, -1).contiguous()
        sl = torch.cat([torch.arange(0, 20), torch.arange(shape.N // 2, shape.N // 2 + 7)]).to(torch.int32)
        sl = sl.expand(2, 3, -1).contiguous()
        bm = kernels.vertical_slash_block_m(q)
        index = kernels.convert_vertical_slash(vert.to(DEVICE), sl.to(DEVICE), shape.N, block_m=bm, fill_gaps=bm - 1)
        assert index.all_solid and int(index.run_count.min()) == 2
        run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vert, sl, fill_gaps=bm - 1)
    else:
        for block, split in ((16, 1), (32, 2)):  # the second: each 32-key block read as two 16-key tiles
            monkeypatch.setitem(module._KEY_SPLIT, block, split)
            nqb = -(-shape.N // block)
            blocks = torch.stack([torch.arange(nqb), torch.zeros(nqb, dtype=torch.long),
                                  (torch.arange(nqb) - 3).clamp(min=0)], -1).expand(2, 3, nqb, 3).to(torch.int32)
            run_and_check(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=block)
    assert built and all(built), "the descriptor path did not run"
    assert any(scratch) == (which == "vertical_slash"), "the VS column scratch was not read"


# --------------------------------------------------------------------------------------------
# sharp logits: a masked key dominates the kept ones (catches a mask applied after the exponential)
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# tiles chosen from the device's shared memory (GPUs other than Hopper)
# --------------------------------------------------------------------------------------------

_CANDIDATES = [C.Tiles(128, 128, 8, 3), C.Tiles(128, 128, 8, 2), C.Tiles(128, 64, 8, 2)]
_SHARED = {_CANDIDATES[0]: 234_000, _CANDIDATES[1]: 168_000, _CANDIDATES[2]: 99_000}


@pytest.fixture
def compiled_gpu(monkeypatch):
    """fit_tiles as on a GPU (the interpreter would take the first candidate unprobed)."""
    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.setattr(C, "_FITTED", {})
    monkeypatch.setattr(C, "_DEVICE_SMEM", {0: 232_448})  # an H200's opt-in limit per block
    monkeypatch.delenv(C.SMEM_LIMIT_ENV, raising=False)


def test_fit_tiles_takes_the_first_configuration_that_fits(compiled_gpu, monkeypatch):
    dev = torch.device("cuda", 0)
    tried = []

    def shared(t):
        tried.append(t)
        return _SHARED[t]

    assert C.fit_tiles("k", ("a",), dev, _CANDIDATES, shared) == _CANDIDATES[1]  # 234 KB > 227 KB
    assert tried == _CANDIDATES[:2]
    assert C.fit_tiles("k", ("a",), dev, _CANDIDATES, shared) == _CANDIDATES[1] and len(tried) == 2  # remembered
    monkeypatch.setenv(C.SMEM_LIMIT_ENV, "166912")  # an A100's: another key, probed again
    assert C.fit_tiles("k", ("a",), dev, _CANDIDATES, shared) == _CANDIDATES[2]
    monkeypatch.setenv(C.SMEM_LIMIT_ENV, "50000")
    with pytest.raises(RuntimeError, match="no tile configuration fits 50000 bytes"):
        C.fit_tiles("k", ("a",), dev, _CANDIDATES, shared)
    assert C.fit_tiles("k", ("a",), torch.device("cpu"), _CANDIDATES, shared) == _CANDIDATES[0]  # interpreter


def test_smem_limit_is_the_device_limit_or_the_forced_lower_one(compiled_gpu, monkeypatch):
    dev = torch.device("cuda", 0)
    assert C.smem_limit(dev) == 232_448
    monkeypatch.setenv(C.SMEM_LIMIT_ENV, "101376")
    assert C.smem_limit(dev) == 101_376
    monkeypatch.setenv(C.SMEM_LIMIT_ENV, "999999")  # never above the device's own
    assert C.smem_limit(dev) == 232_448
    for bad in ("lots", "0", "-5"):
        monkeypatch.setenv(C.SMEM_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=C.SMEM_LIMIT_ENV):
            C.smem_limit(dev)


def test_launch_fitted_builds_each_candidate_launch_and_runs_the_fitting_one(compiled_gpu):
    launched = []

    class FakeKernel:  # JITFunction's warmup (compile only) and launch
        def warmup(self, *args, grid, **kwargs):
            return SimpleNamespace(metadata=SimpleNamespace(shared=_SHARED[kwargs["tiles"]]))

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs["tiles"]))

    def call(tiles):
        return (tiles.block_m, 1, 1), ("q",), {"tiles": tiles}

    used = C.launch_fitted("fake", FakeKernel(), torch.device("cuda", 0), (), _CANDIDATES, call)
    assert used == _CANDIDATES[1] and launched == [((128, 1, 1), ("q",), _CANDIDATES[1])]
    assert C.fitted_stages(C.Tiles(64, 64, 4, 3)) == [C.Tiles(64, 64, 4, s) for s in (3, 2, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [166_912, 101_376], ids=["a100", "100KB"])
@pytest.mark.parametrize("which", ["ashape", "vertical_slash", "block_sparse", "block_sparse@128"])
def test_smaller_shared_memory_still_runs_and_matches(which, limit, monkeypatch):
    """The H200 forced to an A100's and a 100 KB budget (MINFERENCE_SMEM_LIMIT): each kernel at
    D = 128, bf16, picks tiles that compile within it and still meets the tolerance rule (block
    128 runs 5 stages at full shared memory, so it must give stages up here)."""
    monkeypatch.setenv(C.SMEM_LIMIT_ENV, str(limit))
    monkeypatch.setattr(C, "_FITTED", {})
    shape = AttnShape(B=2, Hq=4, Hkv=2, N=700, D=128)
    q, k, v = qkv(shape, torch.bfloat16, "cuda", seed=3)
    p = dict(shape=shape, dtype=torch.bfloat16, seqlens=torch.tensor([700, 433], dtype=torch.int32), seqstarts=None,
             heads=None, Hg=4, q=q, k=k, v=v)
    g = torch.Generator().manual_seed(4)
    if which == "ashape":
        run_and_check(p, kernels.ashape_attention, ref.ashape_attention, 16, 200)
    elif which == "vertical_slash":
        vert = torch.randint(-1, 700, (2, 4, 40), generator=g, dtype=torch.int32)
        sl = torch.randint(-1, 700, (2, 4, 60), generator=g, dtype=torch.int32)
        run_and_check(p, kernels.vertical_slash_attention, ref.vertical_slash_attention, vert, sl, fill_gaps=383)
    elif which == "block_sparse":
        blocks = torch.randint(-1, 11, (2, 4, 11, 4), generator=g, dtype=torch.int32)
        run_and_check(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=64)
    else:
        blocks = torch.randint(-1, 6, (2, 4, 6, 3), generator=g, dtype=torch.int32)
        run_and_check(p, kernels.block_sparse_attention, ref.block_sparse_attention, blocks, block=128)
    fitted = [t for (name, _, _, lim), t in C._FITTED.items() if lim == limit]
    assert fitted, "the launch must have gone through fit_tiles"
    if which == "block_sparse@128":
        full = block_sparse.gpu_tiles(q, 128)
        bs = [t for (name, _, _, lim), t in C._FITTED.items() if name == "block_sparse" and lim == limit]
        assert bs and all(t.block_m == 128 and t.num_stages < full.num_stages for t in bs), (C._FITTED, full)
