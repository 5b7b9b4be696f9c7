"""One writer per output directory: an fcntl lock held for the whole run.

Two runs naming the same `--out` would capture, train and publish checkpoints over each other
(both exit 0, with a train log of interleaved steps). Every command that writes under `--out`
takes `<out>/.dflash.lock` first: `run`, `train` and `eval` exclusively, the capture slices of
one job array (`extract --slice`, which share the directory through the capture ledger) shared.
A second holder is refused at once, naming the first (pid, host, command, start time, and the
Slurm job when there is one) from the lock file's contents, which the holder writes after it
took the lock. The kernel drops the lock when the holder's process ends, however it ends, so a
crashed run never leaves a stale lock; the contents of the file are only information.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from data_pipeline.durable_files import open_own_file

LOCK_NAME = ".dflash.lock"
EXCLUSIVE, SHARED = "exclusive", "shared"


class RunLocked(RuntimeError):
    """Another process holds the output directory."""


class RunLock:
    """`with RunLock(out, role):` — the directory's lock, or RunLocked naming its holder."""

    def __init__(self, out: str | os.PathLike[str], role: str, mode: str = EXCLUSIVE) -> None:
        if mode not in (EXCLUSIVE, SHARED):
            raise ValueError(f"mode must be {EXCLUSIVE!r} or {SHARED!r}, got {mode!r}")
        self.path = Path(out) / LOCK_NAME
        self.role, self.mode = role, mode
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own_file(self.path, os.O_RDWR | os.O_CREAT)  # truncated below: never through a planted link
        op = fcntl.LOCK_EX if self.mode == EXCLUSIVE else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunLocked(
                f"{self.path.parent} is in use by another run (last recorded holder: {holder}): wait for it to end, "
                "stop it, or use another --out (one run writes an output directory at a time)"
            ) from None
        # the holder's record (of several shared holders, the latest to come)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "role": self.role,
            "command": " ".join(sys.argv),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "since_unix": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        record = json.loads(raw.decode())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "a holder that left no record"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("since_unix", 0))))
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    return (f"{record.get('role', '?')} pid {record.get('pid', '?')} on {record.get('host', '?')} since {since}"
            f"{job}: {record.get('command', '?')}")  # fmt: skip
