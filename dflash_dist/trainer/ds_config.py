"""The one place DeepSpeed settings, the optimizer and the LR schedule are derived (STYLE 4).

Every DeepSpeed key we rely on is written out here, so a default changing under us, or a key
set twice, cannot silently change training (gpt-neox trained for months with clipping off).
tests/test_trainer.py checks that these values reach the engine.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dflash_dist.config import Config
from dflash_dist.model.lr_schedule import warmup_cosine

STEPS_PER_PRINT = 1 << 30  # DeepSpeed's own progress prints stay off: we log through metrics.py


def deepspeed_config(
    cfg: Config, world_size: int, on_gpu: bool, hidden_size: int | None = None, load_universal: bool = False
) -> dict:
    """The DeepSpeed config dict for `world_size` ranks.

    bf16 on GPU, fp32 on CPU. ZeRO-3 bucket and persistence sizes follow the HF integration's
    rule from the model width (`hidden_size`): vectors (norm gains) stay whole on every rank,
    every matrix is partitioned. Without `hidden_size`, DeepSpeed's defaults are written out.
    `load_universal`: the engine loads a universal checkpoint (elastic resume, universal.py).
    """
    t = cfg.train
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"train.zero_stage must be 0, 1, 2 or 3, got {t.zero_stage}")
    h = hidden_size
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": {
            "stage": t.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": on_gpu,  # needs side streams; on CPU it only adds threads
            "reduce_scatter": True,
            # False: one reduce per destination rank instead of the bucket's all-reduce (train.zero_grad_reduce)
            "use_multi_rank_bucket_allreduce": t.zero_grad_reduce == "allreduce",
            "reduce_bucket_size": h * h if h else int(5e8),
            "allgather_partitions": True,
            "allgather_bucket_size": int(5e8),
            "round_robin_gradients": False,
            "compute_grad_norm": True,  # clipping and train/grad_norm need it
            "stage3_param_persistence_threshold": 10 * h if h else int(1e5),
            "stage3_prefetch_bucket_size": int(0.9 * h * h) if h else int(5e7),
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            # exports gather the drafter's own weights (loop.py); checkpoints keep partitions
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "bf16": {"enabled": on_gpu, "check_grad_overflow": t.grad_overflow_check},
        "fp16": {"enabled": False},
        "torch_autocast": {"enabled": False},
        "checkpoint": {"load_universal": load_universal},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on and synchronized by default: a device synchronize in every
        # forward's prologue and every step() (micro-steps too), from the third optimizer step on, to time
        # a samples/s line it prints only every steps_per_print steps (never here). Each drained the GPU's
        # queue (bench/host_reads.py); the trainer times its steps itself (step_log.Window).
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


def build_optimizer(cfg: Config, model: nn.Module, fused: bool = False) -> torch.optim.AdamW:
    """torch AdamW over the trainable parameters only (the target's embedding and lm_head are
    frozen and stay out). Weight decay applies to matrices; norm gains (1-D) are not decayed.
    `fused` (the trainer sets it on GPU): torch's fused AdamW kernel for the step DeepSpeed runs
    on its fp32 master partition, 72 -> 48 ms per step at the 27B drafter shape
    (docs/BENCHMARKS.md). The parameters may still be on the CPU here (DeepSpeed moves them), so
    it is set on the groups, which the kernel choice reads at step time."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.999), eps=1e-8)
    if fused:
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    return optimizer


class WarmupCosine:
    """LR multiplier: linear warmup over `warmup_steps`, then cosine to 0 at `total_steps`
    (model/lr_schedule.warmup_cosine, the project's one schedule shape).

    `unit` "step": the position is the optimizer step LambdaLR passes. "sample": the position is
    `done`, the samples trained so far on all ranks, which the trainer advances before each step
    (token-budget micro-batches hold varying sample counts: Config.schedule_unit); the two lengths
    then count samples. A callable object (not a lambda) so LambdaLR.state_dict() stores its
    fields (`done` included: a resumed run continues the schedule) and a resumed run can check them."""

    def __init__(self, total_steps: int, warmup_steps: int, unit: str = "step") -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if unit not in ("step", "sample"):
            raise ValueError(f"unit must be 'step' or 'sample', got {unit!r}")
        self.total_steps = total_steps
        self.warmup_steps = max(0, min(warmup_steps, total_steps))
        self.unit = unit
        self.done = 0  # samples trained so far (unit "sample")

    def __call__(self, step: int) -> float:
        return warmup_cosine(step if self.unit == "step" else self.done, self.total_steps, self.warmup_steps)


def build_lr_schedule(
    cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int, unit: str = "step"
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup (cfg.train.warmup_frac of the schedule) then cosine over `total_steps` optimizer
    steps (unit "step") or samples (unit "sample"); stepped by DeepSpeed once per optimizer step
    and saved in its checkpoints."""
    warmup = math.ceil(cfg.train.warmup_frac * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(total_steps, warmup, unit))


def schedule_span(cfg: Config, world_size: int, num_samples: int | None) -> tuple[int, str]:
    """The LR schedule's (length, unit): with train.max_steps, optimizer steps
    (total_train_steps); else the samples `epochs` passes over `num_samples` train
    (Config.schedule_unit)."""
    if cfg.schedule_unit() == "step":
        return total_train_steps(cfg, world_size, num_samples), "step"
    if num_samples is None or num_samples < 1:
        raise ValueError(
            "the LR schedule counts samples trained: set data.max_train_samples, pass the number of captured "
            "samples, or set train.max_steps"
        )
    return cfg.train.epochs * num_samples, "sample"


def planned_schedule(cfg: Config, num_samples: int | None, total_steps: int | None = None) -> tuple[int, str]:
    """The LR schedule (length, unit) a run plans: `total_steps` optimizer steps when given, else
    schedule_span over `num_samples` per epoch (default data.max_train_samples)."""
    if total_steps is not None:
        return total_steps, "step"
    samples = num_samples if num_samples is not None else cfg.data.max_train_samples
    return schedule_span(cfg, cfg.train.world_size, samples)


def total_train_steps(cfg: Config, world_size: int, num_samples: int | None) -> int:
    """Optimizer steps the LR schedule spans: train.max_steps, or the steps `epochs` passes over
    `num_samples` samples give (the smaller when both are known)."""
    t = cfg.train
    per_step = t.micro_batch_size * t.grad_accum * world_size
    from_data = None if num_samples is None else t.epochs * (num_samples // per_step)
    if from_data is not None and from_data < 1 and t.max_steps is None:
        raise ValueError(
            f"{num_samples} samples make no full step of {per_step} samples (micro_batch_size x grad_accum "
            "x world_size): capture more data or lower train.micro_batch_size"
        )
    if t.max_steps is None and from_data is None:
        raise ValueError(
            "the LR schedule needs its length: set train.max_steps or data.max_train_samples "
            "(or pass the number of captured samples)"
        )
    if t.max_steps is not None and t.max_steps < 1:
        raise ValueError(f"train.max_steps must be >= 1, got {t.max_steps}")
    steps = [s for s in (t.max_steps, from_data) if s is not None and s >= 1]
    return min(steps)
