"""Picture of measured end-to-end prefill times against cuDNN dense attention, from the JSON that
``benchmarks/bench_end_to_end.py --json`` writes (one or more files; for each length and inputs,
every value comes from the last file that measured it).

``python benchmarks/plot_end_to_end.py a.json b.json --lengths 16384 24576 32768 131072 1048576
--out docs/img/e2e_h200.png`` (archived reports first: ``git show
results-archive:benchmarks/results/h200_s4_run5_e2e.json > a.json``, the same for
``results-archive:benchmarks/results/h200_s4_run7_e2e.json``; see benchmarks/results/README.md)

Needs matplotlib (the ``plot`` extra); reads only measured numbers, draws no fit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: (row key, legend label, line style) of the vertical-slash series.
SERIES = [
    ("dense", "cuDNN SDPA dense (causal)", dict(color="black", marker="s")),
    ("e2e", "vertical-slash end to end", dict(color="tab:blue", marker="o", linewidth=2)),
    ("e2e_graph", "  the same, replayed from a CUDA graph", dict(color="tab:purple", marker="o", linestyle="--")),
    ("e2e_b2b", "  the same, calls back to back", dict(color="tab:cyan", marker="o", linestyle="-.")),
    ("dense_b2b", "cuDNN dense, calls back to back", dict(color="gray", marker="s", linestyle="-.")),
    ("kernel", "  its kernel (gap-filled index)", dict(color="tab:blue", marker=".", linestyle="--")),
    ("kernel_nofill", "  its kernel on the exact set", dict(color="tab:blue", marker="x", linestyle=":")),
    ("index", "  its index build", dict(color="tab:green", marker=".", linestyle="--")),
    ("convert", "  its conversion", dict(color="tab:olive", marker=".", linestyle="--")),
    ("ashape_e2e", "A-shape end to end", dict(color="tab:orange", marker="^", linestyle="none")),
    ("block_e2e", "block-sparse end to end", dict(color="tab:red", marker="v", linestyle="none")),
]


def load_rows(paths: list[str], inputs: str) -> tuple[list[dict], str]:
    rows: dict[int, dict] = {}
    device = ""
    for path in paths:
        data = json.loads(Path(path).read_text())
        device = data.get("device", device)
        for row in data["rows"]:
            if row.get("inputs") == inputs:
                rows[row["N"]] = {**rows.get(row["N"], {}), **row}
    return [rows[n] for n in sorted(rows)], device


def plot(rows: list[dict], device: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for key, label, style in SERIES:
        pts = [(r["N"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot([n for n, _ in pts], [ms for _, ms in pts], label=label, **style)
    for r in rows:
        if "dense" in r and "e2e" in r:
            ax.annotate(f"{r['dense'] / r['e2e']:.2g}x", (r["N"], r["e2e"]), textcoords="offset points",
                        xytext=(4, -12), fontsize=8, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length N (tokens)")
    ax.set_ylabel("ms (median, CUDA events)")
    ax.set_title(f"Prefill attention of one layer, Hq=32, Hkv=8, D=128, bf16 - {device}\n"
                 "vertical-slash (1000, 6096) on smooth inputs; labels: dense / sparse end to end", fontsize=10)
    ticks = [r["N"] for r in rows]
    ax.set_xticks(ticks, [f"{n // 1024}K" for n in ticks])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="bench_end_to_end.py --json outputs")
    ap.add_argument("--inputs", default="smooth", choices=("smooth", "random"))
    ap.add_argument("--out", default="e2e.png")
    ap.add_argument("--lengths", type=int, nargs="*", help="plot only these lengths (default: all)")
    args = ap.parse_args(argv)
    rows, device = load_rows(args.json, args.inputs)
    if args.lengths:
        rows = [r for r in rows if r["N"] in args.lengths]
    if not rows:
        raise SystemExit(f"no rows with inputs={args.inputs!r} in {args.json}")
    plot(rows, device, args.out)
    print(f"wrote {args.out} ({len(rows)} lengths)")


if __name__ == "__main__":
    main()
