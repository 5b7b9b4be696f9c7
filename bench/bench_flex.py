"""The drafter's compiled flex attention alone at the 27B training shape, one tiling after another in one
process: forward and forward+backward ms (CUDA events over many calls), the rate of used work, and each
tiling's output and q/k/v gradients against torch's own tiling (bitwise or the largest difference).

The train-step bench (bench_train_step.py) times whole steps, whose run-to-run spread (~2.5% on the
H200, docs/BENCHMARKS.md's eighth lease) is larger than a 1 ms change of the flex kernels; this times
only them, so a tiling can be judged before it is timed inside the step.

    python bench/bench_flex.py                                       # every FLEX_PRESETS entry, 27B shape
    python bench/bench_flex.py --presets torch,tma,m32n64 --iters 30
    python bench/bench_flex.py --presets m32n64tma,m32n64tma/kvx    # /kvx: k and v repeated to every q head
    python bench/bench_flex.py --device cpu --seq 256 --anchors 16 --heads 4 --kv-heads 1 --head-dim 32 --iters 2

On the CPU (a smoke run) only the forward is timed: flex_attention has no CPU backward.

The inputs are laid out as the drafter hands them to `attend` (q/k/v [b, heads, T, d] transposed from
[b, T, heads, d]); the mask is the trainer's (sample_anchors, the direct block tables) with seed 3 as
bench_train_step.py. A preset the compiler refuses is reported and the next one runs. A name with `/kvx`
runs that tiling on k and v repeated to the query heads (repeat_interleave before flex, its backward sums each
group's dK/dV): flex's GQA backward keeps a kv-head's whole group in one program, so this asks whether that
grouping is what holds the backward at ~1/3 of the GEMM rate (not bitwise: dK/dV sum the group in another order).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import timed  # noqa: E402
from train_step_settings import FLEX_PRESETS  # noqa: E402

from dflash_dist.model.attention import attend, block_mask_dense, block_mask_flex, set_flex_tuning  # noqa: E402
from dflash_dist.model.loss import sample_anchors  # noqa: E402


def inputs(a, dev):
    """q, k, v (bf16 on CUDA, fp32 on CPU, requiring grad), the block mask, the output gradient and the
    used (query, key) pairs per head."""
    anc = sample_anchors(torch.ones(1, a.seq), a.anchors, torch.Generator().manual_seed(3))
    pos, keep = anc.positions.to(dev), anc.keep.to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    nq, nk = a.anchors * a.block, a.seq + a.anchors * a.block

    def heads(n, h):  # [1, T, h, d] -> [1, h, T, d], as the drafter's transpose
        return torch.randn(1, n, h, a.head_dim, generator=g, device=dev).to(dtype).transpose(1, 2)

    q, k, v = heads(nq, a.heads), heads(nk, a.kv_heads), heads(nk, a.kv_heads)
    grad_out = heads(nq, a.heads)
    mask = block_mask_flex(pos, keep, a.seq, a.block)
    used = int(block_mask_dense(pos.cpu(), keep.cpu(), a.seq, a.block).sum())
    return [t.requires_grad_(dev.type == "cuda") for t in (q, k, v)], mask, grad_out, used


def run_preset(name: str, qkv, mask, grad_out, scale: float, a, cuda: bool) -> dict:
    q, k, v = qkv
    tiles, _, how = name.partition("/")
    set_flex_tuning(FLEX_PRESETS[tiles] if tiles != "autotune" else None, autotune=tiles == "autotune")
    group = q.shape[1] // k.shape[1]

    def call():
        if how == "kvx":
            return attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), mask, scale)
        return attend(q, k, v, mask, scale)

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        out = call()
        if not cuda:  # flex_attention has no CPU backward
            return (out.detach(),)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))

    t0 = time.perf_counter()
    got = fwd_bwd()  # the compiles (forward and backward kernels)
    fwd()
    compile_s = time.perf_counter() - t0
    for _ in range(a.warmup):
        fwd_bwd()
    fwd_ms = timed(fwd, a.iters, cuda)
    both_ms = timed(fwd_bwd, a.iters, cuda)
    # on the CPU fwd_bwd is the forward alone (no CPU backward): no backward time to report
    return {"name": name, "fwd_ms": fwd_ms, "bwd_ms": both_ms - fwd_ms if cuda else None, "fwd_bwd_ms": both_ms,
            "compile_s": compile_s, "out": got}


def compare(got, ref) -> str:
    """'bitwise' or the largest |difference| / max |reference| over out, dq, dk, dv."""
    if all(torch.equal(x, r) for x, r in zip(got, ref)):
        return "bitwise"
    rel = [float((x.float() - r.float()).abs().max() / r.float().abs().max()) for x, r in zip(got, ref)]
    return "max rel diff out/dq/dk/dv " + " ".join(f"{r:.1e}" for r in rel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(FLEX_PRESETS),
                    help=f"comma list of {sorted(FLEX_PRESETS)} or autotune; the first is the reference")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=5, help="flex calls per step, for the per-step figure")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="time the presets this many times, alternating")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.presets.split(",") if n.strip()]
    bad = [n for n in names if n.partition("/")[0] not in (*FLEX_PRESETS, "autotune")
           or n.partition("/")[2] not in ("", "kvx")]
    if bad:
        raise SystemExit(f"--presets: unknown {bad}; expected names of {sorted(FLEX_PRESETS)} or autotune, "
                         "each with /kvx or not")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu with a small shape")
    qkv, mask, grad_out, used = inputs(a, dev)
    flops = 4 * a.head_dim * a.heads * used  # forward; the backward's used work is 2.5x
    print(f"shape: seq {a.seq}  anchors {a.anchors}  block {a.block}  heads {a.heads}/{a.kv_heads}x{a.head_dim}  "
          f"{qkv[0].dtype}  {dev}  used forward {flops / 1e9:.0f} GFLOP a call, x{a.layers} layers a step")
    results, ref = [], None
    try:
        for rnd in range(a.rounds):
            for name in names:
                try:
                    r = run_preset(name, qkv, mask, grad_out, a.head_dim**-0.5, a, cuda)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses: report it, time the rest
                    print(f"{name:10s} round {rnd}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                ref = r["out"] if ref is None else ref
                same = compare(r.pop("out"), ref)
                r["round"], r["vs_first"] = rnd, same
                results.append(r)
                bwd = (f"bwd {r['bwd_ms']:7.3f} ms  ({flops / r['fwd_ms'] / 1e9:4.0f} / "
                       f"{2.5 * flops / r['bwd_ms'] / 1e9:4.0f} TFLOP/s used)") if cuda else "bwd n/a (CPU)"
                print(f"{name:10s} round {rnd}: fwd {r['fwd_ms']:7.3f} ms  {bwd}  "
                      f"x{a.layers}: {a.layers * r['fwd_bwd_ms']:7.2f} ms a step  compile {r['compile_s']:5.1f} s  "
                      f"vs {names[0]}: {same}")
    finally:
        set_flex_tuning()
    for name in names:
        mine = [r["fwd_bwd_ms"] for r in results if r["name"] == name]
        if mine:
            print(f"mean {name:10s} {a.layers * sum(mine) / len(mine):7.2f} ms a step over {len(mine)} rounds")
    if a.json:
        a.json.write_text(json.dumps({"shape": vars(a) | {"json": None}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
