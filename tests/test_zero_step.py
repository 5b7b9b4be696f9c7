"""The lean ZeRO step (trainer/zero_step.py) against DeepSpeed's own, on real DeepSpeed engines
over gloo: the same losses and weights within fp32 rounding with clipping active (fused and
foreach AdamW, two parameter groups, gradient accumulation), a non-finite gradient skipped (on the
device with fused AdamW, on the host with foreach AdamW), checkpoints of the same format and an
exact resume (also a lean or DeepSpeed-step checkpoint resumed under the one-kernel step); at 2
ranks (ZeRO-2 partitions split inside tensors) the pinned loss curve's run within fp32 noise; the
gradient path cuts (bf16 as on a GPU): bitwise the same run without them at 1 and 2 ranks,
accumulation 1 and 2, overlap_comm on and off, the divide and the large copy really gone, restored
by uninstall, exact resume; on CUDA (`-m gpu`) bf16 engines."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_dist.actors.local_ranks import run_ranks
from dflash_dist.config import load_config
from dflash_dist.trainer import zero_step
from dflash_dist.trainer.ds_config import build_optimizer, deepspeed_config
from tests.helpers.zero_engines import (
    assert_nan_batch_skipped,
    cut_engine,
    make_engine,
    run_and_inspect,
    train,
    two_rank_worker,
    weights,
)
from tests.helpers.zero_net import CLIP, Net, assert_bitwise, batches, cfg_for, state_of


@pytest.mark.parametrize("fused", [True, False], ids=["fused_adamw", "foreach_adamw"])
def test_lean_step_matches_deepspeeds_step(fused, single_rank_gloo):
    data = batches(12)  # 6 optimizer steps of 2 micro-batches
    ref = make_engine("deepspeed", fused)
    ref_losses = train(ref, data[:2])
    ref_norm = float(ref.get_global_grad_norm())
    ref_losses += train(ref, data[2:])
    lean = make_engine("lean", fused)
    lean_losses = train(lean, data[:2])
    lean_norm = float(lean.get_global_grad_norm())
    lean_losses += train(lean, data[2:])
    assert ref_norm > 10 * CLIP, "the test needs the clip active"
    assert math.isclose(lean_norm, ref_norm, rel_tol=1e-6), (lean_norm, ref_norm)
    assert lean_losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in weights(ref).items():
        torch.testing.assert_close(weights(lean)[name], w, rtol=1e-5, atol=1e-6, msg=name)
    # the clip matters here: without it the same run ends elsewhere
    free = make_engine("deepspeed", fused, cfg_for(grad_clip=0.0))
    train(free, data)
    assert not torch.allclose(weights(free)["a.weight"], weights(ref)["a.weight"], atol=1e-3)
    # the same state DeepSpeed's step keeps: AdamW step counts and moments per flat partition
    for s_ref, s_lean in zip(ref.optimizer.optimizer.state.values(), lean.optimizer.optimizer.state.values()):
        assert float(s_ref["step"]) == float(s_lean["step"]) == 6
        torch.testing.assert_close(s_lean["exp_avg"], s_ref["exp_avg"], rtol=1e-5, atol=1e-7)


def test_one_kernel_step_follows_torchs_adamw(single_rank_gloo, monkeypatch):
    """train.optimizer_step=fused (trainer/fused_adamw.py, compiled for the CPU here) against
    DeepSpeed's step with torch's AdamW: the same losses and weights within fp32 rounding over 6
    clipped steps, the same state tensors, and the kernel is what ran (torch's AdamW.step never did),
    once per partition group and step (a call per tensor made the step host-bound on the GPU)."""
    from dflash_dist.trainer import fused_adamw

    data = batches(12)
    ref = make_engine("deepspeed", True)
    ref_losses = train(ref, data)
    one = make_engine("fused", False)  # torch's AdamW stays the state's owner; its step must not run
    calls, kernel_calls = [], []
    step = one.optimizer.optimizer.step

    def counted(*a, **k):
        calls.append(1)
        return step(*a, **k)

    counted._wrapped_by_lr_sched = step._wrapped_by_lr_sched  # still the LR scheduler's wrapper to its check
    one.optimizer.optimizer.step = counted
    kernel = fused_adamw._kernel()
    monkeypatch.setattr(fused_adamw, "_kernel", lambda: lambda *a: kernel_calls.append(a[0].numel()) or kernel(*a))
    with warnings.catch_warnings():  # torch's LR scheduler would warn that the optimizer never stepped
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step", category=UserWarning)
        one_losses = train(one, data)
    assert calls == []
    groups = one.optimizer.single_partition_of_fp32_groups
    assert len(groups) == 2 and kernel_calls == [g.numel() for g in groups] * 6
    assert one_losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in weights(ref).items():
        torch.testing.assert_close(weights(one)[name], w, rtol=1e-5, atol=1e-6, msg=name)
    for s_ref, s_one in zip(ref.optimizer.optimizer.state.values(), one.optimizer.optimizer.state.values()):
        assert s_one.keys() == s_ref.keys()
        assert s_one["step"].dtype == s_ref["step"].dtype and float(s_one["step"]) == float(s_ref["step"]) == 6
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s_one[k], s_ref[k], rtol=1e-5, atol=1e-9, msg=k)
    # the parameters DeepSpeed hands the model are the kernel's output, not a stale copy
    for p, flat in zip(one.optimizer.bit16_groups, one.optimizer.single_partition_of_fp32_groups):
        assert torch.equal(torch.cat([q.detach().reshape(-1) for q in p]), flat[: sum(q.numel() for q in p)])


@pytest.mark.parametrize("of_flat", [True, False], ids=["gathered", "list"])
def test_one_kernel_step_takes_the_norm_of_the_partitions_it_gathered(of_flat, single_rank_gloo, monkeypatch):
    """The one-kernel step gathers each group's gradients into the flat partition its kernel reads, and
    the clip's norm reads those partitions, one reduction each, instead of a multi-tensor norm over the
    gradient list before the gather (which read every gradient once more at its own, slower rate: 1.5 ms
    a step at the 27B shape on the H200). The list form (zero_step.install(norm_of_flat=False)) stays
    for the bench; both norms agree to fp32 rounding and both train as DeepSpeed's step does."""
    from dflash_dist.trainer import fused_adamw

    data = batches(8)  # 4 optimizer steps of 2 micro-batches
    engine = make_engine("fused", False)
    zero_step.install(engine, "fused", on_gpu=False, norm_of_flat=of_flat)
    kernel, kernel_grads = fused_adamw._kernel(), []
    monkeypatch.setattr(fused_adamw, "_kernel", lambda: lambda *a: kernel_grads.append(a[3].data_ptr()) or kernel(*a))
    reads = []  # (norm, data_ptr, numel) of every tensor a norm of the step reads
    vector_norm, foreach_norm = torch.linalg.vector_norm, torch._foreach_norm

    def vector(t, *a, **k):
        reads.append(("vector", t.data_ptr(), t.numel()))
        return vector_norm(t, *a, **k)

    def multi(ts, *a, **k):
        reads.extend(("foreach", t.data_ptr(), t.numel()) for t in ts)
        return foreach_norm(ts, *a, **k)

    monkeypatch.setattr(torch.linalg, "vector_norm", vector)
    monkeypatch.setattr(torch, "_foreach_norm", multi)
    norms = []
    for x, y in data:
        engine.backward(engine(x, y))
        stepped = len(kernel_grads)
        reads.clear()
        engine.step()
        if len(kernel_grads) == stepped:  # a micro-batch inside the accumulation: no optimizer step
            assert reads == []
            continue
        norms.append(float(engine.optimizer._global_grad_norm))
        sizes = [g.numel() for g in engine.optimizer.single_partition_of_fp32_groups]
        if of_flat:  # one reduction a group, over the very tensor the kernel then updates from
            assert [r[0] for r in reads[: len(sizes)]] == ["vector"] * len(sizes)
            assert [r[2] for r in reads[: len(sizes)]] == sizes
            assert [r[1] for r in reads[: len(sizes)]] == kernel_grads[-len(sizes):]
            assert "foreach" not in {r[0] for r in reads}
        else:
            assert reads[0][0] == "foreach" and len([r for r in reads if r[0] == "foreach"]) > len(sizes)
    ref = make_engine("deepspeed", False)
    ref_norms = []
    for i, (x, y) in enumerate(data):
        ref.backward(ref(x, y))
        ref.step()
        if i % 2:
            ref_norms.append(float(ref.optimizer._global_grad_norm))
    assert len(norms) == 4 and norms == pytest.approx(ref_norms, rel=1e-5)


@pytest.mark.parametrize(
    ("kind", "fused"), [("lean", True), ("fused", True), ("lean", False)], ids=["lean", "fused", "lean_foreach"]
)
def test_non_finite_gradient_skips_the_update(kind, fused, single_rank_gloo):
    """A NaN gradient changes no weight, master or AdamW state (step counts included) and is counted.
    torch's fused AdamW and the one kernel skip it on the device (dflash_skipped_steps; the host does
    not learn of it). Without fused AdamW (the CPU trainer's foreach AdamW) the lean step reads the
    norm on the host and skips as DeepSpeed's step does: the engine's skipped_steps, the LR schedule
    held, although this fp32 engine's check_grad_overflow is off (it had applied the NaN)."""
    from dflash_dist.trainer import engine as trainer_engine

    engine = make_engine(kind, fused=fused, cfg=cfg_for(grad_accum=1))
    assert not engine.optimizer.check_grad_overflow  # DeepSpeed's fp32 engine (CPU) skips on the norm alone
    train(engine, batches(2))
    before, lr = weights(engine), engine.get_lr()
    state = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.optimizer.state.values()]
    x, y = batches(1)[0]
    x[0, 0] = float("nan")
    train(engine, [(x, y)])
    assert trainer_engine.skipped_steps(engine) == 1
    if fused:
        assert int(engine.optimizer.dflash_skipped_steps) == 1
        assert not engine.optimizer.overflow  # not known on the host: no sync
    else:
        assert engine.skipped_steps == 1 and int(engine.optimizer.dflash_skipped_steps) == 0
        assert engine.get_lr() == lr
    for name, w in weights(engine).items():
        assert torch.equal(w, before[name]), name
    for s0, s1 in zip(state, engine.optimizer.optimizer.state.values()):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s0[k], s1[k]), k
    train(engine, batches(3)[2:])  # a finite step after it updates again
    assert not torch.equal(weights(engine)["a.weight"], before["a.weight"])
    assert trainer_engine.skipped_steps(engine) == 1


def _walk(x, key: str, out: dict) -> None:
    if torch.is_tensor(x):
        out[key] = (tuple(x.shape), str(x.dtype))
    elif isinstance(x, dict):
        for k, v in x.items():
            _walk(v, f"{key}/{k}", out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{key}/{i}", out)


def _saved_structure(path: Path) -> dict:
    """Keys, shapes and dtypes of every tensor in a DeepSpeed tag directory's files."""
    out: dict = {}
    for f in sorted(path.glob("*.pt")):
        _walk(torch.load(f, map_location="cpu", weights_only=False), f.name, out)  # our own file, just written
    return out


@pytest.mark.parametrize("kind", ["lean", "fused"])
def test_lean_checkpoints_have_deepspeeds_format_and_resume_exactly(kind, tmp_path, single_rank_gloo):
    data = batches(10)
    ref = make_engine("deepspeed", fused=True)
    train(ref, data[:4])
    ref.save_checkpoint(str(tmp_path / "ds"), tag="t")
    first = make_engine(kind, fused=True)
    train(first, data[:4])
    first.save_checkpoint(str(tmp_path / "lean"), tag="t")
    assert _saved_structure(tmp_path / "lean" / "t") == _saved_structure(tmp_path / "ds" / "t")
    train(first, data[4:])
    resumed = make_engine(kind, fused=True)
    resumed.load_checkpoint(str(tmp_path / "lean"), tag="t")
    train(resumed, data[4:])
    for name, w in weights(first).items():
        assert torch.equal(weights(resumed)[name], w), name
    # a lean checkpoint also continues under DeepSpeed's own step (same state, same format)
    other = make_engine("deepspeed", fused=True)
    other.load_checkpoint(str(tmp_path / "lean"), tag="t")
    train(other, data[4:])
    for name, w in weights(first).items():
        torch.testing.assert_close(weights(other)[name], w, rtol=1e-5, atol=1e-6)


def _optimizer_state(engine) -> list[torch.Tensor]:
    """The fp32 masters and every AdamW state tensor (step counts included), as exact copies."""
    opt = engine.optimizer
    state = [s[k].detach().clone() for s in opt.optimizer.state.values() for k in ("step", "exp_avg", "exp_avg_sq")]
    return [m.detach().clone() for m in opt.single_partition_of_fp32_groups] + state


@pytest.mark.parametrize("writer", ["lean", "deepspeed"])
def test_checkpoint_of_another_step_resumes_under_the_one_kernel_step(writer, tmp_path, single_rank_gloo):
    """A checkpoint written under the lean step or DeepSpeed's own, resumed with
    train.optimizer_step=fused: bitwise the writing run switched to the one-kernel AdamW in memory
    (the same state, never stopped: the same weights, masters, moments, step counts and LR), and
    within the fused-vs-deepspeed resume tolerance of a run under fused from the start."""
    data = batches(10)  # 5 optimizer steps of 2 micro-batches, the checkpoint after 2
    first = make_engine(writer, fused=True)
    train(first, data[:4])
    first.save_checkpoint(str(tmp_path), tag="t")
    zero_step.uninstall(first)  # the same engine continues under the one-kernel step
    assert zero_step.install(first, "fused", on_gpu=False) == "fused"
    train(first, data[4:])
    resumed = make_engine("fused", fused=True)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    lr_at_load = resumed.get_lr()
    train(resumed, data[4:])
    assert lr_at_load != make_engine("fused", fused=True).get_lr()  # the schedule came back, not its start
    assert resumed.get_lr() == first.get_lr() and resumed.global_steps == first.global_steps == 5
    assert [float(s["step"]) for s in resumed.optimizer.optimizer.state.values()] == [5.0, 5.0]
    for name, w in weights(first).items():
        assert torch.equal(weights(resumed)[name], w), name
    assert_bitwise(_optimizer_state(resumed), _optimizer_state(first))
    assert int(resumed.optimizer.dflash_skipped_steps) == 0
    fused_throughout = make_engine("fused", fused=True)
    train(fused_throughout, data)
    for name, w in weights(fused_throughout).items():
        torch.testing.assert_close(weights(resumed)[name], w, rtol=1e-5, atol=1e-6)


def test_universally_loaded_steps_go_where_torchs_own_load_puts_them():
    """DeepSpeed's universal load (an elastic resume) sets AdamW's `step` as its converter stored it:
    on the CPU, one tensor for several partitions under ZeRO-3. engine.place_loaded_steps gives each
    state its own, and a fused (or capturable) group's goes beside its parameter in fp32, as torch's
    load_state_dict places it: torch's fused kernel and the one-kernel AdamW read it on the GPU (where
    the one-kernel step's `step -= found_inf` of a CPU step and a CUDA flag raised). The meta device
    stands in for the GPU; a plain group's step stays as loaded; a partition outside every group
    (ZeRO-3 puts its sub-groups' partitions in the groups only while it steps them) goes by theirs."""
    from dflash_dist.trainer.engine import place_loaded_steps

    on_gpu, on_cpu = nn.Parameter(torch.zeros(4, device="meta")), nn.Parameter(torch.zeros(4))
    loose = nn.Parameter(torch.zeros(2, device="meta"))
    opt = torch.optim.AdamW([{"params": [on_gpu], "fused": True}, {"params": [on_cpu]}])
    shared = torch.tensor(3.0, dtype=torch.float64)  # as loaded: CPU, one tensor for all
    opt.state[on_gpu]["step"] = opt.state[on_cpu]["step"] = opt.state[loose]["step"] = shared
    place_loaded_steps(opt)
    moved, kept = opt.state[on_gpu]["step"], opt.state[on_cpu]["step"]
    assert moved.device.type == "meta" and moved.dtype == torch.float32 and moved.shape == ()
    assert opt.state[loose]["step"].device.type == "meta" and opt.state[loose]["step"] is not moved
    assert kept is not shared and kept.device.type == "cpu" and kept.dtype == torch.float64 and float(kept) == 3.0
    kept += 1  # AdamW increments in place: the loaded tensor is no longer shared
    assert float(shared) == 3.0


def test_trainer_options_put_the_gpu_one_kernel_step_in_place(single_rank_gloo):
    """The trainer's engine (trainer/engine.py) on a GPU with train.optimizer_step=fused: each gradient read in
    place and the device-side epilogue wait; every other step, and the CPU, install's defaults. Installed on a
    CPU engine, those options give the in-place step with the wait (the gathered one without them)."""
    assert zero_step.trainer_options("fused", on_gpu=True) == {"gather": False, "epilogue_wait": True}
    for kind, on_gpu in (("fused", False), ("lean", True), ("auto", True), ("deepspeed", True), ("auto", False)):
        assert zero_step.trainer_options(kind, on_gpu) == {}, (kind, on_gpu)
    def engine_with(options: dict):  # cut_engine names the epilogue wait `wait`
        options = dict(options)
        return cut_engine(True, 1, True, kind="fused", wait=options.pop("epilogue_wait", False), **options).optimizer

    opt = engine_with(zero_step.trainer_options("fused", on_gpu=True))
    assert not opt.dflash_gather and "independent_gradient_partition_epilogue" in vars(opt)
    plain = engine_with(zero_step.trainer_options("fused", on_gpu=False))
    assert plain.dflash_gather and "independent_gradient_partition_epilogue" not in vars(plain)


def test_resolve_and_refusals(single_rank_gloo):
    assert zero_step.resolve_step("auto", on_gpu=True) == "lean"
    assert zero_step.resolve_step("auto", on_gpu=False) == "deepspeed"
    with pytest.raises(ValueError, match="optimizer_step"):
        zero_step.resolve_step("fast", on_gpu=True)
    import deepspeed

    cfg = load_config(None, ["target.kind=tiny_stdlib", "train.zero_stage=3", "train.max_steps=5"])
    model = Net()
    opt = build_optimizer(cfg, model)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=deepspeed_config(cfg, 1, False), dist_init_required=False
    )
    with pytest.raises(ValueError, match="train.optimizer_step=deepspeed"):
        zero_step.install(engine, "lean", on_gpu=False)
    assert zero_step.install(engine, "auto", on_gpu=True) == "deepspeed"  # auto keeps ZeRO-3's own step
    amsgrad = make_engine("deepspeed", True)
    amsgrad.optimizer.optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad.*train.optimizer_step=lean"):
        zero_step.install(amsgrad, "fused", on_gpu=True)
    from dflash_dist.trainer import fused_adamw

    adam = torch.optim.Adam(Net().parameters(), weight_decay=0.01)  # L2 decay: not AdamW's arithmetic
    assert "L2 weight decay" in fused_adamw.supports(adam, adam.param_groups[0])
    sgd = torch.optim.SGD(Net().parameters(), lr=0.1)
    assert "Adam-family" in fused_adamw.supports(sgd, sgd.param_groups[0])
    adamw = torch.optim.AdamW(Net().parameters(), weight_decay=0.01)
    assert fused_adamw.supports(adamw, adamw.param_groups[0]) is None


def _curve_ranks(rank: int, world: int, runs: list) -> dict[str, int]:
    """One of the two gloo ranks (run_ranks has joined it to the group, one torch thread, as a trainer
    rank): each (kind, config, job) of `runs` in turn, a Trainer each, in the trainer ranks'
    compile-cache directories; the steps each trained."""
    from dflash_dist.compile_cache import use_private_cache_dirs
    from dflash_dist.config import load_config_dict
    from dflash_dist.trainer.loop import Trainer

    use_private_cache_dirs()
    return {kind: Trainer(load_config_dict(cfg_dict), job).run().steps for kind, cfg_dict, job in runs}


CURVE_KINDS = ("lean", "fused")


@pytest.fixture(scope="module")
def curve_runs(tiny, tmp_path_factory) -> dict:
    """The pinned curve's run under each of CURVE_KINDS, one after the other on one group of two rank
    processes (each a Trainer of its own, from step 0, into its own out dir): a process start and
    group per kind otherwise. Per kind its config and each rank's steps."""
    from dflash_dist.actors.trainer_group import train_job
    from tests.helpers import loss_curve as lc
    from tests.helpers.tiny import make_cfg, write_shards

    root = tmp_path_factory.mktemp("curve")
    shards = root / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][: lc.NUM], done=True)
    cfgs = {kind: make_cfg(root / kind, tiny["target_dir"], epochs=5, micro_batch_size=1, grad_accum=2,
                           checkpoint_every=10, warmup_frac=0.1, optimizer_step=kind)
            for kind in CURVE_KINDS}  # fmt: skip
    runs = [(kind, cfg.to_dict(), train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"],
                                            num_samples=lc.NUM)) for kind, cfg in cfgs.items()]  # fmt: skip
    steps = run_ranks(_curve_ranks, 2, (runs,), timeout_s=1200)
    return {kind: (cfgs[kind], [r[kind] for r in steps]) for kind in CURVE_KINDS}


@pytest.mark.parametrize("kind", CURVE_KINDS)
def test_two_rank_zero2_run_with_the_lean_step_follows_the_pinned_curve(kind, curve_runs):
    """tests/test_loss_curve.py's run (2 gloo ranks, ZeRO-2, partitions cut inside tensors; its Trainer
    on each rank, here without Ray) with train.optimizer_step=lean or fused (the one-kernel AdamW over
    each rank's partial tensors): the pinned losses within the gate's 1e-6 (the norm sums in fp32,
    not fp64)."""
    from dflash_dist.trainer.loop import TRAIN_LOG
    from tests.helpers import loss_curve as lc

    cfg, steps = curve_runs[kind]
    assert steps == [lc.STEPS, lc.STEPS]
    got = [json.loads(line)["loss"] for line in (cfg.out / TRAIN_LOG).read_text().splitlines()]
    want = [r["loss"] for r in json.loads(lc.PINNED.read_text())]
    print(f"{kind} vs pinned: max rel", max(abs(g - w) / abs(w) for g, w in zip(got, want)))
    assert got == pytest.approx(want, rel=lc.RTOL)  # the gate's own tolerance (measured: 8.8e-8)


# ---- the gradient path cuts (zero_step.cut_grad_path): bf16 engines as on a GPU, bitwise ----


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap_comm"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_grad_path_cuts_are_bitwise_and_skip_the_divide_and_the_copy(grad_accum, overlap, single_rank_gloo):
    data = batches(4 * grad_accum)  # 4 optimizer steps
    runs = {}
    for cuts in (False, True):
        engine = cut_engine(cuts, grad_accum, overlap)
        runs[cuts] = run_and_inspect(engine, data, grad_accum), state_of(engine), engine.optimizer
    (ref, ref_state, ref_opt), (cut, cut_state, cut_opt) = runs[False], runs[True]
    assert cut["losses"] == ref["losses"] and cut["norms"] == ref["norms"]
    assert_bitwise(cut_state, ref_state)
    assert ref["norms"][0] > 10 * CLIP, "the test needs the clip active"
    # (a) one rank: no div_(1.0) over the gradients (DeepSpeed runs one per reduced bucket)
    assert ref_opt.gradient_average and not cut_opt.gradient_average
    assert ref["divides"] > 0 and cut["divides"] == 0
    # (b) a.weight's gradient is its own tensor; grads_in_partition holds only the small ones
    small = (384 + 48 + 48) * 2  # bytes: b.weight, a.bias, g in bf16
    assert ref["storages"] == [[(768 * 2) + small]] * 4
    assert cut["storages"] == [sorted([768 * 2, small])] * 4
    assert all(ref["freed"]) and all(cut["freed"])


def test_grad_path_cuts_restore_and_never_reach_deepspeeds_step(single_rank_gloo):
    """uninstall (the bench's settings switch) restores DeepSpeed's divide and copy; install with
    kind deepspeed leaves them untouched."""
    engine = cut_engine(True, 1, False)
    opt = engine.optimizer
    assert not opt.gradient_average and "copy_grads_in_partition" in vars(opt)
    zero_step.uninstall(engine)
    assert opt.gradient_average and "copy_grads_in_partition" not in vars(opt) and "step" not in vars(opt)
    assert zero_step.install(engine, "deepspeed", on_gpu=True) == "deepspeed"
    assert opt.gradient_average and "copy_grads_in_partition" not in vars(opt)
    out = run_and_inspect(engine, batches(2), 1)
    assert out["divides"] > 0 and out["storages"] == [[(768 + 384 + 48 + 48) * 2]] * 2


def test_epilogue_wait_is_opt_in_and_bitwise_and_uninstalled(single_rank_gloo):
    """zero_step.wait_on_device: only with overlap_comm and only when asked; DeepSpeed's epilogue runs
    through it with the same results bit for bit (the CPU has no streams: the wait is a no-op here;
    tests/test_host_reads.py shows the synchronize gone, `pytest -m gpu` checks it on CUDA), the
    accelerator's own synchronize is back after each backward, and uninstall removes it."""
    from deepspeed.accelerator import get_accelerator

    data = batches(4)
    assert "independent_gradient_partition_epilogue" not in vars(cut_engine(True, 2, True).optimizer)
    assert "independent_gradient_partition_epilogue" not in vars(cut_engine(True, 2, False, wait=True).optimizer)
    ref, waiting = cut_engine(True, 2, True), cut_engine(True, 2, True, wait=True)
    opt = waiting.optimizer
    assert opt.independent_gradient_partition_epilogue.__func__ is zero_step._epilogue_waiting_on_device
    out = run_and_inspect(waiting, data, 2)
    assert "synchronize" not in vars(get_accelerator())
    assert out["losses"] == run_and_inspect(ref, data, 2)["losses"]
    assert_bitwise(state_of(waiting), state_of(ref))
    zero_step.uninstall(waiting)
    assert "independent_gradient_partition_epilogue" not in vars(opt)


def test_grad_path_cuts_resume_exactly(tmp_path, single_rank_gloo):
    data = batches(8)  # 4 optimizer steps of 2 micro-batches, a checkpoint after 2
    first = cut_engine(True, 2, False)
    run_and_inspect(first, data[:4], 2)
    first.save_checkpoint(str(tmp_path), tag="t")
    run_and_inspect(first, data[4:], 2)
    resumed = cut_engine(True, 2, False)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    run_and_inspect(resumed, data[4:], 2)
    assert_bitwise(state_of(resumed), state_of(first))
    plain = cut_engine(False, 2, False)  # and the same as without the cuts
    run_and_inspect(plain, data, 2)
    assert_bitwise(state_of(plain), state_of(first))


TWO_RANK_CASES = [(1, True), (2, False)]


@pytest.fixture(scope="module")
def two_rank_cuts() -> list[dict]:
    """Both cases on one group of two rank processes (a process start, imports and a gloo group
    per case otherwise); each test below reads its own case's outcome on both ranks."""
    return run_ranks(two_rank_worker, 2, (TWO_RANK_CASES,))


@pytest.mark.parametrize("grad_accum,overlap", TWO_RANK_CASES)
def test_grad_path_cuts_at_two_ranks(grad_accum, overlap, two_rank_cuts):
    """Two gloo ranks: (a) is not applied (the divide by 2 changes numbers), (b) is, bitwise."""
    assert [r[(grad_accum, overlap)] for r in two_rank_cuts] == ["ok", "ok"]


# ---- CUDA: the bf16 engine the trainer builds on a GPU (pytest -m gpu) ----


@pytest.fixture
def single_rank_nccl(monkeypatch):
    """A one-rank NCCL group (ZeRO's collectives on CUDA tensors need it; gloo has no reduce-scatter there)."""
    import deepspeed
    import torch.distributed as dist

    from dflash_dist.actors.ports import free_ports
    from tests.conftest import reset_deepspeed_groups

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1, "127.0.0.1")[0]))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    yield
    dist.destroy_process_group()
    reset_deepspeed_groups()


@pytest.mark.gpu
def test_cuda_bf16_lean_step_matches_deepspeeds_step(single_rank_nccl):
    """bf16 weights, fp32 masters, fused AdamW on CUDA: lean vs DeepSpeed's step over 6 steps with
    the clip active, and a NaN batch skipped on the device."""
    data = batches(12)
    ref, lean = make_engine("deepspeed", True, device="cuda"), make_engine("lean", True, device="cuda")
    ref_losses, lean_losses = train(ref, data), train(lean, data)
    assert lean_losses == pytest.approx(ref_losses, rel=1e-2)
    for (name, w), (_, m) in zip(weights(ref).items(), weights(lean).items()):
        torch.testing.assert_close(m, w, rtol=2e-2, atol=2e-3, msg=name)
    masters = [p.float() for p in ref.optimizer.single_partition_of_fp32_groups]
    for m_ref, m_lean in zip(masters, lean.optimizer.single_partition_of_fp32_groups):
        torch.testing.assert_close(m_lean, m_ref, rtol=1e-3, atol=1e-4)
    assert_nan_batch_skipped(lean)


@pytest.mark.gpu
def test_cuda_one_kernel_step_matches_torchs_fused_adamw(single_rank_nccl):
    """train.optimizer_step=fused on the bf16 CUDA engine against the lean step with torch's fused
    AdamW (the same norm and clip): fp32 masters within a few fp32 roundings after 6 clipped steps,
    bf16 weights equal to the masters' rounding, the skip of a NaN batch; prints how many master
    elements differ at all."""
    data = batches(12)
    ref, one = make_engine("lean", True, device="cuda"), make_engine("fused", True, device="cuda")
    ref_losses, one_losses = train(ref, data), train(one, data)
    assert one_losses == pytest.approx(ref_losses, rel=1e-3)
    masters = zip(ref.optimizer.single_partition_of_fp32_groups, one.optimizer.single_partition_of_fp32_groups)
    for m_ref, m_one in masters:
        torch.testing.assert_close(m_one, m_ref, rtol=1e-5, atol=1e-6)
        print(f"fp32 master elements that differ: {int((m_one != m_ref).sum())} of {m_ref.numel()}")
    for p, flat in zip(one.optimizer.bit16_groups, one.optimizer.single_partition_of_fp32_groups):
        low = torch.cat([q.detach().reshape(-1) for q in p])
        assert torch.equal(low, flat[: low.numel()].to(low.dtype))
    assert_nan_batch_skipped(one)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lean", "fused"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_cuda_grad_path_cuts_are_bitwise_with_overlap_comm(grad_accum, kind, single_rank_nccl):
    """The gradient-path cuts on CUDA with overlap_comm (the large gradient reduced on DeepSpeed's
    side stream and then read in place by the step): bitwise the run without them, for the lean
    step and the one-kernel AdamW (one call per group)."""
    data = batches(4 * grad_accum, device="cuda")
    runs = {}
    for cuts in (False, True):
        engine = cut_engine(cuts, grad_accum, True, device="cuda", kind=kind)
        runs[cuts] = run_and_inspect(engine, data, grad_accum), state_of(engine)
    (ref, ref_state), (cut, cut_state) = runs[False], runs[True]
    assert cut["losses"] == ref["losses"] and cut["norms"] == ref["norms"]
    assert_bitwise(cut_state, ref_state)
    assert ref["divides"] > 0 and cut["divides"] == 0
    assert cut["storages"] == [sorted([768 * 2, (384 + 48 + 48) * 2])] * 4 != ref["storages"]


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["allreduce", "reduce"])
@pytest.mark.parametrize("kind", ["lean", "fused"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_cuda_epilogue_wait_is_bitwise_with_overlap_comm(grad_accum, kind, reduce, single_rank_nccl):
    """zero_step.wait_on_device on CUDA with overlap_comm (reductions on DeepSpeed's side stream, the
    reduce buffers released and the partition read right after them): bitwise the run with DeepSpeed's
    host synchronize, with the gradient-path cuts, both reduce modes (per-rank reduce synchronizes per
    bucket too), over 4 optimizer steps."""
    data = batches(4 * grad_accum, device="cuda")
    runs = {}
    for wait in (False, True):
        engine = cut_engine(True, grad_accum, True, device="cuda", kind=kind, wait=wait)
        engine.optimizer.use_multi_rank_bucket_allreduce = reduce == "allreduce"
        runs[wait] = run_and_inspect(engine, data, grad_accum), state_of(engine)
    (ref, ref_state), (got, got_state) = runs[False], runs[True]
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert_bitwise(got_state, ref_state)


@pytest.mark.gpu
@pytest.mark.parametrize("wait", [False, True], ids=["episync", "epiwait"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_cuda_in_place_step_is_bitwise_the_gathered_step(grad_accum, wait, single_rank_nccl):
    """The one-kernel step without the gather (zero_step.install(gather=False): each gradient read where it is,
    the update through views of the partitions) on the bf16 CUDA engine with overlap_comm and the gradient-path
    cuts (a.weight's gradient its own tensor, the others views of grads_in_partition), with DeepSpeed's
    synchronize and with the device-side wait: bitwise the gathered step with the same norm (of the gradient
    list) over 4 clipped steps; a NaN batch then skipped on the device. tests/test_one_kernel_in_place.py on CPU."""
    data = batches(4 * grad_accum, device="cuda")
    runs = {}
    for gather in (True, False):
        engine = cut_engine(True, grad_accum, True, device="cuda", kind="fused", wait=wait, gather=gather,
                            norm_of_flat=False)  # fmt: skip
        runs[gather] = run_and_inspect(engine, data, grad_accum), state_of(engine), engine
    (ref, ref_state, _), (got, got_state, engine) = runs[True], runs[False]
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert_bitwise(got_state, ref_state)
    assert ref["norms"][0] > 10 * CLIP, "the test needs the clip active"
    assert not engine.optimizer.dflash_gather
    if grad_accum == 2:  # one optimizer step of two NaN micro-batches
        assert_nan_batch_skipped(engine)
