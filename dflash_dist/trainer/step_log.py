"""What the trainer records per step and per log window, apart from TensorBoard's writer.

`StepLogs`: rank 0 appends every optimizer step's loss to `<out>/train_log.jsonl`; with
train.log_sample_keys every rank its trained sample keys to `<out>/sample_log/rank_<r>.jsonl`.
Steps are queued and written at the next log or checkpoint (one all-reduce for all queued
steps, no host sync per step); a resume first cuts both files to the resumed step, so they are
the run's true history. `Window`: per-rank sums since the last log, reduced over the ranks into
the scalars of `train/` and `data/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline.durable_files import append_lines
from dflash_dist.model.loss import LossOutput
from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.batching import MicroBatch
from dflash_dist.trainer.collectives import all_gather_json

TRAIN_LOG = "train_log.jsonl"  # rank 0: {step, epoch, loss, lr, samples} per optimizer step
SAMPLE_LOG = "sample_log"  # rank_<r>.jsonl: {step, epoch, keys} per micro-batch (train.log_sample_keys)
LENGTH_BUCKETS = (256, 512, 1024, 2048, 4096)  # train/acc_len_*: accuracy by sample length (tokens)


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


@dataclass(frozen=True)
class StepRecord:
    """One finished optimizer step of this rank, queued for the step logs."""

    step: int
    epoch: int  # the epoch the step ended in
    lr: float
    loss: torch.Tensor  # its micro-batch losses summed (float64, on the compute device)
    micro: int
    samples: int
    keys: tuple[tuple[int, tuple[str, ...]], ...]  # (epoch, sample keys) per micro-batch


class StepLogs:
    """The step logs of one rank (rank 0 writes train_log.jsonl). Construct after the resume:
    both files are cut to `start_step`, and rank 0 also cuts the sample logs of ranks >= `world`
    (left by a run at more ranks, whose steps after `start_step` were discarded)."""

    def __init__(self, out: Path, rank: int, log_sample_keys: bool, start_step: int, group: Any = None,
                 world: int | None = None) -> None:  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        self._group = group
        self._train_log = out / TRAIN_LOG if rank == 0 else None
        self._sample_log = out / SAMPLE_LOG / f"rank_{rank}.jsonl" if log_sample_keys else None
        if self._sample_log is not None:
            self._sample_log.parent.mkdir(parents=True, exist_ok=True)
        for path in (self._train_log, self._sample_log):
            if path is not None:
                checkpoint.truncate_step_log(path, start_step)
        if rank == 0 and world is not None:  # a resume at fewer ranks: the others' logs lose their future too
            for path in sorted((out / SAMPLE_LOG).glob("rank_*.jsonl")):
                if path.stem.removeprefix("rank_").isdigit() and int(path.stem.removeprefix("rank_")) >= world:
                    checkpoint.truncate_step_log(path, start_step)
        self._pending: list[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        self._pending.append(record)

    def reduce(self, samples_seen: int) -> tuple[LogRows, int]:
        """All ranks: reduce the queued steps' losses and sample counts into the lines to write
        (rank 0's train_log.jsonl lines, this rank's sample-key lines). A step's loss is the mean of
        its micro-batch losses over all ranks (float64 sums, the same reduction every run: a
        resumed run's lines are bit-identical). Returns them and samples_seen advanced by the
        flushed steps' samples (all ranks)."""
        lines, key_lines = [], []
        if self._pending:  # equal on all ranks: steps are in lock-step
            n = len(self._pending)
            losses = torch.stack([p.loss for p in self._pending]).cpu()
            counts = torch.tensor([[p.micro, p.samples] for p in self._pending], dtype=torch.float64)
            vec = torch.cat([losses, counts.flatten()])
            dist.all_reduce(vec, group=self._group)
            loss_sums, counts = vec[:n].tolist(), vec[n:].view(n, 2).tolist()
            for p, loss_sum, (micro, samples) in zip(self._pending, loss_sums, counts):
                samples_seen += int(samples)
                lines.append(
                    {"step": p.step, "epoch": p.epoch, "loss": loss_sum / micro, "lr": p.lr, "samples": samples_seen}
                )
                key_lines += [{"step": p.step, "epoch": e, "keys": list(keys)} for e, keys in p.keys]
            self._pending = []
        return LogRows(tuple(lines), tuple(key_lines)), samples_seen

    def write(self, rows: LogRows, durable: bool = False) -> None:
        """This rank's files only (no collective): rank 0 appends the train_log.jsonl lines, every
        rank its sample keys. `durable`: fsynced, before a checkpoint at this step is published."""
        for path, lines in ((self._train_log, rows.train), (self._sample_log, rows.keys)):
            if path is not None and (lines or durable):
                append_lines(path, "".join(json.dumps(r) + "\n" for r in lines).encode(), durable=durable)


@dataclass(frozen=True)
class LogRows:
    """The lines one `StepLogs.reduce` made: train_log.jsonl's (written by rank 0) and this rank's
    sample-key lines."""

    train: tuple[dict[str, Any], ...]
    keys: tuple[dict[str, Any], ...]


@dataclass
class Window:
    """Per-rank sums since the last log, all-reduced when logged. Loss and slot counts stay on
    the compute device (no host sync per micro-batch). Times are host wall-clock of whole steps
    (gathering their micro-batches included; logging and checkpoints are not counted)."""

    block_size: int
    device: torch.device
    micro: int = 0
    tokens: int = 0
    wait_s: float = 0.0
    wall_s: float = 0.0
    sums: torch.Tensor = field(init=False)  # [loss, slot_correct x B, slot_count x B]
    # per sample (diagnostics): [b, 3] rows of (loss, correct, count) on the device, and each
    # sample's length on the host (copying it to the device was an upload per micro-batch)
    samples: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sums = torch.zeros(1 + 2 * self.block_size, dtype=torch.float64, device=self.device)

    def add(self, batch: MicroBatch, out: LossOutput) -> None:
        self.micro += 1
        self.tokens += batch.num_tokens
        step = torch.cat([out.loss.detach().reshape(1), out.slot_correct.detach(), out.slot_count.detach()])
        self.sums += step.to(torch.float64)
        if out.sample_loss is not None:
            cols = (out.sample_loss, out.sample_correct, out.sample_count)
            self.samples.append(torch.stack([c.detach().float() for c in cols], dim=1))
            self.lengths.extend(batch.lengths)

    def add_time(self, wait_s: float, wall_s: float) -> None:
        self.wait_s += wait_s
        self.wall_s += wall_s

    def reduce(self, world: int, group: Any = None) -> tuple[dict[str, float], torch.Tensor]:
        """(scalars, per-sample rows [n, 4] of every rank) of the window, summed over the ranks:
        train/loss (mean micro-batch loss), tokens_per_s, acc_slot_j, acc_len_*, data/wait_frac.
        The lost-sample counts come from the step source (what data.max_lost_fraction holds)."""
        host = torch.tensor([self.micro, self.tokens, self.wait_s, self.wall_s], dtype=torch.float64)
        vec = torch.cat([host, self.sums.cpu()])
        dist.all_reduce(vec, group=group)
        micro, tokens, wait_s, wall_s, loss_sum = vec[:5].tolist()
        b = self.block_size
        correct, count = vec[5 : 5 + b], vec[5 + b :]
        scalars = {
            "train/loss": loss_sum / max(micro, 1.0),
            "train/tokens_per_s": tokens / max(wall_s / world, 1e-9),  # wall_s: summed over ranks
            "data/wait_frac": wait_s / max(wall_s, 1e-9),
        }
        for j in range(1, b):
            scalars[f"train/acc_slot_{j}"] = float(correct[j] / count[j].clamp(min=1))
        rows = self.per_sample()
        # a sample's loss may be non-finite: it travels, and the loop's finite check names the window
        parts = all_gather_json(rows.numpy().tolist(), group, what="per-sample rows", allow_nan=True)
        per_sample = torch.tensor([r for p in parts for r in p], dtype=torch.float64).reshape(-1, 4)
        scalars.update(length_bucket_accuracy(per_sample[:, 1], per_sample[:, 2], per_sample[:, 3]))
        return scalars, per_sample

    def per_sample(self) -> torch.Tensor:
        """[n, 4] (loss, correct, count, length) of this rank's samples since the last log."""
        if not self.samples:
            return torch.zeros(0, 4)
        lengths = torch.tensor(self.lengths, dtype=torch.float32)[:, None]
        return torch.cat([torch.cat(self.samples).cpu(), lengths], dim=1)
