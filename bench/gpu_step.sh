#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24 after the fourteenth session's cuts: the 27B trainer step on
# one engine: BEFORE (the fourteenth session's drafter cuts off), the defaults, each cut
# off alone (and onedx: the opt-in one-buffer dX), epiwait, epiwait+nogather and ce2g+cebal, in rounds of alternating order, and a profile (3 steps, the
# gaps from the second on) under the last setting; flex alone on k/v repeated to the query heads or not (bench_flex
# /kvx); then, in the time left, the gpu tests of what changed (the
# drafter's row cuts and fused add-norm, the one-kernel step without the gather, epiwait, the default flex tiles).
# Everything is written under OUT (default $OUT).
#   bench/gpu_step.sh [DEADLINE_S]   (default 480; SETTINGS overrides the settings, GPU_TESTS_K the tests' -k)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_step}
deadline_s=${1:-480}
. bench/gpu_env.sh
d=direct+fused+leangrads
b=$d+nodedup0+alllastrows+noaddnorm  # before the fourteenth session's drafter cuts
n=$d+epiwait+nogather
settings=${SETTINGS:-$b,$d,$d+epiwait,$n,$d+ce2g+cebal,$n,$d+onedx,$d+ce2g+cebal,$d,$b,$d+epiwait,$d+nodedup0,$d+alllastrows,$d+noaddnorm,$d+onedx,$b,$d+ce2g+cebal,$d+epiwait,$d,$d+onedx,$d+noaddnorm,$d+alllastrows,$d+nodedup0,$n}
t0=$(date +%s)
timeout "$(cap 330 90)" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps "${STEPS:-8}" --warmup 2 \
    --settings "$settings" --profile 3 --json "$out/train_step.json" >"$out/train_step.log" 2>&1
echo "train_step rc=$? s=$(($(date +%s) - t0))"
grep -E "ms/step|FAILED|Error|^profiled|^steady state|idle between|by size|by the host op|  [0-9. ]+ us  after|last sync|host in no op" \
    "$out/train_step.log" | tail -80
t0=$(date +%s)  # flex alone: the default tiles on k/v as they are and repeated to the query heads (bench_flex /kvx)
timeout "$(cap 75 100)" python3 bench/bench_flex.py --presets m32n64tma,m32n64tma/kvx --rounds 2 --json "$out/flex.json" \
    >"$out/flex.log" 2>&1
echo "flex rc=$? s=$(($(date +%s) - t0))"
grep -E "round|^mean|FAILED" "$out/flex.log" | tail -6
t0=$(date +%s)
timeout "$(cap 400 5)" python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_block_mask.py \
    tests/test_zero_step.py tests/test_row_cuts.py tests/test_fused_add_norm.py tests/test_one_kernel_in_place.py \
    tests/test_one_dx.py \
    -k "${GPU_TESTS_K:-default_flex or (tilings and m32n64tma) or epilogue_wait or in_place or gather or cuts or add_norm or one_dx}" \
    >"$out/gpu_flex.log" 2>&1
echo "gpu_flex rc=$? s=$(($(date +%s) - t0))"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_flex.log" | tail -30
