"""The drafter's residual add in its RMSNorm's kernel (drafter.RMSNorm.add_forward, fused.add_rms_norm_fn): with
the fast kernel sets every residual add but the last runs inside the next norm's kernel (each layer returns its
MLP output unsummed); the torch set keeps the add and the norm apart, the same ops in the same order as before."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model import fused
from dflash_dist.model.drafter import RMSNorm
from dflash_dist.model.loss import dflash_loss
from tests.helpers.drafter import cuda_bf16_case, small_drafter
from tests.helpers.drafter import loss_and_grads as _loss_and_grads
from tests.helpers.drafter import loss_batch as _batch
from tests.helpers.drafter import rel as _rel


def _count_fused_calls(d, fn=None) -> list[int]:
    """Wrap each RMSNorm's add_fast (or, given, `fn` as it) to count its calls (a one-element list)."""
    calls = [0]
    for m in d.modules():
        if isinstance(m, RMSNorm) and (fn is not None or m.add_fast is not None):
            inner = fn if fn is not None else m.add_fast

            def counted(*args, _inner=inner):
                calls[0] += 1
                return _inner(*args)

            m.add_fast = counted
    return calls


def test_the_compiled_add_norm_is_the_add_then_the_norm():
    """fused.add_rms_norm_fn("compile"): (residual + x, its RMSNorm), values and gradients as the reference's."""
    g = torch.Generator().manual_seed(0)
    r, x = (torch.randn(3, 5, 32, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(32, generator=g, requires_grad=True)
    got = fused.add_rms_norm_fn("compile")(r, x, w, 1e-6)
    want = fused.add_rms_norm_ref(r, x, w, 1e-6)
    assert torch.equal(got[0], want[0])  # the sum: one add, one rounding either way
    assert _rel(got[1], want[1]) < 1e-6
    up = torch.randn(3, 5, 32, generator=g)
    grads = [torch.autograd.grad(out[0].sum() + (out[1] * up).sum(), (r, x, w)) for out in (got, want)]
    assert all(_rel(a, b) < 1e-5 for a, b in zip(*grads))
    assert fused.add_rms_norm_fn("torch") is None


def test_each_residual_add_but_the_last_runs_in_a_norm_kernel_with_the_same_loss_and_gradients():
    """The fast sets give every RMSNorm an add-norm kernel, which bench_train_step's noaddnorm takes away and
    addnorm gives back; the torch set has none. The forward calls it 2 per layer less one (layer 0's input norm
    takes the embedding alone, the final norm adds apart), and with the reference function as the kernel the
    loss and gradients are bitwise the separate add and norm's (the compiled kernel's numerics: the test above
    and the gpu test below)."""
    d = small_drafter(block=4).train()
    norms = [m for m in d.modules() if isinstance(m, RMSNorm)]
    assert all(m.add_fast is None for m in norms)  # torch: add, then norm
    d.set_kernels("compile")
    assert all(m.add_fast is not None for m in norms)
    d.set_fused_add_norm(False)
    assert all(m.add_fast is None for m in norms)
    d.set_fused_add_norm(True)
    assert all(m.add_fast is not None for m in norms)
    d.set_kernels("torch")
    batch = _batch(d, torch.float32, packed=True)
    off, off_g = _loss_and_grads(d, batch)
    calls = _count_fused_calls(d, fused.add_rms_norm_ref)
    on, on_g = _loss_and_grads(d, batch)
    assert calls[0] == 2 * len(d.layers) - 1
    assert torch.equal(on.loss, off.loss)
    assert all(torch.equal(on_g[n], off_g[n]) for n in off_g)


def test_layer_outputs_are_the_summed_residual_stream():
    """return_layer_outputs: each layer's output is h + its MLP output, bitwise what the layer returned summed
    before the add moved into the next norm (the torch set: the very same adds)."""
    d = small_drafter(block=4)
    ids, feats, lm, anchors = _batch(d, torch.float32, packed=False)
    out = dflash_loss(d, ids, feats, lm, anchors, gamma=3.0, return_logits=True)
    ex = out.extras
    ctx = d.fuse_context(feats)
    with torch.no_grad():
        from dflash_dist.model.attention import layer_masks

        mask = layer_masks("dense", anchors.positions, anchors.keep, ids.shape[1], 4, d.config.layer_types,
                           d.config.sliding_window, anchors.starts)  # fmt: skip
        ctx_pos = ex["position_ids"][:, : ids.shape[1]]
        hidden, outs = d(ex["block_ids"], ex["position_ids"][:, ids.shape[1]:], ctx, ctx_pos, mask,
                         return_layer_outputs=True)  # fmt: skip
        # by hand, the pre-norm layers as they were written before: h = h + attn(norm(h)); h = h + mlp(norm(h))
        h = d.embed_tokens(ex["block_ids"])
        rope_q = d.rotary(ex["position_ids"][:, ids.shape[1]:], h.dtype)
        rope_kv = d.rotary(ex["position_ids"], h.dtype)
        for layer, got in zip(d.layers, outs, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), ctx, rope_q, rope_kv, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            assert torch.equal(got, h)
        assert torch.equal(hidden, d.norm(h))
        assert torch.equal(hidden, ex["hidden"])


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_gpu_add_norm_matches_the_separate_add_and_norm_in_bf16(kernels):
    """bf16 on CUDA, flex attention, the 27B drafter's width at 2 layers: the fused add-norm against the separate
    add and norm (same set, same weights and batch): the forward's hidden rows to bf16 rounding, the loss to
    1e-3, every gradient no further from the fp32 reference than the separate form's (the fused backward rounds
    the norm's dX plus the residual gradient once, the separate form twice)."""
    d, batch, g32 = cuda_bf16_case(5120, 32, 8, 128, 2048, 4096, 2, rows=1, anchors=32, id_max=4000)
    d.set_kernels(kernels)
    calls = _count_fused_calls(d)
    on, on_g = _loss_and_grads(d, batch)
    assert calls[0] == 2 * len(d.layers) - 1
    d.set_fused_add_norm(False)
    off, off_g = _loss_and_grads(d, batch)
    print(f"{kernels}: loss {float(on.loss):.6f} vs {float(off.loss):.6f}; distance to fp32, fused/separate: "
          + ", ".join(f"{n} {_rel(on_g[n], g32[n]):.2e}/{_rel(off_g[n], g32[n]):.2e}" for n in g32 if "norm" in n))
    assert _rel(on.loss, off.loss) < 1e-3
    assert all(_rel(on_g[n], g32[n]) <= 1.25 * _rel(off_g[n], g32[n]) + 2e-3 for n in g32)
