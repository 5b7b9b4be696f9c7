"""Capture's compiled elementwise kernels alone, at the Qwen3.5-27B capture shape, in other compile modes.

Issue 24 (capture at 75% of the bf16 bound end to end). The thirteenth lease's capture profile
(bench/results/h100-2026-12-06d/call1/capture.log, one forward of 26897 tokens) has SwiGLU's compiled
silu * up (`triton_poi_fused_mul_silu_0`, fused_target._silu_mul) at 1.41 ms a call, 64 calls, 90.5 ms of 2796:
its 2.8 GB (two bf16 [T, I] reads, one write) then move at ~2.0 TB/s, where liger's SwiGLU kernel in the
trainer's profile moves ~2.8 TB/s. The capture kernels compiled with every dimension dynamic
(fused_target.compile_kernel: one graph for every token count); since 2026-12-07 SwiGLU's has its width static
(static_width: bitwise, 1.104 -> 1.002 ms on an H100). A pointwise kernel sums nothing, so another
tiling or specialisation gives the same bits: if a static-width compile is faster and bitwise, capture can
take it without a new kernel path. The norms (RMSNorm, add + RMSNorm, the gated RMSNorm and attention's q/k
norm + RoPE) are compiled for their widths too since 2026-12-07: their weights are the model's nn.Parameters,
whose shapes torch.compile specialises, so the former dynamic=True compile had their widths static already (the
same graphs, bitwise); the explicit width adds RoPE's cos/sin width in q/k norm + RoPE. Each is timed as
capture compiles it, as the former compile did, and fully static, with Parameter weights as the model's.

Prints, per kernel and variant, ms a call (median of --iters, CUDA events), the bytes it must move over that
time (GB/s), whether its output equals the capture kernel's bit for bit, and whether a call at another token
count compiled a new graph (capture's token count changes from forward to forward):

    python3 bench/bench_capture_kernels.py                      # GPU, the 27B capture shape
    python3 bench/bench_capture_kernels.py --device cpu --tokens 64 --hidden 64 --inter 128 --iters 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_dist.capture import fused_layers  # noqa: E402
from dflash_dist.capture.fused_layers import _add_rms_norm, _norm_rope  # noqa: E402
from dflash_dist.capture.fused_target import _compiled, _gated_rms_norm, _rms_norm, _silu_mul, compile_kernel  # noqa: E402

OPTIONS = {"emulate_precision_casts": True}  # the capture kernels' rounding (fused_target.compile_kernel)


def _static(f):
    """f compiled for one shape (every dimension static), with the capture kernels' rounding."""
    return torch.compile(f, dynamic=False, fullgraph=True, options=OPTIONS)


def _liger_silu_mul():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


def kernels(device: str) -> list[tuple[str, dict]]:
    """(kernel, {variant: callable}); the first variant of each, the capture's own compile (its width static,
    fused_target.compile_kernel(static_width=True)), is the reference the others are compared with."""
    silu = {"capture (width static)": _compiled()[2], "all dims dynamic": compile_kernel(_silu_mul),
            "static": _static(_silu_mul), "eager": _silu_mul}  # fmt: skip
    if device == "cuda" and _liger_silu_mul() is not None:
        silu["liger (other rounding)"] = _liger_silu_mul()
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    k = fused_layers.gpu_kernels()
    norm_rope = functools.partial(_norm_rope, apply_rotary_pos_emb)
    norms = {
        "rms_norm": (_compiled()[0], _rms_norm),
        "add_rms_norm": (k.add_norm, _add_rms_norm),
        "gated_rms_norm": (_compiled()[1], _gated_rms_norm),
        "norm_rope": (functools.partial(k.norm_rope, apply_rotary_pos_emb), norm_rope),
    }
    variants = [(name, {"capture (width static)": now, "former (dynamic=True)": compile_kernel(eager),
                        "static": _static(eager)}) for name, (now, eager) in norms.items()]  # fmt: skip
    return [("silu_mul", silu), *variants]


def inputs(name: str, tokens: int, hidden: int, inter: int, device: str, seed: int = 0):
    """Arguments (a norm's weight an nn.Parameter, as the model's) and the bytes the kernel must move (each input
    read once, each output written once)."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf = {"dtype": torch.bfloat16, "device": device}
    if name == "silu_mul":
        gate, up = (torch.randn(1, tokens, inter, generator=g, **bf) for _ in range(2))
        return (gate, up), 3 * gate.numel() * 2
    if name == "gated_rms_norm":  # the Gated DeltaNet's output norm: [B, T, value heads, head dim]
        heads, d = max(1, hidden * 48 // 5120), 128 if hidden >= 1024 else 8  # 5120 -> 48 x 128, Qwen3.5-27B's
        x, z = (torch.randn(1, tokens, heads, d, generator=g, **bf) for _ in range(2))
        w = nn.Parameter(torch.randn(d, generator=g, **bf), requires_grad=False)
        return (x, z, w, 1e-6), 3 * x.numel() * 2
    if name == "norm_rope":  # attention's q/k norm + partial RoPE: q [B, T, H, d], k [B, T, KV, d], 1/4 rotary
        d = 256 if hidden >= 1024 else 16
        heads, kv = max(1, hidden * 6 // (5 * d)), max(1, hidden // (5 * d))  # 5120 -> 24 and 4 heads of 256
        q, k = torch.randn(1, tokens, heads, d, generator=g, **bf), torch.randn(1, tokens, kv, d, generator=g, **bf)
        wq, wk = (nn.Parameter(torch.randn(d, generator=g, **bf), requires_grad=False) for _ in range(2))
        cos, sin = (torch.randn(1, tokens, d // 4, generator=g, **bf) for _ in range(2))
        return (q, k, wq, wk, 1e-6, cos, sin), 2 * (q.numel() + k.numel()) * 2
    x = torch.randn(1, tokens, hidden, generator=g, **bf)
    w = nn.Parameter((0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16), requires_grad=False)
    if name == "rms_norm":
        return (x, w, 1e-6), 2 * x.numel() * 2
    res = torch.randn(1, tokens, hidden, generator=g, **bf)
    return (res, x, w, 1e-6), 4 * x.numel() * 2


def time_ms(fn, args, iters: int, device: str, before=None) -> float:
    """Median ms a call (after 5 warm calls: the compiles, dynamic shapes' second one included, and autotuning).
    `before()`, untimed, runs ahead of every call (e.g. a fresh copy of an input the call overwrites)."""
    for _ in range(5):
        if before is not None:
            before()
        fn(*args)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _same(a, b) -> tuple[bool, float]:
    """(bitwise equal, max |a - b|) over every output tensor."""
    outs_a = a if isinstance(a, tuple) else (a,)
    outs_b = b if isinstance(b, tuple) else (b,)
    equal = all(torch.equal(x, y) for x, y in zip(outs_a, outs_b, strict=True))
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(outs_a, outs_b, strict=True))
    return equal, diff


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=26897, help="tokens a forward (the capture profile's)")
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--inter", type=int, default=17408, help="the MLP's intermediate size")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", default="silu_mul,rms_norm,add_rms_norm,gated_rms_norm,norm_rope",
                   help="comma list of the kernels to time")
    a = p.parse_args(argv)
    wanted = [k.strip() for k in a.kernels.split(",") if k.strip()]
    rows = []
    print(f"capture kernels alone on {a.device}: {a.tokens} tokens, hidden {a.hidden}, intermediate {a.inter}")
    for name, variants in kernels(a.device):
        if name not in wanted:
            continue
        ref = None
        for label, fn in variants.items():
            # fresh tensors (the same values) for each variant: a width-static compile marks its inputs' dimensions
            args, nbytes = inputs(name, a.tokens, a.hidden, a.inter, a.device)
            out = fn(*args)
            ref = out if ref is None else ref
            equal, diff = _same(out, ref)
            ms = time_ms(fn, args, a.iters, a.device)
            graphs = counters["stats"]["unique_graphs"]
            other, _ = inputs(name, a.tokens - 7, a.hidden, a.inter, a.device, seed=1)  # another token count
            fn(*other)
            recompiled = counters["stats"]["unique_graphs"] > graphs
            rows.append({"kernel": name, "variant": label, "ms": ms, "gb_s": nbytes / ms / 1e6, "bitwise": equal,
                         "max_abs_diff": diff, "recompiled_at_other_tokens": recompiled})
            print(f"  {name:14s} {label:24s} {ms:8.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  "
                  f"{'bitwise' if equal else f'differs (max |d| {diff:.3g})'} vs the capture kernel"
                  f"{', compiled again at another token count' if recompiled else ''}")
    return rows


if __name__ == "__main__":
    main()
