#!/usr/bin/env bash
# One device call: install, GPU test tier, compute-sanitizer fuzz, benchmark table; logs in $OUT.
# Stages and their wall-clock bounds come from the environment so each call can pick:
#   STAGES="install tests sanitize bench"  T_TESTS=70 T_SAN=45 T_BENCH=80
#   BENCH_ARGS="--lengths 131072 --hkv 32 8"
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"install tests sanitize bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "=== $* [$(date +%T)]" | tee -a "$OUT/summary.txt"; }

log "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null)"
if has install; then
    python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -3
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
fi
if has tests; then
    log "gpu test tier (profile ${MINFERENCE_HYPOTHESIS_PROFILE:=ci})"
    export MINFERENCE_HYPOTHESIS_PROFILE
    timeout "${T_TESTS:-70}" python -m pytest tests/unit/test_kernel_common.py tests/unit/test_kernel_ashape.py \
        tests/unit/test_kernel_vertical_slash.py tests/unit/test_kernel_block_sparse.py \
        -m "gpu or interpret" -q --maxfail=6 -p no:cacheprovider --durations=8 -n "${XDIST:-14}" 2>&1 | tee "$OUT/tests.log" | tail -25
    log "tests rc=$?"
fi
if has sanitize; then
    log "compute-sanitizer memcheck on benchmarks/sanitize_fuzz.py"
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SAN:-45}" "$CS" --tool memcheck --print-limit 20 \
        python benchmarks/sanitize_fuzz.py 2>&1 | tee "$OUT/sanitize.log" | tail -8
    log "sanitize rc=$?"
fi
if has bench; then
    log "benchmark ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    timeout "${T_BENCH:-80}" python benchmarks/bench_kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" \
        2>"$OUT/bench.err" | tee "$OUT/bench.md"
    log "bench rc=$?"
    tail -5 "$OUT/bench.err"
fi
cat "$OUT/summary.txt"
