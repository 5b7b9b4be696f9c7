"""Samples/s per GPU of the 27B drafter's ZeRO-2 trainer at world size N, from one GPU's measurements
plus documented link rates (issue 24, Build 2).

    python bench/bench_train_step.py --loss chunked --kernels liger --settings direct+lean --json train.json
    python bench/cost_model.py --train-json train.json --measure-opt --world 9     # on the GPU
    python bench/cost_model.py --fwd-ms 105 --bwd-ms 100 --opt-ms 4 --params 1.73e9 --world 9   # anywhere
    python bench/cost_model.py --measure-comm    # one step's collectives at 2 and 3 gloo ranks (CPU)

What each rank does per optimizer step with ZeRO-2 (ds_config.py: overlap_comm, reduce_scatter,
bf16 gradients and parameters, fp32 master weights and AdamW states partitioned 1/N):
- grad_accum micro-batches of forward + backward, each the world-size-1 time (every rank runs its
  own micro-batch through the whole drafter; measured by bench_train_step.py);
- per micro-batch an all-reduce of all bf16 gradients (ZeRO-2 reduces every backward), in buckets
  during the backward (overlap_comm); what does not fit under the backward is exposed, and the last
  gradients produced (fc's, the first layer: 25600 x 5120 at the 27B shape) are reduced after the
  backward ends. An all-reduce, not a reduce-scatter (twice the bytes): DeepSpeed 0.19.8's ZeRO-2
  (stage_1_and_2.average_tensor), with our `reduce_scatter: true` and its default
  `use_multi_rank_bucket_allreduce: true`, all-reduces each whole bucket and every rank keeps its
  own partition's slices (`reduce_scatter: false` all-reduces the bucket too; only
  `use_multi_rank_bucket_allreduce: false` would send each rank its slices with one `reduce` per
  rank). overlap_comm and contiguous_gradients change streams and buffers, not the collectives.
  The same calls on gloo and NCCL (deepspeed.comm's all_reduce -> torch.distributed's); only the
  backend's algorithm differs. `--measure-comm` counts them on a real engine (gloo, CPU);
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
IB) x efficiency. Not modelled: SM/HBM contention of NCCL kernels with the backward's GEMMs
(`--comm-slowdown` adds a fraction of the backward), latency of small messages.
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
GRAD_REDUCE = "all_reduce"  # ZeRO-2's gradient reduction, each bucket whole (module docstring)
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


def step_bytes(params: float, world: int) -> dict:
    """Per-rank bus bytes of the model: the gradient all-reduce of one micro-batch, the parameter
    all-gather of one step."""
    return {
        "grad_reduce": bus_bytes(GRAD_REDUCE, GRAD_BYTES * params, world),
        "param_gather": bus_bytes(PARAM_GATHER, PARAM_BYTES * params / world, world),
    }


def estimate(x: Inputs, bus: float) -> dict:
    """One placement's step: times in ms, whether the gradient all-reduce hides under the backward,
    samples/s per GPU."""
    n = x.world
    b = step_bytes(x.params, n)
    reduce_ms = b["grad_reduce"] / (bus * 1e9) * 1e3  # per micro-batch
    ag_ms = b["param_gather"] / (bus * 1e9) * 1e3  # per step
    tail_ms = step_bytes(x.tail_params, n)["grad_reduce"] / (bus * 1e9) * 1e3
    bwd = x.bwd_ms * (1 + x.comm_slowdown)
    body = max(0.0, reduce_ms - tail_ms)  # reduced in buckets while the backward runs
    exposed = max(0.0, body - bwd) + tail_ms
    step_ms = x.grad_accum * (x.fwd_ms + bwd + exposed) + x.opt_ms + ag_ms
    samples = x.grad_accum * x.samples_per_micro
    return {
        "bus_gb_s": bus,
        "grad_reduce_gb_per_micro": b["grad_reduce"] / 1e9,
        "all_gather_gb_per_step": b["param_gather"] / 1e9,
        "grad_reduce_ms": reduce_ms,
        "reduce_hidden": body <= bwd,
        "reduce_exposed_ms": exposed,
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
            f"world {x.world} as {e['placement']:>5} per node: bus {e['bus_gb_s']:6.1f} GB/s; gradient all-reduce "
            f"{e['grad_reduce_gb_per_micro']:.2f} GB/micro-batch = {e['grad_reduce_ms']:.1f} ms "
            f"({'hidden under' if e['reduce_hidden'] else 'LONGER than'} the {x.bwd_ms:.0f} ms backward; exposed "
            f"{e['reduce_exposed_ms']:.1f} ms), all-gather {e['all_gather_gb_per_step']:.2f} GB/step = "
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


# ---- the collectives of one optimizer step, counted on a real engine at world size N (gloo, CPU) ----


def measure_comm(shapes, world: int, hidden: int, grad_accum: int = 2, timeout_s: float = 300) -> dict:
    """The collectives one optimizer step of the trainer's GPU engine (deepspeed_config with
    on_gpu: ZeRO-2, bf16, overlap_comm; the lean step) issues at `world` gloo ranks on this CPU,
    over the drafter's full tensors `shapes`. Per rank and phase (each micro-batch's forward and
    backward, then the step): DeepSpeed's comms logger's calls {op: {message bytes: count}}, their
    bus bytes (`bus_bytes`), and the bytes the rank's gloo TCP connections sent (the kernel's
    tcp_info: gloo's own algorithm, with its message headers)."""
    import multiprocessing as mp
    import queue as queue_mod

    from dflash_dist.actors.ports import free_ports

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_ports(1, "127.0.0.1")[0]
    args = (world, port, shapes, hidden, grad_accum, results)
    procs = [ctx.Process(target=_comm_rank, args=(r, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    ranks: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(ranks) < world:
            try:
                rank, got = results.get(timeout=1.0)
            except queue_mod.Empty:
                rank = got = None
            if rank is None:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in ranks]
                if gone:
                    codes = [procs[r].exitcode for r in gone]
                    raise RuntimeError(f"measure_comm at world {world}: rank(s) {gone} exited {codes} without a result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"measure_comm at world {world}: no result in {timeout_s:.0f} s")
                continue
            if isinstance(got, str):
                raise RuntimeError(f"measure_comm at world {world}: rank {rank} failed: {got}")
            ranks[rank] = got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.terminate()  # our own child, by its handle
    params = sum(math.prod(s) for s in shapes)
    return {"world": world, "params": params, "grad_accum": grad_accum, "ranks": [ranks[r] for r in range(world)]}


def _comm_rank(rank: int, world: int, port: int, shapes, hidden: int, grad_accum: int, results) -> None:
    """One gloo rank of measure_comm: a warm-up step, then one step counted phase by phase."""
    import os

    import deepspeed
    import torch.distributed as dist

    from dflash_dist.config import load_config
    from dflash_dist.trainer import zero_step
    from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        overrides = ["target.kind=tiny_stdlib", "train.max_steps=100000", f"train.grad_accum={grad_accum}"]
        cfg = load_config(None, overrides)
        model = Slice(shapes, 1)  # the whole tensors: every rank holds the model, ZeRO-2 partitions the rest
        opt = build_optimizer(cfg, model, fused=True)
        ds = deepspeed_config(cfg, world, True, hidden_size=hidden)  # the GPU ranks' config, as it is
        ds["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=build_lr_schedule(cfg, opt, 100000), config=ds,
            dist_init_required=False,
        )  # fmt: skip
        step_kind = zero_step.install(engine, "auto", on_gpu=True)
        logged = deepspeed.comm.comms_logger.comms_dict
        x = torch.ones((), dtype=torch.bfloat16)
        for _ in range(2):  # the second step is counted
            phases = {}
            for m in range(grad_accum):
                logged.clear()
                sent = _tcp_bytes_sent(port)
                engine.backward(engine(x))
                phases[f"micro{m + 1}"] = _phase(logged, _tcp_bytes_sent(port) - sent, world)
            logged.clear()
            sent = _tcp_bytes_sent(port)
            engine.step()
            phases["step"] = _phase(logged, _tcp_bytes_sent(port) - sent, world)
        dtypes = sorted({str(g.dtype) for g in engine.optimizer.bit16_groups_flat})
        results.put((rank, {"phases": phases, "step": step_kind, "param_dtypes": dtypes}))
    except BaseException as e:  # noqa: BLE001 - the parent reports it with the rank
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _phase(logged: dict, wire: int, world: int) -> dict:
    """comms_dict {op: {message bytes: [count, latencies, ...]}} as ops, bus bytes and wire bytes."""
    ops = {op: {int(size): rec[0] for size, rec in sizes.items()} for op, sizes in logged.items()}
    bus = sum(bus_bytes(op, size, world) * n for op, sizes in ops.items() for size, n in sizes.items())
    return {"ops": ops, "bus_bytes": bus, "wire_bytes": wire}


def _tcp_bytes_sent(store_port: int) -> int:
    """Bytes this process's connected TCP sockets have sent (tcp_info's tcpi_bytes_sent, Linux >=
    4.19; before it tcpi_bytes_acked), the rendezvous store's connection left out: gloo's traffic."""
    import os
    import socket
    import struct

    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ends = (sock.getsockname()[1], sock.getpeername()[1])
            except OSError:  # listening, not connected
                continue
            if store_port in ends:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            total += struct.unpack_from("Q", info, 200 if len(info) >= 208 else 120)[0]
    return total


def comm_report(got: dict) -> list[str]:
    """Lines: per phase, the engine's collectives and bytes (rank 0; every rank's bus bytes agree)
    beside the model's."""
    n, params = got["world"], got["params"]
    model = step_bytes(params, n)
    first = got["ranks"][0]
    lines = [f"world {n}, {params} parameters, {first['step']} step, parameters {first['param_dtypes']}"]
    for name, phase in first["phases"].items():
        want = model["param_gather"] if name == "step" else model["grad_reduce"]
        what = f"model {'all-gather' if name == 'step' else 'gradient all-reduce'} {want:.0f}"
        lines.append(
            f"  {name:>6}: {phase['ops']}: bus {phase['bus_bytes']:.0f} B/rank ({what}, "
            f"{phase['bus_bytes'] / want:.4f}x); gloo sent {phase['wire_bytes']} B ({phase['wire_bytes'] / want:.3f}x)"
        )
    return lines


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
    ap.add_argument("--measure-comm", action="store_true", help="count one step's collectives on gloo ranks here")
    ap.add_argument("--comm-shape", default="128,2,4,2,32,256", help="--measure-comm's drafter shape (as --shape)")
    ap.add_argument("--comm-worlds", default="2,3", help="--measure-comm's world sizes")
    a = ap.parse_args(argv)
    comm = None
    if a.measure_comm:
        shape = [int(v) for v in a.comm_shape.split(",")]
        comm = [measure_comm(drafter_shapes(*shape), int(n), shape[0], a.grad_accum) for n in a.comm_worlds.split(",")]
        for got in comm:
            print("\n".join(comm_report(got)))
        if a.fwd_ms is None and a.train_json is None:
            return 0
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
        out = {"inputs": vars(x), "measured_opt": measured, "measured_comm": comm, "estimates": rows}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def _init_single_rank(device: str) -> None:
    """A one-rank process group for deepspeed.initialize: nccl on a GPU, gloo on the CPU."""
    import os

    import torch.distributed as dist

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29518", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    if device == "cpu":
        dist.init_process_group("gloo", rank=0, world_size=1)
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


if __name__ == "__main__":
    raise SystemExit(main())
