import torch, dataclasses
from minference.app.search import SearchResult
from minference.app import frontier as F
r = SearchResult.load('/tmp/w/q15_measurements.json.gz')
cm = F.CostModel.load('benchmarks/results/h200_s20_costs_qwen1.5b_130k.json')
opt = F.head_options(r, cm, proxy='mass')
L, H, C = opt.cost.shape
groups = [(0,6),(7,13),(14,20),(21,27)]
def permm(alloc):
    ch = alloc.choice.long()[..., None]
    e = opt.error.gather(-1, ch)[...,0]
    return [float(e[a:b+1].mean()) for a,b in groups]
a20 = F.allocate(opt, 0.2, worst_ratio=1.2, fixed=785)
mm = permm(a20); print('f20 per-group missed mass', [round(x,3) for x in mm], 'cost', a20.cost)
dnll = [1.779-1.782, 1.792-1.782, 1.956-1.782, 1.937-1.782]
slope = [max(d,0.0)/m for d,m in zip(dnll,mm)]
print('slopes nats/unit', [round(s,3) for s in slope])
for a,b in [(0.07,None),(0.1,None),(0.15,None)]:
    al = F.allocate(opt, a, worst_ratio=1.2, fixed=785); print('mass', a, round(al.cost,1), [round(x,3) for x in permm(al)], 'pred dNLL', round(sum(s*m*(b-a0+1)/ (b-a0+1) for s,m,(a0,b) in zip(slope,permm(al),groups))/1,4))
import sys
floor = float(sys.argv[1]) if len(sys.argv)>1 else 0.02
w = torch.ones(L, dtype=torch.float64)
for (a,b),s in zip(groups,slope): w[a:b+1] = max(s, floor)
w = w / w.mean()
print('weights', [round(float(w[a]),3) for a,_ in groups])
wopt = dataclasses.replace(opt, error=opt.error*w[:,None,None], worst_error=opt.worst_error*w[:,None,None])
for bud in [0.02,0.03,0.04,0.05,0.06,0.08,0.1,0.12,0.15]:
    try:
        al = F.allocate(wopt, bud, worst_ratio=1.2, fixed=785)
    except Exception as e: print(bud, e); continue
    ch = al.choice.long()
    counts = [int((ch==i).sum()) for i in range(C)]
    print('w', bud, 'cost', round(al.cost,1), 'permm', [round(x,3) for x in permm(al)], 'pred', round(sum(s*m for s,m in zip(slope,permm(al))),4))
