"""ZeRO-1/2's gradient collectives as DeepSpeed 0.19.8 issues them, computed from the trainable
parameters' sizes (bench/cost_model.py prices them; bench/measure_comm.py and tests/test_measure_comm.py
check them against a real engine's comms logger at 2 and 3 gloo ranks, call by call size).

What stage_1_and_2.py does with our ds_config (contiguous_gradients, reduce_bucket_size B = hidden^2,
no round-robin, no parameter alignment): each parameter group (build_optimizer: matrices, then 1-D
gains) is flattened in registration order, padded to a multiple of 2N, and cut into N equal partitions.
As the backward produces gradients, they fill the ipg bucket; a gradient that would overflow B first
sends the bucket, and one larger than B goes alone (reduce_independent_p_g_buckets_and_remove_grads);
the epilogue sends the rest. `average_tensor` cuts a bucket into slices by destination partition
(consecutive slices of one destination merged) and then, per train.zero_grad_reduce:

- "allreduce" (use_multi_rank_bucket_allreduce: true, DeepSpeed's default): all slices in one list,
  all-reduced in chunks of more than B elements (allreduce_and_scatter); every rank keeps its slices.
- "reduce" (false): per destination rank, in the order its first slice appears, a `reduce` to that
  rank of its slices, in chunks of more than B elements (allreduce_no_retain -> allreduce_and_copy).
  Under overlap_comm (our GPU config) allreduce_and_copy synchronizes the device before each call
  (torch.cuda.synchronize: the host waits for the backward queued so far and the previous reduce),
  so within a bucket every reduce but the last runs with no backward queued behind it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("allreduce", "reduce")


@dataclass(frozen=True)
class Bucket:
    numel: int  # gradient elements the bucket holds (the backward that produced them precedes its calls)
    calls: tuple[int, ...]  # message elements of each collective it issues, in issue order


def partition_size(group_numel: int, world: int) -> int:
    """One rank's partition of a flat group: padded to a multiple of 2N (nccl_start_alignment_factor)."""
    align = 2 * world
    return math.ceil(group_numel / align) * align // world


def destinations(numels: Sequence[int], matrix: Sequence[bool], world: int) -> list[list[tuple[int, int]]]:
    """Per parameter, its gradient's slices as (destination rank, elements) in offset order: the
    partitions its place in its group's flat buffer overlaps (initialize_gradient_partition)."""
    out: list[list[tuple[int, int]]] = [[] for _ in numels]
    for members in ([i for i, m in enumerate(matrix) if m], [i for i, m in enumerate(matrix) if not m]):
        if not members:
            continue
        size = partition_size(sum(numels[i] for i in members), world)
        start = 0
        for i in members:
            end = start + numels[i]
            for d in range(start // size, (end - 1) // size + 1):
                out[i].append((d, min(end, (d + 1) * size) - max(start, d * size)))
            start = end
    return out


def _chunks(sizes: Sequence[int], bucket: int) -> list[int]:
    """allreduce_and_scatter / allreduce_no_retain: a call each time the running sum passes B, then the rest."""
    calls, acc = [], 0
    for n in sizes:
        acc += n
        if acc > bucket:
            calls.append(acc)
            acc = 0
    return calls + ([acc] if acc else [])


def _calls(slices: list[tuple[int, int]], bucket: int, mode: str) -> tuple[int, ...]:
    merged: list[list[int]] = []
    for dst, n in slices:
        if merged and merged[-1][0] == dst:
            merged[-1][1] += n
        else:
            merged.append([dst, n])
    if mode == "allreduce":
        return tuple(_chunks([n for _, n in merged], bucket))
    per_dst: dict[int, list[int]] = {}
    for dst, n in merged:
        per_dst.setdefault(dst, []).append(n)
    return tuple(c for sizes in per_dst.values() for c in _chunks(sizes, bucket))


def grad_buckets(
    numels: Sequence[int], matrix: Sequence[bool], order: Sequence[int], world: int, bucket: int, mode: str
) -> list[Bucket]:
    """The ipg buckets of one backward, in the order they are sent, with their collectives.
    `numels`/`matrix`: the trainable parameters in registration order (matrix: >= 2 dims, the decayed
    group); `order`: their indices in the order the backward produces their gradients."""
    if mode not in MODES:
        raise ValueError(f"gradient reduction {mode!r}: expected one of {MODES}")
    where = destinations(numels, matrix, world)
    out, current, held = [], [], 0

    def send() -> None:
        if current:
            slices = [s for i in current for s in where[i]]
            out.append(Bucket(sum(numels[i] for i in current), _calls(slices, bucket, mode)))

    for i in order:
        if numels[i] == 0:
            continue
        if held + numels[i] > bucket:
            send()
            current, held = [], 0
        current.append(i)
        held += numels[i]
    send()
    return out


def backward_ms(
    buckets: Sequence[Bucket], bwd_ms: float, call_ms, sync_ms: float = 0.0, host_sync: bool = False
) -> float:
    """One micro-batch's backward with its gradient collectives under overlap_comm, on three clocks:
    the compute stream, the reduction stream and the host. Each bucket's backward share is
    bwd_ms x its elements / all elements (GEMM time follows the weights). average_tensor makes the
    reduction stream wait for the bucket's backward and the compute stream wait for the reductions
    issued before (the ipg buffers are reused); `call_ms(elements)` is one collective's time. With
    `host_sync` (the reduce path) the host synchronizes the device before each call (+ sync_ms) and
    queues no more backward until it returns. The epilogue synchronizes: the end is the last clock."""
    total = sum(b.numel for b in buckets) or 1
    host = compute = comm = 0.0
    for b in buckets:
        compute = max(compute, host) + bwd_ms * b.numel / total
        earlier = comm
        for n in b.calls:
            if host_sync:
                host = max(host, compute, comm) + sync_ms
            comm = max(comm, compute, host) + call_ms(n)
        compute = max(compute, earlier)
    return max(host, compute, comm)
