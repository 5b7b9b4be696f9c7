"""capture/fused_layers.py (capture.kernels=fused2): the rewritten Gated DeltaNet, gated attention
and decoder-layer forwards compute what transformers' forwards compute. On CPU with the plain
torch kernels (reference_kernels) against transformers' own torch path: captured features, argmax
and logits within fp32 rounding, cached generation unchanged (it falls back), no weight copied. On
CUDA (`-m gpu`): the compiled/fla path against the eager fla path and the "fused" path, bf16."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.capture.fused_layers import fuse_layers, reference_kernels
from dflash_dist.capture.fused_target import unfuse_target
from dflash_dist.model.capture import capture_features
from dflash_dist.tools.demo import DemoConfig, tiny_qwen35_target

LAYERS = [1, 3, 5]


@pytest.fixture()
def target():
    model = tiny_qwen35_target(DemoConfig(target_layers=8, seed=3))
    with torch.no_grad():  # non-trivial norm gains and gating parameters (the init leaves them at 1 / 0)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _cpu_inductor_keeps_emulated_roundings() -> bool:
    """Whether this torch's CPU (C++) inductor keeps, inside a fused kernel, a bf16 rounding that
    emulate_precision_casts asks for. torch 2.11's does not: its low-precision CSE cache maps the
    fp32 -> bf16 -> fp32 round trip back to the unrounded fp32 value (pytorch#182131, #185337; fixed by
    #182882, #185847; 2.13 keeps it). Triton never had that cache, and the capture kernels run on CUDA
    only (fuse_target refuses a CPU target)."""
    x = torch.linspace(1, 2, 257)  # fp32 values bf16 rounds
    f = torch.compile(lambda t: t.to(torch.bfloat16).float() * 3, options={"emulate_precision_casts": True})
    return torch.equal(f(x), x.to(torch.bfloat16).float() * 3)


def test_fused_kernels_round_as_eager_in_their_own_compiles_only():
    """compile_kernel rounds bf16 intermediates where eager rounds (inductor's emulate_precision_casts), so
    the fused kernels equal eager bit for bit, and leaves the process's inductor config alone: a later
    compile in the same process (the drafter's, a bench's) keeps inductor's own rounding. On a CPU inductor
    that drops the emulated roundings (torch 2.11's C++ backend: _cpu_inductor_keeps_emulated_roundings)
    the kernel rounds once, at the end, whatever the option says: that is what it must equal there, and
    only the config check can see a leak."""
    import torch._inductor.config as inductor_config

    from dflash_dist.capture.fused_target import _silu_mul, compile_kernel

    g, u = torch.randn(2, 64, 1000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).unbind(0)
    eager = _silu_mul(g, u)
    once = (torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16)  # one rounding at the end
    assert not torch.equal(once, eager)  # the inputs tell the two apart
    kernel = compile_kernel(_silu_mul)(g, u)
    assert inductor_config.emulate_precision_casts is False
    if not _cpu_inductor_keeps_emulated_roundings():
        assert torch.equal(kernel, once)
        return
    assert torch.equal(kernel, eager)
    later = torch.compile(lambda x, y: torch.nn.functional.silu(x) * y, dynamic=True)(g, u)
    assert torch.equal(later, once)  # one rounding at the end: the flag did not leak


def test_rewritten_layers_equal_transformers_forwards_on_cpu(target):
    ids = torch.randint(0, 200, (2, 37))
    ref = capture_features(target, ids, LAYERS)
    with torch.no_grad():
        ref_logits = target(input_ids=ids).logits
    weights = {n: p.data_ptr() for n, p in target.named_parameters()}
    n = fuse_layers(target, reference_kernels())
    assert n == 8 + 6 + 2  # every decoder layer, 6 Gated DeltaNets, 2 gated attentions
    gdn = target.model.layers[0].linear_attn
    fused = gdn.dflash_in_proj
    for part in (gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a):  # views of the one weight
        assert part.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert {n for n, p in target.named_parameters() if p.data_ptr() != weights[n]} <= {
        n for n in weights if ".in_proj_" in n
    }
    got = capture_features(target, ids, LAYERS)
    with torch.no_grad():
        logits = target(input_ids=ids).logits
    torch.testing.assert_close(got.features, ref.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.target_argmax, ref.target_argmax)
    # every rewritten piece is what ran: a wrong kernel in any one of them changes the features
    good = vars(reference_kernels())
    wrong = {
        "conv": lambda x, w, b, act: good["conv"](x, w, b, None),
        "gating": lambda b, a, a_log, dt: good["gating"](b, a, a_log, dt + 1),
        "gated_norm": lambda x, z, w, eps: good["gated_norm"](x, z, w + 1, eps),
        "add_norm": lambda r, x, w, eps: good["add_norm"](r, 2 * x, w, eps),
        "gate_out": lambda out, gate: good["gate_out"](out, -gate),
        "norm_rope": lambda rope, q, k, qw, kw, eps, cos, sin: good["norm_rope"](rope, q, k, qw, kw, eps, sin, cos),
    }
    for name, fn in wrong.items():
        fuse_layers(target, reference_kernels().__class__(**{**good, name: fn}))
        assert not torch.allclose(capture_features(target, ids, LAYERS).features, ref.features, atol=1e-4), name
    fuse_layers(target, reference_kernels())


def test_cached_generation_falls_back_to_transformers(target):
    ids = torch.randint(0, 200, (1, 12))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        want = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        fuse_layers(target, reference_kernels())
        got = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    unfuse_target(target, modeling_qwen3_5.causal_conv1d_fn)  # restore the module's own conv (not None)
    assert not any("forward" in vars(m) for m in target.modules())


@pytest.mark.gpu
def test_cuda_fused2_features_match_eager_and_fused_bf16():
    """A Qwen3.5 hybrid (hidden 1024, 8 layers, partial RoPE) in bf16 on fla: fused2 (compiled
    layer rewrites + fla conv) against eager fla and against fused, features and argmax."""
    import sys
    from pathlib import Path

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash_dist.capture.fused_target import fuse_target

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_capture import build_random_target, target_config

    cfg = target_config(tiny=True)
    for k, v in dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                     linear_value_head_dim=128, vocab_size=4096).items():  # fmt: skip
        setattr(cfg, k, v)
    model = build_random_target(cfg, "cuda", torch.bfloat16)
    torch_conv = modeling_qwen3_5.causal_conv1d_fn
    ids = torch.randint(0, 4096, (3, 1500), device="cuda")
    layers = [1, 3, 5]
    eager = capture_features(model, ids, layers)
    assert eager.kernel_path == "fla"
    fuse_target(model)
    fused = capture_features(model, ids, layers)
    unfuse_target(model, torch_conv)
    fuse_target(model, layers=True)
    fused2 = capture_features(model, ids, layers)
    unfuse_target(model, torch_conv)

    def rel(a, b):
        return float((a.features.float() - b.features.float()).norm() / b.features.float().norm())

    def agree(a, b):
        return float((a.target_argmax == b.target_argmax).double().mean())

    print(
        f"fused2 vs eager rel L2 {rel(fused2, eager):.2e} argmax {agree(fused2, eager):.3f}; fused vs eager "
        f"{rel(fused, eager):.2e} / {agree(fused, eager):.3f}; fused2 vs fused {rel(fused2, fused):.2e}"
    )
    assert torch.isfinite(fused2.features).all()
    assert rel(fused2, eager) < 2 * rel(fused, eager) + 1e-2  # bf16 rounding of the same math
    assert agree(fused2, eager) > 0.8
