"""The DeepSpeed drafter trainer: a plain-Python loop (no Ray here; actors/trainer_group.py runs
one per rank after the process group exists).

`Trainer.run()` reads top to bottom: batch -> forward -> backward -> clip + step -> log ->
checkpoint. Ranks stay in lock-step: before every micro-batch they all-reduce (MIN) whether each
has one ready, wait together while the capture is still producing, and end the epoch together
when any rank runs dry (the remainder is counted and logged as data/dropped_samples).
Epoch 0 streams shards while they are written; later epochs re-read the finished manifest.

Checkpoints are DeepSpeed's, published by checkpoint.py only once every rank's files are on
disk. Rank 0 appends every optimizer step's loss to `<out>/train_log.jsonl` (with
train.log_sample_keys, every rank also its trained sample keys to `<out>/sample_log/`); a
resume truncates both to the resumed step, so they are the run's true history.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from data_pipeline.disk_budget import BufferPolicy, release_consumed
from data_pipeline.provenance import Provenance
from data_pipeline.shard_reader import ShardStream, assigned_shards, merge_reader_states, read_manifest
from dflash_dist.config import Config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.export import export_drafter
from dflash_dist.model.loss import Anchors, LossOutput, dflash_loss
from dflash_dist.target.loading import load_embeddings
from dflash_dist.trainer import checkpoint, universal
from dflash_dist.trainer.batching import DRY, READY, MicroBatch, MicroBatchFeeder, make_micro_batch, with_positions
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from dflash_dist.trainer.metrics import Metrics

EXPORT_INDEX = "index.jsonl"
TRAIN_LOG = "train_log.jsonl"  # rank 0: {step, epoch, loss, lr, samples} per optimizer step
SAMPLE_LOG = "sample_log"  # rank_<r>.jsonl: {step, epoch, keys} per micro-batch (train.log_sample_keys)
_STATE_VERSION = 2
_POLL_S = 0.02  # how often waiting ranks re-check each other's data readiness
# a scheduler's notice (Slurm: SIGTERM on preemption/scancel, `--signal=USR1@secs` before the
# time limit): every rank saves a checkpoint at the next step boundary and returns
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LENGTH_BUCKETS = (256, 512, 1024, 2048, 4096)  # train/acc_len_*: accuracy by sample length (tokens)


@dataclass(frozen=True)
class TrainJob:
    """What every rank needs besides the config: small, picklable, the same on all ranks."""

    target_dir: str
    shard_dir: str
    provenance: Provenance  # shards of any other origin are refused
    drafter: DrafterConfig
    total_steps: int  # the LR schedule's length (ds_config.total_train_steps)
    resume_from: str | None = None  # a complete checkpoint tag directory (checkpoint.plan_resume)


@dataclass(frozen=True)
class TrainResult:
    """One rank's outcome."""

    rank: int
    steps: int
    epochs_completed: int
    final_loss: float | None  # the last logged loss (mean over ranks), None if nothing trained
    checkpoints: tuple[str, ...]  # tags saved by this run, e.g. ("step_50", "step_100")
    exports: tuple[str, ...]  # export directories written by this run
    samples_consumed: int  # samples this rank trained on (this run)
    samples_dropped: int  # this rank's epoch remainders (this run)
    resumed_from: str | None = None
    preempted: str | None = None  # the signal's name when a preemption notice ended the run


@dataclass(frozen=True)
class ExportRecord:
    """One line of <out>/export/index.jsonl, appended after the export directory exists."""

    step: int
    epoch: int
    path: str
    checkpoint: str  # the DeepSpeed checkpoint tag saved at the same step
    config_hash: str
    unix_time: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> ExportRecord:
        return cls(**json.loads(line))


def length_bucket_accuracy(
    correct: torch.Tensor, count: torch.Tensor, length: torch.Tensor, edges: tuple[int, ...] = LENGTH_BUCKETS
) -> dict[str, float]:
    """Accuracy over the supervised slots of samples per length bucket (tokens), as
    `train/acc_len_<lo>_<hi>` (the last `train/acc_len_ge_<lo>`); empty buckets are left out."""
    bounds = [0, *edges, None]
    out = {}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (length >= lo) & (length < hi) if hi is not None else length >= lo
        n = float(count[sel].sum())
        if n > 0:
            tag = f"train/acc_len_{lo}_{hi}" if hi is not None else f"train/acc_len_ge_{lo}"
            out[tag] = float(correct[sel].sum()) / n
    return out


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


class TrainForward(nn.Module):
    """The module DeepSpeed wraps: the drafter plus the DFlash loss, so engine(...) runs the
    whole training forward (ZeRO-3 gathers parameters through its module hooks) and returns
    the loss tensor for DeepSpeed's backward hooks next to the full LossOutput."""

    def __init__(self, drafter: DFlashDrafter, label_source: str, gamma: float | None, attention: str) -> None:
        super().__init__()
        self.drafter = drafter
        self.label_source, self.gamma, self.attention = label_source, gamma, attention

    def forward(self, input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep):
        out = dflash_loss(
            self.drafter,
            input_ids,
            features,
            loss_mask,
            Anchors(anchor_positions, anchor_keep),
            target_argmax=target_argmax,
            label_source=self.label_source,
            gamma=self.gamma,
            attention=self.attention,
        )
        return out.loss, out


def build_engine(
    cfg: Config,
    drafter_config: DrafterConfig,
    target_dir: str | Path,
    total_steps: int,
    world_size: int,
    on_gpu: bool,
    load_universal: bool = False,
):
    """The DeepSpeed engine over a fresh drafter sharing the target's frozen embedding/lm_head.
    Every rank seeds identically, so ZeRO-3 partitions come from one initialisation.
    `load_universal`: it will load a universal checkpoint (an elastic resume)."""
    import deepspeed  # imported late: the actor sets DS_ACCELERATOR / CUDA_VISIBLE_DEVICES first

    torch.manual_seed(cfg.run.seed)
    drafter = DFlashDrafter(drafter_config)
    drafter.set_target_weights(*load_embeddings(Path(target_dir)))
    module = TrainForward(drafter, cfg.train.label_source, cfg.train.gamma, cfg.train.attention)
    optimizer = build_optimizer(cfg, module, fused=on_gpu)
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=build_lr_schedule(cfg, optimizer, total_steps),
        config=deepspeed_config(
            cfg, world_size, on_gpu, hidden_size=drafter_config.hidden_size, load_universal=load_universal
        ),
        dist_init_required=False,
    )
    return engine


@dataclass
class _Window:
    """Per-rank sums since the last log, all-reduced when logged. Loss and slot counts stay on
    the compute device (no host sync per micro-batch). Times are host wall-clock from asking
    for the micro-batch to the end of engine.step(): logging and checkpoints are not counted."""

    block_size: int
    device: torch.device
    micro: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    wall_s: float = 0.0
    sums: torch.Tensor = field(init=False)  # [loss, slot_correct x B, slot_count x B]

    def __post_init__(self) -> None:
        self.sums = torch.zeros(1 + 2 * self.block_size, dtype=torch.float64, device=self.device)

    # per sample (diagnostics): [b, 4] rows of (loss, correct, count, length), on the device
    samples: list[torch.Tensor] = field(default_factory=list)

    def add(self, batch: MicroBatch, out: LossOutput, wait_s: float, wall_s: float) -> None:
        self.micro += 1
        self.tokens += batch.num_tokens
        self.wait_s += wait_s
        self.wall_s += wall_s
        step = torch.cat([out.loss.detach().reshape(1), out.slot_correct.detach(), out.slot_count.detach()])
        self.sums += step.to(torch.float64)
        if out.sample_loss is not None:
            lengths = torch.tensor(batch.lengths, dtype=torch.float32).to(self.device, non_blocking=True)
            cols = (out.sample_loss, out.sample_correct, out.sample_count)
            self.samples.append(torch.stack([*(c.detach().float() for c in cols), lengths], dim=1))

    def per_sample(self) -> torch.Tensor:
        """[n, 4] (loss, correct, count, length) of this rank's samples since the last log."""
        return torch.cat(self.samples).cpu() if self.samples else torch.zeros(0, 4)


def _reader_state_for(saved: list[dict[str, Any] | None], rank: int, world: int) -> dict[str, Any] | None:
    """The stream position for `rank` of `world` from every saved rank's ShardStream state
    (None: no rank had trained a sample of this epoch yet). The same world size: the rank's
    own state. Another world size: every saved rank's state merged (merge_reader_states), which
    any rank of any world size loads and skips whatever any saved rank consumed."""
    if len(saved) == world:
        return saved[rank]
    if all(s is None for s in saved):
        return None
    assert all(s is not None for s in saved), "ranks train in lock-step: all or none have a position"
    return merge_reader_states(saved)


class Trainer:
    """One rank of the drafter trainer. torch.distributed must be initialised (by the actor or
    the test); rank and world size are read from it."""

    def __init__(self, cfg: Config, job: TrainJob) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Trainer needs an initialised process group (deepspeed.init_distributed)")
        self.cfg, self.job = cfg, job
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # small control messages (data readiness, counters, metrics) go over gloo on CPU, so
        # polling never waits behind queued GPU work
        self._ctrl = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.on_gpu = cfg.train.gpus_per_rank > 0
        if self.on_gpu and not torch.cuda.is_available():
            raise ValueError("train.gpus_per_rank > 0 but CUDA is not available in this trainer process")
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.ckpt_dir = cfg.out / "checkpoints"
        self.export_dir = cfg.out / "export"
        elastic = self._elastic(job)  # resuming at another world size: the engine loads a universal checkpoint
        self.engine = build_engine(
            cfg, job.drafter, job.target_dir, job.total_steps, self.world, self.on_gpu, load_universal=elastic
        )
        self.device = self.engine.device
        self.metrics = Metrics(cfg.out / "tb" / "train", enabled=self.rank == 0)
        self.block_size = job.drafter.block_size
        # counters (state_dict): where training stands
        self.step = 0
        self.epoch = 0
        self.epoch_samples = 0  # samples trained in the current epoch (equal on all ranks)
        self.epoch_carried = 0  # samples all ranks trained in this epoch before an elastic resume
        self.samples_seen = 0  # samples trained by all ranks since step 0
        self.reader_state: dict[str, Any] | None = None  # stream position after the last trained sample
        self.epoch_exhausted = False  # the epoch ended while a step was open (see _rewind_to_step_boundary)
        self.skipped_total = 0  # samples all ranks skipped (corrupt/missing shard, NaN) in finished epochs
        # this run only
        self.samples_consumed = 0
        self.samples_dropped = 0
        self.checkpoints: list[str] = []
        self.exports: list[str] = []
        self.final_loss: float | None = None
        self.resumed_from: str | None = None
        self.preempted: str | None = None
        self._signal = 0  # set by the preemption handler (any rank); acted on once all ranks agree
        self._boundary: tuple = ()  # the data position after the last complete step (_position)
        self._grad_norms: torch.Tensor | None = None  # per-parameter, at the last histogram step
        self._last_saved = 0
        self._last_logged = 0
        self._last_lr = float("nan")
        self._window = _Window(self.block_size, self.device)
        self._feeder: MicroBatchFeeder | None = None
        # this optimizer step so far (loss summed over its micro-batches, on the device), and
        # finished steps whose loss is not yet in train_log.jsonl: (step, epoch, lr, loss, micro, samples)
        self._step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._step_micro = self._step_samples = 0
        self._step_keys: list[tuple[int, tuple[str, ...]]] = []
        self._pending: list[tuple[int, int, float, torch.Tensor, int, int]] = []
        if job.resume_from is not None:
            self._resume(Path(job.resume_from))
        self._open_step_logs()

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        try:
            with self._preemption_notice():
                self._train()
            if self.step > self._last_logged:
                self._log()
            if self.step > self._last_saved:
                self._save()
            if self.preempted and self.rank == 0:
                print(
                    f"[trainer] {self.preempted}: saved {checkpoint.tag_name(self.step)} and stopped; "
                    "continue with --resume auto",
                    flush=True,
                )
        finally:
            if self._feeder is not None:
                self._feeder.close()
            self.metrics.close()
        return TrainResult(
            rank=self.rank,
            steps=self.step,
            epochs_completed=self.epoch,
            final_loss=self.final_loss,
            checkpoints=tuple(self.checkpoints),
            exports=tuple(self.exports),
            samples_consumed=self.samples_consumed,
            samples_dropped=self.samples_dropped,
            resumed_from=self.resumed_from,
            preempted=self.preempted,
        )

    def _train(self) -> None:
        """Micro-batches until the last step, or until every rank agreed on a preemption notice."""
        self._boundary = self._position()
        while not self._finished():
            t0 = time.perf_counter()
            batch = self._next_micro_batch()  # batch: every rank has one, or the epoch ends
            if self.preempted:
                self._rewind_to_step_boundary()
                return
            if batch is None:
                self._end_epoch()
                continue
            wait_s = time.perf_counter() - t0
            loss, out = self.engine(  # forward
                batch.input_ids,
                batch.features,
                batch.loss_mask,
                batch.target_argmax,
                batch.anchors.positions,
                batch.anchors.keep,
            )
            self.engine.backward(loss)  # backward
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary:
                self._last_lr = self.engine.get_lr()[0]  # the LR this optimizer step uses
                if (self.step + 1) % self.cfg.train.histogram_every == 0:
                    self._grad_norms = self._param_grad_norms()  # before the step clears them
            # clip + step: at the accumulation boundary DeepSpeed clips to gradient_clipping
            # (ds_config), steps AdamW and the LR schedule; otherwise it only accumulates
            self.engine.step()
            self._window.add(batch, out, wait_s, wall_s=time.perf_counter() - t0)
            self._step_loss += out.loss.detach().to(torch.float64)
            self._step_micro += 1
            self._step_samples += len(batch.keys)
            self._step_keys.append((self.epoch, batch.keys))
            self.samples_consumed += len(batch.keys)
            self.epoch_samples += len(batch.keys)
            self.reader_state = batch.reader_state
            if not boundary:
                continue
            self.step += 1
            self._boundary = self._position()
            self._end_step()  # this step's loss and sample keys queued for the step logs
            if self.step % self.cfg.train.log_every == 0:
                self._log()  # log
            if self.step % self.cfg.train.checkpoint_every == 0:
                self._save()  # checkpoint + export

    # ------------------------------------------------------------------ preemption
    @contextlib.contextmanager
    def _preemption_notice(self):
        """SIGTERM/SIGUSR1 only set a flag here; the ranks agree on it with the data-readiness
        all-reduce (_next_micro_batch), so all of them stop at the same micro-batch, and `run`
        saves the last complete step. Handlers need the main thread (a Ray actor's task runs
        there); elsewhere the default handling stays and a warning says so."""
        if threading.current_thread() is not threading.main_thread():
            print(f"[trainer] rank {self.rank}: not on the main thread, no preemption handler", flush=True)
            yield
            return

        def notice(signum, _frame) -> None:
            self._signal = signum

        previous = {s: signal.signal(s, notice) for s in PREEMPT_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _position(self) -> tuple:
        return (
            self.epoch, self.reader_state, self.epoch_samples, self.epoch_carried, self.samples_consumed,
            self.skipped_total,
        )

    def _rewind_to_step_boundary(self) -> None:
        """A notice inside a gradient accumulation: the partial step is dropped (its samples are
        trained after the resume), so the saved position is the last complete step's. If that
        step's epoch has ended since (the open step spans two epochs), the rewound epoch is
        marked exhausted: the resumed run ends it at once, as the uninterrupted run did, instead
        of training the samples that epoch's lock-step end dropped."""
        if self._step_micro:
            crossed = self._boundary[0] != self.epoch
            (
                self.epoch, self.reader_state, self.epoch_samples, self.epoch_carried, self.samples_consumed,
                self.skipped_total,
            ) = self._boundary  # skipped_total: the rewound epoch's skips are counted when it ends again
            if crossed:
                self.epoch_exhausted = True
            if self._feeder is not None:  # its stream is past the rewound position
                self._feeder.close()
                self._feeder = None
            self._step_loss.zero_()
            self._step_micro = self._step_samples = 0
            self._step_keys = []

    def _finished(self) -> bool:
        max_steps = self.cfg.train.max_steps
        return self.epoch >= self.cfg.train.epochs or (max_steps is not None and self.step >= max_steps)

    # ------------------------------------------------------------------ data
    def _open_epoch(self) -> MicroBatchFeeder:
        """Epoch 0 follows the manifest while capture appends to it; later epochs read it whole,
        in a shard order seeded by (run.seed, epoch) (shard_reader.ShardStream)."""
        stop = threading.Event()
        stream = ShardStream(
            self.job.shard_dir,
            self.job.provenance,
            self.rank,
            self.world,
            poll_s=0.5,
            stop_when=stop.is_set,
            epoch=self.epoch,
            seed=self.cfg.run.seed,
            shuffle=self.cfg.train.shuffle,
        )
        if self.reader_state is not None:  # resuming inside this epoch
            stream.load_state_dict(self.reader_state)
        build = functools.partial(
            make_micro_batch,
            dtype=self.dtype,
            num_anchors=self.cfg.train.num_anchors,
            seed=self.cfg.run.seed,
            epoch=self.epoch,
        )
        return MicroBatchFeeder(
            with_positions(stream),
            self.cfg.train.micro_batch_size,
            build,
            stop=stop,
            micro_batch_tokens=self.cfg.train.micro_batch_tokens,
        )

    def _next_micro_batch(self) -> MicroBatch | None:
        """The next micro-batch once every rank has one; None when any rank ran dry. Polls with
        short collectives instead of blocking in one while the capture is still writing."""
        if self.epoch_exhausted:
            return None
        if self._feeder is None:
            self._feeder = self._open_epoch()
        flag = torch.zeros(2, dtype=torch.int32)
        while True:
            flag[0], flag[1] = self._feeder.status(), -self._signal  # MIN of readiness, MAX of signals
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._ctrl)
            agreed, signum = int(flag[0]), -int(flag[1])
            if signum:
                self.preempted = signal.Signals(signum).name
                return None
            if agreed == READY:
                return self._feeder.take().to(self.device)
            if agreed == DRY:
                return None
            time.sleep(_POLL_S)

    def _end_epoch(self) -> None:
        """Every rank stops the epoch together; whatever a rank had left is dropped and counted.

        Per rank: its assigned samples (assigned_shards) = trained + skipped (unreadable shard,
        NaN features; the stream counts them) + dropped (left when another rank ran dry). The
        epoch's totals are all-reduced, plus `epoch_carried` from before an elastic resume. In
        an epoch begun at another world size the shard assignment changed mid-way: there only
        the total is known, and rank 0 counts it."""
        if self._feeder is not None:
            skipped = self._feeder.skipped
            self._feeder.close()
            self._feeder = None
        else:  # an epoch marked exhausted by a rewind: its counts are in the saved position
            skipped = dict((self.reader_state or {}).get("skipped", {}))
        manifest = read_manifest(self.job.shard_dir)  # final: some rank's stream saw DONE
        own = torch.tensor([self.epoch_samples, sum(skipped.values())], dtype=torch.int64)
        total = own.clone()
        dist.all_reduce(total, group=self._ctrl)
        trained_all = int(total[0]) + self.epoch_carried
        skipped_all = int(total[1])
        dropped_all = sum(r.n_samples for r in manifest) - trained_all - skipped_all
        if self.epoch_carried == 0:
            mine = assigned_shards(manifest, self.epoch, self.cfg.run.seed, self.rank, self.world)
            dropped = sum(r.n_samples for r in mine) - int(own[0]) - int(own[1])
        else:
            dropped = dropped_all if self.rank == 0 else 0
        assert dropped >= 0 and dropped_all >= 0, (dropped, dropped_all, self.epoch_samples, self.epoch_carried)
        self.samples_dropped += dropped
        self.skipped_total += skipped_all
        self.metrics.log(
            self.step,
            {"data/dropped_samples": dropped_all, "data/skipped": self.skipped_total, "data/epoch": self.epoch + 1},
        )
        if self.rank == 0:
            print(
                f"[trainer] epoch {self.epoch} done at step {self.step}: {trained_all} samples trained, "
                f"{skipped_all} skipped as unreadable, {dropped_all} dropped to keep ranks in lock-step",
                flush=True,
            )
        self.epoch += 1
        self.epoch_samples = self.epoch_carried = 0
        self.epoch_exhausted = False
        self.reader_state = None

    # ------------------------------------------------------------------ metrics
    def _end_step(self) -> None:
        """Queue the finished step's loss and this rank's sample keys of the step; both are
        written at the next log or checkpoint (no host sync per step)."""
        self._pending.append(
            (self.step, self.epoch, self._last_lr, self._step_loss, self._step_micro, self._step_samples)
        )
        if self._sample_log is not None:
            self._sample_lines += [{"step": self.step, "epoch": e, "keys": list(keys)} for e, keys in self._step_keys]
        self._step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._step_micro = self._step_samples = 0
        self._step_keys = []

    def _flush_step_log(self, durable: bool = False) -> None:
        """All ranks: reduce the queued steps' losses; rank 0 appends them to train_log.jsonl,
        every rank its sample keys. A step's loss is the mean of its micro-batch losses over
        all ranks (float64 sums, the same reduction every run: a resumed run's lines are
        bit-identical). `durable`: fsynced, before a checkpoint at this step is published."""
        lines = []
        if self._pending:  # equal on all ranks: steps are in lock-step
            losses = torch.stack([p[3] for p in self._pending]).cpu()
            counts = torch.tensor([[p[4], p[5]] for p in self._pending], dtype=torch.float64)
            vec = torch.cat([losses, counts.flatten()])
            dist.all_reduce(vec, group=self._ctrl)
            n = len(self._pending)
            loss_sums, counts = vec[:n].tolist(), vec[n:].view(n, 2).tolist()
            for (step, epoch, lr, *_), loss_sum, (micro, samples) in zip(self._pending, loss_sums, counts):
                self.samples_seen += int(samples)
                lines.append(
                    {"step": step, "epoch": epoch, "loss": loss_sum / micro, "lr": lr, "samples": self.samples_seen}
                )
            self._pending = []
        for path, rows in ((self._train_log, lines), (self._sample_log, self._sample_lines)):
            if path is not None and (rows or durable):
                with open(path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
        self._sample_lines = []

    def _open_step_logs(self) -> None:
        """Cut the step logs to the step training starts from (a resumed run's true history; a
        fresh run's stale lines of an earlier attempt go)."""
        self._sample_lines: list[dict] = []
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        self._train_log = self.cfg.out / TRAIN_LOG if self.rank == 0 else None
        self._sample_log = None
        if self.cfg.train.log_sample_keys:
            self._sample_log = self.cfg.out / SAMPLE_LOG / f"rank_{self.rank}.jsonl"
            self._sample_log.parent.mkdir(parents=True, exist_ok=True)
        for path in (self._train_log, self._sample_log):
            if path is not None:
                checkpoint.truncate_step_log(path, self.step)

    def _log(self) -> None:
        self._flush_step_log()
        w = self._window
        grad_norm = self.engine.get_global_grad_norm()
        skipped = sum(self._feeder.skipped.values()) if self._feeder is not None else 0  # this epoch
        host = torch.tensor([w.micro, w.tokens, w.wait_s, w.wall_s, skipped], dtype=torch.float64)
        vec = torch.cat([host, w.sums.cpu()])
        dist.all_reduce(vec, group=self._ctrl)
        micro, tokens, wait_s, wall_s, skipped, loss_sum = vec[:6].tolist()
        b = self.block_size
        correct, count = vec[6 : 6 + b], vec[6 + b :]
        self.final_loss = loss_sum / max(micro, 1.0)
        scalars = {
            "train/loss": self.final_loss,
            "train/lr": self._last_lr,
            "train/tokens_per_s": tokens / max(wall_s / self.world, 1e-9),  # wall_s: summed over ranks
            "data/wait_frac": wait_s / max(wall_s, 1e-9),
            "data/skipped": self.skipped_total + skipped,
        }
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
        for j in range(1, self.block_size):
            scalars[f"train/acc_slot_{j}"] = float(correct[j] / count[j].clamp(min=1))
        per_sample = self._gather_rows(w.per_sample())
        scalars.update(length_bucket_accuracy(per_sample[:, 1], per_sample[:, 2], per_sample[:, 3]))
        self.metrics.log(self.step, scalars)
        hists = {"train/loss_per_sample": per_sample[:, 0].tolist()}
        if self._grad_norms is not None:
            hists["train/grad_norm_per_param"] = self._grad_norms.tolist()
            self._grad_norms = None
        self.metrics.histograms(self.step, hists)
        if self.rank == 0:
            print(
                f"[trainer] step {self.step} epoch {self.epoch} loss {self.final_loss:.4f} "
                f"acc1 {scalars['train/acc_slot_1']:.3f} lr {self._last_lr:.2e} "
                f"wait {scalars['data/wait_frac']:.2f}",
                flush=True,
            )
        self._window = _Window(self.block_size, self.device)
        self._last_logged = self.step

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's [n_r, 4] per-sample rows, concatenated (small: one log window)."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, rows.numpy().tolist(), group=self._ctrl)
        return torch.tensor([r for p in parts for r in p], dtype=torch.float64).reshape(-1, 4)

    def _param_grad_norms(self) -> torch.Tensor:
        """L2 norm of each trainable drafter parameter's full gradient (after backward, before
        the step; a collective under ZeRO, every rank calls it). A layer that gets no gradient
        (e.g. a captured layer fc ignores) shows up as a spike at 0 in the histogram."""
        from deepspeed.utils import safe_get_full_grad

        norms = []
        for name, p in self.engine.module.drafter.named_parameters():
            if name in DFlashDrafter.TARGET_KEYS:
                continue
            g = safe_get_full_grad(p)
            norms.append(float("nan") if g is None else float(g.detach().float().norm()))
        return torch.tensor(norms, dtype=torch.float64)

    # ------------------------------------------------------------------ checkpoint and export
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "epoch_samples": self.epoch_samples,
            "epoch_carried": self.epoch_carried,
            "samples_seen": self.samples_seen,
            "skipped_total": self.skipped_total,
            "epoch_exhausted": self.epoch_exhausted,
            "reader": self.reader_state,
            "rng": checkpoint.rng_state(self.on_gpu),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"trainer state version {state.get('version')!r} != {_STATE_VERSION}")
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.epoch_samples, self.samples_seen = int(state["epoch_samples"]), int(state["samples_seen"])
        self.epoch_carried = int(state.get("epoch_carried", 0))  # absent before elastic resume existed
        self.skipped_total = int(state.get("skipped_total", 0))
        self.epoch_exhausted = bool(state.get("epoch_exhausted", False))
        self.reader_state = state["reader"]
        checkpoint.load_rng_state(state["rng"])

    def _elastic_state(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's state from the states of a checkpoint's ranks at another world size: the
        shared counters; the samples trained so far in this epoch carried as one global count
        (shard assignment changes, so no per-rank count carries over, see _end_epoch); the
        stream position derived from every saved rank's; and a fresh RNG seeded from
        (run.seed, rank, step), since saved per-rank RNG streams have no counterpart at another
        world size. Deterministic: the same checkpoint resumed at the same world size again
        trains identically."""
        first = saved[0]
        for key in ("step", "epoch", "samples_seen", "epoch_samples", "epoch_carried", "epoch_exhausted"):
            assert all(s.get(key) == first.get(key) for s in saved), (key, [s.get(key) for s in saved])
        step = int(first["step"])
        return {
            "version": first["version"],
            "step": step,
            "epoch": first["epoch"],
            "epoch_samples": 0,
            "epoch_carried": int(first.get("epoch_carried", 0)) + sum(int(s["epoch_samples"]) for s in saved),
            "samples_seen": first["samples_seen"],
            "skipped_total": int(first.get("skipped_total", 0)),
            "epoch_exhausted": bool(first.get("epoch_exhausted", False)),
            "reader": _reader_state_for([s["reader"] for s in saved], self.rank, self.world),
            "rng": checkpoint.seeded_rng_state(checkpoint.rank_seed(self.cfg.run.seed, self.rank, step), self.on_gpu),
        }

    def _save(self) -> None:
        """DeepSpeed checkpoint on every rank, published (marker, `latest`, pruning) by rank 0
        only after every rank's files are on disk (checkpoint.py says why), then the export."""
        tag = checkpoint.tag_name(self.step)
        self._flush_step_log(durable=True)  # the logs reach this step before it can be resumed from
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, self.state_dict(), group=self._ctrl)  # client_state is written by rank 0 only
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world,
            "config": self.cfg.to_dict(),
            "config_hash": config_hash(self.cfg),
            "train_config_hash": checkpoint.training_config_hash(self.cfg.to_dict()),
            "data": checkpoint.data_fingerprint(self.job.shard_dir) if self.rank == 0 else None,
        }
        if self.rank == 0:
            shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)  # left by a save that crashed
        dist.barrier(group=self._ctrl)
        # frozen target weights are not checkpointed: they come from the target on resume
        self.engine.save_checkpoint(
            str(self.ckpt_dir),
            tag=tag,
            client_state={"dflash": {"trainer": ranks, **meta}},
            save_latest=False,
            exclude_frozen_parameters=True,
        )
        checkpoint.fsync_tree(self.ckpt_dir / tag)
        dist.barrier(group=self._ctrl)  # every rank's files are durable
        if self.rank == 0:
            checkpoint.commit(self.ckpt_dir, tag, meta, self.cfg.train.keep_checkpoints)
            release_consumed(self.job.shard_dir, BufferPolicy.from_config(self.cfg), [s["reader"] for s in ranks],
                             self.epoch)  # shards this checkpoint no longer needs (disk_budget.py)
        self.checkpoints.append(tag)
        self._last_saved = self.step
        self._export(tag)  # ends in a barrier: no rank runs ahead of the commit
        self.metrics.flush()

    def _export(self, tag: str) -> None:
        import deepspeed

        drafter = self.engine.module.drafter
        own = [p for n, p in drafter.named_parameters() if n not in DFlashDrafter.TARGET_KEYS]
        gather = (
            deepspeed.zero.GatheredParameters(own, modifier_rank=None)
            if self.engine.zero_optimization_stage() == 3
            else contextlib.nullcontext()
        )
        with gather:  # a collective under ZeRO-3: every rank enters, rank 0 writes
            if self.rank == 0:
                path = export_drafter(drafter, self.export_dir / tag)
        if self.rank == 0:
            record = ExportRecord(
                step=self.step,
                epoch=self.epoch,
                path=str(path),
                checkpoint=tag,
                config_hash=config_hash(self.cfg),
                unix_time=time.time(),
            )
            with open(self.export_dir / EXPORT_INDEX, "a") as f:
                f.write(record.to_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.exports.append(str(path))
        dist.barrier()

    def _elastic(self, job: TrainJob) -> bool:
        """Whether job.resume_from was saved at another world size (the engine must then be
        built to load a universal checkpoint); an unreadable marker is refused by _resume."""
        meta = checkpoint.read_marker(Path(job.resume_from)) if job.resume_from is not None else None
        return meta is not None and meta.get("world_size") != self.world

    def _resume(self, path: Path) -> None:
        """Load a complete checkpoint (checkpoint.plan_resume chose it): every rank's engine,
        LR schedule, counters, reader position and RNG; refuse a changed training config, other
        shards, or another world size under a ZeRO stage that cannot change it (from the
        marker, before DeepSpeed's obscure errors).

        Same world size: exact (bit-identical continuation). Another world size (elastic):
        rank 0 converts the tag to a universal checkpoint once (universal.py), every rank's
        engine re-partitions the fp32 weights and AdamW moments from it, and each rank's
        counters, stream position and RNG come from _elastic_state."""
        meta = checkpoint.read_marker(path)
        if meta is None:
            raise checkpoint.ResumeError(f"{path} is not a complete checkpoint (no valid {checkpoint.MARKER})")
        checkpoint.check_resumable(meta, self.cfg.to_dict(), self.world, self.job.shard_dir, str(path))
        elastic = meta["world_size"] != self.world
        assert self.engine.load_universal_checkpoint() == elastic, "build_engine(load_universal=) must match"
        load_dir, tag = path.parent, path.name
        if elastic:
            load_dir, tag = path, universal.ensure_universal(path, group=self._ctrl).name
        groups = [dict(g) for g in self.engine.optimizer.param_groups]
        # strict=False: the frozen target weights are not in the checkpoint (set from the target)
        loaded, client = self.engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=False)
        if loaded is None:
            raise checkpoint.ResumeError(f"{path} could not be loaded by DeepSpeed")
        if elastic:  # two defects of DeepSpeed 0.19.8's ZeRO-3 universal load, undone
            # every param group gets group 0's hyperparameters (our no-decay group would decay)
            for group, before in zip(self.engine.optimizer.param_groups, groups):
                group.update({k: v for k, v in before.items() if k not in ("params", "lr", "initial_lr")})
            # one `step` tensor is shared by every flat partition, and AdamW increments it in
            # place once per partition: each optimizer step would count several times
            for state in self.engine.optimizer.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        saved = client["dflash"]
        schedule = self.engine.lr_scheduler.lr_lambdas[0]
        if schedule.total_steps != self.job.total_steps:
            raise checkpoint.ResumeError(
                f"{path}: its LR schedule spans {schedule.total_steps} steps, this run's {self.job.total_steps}: "
                f"resume with the same train.max_steps / data size (at another world size, set train.max_steps="
                f"{schedule.total_steps}), or use a fresh run.out_dir"
            )
        self.load_state_dict(self._elastic_state(saved["trainer"]) if elastic else saved["trainer"][self.rank])
        self._last_saved = self._last_logged = self.step
        self.resumed_from = str(path)
        self.metrics.close()  # reopen so the killed attempt's points after this step are purged
        self.metrics = Metrics(self.cfg.out / "tb" / "train", enabled=self.rank == 0, purge_step=self.step + 1)
        if self.rank == 0:
            checkpoint.rewind(self.ckpt_dir, path)
            how = f" (saved by {meta['world_size']} ranks, loaded as a universal checkpoint)" if elastic else ""
            print(f"[trainer] resumed from {path}{how}: step {self.step}, epoch {self.epoch}", flush=True)
        # `latest` moves before the export is written: a crash in between leaves it missing
        missing = torch.tensor([int(self.rank == 0 and not (self.export_dir / path.name).is_dir())])
        dist.broadcast(missing, src=0, group=self._ctrl)
        if int(missing.item()):
            self._export(path.name)
