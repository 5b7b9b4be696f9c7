# Sourced by the one-call device scripts (gpu_speed.sh, gpu_capture.sh, gpu_tests.sh) after they set $out and
# $deadline_s (seconds from now the call must end by; left() counts down to it, cap() bounds a step's limit by
# it): installs the offline wheels of launcher/offline_wheels.sh (.whl/, carried with the call) into /tmp/site,
# with RAY=1 also the slimmed Ray, and exports the environment the project's commands need there.
mkdir -p "$out"
end=$(($(date +%s) + deadline_s))
# (.whl-regen/, regenerate's openai client, is installed too where it was carried)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    $(ls .whl-regen/*.whl 2>/dev/null) \
    >"$out/install.log" 2>&1
if [ -n "${RAY:-}" ]; then
    tar -C /tmp/site -xJf .whl/ray-2.60.0-cp312-slim.tar.xz \
        && chmod +x /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/ray/core/src/ray/gcs/gcs_server
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DFLASH_CACHE=/tmp/dflash-cache PYTHONUNBUFFERED=1
export DFLASH_TEST_FAILURES=$out/test_failures.log  # each failing test's report as it fails (tests/conftest.py)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
left() { echo $((end - $(date +%s))); }
# a step's time limit: its own ($1 s) or what the deadline leaves less $2 s (default 10), whichever is
# smaller, and at least 1 s (timeout 0 would mean no limit at all)
cap() { local t=$(($(left) - ${2:-10})); t=$((t < $1 ? t : $1)); echo $((t > 0 ? t : 1)); }
# the device tool returns at most 8 files of $OUT a call (the rest are left out, named by count): at the
# script's exit, more than 8 files there go back as the JSON results, gpu.txt and one logs.tgz of every log
_pack_logs() {
    local n
    n=$(find "$out" -type f | wc -l)
    if [ "$n" -gt 8 ]; then
        (cd "$out" && find . -type f -name '*.log' -print0 | tar --null -czf logs.tgz -T - && find . -type f -name '*.log' -delete)
        echo "gpu_env: $n files under $out, more than the 8 the tool returns: every .log is in logs.tgz"
    fi
}
trap _pack_logs EXIT
