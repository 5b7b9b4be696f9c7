"""The DeepSpeed drafter trainer, plain Python (actors/trainer_group.py runs one per rank).

`Trainer.run()` repeats step -> log -> checkpoint -> export until the last step, and
`Trainer.train_step()` does exactly one optimizer step, top to bottom: gather its micro-batches
(every rank as many, epoch_data.py), forward, backward, clip + AdamW + LR schedule. Ranks stay
in lock-step; a preemption notice (SIGTERM/SIGUSR1) is acted on at a step boundary: a step
either runs whole or not at all, and the last complete step is saved.

What survives a restart is `TrainState` (state.py); DeepSpeed specifics: engine.py; step logs
and log windows: step_log.py; checkpoints are published by checkpoint.py."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline.disk_budget import BufferPolicy, release_consumed
from data_pipeline.provenance import Provenance
from dflash_dist.config import Config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import export_drafter
from dflash_dist.model.loss import loss_weights
from dflash_dist.trainer import checkpoint, engine
from dflash_dist.trainer.batching import MicroBatch
from dflash_dist.trainer.epoch_data import EpochData
from dflash_dist.trainer.metrics import Metrics
from dflash_dist.trainer.state import TrainState
from dflash_dist.trainer.step_log import SAMPLE_LOG, TRAIN_LOG, StepLogs, StepRecord, Window

__all__ = ["SAMPLE_LOG", "TRAIN_LOG", "TrainJob", "TrainResult", "Trainer"]

log = logging.getLogger(__name__)
# a scheduler's notice (Slurm: SIGTERM on preemption/scancel, `--signal=USR1@secs` before the
# time limit): every rank saves a checkpoint at the next step boundary and returns
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class TrainJob:
    """What every rank needs besides the config: small, picklable, the same on all ranks."""

    target_dir: str
    shard_dir: str
    provenance: Provenance  # shards of any other origin are refused
    drafter: DrafterConfig
    total_steps: int  # the LR schedule's length in schedule_unit (ds_config.schedule_span)
    resume_from: str | None = None  # a complete checkpoint tag directory (checkpoint.plan_resume)
    schedule_unit: str = "step"  # "step", or "sample": token-budget micro-batches (Config.schedule_unit)


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
        dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.ckpt_dir, self.export_dir = cfg.out / "checkpoints", cfg.out / "export"
        saved = checkpoint.read_marker(Path(job.resume_from)) if job.resume_from is not None else None
        elastic = saved is not None and saved.get("world_size") != self.world  # loads a universal checkpoint
        self.engine = engine.build_engine(
            cfg, job.drafter, job.target_dir, job.total_steps, self.world, self.on_gpu, load_universal=elastic,
            schedule_unit=job.schedule_unit,
        )
        self.device = self.engine.device
        self.block_size = job.drafter.block_size
        self.gamma = job.drafter.loss_decay_gamma if cfg.train.gamma is None else cfg.train.gamma
        self.state = TrainState()  # everything a restart carries over
        self.data = EpochData(cfg, job.shard_dir, job.provenance, self.rank, self.world, dtype, self._ctrl)
        # this run only
        self.samples_consumed = self.samples_dropped = 0
        self.checkpoints: list[str] = []
        self.exports: list[str] = []
        self.final_loss: float | None = None
        self.resumed_from: str | None = None
        self.preempted: str | None = None
        self._signal = 0  # set by the preemption handler (any rank); acted on once all ranks agree
        self._grad_norms: torch.Tensor | None = None  # per-parameter, at the last histogram step
        self._last_lr = float("nan")
        self.metrics = Metrics(cfg.out / "tb" / "train", enabled=self.rank == 0)
        if job.resume_from is not None:
            self._resume(Path(job.resume_from), elastic)
        self._last_saved = self._last_logged = self.state.step
        self.window = Window(self.block_size, self.device)
        self.logs = StepLogs(cfg.out, self.rank, cfg.train.log_sample_keys, self.state.step, self._ctrl)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """step -> log -> checkpoint + export, until the last step or an agreed preemption
        notice; then the last step is logged and saved if it was not yet."""
        t = self.cfg.train
        try:
            with self._preemption_notice():
                while not self._finished() and self.train_step():
                    if self.state.step % t.log_every == 0:
                        self._log()
                    if self.state.step % t.checkpoint_every == 0:
                        self._save()
            if self.state.step > self._last_logged:
                self._log()
            if self.state.step > self._last_saved:
                self._save()
            if self.preempted and self.rank == 0:
                log.warning("%s: saved %s and stopped; continue with --resume auto", self.preempted,
                            checkpoint.tag_name(self.state.step))  # fmt: skip
        finally:
            self.data.close()
            self.metrics.close()
        return TrainResult(
            rank=self.rank,
            steps=self.state.step,
            epochs_completed=self.state.epoch,
            final_loss=self.final_loss,
            checkpoints=tuple(self.checkpoints),
            exports=tuple(self.exports),
            samples_consumed=self.samples_consumed,
            samples_dropped=self.samples_dropped,
            resumed_from=self.resumed_from,
            preempted=self.preempted,
        )

    def train_step(self) -> bool:
        """One optimizer step: its train.grad_accum micro-batches, forward, backward, then clip,
        AdamW and the LR schedule. False when no step was made: the epochs ran out, or a
        preemption notice came, while its micro-batches were gathered (the state is then that
        of the last complete step)."""
        t0 = time.perf_counter()
        gathered = self._gather_micro_batches()
        if gathered is None:
            return False
        batches = [b for _, b in gathered]
        wait_s = time.perf_counter() - t0
        denominators = self._loss_denominators(batches)
        lr = self.engine.get_lr()[0]  # the LR this optimizer step uses
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (batch, denominator) in enumerate(zip(batches, denominators)):
            batch = batch.to(self.device)
            loss, out = self.engine(  # forward
                batch.input_ids,
                batch.features,
                batch.loss_mask,
                batch.target_argmax,
                batch.anchors.positions,
                batch.anchors.keep,
                denominator,
                batch.anchors.starts,  # None unless train.packing
                batch.anchors.ends,
            )
            self.engine.backward(loss)  # backward (DeepSpeed divides by grad_accum, averages over ranks)
            last = i == len(batches) - 1
            if last and self.job.schedule_unit == "sample":
                self._advance_schedule(batches)
            assert self.engine.is_gradient_accumulation_boundary() == last, "DeepSpeed's accumulation count drifted"
            if last and (self.state.step + 1) % self.cfg.train.histogram_every == 0:
                self._grad_norms = engine.param_grad_norms(self.engine)  # before the step clears them
            # clip + step: at the accumulation boundary DeepSpeed clips to gradient_clipping
            # (ds_config), steps AdamW and the LR schedule; before it, it only accumulates
            self.engine.step()
            step_loss += out.loss.detach().to(torch.float64)
            self.window.add(batch, out)
        self.state.step += 1
        self._last_lr = lr
        keys = tuple((e, b.keys) for e, b in gathered) if self.cfg.train.log_sample_keys else ()
        samples = sum(len(b.keys) for b in batches)
        self.logs.add(StepRecord(self.state.step, self.state.epoch, lr, step_loss, len(batches), samples, keys))
        self.window.add_time(wait_s, time.perf_counter() - t0)
        return True

    def _advance_schedule(self, batches: list[MicroBatch]) -> None:
        """LR schedule by samples: before the step's scheduler update, add this step's samples on
        all ranks (one small all-reduce), so the next step's LR is that of the samples trained."""
        n = torch.tensor([sum(len(b.keys) for b in batches)], dtype=torch.int64)
        dist.all_reduce(n, group=self._ctrl)
        self.engine.lr_scheduler.lr_lambdas[0].done += int(n)

    def _gather_micro_batches(self) -> list[tuple[int, MicroBatch]] | None:
        """This step's (epoch, micro-batch) pairs, on the host; an epoch that ends on the way is
        closed and the next one opened (a step may span two epochs). None: the epochs ran out, or a
        preemption notice was agreed, first; a partly gathered step is then undone."""
        boundary, consumed = self.state.copy(), self.samples_consumed
        batches: list[tuple[int, MicroBatch]] = []
        while len(batches) < self.cfg.train.grad_accum:
            if self._finished():
                return None
            got = self.data.next(self.state, self._signal)
            if isinstance(got, int):
                self.preempted = signal.Signals(got).name
                if batches:
                    self._rewind(boundary, consumed)
                return None
            if got is None:
                self._end_epoch()
                continue
            batches.append((self.state.epoch, got))
            self.state.reader = got.reader_state
            self.state.epoch_samples += len(got.keys)
            self.samples_consumed += len(got.keys)
        return batches

    def _loss_denominators(self, batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        """train.loss_norm "micro_batch": None (each micro-batch's loss is its own weighted mean).
        "step_slots": every micro-batch's loss is sum(w*CE) / D with D = (sum(w) over the step's
        micro-batches on all ranks) / (grad_accum * world): DeepSpeed divides by grad_accum and
        averages over ranks, so the gradient is that of the slot-weighted mean over the whole
        step (every supervised slot counts the same)."""
        if self.cfg.train.loss_norm == "micro_batch":
            return [None] * len(batches)
        weighting = self.cfg.train.position_weighting
        total = torch.zeros(1, dtype=torch.float64)
        for b in batches:  # on the host, before any forward: one all-reduce for the whole step
            total += loss_weights(b.input_ids, b.loss_mask, b.anchors, self.block_size, self.gamma, weighting).sum()
        dist.all_reduce(total, group=self._ctrl)
        scale = self.cfg.train.grad_accum * self.world
        denominator = torch.tensor(max(float(total), 1e-6) / scale, dtype=torch.float32, device=self.device)
        return [denominator] * len(batches)

    def _finished(self) -> bool:
        max_steps = self.cfg.train.max_steps
        return self.state.epoch >= self.cfg.train.epochs or (max_steps is not None and self.state.step >= max_steps)

    def _end_epoch(self) -> None:
        end = self.data.end_epoch(self.state)
        self.samples_dropped += end.dropped
        s = self.state
        s.skipped_total += end.skipped_all
        scalars = {"data/dropped_samples": end.dropped_all, "data/skipped": s.skipped_total, "data/epoch": s.epoch + 1}
        self.metrics.log(s.step, scalars)
        if self.rank == 0:
            log.info(
                "epoch %d done at step %d: %d samples trained, %d skipped as unreadable, %d dropped to keep ranks in "
                "lock-step", s.epoch, s.step, end.trained_all, end.skipped_all, end.dropped_all,
            )  # fmt: skip
        s.epoch += 1
        s.epoch_samples = s.epoch_carried = 0
        s.epoch_exhausted = False
        s.reader = None

    # ------------------------------------------------------------------ preemption
    @contextlib.contextmanager
    def _preemption_notice(self):
        """SIGTERM/SIGUSR1 only set a flag here; the ranks agree on it with the data-readiness
        all-reduce (epoch_data.py), so all of them stop at the same micro-batch. Handlers need
        the main thread (a Ray actor's task runs there); elsewhere the default handling stays
        and a warning says so."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("rank %d: not on the main thread, no preemption handler", self.rank)
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

    def _rewind(self, boundary: TrainState, consumed: int) -> None:
        """A notice while a step was being gathered: its micro-batches are trained after the
        resume, so the state goes back to the last complete step's. If that step's epoch has
        ended since (the open step spans two epochs), the rewound epoch is marked exhausted: the
        resumed run ends it at once, as the uninterrupted run did, instead of training the
        samples that epoch's lock-step end dropped."""
        crossed = boundary.epoch != self.state.epoch
        self.state, self.samples_consumed = boundary, consumed
        if crossed:
            self.state.epoch_exhausted = True
        self.data.close()  # its stream is past the rewound position

    # ------------------------------------------------------------------ metrics
    def _log(self) -> None:
        self.state.samples_seen = self.logs.flush(self.state.samples_seen)
        grad_norm = self.engine.get_global_grad_norm()
        scalars, per_sample = self.window.reduce(self.world, self.data.skipped(), self.state.skipped_total, self._ctrl)
        self.final_loss = scalars["train/loss"]
        if not math.isfinite(self.final_loss):  # the loss's finite check, read here: no host sync per micro-batch
            raise FloatingPointError(f"non-finite DFlash loss {self.final_loss} in the steps up to {self.state.step}")
        scalars["train/lr"] = self._last_lr
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
        self.metrics.log(self.state.step, scalars)
        hists = {"train/loss_per_sample": per_sample[:, 0].tolist()}
        if self._grad_norms is not None:
            hists["train/grad_norm_per_param"] = self._grad_norms.tolist()
            self._grad_norms = None
        self.metrics.histograms(self.state.step, hists)
        if self.rank == 0:
            log.info(
                "step %d epoch %d loss %.4f acc1 %.3f lr %.2e wait %.2f", self.state.step, self.state.epoch,
                self.final_loss, scalars["train/acc_slot_1"], self._last_lr, scalars["data/wait_frac"],
            )  # fmt: skip
        self.window = Window(self.block_size, self.device)
        self._last_logged = self.state.step

    # ------------------------------------------------------------------ checkpoint and export
    def _save(self) -> None:
        """DeepSpeed checkpoint on every rank, published (marker, `latest`, pruning) by rank 0
        only after every rank's files are on disk (checkpoint.py says why), then the export."""
        step = self.state.step
        tag = checkpoint.tag_name(step)
        # the logs reach this step before it can be resumed from
        self.state.samples_seen = self.logs.flush(self.state.samples_seen, durable=True)
        ranks: list[Any] = [None] * self.world  # client_state is written by rank 0 only
        dist.all_gather_object(ranks, self.state.state_dict(self.on_gpu), group=self._ctrl)
        meta = {
            "step": step,
            "epoch": self.state.epoch,
            "world_size": self.world,
            "config": self.cfg.to_dict(),
            "config_hash": checkpoint.config_hash(self.cfg.to_dict()),
            "train_config_hash": checkpoint.training_config_hash(self.cfg.to_dict()),
            "data": checkpoint.data_fingerprint(self.job.shard_dir) if self.rank == 0 else None,
        }
        if self.rank == 0:
            shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)  # left by a save that crashed
        dist.barrier(group=self._ctrl)
        engine.save_checkpoint(self.engine, self.ckpt_dir, tag, {"dflash": {"trainer": ranks, **meta}})
        checkpoint.fsync_tree(self.ckpt_dir / tag)
        dist.barrier(group=self._ctrl)  # every rank's files are durable
        if self.rank == 0:
            checkpoint.commit(self.ckpt_dir, tag, meta, self.cfg.train.keep_checkpoints)
            release_consumed(self.job.shard_dir, BufferPolicy.from_config(self.cfg), [s["reader"] for s in ranks],
                             self.state.epoch)  # shards this checkpoint no longer needs (disk_budget.py)  # fmt: skip
        self.checkpoints.append(tag)
        self._last_saved = step
        self._export(tag)  # ends in a barrier: no rank runs ahead of the commit
        self.metrics.flush()

    def _export(self, tag: str) -> None:
        """The drafter in the release format under <out>/export/<tag> (rank 0 writes)."""
        with engine.gathered_drafter(self.engine) as drafter:  # a collective under ZeRO-3
            if self.rank == 0:
                self.exports.append(str(export_drafter(drafter, self.export_dir / tag)))
        dist.barrier()

    def _resume(self, path: Path, elastic: bool) -> None:
        """Load a complete checkpoint (checkpoint.plan_resume chose it): every rank's engine,
        LR schedule and TrainState (counters, reader position, RNG); refuse a changed training
        config, other shards, or another world size under a ZeRO stage that cannot change it
        (from the marker, before DeepSpeed's obscure errors).

        Same world size: exact (bit-identical continuation). Another world size (elastic): the
        engine loads the universal conversion (engine.load_checkpoint) and each rank's state
        comes from TrainState.for_world."""
        meta = checkpoint.read_marker(path)
        if meta is None:
            raise checkpoint.ResumeError(f"{path} is not a complete checkpoint: {checkpoint.marker_problem(path)}")
        checkpoint.check_resumable(meta, self.cfg.to_dict(), self.world, self.job.shard_dir, str(path))
        saved = engine.load_checkpoint(self.engine, path, elastic, group=self._ctrl)["dflash"]
        span = engine.schedule_length(self.engine)
        if span != (self.job.total_steps, self.job.schedule_unit):
            raise checkpoint.ResumeError(
                f"{path}: its LR schedule spans {span[0]} {span[1]}s, this run's {self.job.total_steps} "
                f"{self.job.schedule_unit}s: resume with the "
                f"same train.max_steps / data size (at another world size, set train.max_steps={span}), or use a "
                "fresh run.out_dir"
            )
        states = saved["trainer"]
        own = TrainState.for_world(states, self.rank, self.world, self.cfg.run.seed, self.on_gpu) if elastic else (
            states[self.rank])  # fmt: skip
        self.state.load_state_dict(own)
        self.resumed_from = str(path)
        self.metrics.close()  # reopen so the killed attempt's points after this step are purged
        self.metrics = Metrics(self.cfg.out / "tb" / "train", enabled=self.rank == 0, purge_step=self.state.step + 1)
        if self.rank == 0:
            checkpoint.rewind(self.ckpt_dir, path)
            how = f" (saved by {meta['world_size']} ranks, loaded as a universal checkpoint)" if elastic else ""
            log.info("resumed from %s%s: step %d, epoch %d", path, how, self.state.step, self.state.epoch)
        # `latest` moves before the export is written: a crash in between leaves it missing
        missing = torch.tensor([int(self.rank == 0 and not (self.export_dir / path.name).is_dir())])
        dist.broadcast(missing, src=0, group=self._ctrl)
        if int(missing.item()):
            self._export(path.name)
