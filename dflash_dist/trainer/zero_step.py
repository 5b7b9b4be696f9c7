"""A lean optimizer step for DeepSpeed's ZeRO-1/2 optimizer (`train.optimizer_step: lean`).

DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer.step` spends ~43 ms of a 256 ms step at the 27B
drafter shape (H200, world size 1) around a 14 ms fused AdamW (docs/BENCHMARKS.md): a separate
inf/nan pass with a host read, a gradient norm that first copies every bf16 gradient to fp64,
a bf16 flatten followed by a second copy to fp32, an unscale/clip pass over the fp32 partition,
and many small launches. This step keeps DeepSpeed's bookkeeping, partitions, all-gather and
checkpoint state exactly (same torch AdamW, same fp32 master partition, same state tensors), and
changes only the arithmetic around AdamW:

- the norm: one `_foreach_norm` over the partition's gradients, accumulated in fp32 (DeepSpeed:
  fp64 copies of each gradient), summed over the data-parallel ranks, never read on the host;
- the cast: each bf16 gradient copied once into the fp32 flat partition (DeepSpeed: flatten in
  bf16, then a second copy to fp32);
- clip and overflow: with torch's fused AdamW (the GPU default) the clip factor and a
  non-finite-norm flag go into the kernel (`grad_scale`, `found_inf`, as torch's GradScaler
  passes them): no unscale pass, no inf/nan pass, no host sync. A non-finite gradient skips the
  update on the device (AdamW's step count is restored), also with `train.grad_overflow_check:
  false` (DeepSpeed would apply it); the host does not learn of it, so the LR schedule advances
  and `skipped_steps` counts it in `dflash_skipped_steps` (a device tensor), not DeepSpeed's.
  Without fused AdamW (CPU) the clip is DeepSpeed's multiply and a non-finite norm is read on the
  host: the step is skipped as DeepSpeed's skips it (no update, AdamW's state untouched, the
  engine's `skipped_steps` counts it and the LR schedule holds), whatever `check_grad_overflow`
  says, as the kernel's skip (off on the CPU's fp32 engine, where DeepSpeed's own step skips on the
  non-finite norm alone; the lean step had applied the NaN there).

Around it, `cut_grad_path` drops two passes of DeepSpeed's ZeRO-2 gradient path where they cannot
change a bit (on with the lean step; DeepSpeed's own step keeps its path): the divide by a
data-parallel world size of 1, and the copy of each gradient larger than the reduce bucket into
`grads_in_partition` (the step reads it in place). `wait_on_device` turns DeepSpeed's
synchronize at the end of every backward under overlap_comm into a wait of the compute stream on
the reduction stream (no host sync; bitwise on an H100, its timing within noise there alone), and
the one-kernel step can read each gradient where DeepSpeed holds it instead of gathering them first
(`install(gather=False)`, fused_adamw.step_group_in_place; bitwise on an H100, -2.9 ms of optimizer
phase there with `epiwait`). Both are install's options, off by default; the trainer's GPU engine
with the one-kernel step takes both (`trainer_options`).

Numerics: the clip factor differs from DeepSpeed's by fp32 rounding of the norm (~1e-7 relative),
the clipped gradient by one rounding (a divide in the kernel instead of a multiply by the
reciprocal). tests/test_zero_step.py checks loss and weights against DeepSpeed's step on CPU,
the skip, and exact resume; the gradient path cuts bitwise against the lean step without them
(1 and 2 ranks); `pytest -m gpu` the same on CUDA.

Installed per engine by `install` (trainer/engine.py), only for the configuration it was written
against: DeepSpeed 0.19.8, `DeepSpeedZeroOptimizer`, no CPU offload, no MoE, Muon, ZenFlow or
torch-autocast scaler. Anything else keeps DeepSpeed's own step.
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

STEPS = ("auto", "deepspeed", "lean", "fused")
DEEPSPEED_VERSION = "0.19.8"  # the step below mirrors this version's DeepSpeedZeroOptimizer.step


def resolve_step(kind: str, on_gpu: bool) -> str:
    """train.optimizer_step "auto": lean on GPU ranks (where the step's launches and syncs cost),
    DeepSpeed's own on CPU (the pinned loss curve's path). "fused" (opt-in): the lean step with one
    AdamW kernel (trainer/fused_adamw.py; 3% at world size 1, 0.13% at the 27B config's 9 ranks: not the
    default, docs/BENCHMARKS.md's eighth lease)."""
    if kind not in STEPS:
        raise ValueError(f"train.optimizer_step={kind!r}; expected one of {STEPS}")
    if kind == "auto":
        return "lean" if on_gpu else "deepspeed"
    return kind


def trainer_options(kind: str, on_gpu: bool) -> dict:
    """`install`'s options the trainer's engine takes (trainer/engine.py): with the one-kernel step on a GPU, each
    gradient read where it is (gather False) and the end-of-backward synchronize as a device-side wait: on two
    H100s (docs/BENCHMARKS.md, sixteenth session) the optimizer phase 21.3 -> 18.4 ms and the 27B step faster than
    the gathered step in all 6 side-by-side pairs (3.2 ms in the means), bitwise the gathered step with the list's
    norm (tests/test_zero_step.py's gpu tests). On the CPU, and with any other step, install's defaults (the pinned
    loss curves' form)."""
    if on_gpu and resolve_step(kind, on_gpu) == "fused":
        return {"gather": False, "epilogue_wait": True}
    return {}


def unsupported(opt) -> str | None:
    """Why the lean step cannot replace this optimizer's step (None: it can)."""
    import deepspeed

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        return f"deepspeed {deepspeed.__version__} (the lean step mirrors {DEEPSPEED_VERSION})"
    if type(opt).__name__ != "DeepSpeedZeroOptimizer":
        return f"optimizer {type(opt).__name__} (ZeRO stage 1/2 only)"
    reasons = {
        "CPU offload": getattr(opt, "cpu_offload", True),
        "MoE layers": getattr(opt, "has_moe_layers", True),
        "ZenFlow": getattr(opt, "zenflow", True),
        "a torch autocast grad scaler": getattr(opt, "torch_autocast_gradscaler", True),
        "Muon": any(getattr(p, "use_muon", False) for g in opt.bit16_groups for p in g),
        "a dynamic loss scale": getattr(opt, "dynamic_loss_scale", True),
    }
    found = [k for k, v in reasons.items() if v]
    return ", ".join(found) if found else None


def install(engine, kind: str, on_gpu: bool, grad_cuts: bool = True, epilogue_wait: bool = False,
            norm_of_flat: bool = True, gather: bool = True) -> str:
    """Give `engine`'s ZeRO optimizer the lean step when train.optimizer_step `kind` asks for it;
    returns the step in use. "lean" that cannot apply is an error naming why; "auto" then keeps
    DeepSpeed's step (ZeRO-3, offload, another DeepSpeed version). With the lean step and
    `grad_cuts`, also `cut_grad_path` (bench_train_step's "dsgrads"/"leangrads" set it); with
    `epilogue_wait`, `wait_on_device` (bench_train_step's "epiwait"; `trainer_options` says when the trainer sets it).
    The one-kernel step ("fused") gathers each group's gradients into one flat partition first; with
    `gather` False (bench_train_step's "nogather"; the trainer's on a GPU) it reads each gradient
    tensor where it is (fused_adamw.step_group_in_place) and the norm is the gradient list's
    (`norm_of_flat` needs the gather)."""
    if not gather and resolve_step(kind, on_gpu) != "fused":
        raise ValueError(f"gather=False is the one-kernel step's (train.optimizer_step=fused), not {kind!r}'s")
    if resolve_step(kind, on_gpu) == "deepspeed":
        return "deepspeed"
    opt = engine.optimizer
    why = unsupported(opt)
    if why is not None:
        if kind != "auto":
            raise ValueError(f"train.optimizer_step={kind} does not support {why}: set train.optimizer_step=deepspeed")
        log.info("optimizer step: DeepSpeed's own (the lean step does not support %s)", why)
        return "deepspeed"
    kernel = resolve_step(kind, on_gpu) == "fused"
    if kernel:
        from dflash_dist.trainer import fused_adamw

        why = next(filter(None, (fused_adamw.supports(opt.optimizer, g) for g in opt.optimizer.param_groups)), None)
        if why is not None:
            raise ValueError(f"train.optimizer_step=fused does not support {why}: set train.optimizer_step=lean")
        fused_adamw._kernel()  # a process with torch.compile disabled is refused here, not at the first step
        if not gather:
            fused_adamw._list_kernel()
        for i, group in enumerate(opt.optimizer.param_groups):  # the kernel updates the flat partition itself
            if len(group["params"]) != 1 or group["params"][0] is not opt.single_partition_of_fp32_groups[i]:
                raise RuntimeError(f"optimizer param group {i} is not DeepSpeed's flat fp32 partition")
    opt.dflash_one_kernel = kernel
    opt.dflash_gather = gather  # the one-kernel step: gradients gathered into flat partitions first
    opt.dflash_norm_of_flat = norm_of_flat and gather  # the one-kernel step: the norm of the gathered partitions
    opt.step = types.MethodType(lean_step, opt)
    opt.dflash_skipped_steps = torch.zeros((), dtype=torch.int64, device=opt.device)
    if grad_cuts:
        log.info("optimizer step: lean; gradient path cuts: %s", ", ".join(cut_grad_path(opt)) or "none apply")
    if epilogue_wait and wait_on_device(opt):
        log.info("optimizer step: the end-of-backward synchronize is a device-side wait")
    return "fused" if kernel else "lean"


def uninstall(engine) -> None:
    """Back to DeepSpeed's own step and gradient path (the bench switches settings on one engine)."""
    opt = engine.optimizer
    vars(opt).pop("step", None)  # the class's step again
    vars(opt).pop("copy_grads_in_partition", None)
    vars(opt).pop("independent_gradient_partition_epilogue", None)
    vars(opt).pop("dflash_one_kernel", None)
    vars(opt).pop("dflash_norm_of_flat", None)
    vars(opt).pop("dflash_gather", None)
    if "dflash_gradient_average" in vars(opt):
        opt.gradient_average = vars(opt).pop("dflash_gradient_average")


def cut_grad_path(opt) -> list[str]:
    """Drop two passes of DeepSpeed's ZeRO-2 gradient path that the lean step does not need, only
    where they cannot change a bit; returns the names of those applied ("average", "copy").

    - "average": with a data-parallel divisor of exactly 1 (one rank, no sequence parallelism,
      no predivide factor) DeepSpeed still runs `div_(1.0)` over every gradient (~2 ms of GPU work
      at the 27B shape, estimated); `gradient_average` off skips it. At more ranks it divides: left on.
    - "copy": a parameter larger than reduce_bucket_size is reduced in its own autograd gradient
      (not in the reused ipg bucket), and DeepSpeed then copies it into `grads_in_partition`
      (1.2-2.7 ms of GPU work, estimated); `_keep_large_grads` leaves it in place. Both cuts
      together measured -0.7 ms a step on the H200 (within the run-to-run spread: with
      overlap_comm this work runs mostly on the reduction stream) and -1.3 GiB of peak memory.
      The gradient is then the same tensor with the same values: the norm, the flat fp32 cast,
      gradient accumulation (the first micro-step's tensors accumulate the later ones, as the
      buffer views did), zero_grad and the
      release in the step see each gradient once, as before. ZeRO-2 with contiguous gradients and
      the low-precision partition path only (not ZeRO-1's boundary reduction, not the fp32
      compact buffer of bf16 + fp32 accumulation): what tests/test_zero_step.py covers, bitwise,
      at 1 and 2 ranks, accumulation 1 and 2, overlap_comm on and off.
    DeepSpeed's own step never gets these (install applies them with the lean step only)."""
    import deepspeed.comm as dist

    cuts = []
    divisor = dist.get_world_size(group=opt.dp_process_group) / float(opt.sequence_parallel_size)
    if opt.gradient_average and divisor == 1.0 and opt.gradient_predivide_factor == 1.0:
        opt.dflash_gradient_average = opt.gradient_average
        opt.gradient_average = False
        cuts.append("average")
    compact = any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups)))
    if opt.partition_gradients and opt.contiguous_gradients and not compact and not opt.cpu_offload:
        opt.copy_grads_in_partition = types.MethodType(_keep_large_grads, opt)
        cuts.append("copy")
    return cuts


def wait_on_device(opt) -> bool:
    """With overlap_comm, DeepSpeed 0.19.8's `independent_gradient_partition_epilogue` (the end of every
    backward) synchronizes the device after queueing the last bucket's reduction on its reduction
    stream (stage_1_and_2.py:1028; train.zero_grad_reduce=reduce also synchronizes per reduce bucket
    during the backward, :2413, which this leaves alone): the host
    waits until the GPU's queue is empty, so it could release the reduce buffers and gradients the
    reduction stream reads, and the step reads the reduced partition. Here the compute stream waits on
    the reduction stream instead, at the same point: every later kernel of the compute stream, the
    step's and those reusing the released memory (the caching allocator reuses a block on the stream
    that allocated it), runs after the reductions queued so far; the host goes on. Nothing else
    changes (the same kernels in the same stream order: bitwise). With train.zero_grad_reduce=reduce the
    per-bucket synchronize of allreduce_and_copy (reached inside the epilogue's last reduce) runs with the
    reduction stream current, so there the wait is on itself, a no-op: that synchronize guards only the
    release of earlier buckets' gradients, none with contiguous_gradients (ds_config sets it); the
    compute stream's order against the reductions is average_tensor's own stream waits. True when
    installed (overlap_comm on).
    install's `epilogue_wait` (bench_train_step's "epiwait"; the trainer's GPU engine with the one-kernel step:
    `trainer_options`): bitwise on CUDA (tests/test_zero_step.py's gpu test passed on H100s, 2026-12-07), its step
    time there within the noise alone; it lets `install(gather=False)` hide its host time."""
    if not opt.overlap_comm:
        return False
    opt.independent_gradient_partition_epilogue = types.MethodType(_epilogue_waiting_on_device, opt)
    return True


def _epilogue_waiting_on_device(self) -> None:
    """DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue with the accelerator's synchronize,
    for this call, a wait of the current stream on the reduction stream (wait_on_device)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    before = vars(acc).get("synchronize")

    def wait(device_index=None) -> None:
        if self.reduction_stream is not None:  # None on a device that orders its work itself (the CPU)
            acc.current_stream().wait_stream(self.reduction_stream)

    acc.synchronize = wait
    try:
        type(self).independent_gradient_partition_epilogue(self)
    finally:
        if before is None:
            vars(acc).pop("synchronize", None)
        else:
            acc.synchronize = before


def _keep_large_grads(self, param, group_idx=None) -> None:
    """DeepSpeedZeroOptimizer.copy_grads_in_partition that leaves a gradient larger than the ipg
    bucket in place (cut_grad_path) and sizes `grads_in_partition` for the others only."""
    if param.numel() > self.reduce_bucket_size:
        return
    if self.grads_in_partition is None:  # DeepSpeed sizes it for every parameter in the partition
        from deepspeed.accelerator import get_accelerator

        size = sum(p.numel() for g in self.params_in_partition for p in g if p.numel() <= self.reduce_bucket_size)
        self.grads_in_partition_offset = 0
        self.grads_in_partition = torch.empty(size, dtype=self.dtype, device=get_accelerator().current_device_name())
    type(self).copy_grads_in_partition(self, param, group_idx)


def _fused(opt) -> bool:
    return all(bool(g.get("fused")) for g in opt.optimizer.param_groups)


def _grad_tensors(opt, i: int) -> list[torch.Tensor]:
    """Group i's gradient partition as DeepSpeed holds it: one pre-flattened tensor or the list
    get_flat_partition made (gradient views and zero pads)."""
    pre = opt._get_preflattened_grad_partition(i)
    return [pre] if pre is not None else list(opt.averaged_gradients[i])


# The gradient list's norm (the in-place one-kernel step's): "foreach", torch's multi-tensor norm over the list; or
# "split", one vector_norm for each tensor of at least SPLIT_NUMEL elements and the multi-tensor norm over the rest
# (opt-in, bench word normsplit). The multi-tensor kernels take a few hundred 64K-element chunks a launch: at the
# 27B shape ~80 launches over 3.46 GB, 1.6 ms on an H100 (~2.2 TB/s). The same sums in another order.
LIST_NORMS = ("foreach", "split")
SPLIT_NUMEL = 1 << 20
_list_norm = {"form": "foreach"}


def set_list_norm(form: str) -> None:
    if form not in LIST_NORMS:
        raise ValueError(f"list norm {form!r}; expected one of {LIST_NORMS}")
    _list_norm["form"] = form


def _list_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if _list_norm["form"] == "foreach":
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    big = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors if t.numel() >= SPLIT_NUMEL]
    small = [t for t in tensors if t.numel() < SPLIT_NUMEL]
    return big + (list(torch._foreach_norm(small, 2, dtype=torch.float32)) if small else [])


@torch.no_grad()
def global_norm(opt, grads: list[list[torch.Tensor]], flat: bool = False) -> torch.Tensor:
    """L2 norm of all groups' gradient partitions over the data-parallel ranks, fp32, on the
    device (DeepSpeed's get_grad_norm_direct without the fp64 copies and the -1 sentinel).
    `flat`: each group is one flat partition (the one-kernel step's gather), reduced by one
    vector_norm each instead of the multi-tensor norm over the gradient list (the same sum in
    another order: the norm differs in the last bits)."""
    import deepspeed.comm as dist

    tensors = [g for group in grads for g in group if g.numel()]
    sq = torch.zeros((), dtype=torch.float32, device=opt.device)
    if tensors:
        if flat:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in tensors]
        else:
            norms = _list_norms(tensors)
        sq = torch.linalg.vector_norm(torch.stack(norms)).square()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
    return sq.sqrt()


def clip_scale(opt, norm: torch.Tensor) -> torch.Tensor | None:
    """DeepSpeed's combined unscale/clip divisor (unscale_and_clip_grads), on the device; None when
    there is nothing to scale."""
    if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
        return None
    scale = torch.full((), float(opt.loss_scale), dtype=torch.float32, device=norm.device)
    if opt.clip_grad > 0.0:
        finite = torch.where(torch.isfinite(norm), norm, torch.full_like(norm, float("inf")))
        scale = torch.clamp(((finite / opt.loss_scale) + 1e-6) / opt.clip_grad, min=1.0) * opt.loss_scale
    return scale


def _flat(opt, i: int, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Group i's gradients copied once into a flat partition of `dtype` (zero padded to the
    partition size, as flatten_dense_tensors_aligned pads the last rank's): fp32 for torch's
    AdamW, the gradients' own dtype for the one-kernel AdamW."""
    master = opt.single_partition_of_fp32_groups[i]
    size = int(opt.partition_size[i])
    flat = torch.empty(size, dtype=dtype, device=master.device)
    sizes = [g.numel() for g in grads]
    used = sum(sizes)
    assert used <= size, f"gradient partition of group {i} holds {used} > {size} elements"
    if grads:
        torch._foreach_copy_(list(flat[:used].split(sizes)), [g.reshape(-1) for g in grads])
    if used < size:
        flat[used:].zero_()
    return flat


def _gather(opt, i: int, grads: list[torch.Tensor]) -> torch.Tensor:
    """Group i's gradient partition as the one flat tensor the one-kernel AdamW reads: the partition
    itself when it already is one (no copy), else one copy in the gradients' dtype (bf16)."""
    master = opt.single_partition_of_fp32_groups[i]
    if len(grads) == 1 and grads[0].is_contiguous() and grads[0].numel() == master.numel():
        return grads[0].reshape(-1)
    return _flat(opt, i, grads, opt.parallel_partitioned_bit16_groups[i][0].dtype)


def lean_step(self, closure=None) -> None:
    """DeepSpeedZeroOptimizer.step (0.19.8, no offload) with the norm, cast, clip and overflow
    handling of the module docstring; bound to the optimizer instance by `install`."""
    import deepspeed.comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    self.micro_step_id = INITIAL_MICRO_STEP_ID
    self._wait_for_offload_copies()
    self.overflow = False
    groups = range(len(self.bit16_groups))
    grads = [_grad_tensors(self, i) for i in groups]
    one_kernel = getattr(self, "dflash_one_kernel", False)
    gather = one_kernel and getattr(self, "dflash_gather", True)  # else each gradient read where it is
    of_flat = one_kernel and getattr(self, "dflash_norm_of_flat", True)  # install keeps it False without the gather
    if of_flat:  # the flat bf16 partitions the kernel reads, gathered first: the norm reads them, not the list
        grads = [[_gather(self, i, g)] for i, g in enumerate(grads)]
    norm = global_norm(self, grads, flat=of_flat)
    scale = clip_scale(self, norm)
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    fused = one_kernel or _fused(self)  # the clip and the skip happen inside the kernel
    if not fused and bool(found_inf):  # host read: the non-fused (CPU) path only
        self.overflow = True
    self._global_grad_norm = norm if self.compute_grad_norm else None
    self._update_scale(self.overflow)
    if self.overflow:  # DeepSpeed's skip: drop the gradients, no update, the engine counts it
        self.zero_grad(set_to_none=True)
        for i in groups:
            self._release_preflattened_grad_buffers(i)
            self.averaged_gradients[i] = None
            self.all_grad_tensors[i] = None
        return
    self.dflash_skipped_steps += found_inf.to(torch.int64)
    for i in groups:
        partition_id = dist.get_rank(group=self.real_dp_process_group[i])
        master = self.single_partition_of_fp32_groups[i]
        low = self.parallel_partitioned_bit16_groups[i][partition_id]
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        g = grads[i]
        if one_kernel and not gather:  # the list itself: the kernel reads each gradient where it is
            flat = g
        else:
            flat = _gather(self, i, g) if one_kernel else _flat(self, i, g, master.dtype)  # fp32 for torch's AdamW
        grads[i] = g = None
        self.free_grad_in_param_list(self.params_in_partition[i])
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None
        inner = self.optimizer
        if one_kernel:  # bf16 gradients in, fp32 master and bf16 partition out, in one pass
            from dflash_dist.trainer import fused_adamw

            step = fused_adamw.step_group if gather else fused_adamw.step_group_in_place
            step(inner, inner.param_groups[i], master, flat, low, scale, found_inf)
            flat = None
            self._lazy_init_hp_params_optimizer_state()
            continue
        master.grad = flat
        if fused:  # clip and skip inside torch's fused AdamW kernel (GradScaler's interface)
            inner.grad_scale, inner.found_inf = scale, found_inf
        elif scale is not None:
            flat.mul_(1.0 / scale)
        try:
            self._optimizer_step(i)
        finally:
            if fused:
                del inner.grad_scale, inner.found_inf
        master.grad = None
        del flat
        low.data.copy_(master.data)
    all_gather_dp_groups(
        groups_flat=self.bit16_groups_flat,
        partitioned_param_groups=self.parallel_partitioned_bit16_groups,
        dp_process_group=self.real_dp_process_group,
        start_alignment_factor=self.nccl_start_alignment_factor,
        allgather_bucket_size=self.allgather_bucket_size,
    )
    for i in groups:
        self._update_model_bit16_weights(i)
