"""The collectives one optimizer step of the trainer's ZeRO-2 engine issues, counted on real DeepSpeed
engines at 2 and 3 gloo ranks on this CPU, beside bench/cost_model.py's bytes and bench/zero_buckets.py's
calls (issue 24).

    python bench/measure_comm.py       # both gradient reductions (train.zero_grad_reduce) at 2 and 3 ranks
    python bench/measure_comm.py --worlds 2 --grad-reduce reduce --json comm.json

Each rank (dflash_dist/actors/local_ranks.py: a spawned process joined through the trainers' own
rendezvous, its store on 127.0.0.1) builds the engine a GPU rank builds (deepspeed_config with on_gpu:
ZeRO-2, bf16, overlap_comm; the lean step) over the drafter's full tensors (cost_model.Slice), runs a
warm-up step and counts the next phase by phase (each micro-batch's forward and backward, then the
step): DeepSpeed's comms logger's calls, their bus bytes (cost_model.bus_bytes) and the bytes the
rank's gloo TCP connections sent (the kernel's tcp_info: gloo's own algorithm, with its headers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import struct
from pathlib import Path

import torch
import zero_buckets
from cost_model import GRAD_BYTES, GRAD_OPS, Slice, bus_bytes, drafter_shapes, step_bytes

from data_pipeline.durable_files import write_text_atomic
from dflash_dist.actors.local_ranks import run_ranks


def gloo_sent(mode: str, grad_bytes: float, n: int) -> float:
    """Bytes one rank's gloo sockets send for one micro-batch's gradient reduction: its all-reduce is
    a ring (the bus bytes); its reduce (gloo/reduce.cc) a ring reduce-scatter, (N-1)/N of the message
    from every rank, then each non-root rank's reduced chunk, 1/N, to the root: over the N
    destinations of an even split (N-1)/N x (1 + 1/N) x S (NCCL's ring reduce: (N-1)/N x S)."""
    if mode == "allreduce":
        return bus_bytes("all_reduce", grad_bytes, n)
    return (n - 1) / n * (1 + 1 / n) * grad_bytes


def measure_comm(
    shapes, world: int, hidden: int, grad_accum: int = 2, timeout_s: float = 300, mode: str = "allreduce"
) -> dict:
    """The collectives one optimizer step of the trainer's GPU engine (train.zero_grad_reduce `mode`)
    issues at `world` gloo ranks on this CPU, over the drafter's full tensors `shapes`. Per rank and
    phase: DeepSpeed's comms logger's calls {op: {message bytes: count}}, their bus bytes and the
    bytes the rank's gloo connections sent; beside them the calls zero_buckets predicts."""
    (got,) = measure_modes(shapes, world, hidden, grad_accum, timeout_s, (mode,))
    return got


def measure_modes(
    shapes, world: int, hidden: int, grad_accum: int = 2, timeout_s: float = 300, modes=zero_buckets.MODES
) -> list[dict]:
    """measure_comm for each of `modes` in turn, on one group of `world` rank processes (an engine per
    mode; each counts its own warm-up and counted steps): one process start and gloo group per world
    size instead of one per measurement."""
    ranks = run_ranks(_comm_ranks, world, (shapes, hidden, grad_accum, tuple(modes)), timeout_s)
    params = sum(math.prod(s) for s in shapes)
    return [{"world": world, "params": params, "grad_accum": grad_accum, "mode": mode,
             "model_calls": slice_calls(shapes, world, hidden, mode), "ranks": [r[i] for r in ranks]}
            for i, mode in enumerate(modes)]  # fmt: skip


def slice_calls(shapes, world: int, hidden: int, mode: str) -> dict[int, int]:
    """{message bytes: calls} zero_buckets predicts for one backward of measure_comm's engine (`Slice`:
    its gradients come in reverse registration order)."""
    numels, matrix = [math.prod(s) for s in shapes], [len(s) >= 2 for s in shapes]
    order = list(reversed(range(len(shapes))))
    counts: dict[int, int] = {}
    for b in zero_buckets.grad_buckets(numels, matrix, order, world, hidden * hidden, mode):
        for n in b.calls:
            counts[GRAD_BYTES * n] = counts.get(GRAD_BYTES * n, 0) + 1
    return counts


def _comm_ranks(rank: int, world: int, shapes, hidden: int, grad_accum: int, modes: tuple[str, ...]) -> list[dict]:
    """One rank of measure_modes (run_ranks has joined it to the group): _comm_rank for each mode."""
    return [_comm_rank(rank, world, shapes, hidden, grad_accum, mode) for mode in modes]


def _comm_rank(rank: int, world: int, shapes, hidden: int, grad_accum: int, mode: str) -> dict:
    """One rank of measure_comm (run_ranks has joined it to the group): a warm-up step, then one step
    counted phase by phase."""
    import deepspeed

    from dflash_dist.config import load_config
    from dflash_dist.trainer import zero_step
    from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config

    port = int(os.environ["MASTER_PORT"])  # the rendezvous store's: not gloo's traffic
    overrides = ["target.kind=tiny_stdlib", "train.max_steps=100000", f"train.grad_accum={grad_accum}"]
    cfg = load_config(None, [*overrides, f"train.zero_grad_reduce={mode}"])
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
    return {"phases": phases, "step": step_kind, "param_dtypes": dtypes}


def _phase(logged: dict, wire: int, world: int) -> dict:
    """comms_dict {op: {message bytes: [count, latencies, ...]}} as ops, bus bytes and wire bytes."""
    ops = {op: {int(size): rec[0] for size, rec in sizes.items()} for op, sizes in logged.items()}
    bus = sum(bus_bytes(op, size, world) * n for op, sizes in ops.items() for size, n in sizes.items())
    return {"ops": ops, "bus_bytes": bus, "wire_bytes": wire}


def _tcp_bytes_sent(store_port: int) -> int:
    """Bytes this process's connected TCP sockets have sent once (tcp_info's tcpi_bytes_sent less
    tcpi_bytes_retrans, Linux >= 4.19; before it tcpi_bytes_acked), the rendezvous store's connection
    left out: gloo's traffic. Retransmitted bytes are not the algorithm's: a loaded host drops loopback
    packets (its backlog full) and TCP sends them again (11-12% more of the step phase at load 11-28)."""
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
            if len(info) >= 216:  # tcpi_bytes_sent at 200, tcpi_bytes_retrans at 208
                sent, retrans = struct.unpack_from("QQ", info, 200)
                total += sent - retrans
            else:
                total += struct.unpack_from("Q", info, 120)[0]
    return total


def comm_report(got: dict) -> list[str]:
    """Lines: per phase, the engine's collectives and bytes (rank 0; every rank's bus bytes agree)
    beside the model's."""
    n, params, mode = got["world"], got["params"], got.get("mode", "allreduce")
    model = step_bytes(params, n, mode)
    first = got["ranks"][0]
    lines = [
        f"world {n}, {params} parameters, gradient {mode}, {first['step']} step, parameters {first['param_dtypes']}"
    ]
    for name, phase in first["phases"].items():
        step = name == "step"
        want = model["param_gather"] if step else model["grad_reduce"]
        wire = want if step else gloo_sent(mode, GRAD_BYTES * params, n)
        same = phase["ops"].get(GRAD_OPS[mode]) == got["model_calls"]
        calls = "" if step else f", calls {'=' if same else '!='} model's"
        lines.append(
            f"  {name:>6}: {phase['ops']}: bus {phase['bus_bytes']:.0f} B/rank (model "
            f"{'all-gather' if step else 'gradient ' + mode} {want:.0f}, {phase['bus_bytes'] / want:.4f}x{calls}); "
            f"gloo sent {phase['wire_bytes']} B (model {wire:.0f}, {phase['wire_bytes'] / wire:.3f}x)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128,2,4,2,32,256", help="the drafter's H,layers,heads,kv_heads,head_dim,I")
    ap.add_argument("--worlds", default="2,3", help="gloo ranks, one measurement per size")
    ap.add_argument("--grad-reduce", default="both", choices=[*zero_buckets.MODES, "both"], help="mode(s) to count")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per world size (all its modes)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    a = ap.parse_args(argv)
    modes = zero_buckets.MODES if a.grad_reduce == "both" else (a.grad_reduce,)
    shape = [int(v) for v in a.shape.split(",")]
    worlds = [int(n) for n in a.worlds.split(",")]
    if len(shape) != 6:
        raise SystemExit(f"--shape needs 6 numbers, H,layers,heads,kv_heads,head_dim,I (got {a.shape!r})")
    if min(worlds) < 2:
        raise SystemExit(f"--worlds: every size needs 2 or more ranks to have collectives (got {a.worlds!r})")
    shapes = drafter_shapes(*shape)
    comm = [got for n in worlds for got in measure_modes(shapes, n, shape[0], a.grad_accum, a.timeout_s, modes)]
    for got in comm:
        print("\n".join(comm_report(got)))
    if a.json:
        write_text_atomic(Path(a.json), json.dumps(comm, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
