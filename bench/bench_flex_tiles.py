"""How much of the work flex_attention's tiles do the training block mask uses (no GPU needed).

The trainer's BlockMask (attention.block_mask_flex, direct build) marks each 128 x 128 (query, key)
tile as skipped, full or partial; the kernels compute every pair of a touched tile. This prints, for
the 27B bench's mask (bench_train_step.py: sorted anchors drawn as the trainer draws them), the
touched tiles, the pairs they hold against the pairs the mask lets through, and per layer the used
attention FLOPs; with --fwd-ms/--bwd-ms (a profile's flex kernel times per layer) the rates they imply.

    python bench/bench_flex_tiles.py                              # seq 3072, 512 anchors, block 16, 32 heads
    python bench/bench_flex_tiles.py --fwd-ms 0.724 --bwd-ms 3.121   # the 2026-12-04 profile's per-layer times
"""

from __future__ import annotations

import argparse

import torch

from dflash_dist.model.attention import FLEX_BLOCK, _block_tables, block_mask_dense
from dflash_dist.model.loss import sample_anchors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--window", type=int, default=None, help="a sliding layer's window (default: a full layer)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=3, help="the anchors' generator (bench_train_step.py uses 3)")
    ap.add_argument("--fwd-ms", type=float, default=None, help="flex forward kernel time per layer")
    ap.add_argument("--bwd-ms", type=float, default=None, help="flex backward kernel time per layer")
    a = ap.parse_args(argv)
    a_ = sample_anchors(torch.ones(1, a.seq), a.anchors, torch.Generator().manual_seed(a.seed))
    partial, full = _block_tables(a_.positions, a_.keep, a.seq, a.block, a.window)
    used = block_mask_dense(a_.positions, a_.keep, a.seq, a.block, a.window)
    ctx_tiles = -(-a.seq // FLEX_BLOCK)
    tile = FLEX_BLOCK * FLEX_BLOCK
    parts = (("all", slice(None), slice(None)), ("context", slice(0, ctx_tiles), slice(0, a.seq)),
             ("own blocks", slice(ctx_tiles, None), slice(a.seq, None)))  # (name, key tiles, keys)
    for name, cols, keys in parts:
        p, f = int(partial[..., cols].sum()), int(full[..., cols].sum())
        pairs = int(used[..., keys].sum())
        computed = (p + f) * tile
        print(f"{name:10s}: tiles partial {p:5d} full {f:5d}; used pairs {pairs / 1e6:7.2f}M of "
              f"{computed / 1e6:7.2f}M computed ({pairs / max(computed, 1):.1%})")
    flops = 4 * a.head_dim * a.heads * int(used.sum())  # QK^T and PV, 2 FLOPs a multiply-add, per head
    print(f"used attention FLOPs per layer: forward {flops / 1e9:.0f} GFLOP, backward {2.5 * flops / 1e9:.0f} GFLOP")
    if a.fwd_ms:
        print(f"forward {a.fwd_ms} ms: {flops / a.fwd_ms / 1e9:.0f} TFLOP/s of used work")
    if a.bwd_ms:
        print(f"backward {a.bwd_ms} ms: {2.5 * flops / a.bwd_ms / 1e9:.0f} TFLOP/s of used work"
              + (f"; at the forward's rate {a.bwd_ms - 2.5 * a.fwd_ms:.2f} ms less a layer" if a.fwd_ms else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
