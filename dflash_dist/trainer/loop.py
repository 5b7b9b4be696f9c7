"""The DeepSpeed drafter trainer, plain Python (actors/trainer_group.py runs one per rank).

`Trainer.run()` repeats step -> log -> checkpoint -> export until the last step, and
`Trainer.train_step()` does exactly one optimizer step, top to bottom: take a whole step from
the data source (step_source.py: agreed by every rank, epochs crossed inside it), forward,
backward, clip + AdamW + LR schedule. A preemption notice (SIGTERM/SIGUSR1) is acted on at a step
boundary: the source halts every rank at the same slot without handing out the open step, and
the last complete step is saved.

What survives a restart is `TrainState` (state.py); DeepSpeed specifics: engine.py; step logs
and log windows: step_log.py; checkpoints are published by checkpoint.py.

File work of one rank (rank 0 publishing a checkpoint or an export, opening the logs; each rank
flushing its files) that the ranks' next collective follows runs under `_together`: a failure
there stops every rank at that point (the failed rank with its own error, the others with a
`PeerError` carrying its text) instead of leaving the peers in the next collective."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from data_pipeline.provenance import Provenance
from dflash_dist.config import Config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import export_drafter
from dflash_dist.model.loss import loss_weights, supervised_rows
from dflash_dist.trainer import checkpoint, engine, resume
from dflash_dist.trainer.batching import MicroBatch, empty_batch
from dflash_dist.trainer.collectives import PeerError, all_gather_json, all_reduce_or_stop, run_or_stop
from dflash_dist.trainer.metrics import Metrics
from dflash_dist.trainer.resume import ResumeDecision
from dflash_dist.trainer.state import STATE_VERSION, TrainState
from dflash_dist.trainer.step_log import SAMPLE_LOG, TRAIN_LOG, StepLogs, StepRecord, Window
from dflash_dist.trainer.step_source import EpochEnd, Halt, StepSource

__all__ = ["SAMPLE_LOG", "TRAIN_LOG", "TrainJob", "TrainResult", "Trainer"]

log = logging.getLogger(__name__)
T = TypeVar("T")
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
    resume: ResumeDecision | None = None  # where to start, decided once (resume.decide); None: step 0
    schedule_unit: str = "step"  # "step", or "sample": token-budget micro-batches (Config.schedule_unit)
    num_samples: int | None = None  # samples per epoch the run planned for (data.max_lost_fraction's base)
    later_epochs: str = "keep"  # the run plan's resolved capture.later_epochs: keep | recapture


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
    # samples lost since step 0, as data.max_lost_fraction holds them: those no rank could read plus
    # those the capture skipped, counted once per epoch that reads their directory (all ranks)
    samples_lost: int
    resumed_from: str | None = None
    preempted: str | None = None  # the signal's name when a preemption notice ended the run
    capture_skipped: int = 0  # the part of samples_lost the capture skipped (non-finite, empty responses)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient (engine.skipped_steps)


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
        if job.resume is not None and job.resume.world != self.world:
            raise checkpoint.ResumeError(f"the resume from {job.resume.tag} was decided for {job.resume.world} ranks, "
                                         f"this group has {self.world}")  # fmt: skip
        elastic = job.resume is not None and job.resume.elastic  # loads a universal checkpoint
        self.engine = engine.build_engine(
            cfg, job.drafter, job.target_dir, job.total_steps, self.world, self.on_gpu, load_universal=elastic,
            schedule_unit=job.schedule_unit,
        )
        self.device = self.engine.device
        self.block_size = job.drafter.block_size
        self.gamma = job.drafter.loss_decay_gamma if cfg.train.gamma is None else cfg.train.gamma
        self.state = TrainState()  # everything a restart carries over
        self.source = StepSource(cfg, job.shard_dir, job.provenance, self.rank, self.world, dtype, self._ctrl,
                                 planned_samples=job.num_samples, recapture=job.later_epochs == "recapture")
        # this run only
        self.samples_consumed = 0
        self.checkpoints: list[str] = []
        self.exports: list[str] = []
        self.final_loss: float | None = None
        self.resumed_from: str | None = None
        self.preempted: str | None = None
        self._signal = 0  # set by the preemption handler (any rank); acted on once all ranks agree
        self._grad_norms: torch.Tensor | None = None  # per-parameter, at the last histogram step
        self._last_lr = float("nan")
        self._pad: MicroBatch | None = None  # the zero-weight batch of empty slots (_pad_batch)
        if job.resume is not None:
            self._resume(job.resume)
        self._last_saved = self._last_logged = self.state.step
        self.window = Window(self.block_size, self.device)
        self._together("opening the logs", self._open_logs)

    def _open_logs(self) -> None:
        """TensorBoard (rank 0; an earlier attempt's points after this step are purged: after the
        resumed checkpoint, or all of them when a run that stopped before its first checkpoint starts
        over) and the step logs (cut to this step)."""
        purge = self.state.step + 1
        self.metrics = Metrics(self.cfg.out / "tb" / "train", enabled=self.rank == 0, purge_step=purge)
        self.logs = StepLogs(self.cfg.out, self.rank, self.cfg.train.log_sample_keys, self.state.step, self._ctrl,
                             self.world)  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """step -> log -> checkpoint + export, until the last step or an agreed preemption
        notice; then the last step is logged and saved if it was not yet."""
        t = self.cfg.train
        try:
            with self._preemption_notice():
                if self._finished():  # resumed with nothing left to train: no slot says what was lost
                    self.source.settle()
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
            self.source.close()
            self.metrics.close()
        return TrainResult(
            rank=self.rank,
            steps=self.state.step,
            epochs_completed=self.source.epoch,
            final_loss=self.final_loss,
            checkpoints=tuple(self.checkpoints),
            exports=tuple(self.exports),
            samples_consumed=self.samples_consumed,
            samples_lost=self.source.lost,
            resumed_from=self.resumed_from,
            preempted=self.preempted,
            capture_skipped=self.source.capture_lost,
            skipped_steps=engine.skipped_steps(self.engine),
        )

    def train_step(self) -> bool:
        """One optimizer step: its train.grad_accum micro-batch slots, forward, backward, then clip,
        AdamW and the LR schedule. False when no step was made: the epochs ran out, or a preemption
        notice came while its micro-batches were gathered (the state is then that of the last
        complete step). A slot this rank has no micro-batch for (its share of the epoch is read,
        or the epoch ended inside the step) runs a zero-weight batch, so every rank makes the same
        DeepSpeed calls; each real micro-batch's loss is scaled so the gradient is the mean over
        the step's real micro-batches (train.loss_norm "step_slots" needs no scale: its
        denominators are the step's summed slot weights)."""
        t0 = time.perf_counter()
        got = self.source.next_step(self._signal)
        for end in got.epoch_ends:
            self._log_epoch(end)
        if isinstance(got, Halt):
            if got.notice is not None:
                self.preempted = got.notice
            return False
        batches = list(got.batches)
        wait_s = time.perf_counter() - t0
        denominators = self._loss_denominators(batches)
        slots = self.cfg.train.grad_accum
        full = got.real_all == slots * self.world
        scale = None if full or self.cfg.train.loss_norm == "step_slots" else slots * self.world / got.real_all
        lr = self.engine.get_lr()[0]  # the LR this optimizer step uses
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(slots):
            real = i < len(batches)
            host = batches[i] if real else self._pad_batch()
            # the supervised slots from the host batch: found on the device they are a host sync
            rows = supervised_rows(host.input_ids, host.loss_mask, host.anchors, self.block_size)
            batch = host.to(self.device)
            loss, out = self.engine(  # forward
                batch.input_ids,
                batch.features,
                batch.loss_mask,
                batch.target_argmax,
                batch.anchors.positions,
                batch.anchors.keep,
                denominators[0],
                batch.anchors.starts,  # None unless train.packing
                batch.anchors.ends,
                rows.to(self.device, non_blocking=True),
            )
            if not real:
                loss = loss * 0.0  # an empty slot: no gradient, but the same collectives as its peers
            elif scale is not None:
                loss = loss * scale
            self.engine.backward(loss)  # backward (DeepSpeed divides by grad_accum, averages over ranks)
            last = i == slots - 1
            if last and self.job.schedule_unit == "sample":
                # before the step's scheduler update: the next step's LR is that of the samples trained
                self.engine.lr_scheduler.lr_lambdas[0].done += got.samples_all
            assert self.engine.is_gradient_accumulation_boundary() == last, "DeepSpeed's accumulation count drifted"
            if last and (self.state.step + 1) % self.cfg.train.histogram_every == 0:
                self._grad_norms = engine.param_grad_norms(self.engine)  # before the step clears them
            # clip + step: at the accumulation boundary DeepSpeed clips to gradient_clipping
            # (ds_config), steps AdamW and the LR schedule; before it, it only accumulates
            self.engine.step()
            if real:
                step_loss += out.loss.detach().to(torch.float64)
                self.window.add(batch, out)
        self.state.step += 1
        self._last_lr = lr
        keys = tuple((got.epoch, b.keys) for b in batches) if self.cfg.train.log_sample_keys else ()
        samples = sum(len(b.keys) for b in batches)
        self.samples_consumed += samples
        self.logs.add(StepRecord(self.state.step, got.epoch, lr, step_loss, len(batches), samples, keys))
        self.window.add_time(wait_s, time.perf_counter() - t0)
        return True

    def _pad_batch(self) -> MicroBatch:
        if self._pad is None:
            d = self.job.drafter
            self._pad = empty_batch(len(d.target_layer_ids) * d.hidden_size, self.source.dtype, d.block_size,
                                    self.cfg.train.num_anchors, self.source.pack_tokens)  # fmt: skip
        return self._pad

    def _loss_denominators(self, batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        """train.loss_norm "micro_batch": None (each micro-batch's loss is its own weighted mean).
        "step_slots": every micro-batch's loss is sum(w*CE) / D with D = (sum(w) over the step's
        micro-batches on all ranks) / (grad_accum * world): DeepSpeed divides by grad_accum and
        averages over ranks, so the gradient is that of the slot-weighted mean over the whole
        step (every supervised slot counts the same)."""
        if self.cfg.train.loss_norm == "micro_batch":
            return [None]
        weighting = self.cfg.train.position_weighting
        total = torch.zeros(1, dtype=torch.float64)
        for b in batches:  # on the host, before any forward: one all-reduce for the whole step
            total += loss_weights(b.input_ids, b.loss_mask, b.anchors, self.block_size, self.gamma, weighting).sum()
        dist.all_reduce(total, group=self._ctrl)
        scale = self.cfg.train.grad_accum * self.world
        # a fill on the device (torch.tensor(value, device=) copies a host tensor and waits for the queue)
        denominator = torch.full((), max(float(total), 1e-6) / scale, dtype=torch.float32, device=self.device)
        return [denominator]

    def _finished(self) -> bool:
        max_steps = self.cfg.train.max_steps
        return self.source.finished or (max_steps is not None and self.state.step >= max_steps)

    def _log_epoch(self, end: EpochEnd) -> None:
        def write() -> None:
            self.metrics.log(self.state.step, {**self.source.lost_scalars(), "data/epoch": end.epoch + 1})
            log.info(
                "epoch %d done at step %d: %d of %d samples trained, %d could not be read", end.epoch,
                self.state.step, end.trained, end.total, end.lost,
            )  # fmt: skip

        self._on_rank_0(f"logging epoch {end.epoch}", write)

    # ------------------------------------------------------------------ preemption
    @contextlib.contextmanager
    def _preemption_notice(self):
        """SIGTERM/SIGUSR1 only set a flag here; the ranks agree on it with the data-readiness
        all-reduce (step_source.py), so all of them stop at the same micro-batch slot. Handlers need
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

    # ------------------------------------------------------------------ metrics
    def _log(self) -> None:
        rows, self.state.samples_seen = self.logs.reduce(self.state.samples_seen)
        self._together("writing the step logs", lambda: self.logs.write(rows))
        grad_norm = self.engine.get_global_grad_norm()
        scalars, per_sample = self.window.reduce(self.world, self._ctrl)
        scalars.update(self.source.lost_scalars())  # what data.max_lost_fraction holds, as of the last slot
        self.final_loss = scalars["train/loss"]
        if not math.isfinite(self.final_loss):  # the loss's finite check, read here: no host sync per micro-batch
            raise FloatingPointError(f"non-finite DFlash loss {self.final_loss} in the steps up to {self.state.step}")
        scalars["train/lr"] = self._last_lr
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
        scalars["train/skipped_steps"] = engine.skipped_steps(self.engine)  # non-finite gradients, so far
        hists = {"train/loss_per_sample": per_sample[:, 0].tolist()}
        if self._grad_norms is not None:
            hists["train/grad_norm_per_param"] = self._grad_norms.tolist()
            self._grad_norms = None

        def write() -> None:  # rank 0: TensorBoard's writer raises a failed write here
            self.metrics.log(self.state.step, scalars)
            self.metrics.histograms(self.state.step, hists)
            log.info(
                "step %d epoch %d loss %.4f acc1 %.3f lr %.2e wait %.2f", self.state.step, self.source.epoch,
                self.final_loss, scalars["train/acc_slot_1"], self._last_lr, scalars["data/wait_frac"],
            )  # fmt: skip

        self._on_rank_0(f"logging step {self.state.step}", write)
        self.window = Window(self.block_size, self.device)
        self._last_logged = self.state.step

    # ------------------------------------------------------------------ checkpoint and export
    def _save(self) -> None:
        """DeepSpeed checkpoint on every rank, published (marker, `latest`, pruning) by rank 0
        only after every rank's files are on disk (checkpoint.py says why), then the export."""
        step = self.state.step
        tag = checkpoint.tag_name(step)
        rows, self.state.samples_seen = self.logs.reduce(self.state.samples_seen)
        self.state.source = self.source.state_dict()
        # every rank's state (JSON-native: TrainState.state_dict), written by rank 0 into client_state
        ranks = all_gather_json(self.state.state_dict(self.on_gpu), self._ctrl, what="trainer state")
        meta = {
            "step": step,
            "epoch": self.source.epoch,
            "world_size": self.world,
            "config": self.cfg.to_dict(),
            "config_hash": checkpoint.config_hash(self.cfg.to_dict()),
            "train_config_hash": resume.training_config_hash(self.cfg.to_dict()),
            "data": None,  # rank 0's below
            "schedule": list(engine.schedule_length(self.engine)),  # checked by resume.decide
            "state_version": STATE_VERSION,
            "drafter": self.job.drafter.to_hf_dict(),  # the shape trained: `dflash-dist export` builds it from this
        }

        def prepare() -> None:
            self.logs.write(rows, durable=True)  # the logs reach this step before it can be resumed from
            if self.rank == 0:
                checkpoint.clear_tag(self.ckpt_dir, tag)  # left by a save that crashed (or a planted link)
                meta["data"] = checkpoint.data_fingerprint(self.job.shard_dir)

        self._together(f"saving {tag}", prepare)  # no rank writes into the tag before it is cleared
        engine.save_checkpoint(self.engine, self.ckpt_dir, tag, {"dflash": {"trainer": ranks, **meta}})
        self._together(f"saving {tag}", lambda: checkpoint.fsync_tree(self.ckpt_dir / tag))  # every rank's durable

        def publish() -> None:
            self.metrics.flush()
            checkpoint.commit(self.ckpt_dir, tag, meta, self.cfg.train.keep_checkpoints)
            self.source.release([s["source"]["reader"] for s in ranks])

        self._on_rank_0(f"publishing {tag}", publish)  # no rank runs ahead of the commit
        self.checkpoints.append(tag)
        self._last_saved = step
        self._export(tag)

    def _export(self, tag: str) -> None:
        """The drafter in the release format under <out>/export/<tag> (rank 0 writes)."""
        with engine.gathered_drafter(self.engine) as drafter:  # a collective under ZeRO-3
            path = self._on_rank_0(f"exporting {tag}", lambda: export_drafter(drafter, self.export_dir / tag))
        if path is not None:
            self.exports.append(str(path))
        dist.barrier()

    def _resume(self, decision: ResumeDecision) -> None:
        """Load the checkpoint decided on (resume.decide checked it against this run once; this
        rank verifies the marker is still that one): every rank's engine, LR schedule and
        TrainState (step, samples, the source's position, RNG).

        Same world size: exact (bit-identical continuation). Another world size (elastic): the
        engine loads the universal conversion (engine.load_checkpoint) and each rank's state
        comes from TrainState.for_world."""
        path, elastic = Path(decision.tag), decision.elastic
        meta = resume.verify(decision)
        checkpoint.verify_checksums(path, meta, self.rank, self.world, self._ctrl)  # before DeepSpeed reads a byte
        saved = engine.load_checkpoint(self.engine, path, elastic, group=self._ctrl)["dflash"]
        span = engine.schedule_length(self.engine)
        assert span == (self.job.total_steps, self.job.schedule_unit), (span, self.job)  # resume.decide checked
        states = saved["trainer"]
        own = TrainState.for_world(states, self.rank, self.world, self.cfg.run.seed, self.on_gpu) if elastic else (
            states[self.rank])  # fmt: skip
        self.state.load_state_dict(own)
        self.source.load_state_dict(self.state.source)
        self.resumed_from = str(path)

        def rewind(vec: torch.Tensor) -> None:
            checkpoint.rewind(self.ckpt_dir, path, self.cfg.out)  # and moves the later exports and results aside
            how = f" (saved by {meta['world_size']} ranks, loaded as a universal checkpoint)" if elastic else ""
            log.info("resumed from %s%s: step %d, epoch %d", path, how, self.state.step, self.source.epoch)
            # `latest` moves before the export is written: a crash in between leaves it missing
            vec[0] = int(not (self.export_dir / path.name).is_dir())

        missing = torch.zeros(2, dtype=torch.int64)  # [rank 0: the tag's export is missing, failed ranks]
        stop = self._peer_failed(f"resuming from {path}")
        all_reduce_or_stop(missing, rewind if self.rank == 0 else lambda _: None, self._ctrl, stop)
        if missing[0]:
            self._export(path.name)

    # ------------------------------------------------------------------ file work before a collective
    def _together(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` on every rank, then every rank goes on or every rank raises (collectives.run_or_stop):
        a rank whose `fn` failed no longer leaves its peers waiting in the next collective."""
        return run_or_stop(fn, self._ctrl, self._peer_failed(what))

    def _on_rank_0(self, what: str, fn: Callable[[], T]) -> T | None:
        """`fn()` on rank 0 alone (None on the others), under `_together`."""
        return self._together(what, fn if self.rank == 0 else lambda: None)

    def _peer_failed(self, what: str) -> Callable[[str], PeerError]:
        def stop(failed: str) -> PeerError:
            return PeerError(f"rank {self.rank} stops {what} because another rank failed there ({failed}); fix what "
                             "that error names, then continue with --resume auto")  # fmt: skip

        return stop
