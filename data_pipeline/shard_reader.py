"""Read feature shards: the manifest, one shard's samples, and a resumable, seeded per-rank stream.

Only shards listed in manifest.jsonl are read; a shard is listed only after it was fully
written, fsynced and renamed into place (see shard_writer.py), so a reader never sees a
partial shard and never opens a `.tmp-*` file. Manifest lines are taken only up to the last
newline, so a line being appended (or left half-written by a crash) is never parsed.

Orders are derived from hashes of (seed, epoch, shard name[, sample index]), not from a
random generator's stream, so they are the same on every Python/numpy version, on every rank
and for every world size. A position counts samples in those orders, so it survives a restart
at another world size once every rank's position is merged (`merge_reader_states`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from webdataset.autodecode import Decoder

from data_pipeline.feature_codec import FP8, decode_fp8
from data_pipeline.npy_bytes import npy_from_bytes
from data_pipeline.plain_tar import tar_samples
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
_STATE_VERSION = 2  # 1: (rank, world, consumed, current, offset), valid for one world size only
# Skip reasons (ShardStream.skipped counts samples by reason).
MISSING_SHARD = "missing_shard"  # listed in the manifest, not on disk
# size or a member's checksum differs from the manifest, not a readable tar, fewer samples, wrong keys
CORRUPT_SHARD = "corrupt_shard"
NONFINITE = "nonfinite_features"  # a sample whose features hold NaN or Inf
SKIP_REASONS = (MISSING_SHARD, CORRUPT_SHARD, NONFINITE)

log = logging.getLogger(__name__)


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
    # Only npy (npy_bytes: numpy's format, no object dtype) and json: nothing in a shard is unpickled.
    if key.endswith(".npy"):
        return npy_from_bytes(data)
    if key.endswith(".json"):
        return json.loads(data)
    raise ValueError(f"unexpected shard member {key!r}: this reader knows only {SAMPLE_FIELDS}")


_DECODER = Decoder([_decode_field], pre=[], post=[])


def decode_sample(raw: dict[str, Any], where: str) -> Sample:
    """One sample from its raw tar members (suffix -> bytes), as the stream decodes it."""
    return _to_sample(_DECODER(raw), where)


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
    if meta.get("features_encoding") == FP8 and dtype in TORCH_FEATURE_DTYPES:
        features = decode_fp8(feats, meta["features_shape"], TORCH_FEATURE_DTYPES[dtype], meta.get("feature_layers", 0))
    elif dtype == "bfloat16" and feats.dtype == np.uint16:
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


def _raw_samples(stream, path: str) -> Iterator[dict[str, Any]]:
    """One shard's samples as raw tar members (webdataset's grouping; plain tars only), in storage order."""
    return tar_samples(stream, path)


def iter_shard_samples(
    path: str | os.PathLike[str], skip: int = 0, record: ShardRecord | None = None
) -> Iterator[Sample]:
    """Decode one complete shard bit-exactly, in storage order; the first `skip` are not decoded.
    The same raw reading, checksum verification and decoding as the training stream (`_raw_samples`,
    `MemberChecksums.verify`, `_to_sample`), without its order, ownership and skip accounting: for
    tools and tests that inspect a shard. A damaged member raises ChecksumMismatch naming it.
    `record` is the shard's manifest line (default: looked up in its directory's manifest)."""
    path = os.fspath(path)
    if os.path.basename(path).startswith(TMP_PREFIX):
        raise ValueError(f"{path} is a shard still being written (or abandoned); never read it")
    if record is None:
        name, listed = os.path.basename(path), read_manifest(os.path.dirname(path) or ".")
        record = next((r for r in listed if r.name == name), None)
        if record is None:
            raise ValueError(
                f"{path} is not listed in {MANIFEST_NAME} beside it, so its checksums cannot be verified: read "
                "shards in their own directory (or pass record=, its manifest line)"
            )
    with open(path, "rb") as stream:
        for i, raw in enumerate(_raw_samples(stream, path)):
            if i >= record.n_samples:
                raise ValueError(f"{path}: the tar holds more than the {record.n_samples} samples its manifest lists")
            if i >= skip:
                record.checksums.verify(i, raw, path, record.keys[i])
                yield _to_sample(_DECODER(raw), path)


def _hash64(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def shard_order(records: Sequence[ShardRecord], epoch: int, seed: int) -> list[ShardRecord]:
    """The shards in the order of `epoch`: epoch 0 in manifest (append) order, so it can follow
    a manifest that is still growing; later epochs (the manifest is final) in a permutation
    seeded by (seed, epoch). A shard's place depends only on its name, seed and epoch."""
    if epoch == 0:
        return list(records)
    return sorted(records, key=lambda r: (_hash64("shards", seed, epoch, r.name), r.name))


def sample_order(name: str, n_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Storage indices of one shard's samples in the order they are handed out in `epoch`."""
    if not shuffle:
        return list(range(n_samples))
    return sorted(range(n_samples), key=lambda i: _hash64("samples", seed, epoch, name, i))


def owns(position: int, rank: int, world_size: int, worker_id: int = 0, num_workers: int = 1) -> bool:
    """Whether the shard at `position` of the epoch's order belongs to (rank, worker): ranks take
    every world_size-th shard, a rank's dataloader workers every num_workers-th of those."""
    return position % world_size == rank and (position // world_size) % num_workers == worker_id


def assigned_shards(
    records: Sequence[ShardRecord],
    epoch: int,
    seed: int,
    rank: int,
    world_size: int,
    worker_id: int = 0,
    num_workers: int = 1,
) -> list[ShardRecord]:
    """The shards one (rank, worker) reads in `epoch`, in reading order (e.g. to count what a
    rank left unread when its epoch ended)."""
    ordered = shard_order(records, epoch, seed)
    return [r for i, r in enumerate(ordered) if owns(i, rank, world_size, worker_id, num_workers)]


class ShardStream:
    """Yields one (rank, worker)'s samples of one epoch from a shard directory that may still grow.

    Order: `shard_order` (epoch 0, and any epoch with `follow` (a directory captured for that epoch
    alone), follows the manifest as it grows; a later epoch of a re-read capture waits for the
    DONE marker, then permutes the final manifest), and within a shard `sample_order` (storage
    order, or with `shuffle` a permutation seeded by (seed, epoch, shard name)).
    Assignment: the shard at position i of the epoch's order belongs to rank `i % world_size`
    and, within the rank, to worker `(i // world_size) % num_workers` (`owns`): every stream
    computes the same split and together they read every shard exactly once. Every manifest
    record's provenance is checked against `expected_provenance`, also those of other ranks,
    so a wrong directory fails on every rank alike (ProvenanceMismatch names the field). The
    stream ends when DONE exists and every listed shard of this stream was read, or, while it
    waits for new shards (sleeping `poll_s`), when `stop_when()` returns True.

    Memory: without shuffle a shard is streamed sample by sample. With shuffle the shard's raw
    tar members are read into memory first (the shuffle buffer: at most one shard's bytes, i.e.
    capture.shard_bytes, 1 GiB by default) and each sample is decoded only when it is handed
    out, its raw bytes dropped then; so at most one shard's raw bytes plus one decoded sample.
    (Reading the whole shard first also means a truncated tar is found before any of its
    samples is handed out; without shuffle, the samples before the damage are handed out.)

    Skips (never an exception mid-run): a shard missing from disk, one whose size differs from
    the manifest, that does not parse as a tar, holds fewer samples or other keys than the
    manifest says, a member whose bytes differ from the checksum its manifest line recorded at
    write time (hashed from the bytes as they are read: no second pass), or a sample that does
    not decode, ends that shard: its remaining samples are
    counted as skipped (`missing_shard`/`corrupt_shard`) with one warning naming the path and
    why. A sample whose features hold NaN/Inf is skipped alone (`nonfinite_features`).
    `skipped` holds this stream's cumulative counts in samples by reason; it is replaced, never
    mutated, so another thread may read it at any time.

    Position (`state_dict`): the names of the shards fully processed in this epoch and, for a
    shard begun, how many of its samples in the epoch's order were processed (handed out or
    skipped). Neither depends on the world size: `merge_reader_states` combines every stream's
    state into one that any (rank, worker) of any world size loads, each then reading only its
    own shards of the new assignment minus what was processed. A stream's own state is loaded
    by the same (rank, world_size, worker_id, num_workers) only: it knows only its own shards.
    """

    def __init__(
        self,
        shard_dir: str | os.PathLike[str],
        expected_provenance: Provenance,
        rank: int = 0,
        world_size: int = 1,
        poll_s: float = 1.0,
        stop_when: Callable[[], bool] | None = None,
        *,
        epoch: int = 0,
        seed: int = 0,
        shuffle: bool = False,
        worker_id: int = 0,
        num_workers: int = 1,
        follow: bool = False,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ShardStream: need 0 <= rank < world_size, got {rank=} {world_size=}")
        if num_workers < 1 or not 0 <= worker_id < num_workers:
            raise ValueError(f"ShardStream: need 0 <= worker_id < num_workers, got {worker_id=} {num_workers=}")
        if poll_s <= 0:
            raise ValueError(f"ShardStream: poll_s must be > 0, got {poll_s}")
        if epoch < 0:
            raise ValueError(f"ShardStream: epoch must be >= 0, got {epoch}")
        self.shard_dir = Path(shard_dir)
        self.expected = expected_provenance
        self.rank, self.world_size = rank, world_size
        self.worker_id, self.num_workers = worker_id, num_workers
        self.epoch, self.seed, self.shuffle, self.follow = epoch, seed, bool(shuffle), follow
        self.poll_s = poll_s
        self.stop_when = stop_when
        self.skipped: dict[str, int] = {}
        self.problems: list[str] = []  # "path (reason): why" per shard or sample skipped, for error messages
        self._consumed: set[str] = set()
        self._consumed_order: list[str] = []  # the same names, in the order they were finished
        self._consumed_view: tuple[str, ...] | None = ()  # cached for state_dict (once per shard)
        self._partial: dict[str, int] = {}  # shard name -> samples processed, 0 < n < n_samples

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Sample]:
        if self.epoch == 0 or self.follow:
            yield from self._iter_growing()
        else:
            yield from self._iter_final()

    def _iter_growing(self) -> Iterator[Sample]:
        follower = ManifestFollower(self.shard_dir)
        seen: set[str] = set()
        pending: deque[ShardRecord] = deque()
        while True:
            done = (self.shard_dir / DONE_NAME).exists()  # check before polling: DONE is last
            for record in follower.poll():
                index = len(seen)
                self._check_record(record, seen, follower.path)
                if self._owns(index) and record.name not in self._consumed:
                    pending.append(record)
            if pending:
                yield from self._iter_shard(pending.popleft())
            elif done or self._stopped():
                return
            else:
                time.sleep(self.poll_s)

    def _iter_final(self) -> Iterator[Sample]:
        while not (self.shard_dir / DONE_NAME).exists():  # the order needs the final manifest
            if self._stopped():
                return
            time.sleep(self.poll_s)
        seen: set[str] = set()
        records = read_manifest(self.shard_dir)
        for record in records:
            self._check_record(record, seen, self.shard_dir / MANIFEST_NAME)
        for i, record in enumerate(shard_order(records, self.epoch, self.seed)):
            if self._owns(i) and record.name not in self._consumed:
                yield from self._iter_shard(record)

    def _owns(self, position: int) -> bool:
        return owns(position, self.rank, self.world_size, self.worker_id, self.num_workers)

    def _stopped(self) -> bool:
        return self.stop_when is not None and self.stop_when()

    def _check_record(self, record: ShardRecord, seen: set[str], manifest: Path) -> None:
        if record.name in seen:
            raise ValueError(f"{manifest}: shard {record.name} listed twice")
        seen.add(record.name)
        check_compatible(self.expected, record.provenance, str(self.shard_dir / record.name))

    def _iter_shard(self, record: ShardRecord) -> Iterator[Sample]:
        path, n = self.shard_dir / record.name, record.n_samples
        position = self._partial.get(record.name, 0)  # samples of this shard already processed
        problem = _file_problem(path, record)
        if problem is not None:
            self._skip_rest(record, position, *problem)
            return
        items = self._raw_in_order(path, record, position)
        warned = False
        try:
            while position < n:
                try:
                    index, raw = next(items)
                    record.checksums.verify(index, raw, str(path), record.keys[index])  # the bytes just read
                    sample = _to_sample(_DECODER(raw), str(path))
                    if sample.key != record.keys[index]:
                        raise ValueError(f"sample {index} is {sample.key!r}, the manifest lists {record.keys[index]!r}")
                except StopIteration:
                    self._skip_rest(record, position, CORRUPT_SHARD, f"the tar holds only {position} of {n} samples")
                    return
                except MemoryError:
                    raise
                except Exception as e:  # any failure to read or decode this shard's bytes
                    self._skip_rest(record, position, CORRUPT_SHARD, f"{type(e).__name__}: {e}")
                    return
                position += 1
                self._advance(record.name, position, n)
                if not bool(torch.isfinite(sample.features).all()):
                    self._count(NONFINITE, 1)
                    self.problems = [*self.problems, f"{path} sample {sample.key!r} ({NONFINITE})"]
                    if not warned:
                        log.warning(
                            "skipping sample %r of %s: its features hold NaN or Inf (later ones of this shard "
                            "are skipped and counted as %s without a warning)",
                            sample.key,
                            path,
                            NONFINITE,
                        )
                        warned = True
                    continue
                yield sample
        finally:
            items.close()  # closes the shard file also when the consumer stops early

    def _raw_in_order(self, path: Path, record: ShardRecord, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """(storage index, raw tar members) of one shard in this epoch's order from `start` on."""
        with open(path, "rb") as f:
            raws = _raw_samples(f, str(path))
            if not self.shuffle:
                for i, raw in enumerate(raws):
                    if i >= start:
                        yield i, raw
                return
            whole = list(raws)  # the shuffle buffer: one shard's raw bytes
        if len(whole) != record.n_samples:
            raise ValueError(f"the tar holds {len(whole)} samples, the manifest says {record.n_samples}")
        for i, raw in enumerate(whole):  # the tar is whole: nothing of it is handed out otherwise
            missing = [f for f in SAMPLE_FIELDS if f not in raw]
            if missing:
                raise ValueError(f"sample {i} lacks members {missing}")
        buffer: list[dict[str, Any] | None] = list(whole)
        del whole
        for position, i in enumerate(sample_order(record.name, record.n_samples, self.epoch, self.seed, True)):
            raw, buffer[i] = buffer[i], None  # handed out (or already processed): its bytes go
            if position >= start:
                yield i, raw

    def _advance(self, name: str, position: int, n: int) -> None:
        if position >= n:
            self._finish(name)
        else:
            self._partial[name] = position

    def _finish(self, name: str) -> None:
        self._partial.pop(name, None)
        if name not in self._consumed:
            self._consumed.add(name)
            self._consumed_order.append(name)
            self._consumed_view = None

    def _count(self, reason: str, n: int) -> None:
        if n > 0:
            self.skipped = {**self.skipped, reason: self.skipped.get(reason, 0) + n}

    def _skip_rest(self, record: ShardRecord, position: int, reason: str, why: str) -> None:
        remaining = record.n_samples - position
        self._count(reason, remaining)
        self.problems = [*self.problems, f"{self.shard_dir / record.name} ({reason}, {remaining} samples): {why}"]
        self._finish(record.name)
        log.warning(
            "skipping shard %s (%s): %s; its %d remaining of %d samples are counted as skipped",
            self.shard_dir / record.name,
            reason,
            why,
            remaining,
            record.n_samples,
        )

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        """The position after the last sample handed out; cheap (called after every sample)."""
        if self._consumed_view is None:
            self._consumed_view = tuple(self._consumed_order)
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "num_workers": self.num_workers,
            "complete": self.world_size == 1 and self.num_workers == 1,  # covers every stream
            "consumed": self._consumed_view,
            "partial": dict(self._partial),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from this stream's own state, or from a complete one (`merge_reader_states`).
        Skip counts of a merged state go to rank 0's worker 0 only, so their sum stays right."""
        _check_state(state, "ShardStream state")
        for key in ("epoch", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ShardStream state is for {key}={state[key]!r}, this stream has {key}={getattr(self, key)!r}: "
                    "a position counts samples in one epoch's order, which depends on epoch, seed and shuffle"
                )
        saved_by = (state["rank"], state["world_size"], state["worker_id"], state["num_workers"])
        own = saved_by == (self.rank, self.world_size, self.worker_id, self.num_workers)
        if not state["complete"] and not own:
            raise ValueError(
                f"ShardStream state was saved by rank {saved_by[0]} of {saved_by[1]} (worker {saved_by[2]} of "
                f"{saved_by[3]}) and knows only that share; this is rank {self.rank} of {self.world_size} (worker "
                f"{self.worker_id} of {self.num_workers}): merge every rank's state with merge_reader_states() "
                "to resume at another world size, or start a fresh stream"
            )
        self._consumed_order = list(dict.fromkeys(state["consumed"]))
        self._consumed = set(self._consumed_order)
        self._consumed_view = None
        self._partial = {k: int(v) for k, v in state["partial"].items() if k not in self._consumed}
        takes_counts = own or (self.rank == 0 and self.worker_id == 0)
        self.skipped = {k: int(v) for k, v in state["skipped"].items()} if takes_counts else {}


_STATE_KEYS = {
    "version",
    "epoch",
    "seed",
    "shuffle",
    "rank",
    "world_size",
    "worker_id",
    "num_workers",
    "complete",
    "consumed",
    "partial",
    "skipped",
}


def _check_state(state: Any, where: str) -> None:
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{where} has version {version!r}, this reader reads {_STATE_VERSION}: it was saved by another "
            "reader version; resume with that code version or start a fresh run"
        )
    missing = sorted(_STATE_KEYS - set(state))
    if missing:
        raise ValueError(f"{where} lacks {missing}")


def merge_reader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the states of every stream of one epoch (all ranks x workers of one world size)
    into one complete state that `ShardStream.load_state_dict` accepts on any rank of any world
    size: shards consumed by any stream, each begun shard at its furthest position, skip counts
    summed (carried on by rank 0's worker 0 after loading)."""
    if not states:
        raise ValueError("merge_reader_states: no states given")
    for i, s in enumerate(states):
        _check_state(s, f"merge_reader_states: state {i}")
    for key in ("epoch", "seed", "shuffle"):
        values = sorted({repr(s[key]) for s in states})
        if len(values) > 1:
            raise ValueError(f"merge_reader_states: the states disagree on {key} ({', '.join(values)})")
    if len(states) == 1 and states[0]["complete"]:
        return _merged(states[0], states)
    if any(s["complete"] for s in states):
        raise ValueError("merge_reader_states: pass each stream's own state, not one that is already complete")
    shapes = sorted({(s["world_size"], s["num_workers"]) for s in states})
    if len(shapes) > 1:
        raise ValueError(f"merge_reader_states: states of different (world_size, num_workers): {shapes}")
    world, workers = shapes[0]
    got = sorted((s["rank"], s["worker_id"]) for s in states)
    want = [(r, w) for r in range(world) for w in range(workers)]
    if got != want:
        missing = sorted(set(want) - set(got))
        twice = sorted({x for x in got if got.count(x) > 1})
        raise ValueError(
            f"merge_reader_states: need exactly one state per (rank, worker) of world {world} x {workers} "
            f"workers; missing {missing}, given twice {twice}"
        )
    return _merged(states[0], states)


def _merged(first: dict[str, Any], states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    consumed: set[str] = set()
    partial: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for s in states:
        consumed.update(s["consumed"])
        for name, n in s["partial"].items():
            partial[name] = max(partial.get(name, 0), int(n))
        for reason, n in s["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + int(n)
    return {
        "version": _STATE_VERSION,
        "epoch": first["epoch"],
        "seed": first["seed"],
        "shuffle": first["shuffle"],
        "rank": None,
        "world_size": None,
        "worker_id": None,
        "num_workers": None,
        "complete": True,
        "consumed": sorted(consumed),
        "partial": {k: v for k, v in sorted(partial.items()) if k not in consumed},
        "skipped": dict(sorted(skipped.items())),
    }


def _file_problem(path: Path, record: ShardRecord) -> tuple[str, str] | None:
    """(reason, why) when the shard file cannot be the one the manifest lists."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return MISSING_SHARD, f"listed in {MANIFEST_NAME} but missing (delete shards only after training read them)"
    except OSError as e:
        return CORRUPT_SHARD, f"cannot stat it ({e})"
    if size != record.n_bytes:
        return CORRUPT_SHARD, f"{size} bytes on disk, the manifest says {record.n_bytes} (truncated or replaced)"
    return None
