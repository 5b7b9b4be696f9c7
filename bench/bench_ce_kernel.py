"""The head's per-chunk cross-entropy kernel alone at the 27B shape: liger's against
dflash_dist/model/ce_kernel.py's (liger's first pass, the second pass last block first), and the
gradient norm of the 27B drafter's trainable parameters (the one-kernel step's `global_norm` over the
gradient list) in other forms.

Issue 24 (the step at 4.7 samples/s). In the sixteenth session's profile the CE kernel is 4.4 ms a
step (7680 rows x 248320 bf16 logits read twice and written once) and the list norm's
multi-tensor kernels 1.6 ms (3.46 GB of bf16 gradients at ~2.2 TB/s).

Prints ms a call (median over --iters, CUDA events; each CE call on a fresh copy of the GEMM's logits,
timed alone), the bytes moved per ms, and for every CE variant whether its CE, argmax and gradient
equal liger's bit for bit:

    python3 bench/bench_ce_kernel.py                     # GPU, 3840 rows (a 2 GiB balanced chunk)
    python3 bench/bench_ce_kernel.py --rows 2162 --iters 20 --no-norm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_dist.model import ce_kernel  # noqa: E402
from dflash_dist.model.fused import _liger_ce_chunk  # noqa: E402
from dflash_dist.trainer import zero_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture_kernels import time_ms  # noqa: E402
from cost_model import drafter_shapes  # noqa: E402

H = 5120  # the 27B drafter's hidden size
GRAD_SHAPES = (H, 5, 32, 8, 128, 17408)  # cost_model.drafter_shapes: H, layers, heads, kv heads, head_dim, I


def bench_ce(rows: int, vocab: int, iters: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, H, device="cuda", dtype=torch.bfloat16, generator=g) * (H ** -0.5)
    base = h @ w.t()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    del h, w
    buf = torch.empty_like(base)
    ref = _liger_ce_chunk(base.clone(), labels, True)
    moved = 3 * base.numel() * base.element_size()  # two reads, one write
    variants = {
        "liger": lambda: _liger_ce_chunk(buf, labels, True),
        "ours forward order": lambda: ce_kernel.ce_rows(buf, labels, True, reverse=False),
        "ours (second pass reversed)": lambda: ce_kernel.ce_rows(buf, labels, True),
        "ours, 132 programs": lambda: ce_kernel.ce_rows(buf, labels, True, programs=132),
        "ours, 264 programs": lambda: ce_kernel.ce_rows(buf, labels, True, programs=264),
        "ours, 96 programs": lambda: ce_kernel.ce_rows(buf, labels, True, programs=96),
    }
    print(f"CE kernel, {rows} x {vocab} bf16 logits ({base.numel() * 2 / 1e9:.2f} GB), {iters} calls each", flush=True)
    for name, fn in variants.items():
        buf.copy_(base)
        out = fn()
        same = all(torch.equal(a, b) for a, b in zip(out, ref))
        ms = time_ms(fn, (), iters, "cuda", before=lambda: buf.copy_(base))
        print(f"  {name:<30} {ms:7.3f} ms  {moved / ms / 1e6:6.0f} GB/s (3 passes' bytes)  bitwise liger: {same}",
              flush=True)


def _sumsq_norm_fn(tensors: list[torch.Tensor], chunk: int = 2**18, block: int = 4096):
    """A candidate: one Triton launch over every tensor (a table of base pointers; a program sums the
    squares of one `chunk` of one tensor), then the partial sums' sum."""
    import triton
    import triton.language as tl

    @triton.jit
    def sumsq(ptrs, sizes, chunk_tensor, chunk_start, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor + pid)
        base = tl.load(ptrs + t).to(tl.pointer_type(tl.bfloat16))
        n = tl.load(sizes + t)
        start = tl.load(chunk_start + pid)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += x * x
        tl.store(out + pid, tl.sum(acc))

    dev = tensors[0].device
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)
    sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=dev)
    pairs = [(i, s) for i, t in enumerate(tensors) for s in range(0, t.numel(), chunk)]
    ct = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=dev)
    cs = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dev)
    out = torch.empty(len(pairs), dtype=torch.float32, device=dev)

    def run():
        sumsq[(len(pairs),)](ptrs, sizes, ct, cs, out, CHUNK=chunk, BLOCK=block, num_warps=8)
        return out.sum().sqrt()

    return run


def _list_norm_fn(grads: list[torch.Tensor], form: str):
    """zero_step's gradient-list norm (global_norm's sum over _list_norms) in one of zero_step.LIST_NORMS."""

    def run():
        zero_step.set_list_norm(form)
        try:
            return torch.linalg.vector_norm(torch.stack(zero_step._list_norms(grads)))
        finally:
            zero_step.set_list_norm("foreach")

    return run


def bench_norm(iters: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
             for s in drafter_shapes(*GRAD_SHAPES)]  # fmt: skip
    n = sum(t.numel() for t in grads)
    forms = {
        "_foreach_norm + stack (the list norm)": _list_norm_fn(grads, "foreach"),
        "vector_norm per tensor + stack": lambda: torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in grads])),
        "split: vector_norm >= 1M, foreach below": _list_norm_fn(grads, "split"),
        "one Triton launch, 256K-element chunks": _sumsq_norm_fn(grads),
        "one Triton launch, 1M-element chunks": _sumsq_norm_fn(grads, chunk=2**20),
    }
    ref = forms["_foreach_norm + stack (the list norm)"]()
    print(f"gradient norm over {len(grads)} tensors, {n / 1e9:.3f}B bf16 ({2 * n / 1e9:.2f} GB)", flush=True)
    for name, fn in forms.items():
        val = fn()
        ms = time_ms(fn, (), iters, "cuda")
        print(f"  {name:<40} {ms:7.3f} ms  {2 * n / ms / 1e6:6.0f} GB/s  norm {val.item():.9g} "
              f"(rel to the list norm {abs(val.item() - ref.item()) / ref.item():.1e})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3840)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--no-norm", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ce_kernel: needs a CUDA device (the kernels are Triton)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}  {torch.cuda.get_device_name()}", flush=True)
    bench_ce(a.rows, a.vocab, a.iters)
    if not a.no_norm:
        bench_norm(a.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
