#!/usr/bin/env bash
# One device call for the dispatcher: install, gpu-marked builder/dispatcher tests (CUDA-graph
# capture included), end-to-end benchmark; logs in $OUT.
#   STAGES="install tests bench"  T_TESTS=70 T_BENCH=90  BENCH_ARGS="--lengths 8192 131072"
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"install tests bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "=== $* [$(date +%T)]" | tee -a "$OUT/summary.txt"; }

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
if has install; then
    python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -3
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
fi
if has tests; then
    export MINFERENCE_HYPOTHESIS_PROFILE=${MINFERENCE_HYPOTHESIS_PROFILE:-ci}
    log "gpu tests (profile $MINFERENCE_HYPOTHESIS_PROFILE)"
    timeout "${T_TESTS:-70}" python -m pytest tests/unit/test_estimators.py tests/unit/test_dispatch.py -m gpu -q \
        -p no:cacheprovider -n "${XDIST:-4}" 2>&1 | tee "$OUT/tests.log" | tail -30
    log "tests rc=$?"
fi
if has bench; then
    log "bench_end_to_end ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    timeout "${T_BENCH:-90}" python benchmarks/bench_end_to_end.py ${BENCH_ARGS:-} --json "$OUT/e2e.json" \
        2>"$OUT/bench.err" | tee "$OUT/e2e.md"
    log "bench rc=$?"
    tail -8 "$OUT/bench.err"
fi
cat "$OUT/summary.txt"
