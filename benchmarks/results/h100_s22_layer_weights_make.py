import torch, dataclasses, numpy as np
from minference.app.search import SearchResult
from minference.app import frontier as F
r = SearchResult.load('/tmp/w/q15_measurements.json.gz')
cm = F.CostModel.load('benchmarks/results/h200_s20_costs_qwen1.5b_130k.json')
opt = F.head_options(r, cm, proxy='mass')
L = opt.cost.shape[0]
groups = [(0,6),(7,13),(14,20),(21,27)]
slope = [0.0, 0.064, 0.895, 0.59]
for floor in (0.02, 0.3):
    w = torch.ones(L, dtype=torch.float64)
    for (a,b),s in zip(groups,slope): w[a:b+1] = max(s, floor)
    w = w / w.mean()
    wopt = dataclasses.replace(opt, error=opt.error*w[:,None,None], worst_error=opt.worst_error*w[:,None,None])
    for target in (571.9, 370.5, 253.3):
        best=None
        for bud in np.arange(0.005, 0.4, 0.0025):
            try: al = F.allocate(wopt, float(bud), worst_ratio=1.2, fixed=785)
            except Exception: continue
            if best is None or abs(al.cost-target) < abs(best[1].cost-target): best=(bud,al)
        bud = float(best[0])
        pts = F.frontier_family(r, wopt, [bud], worst_ratio=1.2, fixed=785, cost_source=cm.source)
        p = pts[0]; name=f'/tmp/w/w{int(floor*100):02d}_{int(round(target))}.json'
        p.config.save(name)
        ch=p.allocation.choice.long()[...,None]; e=opt.error.gather(-1,ch)[...,0]
        print(name, 'budget', round(bud,4), 'cost', round(p.allocation.cost,1), p.config.counts(), 'group mm', [round(float(e[a:b+1].mean()),3) for a,b in groups], 'mean mm', round(float(e.mean()),4))
