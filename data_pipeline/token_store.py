"""The token store: each sample's (key, input ids, loss mask) as epoch 0 captured it, so later
epochs under `capture.later_epochs: recapture` run the target over exactly the same sequences
without regenerating or re-encoding anything (a regenerated response is fixed once, in epoch 0).

Layout (`<out>/shards/sequences/`, kept for the whole run; about 5 bytes per token plus tar
headers): webdataset tars `<prefix>-<NNNNNN>.tar` holding per sample `<i:08d>.ids.npy` (int32),
`<i:08d>.mask.npy` (uint8) and `<i:08d>.key.txt`, written as `.tmp-*`, fsynced, renamed, then
listed in `manifest.jsonl` with their keys, size and the file's XXH3 checksum, under the same
lock as the shard manifest (shard_writer.manifest_lock): a tar is listed only once complete, a
killed writer leaves at most an unlisted file. What is read back is verified against its line
(size, checksum, keys in order) and decoded with numpy's loader without pickle.
"""

from __future__ import annotations

import io
import json
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.writer import TarWriter

from data_pipeline.checksums import FILE_ALGORITHM, digest_bytes, digest_file, is_digest
from data_pipeline.durable_files import append_lines, fsync_dir
from data_pipeline.ledger import remove_unlisted_tars
from data_pipeline.npy_bytes import npy_from_bytes
from data_pipeline.plain_tar import tar_samples
from data_pipeline.records import MANIFEST_NAME, TMP_PREFIX
from data_pipeline.shard_writer import manifest_lock

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*-(\d{6,})\.tar")
_MEMBERS = ("ids.npy", "key.txt", "mask.npy")
TAR_MEMBER_OVERHEAD = 1024  # a member's 512-byte header plus its padding to 512 bytes, at most


@dataclass(frozen=True)
class SequenceRecord:
    """One complete token-store tar as listed in its manifest."""

    name: str
    keys: tuple[str, ...]
    lengths: tuple[int, ...]  # tokens per sample (a later epoch plans its passes from the manifest alone)
    n_bytes: int
    checksum: str  # FILE_ALGORITHM hex digest of the whole file

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "keys": list(self.keys),
                "lengths": list(self.lengths),
                "n_bytes": self.n_bytes,
                "checksum": self.checksum,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, line: str, where: str) -> SequenceRecord:
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a valid token-store manifest line ({e})") from None
        fields = {"name", "keys", "lengths", "n_bytes", "checksum"}
        if not isinstance(d, dict) or set(d) != fields:
            raise ValueError(f"{where}: a token-store manifest line has exactly {sorted(fields)}")
        if not isinstance(d["name"], str) or not _NAME_RE.fullmatch(d["name"]):
            raise ValueError(f"{where}: name {d['name']!r} is not a token-store tar name (<prefix>-<NNNNNN>.tar)")
        keys = d["keys"]
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{where}: keys must be a non-empty list of non-empty strings")
        lengths = d["lengths"]
        if (
            not isinstance(lengths, list)
            or len(lengths) != len(keys)
            or not all(isinstance(n, int) and n > 0 for n in lengths)
        ):
            raise ValueError(f"{where}: lengths must list a positive token count per key")
        if not isinstance(d["n_bytes"], int) or d["n_bytes"] < 0:
            raise ValueError(f"{where}: n_bytes must be an integer >= 0, got {d['n_bytes']!r}")
        if not is_digest(d["checksum"], FILE_ALGORITHM):
            raise ValueError(f"{where}: checksum must be a {FILE_ALGORITHM} hex digest")
        return cls(d["name"], tuple(keys), tuple(lengths), d["n_bytes"], d["checksum"])


def estimate_bytes(lengths: Iterable[int]) -> int:
    """An upper bound of the tar bytes `write_sequences` makes of sequences of these lengths."""
    lengths = list(lengths)
    return sum(5 * n + 4 * TAR_MEMBER_OVERHEAD for n in lengths) + 12 * TAR_MEMBER_OVERHEAD


def read_store(store_dir: str | os.PathLike[str]) -> list[SequenceRecord]:
    """Every listed tar, in listing order (a line being appended is not read)."""
    path = Path(store_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [
        SequenceRecord.from_json(raw.decode("utf-8"), f"{path}:{i}")
        for i, raw in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), 1)
    ]


def write_sequences(
    store_dir: str | os.PathLike[str], prefix: str, items: list[tuple[str, list[int], list[int]]]
) -> SequenceRecord:
    """Write (key, ids, loss mask) of several samples as one tar and list it; returns its record."""
    assert items, "nothing to store"
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f"{TMP_PREFIX}{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tar"
    try:
        with open(tmp, "xb") as f:
            tar = TarWriter(f, mtime=0)
            for i, (key, ids, mask) in enumerate(items):
                if len(ids) != len(mask):
                    raise ValueError(f"sample {key!r}: {len(ids)} ids but {len(mask)} loss-mask entries")
                tar.write(
                    {
                        "__key__": f"{i:08d}",
                        "ids.npy": np.asarray(ids, dtype=np.int32),
                        "mask.npy": np.asarray(mask, dtype=np.uint8),
                        "key.txt": key,
                    }
                )
            tar.close()
            f.flush()
            os.fsync(f.fileno())
        checksum, size = digest_file(tmp, FILE_ALGORITHM), tmp.stat().st_size
        with manifest_lock(store):
            listed = read_store(store)
            index = 1 + max(
                (int(_NAME_RE.fullmatch(r.name).group(1)) for r in listed if r.name.startswith(f"{prefix}-")),
                default=-1,
            )
            while (store / f"{prefix}-{index:06d}.tar").exists():  # renamed by a writer killed before listing it
                index += 1
            name = f"{prefix}-{index:06d}.tar"
            os.rename(tmp, store / name)
            fsync_dir(store)
            record = SequenceRecord(
                name, tuple(k for k, _, _ in items), tuple(len(ids) for _, ids, _ in items), size, checksum
            )
            append_lines(store / MANIFEST_NAME, (record.to_json() + "\n").encode())
    finally:
        tmp.unlink(missing_ok=True)
    return record


def read_sequences(store_dir: str | os.PathLike[str], record: SequenceRecord) -> dict[str, tuple[list[int], list[int]]]:
    """One listed tar's samples, verified against its manifest line (ValueError naming the file)."""
    path = Path(store_dir) / record.name
    if not path.is_file() or path.stat().st_size != record.n_bytes:
        raise ValueError(
            f"{path}: missing or not the {record.n_bytes} bytes its manifest line lists: the token "
            "store is damaged; later epochs cannot be captured (re-extract into another --out)"
        )
    data = path.read_bytes()  # a window's sequences: a few MB
    if digest_bytes(data, FILE_ALGORITHM) != record.checksum:
        raise ValueError(f"{path}: its bytes differ from the checksum listed when it was written (damaged)")
    out: dict[str, tuple[list[int], list[int]]] = {}
    for i, sample in enumerate(tar_samples(io.BytesIO(data), str(path))):
        if sorted(k for k in sample if not k.startswith("_")) != sorted(_MEMBERS) or i >= len(record.keys):
            raise ValueError(f"{path}: sample {i} is not (ids.npy, key.txt, mask.npy) or is not listed")
        key = sample["key.txt"].decode("utf-8")
        ids, mask = npy_from_bytes(sample["ids.npy"]), npy_from_bytes(sample["mask.npy"])
        if key != record.keys[i] or ids.dtype != np.int32 or mask.dtype != np.uint8 or ids.shape != mask.shape:
            raise ValueError(f"{path}: sample {i} ({key!r}) does not match its manifest line or is malformed")
        out[key] = (ids.tolist(), mask.tolist())
    if len(out) != len(record.keys):
        raise ValueError(f"{path}: holds {len(out)} samples, its manifest line lists {len(record.keys)}")
    return out


class SequenceStore:
    """Look up stored sequences by key, loading only the tars that hold the keys asked for (the
    last few tars loaded are kept: a window of a later epoch is usually one tar of epoch 0)."""

    def __init__(self, store_dir: str | os.PathLike[str], cached: int = 4) -> None:
        self.dir = Path(store_dir)
        self.cached = cached
        self._where: dict[str, SequenceRecord] = {}
        self._lengths: dict[str, int] = {}
        self._loaded: dict[str, dict[str, tuple[list[int], list[int]]]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-read the manifest (another writer may have listed tars since)."""
        for record in read_store(self.dir):
            for key in record.keys:
                if key in self._where and self._where[key].name != record.name:
                    raise ValueError(
                        f"{self.dir}: key {key!r} is listed in {self._where[key].name} and "
                        f"{record.name}: the token store holds a sample twice"
                    )
                self._where[key] = record
            self._lengths.update(zip(record.keys, record.lengths))

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def length(self, key: str) -> int:
        return self._lengths[key]

    def get(self, keys: list[str]) -> list[tuple[list[int], list[int]]]:
        missing = [k for k in keys if k not in self._where]
        if missing:
            raise ValueError(
                f"{self.dir}: no stored sequence for {len(missing)} key(s) ({missing[:3]}...): epoch 0 "
                "stores every sample it captures, so the token store is incomplete (deleted files?)"
            )
        out = []
        for key in keys:
            name = self._where[key].name
            if name not in self._loaded:
                while len(self._loaded) >= self.cached:
                    self._loaded.pop(next(iter(self._loaded)))
                self._loaded[name] = read_sequences(self.dir, self._where[key])
            out.append(self._loaded[name][key])
        return out


def remove_stale_tmp(store_dir: str | os.PathLike[str], prefix: str) -> list[str]:
    """Tars of this prefix a writer that died left: unfinished ones, and renamed ones it did not live
    to list (call when none of it is alive; ledger.remove_unlisted_tars)."""
    store = Path(store_dir)
    if not store.is_dir():
        return []
    return remove_unlisted_tars(store, lambda: {r.name for r in read_store(store)}, prefix)
