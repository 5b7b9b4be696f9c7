#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) of gpu tests, in groups run in the order given, each stopped at
# GPU_TESTS_GROUP_S seconds (default: none) or 20 s before the deadline, whichever comes first: without
# GPU_TESTS_GROUP_S one slow group can use all the time left, so put the groups that matter most first;
# stops starting groups when less than 60 s remain. Everything is written under OUT (default $OUT):
# gpu_tests_<n>.log per group.
#   GPU_TESTS="GROUP;GROUP;..." bench/gpu_tests.sh [DEADLINE_S]    (a GROUP: pytest arguments; default 570 s)
# e.g. GPU_TESTS="tests/test_zero_step.py;tests/test_block_mask.py -k tilings;tests/test_evaluator.py -k 'fused and not fused2'"
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_tests}
deadline_s=${1:-570}
RAY=1 . bench/gpu_env.sh
IFS=';' read -r -a groups <<<"${GPU_TESTS:?the gpu test groups to run, ';'-separated}"
n=0
for group in "${groups[@]}"; do
    n=$((n + 1))
    if [ "$(left)" -le 60 ]; then
        echo "group $n not started (less than 60 s left): $group"
        continue
    fi
    t0=$(date +%s)
    # a group is pytest's arguments as a shell reads them (quotes keep a -k expression together)
    limit=$(($(left) - 20))
    if [ "${GPU_TESTS_GROUP_S:-0}" -gt 0 ] && [ "$GPU_TESTS_GROUP_S" -lt "$limit" ]; then limit=$GPU_TESTS_GROUP_S; fi
    timeout -k 10 "$limit" bash -c "python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider $group" \
        >"$out/gpu_tests_$n.log" 2>&1
    echo "group $n rc=$? s=$(($(date +%s) - t0)): $group"
    grep -E "PASSED|FAILED|ERROR|passed|failed|max \|error\|" "$out/gpu_tests_$n.log" | tail -8
done
