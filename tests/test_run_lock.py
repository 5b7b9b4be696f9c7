"""One run per output directory (orchestration/run_lock.py): a second run naming the same --out
is refused at once, naming the holder, and writes nothing; the lock goes with the holder's
process however it ends; capture slices share it; a Slurm task whose leader was refused stops at
once instead of waiting for a plan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_dist.config import load_config
from dflash_dist.orchestration.run_lock import LOCK_NAME, SHARED, RunLock, RunLocked
from dflash_dist.orchestration.run_plan import PipelineError, fail_plan, share_plan
from tests.conftest import REPO

HOLD = "import sys, time; from dflash_dist.orchestration.run_lock import RunLock; l = RunLock(sys.argv[1], 'run'); " \
       "l.acquire(); print('held', flush=True); time.sleep(600)"  # fmt: skip


def hold(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first_until_it_dies(tmp_path):
    out = tmp_path / "run"
    holder = hold(out)
    try:
        with pytest.raises(RunLocked, match=rf"in use by another run .*run pid {holder.pid} on .* since .*: -c {out}"):
            RunLock(out, "train").acquire()
        with pytest.raises(RunLocked):  # a shared holder (a capture slice) is refused too
            RunLock(out, "extract", SHARED).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(out, "train"):  # the kernel dropped the dead holder's lock: no stale lock
        assert f'"pid": {os.getpid()}' in (out / LOCK_NAME).read_text()
    with RunLock(out, "a", SHARED), RunLock(out, "b", SHARED), pytest.raises(RunLocked):  # slices coexist
        RunLock(out, "run").acquire()


def test_the_cli_refuses_a_second_run_in_the_same_out_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    holder = hold(out)
    try:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run", "configs/tiny.yaml", "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        assert f"in use by another run (last recorded holder: run pid {holder.pid}" in proc.stderr
        assert time.monotonic() - t0 < 120  # refused before the target or data are touched
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_waiting_task_stops_with_its_leaders_error(tmp_path):
    """A second srun in the same allocation has its own plan key (its step id); its rank 0 is
    refused by the lock and says so in `<key>.failed`; its other ranks stop with that message
    at once instead of waiting PLAN_WAIT_S for a plan."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", out_dir=str(tmp_path / "run"))
    fail_plan(cfg.out, "train-7-step-1-restart-0", "RunLocked: in use by another run")
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="failed: RunLocked: in use by another run"):
        share_plan(cfg, ("train",), "auto", key="train-7-step-1-restart-0", leader=False, wait_s=60)
    assert time.monotonic() - t0 < 5
