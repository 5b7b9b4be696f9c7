"""bench/bench_train_step.py's --settings switches reach a real engine (CPU, gloo, tiny drafter):
block-mask build, optimizer step and its gradient path, inf/nan pass and k/v projection, and back; and its per-phase
FLOP split adds up to the SPEC 6 total."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_dist.actors.trainer_group import default_extensions_dir
from dflash_dist.config import load_config
from dflash_dist.model.loss import sample_anchors
from dflash_dist.trainer.ds_config import build_optimizer, deepspeed_config
from dflash_dist.trainer.engine import TrainForward
from dflash_dist.trainer.zero_step import lean_step
from tests.helpers.drafter import small_drafter

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_train_step as bts  # noqa: E402
import train_step_settings as tss  # noqa: E402


class _HeadPasses(TorchDispatchMode):
    """Counts the matmuls that produce logits: those that read the lm_head weight into V columns."""

    def __init__(self, head: torch.Tensor) -> None:
        super().__init__()
        self.head, self.calls = head.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] != args[0].shape[-1]:
            reads = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            self.calls += int(self.head in reads)
        return out


def _tiny_engine(hidden_size: int | None = None):
    """The bench's engine at a tiny size: a small drafter in the trainer's TrainForward, DeepSpeed on
    CPU with the trainer's optimizer and config (DeepSpeed's own step until a setting installs one).
    hidden_size: the reduce bucket of that width, as the bench passes it (h * h elements)."""
    import deepspeed

    cfg = load_config(None, ["target.kind=tiny_stdlib", "train.max_steps=10"])
    module = TrainForward(small_drafter().train(), "data", None, "dense")
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=build_optimizer(cfg, module, fused=True),
        config=deepspeed_config(cfg, 1, False, hidden_size=hidden_size),
        dist_init_required=False,
    )
    return engine


def test_settings_parse_and_switch_a_running_engine(single_rank_gloo):
    assert bts.parse_setting("create+ds") == bts.BEFORE
    after = bts.parse_setting("direct+lean+splitkv+noovf")
    assert after == {"mask": "direct", "step": "lean", "ovf": False, "kv": True, "grads": "ds"}
    cuts = bts.parse_setting("direct+lean+splitkv+noovf+leangrads")
    assert cuts == {**after, "grads": "lean"}
    with pytest.raises(SystemExit, match="add lean or fused"):
        bts.parse_setting("direct+ds+leangrads")
    with pytest.raises(SystemExit, match="unknown word"):
        bts.parse_setting("direct+fast")
    engine = _tiny_engine()
    module = engine.module
    bts.apply_setting(engine, after)
    opt = engine.optimizer
    assert engine.module.block_mask == "direct" and not opt.check_grad_overflow
    assert opt.step.__func__ is lean_step and engine.module.drafter.layers[0].self_attn.split_kv
    ids = torch.randint(0, 60, (1, 24))
    lm = torch.ones(1, 24)
    a = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    feats = torch.randn(1, 24, 96)
    assert opt.gradient_average and "copy_grads_in_partition" not in vars(opt)  # dsgrads: DeepSpeed's path
    for setting in (cuts, after, cuts, bts.BEFORE):  # a step under each, on the same engine
        bts.apply_setting(engine, setting)
        cut = setting["grads"] == "lean"  # one rank: no divide, large gradients in place (zero_step.cut_grad_path)
        assert opt.gradient_average is not cut and ("copy_grads_in_partition" in vars(opt)) is cut
        loss, _ = engine(ids, feats, lm, ids, a.positions, a.keep)
        engine.backward(loss)
        engine.step()
    assert "step" not in vars(opt) and engine.module.block_mask == "create"
    assert opt.gradient_average and "copy_grads_in_partition" not in vars(opt)
    bts.apply_setting(engine, bts.parse_setting("direct+fused"))  # the one-kernel AdamW, then back to lean
    assert opt.step.__func__ is lean_step and opt.dflash_one_kernel
    state = {k: v.clone() for k, v in next(iter(opt.optimizer.state.values())).items()}
    loss, _ = engine(ids, feats, lm, ids, a.positions, a.keep)
    engine.backward(loss)
    engine.step()
    assert float(next(iter(opt.optimizer.state.values()))["step"]) == float(state["step"]) + 1
    bts.apply_setting(engine, after)
    assert not opt.dflash_one_kernel
    bts.apply_setting(engine, bts.BEFORE)
    assert not engine.module.drafter.layers[0].self_attn.split_kv and opt.check_grad_overflow
    # slot weights per setting, and D-PACE's two-pass form (a no-grad head pass more) with the same loss
    module.cli_weighting = "dpace"  # as --position-weighting dpace
    losses = {}
    try:
        for text in ("direct+decay", "direct+dpace+twopass", "direct+dpace", "direct"):
            setting = bts.parse_setting(text)
            bts.apply_setting(engine, setting)
            assert engine.module.position_weighting == setting.get("weighting", "dpace")
            heads = _HeadPasses(engine.module.drafter.lm_head.weight)
            with heads:
                loss, _ = engine(ids, feats, lm, ids, a.positions, a.keep)
            losses[text] = (loss.item(), heads.calls)
        assert bts.loss_mod.lm_head_cross_entropy is bts.lm_head_cross_entropy  # a setting without twopass undoes it
    finally:
        bts.loss_mod.lm_head_cross_entropy = bts.lm_head_cross_entropy
    assert losses["direct+dpace"][0] == losses["direct+dpace+twopass"][0] != losses["direct+decay"][0]
    assert losses["direct+dpace"] == losses["direct"]
    with pytest.raises(SystemExit, match="needs the word dpace"):
        bts.parse_setting("direct+decay+twopass")
    # per chunk: logits and the gradient's product; twopass adds a no-grad logits pass
    assert 2 * losses["direct+dpace+twopass"][1] == 3 * losses["direct+dpace"][1] == 3 * losses["direct+decay"][1] > 0


def test_phase_flops_add_up_to_the_total():
    d = small_drafter()
    dc = d.config
    ids = torch.randint(0, 60, (2, 40))
    lm = torch.ones(2, 40)
    a = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    total = bts.model_flops(dc, 40, ids, lm, a)
    fwd, bwd = bts.model_flops(dc, 40, ids, lm, a, phases=True)
    assert fwd + bwd == pytest.approx(total) and fwd > bwd / 2  # the head's 4HV sits in the forward


def test_row_cut_flops_are_the_matmul_work_the_cuts_leave_out():
    """row_cut_flops against torch's own FLOP counter on the drafter's loss forward, the row cuts off and then on
    (two sequences, every block kept, loss-masked slots, one block past the end): SPEC 6's 6 FLOPs a parameter a
    row are 3x the forward's, so 3x the counted forward difference. Without the cuts nothing is left out."""
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_dist.model.loss import Anchors, dflash_loss

    d = small_drafter(block=4)
    ids = torch.randint(0, d.config.vocab_size - 2, (2, 30), generator=torch.Generator().manual_seed(1))
    feats = torch.randn(2, 30, d.config.num_context_layers * d.config.hidden_size)
    lm = torch.ones(2, 30)
    lm[0, 4:7] = 0
    a = Anchors(torch.tensor([[1, 8, 14, 28], [3, 10, 17, 22]]), torch.ones(2, 4, dtype=torch.bool))

    def forward_flops():
        with torch.no_grad(), FlopCounterMode(display=False) as count:
            dflash_loss(d, ids, feats, lm, a, gamma=3.0)
        return count.get_total_flops()

    full = forward_flops()
    d.set_row_cuts(True, True)
    cut = forward_flops()
    assert full - cut > 0 and 3 * (full - cut) == bts.row_cut_flops(d.config, ids, lm, a)
    assert bts.row_cut_flops(d.config, ids, lm, a) < bts.model_flops(d.config, 30, ids, lm, a) / 2


def test_nogather_word_reads_the_gradients_in_place(single_rank_gloo):
    """nogather: the one-kernel step without the gather (zero_step.install(gather=False)), with fused only and
    without the gathered partitions' norm; a setting without it gathers again. (The step it installs is
    tests/test_one_kernel_in_place.py's: a step here would only compile its list kernel once more, ~35 s.)"""
    assert bts.parse_setting("direct+fused+nogather")["gather"] is False
    with pytest.raises(SystemExit, match="add fused"):
        bts.parse_setting("direct+lean+nogather")
    with pytest.raises(SystemExit, match="nogather has none"):
        bts.parse_setting("direct+fused+nogather+gnormflat")
    engine = _tiny_engine()
    opt = engine.optimizer
    bts.apply_setting(engine, bts.parse_setting("direct+fused+leangrads+nogather+epiwait"))
    assert opt.dflash_one_kernel and not opt.dflash_gather and not opt.dflash_norm_of_flat
    bts.apply_setting(engine, bts.parse_setting("direct+fused"))
    assert opt.dflash_gather and opt.dflash_norm_of_flat


def test_fused_words_switch_the_layout_and_a_setting_without_them_restores_the_defaults(single_rank_gloo):
    """ropebhtd/rmscopy (issue 24's former forms) and cerows (ce_kernel.py's CE) reach fused.py, normsplit
    zero_step's list norm; a setting without them gets the defaults."""
    from dflash_dist.model import fused
    from dflash_dist.trainer import zero_step

    assert bts.parse_setting("direct+ropebhtd+rmscopy")["rope"] == "bhtd"
    with pytest.raises(SystemExit, match="normsplit splits the gradient list's norm; add nogather or gnormlist"):
        bts.parse_setting("direct+fused+normsplit")  # the gathered step takes the flat partitions' norm
    engine = _tiny_engine()
    try:
        bts.apply_setting(engine, bts.parse_setting("direct+lean+ropebhtd+rmscopy+cerows+normsplit+gnormlist"))
        assert fused._switch == {"rope_layout": "bhtd", "rms_norm_in_place": False, "ce": "rows"}
        assert zero_step._list_norm["form"] == "split"
        bts.apply_setting(engine, bts.parse_setting("direct+lean"))
        assert fused._switch == {"rope_layout": "bthd", "rms_norm_in_place": True, "ce": "liger"}
        assert zero_step._list_norm["form"] == "foreach"
    finally:
        zero_step.set_list_norm("foreach")
        fused.set_rope_layout("bthd")
        fused.set_rms_norm_in_place(True)
        fused.set_ce_kernel("liger")


def test_flex_words_set_the_compiled_flex_tuning_and_reach_the_call(single_rank_gloo, monkeypatch):
    """fa* words reach attention.set_flex_tuning (a FLEX_PRESETS tiling, torch's own, or inductor's autotuning);
    a setting without one gets the device's default tiles back; the options reach flex_attention's call."""
    from dflash_dist.model import attention

    assert tss.parse_setting("direct+lean+fam32n128")["flex"] == "m32n128"
    engine = _tiny_engine()
    try:
        tss.apply_setting(engine, tss.parse_setting("direct+lean+fam32n128"))
        assert attention.flex_tuning() == {"options": tss.FLEX_PRESETS["m32n128"], "autotune": False}
        assert attention.flex_tuning()["options"]["bwd_BLOCK_N1"] == 128
        tss.apply_setting(engine, tss.parse_setting("direct+lean+faautotune"))
        assert attention.flex_tuning() == {"options": None, "autotune": True}
        tss.apply_setting(engine, tss.parse_setting("direct+lean+fam64n64"))
        seen = []
        real = attention.flex_attention
        monkeypatch.setattr(attention, "flex_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
        positions, keep = torch.tensor([[3, 9]]), torch.tensor([[True, True]])
        mask = attention.block_mask_flex(positions, keep, 12, 4)
        q, k = torch.randn(1, 2, 8, 8), torch.randn(1, 1, 20, 8)
        attention.attend(q, k, k, mask, scale=0.3)
        assert seen[-1]["kernel_options"] == tss.FLEX_PRESETS["m64n64"]
        tss.apply_setting(engine, tss.parse_setting("direct+lean+fatorch"))
        assert attention.flex_tuning() == {"options": {}, "autotune": False}
        attention.attend(q, k, k, mask, scale=0.3)
        assert seen[-1]["kernel_options"] is None  # torch's own choice
        tss.apply_setting(engine, tss.parse_setting("direct+lean"))
        assert attention.flex_tuning() == {"options": None, "autotune": False}  # the device's default
        attention.attend(q, k, k, mask, scale=0.3)
        assert seen[-1]["kernel_options"] is None  # on the CPU: torch's own choice
    finally:
        attention.set_flex_tuning()
    with pytest.raises(ValueError, match=r"\['bwd_BLOCK_Q'\]: not torch's FlexKernelOptions"):
        attention.set_flex_tuning({"bwd_BLOCK_M1": 32, "bwd_BLOCK_Q": 64})
    assert attention.flex_tuning() == {"options": None, "autotune": False}  # a refused tuning changes nothing


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises: a flex tiling the compiler refuses (its backward compiles at the first call)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("InductorError: the backward tiling does not compile")


@pytest.mark.parametrize("text", ["direct+ds", "direct+lean+leangrads"])
def test_a_setting_that_fails_in_its_backward_leaves_the_engine_to_the_next(text, single_rank_gloo, monkeypatch):
    """A setting that fails inside the backward (the attention's, after DeepSpeed's hooks queued the later
    layers' gradients in the reduce bucket and reduced those larger than it): tss.recover, run by the bench
    after each FAILED setting, leaves the engine as a finished step would, so the next steps are bitwise
    those of an engine that never ran the failed one (without it the next backward fails on the stale
    bucket and every later setting of the lease with it)."""
    from dflash_dist.model import drafter as drafter_mod

    ids = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(5))
    lm = torch.ones(1, 24)
    a = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    feats = torch.randn(1, 24, 96, generator=torch.Generator().manual_seed(6))

    def step(engine):
        loss, _ = engine(ids, feats, lm, ids, a.positions, a.keep)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    engines = [_tiny_engine(hidden_size=32), _tiny_engine(hidden_size=32)]  # bucket 1024: the MLP weights exceed it
    for engine in engines:
        tss.apply_setting(engine, tss.parse_setting(text))
    failed, clean = engines
    assert [step(failed)] == [step(clean)]
    real = drafter_mod.attend
    monkeypatch.setattr(drafter_mod, "attend", lambda *args, **kw: _FailingBackward.apply(real(*args, **kw)))
    loss, _ = failed(ids, feats, lm, ids, a.positions, a.keep)
    with pytest.raises(RuntimeError, match="does not compile"):
        failed.backward(loss)
    opt = failed.optimizer
    assert any(opt.params_already_reduced) and any(b.params for b in opt.ipg_buckets.values())  # what it leaves
    monkeypatch.setattr(drafter_mod, "attend", real)
    tss.recover(failed)
    assert [step(failed) for _ in range(3)] == [step(clean) for _ in range(3)]
    for p, q in zip(failed.module.parameters(), clean.module.parameters()):
        assert torch.equal(p, q)
    for s_failed, s_clean in zip(opt.optimizer.state.values(), clean.optimizer.optimizer.state.values()):
        assert all(torch.equal(s_failed[k], s_clean[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_row_cut_words_switch_the_drafter_and_a_setting_without_them_takes_the_kernel_sets_default(single_rank_gloo):
    """dedup0/nodedup0 and lastrows/alllastrows reach the drafter's row cuts (drafter.py), onedx/adddx its
    one-buffer dX (shared_input.py), on a running engine; a
    setting without them gets what the trainer runs with the drafter's kernel set (on with liger/compile, the
    GPU's; off with torch); the step's loss is the same under each (the cuts compute the same function)."""
    assert tss.parse_setting("direct+nodedup0+alllastrows") == {**tss.BEFORE, "mask": "direct", "dedup0": False,
                                                                 "lastrows": False}  # fmt: skip
    engine = _tiny_engine()
    drafter = engine.module.drafter
    ids = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(5))
    lm = torch.ones(1, 24)
    lm[0, 9:12] = 0
    a = sample_anchors(torch.ones(1, 24), 4, torch.Generator().manual_seed(0))
    feats = torch.randn(1, 24, 96, generator=torch.Generator().manual_seed(6))
    losses = {}
    for text, want in (("direct+dedup0+lastrows", (True, True, False)), ("direct+nodedup0+lastrows+onedx",
                       (False, True, True)), ("direct+dedup0+alllastrows", (True, False, False)),
                       ("direct", (False, False, False))):  # fmt: skip
        tss.apply_setting(engine, tss.parse_setting(text))
        assert (drafter.dedup_layer0, drafter.last_rows, drafter.one_dx) == want, text
        with torch.no_grad():
            losses[text] = float(engine(ids, feats, lm, ids, a.positions, a.keep)[0])
    assert max(losses.values()) - min(losses.values()) <= 1e-6 * losses["direct"], losses  # fp32: ~1 ulp apart
    drafter.set_kernels("compile")  # the trainer's GPU defaults: both cuts on without a word, the one-buffer dX off
    tss.apply_setting(engine, tss.parse_setting("direct+lean"))
    assert (drafter.dedup_layer0, drafter.last_rows, drafter.one_dx) == (True, True, False)
    tss.apply_setting(engine, tss.parse_setting("direct+lean+nodedup0+onedx"))
    assert (drafter.dedup_layer0, drafter.last_rows, drafter.one_dx) == (False, True, True)
