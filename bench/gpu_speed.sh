#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24: the 27B trainer step under TRAIN_STEP_SETTINGS
# side by side on one engine (with COST=1, then bench/cost_model.py --measure-opt --world 9), then the gpu
# tests of the optimizer step and golden parity on CUDA, then (if the time left allows) the README's GPU
# pipeline test. Everything is written under OUT (default $OUT). TRAIN_STEP_ARGS: more bench_train_step.py
# arguments (e.g. --profile 2, which runs under the last setting); FLEX_TESTS=m32n128,autotune: the gpu test of
# those flex tilings' numerics (tests/test_block_mask.py) before the pipeline test. COST_SETTING: the result line
# (e.g. "liger direct+fused+leangrads") whose forward and backward the cost model uses (default: the last).
#   bench/gpu_speed.sh [DEADLINE_S]      (seconds from the start the whole call must end by; default 570)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_speed}
deadline_s=${1:-570}
RAY=1 . bench/gpu_env.sh
t0=$(date +%s)
timeout "$(cap "${TRAIN_STEP_LIMIT_S:-300}")" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps "${STEPS:-8}" \
    --warmup 2 --settings "${TRAIN_STEP_SETTINGS:?the --settings to time}" ${TRAIN_STEP_ARGS:-} \
    --json "$out/train_step.json" >"$out/train_step.log" 2>&1
echo "train_step rc=$? s=$(($(date +%s) - t0))"
grep -E "ms/step|^setting|bound share|FAILED|^profiled|idle between|by size|by the host op|  [0-9. ]+ us  after" "$out/train_step.log" | tail -36
# a faautotune setting: inductor's timing table of each flex kernel's candidate tilings (stderr)
grep -A 8 "^AUTOTUNE flex_attention" "$out/train_step.log" | head -40
if [ -n "${COST:-}" ]; then  # the optimizer steps on a 1/9 slice (deepspeed, lean, fused) and the 9-rank estimate
    t0=$(date +%s)
    timeout "$(cap 150)" python3 bench/cost_model.py --train-json "$out/train_step.json" --measure-opt --world 9 \
        ${COST_SETTING:+--setting "$COST_SETTING"} --json "$out/cost.json" >"$out/cost.log" 2>&1
    echo "cost rc=$? s=$(($(date +%s) - t0))"
    tail -12 "$out/cost.log"
fi
if [ "$(left)" -gt 60 ]; then
    t0=$(date +%s)
    timeout $(($(left) < 220 ? $(left) - 10 : 210)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider \
        tests/test_zero_step.py tests/test_gpu_parity.py "tests/test_evaluator.py::test_cuda_evaluator_measures_on_the_fused_capture_kernels[fused2]" \
        >"$out/gpu_tests.log" 2>&1
    echo "gpu_tests rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|differ|passed|failed" "$out/gpu_tests.log" | tail -12
fi
if [ -n "${FLEX_TESTS:-}" ] && [ "$(left)" -gt 120 ]; then  # the tilings' numerics (fa* words), e.g. FLEX_TESTS=m32n128
    t0=$(date +%s)
    timeout $(($(left) - 10)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_block_mask.py \
        -k "tilings and ($(echo "$FLEX_TESTS" | sed 's/,/ or /g'))" >"$out/gpu_flex.log" 2>&1
    echo "gpu_flex rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|max \|error\||passed|failed" "$out/gpu_flex.log" | tail -10
fi
if [ "$(left)" -gt 250 ]; then
    t0=$(date +%s)
    timeout $(($(left) - 10)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_gpu_pipeline.py \
        >"$out/gpu_pipeline.log" 2>&1
    echo "gpu_pipeline rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|tau|passed|failed" "$out/gpu_pipeline.log" | tail -12
fi
