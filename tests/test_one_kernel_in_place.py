"""The one-kernel AdamW step without the gradient gather (zero_step.install(gather=False),
fused_adamw.step_group_in_place): each gradient tensor read where DeepSpeed holds it, the master, both
moments and the bf16 partition updated through views at its offset, one compiled call per group over the
lists. Bitwise the gathered one-kernel step with the same norm (of the gradient list: norm_of_flat=False)
on real DeepSpeed engines over gloo: fp32 and bf16 engines, the gradient-path cuts on and off, clipping
active, a non-finite step skipped, gradient accumulation 1 and 2, two ranks whose ZeRO-2 partitions cut a
parameter, an exact resume; against the gathered step's default norm (of the flat partitions) within fp32
rounding. On CUDA: tests/test_zero_step.py's gpu tests."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from dflash_dist.actors.local_ranks import run_ranks
from dflash_dist.trainer import fused_adamw, zero_step
from tests.helpers.zero_engines import cut_engine, in_place_worker, make_engine, run_and_inspect, train, weights
from tests.helpers.zero_net import CLIP, assert_bitwise, batches, cfg_for, state_of


@pytest.fixture
def lists_read(monkeypatch) -> list[list[int]]:
    """The gradient lengths of every list the in-place kernel reads (the compiled kernel still runs)."""
    kernel, read = fused_adamw._list_kernel(), []

    def recording(ps, ms, vs, gs, outs, *args):
        read.append([g.numel() for g in gs])
        return kernel(ps, ms, vs, gs, outs, *args)

    monkeypatch.setattr(fused_adamw, "_list_kernel", lambda: recording)
    return read


def _two_steps(grads: list[torch.Tensor], gather: bool, steps: list[tuple[float, float]]):
    """A flat fp32 master of 29 elements under torch's AdamW (DeepSpeed's partition group), stepped from
    `grads` (new values each step) with the gathered flat kernel (zero_step._flat: the production gather) or
    in place; per step (clip divisor, skip flag). The master, both moments, the bf16 partition."""
    master = torch.linspace(-1.0, 1.0, 29)
    opt = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.01)
    low = master.to(torch.bfloat16)
    ds = SimpleNamespace(single_partition_of_fp32_groups=[master], partition_size=[29])
    for n, (scale, skip) in enumerate(steps):
        gs = [g * (n + 1) - n for g in grads]  # the same structure, other values
        gs = [g.view_as(orig) for g, orig in zip(gs, grads)]
        args = (low, torch.tensor(scale), torch.tensor(skip))
        if gather:
            flat = zero_step._flat(ds, 0, gs, torch.bfloat16)
            fused_adamw.step_group(opt, opt.param_groups[0], master, flat, *args)
        else:
            fused_adamw.step_group_in_place(opt, opt.param_groups[0], master, gs, *args)
    state = opt.state[master]
    return [master, state["exp_avg"], state["exp_avg_sq"], low, state["step"]]


def test_each_gradient_is_read_at_its_offset_in_the_partition(lists_read):
    """DeepSpeed's list holds whole gradients (a 2-D one), parts of a gradient the partition boundary cuts
    (a narrow view at a storage offset), views into grads_in_partition, empty ones, a tensor of another dtype
    (the gather casts it) and a tail the list does not cover (the gather zero-fills it): the in-place step is
    bitwise the gathered one over three clipped steps and a skipped one, every length distinct so that a view
    at a wrong offset reads another gradient. One list call per step; the tail read as a zero gradient."""
    big, buf = torch.randn(20).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16)
    grads = [
        torch.randn(3, 4).to(torch.bfloat16),  # 12: a whole gradient
        big.narrow(0, 5, 6),  # 6: a gradient's part, at offset 5 of its storage
        torch.empty(0, dtype=torch.bfloat16),
        buf[2:5],  # 3: a view into a shared buffer
        torch.randn(2),  # 2: fp32
    ]
    steps = [(2.5, 0.0), (1.0, 0.0), (3.0, 1.0), (1.5, 0.0)]
    gathered, in_place = _two_steps(grads, True, steps), _two_steps(grads, False, steps)
    assert lists_read == [[12, 6, 3, 2, 6]] * 4
    assert_bitwise(in_place, gathered)
    assert float(in_place[-1]) == 3.0  # the skipped step is not counted
    # a list that is one tensor of the partition's length is the flat gradient: the gathered kernel reads it
    lists_read.clear()
    whole = _two_steps([torch.randn(29).to(torch.bfloat16)], False, steps[:1])
    assert lists_read == [] and float(whole[-1]) == 1.0


def _run(engine, data, bf16: bool) -> dict:
    if bf16:
        return run_and_inspect(engine, data, engine.gradient_accumulation_steps())
    out = {"losses": train(engine, data)}
    return out


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


ENGINES = {  # (bf16 engine with the cut gradient path?, cuts, grad_accum, overlap_comm)
    "fp32_accum2": (False, True, 2, False),
    "bf16_cuts_accum1_overlap": (True, True, 1, True),
    "bf16_nocuts_accum2": (True, False, 2, False),
}


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_in_place_step_is_bitwise_the_gathered_step(engine_kind, single_rank_gloo, lists_read, monkeypatch):
    """6 optimizer steps with the clip active and a NaN gradient at the third (skipped on the device by both):
    the same losses, norms, bf16 weights, fp32 masters, moments, step counts and skip count, bit for bit;
    no gather ran (zero_step._gather) and the list kernel compiled at its first step only."""
    bf16, cuts, accum, overlap = ENGINES[engine_kind]
    data = batches(6 * accum)
    for x, _ in data[2 * accum : 3 * accum]:
        x[0, 0] = float("nan")
    gathers, own_gather = [], zero_step._gather
    monkeypatch.setattr(zero_step, "_gather", lambda *a: gathers.append(a[1]) or own_gather(*a))
    runs = {}
    for gather in (True, False):
        if bf16:
            engine = cut_engine(cuts, accum, overlap, kind="fused", gather=gather, norm_of_flat=False)
        else:
            engine = make_engine("fused", True, cfg_for(grad_accum=accum), gather=gather, norm_of_flat=False)
        opt = engine.optimizer
        gathers.clear()
        out = _run(engine, data[:accum], bf16)
        compiled = len(cache_entries(fused_adamw._adamw_lists.__code__))
        later = _run(engine, data[accum:], bf16)
        out = {k: v + later[k] for k, v in out.items() if k in ("losses", "norms")}
        steps = [float(s["step"]) for s in opt.optimizer.state.values()]
        runs[gather] = out, state_of(engine), steps, int(opt.dflash_skipped_steps), list(gathers), compiled
    (ref, ref_state, ref_steps, ref_skips, ref_gathers, _), (got, got_state, steps, skips, gathers, compiled) = (
        runs.values()
    )
    assert _same(got["losses"], ref["losses"]) and _same(got.get("norms", []), ref.get("norms", []))
    assert_bitwise(got_state, ref_state)
    assert steps == ref_steps == [5.0, 5.0] and skips == ref_skips == 1
    assert ref_gathers and gathers == [] and len(lists_read) == 2 * 6  # both groups, every step (skips included)
    assert len(cache_entries(fused_adamw._adamw_lists.__code__)) == compiled  # no recompile after the first step
    if bf16:
        assert ref["norms"][0] > 10 * CLIP, "the test needs the clip active"


def test_in_place_step_follows_the_gathered_default_within_the_norms_rounding(single_rank_gloo):
    """Against the gathered step's default norm (of the flat partitions, one reduction each): the norm sums in
    another order, so the clip divisor, and the weights after it, agree to fp32 rounding, not bit for bit."""
    data = batches(8)
    flat, in_place = make_engine("fused", True), make_engine("fused", True, gather=False)
    norms = {}
    for name, engine in (("flat", flat), ("in_place", in_place)):
        train(engine, data[:2])
        norms[name] = float(engine.optimizer._global_grad_norm)
        train(engine, data[2:])
    assert norms["flat"] > 10 * CLIP and math.isclose(norms["in_place"], norms["flat"], rel_tol=1e-6)
    for name, w in weights(flat).items():
        torch.testing.assert_close(weights(in_place)[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_in_place_step_resumes_exactly(tmp_path, single_rank_gloo):
    """A checkpoint of the in-place step (DeepSpeed's format: the same state tensors) resumed under it: bitwise
    the run that went on; and the gathered step's checkpoint continues under it as the gathered step does."""
    data = batches(8)  # 4 optimizer steps of 2 micro-batches, the checkpoint after 2

    def resumed_in_place(name: str, **first_step):
        """Train under `first_step`, save after 2 steps and go on; resume the save in place: both engines."""
        first = make_engine("fused", True, **first_step)
        train(first, data[:4])
        first.save_checkpoint(str(tmp_path / name), tag="t")
        train(first, data[4:])
        resumed = make_engine("fused", True, gather=False)
        resumed.load_checkpoint(str(tmp_path / name), tag="t")
        train(resumed, data[4:])
        return first, resumed

    first, resumed = resumed_in_place("in_place", gather=False)
    assert_bitwise(state_of(resumed), state_of(first))
    assert [float(s["step"]) for s in resumed.optimizer.optimizer.state.values()] == [4.0, 4.0]
    gathered, switched = resumed_in_place("gathered", norm_of_flat=False)
    assert_bitwise(state_of(switched), state_of(gathered))


def test_gather_is_the_one_kernel_steps_option(single_rank_gloo):
    """gather=False with another step is an error naming it; uninstall (the bench's switch) removes it."""
    engine = make_engine("fused", True, gather=False)
    opt = engine.optimizer
    assert opt.dflash_one_kernel and not opt.dflash_gather and not opt.dflash_norm_of_flat
    zero_step.uninstall(engine)
    assert "dflash_gather" not in vars(opt)
    for kind in ("lean", "deepspeed", "auto"):
        with pytest.raises(ValueError, match=f"gather=False is the one-kernel step's .*not '{kind}'"):
            zero_step.install(engine, kind, on_gpu=False, gather=False)


IN_PLACE_CASES = [(True, 1), (False, 2)]  # (gradient-path cuts, grad_accum); overlap_comm on


@pytest.fixture(scope="module")
def two_rank_in_place() -> list[dict]:
    return run_ranks(in_place_worker, 2, (IN_PLACE_CASES,))


@pytest.mark.parametrize("cuts,grad_accum", IN_PLACE_CASES)
def test_in_place_step_at_two_ranks(cuts, grad_accum, two_rank_in_place):
    """Two gloo ranks, ZeRO-2 partitions of 576 + 576 elements of the first group (a.weight 768, b.weight 384):
    bitwise the gathered step on both ranks. Rank 1's list is a.weight's last 192 elements and then b.weight at
    offset 192 (read in place); rank 0's partition and both ranks' second group are one tensor each (the flat
    kernel reads it, as the gathered step does)."""
    rank0, rank1 = (r[(cuts, grad_accum)] for r in two_rank_in_place)
    assert isinstance(rank0, list), rank0
    assert isinstance(rank1, list), rank1
    assert rank0 == [] and rank1 == [[192, 384]] * 3


def test_split_list_norm_reads_each_large_gradient_by_one_reduction(single_rank_gloo, monkeypatch):
    """zero_step.set_list_norm("split") (bench word normsplit): each gradient of at least SPLIT_NUMEL elements
    is reduced by its own vector_norm, the rest by the multi-tensor norm, every gradient read once a step; the
    losses and the trained state stay within fp32 rounding of the multi-tensor form's (the same sums in another
    order). An unknown form is refused by name."""
    with pytest.raises(ValueError, match=r"list norm 'fast'; expected one of \('foreach', 'split'\)"):
        zero_step.set_list_norm("fast")
    data = batches(6)
    ref = make_engine("fused", True, gather=False)
    ref_losses = train(ref, data)
    monkeypatch.setattr(zero_step, "SPLIT_NUMEL", 300)  # the tiny net's a.weight (768) and b.weight (384)
    reads = []
    vector_norm, foreach_norm = torch.linalg.vector_norm, torch._foreach_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, *a, **k: reads.append(("vector", t.numel()))
                        or vector_norm(t, *a, **k))
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: reads.extend(("foreach", t.numel()) for t in ts)
                        or foreach_norm(ts, *a, **k))
    zero_step.set_list_norm("split")
    try:
        engine = make_engine("fused", True, gather=False)
        losses = train(engine, data)
    finally:
        zero_step.set_list_norm("foreach")
    grads = sorted(p.numel() for p in engine.module.parameters())
    steps = len(data) // engine.gradient_accumulation_steps()
    assert sorted(n for kind, n in reads if kind == "vector" and n >= 300) == sorted([768, 384] * steps)
    assert sorted(n for kind, n in reads if kind == "foreach") == sorted([n for n in grads if n < 300] * steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(state_of(engine), state_of(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
