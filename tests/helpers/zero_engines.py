"""The ZeRO engines tests/test_zero_step.py builds and runs (on tests/helpers/zero_net.py's model): the lean or
one-kernel step's engine, the bf16 engine of the gradient path cuts, a run inspected for the divides and storages
its steps read, the two-rank cut case (run in rank processes, so importable from here)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_dist.trainer import zero_step
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from tests.helpers.zero_net import BUCKET, Net, assert_bitwise, batches, cfg_for, state_of


def make_engine(kind: str, fused: bool, cfg=None, device: str = "cpu", **step):
    """A ZeRO engine of the test net with train.optimizer_step `kind`; `step`: install's other options
    (gather, norm_of_flat)."""
    import deepspeed

    cfg = cfg or cfg_for()
    model = Net().to(device)
    opt = build_optimizer(cfg, model, fused=fused)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=build_lr_schedule(cfg, opt, 50),
        config=deepspeed_config(cfg, 1, device != "cpu"),
        dist_init_required=False,
    )
    assert zero_step.install(engine, kind, on_gpu=device != "cpu", **step) == kind
    return engine


def train(engine, data) -> list[float]:
    """engine(batch) -> backward -> step per micro-batch, as trainer/loop.py does."""
    losses = []
    for x, y in data:
        x, y = x.to(engine.device), y.to(engine.device)
        loss = engine(x.to(next(engine.module.parameters()).dtype), y.to(next(engine.module.parameters()).dtype))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def cut_engine(cuts: bool, grad_accum: int, overlap: bool, world: int = 1, device: str = "cpu", kind: str = "lean",
               wait: bool = False, **step):  # fmt: skip
    """A bf16 ZeRO-2 engine with the lean step (the trainer's GPU config), with or without the cuts
    (and with `wait`, the end-of-backward synchronize as a device-side wait: zero_step.wait_on_device;
    `step`: install's other options, gather and norm_of_flat)."""
    import deepspeed

    cfg = cfg_for(grad_accum=grad_accum)
    model = Net().to(device)
    opt = build_optimizer(cfg, model, fused=True)
    ds = deepspeed_config(cfg, world, True)
    ds["zero_optimization"].update(overlap_comm=overlap, reduce_bucket_size=BUCKET)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=build_lr_schedule(cfg, opt, 50), config=ds, dist_init_required=False
    )
    assert zero_step.install(engine, kind, on_gpu=True, grad_cuts=cuts, epilogue_wait=wait, **step) == kind
    return engine


class InplaceDivides(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is torch.ops.aten.div_
        return func(*args, **(kwargs or {}))


def run_and_inspect(engine, data, grad_accum: int) -> dict:
    """Train on `data`; per optimizer step the grad norm, the in-place divides of the backward
    passes, and the storages (bytes) the step's gradient partition reads from."""
    out = {"losses": [], "norms": [], "divides": 0, "storages": [], "freed": []}
    for n, (x, y) in enumerate(data):
        loss = engine(x.bfloat16(), y.bfloat16())
        with InplaceDivides() as mode:
            engine.backward(loss)
        out["divides"] += mode.calls
        if (n + 1) % grad_accum == 0:
            grads = [t for g in engine.optimizer.averaged_gradients.values() for t in g]
            out["storages"].append(sorted({t.untyped_storage().nbytes() for t in grads}))
            big = weakref.ref(max(grads, key=lambda t: t.numel()))
            del grads
        engine.step()
        if (n + 1) % grad_accum == 0:
            gc.collect()
            out["freed"].append(big() is None)  # the step released the largest gradient
            assert all(p.grad is None for p in engine.module.parameters())
            out["norms"].append(float(engine.get_global_grad_norm()))
        out["losses"].append(float(loss.detach().float()))
    return out


def two_rank_case(rank: int, world: int, grad_accum: int, overlap: bool) -> None:
    """On one of two gloo ranks: the same run with and without the cuts (rank-dependent data, so the
    reduction sums different gradients; ZeRO-2 cuts a.weight between the ranks' partitions)."""
    data = [(x + rank, y - rank) for x, y in batches(3 * grad_accum)]
    runs = {}
    for cuts in (False, True):
        engine = cut_engine(cuts, grad_accum, overlap, world=world)
        runs[cuts] = run_and_inspect(engine, data, grad_accum), state_of(engine), engine.optimizer
    (ref, ref_state, ref_opt), (cut, cut_state, cut_opt) = runs[False], runs[True]
    assert_bitwise(cut_state, ref_state)
    assert cut["losses"] == ref["losses"] and cut["norms"] == ref["norms"]
    assert ref_opt.gradient_average and cut_opt.gradient_average  # (a) two ranks divide by 2: kept
    assert ref["divides"] == cut["divides"] > 0
    assert "copy_grads_in_partition" in vars(cut_opt)  # (b) applies
    assert len(cut["storages"][0]) > len(ref["storages"][0])  # a.weight's part read in place


def two_rank_worker(rank: int, world: int, cases: list[tuple[int, bool]]) -> dict:
    """One of two gloo ranks (run_ranks has joined it to the group): every (grad_accum, overlap) case
    in turn, each case's outcome ("ok" or its failed assertion) by case. The checks follow every
    collective of a case, so a case failing on one rank leaves both ranks at the next case."""
    import traceback

    out = {}
    for grad_accum, overlap in cases:
        try:
            two_rank_case(rank, world, grad_accum, overlap)
            out[(grad_accum, overlap)] = "ok"
        except AssertionError:
            out[(grad_accum, overlap)] = traceback.format_exc()[-3000:]
    return out


def assert_nan_batch_skipped(engine) -> None:
    """One optimizer step (2 micro-batches) whose gradient is NaN: skipped on the device, counted in
    dflash_skipped_steps, every weight bitwise unchanged."""
    before = weights(engine)
    x, y = batches(1)[0]
    x[0, 0] = float("nan")
    train(engine, [(x, y), (x, y)])
    assert int(engine.optimizer.dflash_skipped_steps) == 1
    for name, w in weights(engine).items():
        assert torch.equal(w, before[name]), name


def in_place_case(rank: int, world: int, cuts: bool, grad_accum: int) -> list[list[int]]:
    """On one of two gloo ranks: the one-kernel step with its gather (the norm of the gradient list) and
    without it (fused_adamw.step_group_in_place), bitwise the same losses, norms, weights, masters and
    moments. ZeRO-2 cuts a.weight between the ranks' partitions: rank 1's first group starts with a.weight's
    tail and reads b.weight after it. Returns the gradient lengths of each list the in-place kernel read."""
    from dflash_dist.trainer import fused_adamw

    data = [(x + rank, y - rank) for x, y in batches(3 * grad_accum)]
    kernel, read = fused_adamw._list_kernel(), []

    def recording(ps, ms, vs, gs, outs, *args):
        read.append([g.numel() for g in gs])
        return kernel(ps, ms, vs, gs, outs, *args)

    runs, own = {}, fused_adamw._list_kernel
    fused_adamw._list_kernel = lambda: recording
    try:
        for gather in (True, False):
            engine = cut_engine(cuts, grad_accum, True, world=world, kind="fused", gather=gather, norm_of_flat=False)
            runs[gather] = run_and_inspect(engine, data, grad_accum), state_of(engine)
    finally:
        fused_adamw._list_kernel = own
    (ref, ref_state), (got, got_state) = runs[True], runs[False]
    assert_bitwise(got_state, ref_state)
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    return read


def in_place_worker(rank: int, world: int, cases: list[tuple[bool, int]]) -> dict:
    """Every (cuts, grad_accum) case of in_place_case in turn on one of two gloo ranks: per case the lists read,
    or the failed assertion (each case's checks follow all of its collectives: both ranks reach the next)."""
    import traceback

    out = {}
    for case in cases:
        try:
            out[case] = in_place_case(rank, world, *case)
        except AssertionError:
            out[case] = traceback.format_exc()[-3000:]
    return out
