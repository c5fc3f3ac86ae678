#!/usr/bin/env bash
# The benchmark gate shown to work on one GPU runner (docs/verification.md, "Benchmark regression gates"):
#   1-2. `tox -e bench` twice on this unchanged tree: each benchmark's run-to-run spread of the median
#   3.   the gate's threshold from that spread: T = max(5, ceil(3 x the largest spread)) percent
#   4.   A-shape's unmasked fast path disabled (kernels/ashape.py: every key tile of the kernel runs masked):
#        `tox -e bench` compared with run 1 under --benchmark-compare-fail=median:T% must fail
#   5.   the tree restored: the same comparison must pass
# Runs land in the per-GPU store (.benchmarks/<gpu>/...) as NNNN_gate<k>.json; logs and the table in $OUT.
#   OUT=out TOX="python -m tox" bash benchmarks/gate_demo.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
TOX=${TOX:-python -m tox}
mkdir -p "$OUT"
KERNEL=kernels/ashape.py
FAST='rows_full = (m0 >= q_lo) & (m0 + BLOCK_M <= row_len)'
[ "$(grep -cF "$FAST" "$KERNEL")" = 1 ] || { echo "gate_demo: the fast-path line moved in $KERNEL" >&2; exit 2; }

saved() {  # path of the newest run saved under the name gate$1
    ls -t .benchmarks/*/*/*_gate"$1".json 2>/dev/null | head -1
}
bench() {  # k, extra pytest arguments...
    local k=$1; shift
    # shellcheck disable=SC2086
    $TOX -e bench -- --benchmark-save="gate$k" "$@" >"$OUT/gate$k.log" 2>&1
    local rc=$?
    echo "run $k: rc=$rc $(tail -1 "$OUT/gate$k.log")" | tee -a "$OUT/gate_summary.txt"
    return $rc
}

bench 1 || exit 1
bench 2 || exit 1
T=$(python - "$(saved 1)" "$(saved 2)" "$OUT/gate_spread.md" <<'EOF'
import json, math, sys
runs = [{b["fullname"]: b["stats"]["median"] for b in json.load(open(p))["benchmarks"]} for p in sys.argv[1:3]]
rows = [(name, runs[0][name], runs[1][name], abs(runs[1][name] / runs[0][name] - 1)) for name in runs[0]]
T = max(5, math.ceil(300 * max(r[3] for r in rows)))
with open(sys.argv[3], "w") as f:
    f.write("| benchmark | run 1 median ms | run 2 median ms | spread |\n|---|---|---|---|\n")
    for name, a, b, s in sorted(rows):
        f.write(f"| {name.split('::')[-1]} | {a * 1e3:.3f} | {b * 1e3:.3f} | {100 * s:.2f}% |\n")
    f.write(f"\nlargest spread {100 * max(r[3] for r in rows):.2f}%: threshold median:{T}%\n")
print(T)
EOF
)
cat "$OUT/gate_spread.md" | tee -a "$OUT/gate_summary.txt"
BASE=$(basename "$(saved 1)" | cut -d_ -f1)
GATE=(--benchmark-compare="$BASE" --benchmark-compare-fail="median:${T}%")

cp "$KERNEL" "$OUT/ashape.py.orig"
sed -i "s/$FAST/rows_full = (m0 >= q_lo) \& (m0 + BLOCK_M <= row_len) \& (m0 < 0)/" "$KERNEL"
bench 3 "${GATE[@]}"; slowed=$?
cp "$OUT/ashape.py.orig" "$KERNEL"
bench 4 "${GATE[@]}"; restored=$?
grep -E "FAIL|Performance has regressed" -A12 "$OUT/gate3.log" | head -40 >>"$OUT/gate_summary.txt"
python - "$(saved 1)" "$(saved 3)" "$(saved 4)" <<'EOF' | tee -a "$OUT/gate_summary.txt"
import json, sys
runs = [{b["fullname"]: b["stats"]["median"] for b in json.load(open(p))["benchmarks"]} for p in sys.argv[1:4]]
print("\n| benchmark | run 1 ms | slowed ms | change | restored ms | change |\n|---|---|---|---|---|---|")
for name in sorted(runs[0]):
    a, s, r = runs[0][name], runs[1].get(name, float("nan")), runs[2].get(name, float("nan"))
    print(f"| {name.split('::')[-1]} | {a * 1e3:.3f} | {s * 1e3:.3f} | {100 * (s / a - 1):+.1f}% | {r * 1e3:.3f} "
          f"| {100 * (r / a - 1):+.1f}% |")
EOF
echo "gate on the slowed kernel: rc=$slowed (must be non-zero); on the restored tree: rc=$restored (must be 0)" \
    | tee -a "$OUT/gate_summary.txt"
[ "$slowed" != 0 ] && [ "$restored" = 0 ]
