"""Processes in tests: a free port for a process group's master, and a SIGKILL at a point of a run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from dflash_dist.actors.ports import free_ports


def free_port() -> int:
    return free_ports(1, "127.0.0.1")[0]


def kill_when(path: Path, lines: int, pid_of, timeout_s: float = 240) -> threading.Thread:
    """SIGKILL pid_of() once `path` has `lines` lines (in a thread: the caller blocks meanwhile)."""

    def watch() -> None:
        deadline = time.time() + timeout_s
        while not (path.exists() and len(path.read_text().splitlines()) >= lines) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(pid_of(), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
