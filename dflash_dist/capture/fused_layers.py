"""Capture path "fused2" (`capture.kernels: fused2`, kernel path "fla_fused2", CUDA only): on top of
fused_target's compiled norms, SwiGLU and fla conv, three Qwen3.5 layer forwards rewritten for the
capture forward (no cache, no padding mask), the same math in the same precision:

- Gated DeltaNet: the four input projections (qkv, z, b, a) as one GEMM over a concatenated weight
  (the module's weights become views of it: no second copy), so the hidden state is read once
  and the two 48-column GEMMs stop running at a fraction of the matmul rate; fla's conv reads the
  qkv columns of that output in place (strided), one call per q / k / v column block, so each
  comes out contiguous and fla's chunk kernel copies none of them (the conv is per channel: the
  same values as one call); beta and g from one compiled kernel; the gated RMSNorm on
  [B, T, heads, d] views (no reshape copy of z);
- gated attention: q/k RMSNorm, the transpose and partial RoPE as one compiled kernel per tensor,
  transformers' own SDPA call (made here in the capture case, `_own_sdpa_call`), and sigmoid(gate)
  x output as one kernel reading SDPA's output and the gate half of q_proj's output in place
  (transformers would copy the output to [B, T, H, d] first);
- decoder layer: the residual add and the post-attention RMSNorm as one compiled kernel.

At the Qwen3.5-27B shape these are ~2-3% of a capture forward (the elementwise share of
docs/BENCHMARKS.md's fused profile). Rounding differs from "fla_fused" (another GEMM shape for the
projections, no bf16 round trip between fused ops), so shards carry their own kernel path.
Any call with a cache or a padding mask (generation, regeneration) runs transformers' forward.
The per-block conv and the in-place attention output (issue 24: they were the 160 strided copies, 54.5
of 2796 ms, in bench/results/h100-2026-12-06d's profile) change no value, so "fla_fused2" stays.

`Kernels` holds the callables: `gpu_kernels()` (compiled, fla) for capture, `reference_kernels()`
(plain torch, transformers' own torch GDN path) so tests/test_fused_layers.py checks the rewritten
forwards against transformers' on CPU.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_dist.capture.fused_target import _compiled, _gated_rms_norm, _rms_norm, compile_kernel


def _gating(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """Qwen3_5GatedDeltaNet's beta and g."""
    return b.sigmoid(), -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def _add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + x, Qwen3_5RMSNorm of it)."""
    s = residual + x
    return s, _rms_norm(s, weight, eps)


def _gate_out(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3_5Attention's output gate: out [B, T, H, d] x sigmoid(gate [B, T, H, d]) as [B, T, H*d]. Both may
    be strided views (SDPA's output transposed, the gate half of q_proj's output): the product is taken on
    [B, T, H, d], sigmoid(gate) first so that eager's output follows its contiguous layout and the reshape
    is a view (a product commutes bit for bit), so neither input is copied."""
    return (torch.sigmoid(gate) * out).reshape(*out.shape[:2], -1).contiguous()


def _norm_rope(rope: Callable, q, k, q_weight, k_weight, eps: float, cos, sin):
    """q/k [B, T, H, d] -> RMSNorm over d, [B, H, T, d], the model's (partial) RoPE."""
    q = _rms_norm(q, q_weight, eps).transpose(1, 2)
    k = _rms_norm(k, k_weight, eps).transpose(1, 2)
    return rope(q, k, cos, sin)


def _torch_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None) -> torch.Tensor:
    """transformers' torch causal conv (causal_conv1d_fn) on the [B, T, D] layout."""
    t = x.shape[1]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[-1])[:, :, :t]  # fmt: skip
    if activation is not None:
        out = F.silu(out) if activation in ("silu", "swish") else getattr(F, activation)(out)
    return out.to(x.dtype).transpose(1, 2).contiguous()  # contiguous [B, T, D], as fla's conv returns


def _fla_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None) -> torch.Tensor:
    """fla's Triton causal conv on [B, T, D], reading a strided x in place, writing a contiguous y."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight=weight, bias=bias, activation=activation)[0]


@dataclass(frozen=True)
class Kernels:
    conv: Callable  # (x [B, T, D], weight [D, W], bias, activation) -> contiguous [B, T, D]
    gating: Callable
    gated_norm: Callable
    add_norm: Callable
    gate_out: Callable
    norm_rope: Callable  # (rope, q, k, q_weight, k_weight, eps, cos, sin)


def reference_kernels() -> Kernels:
    return Kernels(_torch_conv, _gating, _gated_rms_norm, _add_rms_norm, _gate_out, _norm_rope)


@functools.cache
def gpu_kernels() -> Kernels:
    """fused2's kernels: the norms (add + norm, gated norm, q/k norm + RoPE) compiled for their widths
    (fused_target.compile_kernel), gating and the output gate with every dimension dynamic."""
    gating, gate_out = (compile_kernel(f) for f in (_gating, _gate_out))
    add_norm = compile_kernel(_add_rms_norm, static_width=True)
    return Kernels(_fla_conv, gating, _compiled()[1], add_norm, gate_out, _compiled_norm_rope)


@functools.cache
def _compiled_rope(rope: Callable) -> Callable:
    return compile_kernel(functools.partial(_norm_rope, rope), static_width=True)


def _compiled_norm_rope(rope, *args):
    return _compiled_rope(rope)(*args)


# bench_capture's "fused2copies" mode: the two copy cuts off (one conv, split views copied by fla; transformers'
# SDPA function and its output copy), for timing before/after in one run; read at each call
_switch = {"copy_cuts": True}


def set_copy_cuts(on: bool) -> None:
    """True (the default): the per-block conv and the in-place attention output; False: the former forms (the
    same values; bench_capture.py times both side by side)."""
    _switch["copy_cuts"] = bool(on)


# ---- the rewritten forwards (bound per module by fuse_layers) ----


def _qkv_conv(m: nn.Module, conv: Callable, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The depthwise causal conv of the qkv columns as three convs, one per q / k / v column block (each
    with its rows of the conv weight and bias): the conv is per channel, so the values are those of one
    conv over all the columns, and each of q, k, v comes out contiguous. Split from one output they were
    strided views, which fla's chunk_gated_delta_rule (input_guard) copied to contiguous: three copies of
    [B, T, key_dim | key_dim | value_dim] a layer (~550 MB at 26897 tokens of Qwen3.5-27B)."""
    w, bias = m.conv1d.weight.squeeze(1), m.conv1d.bias
    ends = (0, m.key_dim, 2 * m.key_dim, 2 * m.key_dim + m.value_dim)
    return tuple(conv(mixed[..., lo:hi], w[lo:hi], None if bias is None else bias[lo:hi], m.activation)
                 for lo, hi in zip(ends, ends[1:]))  # fmt: skip


def gdn_forward(m: nn.Module, k: Kernels, chunk_fn: Callable, hidden_states, cache=None, attention_mask=None, **kw):
    if cache is not None or attention_mask is not None or kw.get("cu_seq_lens_q") is not None:
        return type(m).forward(m, hidden_states, cache=cache, attention_mask=attention_mask, **kw)
    bsz, t, _ = hidden_states.shape
    c, vd, hv = m.conv_dim, m.value_dim, m.num_v_heads
    proj = F.linear(hidden_states, m.dflash_in_proj)  # [B, T, qkv | z | b | a]
    mixed, z = proj[..., :c], proj[..., c : c + vd]
    b, a = proj[..., c + vd : c + vd + hv], proj[..., c + vd + hv :]
    if _switch["copy_cuts"]:
        q, key, v = _qkv_conv(m, k.conv, mixed)
    else:  # the former form: one conv, strided views that fla's chunk kernel copies
        y = k.conv(mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.activation)
        q, key, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.view(bsz, t, -1, m.head_k_dim)
    key = key.view(bsz, t, -1, m.head_k_dim)
    v = v.view(bsz, t, -1, m.head_v_dim)
    beta, g = k.gating(b, a, m.A_log, m.dt_bias)
    core, _ = chunk_fn(q, key, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=None)  # fmt: skip
    out = k.gated_norm(core, z.view(bsz, t, -1, m.head_v_dim), m.norm.weight, m.norm.variance_epsilon)
    return m.out_proj(out.reshape(bsz, t, -1))


def _own_sdpa_call(m: nn.Module, attend: Callable, q, key, v, attention_mask, kw: dict) -> bool:
    """Whether attn_forward makes transformers' sdpa_attention_forward's SDPA call itself: the capture
    forward's case (sdpa, no mask, several queries, causal, GQA inside SDPA as transformers decides it, none
    of the keywords that change its call), where that function's call is F.scaled_dot_product_attention(q,
    key, v, attn_mask=None, dropout_p=0.0, scale, is_causal=True[, enable_gqa=True]): the same kernel on the
    same tensors, so the same output, here left as the [B, T, H, d] view of SDPA's [B, H, T, d] result that
    gate_out reads in place. transformers returns `transpose(1, 2).contiguous()` of it, a copy where SDPA's
    output follows q's [B, H, T, d] layout (cuDNN's, CPU's): 16 copies of [T, 6144] bf16 a Qwen3.5-27B forward."""
    from transformers.integrations import sdpa_attention

    return (
        attend is sdpa_attention.sdpa_attention_forward
        and attention_mask is None
        and q.shape[2] > 1
        and getattr(m, "is_causal", True)
        and all(kw.get(name) is None for name in ("is_causal", "position_bias", "softcap", "output_attentions"))
        and (m.num_key_value_groups == 1 or sdpa_attention.use_gqa_in_sdpa(None, key, v))
    )


def attn_forward(m: nn.Module, k: Kernels, hidden_states, position_embeddings, attention_mask, cache=None, **kw):
    mod = sys.modules[type(m).__module__]
    if cache is not None:
        return type(m).forward(m, hidden_states, position_embeddings, attention_mask, cache=cache, **kw)
    shape = hidden_states.shape[:-1]
    d = m.head_dim
    qg = m.q_proj(hidden_states).view(*shape, -1, 2 * d)  # per head: query | gate
    key = m.k_proj(hidden_states).view(*shape, -1, d)
    cos, sin = position_embeddings
    q, key = k.norm_rope(mod.apply_rotary_pos_emb, qg[..., :d], key, m.q_norm.weight, m.k_norm.weight,
                         m.q_norm.eps, cos, sin)  # fmt: skip
    v = m.v_proj(hidden_states).view(*shape, -1, d).transpose(1, 2)
    attend = mod.ALL_ATTENTION_FUNCTIONS.get_interface(m.config._attn_implementation, mod.eager_attention_forward)
    if _switch["copy_cuts"] and _own_sdpa_call(m, attend, q, key, v, attention_mask, kw):
        gqa = {"enable_gqa": True} if m.num_key_value_groups > 1 else {}
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=None, dropout_p=0.0, scale=m.scaling, is_causal=True,
                                             **gqa).transpose(1, 2)  # fmt: skip
        weights = None
    else:
        out, weights = attend(m, q, key, v, attention_mask, dropout=0.0, scaling=m.scaling, **kw)
    return m.o_proj(k.gate_out(out, qg[..., d:])), weights


def layer_forward(m: nn.Module, k: Kernels, hidden_states, position_embeddings=None, attention_mask=None,
                  position_ids=None, cache=None, **kw):  # fmt: skip
    if cache is not None:
        return type(m).forward(m, hidden_states, position_embeddings, attention_mask, position_ids, cache, **kw)
    residual = hidden_states
    h = m.input_layernorm(hidden_states)
    if m.block_type == "linear_attention":
        h = m.linear_attn(hidden_states=h, cache=None, attention_mask=attention_mask, **kw)
    else:
        h, _ = m.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=None,
                           position_embeddings=position_embeddings, **kw)  # fmt: skip
    post = m.post_attention_layernorm
    residual, h = k.add_norm(residual, h, post.weight, post.eps)
    return residual + m.mlp(h)


def _fuse_in_projections(m: nn.Module) -> None:
    """One [qkv | z | b | a] weight; the four Linear weights become views of it (no extra memory)."""
    parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
    if any(p.bias is not None for p in parts):
        raise ValueError("fused2: Gated DeltaNet input projections with a bias are not supported")
    w = torch.cat([p.weight.detach() for p in parts], dim=0)
    offset = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(w[offset : offset + n], requires_grad=False)
        offset += n
    m.dflash_in_proj = w


def fuse_layers(model: nn.Module, kernels: Kernels) -> int:
    """Bind the rewritten forwards to every Qwen3.5 decoder layer, Gated DeltaNet and gated
    attention of `model` (undone by fused_target.unfuse_target); returns the modules changed."""
    n = 0
    for m in model.modules():
        kind = type(m).__name__
        if kind.endswith("GatedDeltaNet"):
            if not hasattr(m, "dflash_in_proj"):
                _fuse_in_projections(m)
            chunk = sys.modules[type(m).__module__].torch_chunk_gated_delta_rule  # fla's, as transformers resolved it
            m.forward = functools.partial(gdn_forward, m, kernels, chunk)
        elif kind.endswith("Attention") and hasattr(m, "q_norm") and m.q_proj.out_features == 2 * m.o_proj.in_features:
            m.forward = functools.partial(attn_forward, m, kernels)
        elif kind.endswith("DecoderLayer") and hasattr(m, "post_attention_layernorm"):
            m.forward = functools.partial(layer_forward, m, kernels)
        else:
            continue
        n += 1
    return n
