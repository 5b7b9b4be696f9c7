"""Write captured samples into webdataset tar shards that appear atomically, plus the manifest.

A shard is written as `.tmp-<prefix>-<pid>-<rand>.tar`, fsynced, then renamed to
`<prefix>-<NNNNNN>.tar`; only after the rename is its ShardRecord appended to manifest.jsonl,
with the XXH3 digest of every tar member, hashed from the encoded bytes as they are written (no
second pass; the reader checks them as it streams, checksums.py).
`start_writeback()` starts the disk write of what an open shard holds so far without waiting for
it: a capture writer process calls it whenever it has no job (capture.writeback_idle), so a shard's
closing fsync, and the capture's drain after its last pass, wait for the tail only, not for up to a
whole shard that the kernel kept dirty in the page cache.
Rename and append happen under an fcntl lock on `.manifest.lock` (plus a per-process thread
lock), so several writers (one per target actor, any prefixes) can share one directory. A
writer that dies leaves at most a `.tmp-*` file and no manifest line; a crash in the middle of
an append leaves a line without its newline, which readers ignore and the next append cuts off
(durable_files.append_lines).
Layout of a sample inside the tar: see records.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np
import torch
from webdataset.writer import TarWriter, default_handlers, encode_based_on_extension

from data_pipeline.checksums import member_digests
from data_pipeline.durable_files import append_lines, can_start_write_back, fsync_dir, open_own_file, start_write_back
from data_pipeline.feature_codec import ENCODING_OF, FP8, RAW, encode_fp8
from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance, check_compatible
from data_pipeline.records import (
    DONE_NAME,
    MANIFEST_LOCK_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    MemberChecksums,
    Sample,
    ShardRecord,
)
from data_pipeline.shard_reader import ManifestFollower, decode_sample

# webdataset's own npy and json encoders, and nothing else: no pickle can reach a shard.
_HANDLERS = {"npy": default_handlers["npy"], "json": default_handlers["json"]}
_TAR_BLOCK = 512
_TAR_RECORD = 20 * _TAR_BLOCK  # tarfile pads the finished archive to a multiple of this
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
log = logging.getLogger(__name__)

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def manifest_lock(shard_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive lock over shard renames and manifest appends in `shard_dir`.

    flock excludes other processes; the thread lock excludes writers of this process (flock on
    NFS is emulated with POSIX locks, which do not exclude threads of one process).
    """
    path = Path(os.path.realpath(shard_dir)) / MANIFEST_LOCK_NAME  # the directory resolved, never the lock's name
    with _thread_locks_guard:
        thread_lock = _thread_locks.setdefault(str(path), threading.Lock())
    with thread_lock:
        fd = open_own_file(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def encode_sample(sample: Sample, tar_key: str, encoding: str = RAW, layers: int = 1) -> dict[str, Any]:
    """The tar members of one sample, encoded by webdataset (npy/json): features raw (bf16 as
    its uint16 bits) or, with encoding FP8, as feature_codec.encode_fp8 over `layers` layers."""
    features = sample.features.detach().cpu().contiguous()
    if encoding == FP8:
        feats = encode_fp8(features, layers)
    elif features.dtype == torch.bfloat16:
        feats, encoding = features.view(torch.int16).numpy().view(np.uint16), "bfloat16-bits-as-uint16"
    else:
        feats, encoding = features.numpy(), "native"
    meta = {
        "schema_version": SHARD_SCHEMA_VERSION,
        "key": sample.key,
        "T": sample.num_tokens,
        "dtype": sample.dtype_name,
        "features_shape": list(features.shape),
        "features_encoding": encoding,
        **({"feature_layers": layers} if encoding == FP8 else {}),
        "extra": dict(sample.meta),
    }
    raw = {
        "__key__": tar_key,
        "input_ids.npy": sample.input_ids.detach().cpu().numpy(),
        "loss_mask.npy": sample.loss_mask.detach().cpu().numpy(),
        "target_argmax.npy": sample.target_argmax.detach().cpu().numpy(),
        "features.npy": feats,
        "meta.json": meta,
    }
    try:
        return encode_based_on_extension(raw, _HANDLERS)
    except TypeError as e:
        raise ValueError(f"sample {sample.key!r}: meta must be JSON-serialisable ({e})") from e


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tar_bytes(encoded: dict[str, Any]) -> int:
    """Bytes a sample adds to a USTAR tar: a header block per member plus padded contents."""
    return sum(_TAR_BLOCK + _round_up(len(v), _TAR_BLOCK) for k, v in encoded.items() if k[0] != "_")


def _final_size(members_bytes: int) -> int:
    """Archive size once closed: members, two zero end blocks, padded to a whole record."""
    return _round_up(members_bytes + 2 * _TAR_BLOCK, _TAR_RECORD)


class ShardWriter:
    """Writes Samples into `<prefix>-<NNNNNN>.tar` shards of at most `max_shard_bytes` each.

    A shard is closed when the next sample would push it past `max_shard_bytes` (a single
    larger sample gets a shard of its own), on `flush()` and on `close()`. `write`, `flush`
    and `close` return the ShardRecord of a shard they completed, else None. Used as a context
    manager, an exception inside the block aborts: the unfinished shard is deleted, unlisted.
    `before_open`, if given, is called before each new shard file is opened (the capture waits
    there while the disk buffer is full, disk_budget.py), with no shard of this writer open.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        provenance: Provenance,
        max_shard_bytes: int = 1 << 30,
        prefix: str = "shard",
        before_open: Callable[[], None] | None = None,
    ):
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"ShardWriter prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        if max_shard_bytes <= 0:
            raise ValueError(f"ShardWriter max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.provenance = provenance
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self.before_open = before_open
        self.writeback_calls = 0  # write-back ranges started by start_writeback (diagnostics, tests)
        self.writeback_max_s = 0.0  # the longest of them: a disk with a full queue makes the call wait
        self._can_write_back = can_start_write_back()
        self._written_back = 0  # bytes of the open shard handed to the disk so far
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._name_re = re.compile(re.escape(prefix) + r"-(\d+)\.tar")
        self._next_index = 0
        self._follower = ManifestFollower(self.out_dir)
        with manifest_lock(self.out_dir):
            self._check_not_done()
            self._absorb(self._follower.poll())  # refuse a directory of other provenance now
        self._records: list[ShardRecord] = []
        self._seen_keys: set[str] = set()
        self._closed = False
        self._file: IO[bytes] | None = None
        self._tar: TarWriter | None = None
        self._tmp_path: Path | None = None
        self._keys: list[str] = []
        self._digests: list[dict[str, str]] = []  # per sample of the open shard: member -> digest
        self._tokens = 0
        self._members_bytes = 0

    @property
    def records(self) -> tuple[ShardRecord, ...]:
        """Shards this writer completed, in order."""
        return tuple(self._records)

    def write(self, sample: Sample) -> ShardRecord | None:
        if self._closed:
            raise ValueError(f"ShardWriter({self.prefix!r}) is closed")
        if sample.dtype_name != self.provenance.dtype:
            raise ValueError(
                f"sample {sample.key!r}: features are {sample.dtype_name}, provenance says {self.provenance.dtype}"
            )
        if sample.features.shape[1] != self.provenance.feature_width:
            raise ValueError(
                f"sample {sample.key!r}: features width {sample.features.shape[1]} != "
                f"len(layer_ids) * hidden_size = {self.provenance.feature_width}"
            )
        if sample.key in self._seen_keys:
            raise ValueError(f"sample key {sample.key!r} was already written by this writer")
        encoded = encode_sample(sample, "", self.provenance.feature_encoding, len(self.provenance.layer_ids))
        nbytes = _tar_bytes(encoded)
        digests = member_digests(encoded)
        finished = None
        if self._keys and _final_size(self._members_bytes + nbytes) > self.max_shard_bytes:
            finished = self._finish_shard()
        if self._tar is None:
            self._open_shard()
        assert self._tar is not None
        encoded["__key__"] = f"{len(self._keys):08d}"
        self._tar.write(encoded)
        self._members_bytes += nbytes
        assert self._tar.tarstream.offset == self._members_bytes, "tar size prediction is off"
        self._keys.append(sample.key)
        self._digests.append(digests)
        self._seen_keys.add(sample.key)
        self._tokens += sample.num_tokens
        return finished

    def start_writeback(self, stop: Callable[[], bool] | None = None, chunk: int = 32 << 20) -> int:
        """Start the disk write of the open shard's bytes written since the last call, without
        waiting for it to finish (durable_files.start_write_back: the pages stay cached), in ranges
        of `chunk` bytes, returning early once `stop()` says so after a range (the caller has work
        again: a range can block while the disk's queue is full); returns the bytes handed over
        (0: no shard open, nothing new, or no sync_file_range here). The bytes still in tarfile's
        stream buffer (<= 10 KiB) go with the next call or the closing fsync."""
        if self._file is None or not self._can_write_back:
            return 0
        self._file.flush()
        end, begin = self._file.tell(), self._written_back
        while self._written_back < end:
            n = min(chunk, end - self._written_back)
            t0 = time.perf_counter()
            try:
                start_write_back(self._file.fileno(), self._written_back, n)
            except OSError as e:  # refused (a filesystem without it): the closing fsync writes it all, as before
                log.warning("%s: sync_file_range refused (%s); this writer's shards are written back at close only",
                            self.out_dir, e)
                self._can_write_back = False
                break
            self.writeback_calls += 1
            self.writeback_max_s = max(self.writeback_max_s, time.perf_counter() - t0)  # what a job may wait
            self._written_back += n
            if stop is not None and stop():
                break
        return self._written_back - begin

    def flush(self) -> ShardRecord | None:
        """Complete the current shard now (if it holds any sample)."""
        return self._finish_shard() if self._keys else None

    def close(self) -> ShardRecord | None:
        if self._closed:
            return None
        record = self.flush()
        self._discard_tmp()
        self._closed = True
        return record

    def abort(self) -> None:
        """Drop the unfinished shard; completed shards stay listed."""
        self._discard_tmp()
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _open_shard(self) -> None:
        if self.before_open is not None:
            self.before_open()
        name = f"{TMP_PREFIX}{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tar"
        self._tmp_path = self.out_dir / name
        self._file = open(self._tmp_path, "xb")  # noqa: SIM115 (lives until _finish_shard)
        # An integer mtime keeps every header plain USTAR (a float one adds a pax header per
        # member), so _tar_bytes predicts each sample's size exactly.
        self._tar = TarWriter(self._file, encoder=False, mtime=int(time.time()))

    def _discard_tmp(self) -> None:
        # The unfinished shard is thrown away; a tar error while closing it changes nothing.
        with contextlib.suppress(Exception):
            if self._tar is not None:
                self._tar.close()
        if self._file is not None:
            self._file.close()
        if self._tmp_path is not None:
            self._tmp_path.unlink(missing_ok=True)
        self._tar = self._file = self._tmp_path = None
        self._keys, self._digests, self._tokens, self._members_bytes = [], [], 0, 0
        self._written_back = 0

    def _finish_shard(self) -> ShardRecord:
        assert self._tar is not None and self._file is not None and self._tmp_path is not None
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        assert size == _final_size(self._members_bytes), (size, self._members_bytes)
        try:
            with manifest_lock(self.out_dir):
                self._check_not_done()
                self._absorb(self._follower.poll())
                name = self._claim_name()
                os.rename(self._tmp_path, self.out_dir / name)
                self._tmp_path = None
                fsync_dir(self.out_dir)
                record = ShardRecord(
                    name=name,
                    n_samples=len(self._keys),
                    n_tokens=self._tokens,
                    n_bytes=size,
                    keys=tuple(self._keys),
                    provenance=self.provenance,
                    checksums=MemberChecksums.of(self._digests),
                )
                append_lines(self.out_dir / MANIFEST_NAME, (record.to_json() + "\n").encode())
                fsync_dir(self.out_dir)
        finally:
            self._file = self._tar = None
            self._discard_tmp()
        self._records.append(record)
        return record

    def _check_not_done(self) -> None:
        if (self.out_dir / DONE_NAME).exists():
            raise ValueError(
                f"{self.out_dir} is marked {DONE_NAME}: readers stop there, so new shards would be "
                f"lost. Write to a fresh directory (or delete {DONE_NAME} if that was a mistake)."
            )

    def _absorb(self, records: list[ShardRecord]) -> None:
        """Refuse a directory holding other provenance; keep numbering after listed shards."""
        for record in records:
            check_compatible(self.provenance, record.provenance, str(self.out_dir / record.name))
            m = self._name_re.fullmatch(record.name)
            if m:
                self._next_index = max(self._next_index, int(m.group(1)) + 1)

    def _claim_name(self) -> str:
        # Skip unlisted files too: a writer may have died between its rename and its append.
        while (self.out_dir / f"{self.prefix}-{self._next_index:06d}.tar").exists():
            self._next_index += 1
        name = f"{self.prefix}-{self._next_index:06d}.tar"
        self._next_index += 1
        return name


def round_trip_features(features: torch.Tensor, feature_dtype: str, layers: int) -> torch.Tensor:
    """`features` [T, k*H] through exactly what a shard does to them (the writer's encode_sample,
    npy bytes, the reader's decoding) for capture.feature_dtype `feature_dtype` (bf16 | fp8),
    back in their own dtype: for benches comparing bf16 and fp8 features on the same data."""
    t = features.shape[0]
    zeros = torch.zeros(t, dtype=torch.int32)
    sample = Sample("round-trip", zeros, zeros.to(torch.uint8), features.detach().cpu(), zeros)
    encoded = encode_sample(sample, "0", ENCODING_OF[feature_dtype], layers)
    return decode_sample(encoded, "<round_trip_features>").features


def mark_done(out_dir: str | os.PathLike[str]) -> None:
    """Mark the directory complete. Call once, after every producer's writer was closed."""
    out = Path(out_dir)
    tmp = out / f"{TMP_PREFIX}{DONE_NAME}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump({"done_unix": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, out / DONE_NAME)
    fsync_dir(out)
