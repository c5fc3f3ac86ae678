"""Head-sharded tensor parallelism: two gloo processes on localhost against one process.

The whole-model part loads tiny Llama and Qwen2 checkpoints (written here with
``save_pretrained``) with transformers' own tensor parallelism (``tp_plan="auto"`` through
:func:`minference.integration.tensor_parallel_kwargs`), patches them, and compares with the same
checkpoint patched in one process. Every global head has its own pattern, so a rank reading the
wrong head ids changes the output; the index builders run per head on that head's own q/k, so a
head's sparse index is the same in the sharded and the single run.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from minference.distributed import head_shard

WORLD = 2
HEADS, KV, N, D = 4, 2, 40, 16
ARCHS = ("llama", "qwen2")
# fp32 floor of the tolerance rule (docs/verification.md), for logits of magnitude ~1
FLOOR = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan():
    from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

    # every global head different, so reading the wrong head ids changes the output
    return [AShape(sink=1, window=5), VerticalSlash(vertical=3, slash=6, last_q=8, sink_columns=1, local_diagonals=1),
            BlockSparse(top_k=1, block=8, sink_blocks=0), Dense()]


def _save_tiny(arch: str, path: str, kv: int = KV) -> None:
    import transformers as T

    torch.manual_seed(0)
    cfg, cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[arch]
    cls(cfg(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=kv)).eval().save_pretrained(path)


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _model_checks(rank: int, path: str, ids: torch.Tensor) -> dict:
    """One checkpoint: single process vs transformers' tensor parallelism, dense and patched."""
    from transformers import AutoModelForCausalLM

    import minference.integration as I
    from minference.config import PatternConfig, model_signature, weights_fingerprint

    out = {}
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **I.tensor_parallel_kwargs()).eval()
    out["local_q_rows"] = int(tp.model.layers[0].self_attn.q_proj.weight.to_local().shape[0])
    plan = _plan()
    config = PatternConfig(model_signature(single), [plan, list(reversed(plan))])
    with torch.no_grad():
        out["dense_single"], out["dense_tp"] = single(ids).logits, tp(ids).logits
    I.patch(single, config, dense_threshold=0)
    out["fingerprints"] = (weights_fingerprint(single), weights_fingerprint(tp))
    I.patch(tp, config, dense_threshold=0)  # head offset read from the shard, fingerprint of the gathered weights
    out["offsets"] = {i: (s.head_offset, s.heads) for i, s in I.layer_states(tp).items()}
    with torch.no_grad():
        out["sparse_single"], out["sparse_tp"] = single(ids).logits, tp(ids).logits
    out["counts"] = I.call_counts(tp)
    out["wrong_offset_error"] = _error(
        lambda: I.patch(tp, config, head_offset=0, dense_threshold=0, check_fingerprint=False))
    out["patched_after_error"] = I.is_patched(tp)
    I.patch(tp, config, head_offset=0, dense_threshold=0, check_fingerprint=False, check_partition=False)
    with torch.no_grad():
        out["sparse_tp_wrong"] = tp(ids).logits
    return out


def _worker(rank: int, port: int, path: str) -> None:
    import torch.distributed as dist

    import minference.integration as I
    from minference.config import PatternConfig, model_signature
    from minference.dispatch import sparse_prefill
    from minference.distributed import shard_heads, tp_sparse_prefill

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        out = {}
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, HEADS, N, D, generator=g)
        k = torch.randn(1, KV, N, D, generator=g)
        v = torch.randn(1, KV, N, D, generator=g)
        plan = _plan()
        out["full"] = sparse_prefill(q, k, v, plan, dense_threshold=0)
        shard = head_shard(HEADS, KV, rank, WORLD)
        ql, kl, vl = shard_heads(q, k, v, shard)
        out["tp"] = tp_sparse_prefill(ql, kl, vl, plan, gather=True, dense_threshold=0)
        out["wrong_offset_error"] = _error(lambda: tp_sparse_prefill(ql, kl, vl, plan, head_offset=0,
                                                                     dense_threshold=0))
        out["tp_wrong"] = tp_sparse_prefill(ql, kl, vl, plan, head_offset=0, check=False, gather=True,
                                            dense_threshold=0)

        ids = torch.randint(2, 64, (1, N), generator=g)
        out["models"] = {arch: _model_checks(rank, f"{path}/{arch}", ids) for arch in ARCHS}

        # one kv head on two ranks: transformers splits it in half; patch refuses on every rank
        from transformers import AutoModelForCausalLM

        split = AutoModelForCausalLM.from_pretrained(f"{path}/llama_kv1", dtype=torch.float32,
                                                     **I.tensor_parallel_kwargs())
        config = PatternConfig(model_signature(split, fingerprint=False), [plan, plan])
        out["split_head_error"] = _error(lambda: I.patch(split, config, dense_threshold=0, check_fingerprint=False))
        torch.save(out, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
    for arch in ARCHS:
        _save_tiny(arch, str(path / arch))
    _save_tiny("llama", str(path / "llama_kv1"), kv=1)
    mp.spawn(_worker, args=(_free_port(), str(path)), nprocs=WORLD, join=True)
    return [torch.load(path / f"rank{r}.pt") for r in range(WORLD)]


def test_sharded_attention_equals_single_process(results):
    for r in results:
        torch.testing.assert_close(r["tp"], r["full"], atol=1e-6, rtol=0)


def test_wrong_offset_is_caught_on_every_rank(results):
    for r in results:
        assert r["wrong_offset_error"] is not None
        assert "do not tile" in r["wrong_offset_error"] and "rank 1 has head_offset 0" in r["wrong_offset_error"]


def test_wrong_offset_changes_the_output(results):
    for r in results:
        assert (r["tp_wrong"] - r["full"]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_tensor_parallel_model_equals_single_process(results, arch):
    """Sharded by transformers (DTensor projections, 2 of 4 heads per rank), patched with the
    head offset read from the shard: the logits equal the single process's patched logits within
    twice what sharding alone changes (the dense sharded vs dense single difference) plus the
    fp32 floor."""
    for rank, r in enumerate(results):
        m = r["models"][arch]
        assert m["local_q_rows"] == HEADS // WORLD * D  # really sharded
        assert m["offsets"] == {0: (rank * HEADS // WORLD, HEADS // WORLD), 1: (rank * HEADS // WORLD, HEADS // WORLD)}
        assert m["counts"]["sparse"] == 2
        sharding_error = (m["dense_tp"] - m["dense_single"]).abs().max().item()
        bound = 2 * sharding_error + FLOOR
        assert (m["sparse_tp"] - m["sparse_single"]).abs().max().item() <= bound
        assert (m["sparse_single"] - m["dense_single"]).abs().max() > 100 * bound  # the plan is really sparse
        assert (m["sparse_tp_wrong"] - m["sparse_single"]).abs().max() > 100 * bound  # offsets matter


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_tensor_parallel_wrong_offset_is_refused_on_every_rank(results, arch):
    errors = [r["models"][arch]["wrong_offset_error"] for r in results]
    assert errors[0] is not None and "rank(s) [1] refused" in errors[0]
    assert errors[1] is not None and "head_offset 0 was given" in errors[1] and "global heads 2..3" in errors[1]
    assert "self_attn.q_proj holds rows 32..63" in errors[1]
    assert not any(r["models"][arch]["patched_after_error"] for r in results)


def test_transformers_tensor_parallel_model_has_the_whole_models_fingerprint(results):
    """The DTensor weights are gathered for the hash: every rank gets the single process's
    fingerprint, so patch() checks a sharded model against its config (it did refuse before)."""
    for r in results:
        for arch in r["models"]:
            single, tp = r["models"][arch]["fingerprints"]
            assert single == tp and single.startswith("sha256:")


def test_a_shard_that_splits_a_head_is_refused(results):
    for r in results:
        assert r["split_head_error"] is not None and "splits a head" in r["split_head_error"]


def test_tensor_parallel_kwargs_follow_the_transformers_spelling(monkeypatch):
    """``distributed_config=DistributedConfig(tp_plan=...)`` where DistributedConfig has the field
    (transformers 5.17, 5.24), the bare ``tp_plan=`` keyword where it does not."""
    import dataclasses

    import transformers.distributed as TD

    import minference.integration as I

    monkeypatch.setenv("WORLD_SIZE", "2")
    kw = I.tensor_parallel_kwargs()
    assert set(kw) == {"distributed_config"} and kw["distributed_config"].tp_plan == "auto"

    @dataclasses.dataclass
    class OldDistributedConfig:  # a transformers whose DistributedConfig predates tp_plan
        enable_expert_parallel: bool = False

    monkeypatch.setattr(TD, "DistributedConfig", OldDistributedConfig)
    assert I.tensor_parallel_kwargs({"x": "colwise"}) == {"tp_plan": {"x": "colwise"}}


@pytest.mark.parametrize(
    "args, needle",
    [((4, 2, 2, 2), "rank must be < world"), ((4, 3, 0, 2), "multiple of num_kv_heads"),
     ((6, 3, 0, 2), "must divide by the tensor-parallel world size"), ((4, 2, True, 2), "rank must be an int")],
)
def test_head_shard_validates(args, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        head_shard(*args)


def test_head_shard_slices():
    shards = [head_shard(8, 4, r, 4) for r in range(4)]
    assert [s.q for s in shards] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [s.kv for s in shards] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert [s.head_offset for s in shards] == [0, 2, 4, 6]
