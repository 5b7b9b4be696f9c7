"""Checksums of shard members and checkpoint files (XXH3, from the xxhash library).

Why XXH3: it hashes 18-21 GiB/s on one core of the development machine (a 256 MiB buffer:
xxh3_64 18.2, xxh3_128 21.5 GiB/s), against 1.1 GiB/s for sha256 (with SHA-NI) and 0.5 for
blake2b. A capture writer writes ~0.4 GB/s and hashes every byte it writes, inline: sha256 would
add about a third to its time, XXH3 about 2%. The checksums catch damage (bit rot, a torn copy,
a bad disk), not forgery: whoever can rewrite a shard can rewrite the manifest line beside it,
so a cryptographic hash would buy nothing here.

Shard members are checked with the 64-bit XXH3 (a manifest line carries one digest per member,
five per sample, and a large run lists about a million samples: 16 hex digits each, half the
manifest that 128 bits would need); the chance that a damaged member still matches is 2^-64.
Checkpoint files (a handful per tag) use the 128-bit XXH3. Each digest is stored with its
algorithm's name, so either can change without guessing.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import xxhash

MEMBER_ALGORITHM = "xxh3_64"  # shard members (manifest.jsonl)
FILE_ALGORITHM = "xxh3_128"  # checkpoint files (the completion marker)
_HASHERS: dict[str, Callable[[], Any]] = {"xxh3_64": xxhash.xxh3_64, "xxh3_128": xxhash.xxh3_128}
_HEX_DIGITS = {"xxh3_64": 16, "xxh3_128": 32}
_CHUNK = 8 << 20


class ChecksumMismatch(ValueError):
    """Bytes on disk differ from the checksum recorded when they were written."""


def member_digests(encoded: dict[str, Any], algorithm: str = MEMBER_ALGORITHM) -> dict[str, str]:
    """{member suffix: hex digest} of one sample's encoded tar members, by suffix (keys that
    start with "_", such as webdataset's __key__, are not members)."""
    return {k: digest_bytes(encoded[k], algorithm) for k in sorted(encoded) if not k.startswith("_")}


def check_algorithm(algorithm: Any, where: str) -> str:
    if algorithm not in _HASHERS:
        raise ValueError(f"{where}: unknown checksum algorithm {algorithm!r} (this code knows {sorted(_HASHERS)})")
    return algorithm


def is_digest(value: Any, algorithm: str) -> bool:
    """A lowercase hex digest of the algorithm's length."""
    return isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{_HEX_DIGITS[algorithm]}}}", value) is not None


def digest_bytes(data: bytes | bytearray | memoryview, algorithm: str = MEMBER_ALGORITHM) -> str:
    """The hex digest of bytes already in memory (a tar member as written or as read)."""
    return _HASHERS[algorithm](data).hexdigest()


def digest_file(path: str | os.PathLike[str], algorithm: str = FILE_ALGORITHM) -> str:
    """The hex digest of a file, streamed in 8 MiB chunks."""
    h = _HASHERS[algorithm]()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def inside(root: Path, name: Any, where: str) -> Path:
    """`root / name` for a name read from a record (a completion marker's file list): a relative
    path of plain parts, else a ValueError naming `where` (an absolute name or a `..` part would
    have the reader hash, stat or load a file outside `root`)."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or name.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ValueError(f"{where}: file name {name!r} is not a relative path inside {root}: this record was not "
                         "written by dflash-dist")
    return root / name


def regular_file(root: Path, name: Any, where: str) -> os.stat_result:
    """The lstat of `inside(root, name, where)`, a regular file reached through no symbolic link:
    else a ValueError naming it (a link would have the reader hash, stat or load a file outside
    `root`; a FIFO or a device such as /dev/zero, whose size is 0, would block or never end the
    read). OSError when it is missing."""
    path = inside(root, name, where)
    for part in [*reversed(path.relative_to(root).parents)][1:]:
        if (root / part).is_symlink():
            raise ValueError(f"{where}: {root / part} is a symbolic link: the files of {root} are its own, never links")
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ValueError(f"{where}: {path} is {kind}: the files of {root} are its own regular files, never links or "
                         "devices; this record was not written by dflash-dist")
    return st


def file_checksums(root: Path, names: Iterable[str], algorithm: str = FILE_ALGORITHM) -> dict[str, Any]:
    """{"algorithm", "files": {relative name: hex digest}} of the files `names` under `root`."""
    return {"algorithm": algorithm, "files": {name: digest_file(root / name, algorithm) for name in sorted(names)}}


def mismatched_files(root: Path, checksums: dict[str, Any], names: Iterable[str] | None = None,
                     links_ok: bool = False) -> list[str]:  # fmt: skip
    """The files (of `names`, default all listed) whose bytes no longer match `checksums`
    (as file_checksums wrote it); a file that cannot be read counts as mismatched, and so does a
    link or a device (`regular_file`) unless `links_ok` (a directory the user chose, such as a
    downloaded export whose files link into the Hugging Face cache)."""
    algorithm = check_algorithm(checksums.get("algorithm"), str(root))
    listed = checksums["files"]
    bad = []
    for name in sorted(listed if names is None else names):
        path = inside(root, name, str(root))
        try:
            if not links_ok:
                regular_file(root, name, str(root))
            if digest_file(path, algorithm) != listed[name]:
                bad.append(name)
        except (OSError, ValueError):  # missing, unreadable, a link or a device
            bad.append(name)
    return bad
