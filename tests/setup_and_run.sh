#!/usr/bin/env bash
# The README's test command (and CI's: .ci/run calls it): everything the tests need on a fresh
# Debian/Ubuntu machine, then pytest.   tests/setup_and_run.sh [pytest arguments ...]
#  1. Debian packages the tests use, installed only when missing (as root, or through sudo):
#     Slurm and munge (tests/test_slurm.py starts a one-node cluster from them), and what the venv
#     and DeepSpeed's JIT-compiled CPU op need when absent (python3-venv, g++, python3-dev).
#  2. .venv with the project and its test extras (`pip install -e '.[test]'`).
#  3. pytest with the given arguments (none: both tiers, as CI runs them).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pkg in slurmctld slurmd slurm-client munge; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$pkg")
done
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
    echo "tests/setup_and_run.sh: installing Debian packages: ${missing[*]}" >&2
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || {
            echo "tests/setup_and_run.sh: not root and no sudo: install ${missing[*]} (apt-get install -y ...) first" >&2
            exit 1
        }
        sudo=(sudo)
    fi
    ${sudo[@]+"${sudo[@]}"} apt-get update -qq
    ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python3 -m venv .venv
.venv/bin/pip install -q --no-compile -e '.[test]'
exec .venv/bin/pytest "$@"
