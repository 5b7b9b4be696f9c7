"""One rank's training data as whole optimizer steps (STYLE 7: the source owns its epochs).

`StepSource.next_step()` hands out one optimizer step of `train.grad_accum` micro-batch slots that
every rank agreed on, or a `Halt` (the epochs ran out, or a preemption notice). The trainer loop
never meets an epoch edge: the source crosses epochs itself and reports each epoch's end as an
`EpochEnd` record riding on the next step (or halt).

Lock-step: before each slot the ranks all-reduce (SUM) one small vector: how many have a
micro-batch ready, are waiting for the capture, or are dry (their share of the epoch is read),
the preemption notices, the samples each rank could not read so far, the ready batch's samples,
the capture's skipped samples (rank 0 reads them) and the ranks whose reading failed. Nobody
waits inside a collective for data (a gloo/NCCL collective would time out while a slow capture
writes the next shard): while a rank waits, all poll again after POLL_S.
- a notice on any rank: every rank halts at the same slot; nothing of the open step counts, and
  the position stays that of the last handed-out step (it is committed only with a whole step,
  so a preemption needs no rewind: the resumed run reads the open step's samples again);
- every rank dry: the epoch ends. A step already begun is handed out short (its remaining slots
  empty on every rank), so a step never spans two epochs and the epoch's last samples are
  trained; the epoch is closed when the next step is asked for;
- a rank could not read what it needs (its stream's position, its reader thread's error, rank 0's
  reading of a skipped.jsonl; at an epoch's end, the finished manifest): every rank raises at the
  same slot, the failed rank its own error, the others `PeerDataError` carrying its text (raised
  before the all-reduce, such an error left the peers waiting in it for as long as the failed
  rank's process lived);
- some ranks dry, others ready: the dry ranks fill the slot with an empty micro-batch (`Step.pads`)
  and the others train theirs, so a rank whose shards held more samples trains its remainder
  instead of dropping it. The trainer scales each real micro-batch's loss so the step's gradient
  is the mean over the step's real micro-batches (`Step.real_all`).

Every sample of an epoch's shards is thus trained once or counted as lost (a missing, truncated
or corrupt shard, a sample whose features are not finite); `EpochEnd` says both. The run's loss
is one total against one budget: the samples no rank could read plus those the capture skipped,
non-finite or with an empty regenerated response (each epoch's directory's skipped.jsonl, which
never reach a manifest; under keep every epoch re-reads epoch 0's shards and so misses its
skipped samples again), against `data.max_lost_fraction` of the samples the run was meant to
train on (planned per epoch x epochs). Over it, every rank raises `DataLost` at the same slot,
naming both parts and what this rank could not read (checking each part alone let a run lose up
to twice the fraction).

Epoch 0 follows the manifest while capture still writes it; later epochs re-read the finished
manifest in a shard order seeded by (run.seed, epoch) (shard_reader.ShardStream), or, when they
are captured again (`capture.later_epochs: recapture`), follow their own directory
`epoch_<e>/` as epoch 0 follows the root (data_pipeline/epoch_dirs.py). The source also releases
what a published checkpoint covers (`release`: the disk budget of every epoch's directory).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from data_pipeline.disk_budget import BufferPolicy, release_consumed
from data_pipeline.epoch_dirs import epoch_dir
from data_pipeline.ledger import read_skipped
from data_pipeline.records import SKIPPED_NAME
from data_pipeline.shard_reader import ShardStream, merge_reader_states, read_manifest
from dflash_dist.config import Config
from dflash_dist.trainer.batching import (
    DRY,
    READY,
    WAITING,
    MicroBatch,
    MicroBatchFeeder,
    make_micro_batch,
    with_positions,
)
from dflash_dist.trainer.collectives import PeerError, all_reduce_or_stop

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.02  # how often waiting ranks re-check each other's data readiness
STATE_VERSION = 1
# the per-slot all-reduce vector: [ready, waiting, dry, SIGTERM, SIGUSR1, lost so far, batch samples,
# capture-skipped so far (rank 0's reading of the skipped.jsonl files; 0 from the others),
# ranks that could not read (1 from a rank whose status or reading raised)]
_VEC_LEN = 9
_FAILED = _VEC_LEN - 1  # the last entry: all_reduce_or_stop sets it
_NOTICES = ("SIGTERM", "SIGUSR1")


class DataLost(RuntimeError):
    """More samples were lost (unreadable, or skipped by the capture) than data.max_lost_fraction allows."""


class PeerDataError(PeerError):
    """Another rank could not read its data at this slot (its own error names the file and the fix);
    this rank stops with it instead of waiting for that rank in the next collective."""


@dataclass(frozen=True)
class EpochEnd:
    """An epoch's accounting over all ranks: every sample of its shards was trained or lost."""

    epoch: int
    trained: int  # samples trained in the epoch
    lost: int  # samples that could not be read (missing/corrupt shard, non-finite features)
    total: int  # samples the epoch's shards hold


@dataclass(frozen=True)
class Step:
    """One optimizer step of this rank. `batches` are its real micro-batches; `pads` empty slots
    (this rank had run dry, or the epoch ended mid-step) are filled with a zero-weight batch."""

    epoch: int
    batches: tuple[MicroBatch, ...]
    pads: int
    real_all: int  # real micro-batches of the step over all ranks
    samples_all: int  # samples of the step over all ranks
    epoch_ends: tuple[EpochEnd, ...] = ()  # epochs closed before this step began


@dataclass(frozen=True)
class Halt:
    """No step: `notice` names the agreed preemption signal, or None when the epochs ran out."""

    notice: str | None
    epoch_ends: tuple[EpochEnd, ...] = ()


@dataclass(frozen=True)
class _Slot:
    ready: int
    waiting: int
    dry: int
    notice: str | None
    lost: int  # samples of the open epoch no rank could read, so far
    samples: int  # samples of the micro-batches the ready ranks take in this slot
    capture_lost: int  # samples the capture skipped, over the epochs up to the open one (rank 0's count)
    mine: int  # this rank's status in the slot (READY, WAITING, DRY): what it does in it, not asked again


class StepSource:
    """The shard stream of the current epoch on one rank, the lock-step protocol around it, and
    its position (state_dict / load_state_dict / for_world)."""

    def __init__(
        self, cfg: Config, shard_dir: str, provenance: Any, rank: int, world: int, dtype: torch.dtype,
        group: Any = None, planned_samples: int | None = None, recapture: bool = False,
    ) -> None:  # fmt: skip
        self.cfg, self.shard_dir, self.provenance = cfg, shard_dir, provenance  # shard_dir: the tree's root
        self.recapture = recapture  # epochs >= 1 in epoch_<e>/, each read once as it is captured
        self.rank, self.world, self.dtype, self.group = rank, world, dtype, group
        self.grad_accum = cfg.train.grad_accum
        self.pack_tokens = cfg.pack_tokens()  # train.packing: one row of this many tokens per micro-batch
        self.planned = planned_samples  # samples per epoch the LR schedule was planned over
        # the position, committed with every step handed out
        self.epoch = 0
        self.reader: dict[str, Any] | None = None  # this rank's stream position (None: epoch start)
        self.trained = 0  # this rank's samples trained in the epoch
        self.carried = 0  # samples all ranks trained in the epoch before an elastic resume
        self.lost_before = 0  # samples lost in finished epochs (all ranks)
        self.lost_epoch = 0  # samples lost in the open epoch so far (all ranks, as of the last slot)
        self.capture_lost = 0  # samples the capture skipped, epochs up to the open one (as of the last slot)
        self._skipped = _SkippedCount()  # rank 0 reads the capture's skipped.jsonl files
        self._feeder: MicroBatchFeeder | None = None

    # ------------------------------------------------------------------ steps
    @property
    def finished(self) -> bool:
        return self.epoch >= self.cfg.train.epochs

    def next_step(self, signum: int = 0) -> Step | Halt:
        """The next whole step once every rank agreed on each of its slots. `signum`: this rank's
        pending preemption notice (0: none)."""
        ends: list[EpochEnd] = []
        batches: list[MicroBatch] = []
        pads = real_all = samples_all = 0
        while len(batches) + pads < self.grad_accum:
            if self.finished:
                return Halt(None, tuple(ends))
            slot = self._agree(signum)
            feeder = self._open()  # opened by _agree
            if slot.notice is not None:
                return Halt(slot.notice, tuple(ends))
            if slot.dry == self.world:
                if batches or pads:  # the epoch ended inside this step: it is handed out short
                    pads = self.grad_accum - len(batches)
                    break
                ends.append(self._close_epoch(feeder))
                continue
            if slot.mine == READY:  # asked again, a reader error since would raise on this rank alone
                batches.append(feeder.take())
            else:
                pads += 1
            real_all += slot.ready
            samples_all += slot.samples
        self._commit(batches)
        return Step(self.epoch, tuple(batches), pads, real_all, samples_all, tuple(ends))

    def _open(self) -> MicroBatchFeeder:
        if self._feeder is not None:
            return self._feeder
        stop = threading.Event()
        stream = ShardStream(
            self.epoch_dir(), self.provenance, self.rank, self.world, poll_s=0.5, stop_when=stop.is_set,
            epoch=self.epoch, seed=self.cfg.run.seed, shuffle=self.cfg.train.shuffle, follow=self.recapture,
        )  # fmt: skip
        if self.reader is not None:  # resuming inside this epoch
            stream.load_state_dict(self.reader)
        build = functools.partial(
            make_micro_batch, dtype=self.dtype, num_anchors=self.cfg.train.num_anchors, seed=self.cfg.run.seed,
            epoch=self.epoch, anchor_rule=self.cfg.train.anchor_rule, pack_tokens=self.pack_tokens,
        )  # fmt: skip
        self._feeder = MicroBatchFeeder(
            with_positions(stream), self.cfg.train.micro_batch_size, build, stop=stop,
            micro_batch_tokens=self.pack_tokens or self.cfg.train.micro_batch_tokens,
            packed=self.pack_tokens is not None, keep_short=True,
        )  # fmt: skip
        return self._feeder

    def _agree(self, signum: int) -> _Slot:
        """Poll until no rank waits for data (or a notice came), agreeing on the slot's outcome.
        Opening the epoch's stream (a resumed position), the reader thread's errors and rank 0's
        reading of skipped.jsonl fail inside the agreement, so every rank raises at this slot."""
        while True:
            vec = torch.zeros(_VEC_LEN, dtype=torch.int64)
            if signum:
                name = _signal_name(signum)
                vec[3 + _NOTICES.index(name)] = 1
            status = self._all_reduce_or_stop(vec, self._read_slot)
            ready, waiting, dry, term, usr1, lost, samples, capture_lost = (int(x) for x in vec[:_FAILED])
            notice = _NOTICES[0] if term else _NOTICES[1] if usr1 else None
            self.lost_epoch, self.capture_lost = lost, capture_lost
            self._check_lost(self._open())
            if notice is not None or waiting == 0:
                return _Slot(ready, waiting, dry, notice, lost, samples, capture_lost, status)
            time.sleep(POLL_S)

    def _read_slot(self, vec: torch.Tensor) -> int:
        """This rank's part of a slot's vector; its status (READY, WAITING, DRY)."""
        feeder = self._open()
        status = feeder.status()  # raises the reader thread's own error
        # after the status: DRY means the reader ended, so the count is final (read before, it
        # missed a last shard skipped in between, and the last slot is the budget's last check)
        vec[5] = sum(feeder.skipped.values())
        vec[status_index(status)] = 1
        vec[6] = len(feeder.peek().keys) if status == READY else 0
        vec[7] = self.capture_skipped() if self.rank == 0 else 0
        return status

    def _all_reduce_or_stop(self, vec: torch.Tensor, read: Callable[[torch.Tensor], T]) -> T:
        """`read(vec)` then `vec` all-reduced; a rank whose reading raised stops every rank at this
        slot (collectives.all_reduce_or_stop): the others raise `PeerDataError` with its text."""
        return all_reduce_or_stop(vec, read, self.group, self._peer_failed)

    def _peer_failed(self, failed: str) -> PeerDataError:
        return PeerDataError(
            f"rank {self.rank} stops at epoch {self.epoch} because another rank could not read its "
            f"data ({failed}); fix what that error names, then continue with --resume auto"
        )

    def _check_lost(self, feeder: MicroBatchFeeder) -> None:
        """The run's lost samples, unreadable plus skipped by the capture, against one budget.
        Every rank sees the same totals, so every rank raises at the same slot."""
        unread, capture_lost, lost = self.unreadable, self.capture_lost, self.lost
        if lost == 0:
            return
        fraction = self.cfg.data.max_lost_fraction
        planned = (self.planned or 0) * self.cfg.train.epochs
        allowed = math.floor(fraction * planned) if planned else 0
        if lost <= allowed:
            return
        own = feeder.problems
        mine = "; ".join(own[:5]) + (f" (+{len(own) - 5} more)" if len(own) > 5 else "") if own else "none here"
        err = DataLost(
            f"{unread} sample(s) could not be read and {capture_lost} were skipped by the capture (non-finite "
            f"features or an empty regenerated response, by reason in {SKIPPED_NAME} under {self.shard_dir}): {lost} "
            f"lost, more than data.max_lost_fraction={fraction} of the {planned} the run trains on allows "
            f"({allowed}). Rank {self.rank} could not read: {mine}. Restore or re-extract the shards (and --resume "
            f"auto), check the target's dtype and kernels (or its chat template and stop tokens), or raise "
            f"data.max_lost_fraction"
        )
        err.names_nothing = not own  # every rank raises; the group reports one that names the samples
        raise err

    @property
    def unreadable(self) -> int:
        """Samples no rank could read since step 0 (all ranks, as of the last slot)."""
        return self.lost_before + self.lost_epoch

    @property
    def lost(self) -> int:
        """The samples data.max_lost_fraction holds against the run: unreadable plus those the
        capture skipped, counted once per epoch that reads their directory."""
        return self.unreadable + self.capture_lost

    def lost_scalars(self) -> dict[str, int]:
        """data/lost_samples (what the budget holds) and its two parts, for TensorBoard."""
        return {"data/lost_samples": self.lost, "data/unreadable_samples": self.unreadable,
                "data/capture_skipped_samples": self.capture_lost}  # fmt: skip

    def capture_skipped(self) -> int:
        """Samples the capture skipped (never in a manifest) in the directories of the epochs up to
        the open one (the last, once every epoch is done): under recapture each epoch's own; under
        keep epoch 0's, once per epoch. The open epoch's file may still grow (capture runs
        alongside); it is re-read when it does."""
        last = min(self.epoch, self.cfg.train.epochs - 1)
        return sum(self._skipped.count(self.epoch_dir_of(e)) for e in range(last + 1))

    def settle(self) -> None:
        """The lost-sample counts of a run that agrees no slot (resumed with nothing left to train:
        every epoch done, or train.max_steps reached), as its last slot would have had them: every
        rank's unreadable samples of the open epoch from its resumed position, and rank 0's reading
        of skipped.jsonl. Without it such a run reported the unreadable samples of finished epochs
        alone. All ranks call it together; a reading error stops every rank, as in a slot."""
        vec = torch.zeros(3, dtype=torch.int64)  # [open epoch's unreadable, capture-skipped, failed ranks]

        def read(vec: torch.Tensor) -> None:
            vec[0] = self._resumed_skipped()
            vec[1] = self.capture_skipped() if self.rank == 0 else 0

        self._all_reduce_or_stop(vec, read)
        self.lost_epoch, self.capture_lost = int(vec[0]), int(vec[1])

    def _resumed_skipped(self) -> int:
        """This rank's share of the open epoch's unreadable samples in its position: its own
        stream's count, or a merged position's (for_world) on rank 0 alone, as the stream loads it."""
        if self.finished or self.reader is None:
            return 0
        own = (self.reader.get("rank"), self.reader.get("world_size")) == (self.rank, self.world)
        if not own and not (self.rank == 0 and self.reader.get("complete")):
            return 0
        return sum(int(n) for n in self.reader.get("skipped", {}).values())

    def _commit(self, batches: list[MicroBatch]) -> None:
        """The position after the step just handed out. A rank that ran dry takes its stream's
        end (trailing unreadable samples included), so a resume does not count them twice."""
        if batches:
            self.reader = batches[-1].reader_state
            self.trained += sum(len(b.keys) for b in batches)
        elif self._feeder is not None and self._feeder.end_state is not None:
            self.reader = self._feeder.end_state

    def _close_epoch(self, feeder: MicroBatchFeeder) -> EpochEnd:
        """All ranks: the epoch's totals; the next epoch starts at its beginning. Each rank reads
        the finished manifest before the counts' all-reduce, whose third entry says whether a rank
        could not: read after it, an error there (one node's I/O) left the peers in the next slot's."""
        counts = torch.tensor([self.trained, sum(feeder.skipped.values()), 0], dtype=torch.int64)
        self.close()
        total = self._all_reduce_or_stop(  # final: every stream saw DONE
            counts, lambda _: sum(r.n_samples for r in read_manifest(self.epoch_dir()))
        )
        trained, lost = int(counts[0]) + self.carried, int(counts[1])
        end = EpochEnd(self.epoch, trained, lost, total)
        if trained + lost != total:
            raise RuntimeError(f"epoch {self.epoch}: {trained} trained + {lost} lost != {total} samples in "
                               f"{self.epoch_dir()}/manifest.jsonl: a sample was trained twice or never")  # fmt: skip
        self.epoch += 1
        self.reader, self.trained, self.carried = None, 0, 0
        self.lost_before += lost
        self.lost_epoch = 0
        return end

    def epoch_dir(self) -> Path:
        """The directory the open epoch's shards are in."""
        return self.epoch_dir_of(self.epoch)

    def epoch_dir_of(self, epoch: int) -> Path:
        return epoch_dir(self.shard_dir, epoch, self.recapture)

    def release(self, reader_states: list[dict[str, Any] | None]) -> list[str]:
        """After a checkpoint is published (rank 0, with every rank's reader state at it): release
        the shards it covers to the disk budget (deleted where the policy says; disk_budget.py)."""
        policy = BufferPolicy.from_config(self.cfg, self.recapture)
        return release_consumed(self.shard_dir, policy, reader_states, self.epoch)

    def close(self) -> None:
        """Stop the reader thread (at an epoch end, and when training stops)."""
        if self._feeder is not None:
            self._feeder.close()
            self._feeder = None

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "reader": self.reader,
            "trained": self.trained,
            "carried": self.carried,
            "lost_before": self.lost_before,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"step source state version {state.get('version') if isinstance(state, dict) else state!r}"
                             f" != {STATE_VERSION}: saved by another code version; resume with it or start fresh")
        self.close()
        self.epoch, self.reader = int(state["epoch"]), state["reader"]
        self.trained, self.carried = int(state["trained"]), int(state["carried"])
        self.lost_before = int(state["lost_before"])

    @staticmethod
    def for_world(saved: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
        """`rank`'s state at `world` ranks from every rank's state of a checkpoint saved at another
        world size: the epoch and lost count (equal on every rank), the samples trained so far in
        the epoch carried as one count, and the stream position merged from every saved rank's
        (shard_reader.merge_reader_states), which any rank of any world size loads."""
        first = saved[0]
        for key in ("epoch", "lost_before", "carried"):
            values = {int(s[key]) for s in saved}
            assert len(values) == 1, (key, values)
        readers = [s["reader"] for s in saved]
        if len(saved) == world:
            reader = readers[rank]
        elif all(r is None for r in readers):
            reader = None
        else:
            assert all(r is not None for r in readers), "after a step every rank has a position"
            reader = merge_reader_states(readers)
        return {
            "version": STATE_VERSION,
            "epoch": int(first["epoch"]),
            "reader": reader,
            "trained": 0 if len(saved) != world else int(saved[rank]["trained"]),
            "carried": int(first["carried"]) + (sum(int(s["trained"]) for s in saved) if len(saved) != world else 0),
            "lost_before": int(first["lost_before"]),
        }


class _SkippedCount:
    """Records in each directory's skipped.jsonl (append-only), re-read only when its size changed:
    rank 0 asks at every slot."""

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[int, int]] = {}  # directory -> (file size, records)

    def count(self, shard_dir: Path) -> int:
        try:
            size = (shard_dir / SKIPPED_NAME).stat().st_size
        except FileNotFoundError:
            return 0
        seen = self._seen.get(shard_dir)
        if seen is None or seen[0] != size:
            seen = (size, len(read_skipped(shard_dir)))
            self._seen[shard_dir] = seen
        return seen[1]


def status_index(status: int) -> int:
    """The all-reduce vector's index of a feeder status."""
    return {READY: 0, WAITING: 1, DRY: 2}[status]


def _signal_name(signum: int) -> str:
    import signal

    name = signal.Signals(signum).name
    if name not in _NOTICES:
        raise ValueError(f"not a preemption notice: {name}")
    return name
