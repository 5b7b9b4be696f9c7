"""The one-kernel AdamW beside the next forward (zero_step.install(overlap=True), trainer/step_overlap.py): the
in-place step cut at the forward's module stages, each stage's forward waiting for its weights. On CPU (no
streams, the chunks run inline): bitwise the uncut in-place step on the test net and on a drafter's training
engine, the chunks each step launches, every trainable weight's stage waited for before the forward first reads
it, the joins before checkpoints and exports, the errors and uninstall. Two ranks: tests/test_one_kernel_in_place.py.
On CUDA (`-m gpu`): bitwise on a drafter big enough that an unwaited read would see a half-updated weight."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_dist.config import load_config
from dflash_dist.model.loss import supervised_rows
from dflash_dist.trainer import fused_adamw, step_overlap, zero_step
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from dflash_dist.trainer.engine import TrainForward, gathered_drafter
from tests.helpers.drafter import loss_batch, small_drafter
from tests.helpers.zero_engines import make_engine, train
from tests.helpers.zero_net import assert_bitwise, batches, state_of


@pytest.fixture
def lists_read(monkeypatch) -> list[list[int]]:
    """The gradient lengths of every list the in-place kernel reads (the compiled kernel still runs)."""
    kernel, read = fused_adamw._list_kernel(), []

    def recording(ps, ms, vs, gs, outs, *args):
        read.append([g.numel() for g in gs])
        return kernel(ps, ms, vs, gs, outs, *args)

    monkeypatch.setattr(fused_adamw, "_list_kernel", lambda: recording)
    return read


def test_overlapped_step_is_bitwise_the_in_place_step(single_rank_gloo, lists_read):
    """The test net (a, g, b; stages a then b, g in none): 6 clipped steps of 2 micro-batches, a NaN step skipped.
    Bitwise the uncut in-place step; each step reads the 1-D group whole (a.bias, g) and then the matrices' group
    cut at the stage boundary: a.weight, then b.weight."""
    data = batches(12)
    for x, _ in data[4:6]:
        x[0, 0] = float("nan")
    runs = {}
    for overlap in (False, True):
        lists_read.clear()
        engine = make_engine("fused", True, gather=False, overlap=overlap)
        losses = train(engine, data)
        runs[overlap] = losses, state_of(engine), int(engine.optimizer.dflash_skipped_steps), list(lists_read)
    (ref, ref_state, ref_skips, ref_lists), (got, got_state, skips, lists) = runs[False], runs[True]
    assert got[:4] + got[6:] == ref[:4] + ref[6:] and ref_skips == skips == 1
    assert_bitwise(got_state, ref_state)
    assert ref_lists == [[768, 384], [48, 48]] * 6  # uncut: the groups in their order
    assert lists == [[48, 48], [768], [384]] * 6  # small group first, then one call a stage


def _cfg(grad_clip: float, lr: float):
    keys = {"target.kind": "tiny_stdlib", "train.grad_clip": grad_clip, "train.weight_decay": 0.01,
            "train.max_steps": 50, "train.lr": lr, "train.warmup_frac": 0.0, "train.grad_accum": 1}  # fmt: skip
    return load_config(None, [f"{k}={v}" for k, v in keys.items()])


def _drafter_engine(overlap: bool, grad_clip: float = 0.05):
    """A fp32 ZeRO-2 engine of the trainer's training module over a 2-layer drafter, the in-place step."""
    import deepspeed

    cfg = _cfg(grad_clip, 0.01)
    module = TrainForward(small_drafter().train(), "target", 3.0, "dense")
    opt = build_optimizer(cfg, module)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=build_lr_schedule(cfg, opt, 50),
                                      config=deepspeed_config(cfg, 1, False), dist_init_required=False)  # fmt: skip
    zero_step.install(engine, "fused", on_gpu=False, gather=False, overlap=overlap)
    return engine


def _drafter_step(engine, seed: int, forward_in=contextlib.nullcontext) -> float:
    """One step of loss_batch's rows (ids shifted by `seed`); the forward inside `forward_in()`."""
    d = engine.module.drafter
    ids, feats, lm, anchors = loss_batch(d, torch.float32, packed=False)
    ids = (ids + seed) % (d.config.vocab_size - 2)
    rows = supervised_rows(ids, lm, anchors, d.config.block_size)
    with forward_in():
        loss, _ = engine(ids, feats, lm, ids, anchors.positions, anchors.keep, rows=rows)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


class _ParamReads(TorchDispatchMode):
    """Each op's reads of the watched parameters (a tensor argument starting where one does), in order, as
    ("read", name) into `log`."""

    def __init__(self, params: dict[str, torch.Tensor], log: list) -> None:
        super().__init__()
        self.by_ptr = {p.data_ptr(): n for n, p in params.items()}  # ZeRO: views of one flat buffer, distinct starts
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                name = self.by_ptr.get(t.data_ptr())
                if name is not None:
                    self.log.append(("read", name))
        return func(*args, **(kwargs or {}))


def test_each_weight_is_waited_for_before_the_forward_reads_it(single_rank_gloo, monkeypatch):
    """The drafter's training engine: after a step, the next forward (loss.py: fuse_context, the layers, the final
    norm) waits for each trainable weight's stage before its first read of that weight; the forward's end joins the
    step. The step launches the 1-D group whole, then fc, each layer's matrices, in the forward's order."""
    engine = _drafter_engine(True)
    overlap = engine.optimizer.dflash_overlap
    d = engine.module.drafter
    stage_of = {n: s for s, m in enumerate(d.forward_stages(), start=1)
                for n, _ in m.named_parameters(prefix=_prefix(d, m))}  # fmt: skip
    trainable = {n: p for n, p in d.named_parameters() if p.requires_grad}
    assert set(stage_of) == set(trainable)  # every trainable weight is in a stage
    log: list = []
    chunks = overlap.chunks
    monkeypatch.setattr(overlap, "done", lambda stages: log.append(("done", tuple(sorted(stages)))))
    monkeypatch.setattr(overlap, "chunks", lambda *a, **k: chunks(*a, **k))
    own_wait = step_overlap.StepOverlap.wait
    monkeypatch.setattr(overlap, "wait", lambda s: log.append(("wait", s)) or own_wait(overlap, s))
    _drafter_step(engine, 0)
    layers = len(d.layers)
    gains, matrices = ("done", tuple(range(2, 4 + layers))), [("done", (s,)) for s in (1, *range(3, 3 + layers))]
    assert [e for e in log if e[0] == "done"] == [gains, *matrices]  # the 1-D gains whole, then fc and each layer
    assert overlap.pending  # until the next forward (or a join)
    log.clear()
    _drafter_step(engine, 1, lambda: _ParamReads(trainable, log))
    waited, first_read = set(), {}
    for kind, what in log:
        if kind == "wait":
            waited.add(what)
        elif kind == "read" and what not in first_read:
            first_read[what] = set(waited)
    assert set(first_read) == set(trainable)
    late = {n: stage_of[n] for n, seen in first_read.items() if stage_of[n] not in seen}
    assert not late, f"read before its stage's wait: {late}"
    assert [w for k, w in log if k == "wait"] == list(range(4 + layers))  # root, fc, hidden norm, layers, norm


def _prefix(root, module) -> str:
    return next(n for n, m in root.named_modules() if m is module)


def test_overlapped_drafter_engine_is_bitwise_and_joins_before_reads(single_rank_gloo, tmp_path):
    """The drafter's engine over 3 steps: bitwise the uncut in-place step; a step leaves the update pending until
    the next forward's end, a checkpoint save or an export (gathered_drafter) joins it first."""
    runs = {}
    for overlap in (False, True):
        engine = _drafter_engine(overlap)
        losses = [_drafter_step(engine, s) for s in range(3)]
        runs[overlap] = losses, state_of(engine), engine
    (ref, ref_state, _), (got, got_state, engine) = runs[False], runs[True]
    assert got == ref
    assert_bitwise(got_state, ref_state)
    overlap = engine.optimizer.dflash_overlap
    assert overlap.pending
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert not overlap.pending
    _drafter_step(engine, 3)
    assert overlap.pending
    with gathered_drafter(engine):
        assert not overlap.pending
    _drafter_step(engine, 4)
    engine.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False)
    assert not overlap.pending


def test_overlap_needs_the_in_place_step_and_forward_stages(single_rank_gloo):
    """overlap with the gather, or on a module without forward_stages, is an error naming what to do; uninstall
    and a second install take the hooks off."""
    with pytest.raises(ValueError, match="overlap=True is the in-place one-kernel step's: it needs gather=False"):
        make_engine("fused", True, overlap=True)
    engine = make_engine("fused", True, gather=False)
    root = engine.module

    def hooks() -> list[int]:
        return [len(root._forward_pre_hooks), len(root._forward_hooks), len(root.a._forward_pre_hooks),
                len(root.b._forward_pre_hooks)]  # fmt: skip

    before = hooks()
    zero_step.install(engine, "fused", on_gpu=False, gather=False, overlap=True)
    assert hooks() == [before[0] + 1, before[1] + 1, before[2] + 1, before[3] + 1]
    zero_step.install(engine, "fused", on_gpu=False, gather=False, overlap=True)  # again: the old hooks off
    assert hooks() == [before[0] + 1, before[1] + 1, before[2] + 1, before[3] + 1]
    zero_step.uninstall(engine)
    assert hooks() == before
    assert "save_checkpoint" not in vars(engine) and "dflash_overlap" not in vars(engine.optimizer)
    type(root).forward_stages, own = None, type(root).forward_stages
    try:
        with pytest.raises(ValueError, match="needs the module's forward stages: Net .* has no forward_stages"):
            zero_step.install(engine, "fused", on_gpu=False, gather=False, overlap=True)
    finally:
        type(root).forward_stages = own


def _cuda_drafter_engine(overlap: bool):
    """The trainer's GPU engine (bf16 ZeRO-2, liger kernels, the in-place one-kernel step) over a drafter of 4
    layers at hidden 1024 (~55M trainable weights: each layer's AdamW takes long enough that a forward reading its
    weights unwaited would see them half-updated)."""
    import deepspeed

    from dflash_dist.model.config import DrafterConfig
    from dflash_dist.model.drafter import DFlashDrafter

    torch.manual_seed(0)
    h, vocab, k = 1024, 8192, 3
    cfg = _cfg(0.05, 0.001)
    dc = DrafterConfig(hidden_size=h, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                       intermediate_size=4096, vocab_size=vocab, target_layer_ids=tuple(range(1, 2 * k, 2)),
                       num_target_layers=8, block_size=16, mask_token_id=vocab - 1)  # fmt: skip
    d = DFlashDrafter(dc, kernels="liger")
    d.set_target_weights(torch.randn(vocab, h), torch.randn(vocab, h) * h**-0.5)
    module = TrainForward(d, "target", 7.0, "flex")
    opt = build_optimizer(cfg, module, fused=True)
    ds = deepspeed_config(cfg, 1, True, hidden_size=h)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=build_lr_schedule(cfg, opt, 50),
                                      config=ds, dist_init_required=False)  # fmt: skip
    assert zero_step.install(engine, "fused", on_gpu=True, gather=False, overlap=overlap, epilogue_wait=True) == "fused"
    return engine


@pytest.mark.gpu
def test_cuda_overlapped_step_is_bitwise_on_a_drafter(single_rank_nccl):
    """The bf16 CUDA engine of the trainer over a 4-layer drafter, 6 clipped steps with and without the overlap
    (both with the device-side epilogue wait): the losses, weights, masters and moments bitwise; with the overlap
    the step's chunks were queued on the side stream and waited for by the forward."""
    from dflash_dist.model.loss import Anchors

    g = torch.Generator(device="cuda").manual_seed(1)
    s, n = 1024, 64
    data = []
    for _ in range(6):
        ids = torch.randint(0, 8000, (1, s), device="cuda", generator=g)
        feats = torch.randn(1, s, 3 * 1024, device="cuda", generator=g).bfloat16()
        pos = torch.sort(torch.randperm(s - 1, device="cuda", generator=g)[:n]).values[None]
        data.append((ids, feats, torch.ones(1, s, device="cuda"), Anchors(pos, torch.ones(1, n, dtype=torch.bool,
                                                                                          device="cuda"))))  # fmt: skip
    runs = {}
    for overlap in (False, True):
        engine = _cuda_drafter_engine(overlap)
        waits, losses = [], []
        if overlap:
            own = engine.optimizer.dflash_overlap.wait
            engine.optimizer.dflash_overlap.wait = lambda st, own=own, log=waits: log.append(st) or own(st)
        for ids, feats, lm, anchors in data:
            rows = supervised_rows(ids.cpu(), lm.cpu(), Anchors(anchors.positions.cpu(), anchors.keep.cpu()), 16)
            loss, _ = engine(ids, feats, lm, ids, anchors.positions, anchors.keep, rows=rows.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        zero_step.join(engine)  # the last step, before reading the state
        runs[overlap] = [float(x) for x in losses], state_of(engine), engine.optimizer.get_global_grad_norm(), waits
    (ref, ref_state, ref_norm, _), (got, got_state, norm, waits) = runs[False], runs[True]
    print(f"losses {got}; last norm {float(norm):.4g}")
    assert got == ref and float(norm) == float(ref_norm) and float(norm) > 0.05  # the clip active
    assert_bitwise(got_state, ref_state)
    assert waits == list(range(8)) * 6  # each forward: the root, fc, hidden norm, 4 layers, final norm in turn
