"""Sliding-window drafter layers (SPEC 2): slot s of the block anchored at a sees context
positions a+s-(w-1) <= p < a and block slots t <= s; full layers see context < a and the whole
block. One rule for training (dense and flex masks) and inference (draft_block)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import create_mask

from dflash_dist.model.attention import FULL, SLIDING, block_mask_dense, block_mask_flex, inference_sliding_mask
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import export_drafter, load_drafter
from dflash_dist.model.loss import Anchors, dflash_loss, sample_anchors
from tests.helpers.drafter import context_features, small_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIXED = (SLIDING, SLIDING, FULL)


def _rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row.tolist()) for row in mask]


def test_mask_reproduces_the_spec_example():
    """golden_swa README's table: context T=4, block B=4 at 4..7, w=3."""
    m = block_mask_dense(torch.tensor([[4]]), torch.tensor([[True]]), 4, 4, sliding_window=3)[0]
    assert _rows(m) == ["..xxx...", "...xxx..", "....xxx.", "....xxxx"]
    full = block_mask_dense(torch.tensor([[4]]), torch.tensor([[True]]), 4, 4)[0]
    assert _rows(full) == ["xxxxxxxx"] * 4
    inf = inference_sliding_mask(4, torch.arange(4)[None], torch.arange(4, 8)[None], 3)[0]
    assert torch.equal(inf, m)


def test_sliding_flex_and_dense_masks_agree():
    anchors = torch.tensor([[3, 9, 0], [1, 2, 17]])
    keep = torch.tensor([[True, True, False], [True, True, True]])
    for w in (1, 2, 5, 40):
        dense = block_mask_dense(anchors, keep, 20, 4, sliding_window=w)
        flex = block_mask_flex(anchors, keep, 20, 4, sliding_window=w)
        assert torch.equal(create_mask(flex.mask_mod, 2, 1, 12, 32, device="cpu")[:, 0], dense), w
        assert not dense[0, 8:].any()
    # w larger than everything: context rule = full's, block causal
    full = block_mask_dense(anchors, keep, 20, 4)
    wide = block_mask_dense(anchors, keep, 20, 4, sliding_window=64)
    assert torch.equal(wide[..., :20], full[..., :20]) and not torch.equal(wide, full)


def test_window_cuts_context_and_block_is_causal():
    d = small_drafter(layer_types=(SLIDING, SLIDING), sliding_window=3)
    f = context_features(d, 1, 12)
    base = d.draft_block(f[0], 3, 12)
    g = f.clone()
    g[0, 12 - 3] += 5.0  # position a-w: outside every slot's window (slot 0 sees a-2, a-1)
    assert torch.allclose(d.draft_block(g[0], 3, 12), base, atol=1e-6)
    g = f.clone()
    g[0, 11] += 5.0  # a-1: inside slots 0 and 1
    assert not torch.allclose(d.draft_block(g[0], 3, 12), base, atol=1e-4)
    # causal inside the block: changing slot 2's input leaves slots 0 and 1 alone
    ctx = d.fuse_context(f[:, :12])
    ids = torch.tensor([[3, 63, 63, 63]])
    pos, cpos = torch.arange(12, 16)[None], torch.arange(12)[None]
    h0 = d(ids, pos, ctx, cpos)
    h1 = d(torch.tensor([[3, 63, 7, 63]]), pos, ctx, cpos)
    assert torch.allclose(h0[0, :2], h1[0, :2], atol=1e-6) and not torch.allclose(h0[0, 2:], h1[0, 2:], atol=1e-4)
    # a full layer on top sees it all again
    mixed = small_drafter(layer_types=(SLIDING, FULL), sliding_window=3)
    m0, m1 = mixed(ids, pos, ctx, cpos), mixed(torch.tensor([[3, 63, 7, 63]]), pos, ctx, cpos)
    assert not torch.allclose(m0[0, :2], m1[0, :2], atol=1e-4)


def test_training_logits_equal_inference_per_block():
    """The training block mask and draft_block apply one rule (window 3 < block 4 < context)."""
    d = small_drafter(block=4, layer_types=MIXED, sliding_window=3)
    s = 30
    ids = torch.randint(0, 60, (2, s))
    f = context_features(d, 2, s)
    lm = torch.ones(2, s)
    anchors = sample_anchors(lm, 6, torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = dflash_loss(d, ids, f, lm, anchors, attention="dense", return_logits=True)
        flex = dflash_loss(d, ids, f, lm, anchors, attention="flex", return_logits=True)
    rows = anchors.keep.repeat_interleave(4, dim=1)
    assert torch.allclose(dense.logits[rows], flex.logits[rows], atol=1e-5)
    for b in range(2):
        for j in range(anchors.positions.shape[1]):
            if anchors.keep[b, j]:
                a = int(anchors.positions[b, j])
                ref = d.draft_block(f[b], int(ids[b, a]), a)
                assert torch.allclose(dense.logits[b, j * 4 + 1 : j * 4 + 4], ref, atol=1e-5)
    full = small_drafter(block=4, layer_types=(FULL,) * 3)
    full.load_state_dict(d.state_dict())
    with torch.no_grad():
        other = dflash_loss(full, ids, f, lm, anchors, attention="dense", return_logits=True)
    assert not torch.allclose(other.logits[rows], dense.logits[rows], atol=1e-3)  # the window matters


def test_a_single_mask_is_refused_for_a_sliding_drafter():
    d = small_drafter(layer_types=MIXED, sliding_window=3)
    f = context_features(d, 1, 8)
    mask = block_mask_dense(torch.tensor([[4]]), torch.tensor([[True]]), 8, 4)
    with pytest.raises(ValueError, match="one mask per layer type"):
        d(torch.zeros(1, 4, dtype=torch.long), torch.arange(4, 8)[None], d.fuse_context(f), torch.arange(8)[None], mask)


def test_sliding_drafter_trains_exports_and_reimports(tmp_path):
    """Dense path on CPU: a few AdamW steps lower the loss; the export carries layer_types and
    sliding_window as z-lab/SGLang/vLLM read them; the import gives the same forward."""
    d = small_drafter(block=4, layer_types=MIXED, sliding_window=3).train()
    s = 24
    ids = torch.randint(0, 60, (4, s))
    f = context_features(d, 4, s)
    lm = torch.ones(4, s)
    anchors = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        out = dflash_loss(d, ids, f, lm, anchors, attention="dense")
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    out_dir = export_drafter(d.eval(), tmp_path / "export")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["layer_types"] == list(MIXED) and cfg["sliding_window"] == 3 and cfg["use_sliding_window"] is True
    back = load_drafter(out_dir, d.embed_tokens.weight, d.lm_head.weight)
    assert back.config == d.config and back.config.layer_types == MIXED
    feats = torch.randn(12, 96)
    assert torch.equal(back.draft_block(feats, 5, 12), d.draft_block(feats, 5, 12))


def test_full_drafter_exports_without_window(tmp_path):
    cfg = json.loads((export_drafter(small_drafter(), tmp_path / "e") / "config.json").read_text())
    assert cfg["layer_types"] == [FULL, FULL] and cfg["use_sliding_window"] is False and cfg["sliding_window"] is None


def _hf(**changes) -> dict:
    d = small_drafter(layer_types=(SLIDING, FULL), sliding_window=4).config.to_hf_dict()
    d.update(changes)
    return d


def test_import_refuses_what_we_do_not_implement():
    with pytest.raises(ValueError, match=r"layer_types\[1\]='chunked_attention'"):
        DrafterConfig.from_hf_dict(_hf(layer_types=[SLIDING, "chunked_attention"]))
    with pytest.raises(ValueError, match="use_sliding_window"):  # not silently full attention
        DrafterConfig.from_hf_dict(_hf(use_sliding_window=False))
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig.from_hf_dict(_hf(sliding_window=None))
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'"):
        DrafterConfig.from_hf_dict(_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        DrafterConfig.from_hf_dict(_hf(rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                        "partial_rotary_factor": 0.25}))
    with pytest.raises(ValueError, match="attn_output_gate=True is not supported"):
        DrafterConfig.from_hf_dict(_hf(attn_output_gate=True))
    with pytest.raises(ValueError, match="is_causal=True is not supported"):
        DrafterConfig.from_hf_dict(_hf(is_causal=True))
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        DrafterConfig.from_hf_dict(_hf(layer_types=[SLIDING]))
    with pytest.raises(ValueError, match=r"layer_types\[0\]"):
        small_drafter(layer_types=("linear_attention", FULL))


def test_import_reads_layer_types_as_qwen3config_does():
    # explicit layer_types decide, whatever max_window_layers says (SpecForge's 27B config)
    assert DrafterConfig.from_hf_dict(_hf(max_window_layers=2)).layer_types == (SLIDING, FULL)
    # without layer_types: layers i >= max_window_layers slide when use_sliding_window is set
    d = _hf(max_window_layers=1)
    del d["layer_types"]
    assert DrafterConfig.from_hf_dict(d).layer_types == (FULL, SLIDING)
    d["use_sliding_window"] = False
    c = DrafterConfig.from_hf_dict(d)
    assert c.layer_types == (FULL, FULL) and c.sliding_window is None


def test_golden_swa_config_and_weights_load(golden_swa_dir, tmp_path):
    """The reference sliding config.json + weights import and reproduce the main (SpecForge/SGLang) keys."""
    g = load_file(str(golden_swa_dir / "drafter_forward.safetensors"))
    (tmp_path / "swa").mkdir()
    (tmp_path / "swa" / "config.json").write_text((golden_swa_dir / "drafter_config.json").read_text())
    save_file({k: v for k, v in g.items() if k.split(".")[0] in ("layers", "fc", "hidden_norm", "norm")},
              str(tmp_path / "swa" / "model.safetensors"))
    d = load_drafter(tmp_path / "swa", g["target.model.embed_tokens.weight"], g["target.lm_head.weight"])
    assert d.config.layer_types == (SLIDING, FULL) and d.config.sliding_window == 8
    logits = d.draft_block(g["context_features"][0], int(g["block_input_ids"][0, 0]), 32)
    assert torch.allclose(logits, g["draft_logits"][0], atol=2e-5)
    assert not torch.allclose(logits, g["zlab_sdpa.draft_logits"][0], atol=1e-3)  # window applied


def test_anchor_block_of_training_matches_golden_swa_loss(golden_swa_dir):
    from dflash_dist.tools.parity import build_drafter

    drafter, _ = build_drafter(golden_swa_dir, "cpu")
    t = load_file(str(golden_swa_dir / "dflash_loss.safetensors"))
    anchors = Anchors(t["anchor_positions"], t["block_keep_mask"])
    with torch.no_grad():
        out = dflash_loss(drafter, t["input_ids"], t["hidden_states"], t["loss_mask"], anchors,
                          gamma=float(t["loss_decay_gamma"]), attention="dense")
    assert abs(out.loss.item() - t["loss"].item()) < 1e-5


@pytest.mark.gpu
def test_cuda_flex_sliding_training_matches_dense():
    """flex_attention (compiled BlockMasks, one per layer type) vs the dense path, bf16, fwd + bwd."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=1024, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, intermediate_size=2816, vocab_size=4096, target_layer_ids=(1, 5, 9),
                        num_target_layers=12, block_size=16, mask_token_id=4095, layer_types=MIXED,
                        sliding_window=64)
    from dflash_dist.model.drafter import DFlashDrafter

    d = DFlashDrafter(cfg)
    d.set_target_weights(torch.randn(4096, 1024) * 0.02, torch.randn(4096, 1024) * 0.02)
    d = d.to("cuda", torch.bfloat16)
    s = 1024
    ids = torch.randint(0, 4000, (2, s), device="cuda")
    f = torch.randn(2, s, 3 * 1024, device="cuda").bfloat16()
    lm = torch.ones(2, s, device="cuda")
    a = sample_anchors(lm, 64, torch.Generator().manual_seed(0))
    results = {}
    for mode in ("dense", "flex"):
        d.zero_grad(set_to_none=True)
        out = dflash_loss(d, ids, f, lm, a, attention=mode, return_logits=True)
        out.loss.backward()
        results[mode] = (out.loss.item(), out.extras["hidden"].float(), d.fc.weight.grad.float().clone())
    rows = a.keep.repeat_interleave(16, dim=1)
    (ld, hd, gd), (lf, hf, gf) = results["dense"], results["flex"]
    assert abs(lf - ld) / ld < 1e-2
    assert (hd[rows] - hf[rows]).abs().max().item() < 0.1
    assert ((gd - gf).norm() / gd.norm()).item() < 5e-2
