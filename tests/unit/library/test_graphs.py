"""minference.graphs.PrefillGraphs: the CUDA-graph cache of sparse_prefill.

On the CPU: the direct path is sparse_prefill itself; the cache's bookkeeping (keys, shared static
buffers, capture order, LRU eviction, limits, errors, the integration and eval wiring) runs with
the two device steps (capture, stream ordering) replaced by eager ones, so every "replay" is a real
sparse_prefill on the static buffers. On the GPU (marker ``gpu``): real captures and replays
against direct calls, bit for bit, and no host sync in a replay.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import minference.graphs as G
import minference.integration as I
from minference.config import PatternConfig, Provenance, model_signature
from minference.dispatch import sparse_prefill
from minference.graphs import PrefillGraphs
from minference.index import prepare_plan
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing.strategies import AttnShape, qkv

B, HQ, HKV, N, D = 2, 4, 2, 96, 16
PLAN = [
    VerticalSlash(vertical=8, slash=12, last_q=16, sink_columns=2, local_diagonals=2),
    AShape(sink=4, window=24),
    BlockSparse(top_k=3, block=16, sink_blocks=1),
    Dense(),
]
OTHER_PLAN = [AShape(sink=2, window=16), VerticalSlash(vertical=4, slash=20, last_q=16), Dense(),
              BlockSparse(top_k=2, block=16)]
KW = dict(dense_threshold=0)


def _inputs(seed: int, *, n: int = N, dtype=torch.float32, layout: str = "contiguous", b: int = B):
    return qkv(AttnShape(B=b, Hq=HQ, Hkv=HKV, N=n, D=D), dtype, "cpu", seed, layout=layout)


def _rows(seed: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(n // 2, n + 1, (B,), generator=g, dtype=torch.int32)
    starts = torch.stack([torch.randint(0, int(n - l) + 1, (1,), generator=g)[0] for l in lens]).to(torch.int32)
    return lens, starts


class EagerSteps(G._CudaSteps):
    """Device steps that run on the CPU: a "capture" runs the warm-up and hands back the step
    itself as the replay (so each replay is a real sparse_prefill on the static buffers)."""

    def __init__(self, retained: int = 0) -> None:
        super().__init__()
        self.retained = retained
        self.captured = 0

    def graphable(self, tensors, backend):
        return all(isinstance(x, torch.Tensor) for x in tensors.values())

    def pool(self, device):
        return object()

    def order_streams(self, group):
        pass

    def capture(self, step, group, warmup):
        for _ in range(warmup):
            step()
        self.captured += 1
        return step, self.retained


def eager_graphs(**kw) -> PrefillGraphs:
    graphs = PrefillGraphs(**kw)
    graphs._steps = EagerSteps()
    return graphs


def _direct(q, k, v, plan=PLAN, **kw):
    return sparse_prefill(q, k, v, plan, validate=False, **KW, **kw)


# ---- the direct path ------------------------------------------------------------------------


@pytest.mark.parametrize("ragged", [False, True])
def test_the_cpu_path_is_sparse_prefill(ragged):
    graphs = PrefillGraphs()
    q, k, v = _inputs(0)
    rows = dict(zip(("seqlens", "seqstarts"), _rows(1))) if ragged else {}
    got = graphs(0, q, k, v, PLAN, **KW, **rows)
    assert torch.equal(got, _direct(q, k, v, **rows))
    assert graphs.stats["direct"] == 1 and len(graphs) == 0 and graphs.shapes == 0


def test_only_cuda_triton_calls_are_graphable():
    steps = G._CudaSteps()
    q, k, v = _inputs(0)
    assert not steps.graphable({"q": q, "k": k, "v": v}, "auto")  # CPU tensors
    assert not steps.graphable({"q": None, "k": k, "v": v}, "auto")


def test_validate_true_runs_directly_and_checks_values():
    graphs = eager_graphs()
    q, k, v = _inputs(0)
    q[0, 1, 5, 3] = float("nan")
    with pytest.raises(ValueError, match="q"):
        graphs(0, q, k, v, PLAN, validate=True, **KW)
    assert graphs.stats["direct"] == 1 and len(graphs) == 0
    out = graphs(0, q, k, v, PLAN, **KW)  # validate defaults to False: no host read of the values
    assert out.shape == q.shape and graphs.stats["captures"] == 1


# ---- replay (eager stand-in for the graph) ----------------------------------------------------


def test_replays_see_each_call_s_inputs():
    graphs = eager_graphs()
    outs = []
    for seed in range(3):
        q, k, v = _inputs(seed)
        got = graphs("layer", q, k, v, PLAN, **KW)
        assert torch.equal(got, _direct(q, k, v))
        outs.append(got.clone())
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 3 and graphs._steps.captured == 1
    assert not torch.equal(outs[0], outs[1])  # no stale output


def test_keys_of_one_shape_share_buffers_and_get_their_own_results():
    graphs = eager_graphs()
    for seed in range(3):
        q0, k0, v0 = _inputs(2 * seed)
        out0 = graphs(0, q0, k0, v0, PLAN, **KW)
        assert torch.equal(out0, _direct(q0, k0, v0))
        q1, k1, v1 = _inputs(2 * seed + 1)
        out1 = graphs(1, q1, k1, v1, OTHER_PLAN, **KW)
        assert torch.equal(out1, _direct(q1, k1, v1, OTHER_PLAN))
        assert out0 is out1  # one static output: the second call overwrote the first's result
    assert len(graphs) == 2 and graphs.shapes == 1 and graphs.stats["captures"] == 2


def test_ragged_rows_are_inputs():
    graphs = eager_graphs()
    for seed in range(3):
        q, k, v = _inputs(seed)
        lens, starts = _rows(10 + seed)
        got = graphs(0, q, k, v, PLAN, seqlens=lens, seqstarts=starts, **KW)
        assert torch.equal(got, _direct(q, k, v, seqlens=lens, seqstarts=starts))
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 3


def test_the_key_tells_shapes_dtypes_strides_and_arguments_apart():
    graphs = eager_graphs(max_shapes=16)
    q, k, v = _inputs(0)
    lens, starts = _rows(1)

    def check(n_graphs, n_shapes, *inputs, key=0, plan=PLAN, **kw):
        got = graphs(key, *inputs, plan, **KW, **kw)
        assert torch.equal(got, _direct(*inputs, plan, **kw))
        assert (len(graphs), graphs.shapes) == (n_graphs, n_shapes)

    check(1, 1, q, k, v)
    check(1, 1, q, k, v)  # the same call again: a replay
    check(2, 2, *_inputs(0, n=80))  # length
    check(3, 3, *_inputs(0, dtype=torch.float64))  # dtype
    check(4, 4, *_inputs(0, layout="transposed"))  # strides (transformers' layout)
    check(5, 5, *_inputs(0, b=1))  # batch
    check(6, 6, q, k, v, seqlens=lens)  # a ragged tensor given
    check(6, 6, q, k, v, seqlens=lens.flip(0))  # ... with other values: the same graph
    check(7, 7, q, k, v, seqlens=lens, seqstarts=starts)
    check(8, 8, q, k, v, seqlens=lens.long())  # its dtype
    # the same shape group (q, k, v), other non-tensor arguments: new graphs at the end of the round
    check(9, 8, q, k, v, dense_tail=8)
    check(10, 8, q, k, v, fill_gaps=0)
    check(11, 8, q, k, v, scale=0.2)
    check(12, 8, q, k, v, plan=OTHER_PLAN)
    check(13, 8, q, k, v, key=1)
    assert graphs.stats["captures"] == 13 and graphs.stats["out_of_order"] == 0


def test_capture_order_is_enforced():
    graphs = eager_graphs()
    inputs = [_inputs(s) for s in range(4)]
    plans = [PLAN, OTHER_PLAN, PLAN]

    def call(key):
        q, k, v = inputs[key]
        got = graphs(key, q, k, v, plans[key % 3], **KW)
        assert torch.equal(got, _direct(q, k, v, plans[key % 3]))
        return got

    static = [call(key) for key in (0, 1, 2)][0]  # captured in this order
    assert [call(key) is static for key in (0, 1, 2)] == [True] * 3  # a round in order: replays
    assert call(0) is static
    assert call(2) is not static  # skips 1: run directly
    assert graphs.stats["out_of_order"] == 1
    assert call(1) is static and call(2) is static  # the round goes on where it was
    assert call(0) is static
    assert call(3) is not static  # a new key in the middle of a round: directly, not captured
    assert graphs.stats["out_of_order"] == 2 and len(graphs) == 3
    assert call(1) is static and call(2) is static
    assert call(3) is static  # at the end of the round: captured
    assert len(graphs) == 4 and graphs.stats["captures"] == 4


def test_lru_eviction_and_clear():
    graphs = eager_graphs(max_shapes=2)
    a, b, c = (_inputs(0, n=n) for n in (64, 80, 96))
    for x in (a, b, a, c):  # c evicts b, the least recently used
        graphs(0, *x, PLAN, **KW)
    assert graphs.shapes == 2 and graphs.stats["evictions"] == 1 and graphs.stats["captures"] == 3
    assert torch.equal(graphs(0, *a, PLAN, **KW), _direct(*a))
    assert graphs.stats["captures"] == 3  # a was kept
    assert torch.equal(graphs(0, *b, PLAN, **KW), _direct(*b))
    assert graphs.stats["captures"] == 4 and graphs.stats["evictions"] == 2  # b again: it evicted c
    graphs.clear()
    assert len(graphs) == 0 and graphs.shapes == 0
    assert torch.equal(graphs(0, *a, PLAN, **KW), _direct(*a))
    assert graphs.stats["captures"] == 5


def test_graphs_per_shape_are_bounded():
    graphs = eager_graphs(max_graphs_per_shape=2)
    q, k, v = _inputs(0)
    for key in (0, 1):
        graphs(key, q, k, v, PLAN, **KW)
    assert torch.equal(graphs(2, q, k, v, PLAN, **KW), _direct(q, k, v))
    assert len(graphs) == 2 and graphs.stats["over_limit"] == 1


def test_a_failed_capture_keeps_nothing():
    graphs = eager_graphs()
    q, k, v = _inputs(0)
    with pytest.raises(ValueError):
        graphs(0, q, k, v, PLAN[:2], **KW)  # a plan for 2 of the 4 heads: sparse_prefill refuses it
    assert len(graphs) == 0 and graphs.shapes == 0
    assert torch.equal(graphs(0, q, k, v, PLAN, **KW), _direct(q, k, v))


def test_a_group_made_in_inference_mode_is_usable_outside_it():
    graphs = eager_graphs()
    q, k, v = _inputs(0)
    with torch.inference_mode():
        graphs(0, q, k, v, PLAN, **KW)
    q2, k2, v2 = _inputs(1)
    assert torch.equal(graphs(0, q2, k2, v2, PLAN, **KW), _direct(q2, k2, v2))


def test_the_capture_pins_the_plan_s_device_tensors():
    graphs = eager_graphs()
    q, k, v = _inputs(0)
    graphs(0, q, k, v, PLAN, head_offset=0, **KW)
    (group,) = graphs._groups.values()
    (graph,) = group.graphs.values()
    assert graph.pinned is prepare_plan(PLAN, HQ, 0, q.device)  # the dispatcher's cached tensors, held


def test_memory_left_in_the_pool_is_counted_and_warned_about_once():
    graphs = PrefillGraphs()
    graphs._steps = EagerSteps(retained=512)
    q, k, v = _inputs(0)
    with pytest.warns(RuntimeWarning, match="512 bytes"):
        graphs(0, q, k, v, PLAN, **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphs(1, q, k, v, PLAN, **KW)
    assert graphs.stats["retained_bytes"] == 1024


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(max_shapes=0), ValueError, "max_shapes must be an int >= 1"),
    (dict(max_shapes=True), ValueError, "max_shapes"),
    (dict(max_shapes=2.0), ValueError, "max_shapes"),
    (dict(max_graphs_per_shape=-1), ValueError, "max_graphs_per_shape"),
    (dict(warmup=0), ValueError, "warmup"),
])
def test_bad_settings(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        PrefillGraphs(**kwargs)


def test_bad_calls():
    q, k, v = _inputs(0)
    for graphs in (PrefillGraphs(), eager_graphs()):  # the same errors on the direct and the graph path
        with pytest.raises(TypeError, match="key must be hashable"):
            graphs([0], q, k, v, PLAN, **KW)
        with pytest.raises(TypeError, match="q given as keyword"):
            graphs(0, q, k, v, PLAN, q=q)
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            graphs(0, None, k, v, PLAN, **KW)
    graphs = eager_graphs()
    with pytest.raises(TypeError, match="scale is not"):
        graphs(0, q, k, v, PLAN, scale=[0.25], **KW)
    with pytest.raises(TypeError, match="plan must be a sequence"):
        graphs(0, q, k, v, (p for p in PLAN), **KW)
    with pytest.raises(TypeError, match="unexpected keyword"):
        graphs(0, q, k, v, PLAN, windw=3, **KW)  # sparse_prefill's own error
    assert len(graphs) == 0


# ---- integration and eval wiring --------------------------------------------------------------

LAYERS = 2


def _tiny_llama(heads: int = HQ, kv: int = HKV, hidden: int = 64, device="cpu", dtype=torch.float32):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=heads, num_key_value_heads=kv, pad_token_id=0, eos_token_id=1,
                        bos_token_id=1, max_position_embeddings=8192)
    return T.LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)


def _config(model, plans):
    return PatternConfig(model_signature(model), plans, Provenance(package_version="test"))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_patch_runs_every_layer_through_one_cache():
    model = _tiny_llama()
    cfg = _config(model, [PLAN, OTHER_PLAN])
    ids = [torch.randint(2, 64, (1, 80), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    I.patch(model, cfg, dense_threshold=0)
    want = [_logits(model, x) for x in ids]
    I.patch(model, cfg, dense_threshold=0, cuda_graphs=True)  # on the CPU: direct calls
    states = I.layer_states(model)
    caches = {id(s.graphs) for s in states.values()}
    assert len(caches) == 1 and isinstance(states[0].graphs, PrefillGraphs)
    assert all(torch.equal(_logits(model, x), w) for x, w in zip(ids, want))
    assert states[0].graphs.stats["direct"] == 2 * LAYERS
    graphs = eager_graphs()  # empty (len 0): still used, not mistaken for "no cache"
    I.patch(model, cfg, dense_threshold=0, cuda_graphs=graphs)
    assert all(s.graphs is graphs for s in I.layer_states(model).values())
    assert all(torch.equal(_logits(model, x), w) for x, w in zip(ids, want))
    assert graphs.stats["captures"] == LAYERS and graphs.stats["replays"] == 2 * LAYERS
    assert graphs.stats["out_of_order"] == 0 and graphs.shapes == 1
    I.patch(model, cfg, dense_threshold=0)
    assert all(s.graphs is None for s in I.layer_states(model).values())
    I.unpatch(model)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_patch_refuses_other_cuda_graph_values(value):
    model = _tiny_llama()
    with pytest.raises(TypeError, match="cuda_graphs must be a bool or a PrefillGraphs"):
        I.patch(model, _config(model, [PLAN, PLAN]), cuda_graphs=value)
    assert not I.is_patched(model)


def test_eval_cli_and_patching_take_cuda_graphs(monkeypatch):
    import minference.app.evaluate as E
    from minference.app.cli import build_parser

    assert build_parser().parse_args(["eval", "--cuda-graphs"]).cuda_graphs is True
    assert build_parser().parse_args(["eval"]).cuda_graphs is False
    seen = []
    monkeypatch.setattr(I, "is_patched", lambda model: False)
    monkeypatch.setattr(I, "patch", lambda model, config, **kw: seen.append(kw))
    cache = PrefillGraphs()
    E._apply(object(), object(), None, "auto", False, 0, cache)
    E._apply(object(), object(), None, "auto", False, 0)
    assert seen[0]["cuda_graphs"] is cache and "cuda_graphs" not in seen[1]


def test_eval_refuses_a_non_bool_cuda_graphs(monkeypatch):
    import minference.app.evaluate as E
    import minference.app.models as M

    monkeypatch.setattr(M, "load_model", lambda *a, **kw: pytest.fail("loaded a model for bad arguments"))
    with pytest.raises(E.EvalError, match="cuda_graphs must be a bool"):
        E.run_eval("smollm2", configs=["dense"], lengths=[256], cuda_graphs=1, progress=False)


# ---- GPU: real graphs ---------------------------------------------------------------------------

GPU_N = 4096 + 37
#: Every index builder here is deterministic run to run, so replay and direct call can be compared
#: bit for bit: vertical-slash with last_q <= 64 (one row chunk: at most two atomic adds onto zero
#: per score, which commute) or max aggregation, pooled and query-aware block routing, A-shape.
GPU_PLAN = [
    VerticalSlash(vertical=64, slash=128), AShape(sink=16, window=256), BlockSparse(top_k=8), Dense(),
    VerticalSlash(vertical=32, slash=256, aggregation="max"), AShape(sink=4, window=64),
    BlockSparse(top_k=4, block=128), BlockSparse(top_k=8, rule="relative", threshold=0.1, estimate="query"),
]
GPU_OTHER_PLAN = [AShape(sink=64, window=512)] * 4 + [VerticalSlash(vertical=100, slash=300, last_q=32)] * 4
GPU_KW = dict(dense_threshold=0, backend="triton")


def _gpu_inputs(seed: int, *, b: int = 1, n: int = GPU_N):
    return qkv(AttnShape(B=b, Hq=8, Hkv=2, N=n, D=64), torch.bfloat16, "cuda", seed, layout="transposed")


def _gpu_direct(q, k, v, plan=GPU_PLAN, **kw):
    want = sparse_prefill(q, k, v, plan, validate=False, **GPU_KW, **kw)
    again = sparse_prefill(q, k, v, plan, validate=False, **GPU_KW, **kw)
    assert torch.equal(want, again), "sparse_prefill is not deterministic here: a bitwise comparison means nothing"
    return want


@pytest.mark.gpu
def test_gpu_replay_equals_a_direct_call_bit_for_bit():
    graphs = PrefillGraphs()
    outs, ptrs = [], set()
    for seed in range(4):
        q, k, v = _gpu_inputs(seed)
        want = _gpu_direct(q, k, v, dense_tail=64)
        got = graphs("layer", q, k, v, GPU_PLAN, dense_tail=64, **GPU_KW)
        assert torch.equal(got, want), f"call {seed}: max diff {(got.float() - want.float()).abs().max()}"
        outs.append(got.clone())
        ptrs.add(got.data_ptr())
    s = graphs.stats
    assert (s["captures"], s["replays"], s["direct"], s["retained_bytes"]) == (1, 4, 0, 0)
    assert len(ptrs) == 1  # the static output
    assert not torch.equal(outs[0], outs[1])  # no stale output


@pytest.mark.gpu
def test_gpu_layers_share_buffers_and_each_gets_its_result():
    graphs = PrefillGraphs()
    for seed in range(3):
        q0, k0, v0 = _gpu_inputs(2 * seed)
        want0 = _gpu_direct(q0, k0, v0)
        out0 = graphs(0, q0, k0, v0, GPU_PLAN, **GPU_KW)
        assert torch.equal(out0, want0)
        ptr = out0.data_ptr()
        q1, k1, v1 = _gpu_inputs(2 * seed + 1)
        want1 = _gpu_direct(q1, k1, v1, GPU_OTHER_PLAN)
        out1 = graphs(1, q1, k1, v1, GPU_OTHER_PLAN, **GPU_KW)
        assert torch.equal(out1, want1)
        assert out1.data_ptr() == ptr
    s = graphs.stats
    assert (len(graphs), graphs.shapes, s["captures"], s["replays"], s["out_of_order"]) == (2, 1, 2, 6, 0)
    assert s["retained_bytes"] == 0


@pytest.mark.gpu
def test_gpu_ragged_batch():
    graphs = PrefillGraphs()
    for r in range(3):
        q, k, v = _gpu_inputs(r, b=2)
        lens = torch.tensor([GPU_N - 200 * r, GPU_N - 301 - r], dtype=torch.int32, device="cuda")
        starts = torch.tensor([0, 150 + 50 * r], dtype=torch.int32, device="cuda")
        rows = dict(seqlens=lens, seqstarts=starts)
        want = _gpu_direct(q, k, v, **rows, dense_tail=32)
        got = graphs(0, q, k, v, GPU_PLAN, **rows, dense_tail=32, **GPU_KW)
        assert torch.equal(got, want)
        assert not got[0, :, GPU_N - 200 * r:].any() and not got[1, :, : 150 + 50 * r].any()  # padding rows
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 3


@pytest.mark.gpu
def test_gpu_replay_issues_no_host_sync():
    graphs = PrefillGraphs()
    lens = torch.tensor([GPU_N, GPU_N - 301], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 150], dtype=torch.int32, device="cuda")
    rows = dict(seqlens=lens, seqstarts=starts, **GPU_KW)
    graphs(0, *_gpu_inputs(0, b=2), GPU_PLAN, **rows)  # capture (synchronises: not what is checked)
    graphs(1, *_gpu_inputs(1, b=2), GPU_OTHER_PLAN, **rows)
    inputs = [_gpu_inputs(s, b=2) for s in (2, 3)]
    new_lens = lens - 7
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out0 = graphs(0, *inputs[0], GPU_PLAN, **rows).clone()
        out1 = graphs(1, *inputs[1], GPU_OTHER_PLAN, **dict(rows, seqlens=new_lens))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert graphs.stats["replays"] == 4 and graphs.stats["captures"] == 2
    assert torch.equal(out0, _gpu_direct(*inputs[0], seqlens=lens, seqstarts=starts))
    assert torch.equal(out1, _gpu_direct(*inputs[1], GPU_OTHER_PLAN, seqlens=new_lens, seqstarts=starts))


@pytest.mark.gpu
def test_gpu_out_of_order_calls_run_directly():
    graphs = PrefillGraphs()
    for key, plan in ((0, GPU_PLAN), (1, GPU_OTHER_PLAN)):
        graphs(key, *_gpu_inputs(key), plan, **GPU_KW)
    q, k, v = _gpu_inputs(5)
    got = graphs(1, q, k, v, GPU_OTHER_PLAN, **GPU_KW)  # the round ended at 1: only 0 may come next
    assert graphs.stats["out_of_order"] == 1
    assert torch.equal(got, _gpu_direct(q, k, v, GPU_OTHER_PLAN))
    for key, plan in ((0, GPU_PLAN), (1, GPU_OTHER_PLAN)):
        q, k, v = _gpu_inputs(10 + key)
        assert torch.equal(graphs(key, q, k, v, plan, **GPU_KW), _gpu_direct(q, k, v, plan))
    assert graphs.stats["replays"] == 4


@pytest.mark.gpu
def test_gpu_patched_model_replays_its_layers():
    model = _tiny_llama(heads=8, kv=2, hidden=512, device="cuda", dtype=torch.bfloat16)  # head_dim 64
    cfg = _config(model, [GPU_PLAN, GPU_OTHER_PLAN])
    ids = [torch.randint(2, 64, (1, GPU_N), generator=torch.Generator().manual_seed(s)).cuda() for s in (1, 2, 3)]
    I.patch(model, cfg, dense_threshold=0, dense_tail=64)
    want = [_logits(model, x) for x in ids]
    graphs = PrefillGraphs()
    I.patch(model, cfg, dense_threshold=0, dense_tail=64, cuda_graphs=graphs)
    got = [_logits(model, x) for x in ids]
    I.unpatch(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    s = graphs.stats
    assert (s["captures"], s["replays"], s["out_of_order"], s["direct"]) == (LAYERS, 3 * LAYERS, 0, 0)
