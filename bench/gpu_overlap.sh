#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24's optimizer-forward overlap (trainer/step_overlap.py):
# first its gpu tests (bitwise on a 4-layer drafter; the in-place step's and epiwait's own), then the 27B trainer
# step on one engine, the in-place one-kernel step after the backward (n = the defaults + epiwait + nogather) and
# beside the next forward (o = n + overlap), in ABBA rounds, and a profile (3 steps) under o; then, in the time
# left, the one-buffer dX's and the shared drafter case's gpu tests. Everything is written under OUT.
#   bench/gpu_overlap.sh [DEADLINE_S]   (default 560; SETTINGS overrides the step's settings)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_overlap}
deadline_s=${1:-560}
. bench/gpu_env.sh
t0=$(date +%s)
timeout "$(cap 150 300)" python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_step_overlap.py \
    tests/test_zero_step.py -k "overlap or in_place or epilogue_wait" >"$out/gpu_overlap.log" 2>&1
echo "gpu_overlap rc=$? s=$(($(date +%s) - t0))"
grep -E "PASSED|FAILED|ERROR|passed|failed|^losses" "$out/gpu_overlap.log" | tail -16
d=direct+fused+leangrads
n=$d+epiwait+nogather
o=$n+overlap
t0=$(date +%s)
timeout "$(cap 300 70)" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps "${STEPS:-8}" --warmup 2 \
    --settings "${SETTINGS:-$n,$o,$o,$n,$n,$o,$o,$n}" --profile 3 --json "$out/train_step.json" \
    >"$out/train_step.log" 2>&1
echo "train_step rc=$? s=$(($(date +%s) - t0))"
grep -E "ms/step|FAILED|Error|^profiled|^steady state|idle between|by size" "$out/train_step.log" | tail -20
if [ "$(left)" -gt 50 ]; then
    t0=$(date +%s)
    timeout $(($(left) - 8)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_one_dx.py \
        tests/test_row_cuts.py tests/test_fused_add_norm.py >"$out/gpu_rest.log" 2>&1
    echo "gpu_rest rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_rest.log" | tail -10
fi
