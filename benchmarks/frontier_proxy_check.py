"""Does the frontier's error proxy predict end-task damage? A CPU check on SmolLM2 at a short
length (docs/search.md, "Checking the proxy").

The frontier search ranks configs by their predicted error, the mean missed attention mass per
head on the calibration prompts (``--proxy output``: the mean relative output error). This
script searches SmolLM2-135M at ``--tokens`` with the frontier candidates, writes the family at
``--budgets`` and, for comparison, the per-head min-mass rule's configs (another allocation, so a
proxy that only orders one family's points is not enough), then measures each config's mean
next-token NLL on held-out haystack prompts of the eval suite
(:func:`minference.app.evals.perplexity_ids`) with the portable backend, sparse from the first
token (``dense_threshold=0``), against dense in the same run. It prints a markdown table and the
Spearman rank correlation of predicted error with the NLL increase.

    python benchmarks/frontier_proxy_check.py --tokens 2048 --out benchmarks/results/cpu_frontier_proxy_smollm2_2k.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from minference.app import frontier as F
from minference.app import search as S
from minference.app.evals import perplexity_ids
from minference.app.evaluate import sequence_nll
from minference.app.models import load_smollm2
from minference.app.prompts import calibration_prompts
from minference.integration import patch, unpatch

#: Error budgets of the family (mean error per head of the proxy).
BUDGETS = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15)
#: The per-head rule's thresholds measured alongside.
RULE_MASSES = (0.8, 0.9, 0.95)
#: Routing block of the block-sparse candidates at short lengths (128 leaves too few blocks).
BLOCK = 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=2, help="calibration prompts")
    parser.add_argument("--eval-prompts", type=int, default=2, help="held-out perplexity prompts")
    parser.add_argument("--row-stride", type=int, default=8)
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help="the family's error budgets")
    parser.add_argument("--proxy", choices=sorted(F.PROXIES), default="mass", help="the allocation's error proxy")
    parser.add_argument("--out", default=None, help="markdown file to write (rewritten after every config)")
    args = parser.parse_args(argv)
    start = time.time()
    model, tokenizer = load_smollm2()
    prompts = calibration_prompts(tokenizer, args.tokens, args.prompts, seed=0)
    cands = S.frontier_candidates(args.tokens, blocks=(BLOCK,))
    result = S.search(model, prompts, candidates=cands, select="cheapest", min_mass=0.9, row_stride=args.row_stride,
                      progress=False)
    sig = result.config.model
    options = F.head_options(result, F.CostModel.proxy(sig.head_dim, args.tokens, sig.num_heads), proxy=args.proxy)
    points = F.frontier_family(result, options, args.budgets, worst_ratio=None, cost_source="tile proxy")
    configs = [(f"frontier {p.budget:g}", p.config, p.allocation.error / options.heads, p.allocation.cost)
               for p in points]
    for m in RULE_MASSES:
        config = result.rechoose(m, "cheapest")
        choice = torch.tensor([[options.candidates.index(p) for p in row] for row in config.layers])
        cost, error, _ = options.totals(choice)
        configs.append((f"rule min_mass {m:g}", config, error / options.heads, cost))
    print(f"search done in {time.time() - start:.0f} s", file=sys.stderr)
    held_out = [perplexity_ids(tokenizer, args.tokens, i, seed=1) for i in range(args.eval_prompts)]

    def nll() -> tuple[float, float]:
        values = [sequence_nll(model, ids) for ids in held_out]
        half = args.tokens // 2
        return (float(torch.stack(values).mean()), float(torch.stack([v[half:] for v in values]).mean()))

    dense_all, dense_late = nll()
    rows: list[tuple] = []

    def table() -> str:
        lines = [f"## Frontier proxy vs NLL: SmolLM2-135M, {args.tokens} tokens (CPU, fp32, torch backend)", "",
                 f"search: {args.prompts} calibration prompts, every {args.row_stride}th row, frontier candidates "
                 f"(block {BLOCK}), tile-proxy cost, error proxy {args.proxy} ({F.PROXIES[args.proxy]}); "
                 f"NLL on {args.eval_prompts} held-out perplexity prompts "
                 f"(dense {dense_all:.4f} nats, second half {dense_late:.4f})", "",
                 "| config | predicted error | predicted cost (dense tiles) | ΔNLL | ΔNLL 2nd half "
                 "| A / VS / BS / dense |",
                 "|---|---|---|---|---|---|"]
        for name, error, cost, d_all, d_late, c in rows:
            lines.append(f"| {name} | {error:.4f} | {cost:.2f} | {d_all:+.4f} | {d_late:+.4f} | {c['a_shape']} / "
                         f"{c['vertical_slash']} / {c['block_sparse']} / {c['dense']} |")
        errors = [r[1] for r in rows]
        fam = min(len(rows), len(points))
        if len(rows) > 2:
            rho = F.rank_agreement
            lines += ["", f"Spearman(predicted error, ΔNLL) = {rho(errors, [r[3] for r in rows]):.3f} over "
                      f"{len(rows)} configs; second half {rho(errors, [r[4] for r in rows]):.3f}; frontier "
                      f"only {rho(errors[:fam], [r[3] for r in rows[:fam]]):.3f}"]
        lines += ["", f"wall time {time.time() - start:.0f} s" + ("" if len(rows) == len(configs) else
                                                                     f" (cut short: {len(rows)} of {len(configs)})")]
        return "\n".join(lines)

    for name, config, error, cost in configs:
        patch(model, config, backend="torch", dense_threshold=0)
        try:
            all_, late = nll()
        finally:
            unpatch(model)
        rows.append((name, error, cost, all_ - dense_all, late - dense_late, config.counts()))
        print(f"{name}: error {error:.4f} cost {cost:.3f} dNLL {all_ - dense_all:+.4f} "
              f"(2nd half {late - dense_late:+.4f})", file=sys.stderr)
        if args.out:
            Path(args.out).write_text(table() + "\n", encoding="utf-8")
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
