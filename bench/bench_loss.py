"""Time and peak memory of one forward+backward of the loss through the frozen lm_head: the
chunked loss (dflash_dist/model/vocab_loss.py) next to the naive full-logits loss, in one run.

    python bench/bench_loss.py                      # the 27B shape on CUDA, bf16
    python bench/bench_loss.py --device cpu --hidden 256 --vocab 8192 --slots 512 --dtype float32
    python bench/bench_loss.py --kernels torch,liger,compile   # the per-chunk CE kernels (fused.py)

Prints numbers only. Peak memory is above the inputs (hidden, weight, labels, row weights); on CPU
it is not measured. TFLOP/s counts 4*H*V per slot (logits + dL/dh; SPEC 6).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflash_dist.model.vocab_loss import default_chunk_rows, lm_head_cross_entropy


def naive_loss(hidden, weight, labels, row_weights):
    logits = F.linear(hidden, weight).float()
    return (row_weights * F.cross_entropy(logits, labels, reduction="none")).sum()


def chunked_loss(hidden, weight, labels, row_weights, chunk_rows, kernels="torch"):
    return lm_head_cross_entropy(hidden, weight, labels, row_weights, chunk_rows, kernels)[0]


def measure(fn, hidden, iters: int, warmup: int) -> tuple[float, float | None]:
    """(seconds per forward+backward, peak bytes above what was allocated before)."""
    cuda = hidden.is_cuda

    def step():
        hidden.grad = None
        fn().backward()

    for _ in range(warmup):
        step()
    hidden.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters, torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--slots", type=int, default=7680, help="supervised slots (rows with weight)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk-rows", type=int, default=None, help="default: 1 GiB of logits (fp32 torch, bf16 fused)")
    p.add_argument("--kernels", default="torch", help="comma list of chunked CE kernels: torch, liger, compile")
    p.add_argument("--no-naive", action="store_true", help="skip the full-logits reference")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu with small --hidden/--vocab/--slots")

    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(a.slots, a.hidden, device=dev, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * a.hidden**-0.5).to(dtype)
    labels = torch.randint(0, a.vocab, (a.slots,), device=dev, generator=g)
    row_weights = torch.rand(a.slots, device=dev, generator=g) / a.slots
    chunk = a.chunk_rows or default_chunk_rows(a.vocab)
    kernel_list = [k.strip() for k in a.kernels.split(",") if k.strip()]

    print(f"shape: slots {a.slots}  hidden {a.hidden}  vocab {a.vocab}  {a.dtype}  {dev}  chunk_rows {chunk}")
    full, one = a.slots * a.vocab * 4 / 2**30, min(chunk, a.slots) * a.vocab * 4 / 2**20
    print(f"fp32 logits: all slots {full:.2f} GiB, one chunk {one:.0f} MiB")
    flops = 4 * a.hidden * a.vocab * a.slots
    runs = {} if a.no_naive else {"naive": lambda: naive_loss(hidden, weight, labels, row_weights)}
    for k in kernel_list:
        name = "chunked" if k == "torch" else f"chunked-{k}"
        runs[name] = lambda k=k: chunked_loss(hidden, weight, labels, row_weights, a.chunk_rows, k)
    grads = {}
    for name, fn in runs.items():
        try:
            secs, peak = measure(fn, hidden, a.iters, a.warmup)
        except torch.OutOfMemoryError:
            print(f"{name:8s} out of memory")
            continue
        grads[name] = hidden.grad.float()
        mem = f"{peak / 2**30:8.2f} GiB" if peak is not None else "       n/a"
        print(f"{name:15s} {secs * 1e3:9.2f} ms/fwd+bwd  peak {mem}  {flops / secs / 1e12:8.3g} TFLOP/s")
    ref = "naive" if "naive" in grads else next(iter(grads), None)
    for name, g in grads.items():
        if name != ref:
            rel = (g - grads[ref]).norm() / grads[ref].norm()
            print(f"dL/dh relative difference {name} vs {ref}: {rel.item():.2e}")


if __name__ == "__main__":
    main()
