#!/usr/bin/env bash
# One device call that checks and times everything GPU-side; every log lands in $OUT.
# Stages run in the order STAGES lists them, each under its own wall-clock bound:
#   install    editable install against the machine's CUDA torch/triton (no network), plus the
#              carried wheels in .whl (jsonschema and its dependencies; see README)
#   tests:P    the GPU test tier under hypothesis profile P (ci or gpu): every gpu- or
#              interpret-marked test in $TEST_FILES (default tests/unit), on CUDA (T_TESTS
#              seconds, XDIST workers), longest first, with the 40 slowest tests and the compile
#              report in the log; every test's time to $OUT/gpu_durations_P.json (a cold run's
#              is the next tests/gpu_durations.json)
#   sanitize   compute-sanitizer memcheck over benchmarks/sanitize_fuzz.py (all three kernels)
#   bench      benchmarks/bench_kernels.py $BENCH_ARGS   (kernels vs cuDNN / FlexAttention)
#   bench2     benchmarks/bench_kernels.py $BENCH_ARGS2
#   ab         benchmarks/bench_kernels.py $AB_ARGS in each tree of $AB_TREES (paths to unpacked
#              snapshots, e.g. "../.snap0 ." for main before and after a kernel change), each
#              installed before its run, $AB_ROUNDS (2) interleaved rounds, to $OUT/ab_<i>_<round>.*;
#              then this tree is installed again
#   e2e        benchmarks/bench_end_to_end.py $E2E_ARGS  (index / convert / kernel / end to end)
#   qwen       check the staged GGUF of $MODEL (qwen0.5b, the default: /tmp/m/q.gguf; qwen1.5b:
#              /tmp/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; ../shared/tools/stage_models.sh; carry
#              .stage/whl for the gguf wheel, .stage/tok<model> for its converted tokenizer) and point
#              the model's file variable at it
#   costs      benchmarks/calibrate_costs.py $COSTS_ARGS --out $OUT/costs.json (the frontier's cost table)
#   search     minference search on $MODEL: $SEARCH_ARGS, configs to $OUT/qwen_search_<min mass>.json
#              (SEARCH_OUT overrides the name) and /tmp/m/, with any measurements saved as .json.gz
#              (a call returns at most 8 files of $OUT: a family with its measurements is more; leave PACK on)
#   eval       minference eval on $MODEL: $EVAL_ARGS, report to $OUT/eval_$TAG.{json,md,png}, bounded by T_EVAL
#              seconds (default 540), or with CALL_END=585 by what is left of 585 s since this script
#              started (the stages before it vary; a cut eval leaves its checkpointed report); CUDA_GRAPHS=1 adds
#              --cuda-graphs (sparse layers replay CUDA graphs captured by the warm-up prefill). To
#              measure the host time it saves at 16K-32K (dense there unless EVAL_ARGS has
#              --dense-threshold 0), run the same EVAL_ARGS as TAG=eager and as CUDA_GRAPHS=1 TAG=graphs.
#              EVAL_CONTINUE=FILE (RULER, runs over several calls): when FILE exists the eval gets
#              --continue FILE, and its report (complete or cut) is copied back to FILE afterwards,
#              so each call of a machine picks up where the last stopped; put FILE under /tmp/m
#              (seed it with a committed report to continue one from an earlier session)
# e.g. STAGES="install tests:ci tests:gpu" T_TESTS=300 XDIST=16 bash benchmarks/gpu_session.sh
# The exit status is non-zero when a stage failed (the summary names them); a stage whose bound
# would be under 30 s (eval past CALL_END) is skipped and counts as failed.
# With no STAGES every stage runs: name the stages of each device call.
set -o pipefail
if [ $# -gt 0 ]; then  # it takes no arguments: print this header (a stray --help once ran every stage)
    sed -n '2,/^set -o pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    [ "$1" = -h ] || [ "$1" = --help ]
    exit
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "=== $* [$(date +%T)]" | tee -a "$OUT/summary.txt"; }

editable() {  # this directory's tree as the installed minference (kernels/ and reference/ map in)
    python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -3
}
install() {
    editable
    # wheels the machine lacks (carry .whl: jsonschema and its three dependencies, for configs)
    if ls .whl/*.whl >/dev/null 2>&1; then
        python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
        | tee -a "$OUT/summary.txt"
}
tests() {  # hypothesis profile
    log "gpu test tier (hypothesis profile $1)"
    MINFERENCE_HYPOTHESIS_PROFILE=$1 timeout -s INT -k 20 "${T_TESTS:-300}" python -m pytest ${TEST_FILES:-tests/unit} -m "gpu or triton" \
        -v --tb=short -rfE --continue-on-collection-errors -p no:cacheprovider -W ignore::UserWarning -n "${XDIST:-16}" --longest-first tests/gpu_durations.json \
        --durations=40 --compile-report --save-durations "$OUT/gpu_durations_$1.json" 2>&1 | tee "$OUT/tests_$1.log" | tail -25
    local rc=$?  # pytest's (pipefail)
    log "tests rc=$rc"
    return $rc
}
sanitize() {
    log "compute-sanitizer memcheck on benchmarks/sanitize_fuzz.py"
    local cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SAN:-200}" "$cs" --tool memcheck --print-limit 20 \
        python benchmarks/sanitize_fuzz.py 2>&1 | tee "$OUT/sanitize.log" | tail -4
    local rc=$?
    log "sanitize rc=$rc"
    return $rc
}
run_bench() {  # name, script, time bound, arguments
    log "$1: $2 $4"
    # shellcheck disable=SC2086
    timeout "$3" python "$2" $4 --json "$OUT/$1.json" 2>"$OUT/$1.err" | tee "$OUT/$1.md"
    local rc=$?
    log "$1 rc=$rc"
    tail -5 "$OUT/$1.err"
    return $rc
}

ab() {
    local round i tree rc=0
    for round in $(seq 1 "${AB_ROUNDS:-2}"); do
        i=0
        for tree in ${AB_TREES:?AB_TREES names the trees to compare}; do
            i=$((i + 1))
            log "ab round $round, tree $i ($tree): bench_kernels.py $AB_ARGS"
            # shellcheck disable=SC2086
            (cd "$tree" && editable >/dev/null \
                && timeout "${T_AB:-110}" python benchmarks/bench_kernels.py $AB_ARGS --json "$OUT/ab_${i}_$round.json" \
                    >"$OUT/ab_${i}_$round.md" 2>"$OUT/ab_${i}_$round.err")
            local r=$?
            log "ab rc=$r"
            [ $r = 0 ] || rc=$r
        done
    done
    editable
    return $rc
}
MODEL=${MODEL:-qwen0.5b}
# not ${SEARCH_OUT:-...{min_mass}...}: the default's own '}' would end the expansion there
[ -n "${SEARCH_OUT:-}" ] || SEARCH_OUT='qwen_search_{min_mass}.json'
qwen() {
    local file sha var tok
    case $MODEL in
        qwen0.5b|qwen) file=/tmp/m/q.gguf; var=MINFERENCE_QWEN_GGUF; tok=.stage/tok
                       sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
        qwen1.5b) file=/tmp/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; var=MINFERENCE_QWEN15_GGUF; tok=.stage/tok1.5b
                  sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
        *) echo "unknown MODEL $MODEL"; return 1 ;;
    esac
    log "staged $MODEL GGUF"
    echo "$sha  $file" | sha256sum -c - | tee -a "$OUT/summary.txt" || return 1
    python -m pip install -q --no-index --no-deps --target /tmp/site .stage/whl/*.whl 2>&1 | tail -2
    # the tokenizer converted once from the GGUF (carried): saves ~a minute of conversion
    if [ -d "$tok" ]; then mkdir -p "$file.tokenizer" && cp "$tok"/* "$file.tokenizer/"; fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} "$var=$file" HF_HUB_OFFLINE=1
}
app() {  # name, time bound, command...
    local name=$1 bound=$2
    shift 2
    log "$name: $*"
    if [ "$bound" -lt 30 ]; then  # timeout 0 would mean no bound, a negative one an error
        log "$name skipped: ${bound} s left of the call's bound"
        return 1
    fi
    timeout "$bound" "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.md"
    local rc=$?
    log "$name rc=$rc"
    tail -5 "$OUT/$name.err"
    return $rc
}

log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
failed=""
for stage in ${STAGES:-install tests:gpu sanitize bench e2e}; do
    case $stage in
        install) install ;;
        tests:*) tests "${stage#tests:}" ;;
        sanitize) sanitize ;;
        bench) run_bench bench benchmarks/bench_kernels.py "${T_BENCH:-90}" "${BENCH_ARGS:-}" ;;
        bench2) run_bench bench2 benchmarks/bench_kernels.py "${T_BENCH2:-90}" "${BENCH_ARGS2:-}" ;;
        ab) ab ;;
        e2e) run_bench e2e benchmarks/bench_end_to_end.py "${T_E2E:-90}" "${E2E_ARGS:-}" ;;
        qwen) qwen || { failed="$failed qwen"; break; } ;;
        # shellcheck disable=SC2086
        # shellcheck disable=SC2086
        costs) app costs "${T_COSTS:-200}" python benchmarks/calibrate_costs.py $COSTS_ARGS --out "$OUT/costs.json" \
                   && cp "$OUT/costs.json" /tmp/m/ ;;
        # shellcheck disable=SC2086
        search) app search "${T_SEARCH:-240}" python -m minference.app.cli search --model "$MODEL" --device cuda $SEARCH_ARGS \
                    --out "$OUT/$SEARCH_OUT" && cp "$OUT"/*.json /tmp/m/ \
                    && { ls "$OUT"/*.json.gz >/dev/null 2>&1 && cp "$OUT"/*.json.gz /tmp/m/ || true; } ;;
        # shellcheck disable=SC2086
        eval) app "eval_${TAG:-run}" "${T_EVAL:-$([ -n "${CALL_END:-}" ] && echo $((CALL_END - SECONDS)) || echo 540)}" python -m minference.app.cli eval --model "$MODEL" --device cuda $EVAL_ARGS \
                  $([ "${CUDA_GRAPHS:-0}" = 1 ] && echo --cuda-graphs) \
                  $([ -n "${EVAL_CONTINUE:-}" ] && [ -f "$EVAL_CONTINUE" ] && echo --continue "$EVAL_CONTINUE") \
                  --out "$OUT/eval_${TAG:-run}.json" --plot "$OUT/eval_${TAG:-run}.png"
              rc=$?  # a cut eval leaves its checkpoint: the next call continues it
              if [ -n "${EVAL_CONTINUE:-}" ] && [ -f "$OUT/eval_${TAG:-run}.json" ]; then
                  cp "$OUT/eval_${TAG:-run}.json" "$EVAL_CONTINUE"
              fi
              [ $rc = 0 ] ;;
        *) echo "unknown stage $stage"; false ;;
    esac || failed="$failed $stage"
done
[ -z "$failed" ] || log "failed stages:$failed"
cat "$OUT/summary.txt"
# a device call returns at most 8 files from $OUT (the rest are left out, "(count)"): past 8,
# pack everything into one archive (tar -xzf results.tgz here). PACK=0 for all but the last of
# several runs of this script in one call
if [ "${PACK:-1}" = 1 ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/"
    echo "more than 8 files: packed into \$OUT/results.tgz"
fi
[ -z "$failed" ]  # the call's exit status: non-zero when a stage failed
