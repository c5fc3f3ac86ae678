"""Where a greedy decode step's time goes over a long KV cache.

`minference eval` decodes RULER's answers at ~42-44 ms a token over a 130K cache on the H200 for
dense and sparse configs alike (the 1.5B, docs/testbed.md), where reading the cache needs ~1 ms:
most of the eval's device time on the prompts the model fails. This script prefills one prompt of
``--tokens`` random ids, then times ``--steps`` decode steps as the eval's loop runs them (each
step's token read on the host), and profiles a few more: the wall time per step against the device
(kernel) time inside it says whether the step is host-bound, and the costliest kernels say which
attention kernel a one-token query over the cache gets. With ``--config`` the same again on the
model patched with it (decode runs the patched model's dense-decode path).

    python benchmarks/decode_step.py --model qwen1.5b --device cuda --tokens 130000 --steps 32 \\
      [--config fixtures/configs/qwen2.5-coder-1.5b.json] [--prefill-chunk 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from minference.app.models import decode_step, forward_chunks, output_cache, synchronize

#: Steps under the profiler (after the timed ones).
PROFILED_STEPS = 4
#: Kernels listed per run, by device time.
TOP_KERNELS = 6


def measure(model, ids: torch.Tensor, steps: int, *, chunk: int = 0) -> dict:
    """Prefill ``ids [n]`` (in chunks of ``chunk`` tokens, 0: one call), then ``steps`` timed greedy
    decode steps and :data:`PROFILED_STEPS` profiled ones. Returns the wall times per step (ms),
    their median, and on CUDA the device time per profiled step and its costliest kernels
    (``None`` / ``{}`` on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = ids.device
    with torch.no_grad():
        out = forward_chunks(model, ids[None], chunk, logits_to_keep=1)
        cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1)
        del out

        def step(nxt, cache):
            out = decode_step(model, nxt, cache, dev)
            return out.logits[:, -1].argmax(-1), output_cache(out)

        for _ in range(2):  # warm-up
            nxt, cache = step(nxt, cache)
        wall = []
        for _ in range(steps):
            synchronize(dev)
            start = time.perf_counter()
            nxt, cache = step(nxt, cache)
            nxt.tolist()  # the eval's loop reads each token on the host
            wall.append((time.perf_counter() - start) * 1e3)
        cuda = dev.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                nxt, cache = step(nxt, cache)
                nxt.tolist()
            synchronize(dev)
    del cache
    device_ms, top = None, {}
    if cuda:
        kernels: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e3 / PROFILED_STEPS
        device_ms = sum(kernels.values())
        top = {k[:100]: round(v, 4) for k, v in sorted(kernels.items(), key=lambda x: -x[1])[:TOP_KERNELS]}
    return {"tokens": int(ids.numel()), "steps": steps, "wall_ms": [round(w, 3) for w in wall],
            "wall_ms_median": statistics.median(wall), "device_ms_per_step": device_ms, "top_kernels_ms": top}


def _report(name: str, r: dict) -> str:
    dev = r["device_ms_per_step"]
    lines = [f"{name}: {r['wall_ms_median']:.2f} ms a step (median of {r['steps']}) over {r['tokens']} tokens"
             + ("" if dev is None else f"; device {dev:.2f} ms a step ({dev / r['wall_ms_median']:.0%} of the wall)")]
    lines += [f"  {ms:8.3f} ms  {k}" for k, ms in r["top_kernels_ms"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from minference.app.models import MODEL_CHOICES, load_model, set_context_length

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=MODEL_CHOICES, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, required=True, help="prompt length (random ids)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--config", default=None, help="also measure the model patched with this config")
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens")
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.steps < 1:
        print("decode_step: --tokens must be >= 2 and --steps >= 1", file=sys.stderr)
        return 2
    import minference.integration as integ
    from minference.config import load_config

    config = load_config(args.config) if args.config else None  # a bad file fails before the model loads
    model, _ = load_model(args.model, device=args.device)
    if args.model != "smollm2":
        set_context_length(model, args.tokens + args.steps + PROFILED_STEPS + 2)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(args.device)
    results = {"as loaded": measure(model, ids, args.steps, chunk=args.prefill_chunk)}
    print(_report("as loaded", results["as loaded"]))
    if config is not None:
        integ.patch(model, config)
        results["patched"] = measure(model, ids, args.steps, chunk=args.prefill_chunk)
        print(_report("patched", results["patched"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
