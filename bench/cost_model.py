"""Samples/s per GPU of the 27B drafter's ZeRO-2 trainer at world size N, from one GPU's measurements
plus documented link rates (issue 24, Build 2).

    python bench/bench_train_step.py --loss chunked --kernels liger --settings direct+lean --json train.json
    python bench/cost_model.py --train-json train.json --measure-opt --world 9     # on the GPU
    python bench/cost_model.py --fwd-ms 105 --bwd-ms 100 --opt-ms 4 --params 1.73e9 --world 9   # anywhere
    python bench/measure_comm.py     # the engine's collectives at 2 and 3 gloo ranks (CPU) beside this model's

What each rank does per optimizer step with ZeRO-2 (ds_config.py: overlap_comm, reduce_scatter,
bf16 gradients and parameters, fp32 master weights and AdamW states partitioned 1/N):
- grad_accum micro-batches of forward + backward, each the world-size-1 time (every rank runs its
  own micro-batch through the whole drafter; measured by bench_train_step.py);
- per micro-batch the reduction of all bf16 gradients (ZeRO-2 reduces every backward), in buckets
  during the backward (overlap_comm); what does not fit under the backward is exposed, and the last
  gradients produced (fc's, the first layer: 25600 x 5120 at the 27B shape) are reduced after the
  backward ends. train.zero_grad_reduce (bench/zero_buckets.py: which calls, of what size):
  "allreduce" (DeepSpeed 0.19.8's default use_multi_rank_bucket_allreduce; our reduce_scatter: true
  does not make it a reduce-scatter) all-reduces each whole bucket, 2(N-1)/N x 2P bytes per rank;
  "reduce" sends each destination rank its slices with one `reduce`: a ring reduce of M bytes moves M
  through every link but the root's (nccl-tests' reduce bus bytes: M), 2P of link time per
  micro-batch in all (0.56x the all-reduce's at 9 ranks), (N-1)/N x 2P sent per rank; but DeepSpeed
  synchronizes the device before each reduce under overlap_comm, so the backward waits behind all
  but the last reduce of each bucket. The same calls on gloo and NCCL (torch.distributed's); only the
  backend's algorithm differs. bench/measure_comm.py counts them on a real engine (gloo, CPU);
- the optimizer step on 1/N of the parameters (`--measure-opt`: measured on this GPU at world size
  1 on a parameter set of the drafter's tensors with 1/N of their rows, DeepSpeed's step, the
  lean one (the GPU default) and fused, trainer/zero_step.py);
- an all-gather (all_gather_into_tensor of each rank's bf16 partition) of the updated parameters,
  after the step and before the next forward (not overlapped in DeepSpeed 0.19.8's ZeRO-2 step);
  and one 4-byte all-reduce (the lean step's gradient norm), not counted.
Bytes per rank are nccl-tests' bus bytes (what DeepSpeed's comms logger divides by the time for its
busbw, utils/comms_logging.calc_bw_log): a ring all-reduce of a buffer of S bytes over N ranks moves
2(N-1)/N x S through each rank's link, an all-gather or reduce-scatter (N-1)/N x S; the time is that
over the bus bandwidth. For the all-reduce NCCL may pick a tree (across nodes, about the same
bytes) or NVLink SHARP (NVLS, the switch reduces: each GPU sends and receives about S, near half
the ring's bytes): not modelled, the ring is the upper bound. Constants (override by flags):
NVLink 4 on H200 SXM, 900 GB/s per GPU in both directions together = 450 GB/s per direction
(NVIDIA H200 datasheet); InfiniBand NDR 400 Gb/s per GPU = 50 GB/s per direction (one ConnectX-7
per GPU, the HGX H200 layout); achieved bus bandwidth 0.8 of the link rate for large ring
collectives (nccl-tests all_gather/reduce_scatter on 8x H100/H200 SXM report ~360-390 GB/s of 450;
assumed the same for the all-reduce and for IB). Ranks split over two nodes (`--placements 5+4`):
every ring crosses between the nodes, each crossing uses one GPU's NIC, and NCCL spreads its
channels over the smaller side's NICs, so the bus bandwidth is min(NVLink, min(ranks per node) x
IB) x efficiency. With the drafter's buckets (main: from --shape) the backward and its collectives
run on zero_buckets.backward_ms's timeline (the ipg buffers' stream waits, the reduce path's device
syncs), each collective + `--call-us` (assumed 20 us: NCCL's small-message latency) and each sync
+ `--sync-us` (assumed 10 us): assumptions, not measured; the NCCL timing needs a multi-GPU machine.
Not modelled: SM/HBM contention of NCCL kernels with the backward's GEMMs (`--comm-slowdown` adds a
fraction of the backward), the backward's work before the first trainable gradient (the loss).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zero_buckets
from torch import nn

NVLINK_GBPS = 450.0  # H200 SXM NVLink 4: 900 GB/s bidirectional per GPU (datasheet) -> 450 per direction
IB_GBPS = 50.0  # InfiniBand NDR, 400 Gb/s per GPU (ConnectX-7) -> 50 GB/s per direction
BUS_EFFICIENCY = 0.8  # nccl-tests busbw / link rate for large all-gather / reduce-scatter (~360-390 of 450)
GRAD_BYTES = PARAM_BYTES = 2  # bf16 gradients reduced, bf16 parameters gathered (ds_config: bf16, no fp32 comm)
GRAD_OPS = {"allreduce": "all_reduce", "reduce": "reduce"}  # train.zero_grad_reduce -> DeepSpeed's collective
GRAD_REDUCE = GRAD_OPS["allreduce"]  # the default: each bucket whole (module docstring)
CALL_US = 20.0  # assumed latency of one NCCL collective (small messages)
SYNC_US = 10.0  # assumed cost of the reduce path's torch.cuda.synchronize before each call
PARAM_GATHER = "all_gather_into_tensor"  # the bf16 partitions after the step (runtime/utils.all_gather_dp_groups)


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


def bus_bytes(op: str, msg_bytes: float, n: int) -> float:
    """Bytes a ring moves through each rank's link for collective `op` over `n` ranks, given the
    tensor DeepSpeed's comms logger records as its message (the whole buffer for all_reduce and
    reduce_scatter_tensor, one rank's input for the all-gathers): nccl-tests' bus bytes, the
    factors of deepspeed/utils/comms_logging.calc_bw_log."""
    if op in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (n - 1) / n * msg_bytes
    if op in ("all_gather", "all_gather_into_tensor"):
        return (n - 1) * msg_bytes
    if op in ("reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single"):
        return (n - 1) / n * msg_bytes
    if op in ("reduce", "broadcast", "send", "recv", "isend", "irecv", "gather", "scatter"):
        return float(msg_bytes)
    if op == "barrier":
        return 0.0
    raise ValueError(f"no bus-byte rule for collective {op!r}: add it to cost_model.bus_bytes")


def step_bytes(params: float, world: int, mode: str = "allreduce") -> dict:
    """Per-rank bus bytes of the model: the gradient reduction of one micro-batch (train.zero_grad_reduce
    `mode`: the all-reduce of every bucket, or one reduce per destination of its 1/N share, M bytes of
    bus each: 2P in all), the parameter all-gather of one step."""
    grad = GRAD_BYTES * params
    return {
        "grad_reduce": bus_bytes("all_reduce", grad, world) if mode == "allreduce" else grad,
        "param_gather": bus_bytes(PARAM_GATHER, PARAM_BYTES * params / world, world),
    }


def estimate(
    x: Inputs, bus: float, mode: str = "allreduce", buckets=None, call_us: float = CALL_US, sync_us: float = SYNC_US
) -> dict:
    """One placement's step: times in ms, whether the gradient reduction (train.zero_grad_reduce
    `mode`) hides under the backward, samples/s per GPU. Without `buckets` (zero_buckets.grad_buckets)
    the reduction overlaps the backward ideally, only the tail (fc's gradient) after it; with them, on
    zero_buckets.backward_ms's timeline (`ideal_exposed_ms` keeps the ideal figure)."""
    n = x.world
    b = step_bytes(x.params, n, mode)
    reduce_ms = b["grad_reduce"] / (bus * 1e9) * 1e3  # per micro-batch
    ag_ms = b["param_gather"] / (bus * 1e9) * 1e3  # per step
    tail_ms = step_bytes(x.tail_params, n, mode)["grad_reduce"] / (bus * 1e9) * 1e3
    bwd = x.bwd_ms * (1 + x.comm_slowdown)
    body = max(0.0, reduce_ms - tail_ms)  # reduced in buckets while the backward runs
    ideal = max(0.0, body - bwd) + tail_ms
    exposed, calls = ideal, None
    if buckets is not None:
        per_elem = bus_bytes(GRAD_OPS[mode], GRAD_BYTES, n) / (bus * 1e9) * 1e3  # ms of one call per element
        calls = sum(len(k.calls) for k in buckets)
        end = zero_buckets.backward_ms(
            buckets, bwd, lambda e: call_us / 1e3 + e * per_elem, sync_us / 1e3, host_sync=mode == "reduce"
        )
        exposed = end - bwd
    step_ms = x.grad_accum * (x.fwd_ms + bwd + exposed) + x.opt_ms + ag_ms
    samples = x.grad_accum * x.samples_per_micro
    return {
        "mode": mode,
        "bus_gb_s": bus,
        "grad_reduce_gb_per_micro": b["grad_reduce"] / 1e9,
        "all_gather_gb_per_step": b["param_gather"] / 1e9,
        "grad_reduce_ms": reduce_ms,
        "grad_calls_per_micro": calls,
        "reduce_hidden": body <= bwd,  # its bytes fit under the backward
        "reduce_exposed_ms": exposed,
        "ideal_exposed_ms": ideal,
        "all_gather_ms": ag_ms,
        "step_ms": step_ms,
        "samples_per_s_per_gpu": samples / step_ms * 1e3,
        "samples_per_s_all": n * samples / step_ms * 1e3,
    }


def report(
    x: Inputs, placements: list[tuple[int, ...]], nvlink: float, ib: float, eff: float, buckets: dict | None = None,
    call_us: float = CALL_US, sync_us: float = SYNC_US,
) -> list[dict]:  # fmt: skip
    """One line per placement and gradient reduction (`buckets`: {mode: zero_buckets.grad_buckets} priced on
    the timeline; None: the all-reduce, ideally overlapped)."""
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
        for mode, bks in (buckets or {"allreduce": None}).items():
            e = estimate(x, bus_gbps(p, nvlink, ib, eff), mode, bks, call_us, sync_us)
            e["placement"] = "+".join(map(str, p))
            rows.append(e)
            calls = "" if bks is None else f" in {e['grad_calls_per_micro']} calls"
            ideal = "" if bks is None else f"; ideally overlapped {e['ideal_exposed_ms']:.1f}"
            print(
                f"world {x.world} as {e['placement']:>5} per node: bus {e['bus_gb_s']:6.1f} GB/s; gradient {mode} "
                f"{e['grad_reduce_gb_per_micro']:.2f} GB/micro-batch{calls} = {e['grad_reduce_ms']:.1f} ms "
                f"({'fits under' if e['reduce_hidden'] else 'LONGER than'} the {x.bwd_ms:.0f} ms backward; exposed "
                f"{e['reduce_exposed_ms']:.1f} ms{ideal}), all-gather {e['all_gather_gb_per_step']:.2f} GB/step = "
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


def _drafter(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, k: int, vocab: int = 8):
    from dflash_dist.model.config import DrafterConfig
    from dflash_dist.model.drafter import DFlashDrafter

    dc = DrafterConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, target_layer_ids=tuple(range(1, k + 1)),
        num_target_layers=k + 2, block_size=4, mask_token_id=vocab - 1,
    )  # fmt: skip
    return DFlashDrafter(dc)


def drafter_params(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, k: int = 5):
    """(name, shape) of the trainable drafter tensors in registration order, from the model itself
    (built on the meta device)."""
    with torch.device("meta"):
        d = _drafter(hidden, layers, heads, kv_heads, head_dim, inter, k)
    return [(n, tuple(p.shape)) for n, p in d.named_parameters() if n not in type(d).TARGET_KEYS]


def drafter_shapes(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, k: int = 5):
    """Shapes of the trainable drafter tensors in registration order."""
    return [shape for _, shape in drafter_params(hidden, layers, heads, kv_heads, head_dim, inter, k)]


def gradient_order(layers: int, k: int = 5) -> list[str]:
    """The trainable drafter tensors' names in the order the training backward finishes their
    gradients (DeepSpeed's hooks fill its buckets in this order): a tiny drafter of the same layers and
    k through dflash_loss on the CPU with the GPU's row cuts, recorded by post-accumulate-grad
    hooks (the order follows the graph, not the widths)."""
    from dflash_dist.model.loss import dflash_loss, sample_anchors

    torch.manual_seed(0)
    d = _drafter(32, layers, 2, 1, 16, 64, k, vocab=40)
    d.set_target_weights(torch.randn(40, 32), torch.randn(40, 32))
    d.set_row_cuts(True, True)  # the GPU kernel sets' forms (on with liger/compile), whose graph orders the gradients
    seen: list[str] = []
    for n, p in d.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, n=n: seen.append(n))
    ids, mask = torch.randint(0, 39, (1, 24)), torch.ones(1, 24, dtype=torch.long)
    anchors = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    dflash_loss(d, ids, torch.randn(1, 24, k * 32), mask, anchors, target_argmax=ids, attention="dense").loss.backward()
    return seen


def drafter_buckets(shape: list[int], world: int, mode: str, k: int = 5) -> list:
    """zero_buckets.grad_buckets of the drafter `shape` (H, layers, heads, kv_heads, head_dim, I) at
    `world` ranks: the trainer's reduce bucket (H^2, ds_config.py), the training backward's order."""
    named = drafter_params(*shape, k=k)
    index = {n: i for i, (n, _) in enumerate(named)}
    order = [index[n] for n in gradient_order(shape[1], k)]
    if sorted(order) != list(range(len(named))):
        raise RuntimeError("gradient_order does not name every trainable drafter tensor once")
    numels, matrix = [math.prod(s) for _, s in named], [len(s) >= 2 for _, s in named]
    return zero_buckets.grad_buckets(numels, matrix, order, world, shape[0] * shape[0], mode)


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
        zero_step.install(engine, kind, on_gpu=on_gpu, **zero_step.trainer_options(kind, on_gpu))  # as the trainer
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
    ap.add_argument("--grad-reduce", default="both", choices=[*zero_buckets.MODES, "both"], help="mode(s) to price")
    ap.add_argument("--call-us", type=float, default=CALL_US, help="latency of one gradient collective (assumed)")
    ap.add_argument("--sync-us", type=float, default=SYNC_US, help="the reduce path's device sync per call (assumed)")
    a = ap.parse_args(argv)
    modes = zero_buckets.MODES if a.grad_reduce == "both" else (a.grad_reduce,)
    fwd, bwd, params = a.fwd_ms, a.bwd_ms, a.params
    if a.train_json:
        row, trainable = from_train_json(a.train_json, a.setting)
        fwd, bwd, params = fwd or row["fwd_ms"], bwd or row["bwd_ms"], params or trainable
        print(f"from {a.train_json}: {row['name']}: {row['samples_per_s']:.2f} samples/s at world size 1")
    opt_ms, measured = a.opt_ms, None
    shape = [int(v) for v in a.shape.split(",")]
    if a.measure_opt:
        _init_single_rank(a.device)
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
    buckets = {m: drafter_buckets(shape, a.world, m) for m in modes}
    rows = report(x, placements, a.nvlink_gbps, a.ib_gbps, a.efficiency, buckets, a.call_us, a.sync_us)
    if a.json:
        out = {"inputs": vars(x), "measured_opt": measured, "estimates": rows}
        Path(a.json).write_text(json.dumps(out, indent=1))
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
