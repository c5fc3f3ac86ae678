"""The dense tail of a sparse prefill (``sparse_prefill(..., dense_tail=T)``): the last ``T``
query rows of each batch row attend densely, the other rows are exactly what the plan gives.
Checked against the float64 dense reference on the tail rows (the tolerance rule) and against
the same call without a tail elsewhere (bit-equal: the tail writes nothing else), on full and
ragged rows (rows shorter than the tail, an empty row), GQA, both backends."""

from __future__ import annotations

import pytest
import torch
from minference.reference import attention as ref

from minference._checks import token_mask
from minference.dispatch import dense_tail_attention, sparse_prefill
from minference.patterns import AShape, BlockSparse, VerticalSlash
from minference.testing import assert_close_to_reference
from minference.testing.strategies import AttnShape, qkv
from tests.unit.kernels.cases import backend_device

#: The tail is one dense call on query rows: the torch backend's dense path, or the Triton A-shape
#: kernel (here in the interpreter; the GPU test runs it on CUDA).
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
#: Patterns that miss most of a late row's keys, so a tail that is not dense shows.
PLAN = [AShape(sink=1, window=4), VerticalSlash(vertical=2, slash=2, last_q=8),
        BlockSparse(top_k=1, block=16, sink_blocks=0, rule="relative", threshold=0.5, estimate="query"),
        AShape(sink=0, window=2)]


def _tail_rows(B: int, N: int, T: int, seqlens, seqstarts) -> torch.Tensor:
    """``[B, 1, N, 1]`` bool: the last ``T`` tokens of each row."""
    valid = token_mask(seqlens, seqstarts, B, N, "cpu")  # [B, N]
    after = valid.flip(-1).cumsum(-1).flip(-1)  # tokens of the row at or after each position
    return (valid & (after <= T))[:, None, :, None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ragged", [False, True])
def test_tail_rows_are_dense_and_the_rest_unchanged(backend: str, ragged: bool) -> None:
    shape = AttnShape(B=3, Hq=4, Hkv=2, N=70, D=16)
    # compared on the CPU
    device = backend_device(backend)
    q, k, v = qkv(shape, torch.float32, device, seed=5, sharpness=2.0)
    T = 9
    seqlens = torch.tensor([70, 5, 0], dtype=torch.int32) if ragged else None  # shorter than T; empty
    seqstarts = torch.tensor([0, 40, 10], dtype=torch.int32) if ragged else None
    kw = dict(seqlens=None if seqlens is None else seqlens.to(device),
              seqstarts=None if seqstarts is None else seqstarts.to(device), dense_threshold=0, backend=backend)
    base = sparse_prefill(q, k, v, PLAN, **kw).cpu()
    out = sparse_prefill(q, k, v, PLAN, dense_tail=T, **kw).cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    tail = _tail_rows(shape.B, shape.N, T, seqlens, seqstarts).expand_as(out)
    assert torch.equal(out[~tail], base[~tail]), "the tail must write nothing but its rows"
    rows = dict(seqlens=seqlens, seqstarts=seqstarts)
    r64 = ref.dense_attention(q, k, v, **rows)
    rsame = ref.dense_attention(q, k, v, compute_dtype=torch.float32, **rows)
    assert_close_to_reference(out, r64, rsame, where=tail)
    # the plan really is sparse on those rows: without the tail they are far from dense
    assert (base[tail].double() - r64[tail]).abs().max() > 1e-2


def test_tail_longer_than_the_prompt_is_dense_attention() -> None:
    shape = AttnShape(B=1, Hq=3, Hkv=1, N=24, D=8)
    q, k, v = qkv(shape, torch.float32, "cpu", seed=1)
    out = dense_tail_attention(q, k, v, 1000, out=torch.zeros_like(q))
    assert_close_to_reference(out, ref.dense_attention(q, k, v),
                              ref.dense_attention(q, k, v, compute_dtype=torch.float32))


def test_dense_tail_argument_errors() -> None:
    q, k, v = qkv(AttnShape(B=1, Hq=2, Hkv=1, N=32, D=8), torch.float32, "cpu", seed=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="dense_tail"):
            sparse_prefill(q, k, v, PLAN[:2], dense_threshold=0, backend="torch", dense_tail=bad)


@pytest.mark.gpu
def test_tail_on_gpu_and_capturable() -> None:
    """bf16 on the GPU, the tail inside a captured CUDA graph (no host sync), replayed."""
    shape = AttnShape(B=2, Hq=14, Hkv=2, N=3000, D=64)
    q, k, v = qkv(shape, torch.bfloat16, "cuda", seed=2)
    seqlens = torch.tensor([3000, 1700], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(q)
    dense_tail_attention(q, k, v, 128, out=out, seqlens=seqlens)
    tail = _tail_rows(2, 3000, 128, seqlens.cpu(), None).expand(q.shape)
    r64 = ref.dense_attention(q.cpu(), k.cpu(), v.cpu(), seqlens=seqlens.cpu())
    rsame = ref.dense_attention(q.cpu(), k.cpu(), v.cpu(), seqlens=seqlens.cpu(), compute_dtype=torch.bfloat16)
    assert_close_to_reference(out.cpu(), r64, rsame, where=tail)
    graph_out = torch.zeros_like(q)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dense_tail_attention(q, k, v, 128, out=graph_out, seqlens=seqlens)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph_out.zero_()
    with torch.cuda.graph(g):
        dense_tail_attention(q, k, v, 128, out=graph_out, seqlens=seqlens)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)


def test_patch_passes_the_tail_to_every_layer() -> None:
    """A patched tiny Llama whose narrow A-shapes change the logits: with a tail as long as the
    prompt it gives the unpatched (dense) model's logits; a bad tail is refused by ``patch``."""
    import transformers as T

    import minference.integration as I
    from minference.config import PatternConfig, model_signature

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        dense = model(ids).logits
        config = PatternConfig(model_signature(model), [[AShape(sink=0, window=2)] * 4] * 2)
        with pytest.raises(ValueError, match="dense_tail"):
            I.patch(model, config, dense_threshold=0, backend="torch", dense_tail=-1)
        I.patch(model, config, dense_threshold=0, backend="torch")
        sparse = model(ids).logits
        I.unpatch(model)
        I.patch(model, config, dense_threshold=0, backend="torch", dense_tail=40)
        tail = model(ids).logits
        I.unpatch(model)
    assert (sparse - dense).abs().max() > 1e-3
    torch.testing.assert_close(tail, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_tail_refuses_an_out_of_another_form(backend) -> None:
    """``out`` is the caller's: its dtype, rank, shape and device are checked at this public entry
    (the backends write it with their entry checks off)."""
    q, k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 1, 100, 16), torch.randn(1, 1, 100, 16)
    for out, error, match in ((torch.zeros(1, 2, 100, 16, dtype=torch.float64), TypeError, "out"),
                              (torch.zeros(1, 2, 120, 16), ValueError, "out must have shape"),
                              (torch.zeros(1, 4, 100, 16), ValueError, "out must have shape"),
                              (torch.zeros(2, 100, 16), ValueError, "out")):
        with pytest.raises(error, match=match):
            dense_tail_attention(q, k, v, 8, out=out, backend=backend)
