"""One quality-bench run (a variant, a seed, a sample budget) inside a worker process, trained
with the product trainer's own pieces and measured with the evaluator's replay.

Training is trainer/loop.py's step without DeepSpeed: the product's sample order (shard_reader's
seeded shard and sample orders, world size 1), its micro-batches (batching.group_micro_batches
with the trainer's BatchLimit, make_micro_batch: packing, per-(seed, epoch, sample) anchors), the
module DeepSpeed wraps (engine.TrainForward: dflash_loss with the run's kernels set), AdamW from
ds_config.build_optimizer with the run's LR schedule (build_lr_schedule, by samples when
micro-batches are token-budgeted), gradient clipping, and the loss scaling of train.loss_norm.
On a GPU the drafter computes in bf16 with fp32 master weights, as DeepSpeed's bf16 mode does
(its master copy is made from the bf16 weights); on the CPU in fp32. The features come from the
shared device tensor, laid out exactly as make_micro_batch lays them out (`batch_features`).

The run's seed sets the drafter's initialisation and the anchor draws; the sample order is the
run config's (run.seed), the same for every variant and seed. tau is measured at fixed sample
counts with evaluator/batched_replay.py over the shared held-out references.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import queue
import signal
import statistics
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from quality_data import TrainSet, epoch_order
from quality_variants import FEATURE_CODECS, Resolved

from data_pipeline.records import Sample, ShardRecord
from dflash_dist.config import load_config_dict
from dflash_dist.evaluator.batched_replay import measure_replay_batched
from dflash_dist.evaluator.measure import HeldOut, loop_free
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.export import load_drafter
from dflash_dist.model.fused import resolve_kernels
from dflash_dist.model.loss import loss_weights
from dflash_dist.target.loading import load_embeddings
from dflash_dist.trainer.batching import BatchLimit, MicroBatch, group_micro_batches, make_micro_batch
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer
from dflash_dist.trainer.engine import TrainForward

log = logging.getLogger("bench_quality_run")


@dataclass(frozen=True)
class RunSpec:
    variant: Resolved
    seed: int  # drafter init and anchors
    samples: int  # train until this many samples are seen (at a step boundary)
    schedule: tuple[int, str]  # the LR schedule's length and unit ("step" or "sample")
    marks: tuple[int, ...]  # sample counts at which tau is measured (the last is `samples`)
    calibrate_steps: int = 0  # > 0: a timing run of this many steps (no marks), see calibrate()


@dataclass
class Shared:
    """What every worker gets once (tensors shared, not copied: CUDA IPC or shared memory)."""

    data: TrainSet
    refs: list[HeldOut]
    records: tuple[ShardRecord, ...]
    order_seed: int
    target_dir: str
    device: str
    budgets: tuple[int, ...]
    count: str
    kernel_path: str
    max_walks: int
    stop: Any  # multiprocessing Event: the time budget ran out
    active: Any  # multiprocessing Array('i', workers): 1 while that worker trains
    # the trainer's precision: "bf16" (GPU ranks: bf16 compute, fp32 master weights) or "fp32" (CPU ranks)
    precision: str = "fp32"
    stop_ids: tuple[int, ...] = ()  # the target's stop tokens (uncapped replay stops after a round drafting one)
    # each worker's share of the GPU's memory (torch.cuda.set_per_process_memory_fraction), so that a
    # worker's cached blocks cannot starve the others (H200, 7 workers: two runs died of OOM without it)
    memory_fraction: float | None = None


# --- micro-batches ----------------------------------------------------------------------------


def steps_to(data: TrainSet, records: tuple[ShardRecord, ...], order_seed: int, cfg, samples: int) -> int:
    """Optimizer steps a run of `cfg` takes to see `samples` samples: `steps`' grouping (the
    trainer's) over the sample lengths alone, so packed steps of varying sample counts and each
    epoch's short last step are counted exactly."""
    t = cfg.train
    pack = cfg.pack_tokens()
    limit = BatchLimit(t.micro_batch_size, pack or t.micro_batch_tokens, pack is not None)
    n_micro = t.grad_accum * t.world_size
    seen = n_steps = epoch = 0
    while True:
        order = epoch_order(records, data.keys, epoch, order_seed, t.shuffle)
        lengths = ((SimpleNamespace(num_tokens=data.length(i)), {}) for i in order)
        sizes = [len(group) for group, _, _ in group_micro_batches(lengths, limit, keep_short=True)]
        for lo in range(0, len(sizes), n_micro):
            n_steps, seen = n_steps + 1, seen + sum(sizes[lo : lo + n_micro])
            if seen >= samples:
                return n_steps
        epoch += 1


def micro_batches(sh: Shared, cfg, seed: int, dtype: torch.dtype) -> Iterator[tuple[int, MicroBatch, list[int]]]:
    """(epoch, host micro-batch without features, its sample indices), epoch after epoch, as the
    product trainer forms them at world size 1: every sample of an epoch is trained, its last
    count-based micro-batch kept even when short (trainer/step_source.py)."""
    t = cfg.train
    pack = cfg.pack_tokens()
    limit = BatchLimit(t.micro_batch_size, pack or t.micro_batch_tokens, pack is not None)
    d = sh.data
    index = {key: i for i, key in enumerate(d.keys)}
    epoch = 0
    while True:
        order = epoch_order(sh.records, d.keys, epoch, sh.order_seed, t.shuffle)

        def pairs(order=order):
            for i in order:
                a, b = int(d.offsets[i]), int(d.offsets[i + 1])
                # width-0 features: make_micro_batch lays out everything else; batch_features the features
                yield (
                    Sample(
                        d.keys[i],
                        d.input_ids[a:b],
                        d.loss_mask[a:b],
                        torch.empty(b - a, 0, dtype=dtype),
                        d.target_argmax[a:b],
                    ),
                    {},
                )

        for samples, _, _ in group_micro_batches(pairs(), limit, keep_short=True):
            mb = make_micro_batch(
                samples,
                {},
                dtype=dtype,
                num_anchors=t.num_anchors,
                seed=seed,
                epoch=epoch,
                anchor_rule=t.anchor_rule,
                pack_tokens=pack,
            )
            yield epoch, mb, [index[s.key] for s in samples]
        epoch += 1


def steps(sh: Shared, cfg, seed: int, dtype: torch.dtype) -> Iterator[tuple[int, list[tuple[MicroBatch, list[int]]]]]:
    """(epoch, its micro-batches) per optimizer step: grad_accum x world_size micro-batches (every
    rank's slots, here from the one world-size-1 stream), a step never spanning two epochs: an
    epoch's last step is short (step_source.py hands it out with empty slots)."""
    n_micro = cfg.train.grad_accum * cfg.train.world_size
    for epoch, items in itertools.groupby(micro_batches(sh, cfg, seed, dtype), key=lambda x: x[0]):
        chunk: list[tuple[MicroBatch, list[int]]] = []
        for _, mb, idx in items:
            chunk.append((mb, idx))
            if len(chunk) == n_micro:
                yield epoch, chunk
                chunk = []
        if chunk:
            yield epoch, chunk


def batch_features(
    data: TrainSet,
    idx: list[int],
    mb: MicroBatch,
    packed: bool,
    layers: tuple[int, ...],
    codec: str | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The micro-batch's features on the data's device, laid out as make_micro_batch lays out
    real samples' features (packed: one row, samples back to back then zeros; else right-padded
    rows), restricted to the variant's captured layers and passed through its codec."""
    h, k = data.hidden_size, len(data.layer_ids)
    feats = data.features
    if layers != tuple(range(k)):
        if layers == tuple(range(len(layers))):
            feats = feats[:, : len(layers) * h]  # a prefix of the layers: a view
        else:
            cols = torch.cat([torch.arange(i * h, (i + 1) * h) for i in layers]).to(feats.device)
            feats = feats.index_select(1, cols)
    dev = feats.device
    spans = [(int(data.offsets[i]), int(data.offsets[i + 1])) for i in idx]
    rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(dev)
    real = feats.index_select(0, rows)
    if codec is not None:
        real = FEATURE_CODECS[codec](real, len(layers))
    real = real.to(dtype)
    b, s_len = mb.input_ids.shape
    out = torch.zeros(b, s_len, real.shape[1], dtype=dtype, device=dev)
    if packed:
        out[0, : real.shape[0]] = real
        return out
    dest = torch.cat([torch.arange(j * s_len, j * s_len + (hi - lo)) for j, (lo, hi) in enumerate(spans)]).to(dev)
    out.view(b * s_len, -1).index_copy_(0, dest, real)
    return out


# --- one run ----------------------------------------------------------------------------------

_EMBEDDINGS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _embeddings(target_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    if target_dir not in _EMBEDDINGS:  # read once per worker
        _EMBEDDINGS[target_dir] = load_embeddings(Path(target_dir))
    return _EMBEDDINGS[target_dir]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Clock:
    """Wall time of the run's training steps and their fair share of the GPU: a step's wall time
    divided by the number of workers training at its end (the GPU is shared). The first step
    also compiles (flex_attention, torch.compile): it counts at the median step's time, and its
    excess is reported as warm-up."""

    def __init__(self, sh: Shared, worker: int) -> None:
        self.sh, self.worker = sh, worker
        self.steps: list[tuple[float, int]] = []  # (wall s, workers training)

    def training(self, on: bool) -> None:
        self.sh.active[self.worker] = int(on)

    def add(self, dt: float) -> None:
        self.steps.append((dt, max(1, sum(self.sh.active[:]))))

    def _first_as_median(self) -> float:
        rest = [dt for dt, _ in self.steps[1:]]
        return statistics.median(rest) if rest else (self.steps[0][0] if self.steps else 0.0)

    def train_s(self) -> float:
        return sum(dt for dt, _ in self.steps[1:]) + (self._first_as_median() if self.steps else 0.0)

    def gpu_s(self) -> float:
        if not self.steps:
            return 0.0
        first = self._first_as_median() / self.steps[0][1]
        return first + sum(dt / n for dt, n in self.steps[1:])

    def warmup_s(self) -> float:
        return max(0.0, self.steps[0][0] - self._first_as_median()) if self.steps else 0.0


def _refs(sh: Shared, layers: tuple[int, ...]) -> list[HeldOut]:
    """The held-out references with the features of the captured layers `layers` only (what the
    variant's fc reads; a prefix of the layers is a view, no copy)."""
    k, h = len(sh.data.layer_ids), sh.data.hidden_size
    if layers == tuple(range(k)):
        return sh.refs
    if layers == tuple(range(len(layers))):
        return [replace(r, features=r.features[:, : len(layers) * h]) for r in sh.refs]
    cols = torch.cat([torch.arange(i * h, (i + 1) * h) for i in layers])
    return [replace(r, features=r.features.index_select(1, cols.to(r.features.device))) for r in sh.refs]


def _tau(sh: Shared, drafter: DFlashDrafter, layers: tuple[int, ...] | None = None) -> tuple[dict, float]:
    """Replay tau of the drafter as it is, on the evaluator's kernel set (torch: as load_drafter
    builds it), over the references' features of the captured layers it reads (default: all)."""
    t0 = time.monotonic()
    refs = _refs(sh, layers if layers is not None else tuple(range(len(sh.data.layer_ids))))
    kernels = drafter.kernels
    drafter.set_kernels("torch")
    drafter.eval()
    try:
        m = measure_replay_batched(drafter, refs, sh.budgets, sh.count, sh.kernel_path, sh.stop_ids, sh.max_walks)
    finally:
        drafter.set_kernels(kernels)
        drafter.train()
    r = m.result
    return {
        "tau_chain": r.tau_chain,
        "tau_ddtree": {str(b): r.tau_ddtree(b) for b in sh.budgets},
        "rounds": r.rounds,
        # chain rounds that took more than 8 tokens: where block 8's cap would have bound (block8 vs 16)
        "rounds_over_8": sum(r.accept_hist[8:]) / max(r.rounds, 1),
        "loop_free": _json_budgets(loop_free(m, refs, sh.budgets)),  # the prompts whose continuation is no loop
    }, time.monotonic() - t0


def _json_budgets(record: dict) -> dict:
    return {**record, "tau_ddtree": {str(b): t for b, t in record["tau_ddtree"].items()}}


def train_run(sh: Shared, spec: RunSpec, worker: int) -> dict:
    """Train one (variant, seed) to spec.samples, measuring tau at spec.marks; stops early (at a
    step boundary, with a last measurement) when the bench's time budget runs out."""
    t_start = time.monotonic()
    v = spec.variant
    cfg = load_config_dict(v.cfg)
    t = cfg.train
    dev = torch.device(sh.device)
    on_gpu = dev.type == "cuda"
    mixed = sh.precision == "bf16"
    dtype = torch.bfloat16 if mixed else torch.float32  # the trainer's compute dtype
    torch.manual_seed(spec.seed)  # engine.build_engine: the drafter is built on the host after the seed
    master = DFlashDrafter(v.drafter, kernels=resolve_kernels(t.kernels, on_gpu))
    master.set_target_weights(*_embeddings(sh.target_dir))
    master.to(dev)
    work, pairs = master, []
    if mixed:  # bf16 compute copy; fp32 master weights made from it (DeepSpeed's bf16 mode)
        work = copy.deepcopy(master).to(torch.bfloat16)
        work.set_kernels(master.kernels)
        pairs = [(m, w) for m, w in zip(master.parameters(), work.parameters()) if m.requires_grad]
        for m, w in pairs:
            m.data.copy_(w.data.float())
    module = TrainForward(work, t.label_source, t.gamma, t.attention, t.position_weighting)
    optimizer = build_optimizer(cfg, master, fused=on_gpu)
    schedule = build_lr_schedule(cfg, optimizer, spec.schedule[0], spec.schedule[1])
    trainable = [p for p in master.parameters() if p.requires_grad]
    n_micro = t.grad_accum * t.world_size  # one optimizer step = every rank's accumulated micro-batches
    gamma = v.drafter.loss_decay_gamma if t.gamma is None else t.gamma
    packed = cfg.pack_tokens() is not None
    stream = steps(sh, cfg, spec.seed, dtype)
    clock = _Clock(sh, worker)
    points: list[dict] = []
    losses: list[torch.Tensor] = []
    seen = step = 0
    marks = list(spec.marks)
    status, eval_s = "done", 0.0
    steps_limit = spec.calibrate_steps or math.inf
    try:
        clock.training(True)
        while seen < spec.samples and step < steps_limit:
            if _orphaned():
                raise SystemExit(f"worker {worker}: the bench's main process is gone")
            t0 = time.monotonic()
            epoch, gathered = next(stream)  # n_micro micro-batches, fewer at an epoch's end
            batches = [mb for mb, _ in gathered]
            # the gradient is the mean over the step's real micro-batches (loop.Trainer.train_step scales
            # a short step's losses); step_slots' denominators already sum the step's slot weights
            divide = n_micro if t.loss_norm == "step_slots" else len(batches)
            denominator = None
            if t.loss_norm == "step_slots":  # trainer/loop.py Trainer._loss_denominators at world size 1
                total = sum(
                    float(
                        loss_weights(
                            b.input_ids, b.loss_mask, b.anchors, v.drafter.block_size, gamma, t.position_weighting
                        ).sum()
                    )
                    for b in batches
                )
                denominator = torch.tensor(max(total, 1e-6) / n_micro, dtype=torch.float32, device=dev)
            step_loss = torch.zeros((), dtype=torch.float64, device=dev)
            for mb, idx in gathered:
                feats = batch_features(sh.data, idx, mb, packed, v.feature_layers, v.codec, dtype)
                b = mb.to(dev)
                loss, out = module(
                    b.input_ids,
                    feats,
                    b.loss_mask,
                    b.target_argmax,
                    b.anchors.positions,
                    b.anchors.keep,
                    denominator,
                    b.anchors.starts,
                    b.anchors.ends,
                )
                (loss / divide).backward()  # DeepSpeed divides by grad_accum and averages over ranks
                step_loss += out.loss.detach().to(torch.float64)
                if mixed:  # accumulate into the fp32 master gradients
                    for m, w in pairs:
                        if w.grad is not None:
                            m.grad = w.grad.float() if m.grad is None else m.grad.add_(w.grad)
                            w.grad = None
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
            samples = sum(len(b.keys) for b in batches)
            if spec.schedule[1] == "sample":
                schedule.lr_lambdas[0].done += samples  # loop.Trainer._advance_schedule
            lr = optimizer.param_groups[0]["lr"]  # the LR this step uses (train_log.jsonl's)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            for m, w in pairs:
                w.data.copy_(m.data)
            seen += samples
            step += 1
            losses.append(step_loss / len(batches))  # the step's mean loss (train_log.jsonl's); read when measured
            if spec.calibrate_steps:
                _sync(dev)
            clock.add(time.monotonic() - t0)
            stop = sh.stop.is_set()
            at_mark = bool(marks and seen >= marks[0]) or seen >= spec.samples
            if at_mark or (stop and not spec.calibrate_steps):
                while marks and seen >= marks[0]:
                    marks.pop(0)
                clock.training(False)
                tau, dt = _tau(sh, work, v.feature_layers)
                eval_s += dt
                window = torch.stack(losses).mean().item()
                if not math.isfinite(window):  # as the trainer fails a run whose logged loss is not finite
                    raise FloatingPointError(f"{v.name} seed {spec.seed}: non-finite loss {window} by step {step}")
                losses = []
                points.append(
                    {
                        "samples": seen,
                        "step": step,
                        "epoch": epoch,
                        "loss": window,
                        "lr": lr,
                        "train_s": clock.train_s(),
                        "gpu_s": clock.gpu_s(),
                        "eval_s": dt,
                        "mark": at_mark,  # False: where the time budget stopped the run, between marks
                        **tau,
                    }
                )
                log.info(
                    "%s seed %d: %d samples, step %d, tau chain %.3f ddtree %s, loss %.3f (%.0f s)",
                    v.name,
                    spec.seed,
                    seen,
                    step,
                    tau["tau_chain"],
                    " ".join(f"{b}:{x:.3f}" for b, x in tau["tau_ddtree"].items()),
                    window,
                    time.monotonic() - t_start,
                )
                clock.training(True)
            if stop and not spec.calibrate_steps:
                status = "stopped" if seen < spec.samples else "done"
                break
    finally:
        clock.training(False)
    return {
        "variant": v.name,
        "seed": spec.seed,
        "status": status,
        "points": points,
        "steps": step,
        "samples": seen,
        "train_s": clock.train_s(),
        "gpu_s": clock.gpu_s(),
        "warmup_s": clock.warmup_s(),
        "eval_s": eval_s,
        "wall_s": time.monotonic() - t_start,
        "fc_in_features": work.fc.in_features,
        "target_layer_ids": list(v.drafter.target_layer_ids),
        "block_size": v.drafter.block_size,
        "kernels": work.kernels,
        "dtype": str(dtype).removeprefix("torch."),
        "step_times": [round(dt, 4) for dt, _ in clock.steps] if spec.calibrate_steps else None,
    }


def calibrate(sh: Shared, spec: RunSpec, worker: int) -> dict:
    """A few timed steps (the first compiles) and one tau measurement of the drafter they left:
    what the bench sizes the runs' sample budget from, measured with every worker doing the same."""
    res = train_run(sh, replace(spec, marks=(), calibrate_steps=spec.calibrate_steps), worker)
    times = res["step_times"][1:] or res["step_times"]
    _, eval_s = _tau(sh, _untrained(sh, spec), spec.variant.feature_layers)
    return {
        "worker": worker,
        "step_s": statistics.median(times),
        "warmup_s": res["warmup_s"],
        "samples_per_step": res["samples"] / max(1, res["steps"]),
        "eval_s": eval_s,
    }


def _untrained(sh: Shared, spec: RunSpec) -> DFlashDrafter:
    """An untrained drafter of the spec's shape on the device (the eval cost of a drafter that
    accepts little: every round a forward, the most a measurement can cost)."""
    dev = torch.device(sh.device)
    torch.manual_seed(spec.seed)
    d = DFlashDrafter(spec.variant.drafter)
    d.set_target_weights(*_embeddings(sh.target_dir))
    return d.to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)


def product_point(sh: Shared, checkpoint: dict) -> dict:
    """tau of one of the product run's own exports, measured here as every variant is."""
    dev = torch.device(sh.device)
    embed, head = _embeddings(sh.target_dir)
    drafter = load_drafter(checkpoint["export"], embed, head, device=dev)
    captured = sh.data.layer_ids
    if tuple(drafter.config.target_layer_ids) != captured:
        raise ValueError(
            f"{checkpoint['export']}: reads layers {list(drafter.config.target_layer_ids)}, the run "
            f"captured {list(captured)}"
        )
    tau, dt = _tau(sh, drafter)
    return {"step": checkpoint["step"], "samples": checkpoint["samples"], "eval_s": dt, **tau}


# --- the worker process -----------------------------------------------------------------------


_PARENT: int | None = None  # the bench's main process; a worker whose parent is gone exits


def _orphaned() -> bool:
    return _PARENT is not None and os.getppid() != _PARENT


def worker_main(worker: int, sh: Shared, tasks, results, threads: int) -> None:
    """Take tasks until None: ("calibrate" | "train", RunSpec) or ("product", checkpoint dict).
    SIGINT/SIGTERM are the main process's to act on (it stops the runs through `sh.stop`); a
    worker whose main process died (SIGKILL) leaves instead of holding the device."""
    global _PARENT
    _PARENT = os.getppid()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [worker {worker}] %(message)s")
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sh.memory_fraction is not None:
        dev = torch.device(sh.device)  # "cuda" has no index, which the call needs: the current device's
        index = torch.cuda.current_device() if dev.index is None else dev.index
        torch.cuda.set_per_process_memory_fraction(sh.memory_fraction, index)
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if _orphaned():
                return
            continue
        if task is None:
            return
        results.put(run_task(sh, task, worker))


def run_task(sh: Shared, task: tuple, worker: int) -> dict:
    """One task's result record; an exception becomes a failed record with its traceback."""
    kind, payload = task
    head = {"kind": kind, "worker": worker}
    try:
        if kind == "train" and sh.stop.is_set():
            res = {"variant": payload.variant.name, "seed": payload.seed, "status": "not_run"}
        elif kind == "train":
            res = train_run(sh, payload, worker)
        elif kind == "calibrate":
            res = calibrate(sh, payload, worker)
        else:
            res = product_point(sh, payload)
    except Exception:
        res = {"status": "failed", "error": traceback.format_exc()}
        if kind in ("train", "calibrate"):
            res.update(variant=payload.variant.name, seed=payload.seed)
        log.error("%s failed:\n%s", kind, res["error"])
    return {**head, **res}
