"""Bounded disk between capture and training.

Unconsumed bytes = the sizes of complete shards (manifest.jsonl) not yet released. A shard is
released once it was trained and a published checkpoint covers it, so a resume from the latest
checkpoint never needs it: trainer rank 0 calls `release_consumed` after each publish, with
every rank's reader state (their `consumed` shard names). Released shards are deleted when the
policy says so (one epoch from one capture), else kept and no longer counted.

Producers call a `BufferGate` before opening each new shard: it waits while unconsumed bytes
are at or above the cap. The directory thus holds at most the cap plus one shard in flight per
producer. A gate that waits `stall_s` without any release raises BufferStalled (the trainer
cannot reach its next checkpoint on what the cap lets through) instead of hanging.
`buffer.json` (cap, unconsumed, on-disk bytes, shard counts) is rewritten by both sides for
`dflash-dist status`.

The cap is over the whole shard tree (epoch_dirs.py): the root and, under `later_epochs:
recapture`, every `epoch_<e>/` directory plus the token store (never released: it is read by
every later epoch), so the tree stays within the cap plus one shard per producer for any number
of epochs. Under recapture every released shard is deleted (no later epoch re-reads it): a
checkpoint at epoch e releases all of the earlier epochs' shards and those of epoch e that any
rank's reader finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.durable_files import fsync_dir, write_text_atomic
from data_pipeline.epoch_dirs import epoch_dirs, sequences_dir
from data_pipeline.records import BUFFER_NAME, RELEASED_NAME, ShardRecord, check_shard_name
from data_pipeline.shard_reader import ManifestFollower, read_manifest
from data_pipeline.token_store import read_store

WRITE, WAIT, STALLED = "write", "wait", "stalled"


class BufferStalled(RuntimeError):
    """The capture waited for released shards for longer than the configured stall limit."""


@dataclass(frozen=True)
class BufferPolicy:
    cap_bytes: int | None  # None: unbounded
    delete_consumed: bool
    stall_s: float
    poll_s: float = 0.5
    recapture: bool = False  # later epochs captured again into epoch_<e>/ (released shards always deleted)

    @classmethod
    def from_config(cls, cfg: Any, recapture: bool = False) -> BufferPolicy:
        """From a run config (`capture.max_buffer_bytes`, `capture.consumed_shards`, `train.epochs`) and
        the run's resolved later-epochs mode. auto deletes released shards under a cap for a single
        epoch, and always when later epochs are captured again."""
        c = cfg.capture
        if recapture:
            delete = True
        elif c.consumed_shards == "auto":
            delete = c.max_buffer_bytes is not None and cfg.train.epochs == 1
        else:
            delete = c.consumed_shards == "delete"
        return cls(c.max_buffer_bytes, delete, float(c.buffer_stall_s), recapture=recapture)


@dataclass(frozen=True)
class BufferStatus:
    cap_bytes: int | None
    unconsumed_bytes: int  # complete, not released: what counts against the cap
    on_disk_bytes: int  # complete shard files present (released ones included when kept)
    shards_listed: int
    shards_released: int
    shards_deleted: int
    delete_consumed: bool


def read_released(shard_dir: str | os.PathLike[str]) -> set[str]:
    path = Path(shard_dir) / RELEASED_NAME
    try:
        names = json.loads(path.read_text())["released"]
    except FileNotFoundError:
        return set()
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a released-shards record ({e}); it is written only by the trainer") from None
    if not isinstance(names, list):
        raise ValueError(f"{path}: `released` must be a list of shard names; it is written only by the trainer")
    return {check_shard_name(name, str(path)) for name in names}  # names it may delete: plain shard names only


def buffer_status(
    shard_dir: Path, policy: BufferPolicy, records: Iterable[ShardRecord], released: set[str]
) -> BufferStatus:
    unconsumed = on_disk = listed = n_released = deleted = 0
    present = set(os.listdir(shard_dir)) if shard_dir.is_dir() else set()
    for r in records:
        listed += 1
        if r.name in released:
            n_released += 1
        else:
            unconsumed += r.n_bytes
        if r.name in present:
            on_disk += r.n_bytes
        else:
            deleted += 1
    return BufferStatus(policy.cap_bytes, unconsumed, on_disk, listed, n_released, deleted, policy.delete_consumed)


def _summed(parts: list[BufferStatus], policy: BufferPolicy) -> BufferStatus:
    total = [
        sum(getattr(p, f) for p in parts)
        for f in ("unconsumed_bytes", "on_disk_bytes", "shards_listed", "shards_released", "shards_deleted")
    ]
    return BufferStatus(policy.cap_bytes, *total, policy.delete_consumed)


def store_status(root: Path, policy: BufferPolicy) -> BufferStatus:
    """The token store (recapture): counted against the cap, never released."""
    nbytes = sum(r.n_bytes for r in read_store(sequences_dir(root)))
    return BufferStatus(policy.cap_bytes, nbytes, nbytes, 0, 0, 0, policy.delete_consumed)


def tree_status(root: str | os.PathLike[str], policy: BufferPolicy) -> BufferStatus:
    """The buffer over every epoch directory under `root` and the token store."""
    root = Path(root)
    parts = [buffer_status(d, policy, read_manifest(d), read_released(d)) for _, d in epoch_dirs(root)]
    return _summed([*parts, store_status(root, policy)], policy)


def write_buffer_json(shard_dir: Path, status: BufferStatus) -> None:
    record = {**dataclasses.asdict(status), "updated_unix": time.time()}
    write_text_atomic(shard_dir / BUFFER_NAME, json.dumps(record, sort_keys=True) + "\n")


def room_decision(unconsumed_bytes: int, cap_bytes: int | None, waited_s: float, stall_s: float) -> str:
    """WRITE a new shard, WAIT for releases, or STALLED (waited `stall_s` with no release)."""
    if cap_bytes is None or unconsumed_bytes < cap_bytes:
        return WRITE
    return STALLED if waited_s >= stall_s else WAIT


def consumed_shards(
    reader_states: Iterable[dict[str, Any] | None],
    epoch: int,
    records: Iterable[ShardRecord],
    reader_epoch: int | None = None,
) -> set[str]:
    """Shards of one directory a checkpoint at `epoch` no longer needs: after the directory's
    first reading every shard (it read them all); inside it, those any rank's reader finished
    (`reader_epoch`: the readers' epoch when it is not `epoch`, an epoch directory of recapture
    read once, as epoch 0 is)."""
    if epoch >= 1:
        return {r.name for r in records}
    names: set[str] = set()
    for state in reader_states:
        if state is not None:
            want = epoch if reader_epoch is None else reader_epoch
            assert state["epoch"] == want, (state["epoch"], want)
            names.update(state["consumed"])
    return names


def release_consumed(
    shard_dir: str | os.PathLike[str], policy: BufferPolicy, reader_states: list[dict[str, Any] | None], epoch: int
) -> list[str]:
    """After a checkpoint is published: add its consumed shards to released.json, delete the
    released ones still on disk if the policy says so, rewrite buffer.json. Returns the deleted
    names (under recapture as `epoch_<e>/<name>` for later epochs). Idempotent (a crash between the
    record and the deletes is repaired next time). Without a cap and with shards kept there is
    nothing to account: a no-op (the shard directory may then be read-only to the trainer).
    `shard_dir`: the tree's root; `epoch` and `reader_states`: the checkpoint's."""
    if policy.cap_bytes is None and not policy.delete_consumed:
        return []
    root = Path(shard_dir)
    if not policy.recapture:
        deleted = _release_dir(root, policy, consumed_shards(reader_states, epoch, read_manifest(root)))
        write_buffer_json(root, buffer_status(root, policy, read_manifest(root), read_released(root)))
        return deleted
    deleted = []
    for e, d in epoch_dirs(root):
        if e > epoch:
            continue
        records = read_manifest(d)
        names = {r.name for r in records} if e < epoch else consumed_shards(reader_states, 0, records, e)
        deleted += [name if e == 0 else f"{d.name}/{name}" for name in _release_dir(d, policy, names)]
    write_buffer_json(root, tree_status(root, policy))
    return deleted


def _release_dir(shard_dir: Path, policy: BufferPolicy, consumed: set[str]) -> list[str]:
    """Released shards are deleted (if the policy says so) before released.json names them, so a
    producer's gate never counts a shard as released while its bytes are still on disk."""
    records = read_manifest(shard_dir)
    listed = {r.name for r in records}
    before = read_released(shard_dir)
    released = before | (consumed & listed)
    deleted = []
    if policy.delete_consumed:
        for name in sorted(released):
            path = shard_dir / name
            if path.exists():
                path.unlink()
                deleted.append(name)
        if deleted:
            fsync_dir(shard_dir)
    if released != before:
        write_text_atomic(shard_dir / RELEASED_NAME, json.dumps({"released": sorted(released)}) + "\n")
    return deleted


class BufferAbandoned(RuntimeError):
    """The producer a gate serves must stop instead of waiting (`BufferGate(abandon=...)` said why)."""


class BufferGate:
    """A producer's `ShardWriter(before_open=...)`: returns when the buffer has room, waits
    while it is full, raises BufferStalled after `policy.stall_s` without a release. It counts the
    whole tree under `shard_dir` (the root): every epoch directory and the token store. `abandon`,
    asked on entry and at every poll: None, or why the producer must stop now (BufferAbandoned),
    e.g. a capture writer process whose capture process died: left waiting, it would write its
    shard after the restarted capture read its ledger, and those samples would be captured twice."""

    def __init__(self, shard_dir: str | os.PathLike[str], policy: BufferPolicy,
                 abandon: Callable[[], str | None] | None = None) -> None:
        self.shard_dir, self.policy, self.abandon = Path(shard_dir), policy, abandon
        self._followers: dict[Path, ManifestFollower] = {}
        self._records: dict[Path, list[ShardRecord]] = {}
        self.waited_s = 0.0  # total time this producer spent waiting for room
        self.waiting = False

    def status(self) -> BufferStatus:
        parts = []
        for _, d in epoch_dirs(self.shard_dir):
            if d not in self._followers:
                self._followers[d], self._records[d] = ManifestFollower(d), []
            self._records[d] += self._followers[d].poll()
            parts.append(buffer_status(d, self.policy, self._records[d], read_released(d)))
        if self.policy.recapture:
            parts.append(store_status(self.shard_dir, self.policy))
        return parts[0] if len(parts) == 1 else _summed(parts, self.policy)

    def __call__(self, pending: int = 0) -> None:
        """Return once the unconsumed bytes plus `pending` (a small file about to be written and
        listed whole, e.g. a token-store tar) are under the cap."""
        status = self.status()
        write_buffer_json(self.shard_dir, status)
        since = last = time.monotonic()
        released = status.shards_released
        while True:
            if self.abandon is not None and (why := self.abandon()):
                raise BufferAbandoned(f"{self.shard_dir}: {why}")
            now = time.monotonic()
            decision = room_decision(
                status.unconsumed_bytes + pending, self.policy.cap_bytes, now - since, self.policy.stall_s
            )
            if decision == WRITE:
                self.waiting = False
                return
            if decision == STALLED:
                raise BufferStalled(
                    f"{self.shard_dir}: {status.unconsumed_bytes} unconsumed shard bytes >= capture.max_buffer_bytes="
                    f"{self.policy.cap_bytes} and no shard was released for {self.policy.stall_s:.0f} s "
                    "(capture.buffer_stall_s): the trainer cannot reach its next checkpoint on what the cap lets "
                    "through, or no trainer is consuming; raise capture.max_buffer_bytes or lower "
                    "train.checkpoint_every"
                )
            self.waiting = True
            time.sleep(self.policy.poll_s)
            self.waited_s += time.monotonic() - last
            last = time.monotonic()
            status = self.status()
            if status.shards_released != released:  # progress: the stall clock starts again
                released, since = status.shards_released, time.monotonic()
                write_buffer_json(self.shard_dir, status)
