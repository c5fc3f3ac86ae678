# The least-squares fits of docs/search.md ("A hypothesis from the recorded runs"). /tmp/arch/* are
# results-archive:benchmarks/results/h100_s22_qwen15_nll_proxies_130k_{seed0,seed1,ablate}.json (git show).
import json, numpy as np, pickle
from scipy.optimize import nnls
from minference.app.search import SearchResult
from minference.config import PatternConfig
r = SearchResult.load("benchmarks/results/h100_s22_qwen15_measurements_130k.json.gz")
cands=list(r.candidates); miss=(1-r.mass).numpy(); oe=r.out_error.numpy()
reports = {"s20": "benchmarks/results/h200_s20_qwen15_nll_130k.json", "s21": "benchmarks/results/h100_s21_qwen15_nll_130k.json",
           "s22a": "/tmp/arch/h100_s22_qwen15_nll_proxies_130k_seed0.json", "s22s1": "/tmp/arch/h100_s22_qwen15_nll_proxies_130k_seed1.json",
           "s22ab": "/tmp/arch/h100_s22_qwen15_nll_proxies_130k_ablate.json"}
dense = {0: np.mean([1.7747,1.7889,1.7815]), 1: np.mean([1.792,1.7855,1.7865])}
seen=set(); X=[]; y=[]; names=[]
grp=lambda c: ("A"+str(c.window//1024)) if c.kind=="a_shape" else {"block_sparse": "BS", "vertical_slash": "VS", "dense": None}[c.kind]
cats=["A1","A4","A16","BS","VS"]
def feats(choice):
    f=np.zeros((len(cats),4))
    for L in range(28):
        for h in range(12):
            g=grp(cands[choice[L,h]])
            if g: f[cats.index(g), L//7]+=miss[L,h,choice[L,h]]
    return f
for tag,fn in reports.items():
    d=json.load(open(fn)); seed=d["settings"]["seed"]
    nll={}
    for rec in d["records"]:
        if rec["task"]=="perplexity": nll.setdefault(rec["config"],[]).append(rec["nll"])
    for c in d["configs"]:
        if not c["config"]: continue
        key=(seed,c["name"]) if tag!="s22a" else (seed, c["name"].replace("m","f") if c["name"]!="m07" else "m07")
        ch=np.array([[cands.index(p) for p in l] for l in PatternConfig.from_dict(c["config"]).layers])
        k2=(seed, ch.tobytes())
        if k2 in seen: continue
        seen.add(k2); X.append(feats(ch)); y.append(np.mean(nll[c["name"]])-dense[seed]); names.append(f"{tag}:{c['name']}")
X=np.array(X); y=np.array(y)
print(len(y), "distinct configs")
def fit(A, y):
    w,_=nnls(A,y); return w
for label, A in [("total miss", X.sum((1,2))[:,None]),
                 ("by kind", X.sum(2)),
                 ("by group", X.sum(1)),
                 ("A-small vs rest", np.stack([X[:,:2].sum((1,2)), X[:,2:].sum((1,2))],1)),
                 ("A-small/rest x late/early", np.stack([X[:,:2,:2].sum((1,2)), X[:,:2,2:].sum((1,2)), X[:,2:,:2].sum((1,2)), X[:,2:,2:].sum((1,2))],1))]:
    w=fit(A,y); pred=A@w
    loo=[]
    for i in range(len(y)):
        m=np.arange(len(y))!=i; wi=fit(A[m],y[m]); loo.append(A[i]@wi)
    loo=np.array(loo)
    print(f"{label:28s} w={np.round(w,4)} rms fit {np.sqrt(np.mean((pred-y)**2)):.4f} LOO {np.sqrt(np.mean((loo-y)**2)):.4f}")
    if label.startswith("A-small/rest"):
        for n,yy,p,l in zip(names,y,pred,loo): print(f"   {n:16s} {yy:+.3f} fit {p:+.3f} loo {l:+.3f}")
print()
# local-only heads per layer (A-shape window <= 4096) per config, layers 14-27
allch={}
for tag,fn in reports.items():
    d=json.load(open(fn)); seed=d["settings"]["seed"]
    for c in d["configs"]:
        if c["config"]: allch[f"{tag}:{c['name']}"]=np.array([[cands.index(p) for p in l] for l in PatternConfig.from_dict(c["config"]).layers])
loc=np.array([c.kind=="a_shape" and c.window<=4096 for c in cands])
a16=np.array([c.kind=="a_shape" and c.window>4096 for c in cands])
for n,yy in zip(names,y):
    ch=allch[n]; lo=loc[ch].sum(1); a=a16[ch].sum(1)
    print(f"{n:16s} {yy:+.3f} local-only/layer", "".join(f"{v:x}" for v in lo), " A16/layer", "".join(f"{v:x}" for v in a))
print()
F=[]
for n in names:
    ch=allch[n]; lo=loc[ch].sum(1)
    F.append([lo[14:].sum(), (lo[14:]**2).sum()/12, X[names.index(n)].sum()])
F=np.array(F)
for lab,A in [("late local count",F[:,:1]),("late local^2",F[:,1:2]),("late local + miss",F[:,[0,2]]),("late local^2 + miss",F[:,[1,2]])]:
    w=fit(A,y); pred=A@w
    loo=np.array([A[i]@fit(A[np.arange(len(y))!=i],y[np.arange(len(y))!=i]) for i in range(len(y))])
    print(f"{lab:22s} w={np.round(w,5)} rms {np.sqrt(np.mean((pred-y)**2)):.4f} LOO {np.sqrt(np.mean((loo-y)**2)):.4f}")
    if lab=="late local^2 + miss":
        for n,yy,p,l,f in zip(names,y,pred,loo,F): print(f"   {n:16s} {yy:+.3f} fit {p:+.3f} loo {l:+.3f}  late-local {f[0]:.0f}")
