#!/usr/bin/env bash
# One device call: install, GPU test tier, compute-sanitizer fuzz, benchmark tables; logs in $OUT.
# Stages run in the order STAGES lists them; wall-clock bounds and bench arguments come from the
# environment, e.g.
#   STAGES="install bench bench2 sanitize tests" T_BENCH=40 T_BENCH2=60 T_SAN=35 T_TESTS=55 \
#   BENCH_ARGS="--lengths 524288 --hkv 32 --no-flex" BENCH_ARGS2="--lengths 131072 --hkv 32" \
#   bash benchmarks/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "=== $* [$(date +%T)]" | tee -a "$OUT/summary.txt"; }

install() {
    python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -3
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
        | tee -a "$OUT/summary.txt"
}
tests() {
    log "gpu test tier (profile ${MINFERENCE_HYPOTHESIS_PROFILE:=ci})"
    export MINFERENCE_HYPOTHESIS_PROFILE
    timeout "${T_TESTS:-70}" python -m pytest tests/unit/test_kernel_common.py tests/unit/test_kernel_ashape.py \
        tests/unit/test_kernel_vertical_slash.py tests/unit/test_kernel_block_sparse.py \
        -m "gpu or interpret" -q -rA --maxfail=6 -p no:cacheprovider -W ignore::UserWarning \
        -n "${XDIST:-14}" 2>&1 | grep -v -i "benchmark" | tee "$OUT/tests.log" | tail -40
    log "tests rc=$?"
}
sanitize() {
    log "compute-sanitizer memcheck on benchmarks/sanitize_fuzz.py"
    local cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SAN:-45}" "$cs" --tool memcheck --print-limit 20 \
        python benchmarks/sanitize_fuzz.py 2>&1 | tee "$OUT/sanitize.log" | tail -4
    log "sanitize rc=$?"
}
bench_run() {  # name, time bound, arguments
    log "benchmark $1: $3"
    # shellcheck disable=SC2086
    timeout "$2" python benchmarks/bench_kernels.py $3 --json "$OUT/$1.json" 2>"$OUT/$1.err" | tee "$OUT/$1.md"
    log "$1 rc=$?"
    tail -3 "$OUT/$1.err"
}

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
for stage in ${STAGES:-install tests sanitize bench}; do
    case $stage in
        install) install ;;
        tests) tests ;;
        sanitize) sanitize ;;
        bench) bench_run bench "${T_BENCH:-80}" "${BENCH_ARGS:-}" ;;
        bench2) bench_run bench2 "${T_BENCH2:-80}" "${BENCH_ARGS2:-}" ;;
        *) echo "unknown stage $stage" ;;
    esac
done
cat "$OUT/summary.txt"
