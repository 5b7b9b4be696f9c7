"""Durable small-file writes shared by shards, manifests and checkpoints: a reader sees the old
file or the new one, never half of it, and a crash after the call keeps the new one."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, fsync, rename over it, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")  # unique per writer thread
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
