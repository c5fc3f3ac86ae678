"""Cost of the quality guard (minference.guard, docs/guard.md) on a real model's prefill.

``python benchmarks/bench_guard.py --model qwen --device cuda --lengths 32768 120000 --json out.json``

One model, its bundled config, one task prompt per length (``multi_key`` sample 0 of the eval
suite). Four variants of the patched model, timed in interleaved rounds (whole-model prefill,
``logits_to_keep=1``, synchronised, median over ``--rounds``, after one untimed warm-up each):

* ``off``: no guard;
* ``idle``: a guard in observe mode that checks no call (``sample_rate=0``): the cost every
  unchecked call pays (the model hooks and one attribute read per layer);
* ``observe``: every call checked (``sample_rate=1``);
* ``enforce``: every call checked, heads below the floor recomputed densely.

The cost at a sampling rate ``r`` is the expected value over calls, derived from the same run:
``(idle - off) + r * (checked - idle)``, as a fraction of ``off``. The table also gives the
heads below the floor per checked call and the fallbacks per enforced call (their dense
recomputation is part of ``enforce``'s time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import minference.integration as integ
from minference.app import evals
from minference.app.main_job import main_job_defaults
from minference.app.models import load_model, set_context_length, synchronize
from minference.config import GuardSettings, load_config
from minference.guard import QualityGuard

VARIANTS = ("off", "idle", "observe", "enforce")


def _settings(variant: str, min_mass: float | None) -> GuardSettings | None:
    floor = {} if min_mass is None else {"min_mass": min_mass}
    return {"off": None, "idle": GuardSettings(mode="observe", sample_rate=0.0, **floor),
            "observe": GuardSettings(mode="observe", sample_rate=1.0, **floor),
            "enforce": GuardSettings(mode="enforce", sample_rate=1.0, **floor)}[variant]


def _prefill_ms(model, ids: torch.Tensor) -> float:
    synchronize(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids[None], logits_to_keep=1)
    synchronize(ids.device)
    return 1e3 * (time.perf_counter() - start)


def run(model_name: str, device: str, lengths: list[int], rounds: int, dense_tail: int, dense_threshold: int,
        backend: str, min_mass: float | None, config_path: str | None) -> list[dict]:
    dev = torch.device(device)
    model, tokenizer = load_model(model_name, device=dev)
    _, default_config, _ = main_job_defaults(dev, model_name)
    config = load_config(config_path or default_config, model, fingerprint=False, allow_mismatch=True)
    rows = []
    for n in lengths:
        set_context_length(model, n + 1)
        ids = evals.make_sample("multi_key", tokenizer, n, 0).ids.to(dev)
        guards = {v: None if _settings(v, min_mass) is None else QualityGuard(_settings(v, min_mass), name=v)
                  for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds + 1):  # round 0: warm-up (Triton compilation, caches)
            for v in VARIANTS:
                integ.patch(model, config, backend=backend, dense_threshold=dense_threshold, dense_tail=dense_tail,
                            check_fingerprint=False, allow_mismatch=True,
                            guard=guards[v] if guards[v] is not None else GuardSettings(mode="off"))
                try:
                    ms = _prefill_ms(model, ids)
                finally:
                    integ.unpatch(model)
                if r:
                    times[v].append(ms)
        med = {v: statistics.median(t) for v, t in times.items()}
        row = {"n": n, "rounds": rounds, **{f"{v}_ms": med[v] for v in VARIANTS},
               **{f"{v}_all_ms": times[v] for v in VARIANTS}}
        for v in ("observe", "enforce"):
            g = guards[v]
            row[f"{v}_below_per_call"] = g.below_floor / max(g.sampled, 1)
            row[f"{v}_fallbacks_per_call"] = g.fallbacks / max(g.sampled, 1)
            row[f"{v}_overhead_1_16"] = ((med["idle"] - med["off"]) + (med[v] - med["idle"]) / 16) / med["off"]
            row[f"{v}_checked_extra"] = (med[v] - med["idle"]) / med["off"]
            row[f"{v}_summary"] = g.summary(worst=5)
        row["idle_overhead"] = (med["idle"] - med["off"]) / med["off"]
        rows.append(row)
        print(_table([row]), flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| N | off ms | idle ms | observe ms | enforce ms | idle cost | observe @1/16 | enforce @1/16 | "
             "checked call: observe / enforce extra | below floor per call | fallbacks per call | lowest head mass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        worst = r["observe_summary"]["worst_heads"][:1]
        low = f"L{worst[0]['layer']}H{worst[0]['head']} {worst[0]['mass_mean']:.3f}" if worst else "n/a"
        lines.append(f"| {r['n']} | {r['off_ms']:.1f} | {r['idle_ms']:.1f} | {r['observe_ms']:.1f} | "
                     f"{r['enforce_ms']:.1f} | {100 * r['idle_overhead']:+.2f}% | "
                     f"{100 * r['observe_overhead_1_16']:+.2f}% | "
                     f"{100 * r['enforce_overhead_1_16']:+.2f}% | {100 * r['observe_checked_extra']:+.1f}% / "
                     f"{100 * r['enforce_checked_extra']:+.1f}% | {r['observe_below_per_call']:.1f} | "
                     f"{r['enforce_fallbacks_per_call']:.1f} | {low} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("qwen", "smollm2"), default="qwen")
    p.add_argument("--config", default=None, help="PatternConfig (default: the model's bundled one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 120000])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dense-tail", type=int, default=128, help="as the app's Qwen runs (0 for none)")
    p.add_argument("--dense-threshold", type=int, default=0, help="0: sparse at every length (32K included)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--min-mass", type=float, default=None, help="the guard's floor (default: GuardSettings')")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = run(args.model, args.device, args.lengths, args.rounds, args.dense_tail, args.dense_threshold,
               args.backend, args.min_mass, args.config)
    print(_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
