"""Time and peak memory of one forward+backward of the loss through the frozen lm_head: the
chunked loss (dflash_dist/model/vocab_loss.py) next to the naive full-logits loss, in one run.

    python bench/bench_loss.py                      # the 27B shape on CUDA, bf16
    python bench/bench_loss.py --device cpu --hidden 256 --vocab 8192 --slots 512 --dtype float32
    python bench/bench_loss.py --kernels torch,liger,compile   # the per-chunk CE kernels (fused.py)
    python bench/bench_loss.py --kernels liger --no-naive --chunk-rows 2162,2560,3840,7680 --split greedy,balanced

Prints numbers only. Peak memory is above the inputs (hidden, weight, labels, row weights); on CPU
it is not measured. TFLOP/s counts 4*H*V per slot (logits + dL/dh; SPEC 6).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflash_dist.model import vocab_loss
from dflash_dist.model.fused import ce_logits_bytes
from dflash_dist.model.vocab_loss import CHUNK_SPLITS, chunk_bounds, default_chunk_rows, lm_head_cross_entropy


def naive_loss(hidden, weight, labels, row_weights):
    logits = F.linear(hidden, weight).float()
    return (row_weights * F.cross_entropy(logits, labels, reduction="none")).sum()


def chunked_loss(hidden, weight, labels, row_weights, chunk_rows, kernels="torch"):
    return lm_head_cross_entropy(hidden, weight, labels, row_weights, chunk_rows, kernels)[0]


def _with_split(split: str, fn, *args):
    """fn(*args) with vocab_loss.CHUNK_SPLIT set to `split` for the call."""
    before, vocab_loss.CHUNK_SPLIT = vocab_loss.CHUNK_SPLIT, split
    try:
        return fn(*args)
    finally:
        vocab_loss.CHUNK_SPLIT = before


def timed(fn, iters: int, cuda: bool) -> float:
    """ms per call of fn over `iters` calls (after the caller's warm-up): CUDA events on a device,
    the host clock on the CPU. Also bench_flex.py's timer."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


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
    secs = timed(step, iters, cuda) / 1e3
    return secs, (torch.cuda.max_memory_allocated() - base) if cuda else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--slots", type=int, default=7680, help="supervised slots (rows with weight)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk-rows", default=None,
                   help="comma list of rows a chunk (default: 1 GiB of logits: fp32 torch, bf16 fused)")
    p.add_argument("--split", default=vocab_loss.CHUNK_SPLIT, help=f"comma list of {CHUNK_SPLITS}")
    p.add_argument("--kernels", default="torch", help="comma list of chunked CE kernels: torch, liger, compile")
    p.add_argument("--no-naive", action="store_true", help="skip the full-logits reference")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="time every run this many times, alternating")
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu with small --hidden/--vocab/--slots")

    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(a.slots, a.hidden, device=dev, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * a.hidden**-0.5).to(dtype)
    labels = torch.randint(0, a.vocab, (a.slots,), device=dev, generator=g)
    row_weights = torch.rand(a.slots, device=dev, generator=g) / a.slots
    kernel_list = [k.strip() for k in a.kernels.split(",") if k.strip()]
    chunks = [int(c) for c in a.chunk_rows.split(",")] if a.chunk_rows else [None]
    splits = [x.strip() for x in a.split.split(",") if x.strip()]
    bad = [x for x in splits if x not in CHUNK_SPLITS]
    if bad:
        raise SystemExit(f"--split: unknown {bad}; expected {CHUNK_SPLITS}")

    print(f"shape: slots {a.slots}  hidden {a.hidden}  vocab {a.vocab}  {a.dtype}  {dev}")
    print(f"fp32 logits: all slots {a.slots * a.vocab * 4 / 2**30:.2f} GiB")
    flops = 4 * a.hidden * a.vocab * a.slots
    runs = {} if a.no_naive else {"naive": lambda: naive_loss(hidden, weight, labels, row_weights)}
    for k in kernel_list:
        for rows in chunks:
            for split in splits:
                cut = chunk_bounds(a.slots, rows or default_chunk_rows(a.vocab, logit_bytes=ce_logits_bytes(k)), split)
                sizes = "+".join(str(hi - lo) for lo, hi in cut)
                name = ("chunked" if k == "torch" else f"chunked-{k}") + f" {split} {sizes}"
                runs[name] = lambda k=k, rows=rows, split=split: _with_split(
                    split, chunked_loss, hidden, weight, labels, row_weights, rows, k)
    grads, times = {}, {}
    for rnd in range(a.rounds):  # alternating, so a drift of the card's clock hits every cut alike
        for name, fn in runs.items():
            try:
                secs, peak = measure(fn, hidden, a.iters, a.warmup)
            except torch.OutOfMemoryError:
                print(f"{name:8s} out of memory")
                continue
            grads[name] = hidden.grad.float()
            times.setdefault(name, []).append(secs)
            mem = f"{peak / 2**30:8.2f} GiB" if peak is not None else "       n/a"
            print(f"{name:40s} {secs * 1e3:9.2f} ms/fwd+bwd  peak {mem}  {flops / secs / 1e12:8.3g} TFLOP/s  "
                  f"round {rnd}")
    for name, t in times.items():
        print(f"mean {name:40s} {sum(t) * 1e3 / len(t):9.2f} ms over {len(t)} rounds")
    ref = "naive" if "naive" in grads else next(iter(grads), None)
    for name, g in grads.items():
        if name != ref:
            rel = (g - grads[ref]).norm() / grads[ref].norm()
            print(f"dL/dh relative difference {name} vs {ref}: {rel.item():.2e}")


if __name__ == "__main__":
    main()
