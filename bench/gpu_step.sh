#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24 after the thirteenth lease: the gpu tests of the default flex
# tiles (bitwise torch's own on sm90 at head_dim 128) and of epiwait (bitwise DeepSpeed's synchronize), then the 27B
# trainer step with the defaults, epiwait and the balanced 2 GiB head chunks (ce2g+cebal), three times each in turn on
# one engine, and a profile under epiwait whose largest gaps say why the host was behind (bench/profile_gaps.py). Everything is written
# under OUT (default $OUT).   bench/gpu_step.sh [DEADLINE_S]   (default 480; SETTINGS overrides the settings)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_step}
deadline_s=${1:-480}
. bench/gpu_env.sh
d=direct+fused+leangrads
# the defaults, epiwait and ce2g+cebal in 3 rounds, each round in another order; the last (profiled) is epiwait's
settings=${SETTINGS:-$d,$d+epiwait,$d+ce2g+cebal,$d+epiwait,$d+ce2g+cebal,$d,$d+ce2g+cebal,$d,$d+epiwait}
t0=$(date +%s)
timeout "$(cap 150)" python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_block_mask.py \
    tests/test_zero_step.py -k "default_flex or (tilings and m32n64tma) or epilogue_wait" >"$out/gpu_flex.log" 2>&1
echo "gpu_flex rc=$? s=$(($(date +%s) - t0))"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_flex.log" | tail -6
t0=$(date +%s)
timeout "$(cap 330)" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps "${STEPS:-8}" --warmup 2 \
    --settings "$settings" --profile 3 --json "$out/train_step.json" >"$out/train_step.log" 2>&1
echo "train_step rc=$? s=$(($(date +%s) - t0))"
grep -E "ms/step|FAILED|Error|^profiled|^steady state|idle between|by size|by the host op|  [0-9. ]+ us  after|last sync|host in no op" \
    "$out/train_step.log" | tail -60
