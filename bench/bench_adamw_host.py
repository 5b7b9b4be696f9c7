"""Host time of the one-kernel AdamW step with and without the gradient gather (trainer/fused_adamw.py), at
the 27B drafter's tensor count: its 58 trainable tensors (36 matrices decayed, 22 norm gains not: DeepSpeed's
two partition groups) built on the meta device and each dimension divided by --scale.

Each step runs zero_step's code from the norm to the update, as lean_step runs it at world size 1 with the
gradient-path cuts: the gradient list as DeepSpeed holds it (the tensors past the reduce bucket in their own
tensors, the others views into one `grads_in_partition` buffer), the clip's norm (global_norm), the clip
divisor and skip flag, then per group the update. Modes:

- `gather`: the gathered step (install's default): each group gathered into one flat bf16 partition
  (zero_step._gather), the norm of those partitions, one compiled call per group (fused_adamw.step_group);
- `gather_list`: the same with the norm of the gradient list (bench word gnormlist);
- `in_place`: no gather (bench word nogather): the norm of the list, one compiled call per group over the
  lists of gradients and master/moment/bf16 views (fused_adamw.step_group_in_place);
- `per_tensor`: the form of the fifth lease (a compiled flat-kernel call per gradient tensor), for reference.

Host ms: the wall time of the step's Python without a device sync (on the CPU the kernels run inside it, so
small --scale values keep that share small); on CUDA also the step's device ms (a sync after each step).
The first step of each mode compiles (its seconds are printed; the inductor cache makes reruns faster).

    python bench/bench_adamw_host.py                           # CPU, dims / 64
    python bench/bench_adamw_host.py --device cuda --scale 1 --modes gather,in_place
        # the 27B shape on a GPU: 3.5 GiB of gradients, ~24 GiB a mode (fp32 master and moments, bf16 partition)
        # and the gather's 3.5 GiB partition: two modes fit an H100 (--scale 2 for all four)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from dflash_dist.model.drafter import DFlashDrafter, DrafterConfig
from dflash_dist.trainer import fused_adamw, zero_step

MODES = ("gather", "gather_list", "in_place", "per_tensor")


def shapes_27b() -> list[tuple[int, ...]]:
    """The 27B drafter's trainable parameter shapes in model order (bench_train_step.py's defaults)."""
    dc = DrafterConfig(hidden_size=5120, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=17408, vocab_size=248320, target_layer_ids=(1, 16, 31, 46, 61),
                       num_target_layers=64, block_size=16, mask_token_id=248320 - 250)  # fmt: skip
    with torch.device("meta"):
        drafter = DFlashDrafter(dc)
    return [tuple(p.shape) for p in drafter.parameters() if p.requires_grad]


class Gradients:
    """The gradients of the two groups as DeepSpeed holds them at world size 1 with the gradient-path cuts: the
    tensors past `bucket` elements at full scale in their own tensors, the others views into one buffer
    (`grads_in_partition`). The same values every step and in every mode."""

    def __init__(self, shapes, scale: int, bucket: int, dev: torch.device) -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        self.groups = []
        for group in ([s for s in shapes if len(s) >= 2], [s for s in shapes if len(s) < 2]):
            small = [tuple(max(2, d // scale) for d in s) for s in group]  # no length 1: dynamo specialises it
            own = [torch.Size(s).numel() > bucket for s in group]
            buf = torch.randn(sum(torch.Size(s).numel() for s, o in zip(small, own) if not o), generator=g,
                              device=dev).to(torch.bfloat16)  # fmt: skip
            tensors = [torch.randn(s, generator=g, device=dev).to(torch.bfloat16) if o else None
                       for s, o in zip(small, own)]  # fmt: skip
            self.groups.append((small, own, buf, tensors))
        self.sizes = [sum(torch.Size(s).numel() for s in small) for small, *_ in self.groups]

    def lists(self) -> list[list[torch.Tensor]]:
        """This step's gradient lists, new view objects as DeepSpeed builds them each step."""
        out = []
        for small, own, buf, tensors in self.groups:
            lst, o = [], 0
            for s, is_own, t in zip(small, own, tensors):
                if is_own:
                    lst.append(t)
                else:
                    n = torch.Size(s).numel()
                    lst.append(buf.narrow(0, o, n).view(s))
                    o += n
            out.append(lst)
        return out


class State:
    """One mode's optimizer state (~14 B a parameter): per group the flat fp32 master, torch AdamW's moments
    (created at the first step), the bf16 partition; and what zero_step's functions read of DeepSpeed's optimizer."""

    def __init__(self, sizes: list[int], dev: torch.device) -> None:
        g = torch.Generator(device=dev).manual_seed(1)
        self.masters = [torch.randn(n, generator=g, device=dev) * 0.02 for n in sizes]
        self.lows = [m.to(torch.bfloat16) for m in self.masters]
        self.opt = torch.optim.AdamW([{"params": [m], "weight_decay": wd} for m, wd in zip(self.masters, (0.01, 0.0))],
                                     lr=1e-4, betas=(0.9, 0.999), eps=1e-8)  # fmt: skip
        self.ds = SimpleNamespace(
            device=dev, dp_process_group=None, clip_grad=1.0, loss_scale=1.0,
            single_partition_of_fp32_groups=self.masters, partition_size=sizes,
            parallel_partitioned_bit16_groups=[[lo] for lo in self.lows],
        )  # fmt: skip


def step(st: State, mode: str, grads: list[list[torch.Tensor]]) -> None:
    """lean_step's part from the norm to the update, for one mode."""
    opt = st.ds
    if mode == "gather":
        grads = [[zero_step._gather(opt, i, g)] for i, g in enumerate(grads)]
    norm = zero_step.global_norm(opt, grads, flat=mode == "gather")
    scale = zero_step.clip_scale(opt, norm)
    found_inf = (~torch.isfinite(norm)).to(torch.float32)
    for i, g in enumerate(grads):
        master, low, group = st.masters[i], st.lows[i], st.opt.param_groups[i]
        if mode in ("gather", "gather_list"):
            fused_adamw.step_group(st.opt, group, master, zero_step._gather(opt, i, g), low, scale, found_inf)
        elif mode == "in_place":
            fused_adamw.step_group_in_place(st.opt, group, master, g, low, scale, found_inf)
        else:  # per_tensor: the flat kernel on each tensor's views, the scalars formed once
            state, args = fused_adamw._begin(st.opt, group, master, scale, found_inf)
            flat, sizes = fused_adamw.partition_views(g, master, low.dtype)
            ps, ms, vs, lows = (t.split(sizes) for t in (master, state["exp_avg"], state["exp_avg_sq"], low))
            for p, m, v, t, lo in zip(ps, ms, vs, flat, lows):
                fused_adamw._kernel()(p, m, v, t, lo, *args)
            fused_adamw._end(st.opt, state, found_inf)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=int, default=64, help="each dimension divided by this (1: the 27B shape)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3, help="the modes in turn, this many times")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: expected some of {MODES}, got {a.modes}")
    torch.set_num_threads(a.threads)
    import deepspeed

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    dev = torch.device(a.device)
    deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo", auto_mpi_discovery=False)
    shapes = shapes_27b()
    grads = Gradients(shapes, a.scale, 5120 * 5120, dev)  # reduce_bucket_size = h * h
    states = {m: State(grads.sizes, dev) for m in modes}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"{len(shapes)} tensors, {[len(g) for g in grads.lists()]} per group, "
          f"{sum(grads.sizes) / 1e6:.2f}M parameters, {a.device}, scale {a.scale}", flush=True)
    out = {"compile_s": {}, "host_ms": {m: [] for m in modes}, "device_ms": {m: [] for m in modes}}
    for m in modes:
        t0 = time.perf_counter()
        step(states[m], m, grads.lists())
        sync()
        out["compile_s"][m] = time.perf_counter() - t0
        print(f"{m}: first step (compiles) {out['compile_s'][m]:.1f} s", flush=True)
    for r in range(a.rounds):
        for m in modes:
            host, device = [], []
            for _ in range(a.steps):
                lists = grads.lists()
                sync()
                t0 = time.perf_counter()
                step(states[m], m, lists)
                t1 = time.perf_counter()
                sync()
                host.append(1e3 * (t1 - t0))
                device.append(1e3 * (time.perf_counter() - t0))
            out["host_ms"][m].append(statistics.median(host))
            out["device_ms"][m].append(statistics.median(device))
            extra = f", to the device's end {statistics.median(device):.3f}" if dev.type == "cuda" else ""
            print(f"round {r} {m}: host ms/step median {statistics.median(host):.3f} (min {min(host):.3f}){extra}",
                  flush=True)
    for m in modes:
        print(f"{m}: host ms/step, median of rounds {statistics.median(out['host_ms'][m]):.3f}")
    ref = "in_place" if "in_place" in modes else modes[0]
    for m in modes:  # the same gradients and steps in every mode: the masters after them (gather's norm sums the
        if m != ref:  # flat partitions, in another order than the list's: its clip divisor differs in the last bits)
            same = all(torch.equal(x, y) for x, y in zip(states[m].masters, states[ref].masters))
            print(f"{m}'s fp32 masters bitwise {ref}'s after the same steps: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
