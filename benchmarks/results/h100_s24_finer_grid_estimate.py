import torch, dataclasses
from minference.app.search import SearchResult
from minference.app.frontier import CostModel, head_options, allocate
from minference.patterns import BlockSparse
r = SearchResult.load("benchmarks/results/h100_s22_qwen15_measurements_130k.json.gz")
cm = CostModel.load("benchmarks/results/h200_s20_costs_qwen1.5b_130k.json")
i03, i01 = 11, 14
def geo(x):  # geometric extrapolation one alpha step further (0.01 -> 0.003)
    a, b = x[..., i03:i03+1], x[..., i01:i01+1]
    return (b * b / a.clamp(min=1e-9))
new = {}
for k in ("mass", "worst_mass"):
    m = getattr(r, k); miss = geo(1 - m).clamp(0, 1); new[k] = torch.cat([m, 1 - miss], -1)
for k in ("tiles", "max_tiles", "density", "cost"):
    x = getattr(r, k); new[k] = torch.cat([x, geo(x).clamp(max=1.0)], -1)
for k in ("out_error", "worst_out_error"):
    x = getattr(r, k); new[k] = torch.cat([x, geo(x)], -1)
cand = BlockSparse(top_k=1016, block=128, rule="relative", threshold=0.003, estimate="query")
r2 = dataclasses.replace(r, candidates=list(r.candidates) + [cand], **new)
o1, o2 = head_options(r, cm), head_options(r2, cm)
for b in (0.01, 0.02, 0.03, 0.05):
    a1 = allocate(o1, b, worst_ratio=1.2, fixed=785); a2 = allocate(o2, b, worst_ratio=1.2, fixed=785)
    n_new = int((a2.choice == len(r2.candidates) - 1).sum())
    print(f"{b}: base {a1.cost:.1f} ms | +BS a.003 cap1 (extrapolated) {a2.cost:.1f} ms, heads on it {n_new}, dense {int((a2.choice==18).sum())} vs {int((a1.choice==18).sum())}")
