"""One rank's micro-batches, in lock-step with its peers.

Before every micro-batch the ranks all-reduce (MIN) whether each has one ready, wait together
while the capture is still producing, and end the epoch together when any rank runs dry (the
remainder is counted as dropped). The same all-reduce carries a preemption notice (MAX of the
signal numbers), so every rank sees it at the same micro-batch. Epoch 0 streams shards while
they are written; later epochs re-read the finished manifest in a shard order seeded by
(run.seed, epoch) (shard_reader.ShardStream).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline.shard_reader import ShardStream, assigned_shards, read_manifest
from dflash_dist.config import Config
from dflash_dist.trainer.batching import DRY, READY, MicroBatch, MicroBatchFeeder, make_micro_batch, with_positions
from dflash_dist.trainer.state import TrainState

POLL_S = 0.02  # how often waiting ranks re-check each other's data readiness


@dataclass(frozen=True)
class EpochEnd:
    """An epoch's accounting: every assigned sample was trained, skipped or dropped."""

    trained_all: int  # samples all ranks trained in the epoch
    skipped_all: int  # unreadable (corrupt/missing shard, non-finite features), all ranks
    dropped_all: int  # left when some rank ran dry, all ranks
    dropped: int  # of those, this rank's


class EpochData:
    """The shard stream of the current epoch on one rank and the lock-step protocol around it."""

    def __init__(self, cfg: Config, shard_dir: str, provenance, rank: int, world: int, dtype: torch.dtype,
                 group: Any = None) -> None:  # fmt: skip
        self.cfg, self.shard_dir, self.provenance = cfg, shard_dir, provenance
        self.rank, self.world, self.dtype, self.group = rank, world, dtype, group
        self._feeder: MicroBatchFeeder | None = None
        self.pack_tokens = cfg.pack_tokens()  # train.packing: one row of this many tokens per micro-batch

    def _open(self, state: TrainState) -> MicroBatchFeeder:
        stop = threading.Event()
        stream = ShardStream(
            self.shard_dir,
            self.provenance,
            self.rank,
            self.world,
            poll_s=0.5,
            stop_when=stop.is_set,
            epoch=state.epoch,
            seed=self.cfg.run.seed,
            shuffle=self.cfg.train.shuffle,
        )
        if state.reader is not None:  # resuming inside this epoch
            stream.load_state_dict(state.reader)
        build = functools.partial(
            make_micro_batch,
            dtype=self.dtype,
            num_anchors=self.cfg.train.num_anchors,
            seed=self.cfg.run.seed,
            epoch=state.epoch,
            anchor_rule=self.cfg.train.anchor_rule,
            pack_tokens=self.pack_tokens,
        )
        return MicroBatchFeeder(
            with_positions(stream),
            self.cfg.train.micro_batch_size,
            build,
            stop=stop,
            micro_batch_tokens=self.pack_tokens or self.cfg.train.micro_batch_tokens,
            packed=self.pack_tokens is not None,
        )

    def next(self, state: TrainState, signum: int) -> MicroBatch | int | None:
        """The next micro-batch (on the host) once every rank has one; None when any rank ran
        dry; a signal number when any rank got a preemption notice (`signum`: this rank's, or
        0). Polls with short collectives instead of blocking in one while capture writes."""
        if state.epoch_exhausted:
            return None
        if self._feeder is None:
            self._feeder = self._open(state)
        flag = torch.zeros(2, dtype=torch.int32)
        while True:
            flag[0], flag[1] = self._feeder.status(), -signum  # MIN of readiness, MAX of signals
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            agreed, notice = int(flag[0]), -int(flag[1])
            if notice:
                return notice
            if agreed == READY:
                return self._feeder.take()
            if agreed == DRY:
                return None
            time.sleep(POLL_S)

    def skipped(self) -> int:
        """This rank's skipped samples in the open epoch so far."""
        return sum(self._feeder.skipped.values()) if self._feeder is not None else 0

    def end_epoch(self, state: TrainState) -> EpochEnd:
        """Every rank stops the epoch together; whatever a rank had left is dropped and counted.

        Per rank: its assigned samples (assigned_shards) = trained + skipped (the stream counts
        them) + dropped (left when another rank ran dry). The epoch's totals are all-reduced,
        plus `epoch_carried` from before an elastic resume. In an epoch begun at another world
        size the shard assignment changed mid-way: there only the total is known, and rank 0
        counts it. Call with the state of the epoch that ends; the caller advances it."""
        if self._feeder is not None:
            skipped = self._feeder.skipped
            self.close()
        else:  # an epoch marked exhausted by a rewind: its counts are in the saved position
            skipped = dict((state.reader or {}).get("skipped", {}))
        manifest = read_manifest(self.shard_dir)  # final: some rank's stream saw DONE
        own = torch.tensor([state.epoch_samples, sum(skipped.values())], dtype=torch.int64)
        total = own.clone()
        dist.all_reduce(total, group=self.group)
        trained_all = int(total[0]) + state.epoch_carried
        skipped_all = int(total[1])
        dropped_all = sum(r.n_samples for r in manifest) - trained_all - skipped_all
        if state.epoch_carried == 0:
            mine = assigned_shards(manifest, state.epoch, self.cfg.run.seed, self.rank, self.world)
            dropped = sum(r.n_samples for r in mine) - int(own[0]) - int(own[1])
        else:
            dropped = dropped_all if self.rank == 0 else 0
        assert dropped >= 0 and dropped_all >= 0, (dropped, dropped_all, state)
        return EpochEnd(trained_all, skipped_all, dropped_all, dropped)

    def close(self) -> None:
        """Stop the reader (also after a rewind: its stream is past the rewound position)."""
        if self._feeder is not None:
            self._feeder.close()
            self._feeder = None
