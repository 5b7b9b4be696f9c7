"""Everything DeepSpeed-specific of the trainer (as torchtitan's parallelize.py): the wrapped
training module, the engine build, per-parameter gradient norms, the ZeRO-3 gather for
exports, and checkpoint loading with the universal-checkpoint fixes. trainer/loop.py calls
these and nothing else of DeepSpeed beyond the engine's own forward/backward/step/save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_dist.config import Config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.fused import resolve_kernels
from dflash_dist.model.loss import Anchors, dflash_loss
from dflash_dist.target.loading import load_embeddings
from dflash_dist.trainer import checkpoint, universal, zero_step
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from dflash_dist.trainer.safe_load import weights_only_loads


class TrainForward(nn.Module):
    """The module DeepSpeed wraps: the drafter plus the DFlash loss, so engine(...) runs the
    whole training forward (ZeRO-3 gathers parameters through its module hooks) and returns
    the loss tensor for DeepSpeed's backward hooks next to the full LossOutput.
    `loss_denominator` (train.loss_norm "step_slots"): the loss is sum(w*CE) / it instead of
    this micro-batch's own sum(w). `anchor_starts/ends` (train.packing): each anchor's document
    bounds in a packed row (loss.Anchors). `rows`: the batch's supervised slots found on the host
    (loss.supervised_rows; None: the loss finds them with a host sync). `block_mask`: how flex's
    block mask is built (attention.block_mask_flex; "create" is torch's create_block_mask, for benchmarks)."""

    block_mask = "direct"

    def __init__(
        self, drafter: DFlashDrafter, label_source: str, gamma: float | None, attention: str,
        position_weighting: str = "decay",
    ) -> None:  # fmt: skip
        super().__init__()
        self.drafter = drafter
        self.label_source, self.gamma, self.attention = label_source, gamma, attention
        self.position_weighting = position_weighting

    def forward(
        self, input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep, loss_denominator=None,
        anchor_starts=None, anchor_ends=None, rows=None,
    ):
        extra = {} if loss_denominator is None else {"loss_denominator": loss_denominator}
        if rows is not None:
            extra["rows"] = rows
        out = dflash_loss(
            self.drafter,
            input_ids,
            features,
            loss_mask,
            Anchors(anchor_positions, anchor_keep, anchor_starts, anchor_ends),
            target_argmax=target_argmax,
            label_source=self.label_source,
            gamma=self.gamma,
            attention=self.attention,
            position_weighting=self.position_weighting,
            block_mask=self.block_mask,
            **extra,
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
    schedule_unit: str = "step",
):
    """The DeepSpeed engine over a fresh drafter sharing the target's frozen embedding/lm_head.
    Every rank seeds identically, so ZeRO-3 partitions come from one initialisation.
    `load_universal`: it will load a universal checkpoint (an elastic resume). The LR schedule
    spans `total_steps` optimizer steps, or samples with `schedule_unit` "sample"."""
    import deepspeed  # imported late: the actor sets DS_ACCELERATOR / CUDA_VISIBLE_DEVICES first

    torch.manual_seed(cfg.run.seed)
    t = cfg.train
    drafter = DFlashDrafter(drafter_config, kernels=resolve_kernels(t.kernels, on_gpu))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    drafter.set_target_weights(*load_embeddings(Path(target_dir), f"trainer rank {rank}"))
    module = TrainForward(drafter, t.label_source, t.gamma, t.attention, t.position_weighting)
    optimizer = build_optimizer(cfg, module, fused=on_gpu)
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=build_lr_schedule(cfg, optimizer, total_steps, schedule_unit),
        config=deepspeed_config(
            cfg, world_size, on_gpu, hidden_size=drafter_config.hidden_size, load_universal=load_universal
        ),
        dist_init_required=False,
    )
    # DeepSpeed's step, lean, or fused (on a GPU in place, with the device-side epilogue wait)
    zero_step.install(engine, t.optimizer_step, on_gpu, **zero_step.trainer_options(t.optimizer_step, on_gpu))
    return engine


def skipped_steps(engine) -> int:
    """Optimizer steps skipped for a non-finite gradient: DeepSpeed's count (its overflow skip, kept
    in its checkpoints: since step 0) plus the lean step's device counter (zero_step.py; this run's).
    Read at the end of a run (the lean counter costs a host sync)."""
    lean = getattr(engine.optimizer, "dflash_skipped_steps", None)
    return int(engine.skipped_steps) + (int(lean) if lean is not None else 0)


def param_grad_norms(engine) -> torch.Tensor:
    """L2 norm of each trainable drafter parameter's full gradient (after backward, before
    the step; a collective under ZeRO, every rank calls it). A layer that gets no gradient
    (e.g. a captured layer fc ignores) shows up as a spike at 0 in the histogram."""
    from deepspeed.utils import safe_get_full_grad

    norms = []
    for name, p in engine.module.drafter.named_parameters():
        if name in DFlashDrafter.TARGET_KEYS:
            continue
        g = safe_get_full_grad(p)
        norms.append(float("nan") if g is None else float(g.detach().float().norm()))
    return torch.tensor(norms, dtype=torch.float64)


@contextlib.contextmanager
def gathered_drafter(engine) -> Iterator[DFlashDrafter]:
    """The drafter with its own (non-target) weights whole on every rank: under ZeRO-3 a
    gather (a collective: every rank enters), otherwise the module as it is."""
    import deepspeed

    drafter = engine.module.drafter
    own = [p for n, p in drafter.named_parameters() if n not in DFlashDrafter.TARGET_KEYS]
    gather = (
        deepspeed.zero.GatheredParameters(own, modifier_rank=None)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )
    with gather:
        yield drafter


def save_checkpoint(engine, ckpt_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
    """Every rank's DeepSpeed files of `tag` (not yet published: checkpoint.commit does that).
    The frozen target weights are left out: they come from the target on resume."""
    engine.save_checkpoint(
        str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False, exclude_frozen_parameters=True
    )


def load_checkpoint(engine, path: Path, elastic: bool, group: Any = None) -> dict[str, Any]:
    """Load the tag directory `path` into every rank's engine (weights, AdamW moments, LR
    schedule) and return its client state. `elastic` (saved at another world size): rank 0
    converts the tag to a universal checkpoint once (universal.py), every engine re-partitions
    it (the engine must have been built with load_universal=True), and two defects of
    DeepSpeed 0.19.8's ZeRO-3 universal load are undone."""
    assert engine.load_universal_checkpoint() == elastic, "build_engine(load_universal=) must match"
    load_dir, tag = path.parent, path.name
    if elastic:
        load_dir, tag = path, universal.ensure_universal(path, group=group).name
    groups = [dict(g) for g in engine.optimizer.param_groups]
    # strict=False: the frozen target weights are not in the checkpoint (set from the target)
    with weights_only_loads():  # DeepSpeed's torch.load calls unpickle nothing (safe_load.py)
        loaded, client = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=False)
    if loaded is None:
        raise checkpoint.ResumeError(f"{path} could not be loaded by DeepSpeed")
    if elastic:
        # every param group gets group 0's hyperparameters (our no-decay group would decay)
        for group_, before in zip(engine.optimizer.param_groups, groups):
            group_.update({k: v for k, v in before.items() if k not in ("params", "lr", "initial_lr")})
        place_loaded_steps(engine.optimizer.optimizer)
    return client


def place_loaded_steps(optimizer: torch.optim.Optimizer) -> None:
    """After DeepSpeed's universal load: each AdamW `step` its own tensor, where torch's
    load_state_dict would have put it. DeepSpeed 0.19.8 sets one `step` tensor on every flat
    partition (ZeRO-3), and AdamW increments it in place once per partition: each optimizer step
    would count several times. And it sets the tensor as the converter stored it, on the CPU:
    fused AdamW (torch's kernel, the GPU default, and the one-kernel step of trainer/fused_adamw.py)
    reads the step on the parameter's device, so there it goes beside the parameter, in fp32, as
    torch's own load places a fused or capturable group's step."""
    groups = optimizer.param_groups
    group_of = {id(p): g for g in groups for p in g["params"]}
    for p, state in optimizer.state.items():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        # ZeRO-3 swaps its sub-groups' partitions in and out of the groups (build_optimizer sets the
        # same flags on every group): a partition not in one now goes by any group's
        group = [group_of[id(p)]] if id(p) in group_of else groups
        on_device = any(g.get("fused") or g.get("capturable") for g in group)
        state["step"] = step.to(device=p.device, dtype=torch.float32, copy=True) if on_device else step.clone()


def schedule_length(engine) -> tuple[int, str]:
    """The engine's LR schedule length and unit (ds_config.WarmupCosine): steps or samples."""
    fn = engine.lr_scheduler.lr_lambdas[0]
    return fn.total_steps, fn.unit
