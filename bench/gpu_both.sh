#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24 when the session's device time leaves one call: the
# 27B trainer step on one engine (BEFORE the fourteenth session's drafter cuts, the defaults d, n = d with the
# trainer's in-place one-kernel step and epilogue wait, and n with the head's former chunks, 1 GiB greedy, in
# alternating rounds; no profile), then capture at the Qwen3.5-27B shape: fused2's compute (CAPTURE_VARIANTS) and
# capture_job's own path end to end over 50 passes on the default sink (job:idle; E2E, default fused2);
# then, in the time left, the gpu tests of the fused capture kernels and the head's chunk cut.
# Everything is written under OUT (default $OUT).
#   bench/gpu_both.sh [DEADLINE_S]   (default 570; SETTINGS overrides the step's settings; STEP=0 runs capture alone)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_both}
deadline_s=${1:-570}
. bench/gpu_env.sh
d=direct+fused+leangrads
b=$d+nodedup0+alllastrows+noaddnorm  # before the fourteenth session's drafter cuts
n=$d+epiwait+nogather  # the trainer's form of the one-kernel step on a GPU (zero_step.trainer_options)
g=$n+ce1g+cegreedy  # the head's chunks before 2026-12-07 (vocab_loss: 2 GiB balanced since)
if [ "${STEP:-1}" = 1 ]; then  # STEP=0: capture alone
    t0=$(date +%s)
    timeout "$(cap 200 330)" python3 bench/bench_train_step.py --loss chunked --kernels liger --steps 8 --warmup 2 \
        --settings "${SETTINGS:-$b,$n,$g,$d,$g,$n,$d,$b,$n,$g,$d}" --json "$out/train_step.json" \
        >"$out/train_step.log" 2>&1
    echo "train_step rc=$? s=$(($(date +%s) - t0))"
    grep -E "ms/step|FAILED|Error|^model FLOPs|row cuts" "$out/train_step.log" | tail -12
fi
t0=$(date +%s)
k=32768:keep
timeout $(($(left) > 60 ? $(left) - 15 : 40)) python3 bench/bench_capture.py --pool 256 --batches 2 \
    --variants "${CAPTURE_VARIANTS:-$k:fused2}" --e2e "${E2E:-$k:fused2}" --sinks job:idle --writers 4 \
    --e2e-batches 50 --e2e-distinct 5 --disk-gib 2 --shard-dir /tmp/bench_shards/s --json "$out/capture.json" \
    >"$out/capture.log" 2>&1
echo "capture rc=$? s=$(($(date +%s) - t0))"
grep -E "^compute|^end to end|disk write" "$out/capture.log" | tail -8
if [ "$(left)" -gt 60 ]; then
    t0=$(date +%s)
    timeout $(($(left) - 10)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_vocab_loss.py \
        tests/test_fused_layers.py >"$out/gpu_fused_layers.log" 2>&1
    echo "gpu_fused_layers rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_fused_layers.log" | tail -6
fi
