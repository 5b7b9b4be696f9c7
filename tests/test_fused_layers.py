"""capture/fused_layers.py (capture.kernels=fused2): the rewritten Gated DeltaNet, gated attention
and decoder-layer forwards compute what transformers' forwards compute. On CPU with the plain
torch kernels (reference_kernels) against transformers' own torch path: captured features, argmax
and logits within fp32 rounding, cached generation unchanged (it falls back), no weight copied. On
CUDA (`-m gpu`): the compiled/fla path against the eager fla path and the "fused" path, bf16. No
strided copy of q/k/v (Gated DeltaNet) or of the attention output, bit for bit the former forwards
(`_former_gdn_forward`, `_former_attn_forward`: the code before per-block convs and the in-place SDPA
output), on CPU and on CUDA."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_dist.capture.fused_layers import (
    Kernels,
    attn_forward,
    fuse_layers,
    gdn_forward,
    reference_kernels,
    set_copy_cuts,
)
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


def _former_gdn_forward(m, k: Kernels, chunk_fn, hidden_states):
    """gdn_forward as it was (set_copy_cuts(False): one conv over all the qkv columns, q/k/v split from its
    output as strided views, which fla's chunk_gated_delta_rule copied to contiguous)."""
    set_copy_cuts(False)
    try:
        return gdn_forward(m, k, chunk_fn, hidden_states)
    finally:
        set_copy_cuts(True)


def _former_gate_out(out, gate):
    """capture/fused_layers._gate_out as it was (on transformers' contiguous [B, T, H, d] output)."""
    return (out.reshape(*out.shape[:2], -1) * torch.sigmoid(gate.reshape(*gate.shape[:2], -1))).contiguous()


def _former_attn_forward(m, k: Kernels, gate_out, hidden_states, position_embeddings):
    """attn_forward as it was (set_copy_cuts(False): transformers' attention function, whose sdpa returns a
    contiguous copy) with the former gate `gate_out`."""
    set_copy_cuts(False)
    try:
        return attn_forward(m, dataclasses.replace(k, gate_out=gate_out), hidden_states, position_embeddings, None)[0]
    finally:
        set_copy_cuts(True)


class _Copies(TorchDispatchMode):
    """The copies (clone, copy_) run under it, as (op, shape)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.seen.append((str(func), tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def _odd_width_target(dtype):
    """A Qwen3.5 whose q/k/v column blocks are not multiples of a vector width (72 | 72 | 240), with a bias
    on the conv (Qwen3.5 has none; its rows are sliced with the weight's)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash_dist.target.gdn_path import route_cpu_to_torch

    torch.manual_seed(5)
    config = Qwen3_5TextConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=3,
                               linear_num_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=40,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
                               pad_token_id=None, bos_token_id=None, eos_token_id=None)  # fmt: skip
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).eval().to(dtype)
    route_cpu_to_torch()
    gdn = model.model.layers[0].linear_attn
    with torch.no_grad():
        gdn.conv1d.bias = torch.nn.Parameter(torch.randn(gdn.conv_dim, dtype=dtype))
        for name, p in gdn.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_q_k_v_reach_the_chunk_kernel_contiguous_and_bitwise_as_before(dtype):
    """One conv per q / k / v column block: each reaches chunk_fn contiguous (fla's input guard copied the
    three strided views split from one conv's output), the output bit for bit the former forward's."""
    model = _odd_width_target(dtype)
    gdn = model.model.layers[0].linear_attn
    fuse_layers(model, reference_kernels())
    chunk = sys.modules[type(gdn).__module__].torch_chunk_gated_delta_rule
    seen = []

    def recording(q, k, v, **kw):
        seen.append(tuple(t.is_contiguous() for t in (q, k, v)))
        return chunk(q, k, v, **kw)

    x = torch.randn(2, 45, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        got = gdn_forward(gdn, reference_kernels(), recording, x)
        want = _former_gdn_forward(gdn, reference_kernels(), chunk, x)
        assert torch.equal(gdn(hidden_states=x), got)  # what fuse_layers bound
    assert seen == [(True, True, True)]
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_reads_sdpa_output_in_place_bitwise_as_transformers(target, dtype):
    """The capture case (no mask) makes transformers' SDPA call itself and gates its output in place: no
    copy in the whole attention forward (transformers' sdpa returned a contiguous copy, which the former
    gate also copied again on CPU to reshape it), the output bit for bit transformers' own forward's and
    the former one's. With a mask it runs transformers' attention function: still the same output."""
    model = target.to(dtype)
    attn = model.model.layers[3].self_attn
    x = torch.randn(2, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    pos = model.model.rotary_emb(x, torch.arange(37).expand(2, -1))
    mask = torch.ones(2, 1, 37, 37, dtype=torch.bool).tril()
    mask[1, :, 6:, :4] = False  # the second row left-padded by 4
    with torch.no_grad():
        want, want_masked = attn(x, pos, None)[0], attn(x, pos, mask)[0]
        fuse_layers(model, reference_kernels())
        with _Copies() as copies:
            got, weights = attn(hidden_states=x, position_embeddings=pos, attention_mask=None)
        former = _former_attn_forward(attn, reference_kernels(), _former_gate_out, x, pos)
        masked = attn(hidden_states=x, position_embeddings=pos, attention_mask=mask)[0]
    assert copies.seen == []
    assert weights is None
    # bit for bit, up to CPU eager's own loops: the gate is a strided view of q_proj's output (rows head_dim long),
    # whose sigmoid eager runs per row, and a row shorter than its unrolled vector loop (2 x 16 fp32 lanes with
    # AVX-512) goes through the scalar tail, 1 ulp off the vector exp (the former form's contiguous gate was one
    # vectorised run); o_proj then sums those products (2026-12-07, an AVX-512 EPYC: 3e-8 at most, fp32). Exact
    # with AVX2's lanes here and under the compiled kernels (pointwise: the same bits in any layout; the gpu test).
    for out, ref in ((got, want), (got, former), (masked, want_masked)):
        if not torch.equal(out, ref):
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(out, ref, rtol=4 * eps, atol=4 * eps * float(ref.abs().max()))


def test_the_bench_switch_restores_the_former_copies_with_the_same_values(target):
    """set_copy_cuts(False) (bench_capture's fused2copies: before/after in one run) runs the former forms: q/k/v
    reach chunk_fn as strided views, and the attention forward copies its output; the same bits."""
    model = target.to(torch.bfloat16)
    fuse_layers(model, reference_kernels())
    gdn, attn = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    chunk = sys.modules[type(gdn).__module__].torch_chunk_gated_delta_rule
    seen = []

    def recording(q, k, v, **kw):
        seen.append(all(t.is_contiguous() for t in (q, k, v)))
        return chunk(q, k, v, **kw)

    x = torch.randn(1, 21, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    pos = model.model.rotary_emb(x, torch.arange(21)[None])
    out = {}
    try:
        for on in (True, False):
            set_copy_cuts(on)
            with torch.no_grad():
                g = gdn_forward(gdn, reference_kernels(), recording, x)  # (the CPU conv itself copies: not counted)
                with _Copies() as copies:
                    out[on] = (g, attn(hidden_states=x, position_embeddings=pos, attention_mask=None)[0])
            out[on, "copies"] = len(copies.seen)
    finally:
        set_copy_cuts(True)
    assert seen == [True, False]
    assert out[True, "copies"] == 0 < out[False, "copies"]
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


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


def _cuda_hybrid():
    """A Qwen3.5 hybrid (hidden 1024, 8 layers, partial RoPE) in bf16 on CUDA, bench_capture's random init."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_capture import build_random_target, target_config

    cfg = target_config(tiny=True)
    for k, v in dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                     linear_value_head_dim=128, vocab_size=4096).items():  # fmt: skip
        setattr(cfg, k, v)
    return build_random_target(cfg, "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_cuda_fused2_features_match_eager_and_fused_bf16():
    """A Qwen3.5 hybrid (hidden 1024, 8 layers, partial RoPE) in bf16 on fla: fused2 (compiled
    layer rewrites + fla conv) against eager fla and against fused, features and argmax."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash_dist.capture.fused_target import fuse_target

    model = _cuda_hybrid()
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


@pytest.mark.gpu
def test_cuda_fused2_copies_no_q_k_v_nor_attention_output_bitwise_as_before():
    """On fla and cuDNN/flash SDPA, bf16: fla's conv per q / k / v column block is bit for bit one conv over
    all the columns (its arithmetic is per channel whatever tile BD autotuning picks for a width), at
    Qwen3.5-27B's widths (2048 | 2048 | 6144) and this model's (512 | 512 | 1024, inside its forward);
    fused2's Gated DeltaNet and attention forwards equal the former ones bit for bit, and neither copies a
    tensor of q/k/v's or the attention output's size (the former: fla's input guard copied q, k, v;
    transformers' sdpa the output)."""
    import math

    from torch.profiler import ProfilerActivity, profile
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash_dist.capture.fused_layers import _fla_conv, gpu_kernels
    from dflash_dist.capture.fused_target import compile_kernel, fuse_target, unfuse_target
    from dflash_dist.model.capture import gdn_kernel_path

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)

    # Qwen3.5-27B's blocks (no conv bias); each new width autotunes (16 Triton compiles), so no more of them
    kd, vd = 2048, 6144
    c = 2 * kd + vd
    mixed = randn(2, 300, c + vd + 96)[..., :c]  # the qkv columns of the input GEMM's output, strided
    w, ends = randn(c, 4, scale=0.5), (0, kd, 2 * kd, c)
    parts = [_fla_conv(mixed[..., lo:hi], w[lo:hi], None, "silu") for lo, hi in zip(ends, ends[1:])]
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, -1), _fla_conv(mixed, w, None, "silu"))

    model = _cuda_hybrid()
    torch_conv = modeling_qwen3_5.causal_conv1d_fn
    fuse_target(model, layers=True)
    gdn, attn = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    assert gdn_kernel_path(model) == "fla"  # chunk below is fla's, behind its input guard
    k, chunk = gpu_kernels(), sys.modules[type(gdn).__module__].torch_chunk_gated_delta_rule
    b, t = 2, 700
    x = randn(b, t, model.config.hidden_size)
    pos = model.model.rotary_emb(x, torch.arange(t, device="cuda").expand(b, -1))
    with torch.no_grad():
        want_gdn = _former_gdn_forward(gdn, k, chunk, x)
        want_attn = _former_attn_forward(attn, k, compile_kernel(_former_gate_out), x, pos)
        gdn(hidden_states=x)  # compiles, autotunes
        attn(hidden_states=x, position_embeddings=pos, attention_mask=None)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            got_gdn = gdn(hidden_states=x)
            got_attn, _ = attn(hidden_states=x, position_embeddings=pos, attention_mask=None)
    unfuse_target(model, torch_conv)
    sizes = {b * t * n for n in (gdn.key_dim, gdn.value_dim, attn.config.num_attention_heads * attn.head_dim)}
    copies = [(e.name, e.input_shapes) for e in prof.events() if e.name in ("aten::copy_", "aten::clone")
              and any(shape and math.prod(shape) in sizes for shape in e.input_shapes)]  # fmt: skip
    assert copies == []
    assert torch.equal(got_gdn, want_gdn)
    assert torch.equal(got_attn, want_attn)
