"""Parts of the capture benchmark (bench_capture.py): kernel time by class of one forward, the
argmax and one features copy alone, the disk's write bandwidth (the writers' physical limit), and what a
failed run reports (its traceback and the GPU's memory)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch

from dflash_dist.model.capture import chunked_argmax


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


KERNEL_CLASSES = (  # first match wins; lower-case substrings of CUDA kernel names
    ("copy/cat", ("memcpy", "catarray", "copy_kernel", "memset")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("conv1d", ("conv", "fprop", "depthwise")),
    (
        "gdn (fla triton)",
        (
            "chunk_",
            "gated_delta",
            "recompute_w_u",
            "solve_tril",
            "merge_16x16",
            "l2norm",
            "kkt",
            "fused_recurrent",
            "cumsum",
        ),
    ),
    ("inductor fused", ("triton_",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "wgmma", "cublas")),
    ("reduce (norms, argmax)", ("reduce", "argmax", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "gather", "embedding")),
)


def classify(name: str) -> str:
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def profile_forward(model, batch, layer_ids: list[int], mask: str, capture) -> dict:
    """Kernel time of one capture forward, by class and the top kernels (torch.profiler); `gaps`: where
    the GPU idled between kernels (profile_gaps.py's report)."""
    from profile_gaps import gap_report, host_ops, idle_gaps, kernel_intervals
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        cap = capture(model, batch, layer_ids, mask)
        del cap
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_class: dict[str, float] = {}
    for e in kernels:
        by_class[classify(e.key)] = by_class.get(classify(e.key), 0.0) + e.self_device_time_total / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]
    return {
        "by_class_ms": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "top": [(e.key[:110], round(e.self_device_time_total / 1e3, 2), e.count) for e in top],
        "gaps": gap_report(idle_gaps(kernel_intervals(prof), ops := host_ops(prof)), steps=1, ops=ops),
    }


def time_parts(model, tokens: int, width: int, device: str) -> dict:
    """Seconds of the chunked argmax over `tokens` hidden states and of one features D2H copy."""
    h = model.config.hidden_size
    hidden = torch.randn(1, tokens, h, device=device, dtype=model.dtype)
    chunked_argmax(hidden, model.get_output_embeddings())
    sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        chunked_argmax(hidden, model.get_output_embeddings())
    sync(device)
    argmax_s = (time.perf_counter() - t0) / 3
    feats = torch.randn(tokens, width, device=device, dtype=model.dtype)
    host = torch.empty(tokens, width, dtype=model.dtype, pin_memory=device.startswith("cuda"))
    host.copy_(feats)
    sync(device)
    t0 = time.perf_counter()
    host.copy_(feats, non_blocking=True)
    sync(device)
    d2h_s = time.perf_counter() - t0
    return {"argmax_s": argmax_s, "d2h_s": d2h_s, "d2h_gb": feats.numel() * feats.element_size() / 1e9}


def disk_write_bandwidth(directory: Path, gib: float = 4.0, block_mib: int = 16) -> float:
    """Bytes/s of writing `gib` GiB of random blocks to a file in `directory`, fsync included
    (what `dd bs=16M conv=fsync` measures): the physical limit of the shard writers."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".bench-disk-{os.getpid()}"
    block = os.urandom(block_mib << 20)
    n = int(gib * 1024 / block_mib)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    path.unlink()
    return n * len(block) / secs


def failure_report() -> str:
    """The traceback of the exception being handled and, on a GPU, its memory: a CUDA error says nothing of where."""
    text = traceback.format_exc()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            free, total = torch.cuda.mem_get_info()
            text += (f"GPU memory: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; this process: "
                     f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
                     f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved, "
                     f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB\n")
        except Exception as err:  # a sticky CUDA error can fail these too
            text += f"GPU memory not readable: {type(err).__name__}: {err}\n"
    return text
