"""Throughput and peak memory of one full training step of the drafter inside our DeepSpeed loop:
engine(batch) -> engine.backward -> engine.step (clip, AdamW on the fp32 master weights, LR
schedule), wrapped exactly as the trainer wraps it (trainer/loop.py TrainForward, ds_config.py),
with the chunked loss (our default) and the naive full-logits loss measured in one run.

    python bench/bench_train_step.py                        # the 27B drafter shape, ZeRO-2, batch 1
    python bench/bench_train_step.py --zero-stage 1 --batch 2 --steps 10
    python bench/bench_train_step.py --loss chunked --profile 2   # + torch.profiler kernel table

One process, world size 1 (NCCL), random bf16 features/ids, loss mask all ones, 512 anchors per
sequence drawn like the trainer draws them. MFU counts SPEC section 6's model FLOPs (drafter layers
on the block tokens, fc + context k/v, attention over the visible keys, 4*H*V per supervised slot
for the frozen lm_head; ~124 TFLOP per sample at the 27B shape) against --peak-tflops (790: the
bf16 matmul rate measured on an H200, SPEC's convention) and the 989 TFLOP/s datasheet peak.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from dflash_dist.config import load_config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.loss import Anchors, dflash_loss, label_targets, sample_anchors
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from dflash_dist.trainer.loop import TrainForward

DATASHEET_TFLOPS = 989.0


class BenchForward(TrainForward):
    """TrainForward (the chunked loss, as trained) or, with `naive`, the full-logits loss path
    (dflash_loss return_logits=True: lm_head over every block slot, fp32 logits, F.cross_entropy)."""

    naive = False

    def forward(self, input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep):
        if not self.naive:
            return super().forward(input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep)
        out = dflash_loss(
            self.drafter,
            input_ids,
            features,
            loss_mask,
            Anchors(anchor_positions, anchor_keep),
            target_argmax=target_argmax,
            label_source=self.label_source,
            gamma=self.gamma,
            attention=self.attention,
            return_logits=True,
        )
        out.logits = out.extras = None  # only the loss leaves the step
        return out.loss, out


def model_flops(dc: DrafterConfig, seq_len: int, input_ids, loss_mask, anchors: Anchors) -> float:
    """SPEC 6 cost model for one micro-batch (all rows), from the anchors actually drawn."""
    h, L, blk, d = dc.hidden_size, dc.num_hidden_layers, dc.block_size, dc.head_dim
    nq, nkv = dc.num_attention_heads, dc.num_key_value_heads
    kv_params = 2 * h * nkv * d
    layer_params = 2 * h * nq * d + kv_params + 3 * h * dc.intermediate_size
    keep = anchors.keep
    block_tokens = int(keep.sum()) * blk
    rows = input_ids.shape[0]
    layers = 6 * layer_params * block_tokens * L
    context = 6 * (dc.num_context_layers * h * h + L * kv_params) * seq_len * rows
    # each query of block j sees the context keys < a_j and the block's B keys
    pairs = float(((anchors.positions + blk) * keep).sum()) * blk
    attention = 3 * 4 * nq * d * pairs * L
    _, binary = label_targets(input_ids, loss_mask, anchors, blk)
    head = 4 * h * dc.vocab_size * float(binary.sum())
    return layers + context + attention + head


def drafter_config(a) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate,
        vocab_size=a.vocab,
        target_layer_ids=(1, 16, 31, 46, 61),
        num_target_layers=64,
        block_size=a.block,
        mask_token_id=a.vocab - 250,
    )


def build(a, dc: DrafterConfig):
    """ds_config + build_optimizer + build_lr_schedule + deepspeed.initialize, as
    loop.build_engine does, but with random target embedding/lm_head and the drafter built on the
    GPU (the trainer reads the target's safetensors and builds on CPU; same engine after that)."""
    import deepspeed

    cfg = load_config(
        None,
        [
            "target.kind=tiny_stdlib",
            f"train.zero_stage={a.zero_stage}",
            f"train.micro_batch_size={a.batch}",
            "train.attention=flex",
            "train.gpus_per_rank=1",
            "train.max_steps=100000",
            f"train.num_anchors={a.anchors}",
        ],
    )
    torch.manual_seed(cfg.run.seed)
    with torch.device("cuda"):
        drafter = DFlashDrafter(dc)
        g = torch.Generator(device="cuda").manual_seed(1)
        embed = torch.randn(dc.vocab_size, dc.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        head = torch.randn(dc.vocab_size, dc.hidden_size, generator=g, device="cuda") * dc.hidden_size**-0.5
        drafter.set_target_weights(embed, head.to(torch.bfloat16))
        del embed, head
    module = BenchForward(drafter, cfg.train.label_source, cfg.train.gamma, cfg.train.attention)
    optimizer = build_optimizer(cfg, module, fused=not a.foreach_adamw)  # the trainer's GPU default: fused
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=build_lr_schedule(cfg, optimizer, cfg.train.max_steps),  # LR value: no effect on time
        config=deepspeed_config(cfg, 1, True, hidden_size=dc.hidden_size),
        dist_init_required=False,
    )
    torch.cuda.empty_cache()
    return cfg, engine


def make_batches(a, dc: DrafterConfig, n: int):
    """n micro-batches: (input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, dc.vocab_size, (a.batch, a.seq), generator=g, device="cuda")
    feats = torch.randn(a.batch, a.seq, dc.num_context_layers * dc.hidden_size, generator=g, device="cuda")
    feats = feats.to(torch.bfloat16)
    mask = torch.ones(a.batch, a.seq, dtype=torch.long, device="cuda")
    cpu_g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        anchors = sample_anchors(mask.cpu(), a.anchors, cpu_g)  # as batching.py: on the host, per sample
        out.append((ids, feats, mask, ids, anchors.positions.cuda(), anchors.keep.cuda()))
    return out


def run_steps(engine, batches):
    """(seconds for all steps, [(fwd, bwd, step) ms] per step) with per-phase CUDA events."""
    events = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        loss, out = engine(*b)
        ev[1].record()
        engine.backward(loss)
        ev[2].record()
        engine.step()
        ev[3].record()
        events.append(ev)
        del loss, out
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    phases = [tuple(e[i].elapsed_time(e[i + 1]) for i in range(3)) for e in events]
    return secs, phases


def profile(engine, batches, path: str | None) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(path)) as prof:
        run_steps(engine, batches)
    avgs = prof.key_averages()
    key = "self_device_time_total" if hasattr(avgs[0], "self_device_time_total") else "self_cuda_time_total"
    print(avgs.table(sort_by=key, row_limit=45, max_name_column_width=90))
    if path:
        prof.export_chrome_trace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1, help="micro-batch (sequences per step)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per loss")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loss (compiles flex_attention)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--loss", default="chunked,naive", help="comma list of chunked, naive (one engine)")
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=17408)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (SPEC 6: 790 measured)")
    p.add_argument("--foreach-adamw", action="store_true", help="torch's foreach AdamW instead of the fused default")
    p.add_argument("--profile", type=int, default=0, help="profile N chunked steps after timing")
    p.add_argument("--trace", default=None, help="chrome trace path for --profile (with Python stacks)")
    a = p.parse_args()
    losses = [s.strip() for s in a.loss.split(",") if s.strip()]
    if not set(losses) <= {"chunked", "naive"}:
        raise SystemExit(f"--loss: expected chunked and/or naive, got {a.loss}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")

    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))

    dc = drafter_config(a)
    cfg, engine = build(a, dc)
    n_train = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    batches = make_batches(a, dc, a.warmup + a.steps)
    ids, _, mask = batches[0][:3]
    flops = (
        sum(model_flops(dc, a.seq, ids.cpu(), mask.cpu(), Anchors(b[4].cpu(), b[5].cpu())) for b in batches[a.warmup :])
        / a.steps
    )
    print(f"torch {torch.__version__}  {torch.cuda.get_device_name()}  deepspeed {__import__('deepspeed').__version__}")
    print(
        f"shape: H {dc.hidden_size}  layers {dc.num_hidden_layers}  heads {dc.num_attention_heads}/"
        f"{dc.num_key_value_heads}x{dc.head_dim}  I {dc.intermediate_size}  V {dc.vocab_size}  B {dc.block_size}"
        f"  seq {a.seq}  anchors {a.anchors}  batch {a.batch}  ZeRO-{a.zero_stage}  bf16 flex_attention"
        f"  trainable {n_train / 1e9:.3f}B  optimizer {type(engine.optimizer).__name__}"
        f"{' foreach AdamW' if a.foreach_adamw else ' fused AdamW'}"
    )
    print(f"model FLOPs per sample (SPEC 6): {flops / a.batch / 1e12:.1f} TFLOP")

    results = {}
    for name in losses:
        engine.module.naive = name == "naive"
        run_steps(engine, batches[: a.warmup])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        secs, phases = run_steps(engine, batches[a.warmup :])
        per_step = secs / a.steps
        samples = a.batch / per_step
        peak = torch.cuda.max_memory_allocated() / 2**30
        fwd, bwd, stp = (sum(x[i] for x in phases) / len(phases) for i in range(3))
        results[name] = samples
        print(
            f"{name:8s} {per_step * 1e3:7.1f} ms/step  {samples:5.2f} samples/s  {samples * a.seq:8.0f} tokens/s  "
            f"MFU {flops / per_step / (a.peak_tflops * 1e12):5.1%} of {a.peak_tflops:.0f} "
            f"({flops / per_step / (DATASHEET_TFLOPS * 1e12):5.1%} of {DATASHEET_TFLOPS:.0f})  "
            f"peak {peak:6.1f} GiB  [fwd {fwd:.1f} / bwd {bwd:.1f} / step {stp:.1f} ms]"
        )
    if len(results) == 2:
        print(f"chunked / naive samples/s: {results['chunked'] / results['naive']:.3f}")
    if a.profile:
        engine.module.naive = False
        profile(engine, batches[: a.profile], a.trace)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
