#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine), seventeenth session: ce_kernel.py's CE (liger's arithmetic, the second
# pass last block first) against liger's and the gradient list's norm split (a vector_norm per large gradient)
# against the multi-tensor norm, alone (bench_ce_kernel.py) and in the 27B step, on whichever card comes. On an H200
# (the issue's card) the CE's gpu tests, then the step's settings and capture over 50 passes (bench/gpu_both.sh),
# the CE bench in the time left; on an H100, or with under 480 s left after the tests, the CE's gpu tests and bench,
# then the step's settings (no capture).
# n = the trainer's GPU step (zero_step.trainer_options); c = n with both (cerows+normsplit), in ABBA order.
#   bench/gpu_ce.sh [DEADLINE_S]   (default 560; everything under $OUT; SETTINGS overrides the H100 branch's)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_ce}
deadline_s=${1:-560}
. bench/gpu_env.sh
n=direct+fused+leangrads+epiwait+nogather
c=$n+cerows+normsplit
settings=${SETTINGS:-$n,$c,$c,$n,$n,$c,$c,$n}
ce_tests() {
    timeout "$(cap "$1")" python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_ce_kernel.py \
        >"$out/ce_tests.log" 2>&1
    echo "ce_tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$out/ce_tests.log" | tail -5
}
ce_bench() {
    timeout "$(cap "$1")" python3 bench/bench_ce_kernel.py --iters 15 >"$out/ce_bench.log" 2>&1
    echo "ce_bench rc=$?"; tail -12 "$out/ce_bench.log"
}
cat "$out/gpu.txt"
ce_tests 70  # the correctness gate first, on either card
if grep -q H200 "$out/gpu.txt" && [ "$(left)" -gt 480 ]; then  # capture's 50 passes need ~330 s
    OUT=$out/both SETTINGS="$n,$c,$c,$n,$n,$c" bench/gpu_both.sh $(($(left) - 45))
    ce_bench 40
else
    ce_bench 70
    t0=$(date +%s)
    timeout "$(cap 400 15)" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps 8 --warmup 2 \
        --settings "$settings" --json "$out/train_step.json" >"$out/train_step.log" 2>&1
    echo "train_step rc=$? s=$(($(date +%s) - t0))"
    grep -E "ms/step|FAILED|Error" "$out/train_step.log" | tail -12
fi
