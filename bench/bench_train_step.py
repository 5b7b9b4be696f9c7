"""Throughput and peak memory of one full training step of the drafter inside our DeepSpeed loop:
engine(batch) -> engine.backward -> engine.step (clip, AdamW on the fp32 master weights, LR
schedule), wrapped exactly as the trainer wraps it (trainer/engine.py TrainForward, ds_config.py),
with the chunked loss (our default) and the naive full-logits loss measured in one run.

    python bench/bench_train_step.py                        # the 27B drafter shape, ZeRO-2, batch 1
    python bench/bench_train_step.py --loss chunked --profile 2   # + torch.profiler kernel table
    python bench/bench_train_step.py --loss chunked --kernels torch,liger,compile --mix 24 --no-overflow-check

--kernels times each kernel set (fused.py) on one engine (`drafter.set_kernels` between runs) and
prints each set's loss on the same batch with the same weights next to the torch reference.
--mix N times N samples of a length mix (`length_mix`) twice: right-padded micro-batches (`mix_batches`;
the trainer's BatchLimit with --mix-batch > 1) and packed rows of --seq tokens (`pack_batches`).
--sliding-layers 4 --window 2048 gives the Qwen3.6-27B recipe's layer types. --no-overflow-check
also times the step with DeepSpeed's inf/nan pass off. --host-sync first times the torch set with a
loss read after every forward. --settings times issue 24's switches side by side on the same engine
and batches (SWITCHES), each line with the forward and backward shares of the bf16 bound and the
optimizer ms; --json keeps the figures for bench/cost_model.py. The engine starts with DeepSpeed's
own step; "lean"/"fused" install trainer/zero_step.py's, with DeepSpeed's gradient path ("dsgrads",
the default) or the trainer's cuts ("leangrads"). The words live in train_step_settings.py; "fa*" words
set the compiled flex kernels' tiling (FLEX_PRESETS) or inductor's autotuning of them ("faautotune",
its timing table on stderr). A setting that fails prints FAILED and the next one runs.

    python bench/bench_train_step.py --loss chunked --kernels liger --steps 6 --warmup 2 \
        --settings create+ds,create+ds+noovf,direct+ds+noovf,direct+lean,direct+lean+splitkv --json train.json

One process, world size 1 (NCCL), random bf16 features/ids, loss mask all ones, 512 anchors per
sequence drawn like the trainer draws them. MFU counts SPEC section 6's model FLOPs (drafter layers
on the block tokens, fc + context k/v, attention over the visible keys, 4*H*V per supervised slot
for the frozen lm_head; ~124 TFLOP per sample at the 27B shape) against --peak-tflops (790: the
bf16 matmul rate measured on an H200, SPEC's convention) and the 989 TFLOP/s datasheet peak.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from profile_gaps import gap_report, host_ops, host_stacks, idle_gaps, kernel_intervals, label_syncs, steady
from step_flops import model_flops, row_cut_flops  # noqa: F401 (quality_budget, tests: bts.model_flops)
from train_step_settings import BEFORE, SWITCHES, apply_setting, parse_setting, recover  # noqa: F401 (tests use bts.*)

from data_pipeline.durable_files import write_text_atomic
from dflash_dist.actors.rendezvous import rendezvous_store
from dflash_dist.config import load_config
from dflash_dist.model import loss as loss_mod
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.fused import KERNELS
from dflash_dist.model.loss import Anchors, dflash_loss, sample_anchors, supervised_rows
from dflash_dist.model.vocab_loss import lm_head_cross_entropy
from dflash_dist.trainer.batching import BatchLimit
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from dflash_dist.trainer.engine import TrainForward

DATASHEET_TFLOPS = 989.0


class BenchForward(TrainForward):
    """TrainForward (the chunked loss, as trained) or, with `naive`, the full-logits loss path
    (dflash_loss return_logits=True: lm_head over every block slot, fp32 logits, F.cross_entropy).
    With anchor_starts/anchor_ends: packed rows (each anchor's document bounds, loss.Anchors).
    `rows`: the supervised slots found on the host (as the trainer passes them); with `host_rows` False
    (the bench word "devrows", the trainer before 2026-12-06) they are dropped and the loss finds them on
    the device (a nonzero: a host sync per micro-batch)."""

    naive = False
    host_rows = True

    def forward(
        self, input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep, anchor_starts=None,
        anchor_ends=None, rows=None,
    ):
        rows = rows if self.host_rows else None
        if not self.naive and anchor_starts is None:
            return super().forward(input_ids, features, loss_mask, target_argmax, anchor_positions, anchor_keep,
                                   rows=rows)
        out = dflash_loss(
            self.drafter,
            input_ids,
            features,
            loss_mask,
            Anchors(anchor_positions, anchor_keep, anchor_starts, anchor_ends),
            target_argmax=target_argmax,
            label_source=self.label_source,
            gamma=self.gamma,
            attention=self.attention,
            return_logits=self.naive,
            position_weighting=self.position_weighting,
            block_mask=self.block_mask,
            rows=rows,
        )
        out.logits = out.extras = None  # only the loss leaves the step
        return out.loss, out


def drafter_config(a) -> DrafterConfig:
    sliding = {}
    if a.sliding_layers:  # the Qwen3.6-27B recipe: the first N layers slide, the last is full
        types = ["sliding_attention"] * a.sliding_layers + ["full_attention"] * (a.layers - a.sliding_layers)
        sliding = {"layer_types": tuple(types), "sliding_window": a.window}
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
        **sliding,
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
    module = BenchForward(drafter, cfg.train.label_source, cfg.train.gamma, cfg.train.attention, a.position_weighting)
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


class Batch(tuple):
    """One micro-batch's forward arguments on the device (input_ids, features, loss_mask, target_argmax,
    anchor positions, keep[, starts, ends]) and its supervised slots `rows`, found on the host from the
    host copies, as the trainer finds them (loss.supervised_rows): the forward then reads nothing back."""

    rows: torch.Tensor

    @classmethod
    def of(cls, args, host_ids, host_mask, host_anchors: Anchors, block_size: int) -> Batch:
        out = cls(args)
        out.rows = supervised_rows(host_ids, host_mask, host_anchors, block_size).to(args[0].device)
        return out


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
        args = (ids, feats, mask, ids, anchors.positions.cuda(), anchors.keep.cuda())
        out.append(Batch.of(args, ids.cpu(), mask.cpu(), anchors, dc.block_size))
    return out


def length_mix(n: int, max_len: int, seed: int = 4) -> list[tuple[int, int]]:
    """(length, prompt length) of n chat samples: prompt + response lengths log-normal with
    median 1024 and sigma 0.75 (mean ~1350), clipped to [192, max_len]; the prompt is the first
    30% (loss mask 0), the response the rest (loss mask 1). A stand-in for a fit to chat data:
    most samples are far shorter than the maximum, a tail reaches it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    lens = (math.log(1024) + 0.75 * z).exp().clamp(192, max_len).round().long().tolist()
    return [(s, int(0.3 * s)) for s in lens]


def mix_batches(a, dc: DrafterConfig, lengths, bucket: int):
    """Right-padded micro-batches of the length mix, grouped like the trainer groups them
    (BatchLimit: one sample each with --mix-batch 1, else a token budget of --seq padded tokens); the
    padded length is rounded up to a multiple of `bucket` so flex_attention compiles for few shapes. Anchors per sample
    (sample_anchors on its own loss mask), padded to --anchors per row (keep False).
    Returns [(batch tuple, real tokens, samples)]."""
    limit = BatchLimit(size=1) if a.mix_batch == 1 else BatchLimit(size=a.mix_batch, tokens=a.seq)
    groups, cur = [], []
    for s, p in lengths:
        if cur and not limit.fits([x for x, _ in cur], s):
            groups.append(cur)
            cur = []
        cur.append((s, p))
    if cur:
        groups.append(cur)
    g = torch.Generator(device="cuda").manual_seed(5)
    cpu_g = torch.Generator().manual_seed(6)
    out = []
    for grp in groups:
        b = len(grp)
        s_len = min(a.seq, -(-max(s for s, _ in grp) // bucket) * bucket)
        ids = torch.randint(0, dc.vocab_size, (b, s_len), generator=g, device="cuda")
        feats = torch.randn(b, s_len, dc.num_context_layers * dc.hidden_size, generator=g, device="cuda")
        mask = torch.zeros(b, s_len, dtype=torch.long)
        for i, (s, p) in enumerate(grp):
            mask[i, p:s] = 1
        pos = torch.zeros(b, a.anchors, dtype=torch.long)
        keep = torch.zeros(b, a.anchors, dtype=torch.bool)
        for i in range(b):
            anc = sample_anchors(mask[i : i + 1], a.anchors, cpu_g)
            k = anc.positions.shape[1]
            pos[i, :k], keep[i, :k] = anc.positions[0], anc.keep[0]
        batch = Batch.of((ids, feats.to(torch.bfloat16), mask.cuda(), ids, pos.cuda(), keep.cuda()), ids.cpu(), mask,
                         Anchors(pos, keep), dc.block_size)
        out.append((batch, sum(s for s, _ in grp), b))
    return out


HOST_SYNC = False  # --host-sync: read the loss after every forward, as the former finite-loss assert did


def pack_batches(a, dc: DrafterConfig, lengths, anchor_bucket: int):
    """Packed rows of --seq tokens, first fit: each sample in arrival order joins the first row with
    room (rows stay open over the whole mix: a stand-in for a shuffle buffer of that size);
    each sample's anchors drawn on its own loss mask (up to --anchors), shifted to its offset, with
    its document bounds (loss.Anchors starts/ends: no block sees or is labelled by another
    document). Anchors per row padded to a multiple of `anchor_bucket` (few compiled shapes).
    Positions stay the row's (RoPE is relative: a shift changes no score). Returns
    [(batch tuple of 8, real tokens, samples)]."""
    rows, used = [], []
    for s, p in lengths:
        i = next((i for i, u in enumerate(used) if u + s <= a.seq), len(rows))
        if i == len(rows):
            rows.append([])
            used.append(0)
        rows[i].append((s, p))
        used[i] += s
    g = torch.Generator(device="cuda").manual_seed(5)
    cpu_g = torch.Generator().manual_seed(6)
    out = []
    for row in rows:
        mask = torch.zeros(1, a.seq, dtype=torch.long)
        per, off = [], 0
        for s, p in row:
            doc = torch.zeros(1, s, dtype=torch.long)
            doc[0, p:] = 1
            mask[0, off + p : off + s] = 1
            anc = sample_anchors(doc, a.anchors, cpu_g)
            k = anc.keep[0]
            m = int(k.sum())
            per.append((anc.positions[0][k] + off, torch.full((m,), off), torch.full((m,), off + s)))
            off += s
        pos, starts, ends = (torch.cat([x[i] for x in per]) for i in range(3))
        n = max(anchor_bucket, -(-pos.numel() // anchor_bucket) * anchor_bucket)
        pad = n - pos.numel()
        keep = torch.cat([torch.ones(pos.numel(), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
        pos, starts, ends = (torch.cat([t, torch.zeros(pad, dtype=torch.long)]) for t in (pos, starts, ends))
        ids = torch.randint(0, dc.vocab_size, (1, a.seq), generator=g, device="cuda")
        feats = torch.randn(1, a.seq, dc.num_context_layers * dc.hidden_size, generator=g, device="cuda")
        anchors = tuple(t[None].cuda() for t in (pos, keep, starts, ends))
        host = Anchors(*(t[None] for t in (pos, keep, starts, ends)))
        batch = Batch.of((ids, feats.to(torch.bfloat16), mask.cuda(), ids, *anchors), ids.cpu(), mask, host,
                         dc.block_size)
        out.append((batch, off, len(row)))
    return out


def run_steps(engine, batches, mark: bool = False):
    """(seconds for all steps, [(fwd, bwd, step) ms] per step) with per-phase CUDA events. `mark`: a ~1 us
    marker kernel at each step's start (profile_gaps.steady splits a profile into steps at them)."""
    events = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        if mark:
            torch.cuda._sleep(1)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        loss, out = engine(*b, rows=b.rows)
        if HOST_SYNC:
            float(loss.detach())
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

    with label_syncs(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                      with_stack=bool(path)) as prof:  # fmt: skip
        secs, _ = run_steps(engine, batches, mark=True)
    avgs = prof.key_averages()
    key = "self_device_time_total" if hasattr(avgs[0], "self_device_time_total") else "self_cuda_time_total"
    print(avgs.table(sort_by=key, row_limit=45, max_name_column_width=90))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3 / len(batches)  # ms of kernels per step (streams summed)
    wall = secs * 1e3 / len(batches)
    print(f"profiled: {wall:.1f} ms/step wall, {busy:.1f} ms of kernels per step (GPU idle >= {wall - busy:.1f} ms)")
    ops = host_ops(prof)  # with --trace also the launching ops' Python frames (with_stack slows the host)
    # the gaps from the second step on: the first starts from the queue the profile's synchronize emptied
    window, steps = steady(kernel_intervals(prof))
    if window:
        busy = sum(e - s for s, e, _ in window) / 1e3 / steps  # streams summed, as above
        span = (max(e for _, e, _ in window) - window[0][0]) / 1e3 / steps
        print(f"steady state (steps 2-{steps + 1} of the profile, from the step markers): {span:.1f} ms/step from the "
              f"first kernel to the last, {busy:.1f} ms of kernels")
    print(gap_report(idle_gaps(window, ops), steps=steps, ops=ops, stacks=host_stacks(prof) if path else None))
    if path:
        prof.export_chrome_trace(path)


def report(name, secs, steps, samples, tokens, flops, peak, phases, peak_tflops, phase_flops=None) -> str:
    """One result line; with phase_flops (forward, backward FLOPs of all timed steps) also each
    phase's share of the bf16 bound (its FLOPs at peak_tflops over its measured time)."""
    per_step = secs / steps
    fwd, bwd, stp = (sum(x[i] for x in phases) / len(phases) for i in range(3))
    share = ""
    if phase_flops is not None:
        f_fwd, f_bwd = (f / steps / (peak_tflops * 1e12) * 1e3 for f in phase_flops)  # bound ms per step
        share = f"  bound share fwd {f_fwd / fwd:5.1%} bwd {f_bwd / bwd:5.1%} ({f_fwd + f_bwd:.1f} ms of fwd+bwd)"
    RESULTS.append({"name": name, "ms_per_step": per_step * 1e3, "samples_per_s": samples / secs,
                    "fwd_ms": fwd, "bwd_ms": bwd, "step_ms": stp, "peak_gib": peak})
    return (
        f"{name:22s} {per_step * 1e3:7.1f} ms/step  {samples / secs:5.2f} samples/s  {tokens / secs:8.0f} tokens/s  "
        f"MFU {flops / secs / (peak_tflops * 1e12):5.1%} of {peak_tflops:.0f} "
        f"({flops / secs / (DATASHEET_TFLOPS * 1e12):5.1%} of {DATASHEET_TFLOPS:.0f})  "
        f"peak {peak:6.1f} GiB  [fwd {fwd:.1f} / bwd {bwd:.1f} / step {stp:.1f} ms]{share}"
    )


RESULTS: list[dict] = []  # every report() line, for --json (bench/cost_model.py reads it)


def write_json(a, engine) -> None:
    """--json: every result line so far (a temp name, then renamed: never half-written)."""
    if a.json:
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        write_text_atomic(Path(a.json), json.dumps({"trainable_params": trainable, "batch": a.batch, "seq": a.seq,
                                                    "results": RESULTS}, indent=1))


def timed(engine, warm, timed_batches):
    run_steps(engine, warm)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    secs, phases = run_steps(engine, timed_batches)
    return secs, phases, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1, help="micro-batch (sequences per step)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per loss")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loss (compiles flex_attention)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--loss", default="chunked,naive", help="comma list of chunked, naive (one engine)")
    p.add_argument("--kernels", default="torch", help=f"comma list of kernel sets {KERNELS} (chunked loss)")
    p.add_argument(
        "--position-weighting",
        default="dpace",
        choices=("dpace", "decay"),
        help="slot weights (train.position_weighting; dpace is the default since 2026-12-04; the step times in "
        "docs/BENCHMARKS.md before then are decay's). --settings words decay/dpace switch it per setting, and "
        "twopass times D-PACE's chunked loss as it ran before its single-pass form",
    )
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
    p.add_argument("--sliding-layers", type=int, default=0, help="first N layers sliding-window (recipe: 4)")
    p.add_argument("--window", type=int, default=2048, help="sliding window (tokens)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (SPEC 6: 790 measured)")
    p.add_argument("--foreach-adamw", action="store_true", help="torch's foreach AdamW instead of the fused default")
    p.add_argument("--no-overflow-check", action="store_true", help="also time with DeepSpeed's inf/nan pass off")
    p.add_argument("--host-sync", action="store_true", help="first time torch kernels with a loss read per forward")
    p.add_argument("--mix", type=int, default=0, help="also time N samples of the realistic length mix")
    p.add_argument("--mix-bucket", type=int, default=1024, help="padded lengths rounded up to this multiple")
    p.add_argument("--mix-batch", type=int, default=1, help="1: a sample per micro-batch; else a token budget of --seq")
    p.add_argument("--mix-kernels", default=None, help="kernel sets for the mix (default: the last of --kernels)")
    p.add_argument(
        "--settings", default="",
        help="after the kernel runs, time each '+'-joined setting on the same engine (last kernel set), e.g. "
        "'create+ds,create+ds+noovf,direct+ds+noovf,direct+lean,direct+lean+splitkv'; words: " + ",".join(SWITCHES),
    )
    p.add_argument("--json", default=None, help="write every result line's figures here (for bench/cost_model.py)")
    p.add_argument("--profile", type=int, default=0, help="profile N chunked steps after timing")
    p.add_argument("--trace", default=None, help="chrome trace path for --profile (with Python stacks)")
    a = p.parse_args()
    losses = [s.strip() for s in a.loss.split(",") if s.strip()]
    kernel_sets = [s.strip() for s in a.kernels.split(",") if s.strip()]
    if not set(losses) <= {"chunked", "naive"}:
        raise SystemExit(f"--loss: expected chunked and/or naive, got {a.loss}")
    if not set(kernel_sets) <= set(KERNELS):
        raise SystemExit(f"--kernels: expected some of {KERNELS}, got {a.kernels}")
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
    # the store on 127.0.0.1 only (env:// would listen on every interface): actors/rendezvous.py
    store = rendezvous_store(dict(os.environ), datetime.timedelta(minutes=10))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))

    dc = drafter_config(a)
    cfg, engine = build(a, dc)
    drafter = engine.module.drafter
    n_train = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    batches = make_batches(a, dc, a.warmup + a.steps)
    ids, _, mask = batches[0][:3]
    flops = sum(
        model_flops(dc, a.seq, ids.cpu(), mask.cpu(), Anchors(b[4].cpu(), b[5].cpu())) for b in batches[a.warmup :]
    )
    split = [model_flops(dc, a.seq, ids.cpu(), mask.cpu(), Anchors(b[4].cpu(), b[5].cpu()), phases=True)
             for b in batches[a.warmup :]]
    phase_flops = (sum(f for f, _ in split), sum(b for _, b in split))
    print(f"torch {torch.__version__}  {torch.cuda.get_device_name()}  deepspeed {__import__('deepspeed').__version__}")
    print(
        f"shape: H {dc.hidden_size}  layers {dc.num_hidden_layers}  heads {dc.num_attention_heads}/"
        f"{dc.num_key_value_heads}x{dc.head_dim}  I {dc.intermediate_size}  V {dc.vocab_size}  B {dc.block_size}"
        f"  seq {a.seq}  anchors {a.anchors}  batch {a.batch}  ZeRO-{a.zero_stage}  bf16 flex_attention"
        f"  trainable {n_train / 1e9:.3f}B  optimizer {type(engine.optimizer).__name__}"
        f"{' foreach AdamW' if a.foreach_adamw else ' fused AdamW'}  layer types {list(dc.layer_types)}"
        f"{f' window {dc.sliding_window}' if dc.has_sliding_layers else ''}"
    )
    print(f"model FLOPs per sample (SPEC 6): {flops / a.steps / a.batch / 1e12:.1f} TFLOP", flush=True)
    cut = sum(row_cut_flops(dc, ids.cpu(), mask.cpu(), Anchors(b[4].cpu(), b[5].cpu())) for b in batches[a.warmup :])
    print(f"of which the row cuts (dedup0, lastrows) skip {cut / a.steps / a.batch / 1e12:.2f} TFLOP "
          f"({cut / flops:.1%}): with them on, MFU and the bound shares count that work as done", flush=True)

    # the loss of each kernel set on one batch with the same weights (forward only, no step)
    ref = None
    for k in kernel_sets:
        drafter.set_kernels(k)
        with torch.no_grad():
            loss = float(engine.module(*batches[0], rows=batches[0].rows)[0])
        ref = loss if ref is None else ref
        print(f"loss on batch 0, kernels {k:8s}: {loss:.6f}  (vs {kernel_sets[0]}: {loss - ref:+.2e})", flush=True)

    results = {}
    global HOST_SYNC
    runs = [("naive", "torch")] if "naive" in losses else []
    runs += [("chunked+sync", "torch")] if a.host_sync else []
    runs += [("chunked", k) for k in kernel_sets] if "chunked" in losses else []
    for loss_name, k in runs:
        engine.module.naive = loss_name == "naive"
        HOST_SYNC = loss_name == "chunked+sync"
        drafter.set_kernels(k)
        secs, phases, peak = timed(engine, batches[: a.warmup], batches[a.warmup :])
        name = f"{loss_name}/{k}"
        results[name] = a.steps * a.batch / secs
        n = a.steps * a.batch
        print(report(name, secs, a.steps, n, n * a.seq, flops, peak, phases, a.peak_tflops, phase_flops), flush=True)
    engine.module.naive = False
    if a.no_overflow_check:  # DeepSpeed reads this flag at every step (bf16 config check_grad_overflow)
        engine.optimizer.check_grad_overflow = False
        secs, phases, peak = timed(engine, batches[:1], batches[a.warmup :])
        n = a.steps * a.batch
        name = f"chunked/{kernel_sets[-1]} no-ovf"
        results[name] = n / secs
        print(report(name, secs, a.steps, n, n * a.seq, flops, peak, phases, a.peak_tflops), flush=True)
    for text in [x for x in a.settings.split(",") if x]:
        apply_setting(engine, parse_setting(text))
        try:  # a setting that fails (a tiling this torch refuses, out of memory) costs only its own line
            secs, phases, peak = timed(engine, batches[: a.warmup], batches[a.warmup :])
        except Exception as e:  # noqa: BLE001 - inductor's InductorError, triton's, DeepSpeed's: the line says which
            print(f"{kernel_sets[-1]} {text}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            recover(engine)  # the interrupted step's gradients and ZeRO's reduce bookkeeping
            continue
        n = a.steps * a.batch
        name = f"{kernel_sets[-1]} {text}"
        results[name] = n / secs
        print(report(name, secs, a.steps, n, n * a.seq, flops, peak, phases, a.peak_tflops, phase_flops), flush=True)
        write_json(a, engine)  # after each setting: a call cut by its time limit keeps the lines so far
    last = "create+ds"  # what --mix and --profile run under: the engine as built, or the last setting
    if a.settings:  # the slot weighting and the loss path back to the command line's for --mix and --profile
        engine.module.position_weighting = a.position_weighting
        loss_mod.lm_head_cross_entropy = lm_head_cross_entropy
        words = [x for x in a.settings.split(",") if x][-1].split("+")
        last = "+".join(w for w in words if SWITCHES[w][0] not in ("weighting", "passes"))
    if a.mix or a.profile:
        print(f"--mix / --profile run under the setting {last}, position weighting {a.position_weighting}")
    if len(results) > 1:
        base = next(iter(results.values()))
        print("samples/s vs the first run: " + ", ".join(f"{k} {v / base:.3f}" for k, v in results.items()))

    if a.mix:
        lengths = length_mix(a.mix, a.seq)
        real = sum(s for s, _ in lengths)
        print(
            f"length mix: {a.mix} samples, lengths median {sorted(s for s, _ in lengths)[a.mix // 2]} mean "
            f"{real / a.mix:.0f} min {min(s for s, _ in lengths)} max {max(s for s, _ in lengths)} "
            "(log-normal, median 1024, sigma 0.75, clipped to [192, seq]; first 30% prompt, loss mask 0)"
        )
        modes = {
            "padded": mix_batches(a, dc, lengths, a.mix_bucket),
            "packed": pack_batches(a, dc, lengths, a.anchors),
        }
        for mode, mixed in modes.items():
            padded = sum(b[0].numel() for b, _, _ in mixed)
            mix_flops = sum(
                model_flops(dc, b[0].shape[1], b[0].cpu(), b[2].cpu(), Anchors(*(t.cpu() for t in b[4:])), real_tok)
                for b, real_tok, _ in mixed
            )
            print(
                f"{mode}: {len(mixed)} micro-batches ({'rows of' if mode == 'packed' else 'token budget'} {a.seq}"
                f"{f', --mix-batch {a.mix_batch}, bucket {a.mix_bucket}' if mode == 'padded' else ''}), padding "
                f"{1 - real / padded:.1%}, "
                f"model FLOPs per sample {mix_flops / a.mix / 1e12:.1f} TFLOP"
            )
            for k in [s.strip() for s in (a.mix_kernels or kernel_sets[-1]).split(",")]:
                drafter.set_kernels(k)
                shapes = {}
                for b, _, _ in mixed:  # one warm-up step per shape (flex_attention compiles per shape)
                    shapes.setdefault((tuple(b[0].shape), tuple(b[4].shape)), b)
                secs, phases, peak = timed(engine, list(shapes.values()), [b for b, _, _ in mixed])
                print(report(f"mix {mode}/{k}", secs, len(mixed), a.mix, real, mix_flops, peak, phases, a.peak_tflops))
    if a.profile:
        profile(engine, batches[: a.profile], a.trace)
    write_json(a, engine)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
