"""Head-sharded tensor parallelism: two gloo processes on localhost against one process."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from minference.distributed import head_shard

WORLD = 2
HEADS, KV, N, D = 4, 2, 40, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan():
    from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

    # every global head different, so reading the wrong head ids changes the output
    return [AShape(sink=1, window=5), VerticalSlash(vertical=3, slash=6, last_q=8, sink_columns=1, local_diagonals=1),
            BlockSparse(top_k=1, block=8, sink_blocks=0), Dense()]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV)
    return LlamaForCausalLM(cfg).eval()


def _worker(rank: int, port: int, path: str) -> None:
    import torch.distributed as dist

    import minference.integration as I
    from minference.config import PatternConfig, model_signature
    from minference.dispatch import sparse_prefill
    from minference.distributed import shard_heads, tp_sparse_prefill
    from minference.integration import shard_model_heads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
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
        try:
            tp_sparse_prefill(ql, kl, vl, plan, head_offset=0, dense_threshold=0)
            out["wrong_offset_error"] = None
        except ValueError as err:
            out["wrong_offset_error"] = str(err)
        out["tp_wrong"] = tp_sparse_prefill(ql, kl, vl, plan, head_offset=0, check=False, gather=True,
                                            dense_threshold=0)

        # the whole model: one process vs. two head shards
        ids = torch.randint(2, 64, (1, N), generator=g)
        model = _tiny_llama()
        config = PatternConfig(model_signature(model), [plan, list(reversed(plan))])
        I.patch(model, config, dense_threshold=0)
        with torch.no_grad():
            out["model_full"] = model(ids).logits
        sharded = _tiny_llama()
        shard = shard_model_heads(sharded, rank, WORLD)
        I.patch(sharded, config, head_offset=shard.head_offset, dense_threshold=0, check_fingerprint=False)
        with torch.no_grad():
            out["model_tp"] = sharded(ids).logits
        out["model_counts"] = I.call_counts(sharded)
        try:
            I.patch(sharded, config, head_offset=0, dense_threshold=0, check_fingerprint=False)
            out["model_wrong_offset_error"] = None
        except ValueError as err:
            out["model_wrong_offset_error"] = str(err)
        out["model_patched_after_error"] = I.is_patched(sharded)
        I.patch(sharded, config, head_offset=0, dense_threshold=0, check_fingerprint=False, check_partition=False)
        with torch.no_grad():
            out["model_tp_wrong"] = sharded(ids).logits
        torch.save(out, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
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


def test_sharded_model_equals_single_process(results):
    for r in results:
        assert r["model_counts"]["sparse"] == 2
        torch.testing.assert_close(r["model_tp"], r["model_full"], atol=1e-4, rtol=0)
        assert (r["model_tp_wrong"] - r["model_full"]).abs().max() > 1e-2


def test_patch_catches_a_wrong_offset(results):
    for r in results:
        assert "do not tile" in r["model_wrong_offset_error"]
        assert r["model_patched_after_error"] is False


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
