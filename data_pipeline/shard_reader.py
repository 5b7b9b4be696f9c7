"""Read feature shards: the manifest, one shard's samples, and a resumable per-rank stream.

Only shards listed in manifest.jsonl are read; a shard is listed only after it was fully
written, fsynced and renamed into place (see shard_writer.py), so a reader never sees a
partial shard and never opens a `.tmp-*` file. Manifest lines are taken only up to the last
newline, so a line being appended (or left half-written by a crash) is never parsed.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from webdataset.autodecode import Decoder, npy_loads
from webdataset.tariterators import group_by_keys, tar_file_expander

from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance, check_compatible
from data_pipeline.records import (
    DONE_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    TORCH_FEATURE_DTYPES,
    Sample,
    ShardRecord,
)

SAMPLE_FIELDS = ("features.npy", "input_ids.npy", "loss_mask.npy", "meta.json", "target_argmax.npy")
_META_KEYS = {"schema_version", "key", "T", "dtype", "features_shape", "extra"}
_STATE_VERSION = 1


class ManifestFollower:
    """Incrementally parses manifest.jsonl as it grows; `poll()` returns only the new records."""

    def __init__(self, shard_dir: str | os.PathLike[str]):
        self.path = Path(shard_dir) / MANIFEST_NAME
        self._offset = 0  # bytes consumed: always just after a newline
        self._lines = 0

    @property
    def count(self) -> int:
        """Records returned so far (= manifest index of the next record)."""
        return self._lines

    def poll(self) -> list[ShardRecord]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(self._offset)
                data = f.read(max(size - self._offset, 0))
        except FileNotFoundError:
            return []
        if size < self._offset:
            raise ValueError(
                f"{self.path} shrank from {self._offset} to {size} bytes: the manifest is "
                "append-only; do not edit or replace it while readers follow it"
            )
        end = data.rfind(b"\n")
        if end < 0:
            return []
        records = []
        for raw in data[:end].split(b"\n"):
            self._lines += 1
            records.append(ShardRecord.from_json(raw.decode("utf-8"), f"{self.path}:{self._lines}"))
        self._offset += end + 1
        return records


def read_manifest(shard_dir: str | os.PathLike[str]) -> list[ShardRecord]:
    """All complete shards listed so far, in manifest (append) order."""
    return ManifestFollower(shard_dir).poll()


def _decode_field(key: str, data: bytes) -> Any:
    # Only npy (numpy's loader, allow_pickle=False) and json: nothing in a shard is unpickled.
    if key.endswith(".npy"):
        return npy_loads(data)
    if key.endswith(".json"):
        return json.loads(data)
    raise ValueError(f"unexpected shard member {key!r}: this reader knows only {SAMPLE_FIELDS}")


_DECODER = Decoder([_decode_field], pre=[], post=[])


def _to_sample(d: dict[str, Any], where: str) -> Sample:
    missing = [f for f in SAMPLE_FIELDS if f not in d]
    if missing:
        raise ValueError(f"{where}: sample {d.get('__key__')!r} lacks members {missing}")
    meta = d["meta.json"]
    if not isinstance(meta, dict) or not set(meta) >= _META_KEYS:
        raise ValueError(f"{where}: sample {d.get('__key__')!r} meta.json lacks {sorted(_META_KEYS)}")
    if meta.get("schema_version") != SHARD_SCHEMA_VERSION:
        raise ValueError(
            f"{where}: sample schema_version {meta.get('schema_version')!r}, this reader reads "
            f"{SHARD_SCHEMA_VERSION}: re-extract the shards or use the matching code version"
        )
    dtype = meta["dtype"]
    feats = d["features.npy"]
    if dtype == "bfloat16" and feats.dtype == np.uint16:
        features = torch.from_numpy(feats.view(np.int16)).view(torch.bfloat16)
    elif dtype in TORCH_FEATURE_DTYPES and dtype != "bfloat16" and feats.dtype.name == dtype:
        features = torch.from_numpy(feats)
    else:
        raise ValueError(f"{where}: sample {meta['key']!r} has dtype {dtype!r} stored as {feats.dtype}")
    if list(features.shape) != list(meta["features_shape"]):
        raise ValueError(
            f"{where}: sample {meta['key']!r} features shape {list(features.shape)} != meta {meta['features_shape']}"
        )
    return Sample(
        key=meta["key"],
        input_ids=torch.from_numpy(d["input_ids.npy"]),
        loss_mask=torch.from_numpy(d["loss_mask.npy"]),
        features=features,
        target_argmax=torch.from_numpy(d["target_argmax.npy"]),
        meta=meta["extra"],
    )


def iter_shard_samples(path: str | os.PathLike[str], skip: int = 0) -> Iterator[Sample]:
    """Decode one complete shard bit-exactly, in storage order; the first `skip` are not decoded."""
    path = os.fspath(path)
    if os.path.basename(path).startswith(TMP_PREFIX):
        raise ValueError(f"{path} is a shard still being written (or abandoned); never read it")
    with open(path, "rb") as stream:
        files = tar_file_expander([{"url": path, "stream": stream}])
        for i, raw in enumerate(group_by_keys(files)):
            if i >= skip:
                yield _to_sample(_DECODER(raw), path)


class ShardStream:
    """Yields this rank's samples from a shard directory that may still be growing.

    Assignment: the shard on manifest line i (0-based, append order) belongs to rank
    `i % world_size`. The manifest is append-only, so every rank computes the same split, and
    the ranks together cover every shard exactly once. (Ranks may get unequal sample counts.)
    Every manifest record's provenance is checked against `expected_provenance`, also those of
    other ranks, so a wrong directory fails on every rank alike. The stream ends when the DONE
    marker exists and every listed shard of this rank was consumed, or, while it waits for new
    shards (sleeping `poll_s`), when `stop_when()` returns True.

    Position: `state_dict()` holds the names of fully consumed shards and the number of
    samples handed out from the current one; after `load_state_dict`, iteration resumes with
    the next sample not yet handed out. Valid only for the same rank and world size.
    """

    def __init__(
        self,
        shard_dir: str | os.PathLike[str],
        expected_provenance: Provenance,
        rank: int = 0,
        world_size: int = 1,
        poll_s: float = 1.0,
        stop_when: Callable[[], bool] | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ShardStream: need 0 <= rank < world_size, got {rank=} {world_size=}")
        if poll_s <= 0:
            raise ValueError(f"ShardStream: poll_s must be > 0, got {poll_s}")
        self.shard_dir = Path(shard_dir)
        self.expected = expected_provenance
        self.rank = rank
        self.world_size = world_size
        self.poll_s = poll_s
        self.stop_when = stop_when
        self._consumed: set[str] = set()
        self._current: str | None = None
        self._offset = 0

    def __iter__(self) -> Iterator[Sample]:
        follower = ManifestFollower(self.shard_dir)
        seen: set[str] = set()
        pending: deque[ShardRecord] = deque()
        while True:
            done = (self.shard_dir / DONE_NAME).exists()  # check before polling: DONE is last
            for record in follower.poll():
                index = len(seen)
                if record.name in seen:
                    raise ValueError(f"{follower.path}: shard {record.name} listed twice")
                seen.add(record.name)
                check_compatible(self.expected, record.provenance, str(self.shard_dir / record.name))
                if index % self.world_size == self.rank and record.name not in self._consumed:
                    pending.append(record)
            if pending:
                yield from self._iter_shard(pending.popleft())
            elif done or (self.stop_when is not None and self.stop_when()):
                return
            else:
                time.sleep(self.poll_s)

    def _iter_shard(self, record: ShardRecord) -> Iterator[Sample]:
        path = self.shard_dir / record.name
        skip = self._offset if self._current == record.name else 0
        self._current, self._offset = record.name, skip
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is listed in {MANIFEST_NAME} but missing: shards may be deleted only "
                "after every rank has consumed them"
            )
        position = skip
        for sample in iter_shard_samples(path, skip=skip):
            if position >= record.n_samples or sample.key != record.keys[position]:
                raise ValueError(f"{path}: sample {position} is {sample.key!r}, manifest disagrees")
            position += 1
            self._offset = position
            if position == record.n_samples:
                self._consumed.add(record.name)
                self._current, self._offset = None, 0
            yield sample
        if position != record.n_samples:
            raise ValueError(f"{path}: {position} samples on disk, manifest says {record.n_samples}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "consumed": sorted(self._consumed),
            "current": self._current,
            "offset": self._offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"ShardStream state version {state.get('version')!r} != {_STATE_VERSION}")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"ShardStream state was saved by rank {state['rank']} of {state['world_size']}, "
                f"this is rank {self.rank} of {self.world_size}: resume with the same world size "
                "(shard assignment depends on it) or start a fresh stream"
            )
        self._consumed = set(state["consumed"])
        self._current = state["current"]
        self._offset = int(state["offset"])
