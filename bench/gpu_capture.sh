#!/usr/bin/env bash
# One device call (<= 600 s, fresh machine) for issue 24's capture: the compiled capture kernels alone in other
# compile modes (bench_capture_kernels.py), then fused2's compute before and after its copy cuts and capture_job's
# own path at the Qwen3.5-27B shape over 50 passes (bench_capture.py, the default sink job:idle), fused2's gpu tests,
# then, as the time left allows, the evaluator's gpu test on
# the fused capture kernels and the writers alone on this machine's disk (bench_capture_drain.py, CPU only). Everything is written under OUT (default $OUT).
#   bench/gpu_capture.sh [DEADLINE_S]      (seconds from the start the whole call must end by; default 570)
# The wheels (.whl/, git-ignored) must be carried with the call.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_capture}
deadline_s=${1:-570}
. bench/gpu_env.sh
t0=$(date +%s)  # capture's compiled kernels alone in other compile modes, bitwise or not (~30 s)
timeout "$(cap 60)" python3 bench/bench_capture_kernels.py >"$out/capture_kernels.log" 2>&1
echo "capture_kernels rc=$? s=$(($(date +%s) - t0))"
grep -E "^ +(silu_mul|rms_norm|add_rms_norm) " "$out/capture_kernels.log"
t0=$(date +%s)
# the capture may use all but 20 s: what follows needs more than 150 s left, which a capture past ~410 s
# never leaves, so a lower cap (450 s before) could only cut its job:idle run (~150 s of its ~400-450 s)
# compute: fused2 before its copy cuts (fused2copies) and after, twice each in turn; end to end: the default sink
k=32768:keep
timeout $(($(left) > 60 ? $(left) - 20 : 40)) python3 bench/bench_capture.py --pool 256 --batches 2 \
    --variants "${VARIANTS:-$k:fused2copies,$k:fused2,$k:fused2copies,$k:fused2}" --profile $k:fused2 \
    --e2e $k:fused2 --sinks "${SINKS:-job:idle}" --writers 4 --e2e-batches 50 --e2e-distinct 5 \
    --disk-gib 2 --shard-dir /tmp/bench_shards/s --json "$out/capture.json" >"$out/capture.log" 2>&1
echo "capture rc=$? s=$(($(date +%s) - t0))"
grep -E "^compute|^end to end|disk write|^profile|idle between|by size|by the host op" "$out/capture.log" | tail -16
if [ "$(left)" -gt 60 ]; then  # fused2's copy cuts: bitwise the former forms with fla's conv, no q/k/v copy
    t0=$(date +%s)
    timeout $(($(left) - 10)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_fused_layers.py \
        >"$out/gpu_fused_layers.log" 2>&1
    echo "gpu_fused_layers rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_fused_layers.log" | tail -6
fi
if [ "$(left)" -gt 150 ]; then  # the evaluator on capture.kernels fused (never run on a GPU before; fused2: gpu_speed)
    t0=$(date +%s)
    TORCH_LOGS=recompiles timeout $(($(left) - 10)) python3 -m pytest -m gpu -v -s -rA -p no:cacheprovider tests/test_evaluator.py \
        -k "fused_capture_kernels and not fused2" >"$out/gpu_eval_fused.log" 2>&1
    echo "gpu_eval_fused rc=$? s=$(($(date +%s) - t0))"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_eval_fused.log" | tail -6
fi
if [ "$(left)" -gt 150 ]; then
    t0=$(date +%s)
    timeout $(($(left) - 10)) python3 bench/bench_capture_drain.py --writers 4 --pass-tokens 32768 --rows 8 \
        --passes 16 --pass-interval 3 --repeat 1 --dir /tmp/bench_drain >"$out/drain.log" 2>&1
    echo "drain rc=$? s=$(($(date +%s) - t0))"
    tail -3 "$out/drain.log"
fi
