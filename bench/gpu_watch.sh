#!/usr/bin/env bash
# One monitoring call of a bench/gpu_session.sh chain on the device machine: waits until the chain
# is done or SECONDS have passed, prints its status, and ends by packing everything the chain has
# written so far into $OUT/gpu.tgz, so that every call brings the results back as they stand (a
# machine given back between two calls takes its files with it).
#   bench/gpu_watch.sh SECONDS [LOG] [RUN]      (LOG, RUN: gpu_session.sh's, default /tmp/gpu, /tmp/mid_gpu)
# SECONDS plus ~30 s of packing must fit the call's timeout_s, or nothing comes back. Exits 3 when
# LOG has no status file 30 s after the start: the call got a fresh machine, the chain is gone.
set -u
limit=${1:?seconds to wait at most}
LOG=${2:-/tmp/gpu}
RUN=${3:-/tmp/mid_gpu}
for _ in $(seq 30); do  # a chain started in this same call writes its first status line within seconds
    [ -f "$LOG/status" ] && break
    sleep 1
done
if [ ! -f "$LOG/status" ]; then
    echo "gpu_watch: no $LOG/status on this machine: a fresh machine, the chain and its files are gone" >&2
    exit 3
fi
end=$(($(date +%s) + limit))
while [ "$(date +%s)" -lt "$end" ] && ! grep -q '^done' "$LOG/status"; do
    sleep 1  # the chain's end is seen within a second: device time is not spent waiting on a finished chain
done
cat "$LOG/status"
date +%s
mkdir -p "$LOG/run"  # the product run's records as they are now
cp -f "$RUN/gpu_summary.json" "$RUN/train_log.jsonl" "$RUN/run_plan.json" "$LOG/run/" 2>/dev/null
cp -rf "$RUN/eval" "$LOG/run/" 2>/dev/null
tail -c 300000 "$RUN/cli.log" >"$LOG/run/cli_tail.log" 2>/dev/null
cp -f "${DFLASH_CACHE:-/tmp/dflash-cache}"/code-lm-*/dflash_target.json "$LOG/target_record.json" 2>/dev/null
grep -hE "^\[eval\]|^  step +[0-9]+: tau" "$RUN/cli.log" 2>/dev/null | tail -8
[ -f "$LOG/quality/table.md" ] && cat "$LOG/quality/table.md"
out=${OUT:-/tmp/gpu_watch_out}
mkdir -p "$out"
# files written while tar reads them make it exit 1; the archive is still whole up to them
tar czf "$out/gpu.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" 2>/dev/null
if [ "$(stat -c %s "$out/gpu.tgz")" -gt $((15 * 2**20)) ]; then  # what comes back is capped at 16 MiB a file
    echo "gpu_watch: the archive is over 15 MiB: packing the records without the files over 1 MiB" >&2
    tar czf "$out/gpu.tgz" -C "$(dirname "$LOG")" --exclude='*.pt' --exclude='*.safetensors' \
        $(cd "$(dirname "$LOG")" && find "$(basename "$LOG")" -type f -size -1024k) 2>/dev/null
fi
ls -l "$out/gpu.tgz"
