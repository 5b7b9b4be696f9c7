"""Durable small-file writes shared by shards, manifests and checkpoints: a reader sees the old
file or the new one, never half of it, and a crash after the call keeps the new one; and the one
appender of line logs, with the one rule for a torn last line (`append_lines`).

Whoever can write a run directory could put a symbolic link where we write: a link named like a
line log or lock file (`shards/skipped.jsonl -> ~/.bashrc`) would have us append to, cut or
truncate the file it points to, outside the directory. So a file written in place is opened with
`open_own_file` (never through a link, only a regular file), and a temporary name is made afresh
(a planted link there is removed, not followed). A rename replaces a link itself, never its target.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)


def _libc_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]  # glibc/musl: off64_t on 64-bit
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-out of the range's dirty pages not yet under write-out


def can_start_write_back() -> bool:
    """Whether `start_write_back` can do anything here (Linux's sync_file_range found in libc)."""
    return _SYNC_FILE_RANGE is not None


def start_write_back(fd: int, offset: int, nbytes: int) -> None:
    """Start the disk write of the file's dirty pages in [offset, offset + nbytes) and return
    without waiting for it to finish; the pages stay in the page cache. Linux's
    sync_file_range(SYNC_FILE_RANGE_WRITE) through libc (Python's os module has no binding): the
    call PostgreSQL's pg_flush_data makes first. It can still block while the disk's request queue
    is full. No durability: the file's fsync stays the commit. Raises OSError if refused."""
    if _SYNC_FILE_RANGE is None:
        raise OSError(38, "sync_file_range is not available on this platform")  # ENOSYS
    if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UnsafeFileError(ValueError):
    """A name we write in place is a symbolic link or not a regular file: not ours to write through."""


def open_own_file(path: Path, flags: int, mode: int = 0o666) -> int:
    """`os.open(path, flags, mode)` of a file we write in place (a line log, a lock file), refusing
    a symbolic link (never followed) and anything but a regular file (a FIFO, a device), before a
    byte is written: UnsafeFileError naming it and what to do. A new file's mode is `mode` less the
    umask, as open() makes it (a group-shared build cache under umask 002 stays group-writable)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)  # NONBLOCK: a FIFO
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    if fd is not None:
        os.close(fd)
    raise UnsafeFileError(
        f"{path} is a symbolic link or not a regular file: dflash-dist writes its own files here and never through a "
        f"link; someone with write access to {path.parent} put it there (a link could point at any file of yours). "
        "Remove it, check who can write that directory, and start again"
    )


def _fresh(tmp: Path) -> Path:
    """`tmp` made free for an exclusive create: whatever has the name (a crashed write's leftover, or
    a link someone planted) is removed, never followed."""
    tmp.unlink(missing_ok=True)
    return tmp


@contextlib.contextmanager
def atomic_writer(path: Path, private: bool = False) -> Iterator[TextIO]:
    """A text file to stream into at a temporary name beside `path` (unique per writer thread);
    on a clean exit it is fsynced, renamed over `path` and the directory synced; on an error it
    is removed and `path` is untouched. `private`: created new with mode 0600, so no other user can
    read it, not even while it is written (secrets)."""
    tmp = _fresh(path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        with os.fdopen(os.open(tmp, flags, 0o600 if private else 0o666), "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` (`.NAME.tmp-PID-TID`) for a writer that takes a path
    (safetensors' save_file, torch.save): on a clean exit the file is fsynced, renamed over `path`
    and the directory synced; on an error it is removed and `path` is untouched. A crash in the
    middle leaves `path` as it was, the partial bytes only under the temporary name."""
    tmp = _fresh(path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, fsync, rename over it, fsync the directory."""
    with atomic_writer(path) as f:
        f.write(text)


def append_lines(path: Path, data: bytes, durable: bool = True) -> None:
    """Append whole lines (`data`: zero or more, each ending in a newline) to a line log
    (manifest.jsonl, skipped.jsonl, the step logs, regenerated JSONL), under one rule for all:
    a line is a record only once its newline is on disk, so readers stop at the last newline; a
    torn last line (a crash in the middle of an append) is cut off here, when the file is next
    opened for append and before anything is written, so a new line never joins it.
    `durable`: fsync the file (and the directory if this call created it) before returning; with
    no `data` that makes earlier non-durable appends durable. One appender at a time per file:
    writers that share a file hold a lock around the call (the shard manifest's manifest_lock)."""
    assert not data or data.endswith(b"\n"), "append whole lines only"
    created = not path.exists()
    fd = open_own_file(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            keep = _end_of_last_line(fd, size)
            log.warning("%s: cut a torn last line of %d bytes (a write interrupted by a crash)", path, size - keep)
            os.ftruncate(fd, keep)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if created and durable:
        fsync_dir(path.parent)


def _end_of_last_line(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """Bytes up to and including the file's last newline (0 without one), read backwards."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        i = os.pread(fd, end - start, start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0
