"""Configs for the late-local hypothesis (not a search option): the mass proxy's allocation with
the local-only A-shapes (window <= 4096) forbidden in layers >= 14, at the predicted cost of the
mass family's 0.1 / 0.15 / 0.2 points (571.9 / 370.5 / 253.3 ms), plus the mass family's
0.03 / 0.04 points. Worst ratio 1.2, fixed 785 ms, as the families. Run from the repo root."""
import dataclasses
import numpy as np
from minference.app.search import SearchResult
from minference.app import frontier as F
r = SearchResult.load("benchmarks/results/h100_s22_qwen15_measurements_130k.json.gz")
cm = F.CostModel.load("benchmarks/results/h200_s20_costs_qwen1.5b_130k.json")
opt = F.head_options(r, cm, proxy="mass")
local = [c.kind == "a_shape" and c.window <= 4096 for c in opt.candidates]
nl = dataclasses.replace(opt, allowed=opt.allowed.clone())
nl.allowed[14:, :, local] = False
out = ".stage/cfg/nl/"
for b in (0.03, 0.04):
    p = F.frontier_family(r, opt, [b], worst_ratio=1.2, fixed=785, cost_source=cm.source)[0]
    p.config.save(f"{out}m{int(b*100):02d}.json")
    print(f"m{int(b*100):02d}", "cost", round(p.allocation.cost, 1), p.config.counts())
for name, target in (("nl10", 571.9), ("nl15", 370.5), ("nl20", 253.3)):
    best = None
    for bud in np.arange(0.005, 0.4, 0.0025):
        try:
            al = F.allocate(nl, float(bud), worst_ratio=1.2, fixed=785)
        except F.FrontierError:
            continue
        if al.cost <= target + 0.5 and (best is None or al.cost > best[1].cost):
            best = (float(bud), al)
    p = F.frontier_family(r, nl, [best[0]], worst_ratio=1.2, fixed=785, cost_source=cm.source)[0]
    p.config.save(f"{out}{name}.json")
    ch = p.allocation.choice
    late = int(np.array(local)[ch[14:].numpy()].sum())
    print(name, "budget", best[0], "cost", round(p.allocation.cost, 1), "mean missed", round(p.allocation.error / opt.heads, 4),
          p.config.counts(), "late local", late)
for b in (0.1, 0.15, 0.2):
    a = F.allocate(opt, b, worst_ratio=1.2, fixed=785)
    print("mass", b, "cost", round(a.cost, 1), "late local", int(np.array(local)[a.choice[14:].numpy()].sum()))
