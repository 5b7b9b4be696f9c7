"""Samples/s per GPU of the 27B drafter's ZeRO-2 trainer at world size N, from one GPU's measurements
plus documented link rates (issue 24, Build 2).

    python bench/bench_train_step.py --loss chunked --kernels liger --settings direct+lean --json train.json
    python bench/cost_model.py --train-json train.json --measure-opt --world 9     # on the GPU
    python bench/cost_model.py --fwd-ms 105 --bwd-ms 100 --opt-ms 4 --params 1.73e9 --world 9   # anywhere

What each rank does per optimizer step with ZeRO-2 (ds_config.py: overlap_comm, reduce_scatter,
bf16 gradients and parameters, fp32 master weights and AdamW states partitioned 1/N):
- grad_accum micro-batches of forward + backward, each the world-size-1 time (every rank runs its
  own micro-batch through the whole drafter; measured by bench_train_step.py);
- per micro-batch a reduce-scatter of all bf16 gradients (ZeRO-2 reduces every backward), in
  buckets during the backward (overlap_comm); what does not fit under the backward is exposed, and
  the last gradients produced (fc's, the first layer: 25600 x 5120 at the 27B shape) are reduced
  after the backward ends;
- the optimizer step on 1/N of the parameters (`--measure-opt`: measured on this GPU at world size
  1 on a parameter set of the drafter's tensors with 1/N of their rows, DeepSpeed's step, the
  lean one (the GPU default) and fused, trainer/zero_step.py);
- an all-gather of the updated bf16 parameters, after the step and before the next forward (not
  overlapped in DeepSpeed 0.19.8's ZeRO-2 step).
A ring collective of a buffer of S bytes over N ranks moves (N-1)/N x S per rank; its time is that
over the bus bandwidth. Constants (override by flags): NVLink 4 on H200 SXM, 900 GB/s per GPU in
both directions together = 450 GB/s per direction (NVIDIA H200 datasheet); InfiniBand NDR 400 Gb/s
per GPU = 50 GB/s per direction (one ConnectX-7 per GPU, the HGX H200 layout); achieved bus
bandwidth 0.8 of the link rate for large ring collectives (nccl-tests all_gather/reduce_scatter on
8x H100/H200 SXM report ~360-390 GB/s of 450; assumed the same for IB). Ranks split over two nodes
(`--placements 5+4`): every ring crosses between the nodes, each crossing uses one GPU's NIC, and
NCCL spreads its channels over the smaller side's NICs, so the bus bandwidth is min(NVLink,
min(ranks per node) x IB) x efficiency. Not modelled: SM/HBM contention of NCCL kernels with the
backward's GEMMs (`--comm-slowdown` adds a fraction of the backward), latency of small messages.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

NVLINK_GBPS = 450.0  # H200 SXM NVLink 4: 900 GB/s bidirectional per GPU (datasheet) -> 450 per direction
IB_GBPS = 50.0  # InfiniBand NDR, 400 Gb/s per GPU (ConnectX-7) -> 50 GB/s per direction
BUS_EFFICIENCY = 0.8  # nccl-tests busbw / link rate for large all-gather / reduce-scatter (~360-390 of 450)
GRAD_BYTES = PARAM_BYTES = 2  # bf16 gradients reduced, bf16 parameters gathered (ds_config: bf16, no fp32 comm)


@dataclass(frozen=True)
class Inputs:
    fwd_ms: float  # per micro-batch, world size 1 (bench_train_step)
    bwd_ms: float
    opt_ms: float  # the optimizer step on 1/N of the parameters (measured, or an estimate)
    params: float  # trainable parameters
    world: int
    grad_accum: int = 2  # configs/qwen3.6-27b.yaml
    samples_per_micro: float = 1.0  # 1 at fixed length; ~2.2 packed chat rows (docs/BENCHMARKS.md)
    tail_params: float = 25600 * 5120  # the backward's last gradient (fc): reduced after the backward ends
    comm_slowdown: float = 0.0  # fraction added to the backward while NCCL runs beside it


def bus_gbps(placement: tuple[int, ...], nvlink: float, ib: float, eff: float) -> float:
    """Achieved ring bus bandwidth (GB/s) of ranks placed `placement` per node (module docstring)."""
    link = nvlink if len(placement) == 1 else min(nvlink, min(placement) * ib)
    return link * eff


def estimate(x: Inputs, bus: float) -> dict:
    """One placement's step: times in ms, whether the reduce-scatter hides under the backward,
    samples/s per GPU."""
    n = x.world
    ring = (n - 1) / n
    rs_ms = ring * GRAD_BYTES * x.params / (bus * 1e9) * 1e3  # per micro-batch
    ag_ms = ring * PARAM_BYTES * x.params / (bus * 1e9) * 1e3  # per step
    tail_ms = ring * GRAD_BYTES * x.tail_params / (bus * 1e9) * 1e3
    bwd = x.bwd_ms * (1 + x.comm_slowdown)
    body = max(0.0, rs_ms - tail_ms)  # reduced in buckets while the backward runs
    exposed_rs = max(0.0, body - bwd) + tail_ms
    step_ms = x.grad_accum * (x.fwd_ms + bwd + exposed_rs) + x.opt_ms + ag_ms
    samples = x.grad_accum * x.samples_per_micro
    return {
        "bus_gb_s": bus,
        "reduce_scatter_gb_per_micro": ring * GRAD_BYTES * x.params / 1e9,
        "all_gather_gb_per_step": ring * PARAM_BYTES * x.params / 1e9,
        "reduce_scatter_ms": rs_ms,
        "rs_hidden": body <= bwd,
        "rs_exposed_ms": exposed_rs,
        "all_gather_ms": ag_ms,
        "step_ms": step_ms,
        "samples_per_s_per_gpu": samples / step_ms * 1e3,
        "samples_per_s_all": n * samples / step_ms * 1e3,
    }


def report(x: Inputs, placements: list[tuple[int, ...]], nvlink: float, ib: float, eff: float) -> list[dict]:
    single = x.samples_per_micro * x.grad_accum / (x.grad_accum * (x.fwd_ms + x.bwd_ms) + x.opt_ms) * 1e3
    print(
        f"inputs: fwd {x.fwd_ms:.1f} ms, bwd {x.bwd_ms:.1f} ms per micro-batch; optimizer {x.opt_ms:.1f} ms "
        f"at 1/{x.world} of {x.params / 1e9:.3f}B parameters; grad_accum {x.grad_accum}; "
        f"{x.samples_per_micro:g} samples per micro-batch; links NVLink {nvlink:g} GB/s, IB {ib:g} GB/s "
        f"per GPU and direction, efficiency {eff:g}"
    )
    print(f"no communication (the compute bound of a rank): {single:.2f} samples/s per GPU")
    rows = []
    for p in placements:
        e = estimate(x, bus_gbps(p, nvlink, ib, eff))
        e["placement"] = "+".join(map(str, p))
        rows.append(e)
        print(
            f"world {x.world} as {e['placement']:>5} per node: bus {e['bus_gb_s']:6.1f} GB/s; reduce-scatter "
            f"{e['reduce_scatter_gb_per_micro']:.2f} GB/micro-batch = {e['reduce_scatter_ms']:.1f} ms "
            f"({'hidden under' if e['rs_hidden'] else 'LONGER than'} the {x.bwd_ms:.0f} ms backward; exposed "
            f"{e['rs_exposed_ms']:.1f} ms), all-gather {e['all_gather_gb_per_step']:.2f} GB/step = "
            f"{e['all_gather_ms']:.1f} ms exposed; step {e['step_ms']:.1f} ms -> "
            f"{e['samples_per_s_per_gpu']:.2f} samples/s per GPU, {e['samples_per_s_all']:.1f} for all {x.world}"
        )
    return rows


# ---- the optimizer step at 1/N of the parameters, measured at world size 1 ----


class Slice(nn.Module):
    """The drafter's trainable tensors with 1/N of their rows (the share of the fp32 partition a
    rank of N steps on); forward = sum of all weights, so the backward is trivial."""

    def __init__(self, shapes: list[tuple[int, ...]], world: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(max(1, math.ceil(s[0] / world)), *s[1:])) for s in shapes)

    def forward(self, x):
        return sum(p.sum() for p in self.w) * x


def drafter_shapes(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, k: int = 5):
    """Shapes of the trainable drafter tensors, from the model itself (built on the meta device)."""
    from dflash_dist.model.config import DrafterConfig
    from dflash_dist.model.drafter import DFlashDrafter

    dc = DrafterConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=8, target_layer_ids=tuple(range(1, k + 1)),
        num_target_layers=k + 2, block_size=16, mask_token_id=7,
    )  # fmt: skip
    with torch.device("meta"):
        d = DFlashDrafter(dc)
    return [tuple(p.shape) for n, p in d.named_parameters() if n not in DFlashDrafter.TARGET_KEYS]


def measure_opt(shapes, world: int, steps: int, device: str, hidden: int) -> dict:
    """ms of engine.step() (ZeRO-2, the trainer's ds_config and optimizer) on a 1/world slice, with
    DeepSpeed's step, the lean one and lean with the one-kernel AdamW (fused), on one engine."""
    import deepspeed

    from dflash_dist.config import load_config
    from dflash_dist.trainer import zero_step
    from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config

    on_gpu = device != "cpu"
    cfg = load_config(None, ["target.kind=tiny_stdlib", "train.max_steps=100000", f"train.gpus_per_rank={int(on_gpu)}"])
    model = Slice(shapes, world).to(device)
    opt = build_optimizer(cfg, model, fused=on_gpu)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=build_lr_schedule(cfg, opt, 100000),
        config=deepspeed_config(cfg, 1, on_gpu, hidden_size=hidden), dist_init_required=False,
    )  # fmt: skip
    x = torch.ones((), device=device, dtype=next(engine.module.parameters()).dtype)
    out = {"params": sum(p.numel() for p in model.parameters()), "world": world}
    for kind in ("deepspeed", "lean", "fused"):
        zero_step.uninstall(engine)  # DeepSpeed's step and gradient path, then this kind's
        zero_step.install(engine, kind, on_gpu=on_gpu)
        times = []
        for i in range(steps + 2):  # two warm-up steps
            engine.backward(engine(x))
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[f"{kind}_ms"] = 1e3 * sorted(times)[len(times) // 2]
    return out


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def from_train_json(path: str, setting: str | None) -> tuple[dict, float]:
    """(the chosen result line, trainable parameters) of bench_train_step.py --json."""
    data = json.loads(Path(path).read_text())
    rows = data["results"]
    row = rows[-1] if setting is None else next((r for r in rows if r["name"] == setting), None)
    if row is None:
        raise SystemExit(f"--setting {setting!r} not in {path}: {[r['name'] for r in rows]}")
    return row, float(data["trainable_params"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-json", help="bench_train_step.py --json output (fwd/bwd ms, parameters)")
    ap.add_argument("--setting", default=None, help="its result line by name (default: the last)")
    ap.add_argument("--fwd-ms", type=float)
    ap.add_argument("--bwd-ms", type=float)
    ap.add_argument("--opt-ms", type=float, help="optimizer step at 1/N of the parameters (or --measure-opt)")
    ap.add_argument("--params", type=float, help="trainable parameters (default: from --train-json)")
    ap.add_argument("--measure-opt", action="store_true", help="measure the optimizer step on a 1/N slice here")
    ap.add_argument("--opt-step", default="lean", choices=["deepspeed", "lean", "fused"], help="measured step to use")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--opt-steps", type=int, default=10)
    ap.add_argument("--world", type=int, default=9, help="trainer ranks (configs/qwen3.6-27b.yaml: 9)")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--samples-per-micro", type=float, default=1.0)
    ap.add_argument("--placements", default="9,5+4,8+1", help="ranks per node, e.g. 9 (one NVLink domain) or 5+4")
    ap.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS)
    ap.add_argument("--ib-gbps", type=float, default=IB_GBPS)
    ap.add_argument("--efficiency", type=float, default=BUS_EFFICIENCY)
    ap.add_argument("--comm-slowdown", type=float, default=0.0)
    ap.add_argument("--shape", default="5120,5,32,8,128,17408", help="H,layers,heads,kv_heads,head_dim,I")
    ap.add_argument("--json", default=None, help="write inputs and estimates here")
    a = ap.parse_args(argv)
    fwd, bwd, params = a.fwd_ms, a.bwd_ms, a.params
    if a.train_json:
        row, trainable = from_train_json(a.train_json, a.setting)
        fwd, bwd, params = fwd or row["fwd_ms"], bwd or row["bwd_ms"], params or trainable
        print(f"from {a.train_json}: {row['name']}: {row['samples_per_s']:.2f} samples/s at world size 1")
    opt_ms, measured = a.opt_ms, None
    if a.measure_opt:
        _init_single_rank(a.device)
        shape = [int(v) for v in a.shape.split(",")]
        measured = measure_opt(drafter_shapes(*shape), a.world, a.opt_steps, a.device, hidden=shape[0])
        print(
            f"optimizer step on a 1/{a.world} slice ({measured['params'] / 1e6:.1f}M parameters, world size 1): "
            f"DeepSpeed {measured['deepspeed_ms']:.2f} ms, lean {measured['lean_ms']:.2f} ms, "
            f"fused {measured['fused_ms']:.2f} ms"
        )
        opt_ms = opt_ms or measured[f"{a.opt_step}_ms"]
    if None in (fwd, bwd, opt_ms, params):
        raise SystemExit("need --fwd-ms/--bwd-ms/--params (or --train-json) and --opt-ms (or --measure-opt)")
    x = Inputs(fwd, bwd, opt_ms, params, a.world, a.grad_accum, a.samples_per_micro, comm_slowdown=a.comm_slowdown)
    placements = [tuple(int(v) for v in p.split("+")) for p in a.placements.split(",") if p]
    for p in placements:
        if sum(p) != a.world:
            raise SystemExit(f"--placements {'+'.join(map(str, p))} does not add up to --world {a.world}")
    rows = report(x, placements, a.nvlink_gbps, a.ib_gbps, a.efficiency)
    if a.json:
        Path(a.json).write_text(json.dumps({"inputs": vars(x), "measured_opt": measured, "estimates": rows}, indent=1))
    return 0


def _init_single_rank(device: str) -> None:
    """A one-rank process group for deepspeed.initialize: nccl on a GPU, gloo on the CPU, over the
    project's rendezvous store on 127.0.0.1 only (torch's env:// store listens on every interface
    whatever MASTER_ADDR says: actors/rendezvous.py)."""
    import datetime
    import os

    import torch.distributed as dist

    from dflash_dist.actors.rendezvous import rendezvous_store

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29518", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    store = rendezvous_store(dict(os.environ), datetime.timedelta(minutes=10))
    if device == "cpu":
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))


if __name__ == "__main__":
    raise SystemExit(main())
