"""Durable small-file writes shared by shards, manifests and checkpoints: a reader sees the old
file or the new one, never half of it, and a crash after the call keeps the new one."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[TextIO]:
    """A text file to stream into at a temporary name beside `path` (unique per writer thread);
    on a clean exit it is fsynced, renamed over `path` and the directory synced; on an error it
    is removed and `path` is untouched."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, fsync, rename over it, fsync the directory."""
    with atomic_writer(path) as f:
        f.write(text)
