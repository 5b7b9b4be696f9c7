"""Drafter conventions that decide whether real tau is ~1 or high: all k layers feed fc, context
strictly before the anchor, bidirectional blocks, no leakage between blocks, frozen target parts."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model.attention import block_mask_dense, block_mask_flex
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.loss import Anchors, dflash_loss, sample_anchors
from tests.helpers.drafter import context_features, small_drafter


def test_fc_uses_all_k_layers():
    d = small_drafter(k=5)
    assert d.fc.in_features == 5 * 32
    f = context_features(d, 1, 10)
    base = d.draft_block(f[0], 3, 10)
    h = d.config.hidden_size
    for layer in range(5):  # changing any one captured layer, the last included, changes the drafts
        g = f.clone()
        g[..., layer * h : (layer + 1) * h] += 1.0
        assert not torch.allclose(d.draft_block(g[0], 3, 10), base, atol=1e-4), f"layer slot {layer} ignored"


def test_training_block_sees_context_strictly_before_anchor():
    d = small_drafter()
    s = 20
    ids = torch.randint(0, 60, (1, s))
    f = context_features(d, 1, s)
    lm = torch.ones(1, s)
    anchors = Anchors(torch.tensor([[5, 11]]), torch.tensor([[True, True]]))
    base = dflash_loss(d, ids, f, lm, anchors, return_logits=True).logits
    g = f.clone()
    g[0, 11] += 5.0  # the anchor's own feature: hidden from block 1 (anchor 11); block 0 never sees it
    same = dflash_loss(d, ids, g, lm, anchors, return_logits=True).logits
    assert torch.allclose(same, base, atol=1e-6)
    g = f.clone()
    g[0, 10] += 5.0  # just before anchor 11: visible to block 1 only
    out = dflash_loss(d, ids, g, lm, anchors, return_logits=True).logits
    assert torch.allclose(out[0, :4], base[0, :4], atol=1e-6)
    assert not torch.allclose(out[0, 4:], base[0, 4:], atol=1e-4)


def test_no_leak_between_blocks_and_bidirectional_within():
    d = small_drafter()
    s = 24
    ids = torch.randint(0, 60, (1, s))
    f = context_features(d, 1, s)
    lm = torch.ones(1, s)
    a = Anchors(torch.tensor([[4, 6, 15]]), torch.tensor([[True, True, True]]))
    base = dflash_loss(d, ids, f, lm, a, return_logits=True).logits
    ids2 = ids.clone()
    ids2[0, 6] = (ids[0, 6] + 1) % 60  # anchor token of block 1 only
    out = dflash_loss(d, ids2, f, lm, a, return_logits=True).logits
    assert torch.allclose(out[0, :4], base[0, :4], atol=1e-6) and torch.allclose(out[0, 8:], base[0, 8:], atol=1e-6)
    # every slot of block 1, including slot 3 after the anchor's position, sees the anchor token
    assert all(not torch.allclose(out[0, 4 + j], base[0, 4 + j], atol=1e-5) for j in range(4))


def test_training_logits_equal_inference_per_block():
    d = small_drafter(block=4)
    s = 30
    ids = torch.randint(0, 60, (2, s))
    f = context_features(d, 2, s)
    lm = torch.ones(2, s)
    anchors = sample_anchors(lm, 6, torch.Generator().manual_seed(1))
    logits = dflash_loss(d, ids, f, lm, anchors, return_logits=True).logits
    for b in range(2):
        for j in range(anchors.positions.shape[1]):
            if not anchors.keep[b, j]:
                continue
            a = int(anchors.positions[b, j])
            ref = d.draft_block(f[b], int(ids[b, a]), a)
            assert torch.allclose(logits[b, j * 4 + 1 : j * 4 + 4], ref, atol=1e-5)


def test_flex_and_dense_masks_agree():
    anchors = torch.tensor([[3, 9, 0], [1, 2, 17]])
    keep = torch.tensor([[True, True, False], [True, True, True]])
    dense = block_mask_dense(anchors, keep, 20, 4)
    flex = block_mask_flex(anchors, keep, 20, 4)
    from torch.nn.attention.flex_attention import create_mask

    assert torch.equal(create_mask(flex.mask_mod, 2, 1, 12, 32, device="cpu")[:, 0], dense)
    assert not dense[0, 8:].any()  # invalid block sees nothing
    assert dense[1, 0, :1].all() and not dense[1, 0, 1:20].any()  # anchor 1: context position 0 only


def test_flex_and_dense_forward_agree():
    d = small_drafter()
    ids = torch.randint(0, 60, (2, 26))
    f = context_features(d, 2, 26)
    lm = torch.ones(2, 26)
    lm[1, :20] = 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    with torch.no_grad():  # flex has no CPU backward; on CUDA the GPU test covers training
        dense = dflash_loss(d, ids, f, lm, a, attention="dense", return_logits=True)
        flex = dflash_loss(d, ids, f, lm, a, attention="flex", return_logits=True)
    rows = a.keep.repeat_interleave(4, dim=1)
    assert torch.allclose(dense.logits[rows], flex.logits[rows], atol=1e-5)
    assert abs(dense.loss.item() - flex.loss.item()) < 1e-5


def test_target_parts_frozen_and_not_exported():
    d = small_drafter().train()
    ids = torch.randint(0, 60, (1, 16))
    lm = torch.ones(1, 16)
    out = dflash_loss(d, ids, context_features(d, 1, 16), lm, sample_anchors(lm, 4))
    out.loss.backward()
    assert d.embed_tokens.weight.grad is None and d.lm_head.weight.grad is None
    assert d.fc.weight.grad is not None and d.layers[0].self_attn.k_proj.weight.grad is not None
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(d.drafter_state_dict())


def test_builds_on_meta_device():
    with torch.device("meta"):
        d = DFlashDrafter(small_drafter().config)
    assert d.fc.weight.is_meta


def _gpu_drafter(dtype):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, intermediate_size=2816, vocab_size=4096, target_layer_ids=(1, 5, 9),
                        num_target_layers=12, block_size=16, mask_token_id=4095)
    d = DFlashDrafter(cfg)
    d.set_target_weights(torch.randn(4096, 1024) * 0.02, torch.randn(4096, 1024) * 0.02)
    return d.to("cuda", dtype)


@pytest.mark.gpu
def test_cuda_flex_bf16_matches_dense_training_forward():
    """flex_attention (compiled, sparse BlockMask) vs the dense-mask sdpa path, bf16, fwd + bwd."""
    d = _gpu_drafter(torch.bfloat16)
    s = 1024
    ids = torch.randint(0, 4000, (2, s), device="cuda")
    f = (torch.randn(2, s, 3 * 1024, device="cuda")).bfloat16()
    lm = torch.ones(2, s, device="cuda")
    lm[1, :600] = 0
    a = sample_anchors(lm, 64, torch.Generator().manual_seed(0))
    results = {}
    for mode in ("dense", "flex"):
        d.zero_grad(set_to_none=True)
        out = dflash_loss(d, ids, f, lm, a, attention=mode, return_logits=True)
        out.loss.backward()
        results[mode] = (out.loss.item(), out.extras["hidden"].float(), d.fc.weight.grad.float().clone())
    rows = a.keep.repeat_interleave(16, dim=1)
    (ld, hd, gd), (lf, hf, gf) = results["dense"], results["flex"]
    hidden_diff = (hd[rows] - hf[rows]).abs().max().item()
    grad_rel = ((gd - gf).norm() / gd.norm()).item()
    print(f"bf16 flex vs dense: loss {lf:.5f} vs {ld:.5f}, hidden max|d| {hidden_diff:.3e}, fc grad rel {grad_rel:.3e}")
    assert abs(lf - ld) / ld < 1e-2
    assert hidden_diff < 0.1  # bf16: ~3 significant digits on O(1) normed activations
    assert grad_rel < 5e-2


def _loss_and_grads(d, ids, f, lm, a, **kw):
    d.zero_grad(set_to_none=True)
    out = dflash_loss(d, ids, f, lm, a, **kw)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}


def test_split_kv_projection_gives_the_same_loss_and_gradients():
    """DrafterAttention.split_kv (k/v of context and block projected apart, then concatenated) is the
    same math as projecting cat(context, block): loss and every gradient within fp32 rounding."""
    d = small_drafter(layer_types=("sliding_attention", "full_attention"), sliding_window=6).train()
    ids = torch.randint(0, 60, (2, 30))
    f = context_features(d, 2, 30)
    lm = torch.ones(2, 30)
    a = sample_anchors(lm, 6, torch.Generator().manual_seed(1))
    ref_loss, ref = _loss_and_grads(d, ids, f, lm, a)
    d.set_split_kv(True)
    assert all(layer.self_attn.split_kv for layer in d.layers)
    loss, got = _loss_and_grads(d, ids, f, lm, a)
    d.set_split_kv(False)
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert got.keys() == ref.keys() and "layers.0.self_attn.k_proj.weight" in got
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
def test_cuda_split_kv_matches_concatenated_projection_bf16():
    """bf16, compiled flex, liger kernels (the trainer's GPU path): split vs concatenated k/v projections."""
    d = _gpu_drafter(torch.bfloat16).train()
    d.set_kernels("liger")
    s = 1024
    ids = torch.randint(0, 4000, (1, s), device="cuda")
    f = torch.randn(1, s, 3 * 1024, device="cuda").bfloat16()
    lm = torch.ones(1, s, device="cuda")
    a = sample_anchors(lm, 64, torch.Generator().manual_seed(0))
    a = Anchors(a.positions.cuda(), a.keep.cuda())
    ref_loss, ref = _loss_and_grads(d, ids, f, lm, a, attention="flex")
    d.set_split_kv(True)
    loss, got = _loss_and_grads(d, ids, f, lm, a, attention="flex")
    print(f"bf16 split vs cat k/v: loss {loss.item():.6f} vs {ref_loss.item():.6f}")
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3
    for name in ("fc.weight", "layers.0.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight"):
        rel = ((got[name] - ref[name]).norm() / ref[name].norm()).item()
        assert rel < 2e-2, (name, rel)
