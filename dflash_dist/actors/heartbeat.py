"""Role heartbeats: every role process (the driver, each target actor, each trainer rank, the
evaluator) rewrites `<out>/heartbeat/<role>-<index>.json` every few seconds while it runs and
once more when it ends, so `dflash-dist status DIR` tells from files alone whether each role is
alive, finished, failed, or lost (a process killed without a last word stops updating).

One record per file, written atomically; no Ray here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_pipeline.durable_files import write_text_atomic

log = logging.getLogger(__name__)
HEARTBEAT_DIR = "heartbeat"
INTERVAL_S = 5.0
STALE_INTERVALS = 3  # a running record older than this many intervals is "lost"
ROLES = ("driver", "target", "trainer", "evaluator")


class Heartbeat:
    """Context manager: state "running" every `interval_s` (with `info()`, a small JSON dict, which
    may be replaced while running), then "finished", or "failed" with the error on an exception."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        role: str,
        index: int = 0,
        info: Callable[[], dict[str, Any]] | None = None,
        interval_s: float = INTERVAL_S,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"heartbeat role {role!r} is not one of {ROLES}")
        self.path = Path(out_dir) / HEARTBEAT_DIR / f"{role}-{index}.json"
        self.info = info
        self.interval_s = interval_s
        self._base = {
            "role": role,
            "index": index,
            "pid": os.getpid(),
            "proc_start": process_start(os.getpid()),  # with the pid, names this process (forward_notice checks it)
            "host": socket.gethostname(),
            "started": time.time(),
            "interval_s": interval_s,
        }
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write("running")
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.path.stem}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        error = "".join(traceback.format_exception_only(exc_type, exc)).strip() if exc_type else None
        self._write("failed" if exc_type else "finished", error)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):  # a full disk must not kill the role; status calls it lost
                self._write("running")

    def _write(self, state: str, error: str | None = None) -> None:
        try:
            info = self.info() if self.info is not None else {}
        except Exception as e:  # a heartbeat reports; it never takes its role down
            info = {"info_error": f"{type(e).__name__}: {e}"}
        record = {**self._base, "state": state, "updated": time.time(), "info": info, "error": error}
        with self._lock:
            write_text_atomic(self.path, json.dumps(record, sort_keys=True) + "\n")


def process_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (clock ticks after boot: /proc/<pid>/stat field
    22), which with the pid names one process for the whole boot (a reused pid starts later).
    None: no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold spaces


_FIELDS: dict[str, tuple[type, ...]] = {
    "role": (str,), "index": (int,), "pid": (int,), "host": (str,), "state": (str,),
    "updated": (int, float), "interval_s": (int, float), "info": (dict,), "error": (str, type(None)),
}  # fmt: skip
STATES = ("running", "finished", "failed")


def check_record(record: Any, where: str) -> dict[str, Any]:
    """`record` if it has a heartbeat's shape (the fields status and the preemption forwarder
    read, with their types and ranges), else a ValueError naming `where` and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a heartbeat record (a JSON {type(record).__name__}, expected an object)")
    for name, types in _FIELDS.items():
        value = record.get(name)
        if name not in record or not isinstance(value, types) or isinstance(value, bool):
            expected = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{where}: heartbeat field {name!r} is {value!r}, expected {expected}")
    if record["role"] not in ROLES or record["state"] not in STATES:
        raise ValueError(
            f"{where}: heartbeat role/state {record['role']!r}/{record['state']!r} is not one of {ROLES}/{STATES}"
        )
    if record["index"] < 0 or not math.isfinite(record["updated"]) or not 0 < record["interval_s"] < math.inf:
        raise ValueError(
            f"{where}: heartbeat index, updated or interval_s out of range "
            f"({record['index']!r}, {record['updated']!r}, {record['interval_s']!r})"
        )
    return record


def read_heartbeats(out_dir: str | os.PathLike[str], skip_bad: bool = False) -> list[dict[str, Any]]:
    """Every role's last record, ordered by role then index. A record is replaced atomically, so
    an unreadable or malformed one was not written by a role: a ValueError naming the file
    (`skip_bad`: logged and left out, for the preemption forwarder, which must reach the rest)."""
    records = []
    for f in sorted((Path(out_dir) / HEARTBEAT_DIR).glob("*.json")):
        try:
            try:
                record = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{f}: not a readable heartbeat record ({e}); remove the file") from None
            records.append(check_record(record, str(f)))
        except ValueError as e:
            if not skip_bad:
                raise
            log.warning("%s", e)
    order = {r: i for i, r in enumerate(ROLES)}
    return sorted(records, key=lambda r: (order[r["role"]], r["index"]))


def liveness(record: dict[str, Any], now: float | None = None) -> str:
    """alive, finished, failed, or lost (still "running" but silent for STALE_INTERVALS intervals)."""
    state = record.get("state")
    if state != "running":
        return str(state)
    now = time.time() if now is None else now
    return "alive" if now - record["updated"] <= STALE_INTERVALS * record["interval_s"] else "lost"


def clear_heartbeats(out_dir: str | os.PathLike[str]) -> None:
    """A new run in `out_dir` starts with no records of an earlier one's roles."""
    for f in (Path(out_dir) / HEARTBEAT_DIR).glob("*.json"):
        f.unlink(missing_ok=True)
