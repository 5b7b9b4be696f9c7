#!/usr/bin/env bash
# One H200 session, every GPU measurement of issues 20 and 24 in one chain, from the repository and
# the wheel set of launcher/offline_wheels.sh alone (the machine starts bare):
#   1. install the wheels (and the slimmed Ray)
#   2. preflight: the lean optimizer step on CUDA (pytest -m gpu); if it fails, the product run below
#      falls back to train.optimizer_step=deepspeed
#   3. build the learned code target (dflash-dist build-target configs/mid_gpu.yaml); beside it, on
#      the same GPU, the other gpu tests (in groups, those earlier leases did not reach first), stopped GPU_TESTS_GRACE_S
#      (default 45) after the build ends so that the product run has the GPU to itself
#   4. the product run on it (configs/mid_gpu.yaml through tests/test_gpu_mid.py, which runs and checks it;
#      on train.kernels=torch if the fast-kernels gpu test failed beside the build)
#   5. the recipe-quality bench on that run's shards (bench/bench_quality_run.py, QBENCH_ARGS), until
#      the epoch second in QBENCH_DEADLINE_FILE (default /tmp/qbench_deadline; a later call may move
#      it) or, without that file, for QBENCH_BUDGET_S (default 480), its results, table and figure written
#      by then (QBENCH_TAIL_S); results.json and table.md are rewritten after each run, so a watch call
#      during the bench brings back the runs finished so far. A bench that finishes no run (its worker
#      processes failing) runs once more in one process (--workers 0) for the time left.
#   6. (only with SPEED=1) the trainer step at the 27B shape, the world-size cost model, and capture
#      over 50 passes
# With TRAIN_STEP=1, between 4 and 5: the 27B trainer step under the --settings in TRAIN_STEP_SETTINGS
# (default: decay, D-PACE's former two head passes and D-PACE's single pass), side by side on one engine,
# then the optimizer steps on a 1/9 slice (bench/cost_model.py --measure-opt)
# Each step's output goes to LOG/<step>.log and one line to LOG/status (start, end, exit code, seconds);
# a step that fails does not stop the ones that do not need it.
#   setsid bench/gpu_session.sh /tmp/gpu >/dev/null 2>&1 < /dev/null &
# and in that call and each one after it, bench/gpu_watch.sh SECONDS: it prints the status and brings
# back everything written so far as $OUT/gpu.tgz (a machine given back between calls keeps its files).
# The machine is given back 30 s after a call: issue the monitoring calls back to back (one batch of
# calls), not one at a time with work between them (the fourth and fifth leases lost their chains so).
set -u
cd "$(dirname "$0")/.."
LOG=${1:-/tmp/gpu}
RUN=${RUN:-/tmp/mid_gpu}
mkdir -p "$LOG"
step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "start $name $t0" >>"$LOG/status"
    timeout -k 30 "$limit" "$@" >"$LOG/$name.log" 2>&1  # -k: a step that outlives TERM must not hold the chain
    rc=$?
    echo "end $name rc=$rc s=$(($(date +%s) - t0))" >>"$LOG/status"
    return $rc
}

step install 180 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && tar -C /tmp/site -xJf .whl/ray-2.60.0-cp312-slim.tar.xz \
    && chmod +x /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/ray/core/src/ray/gcs/gcs_server'
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DFLASH_CACHE=/tmp/dflash-cache PYTHONUNBUFFERED=1
export DFLASH_TEST_FAILURES=$LOG/test_failures.log  # each failing test's report as it fails (tests/conftest.py)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$LOG/gpu.txt" 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" \
    >>"$LOG/gpu.txt" 2>&1

fallback=()  # settings the product run takes because a gpu test of the default path failed
if ! step preflight 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
        "tests/test_zero_step.py::test_cuda_bf16_lean_step_matches_deepspeeds_step"; then
    fallback+=(train.optimizer_step=deepspeed)
    echo "preflight failed: the product run uses train.optimizer_step=deepspeed" >>"$LOG/status"
fi

# the gpu tests beside the build: timeout leads its own process group, so the group can be stopped
echo "start gpu_tests $(date +%s)" >>"$LOG/status"
gt0=$(date +%s)
# (in groups, each with its own limit, so that one slow test does not keep the others from running;
# the groups the earlier leases did not reach first)
timeout -k 20 "${GPU_TESTS_LIMIT_S:-600}" bash -c '
    for files in "tests/test_fused.py tests/test_drafter.py tests/test_gpu_parity.py" \
        "tests/test_capture.py tests/test_live.py tests/test_sliding_window.py" \
        "tests/test_zero_step.py tests/test_fused_layers.py tests/test_block_mask.py tests/test_packing.py"; do
        timeout --foreground -k 10 "${GPU_TESTS_GROUP_S:-200}" python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider $files
        echo "[gpu_session] group rc=$? : $files"
    done' >"$LOG/gpu_tests.log" 2>&1 &
gt=$!
step build 540 python3 -m launcher.cli build-target configs/mid_gpu.yaml
for _ in $(seq "${GPU_TESTS_GRACE_S:-45}"); do kill -0 "$gt" 2>/dev/null || break; sleep 1; done
if kill -0 "$gt" 2>/dev/null; then
    kill -TERM -- "-$gt" 2>/dev/null
    echo "gpu_tests stopped when the build had ended" >>"$LOG/status"
    for _ in $(seq 20); do kill -0 "$gt" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$gt" 2>/dev/null  # what TERM did not end must not hold the GPU for the product run
fi
wait "$gt"
gt_rc=$?
# a JIT op build the stop cut short leaves its lock, and the product run would wait on it for ever
# (the trainers build into trainer_group.default_extensions_dir(), the tests beside them may use torch's default)
ext_dir=$(python3 -c "from dflash_dist.actors.trainer_group import default_extensions_dir as d; print(d())" 2>/dev/null)
find ${ext_dir:+"$ext_dir"} "$HOME/.cache/torch_extensions" -name lock -delete 2>/dev/null
echo "end gpu_tests rc=$gt_rc s=$(($(date +%s) - gt0))" >>"$LOG/status"
cp "$DFLASH_CACHE"/code-lm-*/dflash_target.json "$LOG/target_record.json" 2>/dev/null

# the drafter's fast kernels (liger, compiled) failed against the torch reference beside the build: the
# product run trains on the torch kernels rather than on kernels a test found wrong (no device time spent:
# the gpu tests' failure log, DFLASH_TEST_FAILURES, says so)
if grep -q "test_gpu_fast_kernels_match_torch_in_bf16" "$DFLASH_TEST_FAILURES" 2>/dev/null; then
    fallback+=(train.kernels=torch)
    echo "fast kernels failed their gpu test: the product run uses train.kernels=torch" >>"$LOG/status"
fi
if [ ${#fallback[@]} -gt 0 ]; then  # the run with the fallback, then the test checks it (a finished run is only checked)
    step mid_run 900 python3 -m launcher.cli run configs/mid_gpu.yaml --out "$RUN" --resume auto "${fallback[@]}"
fi
DFLASH_MID_GPU_OUT=$RUN step mid 900 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_mid.py
cp "$RUN/gpu_summary.json" "$RUN/train_log.jsonl" "$RUN/run_plan.json" "$LOG/" 2>/dev/null
cp -r "$RUN/eval" "$LOG/mid_eval" 2>/dev/null
cp -r "$RUN/tb/eval" "$LOG/mid_tb_eval" 2>/dev/null
tail -c 300000 "$RUN/cli.log" >"$LOG/mid_cli_tail.log" 2>/dev/null

if [ -n "${TRAIN_STEP:-}" ]; then  # the 27B trainer step: decay, D-PACE as it ran (two head passes), D-PACE now
    step train_step 240 python3 bench/bench_train_step.py --loss chunked --kernels liger --steps 6 --warmup 2 \
        --settings "${TRAIN_STEP_SETTINGS:-direct+lean+decay,direct+lean+dpace+twopass,direct+lean+dpace,direct+lean+decay}" \
        --json "$LOG/train_step.json"
    # the optimizer step on 1/9 of the parameters (one of the 27B config's ranks): DeepSpeed's, lean, fused
    step cost 150 python3 bench/cost_model.py --train-json "$LOG/train_step.json" --measure-opt --world 9 \
        --json "$LOG/cost.json"
fi

# the quality bench's time: from now to the deadline, less QBENCH_TAIL_S (default 15) for what its own clock
# does not count (the interpreter's start before it, the table and figure after its runs), so that its files
# are complete by the deadline; with under 120 s it does not start. Sets $budget; 1 when skipped.
qbench_budget() {  # qbench_budget NAME
    local now deadline
    now=$(date +%s)
    deadline=$(cat "${QBENCH_DEADLINE_FILE:-/tmp/qbench_deadline}" 2>/dev/null)
    if ! [[ "$deadline" =~ ^[0-9]+$ ]]; then  # no file, or not an epoch second: the fixed budget
        deadline=$((now + ${QBENCH_BUDGET_S:-480}))
    fi
    budget=$((deadline - now - ${QBENCH_TAIL_S:-15}))
    echo "$1 budget ${budget}s" >>"$LOG/status"
    if [ "$budget" -lt 120 ]; then
        echo "$1 skipped: ${budget}s left before the deadline, under 120" >>"$LOG/status"
        return 1
    fi
}
if [ ! -f "$RUN/shards/DONE" ]; then
    echo "qbench skipped: no $RUN/shards/DONE (the product run's capture did not finish)" >>"$LOG/status"
elif qbench_budget qbench; then
    # what else holds the GPU now (a product run's leftovers shrink the workers' memory share)
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv >"$LOG/gpu_apps.txt" 2>&1
    step qbench $((budget + 90)) python3 bench/bench_quality_run.py --run "$RUN" --out "$LOG/quality" \
        --time-budget-s "$budget" ${QBENCH_ARGS:---workers 7}
    rc=$?
    # failed before any run finished (the worker processes' path: calibration failed on every worker, as in the
    # fourth lease): once more in this process alone (--workers 0: no worker processes, no CUDA IPC)
    if [ "$rc" -ne 0 ] && ! grep -qE '"status": "(done|stopped)"' "$LOG/quality/results.json" 2>/dev/null; then
        rm -rf "$LOG/quality_workers" && mv "$LOG/quality" "$LOG/quality_workers" 2>/dev/null
        echo "qbench finished no run (rc=$rc): once more with --workers 0" >>"$LOG/status"
        if qbench_budget qbench_inline; then
            step qbench_inline $((budget + 90)) python3 bench/bench_quality_run.py --run "$RUN" --out "$LOG/quality" \
                --time-budget-s "$budget" ${QBENCH_ARGS:-} --workers 0
        fi
    fi
fi

if [ -n "${SPEED:-}" ]; then
    step train 170 python3 bench/bench_train_step.py --loss chunked --kernels liger --steps 6 --warmup 2 --profile 2 \
        --settings create+ds,create+ds+noovf,direct+ds+noovf,direct+lean,direct+lean+splitkv --json "$LOG/train.json"
    step cost 60 python3 bench/cost_model.py --train-json "$LOG/train.json" --setting "liger direct+lean" --measure-opt \
        --world 9 --json "$LOG/cost.json"
    step capture 330 python3 bench/bench_capture.py --variants 32768:keep:fusedconv,32768:keep:fused2 --pool 256 \
        --batches 2 --profile 32768:keep:fused2 --e2e 32768:keep:fused2 --sinks job --writers 4 --e2e-batches 50 \
        --e2e-distinct 5 --disk-gib 2 --shard-dir /tmp/bench_shards/s --json "$LOG/capture.json"
fi
echo "done $(date +%s)" >>"$LOG/status"
