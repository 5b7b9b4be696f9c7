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
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.durable_files import fsync_dir, write_text_atomic
from data_pipeline.records import BUFFER_NAME, RELEASED_NAME, ShardRecord, check_shard_name
from data_pipeline.shard_reader import ManifestFollower, read_manifest

WRITE, WAIT, STALLED = "write", "wait", "stalled"


class BufferStalled(RuntimeError):
    """The capture waited for released shards for longer than the configured stall limit."""


@dataclass(frozen=True)
class BufferPolicy:
    cap_bytes: int | None  # None: unbounded
    delete_consumed: bool
    stall_s: float
    poll_s: float = 0.5

    @classmethod
    def from_config(cls, cfg: Any) -> BufferPolicy:
        """From a run config (`capture.max_buffer_bytes`, `capture.consumed_shards`, `train.epochs`).
        auto deletes released shards only under a cap and for a single epoch."""
        c = cfg.capture
        if c.consumed_shards == "auto":
            delete = c.max_buffer_bytes is not None and cfg.train.epochs == 1
        else:
            delete = c.consumed_shards == "delete"
        return cls(c.max_buffer_bytes, delete, float(c.buffer_stall_s))


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
    present = set(os.listdir(shard_dir))
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


def write_buffer_json(shard_dir: Path, status: BufferStatus) -> None:
    record = {**dataclasses.asdict(status), "updated_unix": time.time()}
    write_text_atomic(shard_dir / BUFFER_NAME, json.dumps(record, sort_keys=True) + "\n")


def room_decision(unconsumed_bytes: int, cap_bytes: int | None, waited_s: float, stall_s: float) -> str:
    """WRITE a new shard, WAIT for releases, or STALLED (waited `stall_s` with no release)."""
    if cap_bytes is None or unconsumed_bytes < cap_bytes:
        return WRITE
    return STALLED if waited_s >= stall_s else WAIT


def consumed_shards(
    reader_states: Iterable[dict[str, Any] | None], epoch: int, records: Iterable[ShardRecord]
) -> set[str]:
    """Shards a checkpoint at `epoch` no longer needs: after the first epoch every shard (the
    first epoch read them all); inside it, those any rank's reader finished."""
    if epoch >= 1:
        return {r.name for r in records}
    names: set[str] = set()
    for state in reader_states:
        if state is not None:
            assert state["epoch"] == epoch, (state["epoch"], epoch)
            names.update(state["consumed"])
    return names


def release_consumed(
    shard_dir: str | os.PathLike[str], policy: BufferPolicy, reader_states: list[dict[str, Any] | None], epoch: int
) -> list[str]:
    """After a checkpoint is published: add its consumed shards to released.json, delete the
    released ones still on disk if the policy says so, rewrite buffer.json. Returns the deleted
    names. Idempotent (a crash between the record and the deletes is repaired next time).
    Without a cap and with shards kept there is nothing to account: a no-op (the shard
    directory may then be read-only to the trainer)."""
    if policy.cap_bytes is None and not policy.delete_consumed:
        return []
    shard_dir = Path(shard_dir)
    records = read_manifest(shard_dir)
    listed = {r.name for r in records}
    before = read_released(shard_dir)
    released = before | (consumed_shards(reader_states, epoch, records) & listed)
    if released != before:
        write_text_atomic(shard_dir / RELEASED_NAME, json.dumps({"released": sorted(released)}) + "\n")
    deleted = []
    if policy.delete_consumed:
        for name in sorted(released):
            path = shard_dir / name
            if path.exists():
                path.unlink()
                deleted.append(name)
        if deleted:
            fsync_dir(shard_dir)
    write_buffer_json(shard_dir, buffer_status(shard_dir, policy, records, released))
    return deleted


class BufferGate:
    """A producer's `ShardWriter(before_open=...)`: returns when the buffer has room, waits
    while it is full, raises BufferStalled after `policy.stall_s` without a release."""

    def __init__(self, shard_dir: str | os.PathLike[str], policy: BufferPolicy) -> None:
        self.shard_dir, self.policy = Path(shard_dir), policy
        self._follower = ManifestFollower(self.shard_dir)
        self._records: list[ShardRecord] = []
        self.waited_s = 0.0  # total time this producer spent waiting for room
        self.waiting = False

    def status(self) -> BufferStatus:
        self._records += self._follower.poll()
        return buffer_status(self.shard_dir, self.policy, self._records, read_released(self.shard_dir))

    def __call__(self) -> None:
        status = self.status()
        write_buffer_json(self.shard_dir, status)
        since = last = time.monotonic()
        released = status.shards_released
        while True:
            now = time.monotonic()
            decision = room_decision(status.unconsumed_bytes, self.policy.cap_bytes, now - since, self.policy.stall_s)
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
