"""Dense against sparse prefill of the main job on the CPU, idle or under a competing load (issue 30).

The main job's model, prompt and config (SmolLM2-135M-Instruct, a 4096-token passkey prompt,
``fixtures/configs/smollm2-135m.json``, backend ``torch``, always sparse): one warm-up prefill of
each, then ``--repeats`` rounds of one dense and one sparse prefill, interleaved, so the ratio
compares the two under the same load. The thread count is the main job's
(:mod:`minference.app.threads`: ``--threads`` or the policy). ``--load N`` first starts ``N``
busy-loop processes (a competing load; they are stopped at the end) and waits ``--settle``
seconds. Prints one row per run: command, the 1-minute load average before and after, the
threads, the dense and sparse prefill seconds (median of the rounds, and every round), and the
ratio dense / sparse of the medians.

    python benchmarks/bench_cpu.py [--tokens 4096] [--repeats 3] [--threads N] [--load N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: The competing load: one Python busy loop per process.
BUSY_LOOP = "while True: pass"


def _loadavg() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (default: the main job's, 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved dense/sparse rounds")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the main job's policy)")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes started as a competing load")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds to wait after starting the load")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)

    load_before_start = _loadavg()
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
    try:
        if procs:
            time.sleep(args.settle)
        import torch

        from minference.app.threads import apply_threads, choose_threads

        choice = choose_threads(args.threads)  # as the main job: before the model loads
        apply_threads(choice)
        import minference.integration as integ
        from minference.app.main_job import DEFAULT_CONFIG, DEFAULT_TOKENS
        from minference.app.models import load_smollm2, timed_prefill
        from minference.app.prompts import passkey_prompt
        from minference.config import load_config

        model, tokenizer = load_smollm2()
        config = load_config(DEFAULT_CONFIG, model)
        n = DEFAULT_TOKENS if args.tokens is None else args.tokens
        ids, _ = passkey_prompt(tokenizer, n, key=None, depth=0.5, seed=0)

        def sparse() -> float:
            integ.patch(model, config, backend="torch", dense_threshold=0, check_fingerprint=False)
            try:
                return timed_prefill(model, ids[None])[0]
            finally:
                integ.unpatch(model)

        warm = ids[:256]
        timed_prefill(model, warm[None])
        integ.patch(model, config, backend="torch", dense_threshold=0, check_fingerprint=False)
        timed_prefill(model, warm[None])
        integ.unpatch(model)
        load_before = _loadavg()
        dense_s, sparse_s = [], []
        for _ in range(args.repeats):
            dense_s.append(timed_prefill(model, ids[None])[0])
            sparse_s.append(sparse())
        load_after = _loadavg()
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    d, s = statistics.median(dense_s), statistics.median(sparse_s)
    result = dict(command="python benchmarks/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  tokens=n, threads=choice.threads, thread_reason=choice.reason, cores=choice.cores,
                  busy_loops=args.load, load_at_start=round(load_before_start, 2),
                  load_at_choice=round(choice.load, 2), load_before=round(load_before, 2),
                  load_after=round(load_after, 2), dense_s=[round(x, 2) for x in dense_s],
                  sparse_s=[round(x, 2) for x in sparse_s], dense_median=round(d, 2), sparse_median=round(s, 2),
                  ratio=round(d / s, 3), torch=torch.__version__)
    print("| command | load (start / rounds before / after) | threads | dense s (median; rounds) | "
          "sparse s (median; rounds) | dense / sparse |")
    print(f"| `{result['command']}` | {load_before_start:.2f} / {load_before:.2f} / {load_after:.2f} | "
          f"{choice.threads} ({choice.reason}) | {d:.2f}; {', '.join(f'{x:.2f}' for x in dense_s)} | "
          f"{s:.2f}; {', '.join(f'{x:.2f}' for x in sparse_s)} | {d / s:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
