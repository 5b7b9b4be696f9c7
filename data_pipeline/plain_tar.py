"""A shard or token-store tar read as its samples' raw members: uncompressed tars only.

webdataset's reader (`tar_file_expander`) opens every tar with `tarfile.open(mode="r|*")`, which
decompresses gzip, bzip2 and xz on the fly. Our writers never compress (TarWriter, plain "w|"),
and a compressed "shard" holds members whose declared size the decompressor produces from a few
bytes: 4.6 MB of gzip on disk became a 1 GiB member in memory (2.3 GB RSS), read whole before
any checksum could be compared, and xz packs zeros about a thousand times tighter still. A file's
size, which the readers check against its manifest line, then bounds nothing. Here the same walk
is made with `mode="r|"`: a compressed file fails at its first header, and every member read is
bytes of the file itself, so one shard never holds more in memory than its size on disk.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from typing import IO, Any

from webdataset.tariterators import group_by_keys

_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: names it never hands out
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


class NotPlainTar(ValueError):
    """A tar the project's writers cannot have made (compressed, or not a tar at all)."""


def _open_plain(stream: IO[bytes], url: str) -> tarfile.TarFile:
    head = stream.read(6)
    stream.seek(0)
    kind = next((name for magic, name in _COMPRESSED.items() if head.startswith(magic)), None)
    if kind is not None:
        raise NotPlainTar(
            f"{url}: a {kind}-compressed file, not a plain tar: dflash-dist writes its tars uncompressed, and a "
            "compressed one would be decompressed in memory before any checksum is compared; this file was not "
            "written by dflash-dist: remove it, or re-extract into a fresh directory"
        )
    try:
        return tarfile.open(fileobj=stream, mode="r|")
    except tarfile.ReadError as e:
        raise NotPlainTar(f"{url}: not a plain tar ({e})") from None


def _members(stream: IO[bytes], url: str) -> Iterator[dict[str, Any]]:
    with _open_plain(stream, url) as tar:
        try:
            for info in tar:
                if info.isreg() and not _META.match(info.name):
                    yield {"fname": info.name, "data": tar.extractfile(info).read(), "__url__": url}
                tar.members = []  # a stream holds no list of what it has read
        except tarfile.ReadError as e:  # a member cut short: tarfile's message names no file
            raise tarfile.ReadError(f"{url}: cut short or damaged inside a member ({e})") from None
    yield {}  # the end of this tar for group_by_keys: its last sample is complete


def tar_samples(stream: IO[bytes], url: str) -> Iterator[dict[str, Any]]:
    """The samples of one uncompressed tar (a seekable binary `stream`), each a dict of its raw
    members by suffix plus `__key__`/`__url__`, in storage order: what webdataset's
    `group_by_keys(tar_file_expander(...))` yields for a plain tar. A compressed file or one that
    is no tar raises NotPlainTar naming `url`; a tar cut short inside a member raises tarfile.ReadError
    naming `url` (webdataset's expander named it too); one cut at a member boundary just ends there."""
    return group_by_keys(_members(stream, url))
