"""The fused capture path (`capture.kernels: fused`, CUDA only): every RMSNorm (fp32), the gated
RMSNorm and SwiGLU's silu * up of the target run as torch.compile'd kernels, and the Gated
DeltaNet causal conv runs fla's Triton kernel on the [B, T, D] layout in place (no transposed
copy, no cuDNN depthwise conv). GEMMs, attention and fla's GDN kernels are untouched; the math is
the same in the same precision, the rounding is not bit-identical, so shards carry their own
kernel path, "fla_fused": an evaluator or trainer on "fla" refuses them (provenance), and
bench/bench_parity_probe.py reports fused against eager. At the Qwen3.5-27B shape it lifts
capture from ~64% to ~73% of the bf16 bound (docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from data_pipeline.chat_data import template_hash
from data_pipeline.provenance import CAPTURE_KERNEL_PATHS, Provenance
from dflash_dist.model.capture import check_kernel_path
from dflash_dist.strict_compile import strict_compile
from dflash_dist.target.loading import TargetIdentity, provenance_for


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNorm.forward, as one function of its inputs."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated.forward, as one function of its inputs."""
    out = x.float()
    out = weight * (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (out * F.silu(gate.float())).to(x.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _mlp(m: nn.Module, silu_mul, x: torch.Tensor) -> torch.Tensor:
    return m.down_proj(silu_mul(m.gate_proj(x), m.up_proj(x)))


def _fla_conv1d(x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **_) -> torch.Tensor:
    """transformers' causal_conv1d_fn contract (x [B, D, T], a transposed [B, T, D] tensor) on fla's
    Triton causal conv, which reads [B, T, D] in place."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)[0].transpose(1, 2)


# shapes one capture kernel may compile for (ranks 3 and 4, batch and length 1 or not, each dtype:
# capture, greedy generation and live verification share these code objects); dynamo's default is 8
RECOMPILE_LIMIT = 64


def compile_kernel(f, static_width: bool = False):
    """torch.compile for the fused capture kernels (here and capture/fused_layers.py): dynamic shapes,
    and inductor rounding where eager rounds (bf16 intermediates, `emulate_precision_casts`) in these
    compiles only, not in every later compile of the process (the drafter's, a bench's). Triton (CUDA,
    where these kernels run) keeps those roundings in torch 2.11 and 2.13; torch 2.11's CPU C++ backend
    drops them inside a fused kernel (pytorch#182131, fixed by #182882), which only the CPU test meets.

    A kernel never runs eagerly in the kernel path's name (strict_compile): past its recompile limit (in
    any thread) or at a graph break plain torch.compile would run that call in eager, the shards still
    saying "fla_fused"; this raises instead, an error naming the kernel and what to do. An error, not a
    recorded "eager" path: the run's features would then mix two paths, which the trainer and evaluator
    refuse anyway, only later.
    `static_width`: the last dimension static (every other dynamic, strict_compile's static_last_dim): one graph
    per width for every token count. A pointwise kernel keeps its bits under any tiling: SwiGLU's silu * up at
    the Qwen3.5-27B capture shape 1.104 -> 1.002 ms a call on an H100, bitwise (bench_capture_kernels.py,
    docs/BENCHMARKS.md sixteenth session). The norms keep theirs too: their weights are nn.Parameters, whose
    shapes torch.compile specialises (force_parameter_static_shapes), and the row's width with them through the
    broadcast, so even under dynamic=True they were compiled for their widths, the same graphs (counted in
    tests/test_fused_target.py). Marking the width also makes RoPE's cos/sin width static in q/k norm + RoPE,
    a pointwise part: capture's compute +0.9% on an H100 (docs/BENCHMARKS.md nineteenth session)."""
    name = getattr(f, "__name__", None) or getattr(getattr(f, "func", None), "__name__", repr(f))
    return strict_compile(
        f,
        dynamic=None if static_width else True,
        static_last_dim=static_width,
        options={"emulate_precision_casts": True},
        limit=RECOMPILE_LIMIT,
        disabled=f"capture kernel {name}: torch.compile is disabled in this process (TORCHDYNAMO_DISABLE=1 "
        "or TORCH_COMPILE_DISABLE=1), so capture.kernels=fused/fused2 would run eagerly under a "
        "fused kernel path; unset it, or set capture.kernels=eager",
        past_limit=f"capture kernel {name} (dflash_dist/capture/) met more input shapes/dtypes than its "
        f"{RECOMPILE_LIMIT} compiles: torch.compile would run it eagerly, and the features would no longer "
        "come from the kernel path their shards record; stopped instead. TORCH_LOGS=recompiles shows the "
        "shapes; raise dflash_dist.capture.fused_target.RECOMPILE_LIMIT, or capture with "
        "capture.kernels=eager (kernel path 'fla': a new run, its evaluator on the same setting)",
    )


@functools.cache
def _compiled():
    """(RMSNorm, gated RMSNorm, silu * up), each compiled for its width (compile_kernel's static_width)."""
    return tuple(compile_kernel(f, static_width=True) for f in (_rms_norm, _gated_rms_norm, _silu_mul))


def fuse_target(model: nn.Module, conv: bool = True, layers: bool = False) -> int:
    """Switch a Qwen3.5-family target on CUDA to the fused path (module docstring; conv=False
    leaves the causal conv to transformers: a bench variant); returns the number of modules
    changed. Weights are arguments, so one compiled graph serves every layer. layers=True: also
    the rewritten layer forwards of capture/fused_layers.py (capture.kernels=fused2)."""
    if not any(p.is_cuda for p in model.parameters()):
        raise ValueError("capture.kernels=fused needs the target on CUDA (target.device=cuda): its kernels are Triton")
    rms, gated, silu_mul = _compiled()
    n = 0
    for m in model.modules():
        kind = type(m).__name__
        if kind.endswith("RMSNormGated"):
            m.forward = functools.partial(gated, weight=m.weight, eps=m.variance_epsilon)
        elif kind.endswith("RMSNorm"):
            m.forward = functools.partial(rms, weight=m.weight, eps=m.eps)
        elif kind.endswith("MLP") and hasattr(m, "gate_proj"):
            m.forward = functools.partial(_mlp, m, silu_mul)
        elif kind.endswith("GatedDeltaNet") and conv:
            module = __import__(type(m).__module__, fromlist=["causal_conv1d_fn"])
            if getattr(module, "causal_conv1d_fn", None) is not _fla_conv1d:
                module.causal_conv1d_fn = _fla_conv1d
        else:
            continue
        n += 1
    if layers:
        from dflash_dist.capture.fused_layers import fuse_layers, gpu_kernels

        n += fuse_layers(model, gpu_kernels())
    model.dflash_fused = True
    return n


def apply_capture_kernels(kernels: str, model: nn.Module, kernel_path: str) -> str:
    """`capture.kernels` applied to a loaded target whose GDN layers run `kernel_path` (as
    check_kernel_path found it); returns the kernel path its features then carry. Capture, the
    evaluator and its live workers all call this, so evaluation features come from the same
    kernels as the training shards (non-negotiable 4): an evaluator left on "fla" refuses
    "fla_fused" shards."""
    if kernels == "eager":
        return kernel_path
    if kernel_path != "fla":
        raise ValueError(
            f"capture.kernels={kernels} needs fla's kernels on CUDA; this target runs {kernel_path!r} "
            "(set target.device=cuda with flash-linear-attention and triton installed, or "
            "capture.kernels=eager)"
        )
    fuse_target(model, layers=kernels == "fused2")
    return CAPTURE_KERNEL_PATHS[kernels]  # fused: these kernels; fused2: these plus capture/fused_layers.py


def features_provenance(cfg, ident: TargetIdentity, model: nn.Module, tokenizer) -> tuple[Provenance, str]:
    """The provenance of the features this process makes with `model` (its kernel path checked,
    the target fused as capture.kernels says: capture, the evaluator and the quality bench alike),
    and the path its GDN layers run (what capture_features reports: "fla" under "fla_fused" too)."""
    gdn_path = check_kernel_path(model, cfg.target.allow_torch_gdn_on_cuda)
    prov = provenance_for(ident, model, template_hash(tokenizer, cfg.data.enable_thinking), cfg.capture.feature_dtype)
    return dataclasses.replace(prov, kernel_path=apply_capture_kernels(cfg.capture.kernels, model, gdn_path)), gdn_path


def unfuse_target(model: nn.Module, torch_conv) -> None:
    """Back to the eager modules (bench/parity probes); `torch_conv` is the causal_conv1d_fn to restore."""
    for m in model.modules():
        if "forward" in m.__dict__:
            del m.forward
        if type(m).__name__.endswith("GatedDeltaNet"):
            __import__(type(m).__module__, fromlist=["x"]).causal_conv1d_fn = torch_conv
    model.dflash_fused = False
