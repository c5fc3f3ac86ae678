"""Host time of the sparse prefill's Python and tensor ops, without any kernel.

Every Triton launch is stubbed out (the interpreter's ``run`` returns at once) and the tensors are
tiny CPU tensors, so what is timed is the dispatcher, the checks, the launch preparation and each
aten op's dispatch: a proxy for the host time a GPU prefill spends per layer (on the H200 the
sparse prefill of Qwen at 16K took 149 ms TTFT for 79 ms of device time,
``benchmarks/results/h200_s10_qwen_eval.md``). Runs the bundled
Qwen config's 24 layers (14 q / 2 kv heads, D = 64, dense tail 128) ``--rounds`` times and prints
the minimum and median per forward; ``--profile`` adds a cProfile of one forward (our functions,
by cumulative time); ``--count`` adds, per layer of one forward, the aten ops dispatched (and of
them the views and those that launch a device kernel on CUDA) and the Triton launches, and their
means.

    python benchmarks/host_time.py [--rounds 15] [--tokens 256] [--chunk 128] [--profile] [--count]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: the stubbed launches are the interpreter's

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from minference.config import PatternConfig  # noqa: E402
from minference.dispatch import sparse_prefill  # noqa: E402

#: aten ops that launch no device kernel: allocations without a fill, and the 0-dim CPU tensor a
#: Python scalar becomes (``torch.where(mask, x, 0.0)``); views are told apart by ``is_view``.
_NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.scalar_tensor"}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched by name, and apart the views (they only alias their input)
    and the ops that launch no device kernel (:data:`_NO_KERNEL`): the rest launch one or more
    kernels each on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.views = 0
        self.free = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        self.views += bool(func.is_view)
        self.free += name in _NO_KERNEL
        return func(*args, **(kwargs or {}))


CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "qwen2.5-coder-0.5b.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=256, help="prompt length of the tiny tensors")
    ap.add_argument("--chunk", type=int, default=0,
                    help="time a chunk of this many queries after a cache (query rows, no dense tail: a "
                         "chunk that a later one follows); 0: the whole prompt (default)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--count", action="store_true", help="aten ops and Triton launches per layer")
    args = ap.parse_args()
    if not 0 <= args.chunk < args.tokens:
        ap.error(f"--chunk must be in [0, --tokens {args.tokens})")
    config = PatternConfig.from_dict(json.loads(CONFIG.read_text()))
    launches = Counter()

    def stub(self, *a, **kw) -> None:  # kernels cost nothing: host work only
        launches[self.fn.__name__] += 1

    interpreter.InterpretedFunction.run = stub
    torch.set_num_threads(1)
    n = args.tokens
    q, k, v = torch.randn(1, 14, args.chunk or n, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
    plans = [config.plan(layer) for layer in range(len(config.layers))]
    tail = 0 if args.chunk else 128

    def forward() -> None:
        for plan in plans:
            sparse_prefill(q, k, v, plan, dense_threshold=0, backend="triton", validate=False, dense_tail=tail)

    forward()  # fill the plan and constant caches
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    what = f"a {args.chunk}-query chunk after {n - args.chunk} cached tokens" if args.chunk else f"{n} tokens"
    print(f"host per forward ({len(plans)} layers, {what}): min {min(times) * 1e3:.1f} ms, "
          f"median {statistics.median(times) * 1e3:.1f} ms ({args.rounds} rounds)")
    if args.count:
        ops_total, views_total, free_total, launch_total = Counter(), 0, 0, Counter()
        rows = []
        for layer, plan in enumerate(plans):
            launches.clear()
            with _OpCounter() as counter:
                sparse_prefill(q, k, v, plan, dense_threshold=0, backend="triton", validate=False, dense_tail=tail)
            ops_total.update(counter.ops)
            views_total += counter.views
            free_total += counter.free
            launch_total.update(launches)
            kinds = Counter(p.kind for p in plan)
            ops = sum(counter.ops.values())
            rows.append((layer, ops, counter.views, ops - counter.views - counter.free, sum(launches.values()),
                         " ".join(f"{kind} {c}" for kind, c in sorted(kinds.items()))))
        for layer, ops, views, kernels, n_launch, kinds in rows:
            print(f"layer {layer:2d}: {ops:4d} aten ops ({views:3d} views, {kernels:3d} launching kernels), "
                  f"{n_launch:2d} Triton launches  [{kinds}]")
        L = len(plans)
        total = sum(ops_total.values())
        print(f"mean per layer: {total / L:.1f} aten ops ({views_total / L:.1f} views, "
              f"{(total - views_total - free_total) / L:.1f} launching kernels), "
              f"{sum(launch_total.values()) / L:.1f} Triton launches")
        print("aten ops per forward:", ", ".join(f"{name} {c}" for name, c in ops_total.most_common()))
        print("Triton launches per forward:", ", ".join(f"{name} {c}" for name, c in launch_total.most_common()))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        forward()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats("minference|kernels", 30)


if __name__ == "__main__":
    main()
