#!/usr/bin/env bash
# One short device call (~200 s) for what a nearly spent session's device time still allows: the one-buffer dX's
# gpu test (tests/test_one_dx.py: liger in place, compile) and flex alone with k/v repeated to the query heads
# (bench_flex /kvx). Everything is written under OUT (default $OUT).
#   bench/gpu_small.sh [DEADLINE_S]   (default 200)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_small}
deadline_s=${1:-200}
. bench/gpu_env.sh
t0=$(date +%s)
timeout "$(cap 110 70)" python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_one_dx.py >"$out/gpu_one_dx.log" 2>&1
echo "gpu_one_dx rc=$? s=$(($(date +%s) - t0))"
grep -E "PASSED|FAILED|ERROR|passed|failed|x[12]: loss" "$out/gpu_one_dx.log" | tail -8
t0=$(date +%s)
timeout "$(cap 90 5)" python3 bench/bench_flex.py --presets m32n64tma,m32n64tma/kvx --rounds 1 --json "$out/flex.json" \
    >"$out/flex.log" 2>&1
echo "flex rc=$? s=$(($(date +%s) - t0))"
grep -E "round|^mean|FAILED" "$out/flex.log" | tail -4
