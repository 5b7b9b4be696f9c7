"""The preemption forwarder (launcher/slurm_ray.forward_notice) signals only a trainer rank whose
heartbeat is fresh and names the live process that wrote it: forged, stale or pid-reusing
heartbeats (files anyone with write access to the run directory can plant) reach nobody.

Real processes: a `sleep` stands for an unrelated process; a Python child running a real
Heartbeat stands for a trainer rank and records the signal it gets.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_dist.actors.heartbeat import HEARTBEAT_DIR, process_start
from launcher.slurm_ray import forward_notice, signal_refusal
from tests.conftest import REPO

DAY_S = 86400.0


def plant(out: Path, pid: int, updated: float, proc_start: str | None, index: int = 0) -> Path:
    """A heartbeat file as a trainer rank writes it (every field), naming `pid`."""
    d = out / HEARTBEAT_DIR
    d.mkdir(parents=True, exist_ok=True)
    record = {"role": "trainer", "index": index, "pid": pid, "proc_start": proc_start, "host": socket.gethostname(),
              "started": updated - 10, "interval_s": 5.0, "state": "running", "updated": updated, "info": {},
              "error": None}  # fmt: skip
    path = d / f"trainer-{index}.json"
    path.write_text(json.dumps(record))
    return path


@pytest.fixture
def bystander():
    """A live process that is no trainer (SIGUSR1 would kill it)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def still_alive(proc: subprocess.Popen) -> bool:
    time.sleep(0.3)  # a delivered SIGUSR1 would have ended it by now
    return proc.poll() is None


def test_forged_day_old_heartbeat_naming_a_live_process_is_not_signalled(tmp_path, bystander):
    """Even with the process's true start time copied into it: a day-old record is stale."""
    plant(tmp_path, bystander.pid, time.time() - DAY_S, process_start(bystander.pid))
    assert forward_notice(tmp_path, signal.SIGTERM) == []
    assert still_alive(bystander)


def test_fresh_heartbeat_naming_another_process_is_not_signalled(tmp_path, bystander):
    """A fresh record whose pid now names another process (pid reused, or forged without the
    start time) is refused by the kernel's start time."""
    plant(tmp_path, bystander.pid, time.time(), proc_start="12345")
    assert forward_notice(tmp_path, signal.SIGTERM) == []
    plant(tmp_path, bystander.pid, time.time(), proc_start=None)
    assert forward_notice(tmp_path, signal.SIGTERM) == []
    assert still_alive(bystander)


def test_init_our_own_and_future_records_are_refused(tmp_path):
    now = time.time()
    record = {"pid": 1, "updated": now, "interval_s": 5.0, "proc_start": process_start(1)}
    assert "cannot be a trainer" in signal_refusal(record, now)
    assert "cannot be a trainer" in signal_refusal(record | {"pid": os.getpid()}, now)
    assert "not fresh" in signal_refusal(record | {"pid": 2**22 + 7, "updated": now + DAY_S}, now)
    # a record widening its own freshness window with a huge interval is still stale after a day
    assert "not fresh" in signal_refusal(record | {"pid": 2**22 + 7, "interval_s": 1e9, "updated": now - DAY_S}, now)


def test_malformed_heartbeat_does_not_stop_the_forwarder(tmp_path, bystander):
    (tmp_path / HEARTBEAT_DIR).mkdir()
    (tmp_path / HEARTBEAT_DIR / "trainer-7.json").write_text('["not", "a", "record"]')
    plant(tmp_path, bystander.pid, time.time() - DAY_S, process_start(bystander.pid))
    assert forward_notice(tmp_path, signal.SIGTERM) == []
    assert still_alive(bystander)


RANK = """
import signal, sys, time
from pathlib import Path
from dflash_dist.actors.heartbeat import Heartbeat
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
with Heartbeat(out, "trainer", 0, interval_s=0.2):
    (out / "ready").touch()
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.05)
(out / "signalled").write_text(str(got))
"""


def test_a_real_running_rank_is_signalled(tmp_path):
    """The positive case: the live process that writes the heartbeat gets SIGUSR1."""
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists():
            assert rank.poll() is None and time.time() < deadline, "the rank did not start"
            time.sleep(0.05)
        reached = forward_notice(tmp_path, signal.SIGTERM)
        assert reached == [f"trainer 0 (pid {rank.pid} on {socket.gethostname()})"]
        assert rank.wait(timeout=60) == 0
        assert (tmp_path / "signalled").read_text() == f"[{int(signal.SIGUSR1)}]"
    finally:
        if rank.poll() is None:
            rank.kill()
