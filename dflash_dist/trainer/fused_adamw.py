"""One AdamW kernel for the lean ZeRO step (`train.optimizer_step: fused`, opt-in): the fp32
master weights and both moments are updated in place from the bf16 gradients, and the bf16
parameter partition is written in the same pass, with the clip divisor and the non-finite skip
inside it. One compiled call per partition group: the gradients are first gathered into one flat
bf16 tensor (one multi-tensor copy; none when the partition already is one tensor), and the clip's
norm is one reduction over each gathered partition (zero_step.lean_step).

Without the gather (`step_group_in_place`, zero_step.install(gather=False), bench word `nogather`; the
trainer's GPU engine with this step runs it so, zero_step.trainer_options): one compiled call per group over
the lists of the gradient tensors as DeepSpeed holds them
and the views of the master, the moments and the bf16 partition at each tensor's offset, so no flat copy
(4 B a parameter, 2.9 ms of GPU time a step at the 27B shape on an H100) and the norm is the multi-tensor
one over the list. Every element gets the same kernel arithmetic from the same gradient value as in the
gathered step (the partition's zero pads included: DeepSpeed's list holds them as zero tensors, and a tail
the list does not cover is read from a zero tensor as the gather zero-fills it; from a zero master and zero
moments that update leaves them zero, so skipping pads would also keep the state, but reading them needs no
such argument), so the state is bitwise the gathered step's with the list norm (`norm_of_flat=False`);
against the gathered step's default norm of the flat partitions the clip divisor differs in the last bits
(another summation order). Host time a step on the 2-core CPU (bench/bench_adamw_host.py: the 27B drafter's
58 tensors in 2 groups, dimensions / 256, norm to update): 2.0 ms against the gathered step's 1.1 (1.4 with
the list's norm) and a call per tensor's 6.9. On the GPU DeepSpeed's end-of-backward synchronize waited
129-145 ms a step before the gather (docs/BENCHMARKS.md, thirteenth lease, call D); with it replaced by a
stream wait (`epiwait`) the host should reach the step that far ahead and its time there be hidden. The
cost: a cold compile of the two list graphs took 80-100 s on this CPU (the gathered kernel's one graph
7 s), once per process (the inductor cache keeps it). On an H100 (docs/BENCHMARKS.md, fourteenth session, call S)
its gpu test is bitwise the gathered step and the optimizer phase went 21.4 -> 18.7 ms under `epiwait`; on two
more H100s (sixteenth session) 21.3 -> 18.4 ms, the step faster than the gathered one in 6 pairs of 6.

Why: the lean step with torch's fused AdamW moves ~46 bytes per parameter: the bf16 gradients
copied into an fp32 flat partition (6 B), torch's kernel (32 B: with `grad_scale` it also writes
the unscaled fp32 gradient back) and the fp32 master copied to the bf16 partition (6 B), plus the
norm's read (2 B). This path moves 34 B (4 B gather, 28 B kernel, 2 B norm).

Measured (docs/BENCHMARKS.md, fifth lease) in its former per-tensor form (one call per gradient
tensor, the same arithmetic):
at the 27B shape and world size 1 the optimizer phase went 25 -> 16-20 ms, but on a 1/9 slice (one
of 9 ranks) it took 15.5 ms against the lean step's 3.8: each compiled call costs ~0.1-0.25 ms of
host time, 58 tensors a step. Hence the flat gather and one call per group; that form is not yet
measured on the GPU, so "auto" stays on the lean step.

Numerics: the arithmetic of torch's fused AdamW (ATen `adam_math`, ADAMW mode), with its roundings:
the gradient divided by the clip divisor, the decay, both moments and the bias corrections are
formed in fp64 (adam_math mixes its double hyper-parameters into those lines) and rounded to fp32
where adam_math rounds them; the step size, denominator and update are fp32. The compiler (Triton
on CUDA, C++ on CPU, both through torch.compile) may contract a multiply and an add where nvcc
contracts others, so it is not bitwise torch's kernel: on the H200 (per-tensor form) the fp32
masters after 6 steps agreed within rtol 1e-5 / atol 1e-6 and most elements differed in the last
bits (tests/test_zero_step.py, CPU and `-m gpu`).

Compiled through `strict_compile` (dflash_dist/strict_compile.py), as the drafter's kernels: never run
eagerly (past RECOMPILE_LIMIT or at a graph break an error; a disabled torch.compile is refused when
zero_step installs the step).

State: the same `step` / `exp_avg` / `exp_avg_sq` tensors torch's AdamW keeps (created as it
creates them), so checkpoints keep DeepSpeed's format and resume under either step.
"""

from __future__ import annotations

import functools

import torch

from dflash_dist.strict_compile import strict_compile

F64 = torch.float64
F32 = torch.float32


def _adamw(p, m, v, g, out, lr_wd, step_size, bc2_sqrt, scale, skip, beta1: float, beta2: float, eps: float):
    """In place: p, m, v (fp32), out (p's low-precision copy) from g. The per-step scalars are 0-d
    device tensors formed once a step by `_scalars` (so the LR schedule and the clip never recompile,
    and no element recomputes a pow): lr * weight_decay (fp64), the step size and sqrt of the second
    bias correction (fp32, as adam_math holds them), the clip divisor and the skip flag (fp32)."""
    grad = (g.to(F64) / scale.to(F64)).to(F32)
    pd = p.to(F64)
    p1 = (pd - lr_wd * pd).to(F32)
    gd = grad.to(F64)
    m1 = (beta1 * m.to(F64) + (1.0 - beta1) * gd).to(F32)
    v1 = (beta2 * v.to(F64) + ((1.0 - beta2) * gd) * gd).to(F32)
    denom = ((torch.sqrt(v1) / bc2_sqrt).to(F64) + eps).to(F32)
    p2 = p1 - (step_size * m1) / denom
    keep = skip > 0
    p_new = torch.where(keep, p, p2)
    m.copy_(torch.where(keep, m, m1))
    v.copy_(torch.where(keep, v, v1))
    p.copy_(p_new)
    out.copy_(p_new.to(out.dtype))


def _scalars(step: torch.Tensor, lr: float, wd: float, beta1: float, beta2: float):
    """adam_math's per-step scalars from the (already advanced) step count, on its device: the bias
    corrections in fp64 rounded to fp32, the step size lr / bc1 in fp64 rounded to fp32."""
    s = step.to(F64)
    lr64 = torch.full((), lr, dtype=F64, device=step.device)
    bc1 = (1.0 - torch.pow(beta1, s)).to(F32)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, s)).to(F32)
    return lr64 * wd, (lr64 / bc1.to(F64)).to(F32), bc2_sqrt


# compiles the kernel may take (dynamic shapes: one per gradient/weight dtypes and devices; the CPU tests'
# fp32 engines take 1 over all their steps, clipped or not); dynamo's default is 8 per function, past
# which plain torch.compile runs the call eagerly
RECOMPILE_LIMIT = 16


@functools.cache
def _kernel():
    """`_adamw` through torch.compile, never eagerly (dflash_dist/strict_compile.py): one graph for every
    slice length (dynamic shapes); fullgraph, so a graph break raises; past RECOMPILE_LIMIT compiles (in any
    thread) an error naming the setting. Eagerly the fp64 temporaries would be materialised, ~8 B per
    parameter each, and the update would take eager's roundings under the kernel's name."""
    return strict_compile(
        _adamw,
        dynamic=True,
        limit=RECOMPILE_LIMIT,
        disabled="the one-kernel AdamW (dflash_dist/trainer/fused_adamw.py): torch.compile is disabled in this "
        "process (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1), so train.optimizer_step=fused would run it "
        "eagerly (fp64 temporaries of ~8 B per parameter each); unset it, or set train.optimizer_step=lean",
        past_limit=f"the one-kernel AdamW (dflash_dist/trainer/fused_adamw.py, train.optimizer_step=fused) met "
        f"more input dtypes/devices than its {RECOMPILE_LIMIT} compiles: torch.compile would run it eagerly from "
        "here on (fp64 temporaries of ~8 B per parameter each, other roundings than its compiled calls); stopped "
        "instead. TORCH_LOGS=recompiles shows what changed; raise "
        "dflash_dist.trainer.fused_adamw.RECOMPILE_LIMIT, or set train.optimizer_step=lean",
    )


def _adamw_lists(ps, ms, vs, gs, outs, lr_wd, step_size, bc2_sqrt, scale, skip, beta1: float, beta2: float,
                 eps: float):  # fmt: skip
    """`_adamw` on each (master, moment, moment, gradient, bf16) tensor of the lists in turn: one graph per
    group (dynamo unrolls the loop), one kernel per tensor or per tensors of one size (inductor fuses those),
    each element the same arithmetic as in the flat call. The views alias one master (moment, bf16) partition
    without overlapping: AOTAutograd mutates each in place (no synthetic base, no copy of the partition)."""
    for p, m, v, g, out in zip(ps, ms, vs, gs, outs):
        _adamw(p, m, v, g, out, lr_wd, step_size, bc2_sqrt, scale, skip, beta1, beta2, eps)


# compiles the list form may take: one per group structure (its list's length, dtypes, and which tensor
# lengths are 0/1 or equal: dynamic shapes specialise those), so at least one per partition group (the 27B
# drafter: 2); a test process builds several engines
LIST_RECOMPILE_LIMIT = 32


@functools.cache
def _list_kernel():
    """`_adamw_lists` through strict_compile, as `_kernel` (dynamic shapes, fullgraph, never eagerly)."""
    return strict_compile(
        _adamw_lists,
        dynamic=True,
        limit=LIST_RECOMPILE_LIMIT,
        disabled="the one-kernel AdamW without the gather (dflash_dist/trainer/fused_adamw.py): torch.compile is "
        "disabled in this process (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1), so it would run eagerly "
        "(fp64 temporaries of ~8 B per parameter each); unset it, or set train.optimizer_step=lean",
        past_limit=f"the one-kernel AdamW without the gather (dflash_dist/trainer/fused_adamw.py, "
        f"zero_step.install(gather=False)) met more gradient-list structures than its {LIST_RECOMPILE_LIMIT} "
        "compiles: torch.compile would run it eagerly from here on; stopped instead. TORCH_LOGS=recompiles shows "
        "what changed; raise dflash_dist.trainer.fused_adamw.LIST_RECOMPILE_LIMIT, or keep the gather",
    )


def supports(optimizer: torch.optim.Optimizer, group: dict) -> str | None:
    """Why this kernel cannot stand in for `optimizer`'s step on param group `group` (None: it can):
    AdamW's arithmetic only (decoupled decay; torch's Adam with weight decay adds L2 to the gradient)."""
    if "betas" not in group or "eps" not in group:
        return f"{type(optimizer).__name__} (an Adam-family optimizer is needed)"
    for key, ok in (("amsgrad", False), ("maximize", False), ("capturable", False), ("differentiable", False)):
        if bool(group.get(key, False)) != ok:
            return f"AdamW {key}={group.get(key)}"
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    if float(group.get("weight_decay", 0.0)) != 0.0 and not decoupled:
        return f"{type(optimizer).__name__} with L2 weight decay (not AdamW's decoupled decay)"
    if torch.is_tensor(group.get("lr")):
        return "a tensor learning rate"
    return None


def _state(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    """torch AdamW's state for `master`, created as torch's fused AdamW creates it."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=F32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _begin(optimizer: torch.optim.Optimizer, group: dict, master: torch.Tensor, scale: torch.Tensor | None,
           found_inf: torch.Tensor) -> tuple[dict, tuple]:
    """The step count advanced and the kernel's arguments after the five tensors (per-step scalars, clip
    divisor, skip flag, betas, eps), for either form of the call."""
    state = _state(optimizer, master)
    beta1, beta2 = (float(b) for b in group["betas"])
    scale = torch.ones((), dtype=F32, device=master.device) if scale is None else scale.to(F32)
    state["step"] += 1
    lr_wd, step_size, bc2_sqrt = _scalars(state["step"], float(group["lr"]), float(group["weight_decay"]), beta1, beta2)
    return state, (lr_wd, step_size, bc2_sqrt, scale, found_inf, beta1, beta2, float(group["eps"]))


def _end(optimizer: torch.optim.Optimizer, state: dict, found_inf: torch.Tensor) -> None:
    state["step"] -= found_inf
    # what torch's step wrapper records: the LR scheduler would otherwise warn that its first step
    # came before the optimizer's and that it skipped a value (it does not skip one)
    optimizer._opt_called = True


@torch.no_grad()
def step_group(
    optimizer: torch.optim.Optimizer,
    group: dict,
    master: torch.Tensor,
    grad: torch.Tensor,
    low: torch.Tensor,
    scale: torch.Tensor | None,
    found_inf: torch.Tensor,
) -> None:
    """One AdamW step of the flat fp32 `master` (the only param of `group`) from `grad`, the flat
    gradient partition (its zero pad included; zero_step._flat gathers it, any float dtype), writing
    the updated weights also into `low` (the bf16 partition). One kernel call per group, not one per
    tensor: each compiled call costs ~0.1-0.25 ms of host time (guards, wrapper), which at 1/9 of
    the 27B drafter's parameters (58 tensors) made the step host-bound, 15.5 ms against the lean
    step's 3.8 (docs/BENCHMARKS.md).
    `scale` divides the gradients (None: 1); `found_inf` 1.0 skips the update and the step count."""
    state, args = _begin(optimizer, group, master, scale, found_inf)
    _kernel()(master, state["exp_avg"], state["exp_avg_sq"], grad, low, *args)
    _end(optimizer, state, found_inf)


def partition_views(grads: list[torch.Tensor], master: torch.Tensor, dtype: torch.dtype):
    """The gradient list as the flat partition `zero_step._flat` would gather it, without the copy: each
    tensor flattened (a view) in `dtype` (cast only where it has another, as the gather's copy casts), empty
    ones dropped, and a zero tensor for a tail the list does not cover (the gather zero-fills it); and the
    lengths, in partition order, that cut `master` (the moments, the bf16 partition) into views."""
    flat = [g.reshape(-1) if g.dtype == dtype else g.reshape(-1).to(dtype) for g in grads if g.numel()]
    sizes = [g.numel() for g in flat]
    used, size = sum(sizes), master.numel()
    assert used <= size, f"gradient partition holds {used} > {size} elements"
    if used < size:
        flat.append(torch.zeros(size - used, dtype=dtype, device=master.device))
        sizes.append(size - used)
    return flat, sizes


@torch.no_grad()
def step_group_in_place(
    optimizer: torch.optim.Optimizer,
    group: dict,
    master: torch.Tensor,
    grads: list[torch.Tensor],
    low: torch.Tensor,
    scale: torch.Tensor | None,
    found_inf: torch.Tensor,
) -> None:
    """`step_group` reading each gradient tensor of the partition where it is (no gather): DeepSpeed's list
    for the group (whole gradients, the parts of those the partition boundary cuts, zero pads), laid end to
    end over the partition. One compiled call over the lists (`_adamw_lists`): the master, both moments and
    `low` cut into views at each tensor's offset. A list that is one tensor of the partition's length is
    that flat gradient (the gathered step reads it so too)."""
    if len(grads) == 1 and grads[0].is_contiguous() and grads[0].numel() == master.numel():
        return step_group(optimizer, group, master, grads[0].reshape(-1), low, scale, found_inf)
    state, args = _begin(optimizer, group, master, scale, found_inf)
    flat, sizes = partition_views(grads, master, low.dtype)
    ps, ms, vs, outs = (list(t.split(sizes)) for t in (master, state["exp_avg"], state["exp_avg_sq"], low))
    _list_kernel()(ps, ms, vs, flat, outs, *args)
    _end(optimizer, state, found_inf)
