"""No Triton kernel is specialised on the prompt length (docs/kernels.md, "No argument derived from
the length is specialised").

Triton compiles a variant of a kernel per specialisation key: the values of its constexprs, for
every other int argument whether it is divisible by 16 (and whether it equals 1), for every
tensor argument whether its address is 16-byte aligned, unless the kernel lists the argument in
``do_not_specialize`` (``do_not_specialize_on_alignment``). An argument derived from the prompt
length therefore compiles a new variant the first time a prompt of a new divisibility class
comes: on the H200 one 128K prompt of the eval (130,416 tokens, the run's first length divisible
by 16) took 17.05 s to its first token instead of ~2.6 s.

* :func:`test_launch_keys_do_not_depend_on_the_length` (CPU, interpreter): records the key of
  every kernel launch of a prefill (each pattern with its estimator, the adaptive rules, dense
  heads, the value guard, the dense tail and its key split, query rows; descriptor loads forced
  as on the GPU) at two lengths and asserts the keys are equal, and that no int argument whose
  value follows the length is specialised (unless it is a multiple of 16 at both, as the strides
  ``N * D`` of q, k, v are for every supported head dim).
* :func:`test_block_select_chunk_is_one_constexpr_at_serving_lengths`: the one constexpr computed
  from a length (the block selection's chunk) takes one value over the serving lengths.
* :func:`test_no_compile_at_a_second_length` (GPU): the same prefills at two lengths of other
  divisibility classes; the second compiles nothing.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from functools import partial

import pytest
import torch

from minference.dispatch import DENSE_THRESHOLD, dense_tail_attention, sparse_prefill
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing.strategies import AttnShape, qkv

#: Two prompt lengths: at 512, ``n`` and ``ceil(n / 16)``, ``ceil(n / 32)`` are multiples of 16;
#: at 263 ``n`` and ``ceil(n / b)`` for every block ``b`` of 16..128 are odd.
LENGTHS = (512, 263)
#: Query rows (a chunk after its cache) at the two lengths: a multiple of 16, and odd.
CHUNKS = (64, 37)

#: Every pattern and estimator path of the dispatcher (a group per vertical-slash ``last_q`` and
#: block-sparse block): vertical-slash with budgets alone (the one-launch selection), the mass
#: rule with extra rows and max aggregation, the relative rule (both the torch selection),
#: A-shape, block-sparse pooled (top-k) and query-aware (the one-launch relative rule, and the
#: mass rule), dense heads; and budgets above the length at both lengths (a block-sparse top-k
#: over more blocks than the prompt has, a vertical-slash budget over more columns and diagonals),
#: which clip to it, so every width and stride made from a clipped budget follows the length (a
#: 63,468-token RULER prompt under a top-k of up to 508 blocks of 128, clipped to 496, took 1995 ms
#: to its first token on the H100 against a 752 ms median). 10 query heads, 2 kv heads.
PLAN = [
    VerticalSlash(vertical=16, slash=32, last_q=16, sink_columns=2, local_diagonals=3),
    VerticalSlash(vertical=16, slash=32, last_q=16, rule="mass", threshold=0.9, min_vertical=2, min_slash=3,
                  extra_rows=8, aggregation="max"),
    AShape(sink=4, window=32),
    BlockSparse(top_k=4, block=64, sink_blocks=1),
    BlockSparse(top_k=4, block=16, rule="relative", threshold=0.1, estimate="query"),
    BlockSparse(top_k=4, block=32, rule="mass", threshold=0.9, min_blocks=2, estimate="query"),
    VerticalSlash(vertical=8, slash=16, last_q=32, rule="relative", threshold=0.05),
    Dense(),
    BlockSparse(top_k=64, block=16, rule="relative", threshold=0.1, estimate="query"),
    VerticalSlash(vertical=1024, slash=2048, last_q=16),
]
D = 16


# --------------------------------------------------------------------------------------------
# the specialisation key of a launch, as Triton makes it
# --------------------------------------------------------------------------------------------


def _int_type(v: int) -> str:
    return "i32" if -(2**31) <= v < 2**31 else "i64" if -(2**63) <= v < 2**63 else "u64"


def spec(value, *, specialize: bool, align: bool) -> tuple:
    """Triton's key of one non-constexpr argument (``triton.runtime.jit.specialize_impl``): an int
    ``1`` becomes a constexpr, another int is keyed on divisibility by 16, a tensor on a 16-byte
    aligned address; ``specialize`` / ``align`` off (``do_not_specialize``,
    ``do_not_specialize_on_alignment``) key only the type. Floats and bools are never specialised;
    a tensor descriptor is keyed on its block."""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1",)
    if isinstance(value, int):
        if not specialize:
            return (_int_type(value),)
        if value == 1:
            return ("constexpr", 1)
        return (_int_type(value), "D" if value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32",)
    if isinstance(value, torch.Tensor):
        return (f"*{value.dtype}", "D" if align and value.data_ptr() % 16 == 0 else "")
    return (type(value).__name__, tuple(getattr(value, "block_shape", ())))


def _is_constexpr(annotation) -> bool:
    return "constexpr" in str(annotation)


def _names(jit_fn, key: str) -> set[str]:
    """The parameters listed (by name or position) in ``do_not_specialize`` or
    ``do_not_specialize_on_alignment`` of an interpreted kernel."""
    params = list(inspect.signature(jit_fn.fn).parameters)
    return {params[x] if isinstance(x, int) else x for x in jit_fn.kwargs.get(key) or ()}


def kernel_functions() -> dict[str, object]:
    """Every ``@triton.jit`` function defined in ``minference.kernels`` (interpreted), by name."""
    import minference.kernels as package
    from triton.runtime.interpreter import InterpretedFunction

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, InterpretedFunction) and obj.fn.__module__ == module.__name__:
                found[name] = obj
    return found


class Launch:
    """One kernel launch: its name, its arguments by parameter name, and its key per parameter."""

    def __init__(self, name: str, jit_fn, args: tuple, kwargs: dict) -> None:
        sig = inspect.signature(jit_fn.fn)
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        plain = _names(jit_fn, "do_not_specialize")
        unaligned = _names(jit_fn, "do_not_specialize_on_alignment")
        self.name = name
        self.values = dict(bound.arguments)
        self.constexpr = {p for p, param in sig.parameters.items() if _is_constexpr(param.annotation)}
        self.specialized = {p for p in sig.parameters if p not in plain and p not in self.constexpr}
        self.key = {p: ("constexpr", v) if p in self.constexpr
                    else spec(v, specialize=p not in plain, align=p not in unaligned)
                    for p, v in self.values.items()}


@pytest.fixture
def launches(monkeypatch) -> Callable[..., list[Launch]]:
    """``record(call, dry_run=False)``: run ``call()`` and return its kernel launches in order
    (each interpreted kernel's ``run``, what ``kernel[grid](...)`` calls, wrapped for the test);
    ``dry_run``: record the launches without running the kernels (for a call whose outputs
    nothing reads)."""
    log: list[Launch] = []
    dry = [False]
    for name, fn in kernel_functions().items():
        def run(*args, _fn=fn, _name=name, _run=fn.run, **kwargs):
            launch_kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            log.append(Launch(_name, _fn, args, launch_kw))
            return None if dry[0] else _run(*args, **kwargs)

        monkeypatch.setattr(fn, "run", run, raising=False)

    def record(call: Callable[[], object], dry_run: bool = False) -> list[Launch]:
        log.clear()
        dry[0] = dry_run
        try:
            call()
        finally:
            dry[0] = False
        return list(log)

    return record


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor at an address {value.data_ptr() % 16} mod 16"
    return repr(value) if isinstance(value, (int, float, str, type(None))) else type(value).__name__


def key_differences(runs: dict[int, list[Launch]]) -> list[str]:
    """What differs between the launches of one call at two lengths, one line per kernel argument:
    a key that differs, or a specialised int that follows the length (not a multiple of 16 at
    both). Empty when the calls compile the same variants at any length."""
    (n_a, a), (n_b, b) = runs.items()
    names_a, names_b = [x.name for x in a], [x.name for x in b]
    if names_a != names_b:
        return [f"the launches differ: {names_a} at n={n_a}, {names_b} at n={n_b}"]
    lines = set()
    for x, y in zip(a, b):
        for p in x.values:
            va, vb = x.values[p], y.values[p]
            if x.key[p] != y.key[p]:
                what = "constexpr" if p in x.constexpr else "key"
                lines.add(f"{x.name}: argument {p!r}: {what} {x.key[p]} at n={n_a} ({_show(va)}), {y.key[p]} at "
                          f"n={n_b} ({_show(vb)})")
            elif (p in x.specialized and isinstance(va, int) and not isinstance(va, bool) and va != vb
                  and not (va % 16 == 0 and vb % 16 == 0)):
                lines.add(f"{x.name}: argument {p!r} follows the length ({va} at n={n_a}, {vb} at n={n_b}) and is "
                          "specialised (not in do_not_specialize)")
    return sorted(lines)


# --------------------------------------------------------------------------------------------
# CPU: the keys of every launch at two lengths
# --------------------------------------------------------------------------------------------


def _force_descriptors(monkeypatch) -> None:
    """The GPU's load path under the interpreter: K/V tensor descriptors (and the vertical-slash
    column scratch, its ``_gather_columns_kernel``), as contiguous aligned inputs take on CUDA."""
    from minference.kernels import _common, ashape, block_sparse, vertical_slash

    def forced(k, v, block_n, block_d):
        return _common.kv_descriptors(k, v, block_n, block_d, interpreter=True)

    for module in (ashape, block_sparse, vertical_slash):
        monkeypatch.setattr(module, "kv_descriptors", forced)


def _whole(n: int, device: str = "cpu", dtype: torch.dtype = torch.float16, plan=PLAN) -> None:
    """A whole prompt as the integration runs it (transformers' layout, no value checks) with a
    dense tail."""
    q, k, v = qkv(AttnShape(B=1, Hq=len(plan), Hkv=2, N=n, D=D if device == "cpu" else 64), dtype, device, seed=n,
                  layout="transposed")
    sparse_prefill(q, k, v, plan, dense_threshold=0, backend="triton", validate=False, dense_tail=16)


def _chunk(n: int, chunk: int, device: str = "cpu", dtype: torch.dtype = torch.float16, plan=PLAN) -> None:
    """Query rows: a chunk of ``chunk`` tokens after a cache of ``n - chunk``."""
    q, k, v = qkv(AttnShape(B=1, Hq=len(plan), Hkv=2, N=n, D=D if device == "cpu" else 64), dtype, device, seed=n,
                  layout="transposed")
    sparse_prefill(q[:, :, -chunk:].clone(), k, v, plan, dense_threshold=0, backend="triton", validate=False)


def _split_tail(n: int, device: str = "cpu", dtype: torch.dtype = torch.float16, key_split: int | None = 3) -> None:
    """The dense tail split over the keys (the automatic count on CUDA; forced on the CPU)."""
    q, k, v = qkv(AttnShape(B=1, Hq=4, Hkv=2, N=n, D=D if device == "cpu" else 64), dtype, device, seed=n,
                  layout="transposed")
    dense_tail_attention(q, k, v, 16, out=torch.zeros_like(q), key_split=key_split, backend="triton")


def _with_lse(n: int) -> None:
    """The public kernels with ``return_lse`` (the dispatcher never asks for it; the LSE strides
    follow the length): A-shape, vertical-slash, block-sparse, dense split over the keys."""
    from minference import kernels

    q, k, v = qkv(AttnShape(B=1, Hq=2, Hkv=1, N=n, D=D), torch.float16, "cpu", seed=n, layout="transposed")
    kw = dict(return_lse=True, validate=False)
    kernels.ashape_attention(q, k, v, 4, 32, **kw)
    kernels.vertical_slash_attention(q, k, v, torch.tensor([[[0, 5, 40]] * 2], dtype=torch.int32),
                                     torch.arange(0, 24, dtype=torch.int32).expand(1, 2, 24), **kw)
    nqb = -(-n // 64)
    blocks = torch.stack([torch.zeros(nqb, dtype=torch.int32), torch.arange(nqb, dtype=torch.int32)], -1)
    kernels.block_sparse_attention(q, k, v, blocks.expand(1, 2, nqb, 2), block=64, **kw)
    kernels.dense_attention(q, k, v, q_seqlens=16, key_split=3, **kw)


CASES = {
    "whole_prompt": lambda i: _whole(LENGTHS[i]),
    "query_rows": lambda i: _chunk(LENGTHS[i], CHUNKS[i]),
    "dense_tail_split": lambda i: _split_tail(LENGTHS[i]),
    "return_lse": lambda i: _with_lse(LENGTHS[i]),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
def test_launch_keys_do_not_depend_on_the_length(case, launches, monkeypatch):
    """Every launch of the call has the same specialisation key at both lengths: one compiled
    variant serves every prompt length (~10 s on 2 cores for the whole prompt)."""
    _force_descriptors(monkeypatch)
    runs = {n: launches(lambda i=i: CASES[case](i)) for i, n in enumerate(LENGTHS)}
    assert runs[LENGTHS[0]], "no kernel was launched"
    problems = key_differences(runs)
    assert not problems, "kernel arguments specialised on the prompt length:\n" + "\n".join(problems)


@pytest.mark.interpret
def test_the_key_check_sees_a_missing_do_not_specialize(launches, monkeypatch):
    """The check itself: a kernel whose length argument is specialised is reported by name."""
    from minference.kernels import _common

    guard = kernel_functions()["_value_guard_kernel"]
    monkeypatch.setitem(guard.kwargs, "do_not_specialize", [])
    runs = {}
    for n in LENGTHS:
        k = torch.zeros(1, 2, n, D, dtype=torch.float16)
        runs[n] = launches(lambda k=k: _common.value_guard(k, k))
    assert any(line.startswith("_value_guard_kernel: argument 'N'") for line in key_differences(runs))


@pytest.mark.interpret
def test_block_select_chunk_is_one_constexpr_at_serving_lengths(launches):
    """The block selection's chunk (a constexpr) follows the number of query blocks on short rows;
    at the lengths that run sparse (from the dispatcher's dense threshold to 1M, every routing
    block) it must be one value, or a prompt crossing a power of two compiles a new variant. The
    launches are recorded without running them (one query block's row of scores)."""
    from minference.kernels.block_sparse import BLOCK_SIZES
    from minference.kernels.select import select_query_blocks

    i32 = dict(dtype=torch.int32)
    for block in BLOCK_SIZES:
        chunks = {}
        for n in (DENSE_THRESHOLD, 65536, 65537, 130416, 131072, 1 << 20):
            nqb = -(-n // block)
            scores = torch.zeros(1, 1, 1, nqb)
            call = partial(select_query_blocks, scores, torch.tensor([n], **i32), torch.zeros(1, **i32),
                           torch.full((1,), 4, **i32), None, block=block, force_diagonal=True, width=4,
                           q_lens=torch.tensor([block], **i32))
            (launch,) = launches(call, dry_run=True)
            chunks[n] = launch.values["CHUNK"]
        assert len(set(chunks.values())) == 1, f"block {block}: the chunk by length {chunks}"


# --------------------------------------------------------------------------------------------
# GPU: no compile at a second length
# --------------------------------------------------------------------------------------------

#: The GPU's lengths: at 4096 ``n`` and the query blocks of 64 and 128 are multiples of 16; at
#: 3937 ``n`` is odd and ``ceil(n / 64) = 62``, ``ceil(n / 128) = 31`` are not. Both lie in one
#: power-of-two class of query blocks (64 and 32), so the block selection's chunk, a constexpr that
#: follows the query blocks below the serving lengths by design, is one value
#: (:func:`test_gpu_lengths_share_the_block_select_chunk`). 4289 (68 and 34 blocks) crossed it: the
#: H100 compiled a second ``_block_select_kernel`` there (2026-12-05), which is not a length
#: specialisation at the lengths that run sparse.
GPU_LENGTHS = (4096, 3937)
GPU_CHUNKS = (1024, 1111)
GPU_PLAN = [
    VerticalSlash(vertical=64, slash=256, last_q=64, sink_columns=4, local_diagonals=32),
    VerticalSlash(vertical=64, slash=256, last_q=64, rule="mass", threshold=0.9, min_vertical=8, min_slash=16,
                  extra_rows=32),
    AShape(sink=64, window=512),
    BlockSparse(top_k=8, block=64, sink_blocks=1),
    BlockSparse(top_k=8, block=128, rule="relative", threshold=0.1, estimate="query"),
    Dense(),
    BlockSparse(top_k=128, block=64, rule="relative", threshold=0.1, estimate="query"),  # clipped to 64 / 62 blocks
    VerticalSlash(vertical=8192, slash=8192, last_q=64),  # clipped to the length
]


@pytest.mark.gpu
def test_no_compile_at_a_second_length():
    """Each pattern's prefill in bf16 (the mixed plan with its dense tail, the tail split over the
    keys, a chunk after a cache) at one length, then at a length of other divisibility classes:
    the second compiles no kernel (Triton's JIT hooks, as ``--compile-report`` counts them). The
    first call compiles every variant the plan needs (about a minute when Triton's cache is cold)."""
    from minference.compiles import CompileCounter

    dtype = torch.bfloat16

    calls = {
        "whole prompt": lambda n, c: _whole(n, "cuda", dtype, GPU_PLAN),
        "dense tail split": lambda n, c: _split_tail(n, "cuda", dtype, key_split=None),
        "query rows": lambda n, c: _chunk(n, c, "cuda", dtype, GPU_PLAN),
    }
    counter = CompileCounter()
    failures = []
    try:
        for what, call in calls.items():
            call(GPU_LENGTHS[0], GPU_CHUNKS[0])
            torch.cuda.synchronize()
            counter.take()
            call(GPU_LENGTHS[1], GPU_CHUNKS[1])
            torch.cuda.synchronize()
            compiled = [name for name, _ in counter.take()]
            if compiled:
                failures.append(f"{what}: n={GPU_LENGTHS[1]} after n={GPU_LENGTHS[0]} compiled {compiled}")
    finally:
        counter.close()
    assert not failures, "; ".join(failures) + " (an argument derived from the length is specialised)"


def test_gpu_lengths_share_the_block_select_chunk():
    """The GPU test's two lengths differ in every divisibility class but not in the block
    selection's chunk (a power-of-two class of the query blocks, one value at serving lengths):
    otherwise its compile would be by design, not a specialisation."""
    from minference.kernels.select import block_select_chunk

    for p in GPU_PLAN:
        if isinstance(p, BlockSparse):
            nqb = [-(-n // p.block) for n in GPU_LENGTHS]
            assert block_select_chunk(nqb[0]) == block_select_chunk(nqb[1]), (p.block, nqb)
            assert nqb[0] % 16 == 0 and nqb[1] % 16 != 0, (p.block, nqb)
    assert GPU_LENGTHS[0] % 16 == 0 and GPU_LENGTHS[1] % 2 == 1
