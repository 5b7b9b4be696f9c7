"""Capture throughput of a Qwen3.5-27B-shaped target with random bf16 weights, through our capture
path (capture_features: hooks on the k layers our config picks, chunked lm_head argmax) and our
ShardWriter on local disk.

    python bench/bench_capture.py                       # 32k-token forwards, eager, end to end
    python bench/bench_capture.py --variants 32768:keep:eager,65536:keep:fused --profile 32768:keep:fused
    python bench/bench_capture.py --tiny --device cpu --batches 1 --min-len 32 --max-len 64 \
        --variants 128:keep:eager --e2e 128:keep:eager  # smoke run of the same code

Sequences of random length in [--min-len, --max-len] (random token ids) are sorted by length and
grouped into right-padded batches of at most BUDGET padded tokens (--pool 256 sorts as many
sequences together as capture_job's sort window does). A variant is BUDGET:MASK:MODE (MASK: see
capture(); MODE: eager, fused = fuse_elementwise, fusedconv = that plus fla's causal conv =
capture.kernels fused, fused2 = that plus capture/fused_layers.py = capture.kernels fused2).
"compute" times the capture alone, each batch set twice: cold (first
sight of the shapes: autotuning, cuDNN plans) and warm (reported). "end to end" also copies each
sequence's features and argmax to host buffers on a side stream and writes shards from --writers
threads or processes while the GPU runs on (capture_sink.py; finished shards are deleted unless
--keep-shards, so the disk stays bounded). The bf16 bound is 2 x params x tokens / 790e12 with
params = all weights (26.9B here, as SPEC 6's anchor counts them); the share without the input
embedding (25.6B) is printed too. Tokens are real (unpadded) tokens.

The `job` sink is capture_job's own path (CaptureJob.capture_passes, --writers writer processes);
`job:kernel` and `job:idle` run it with capture.writeback_idle false / true, side by side. Its line
also gives the drain: the seconds from the last pass's compute and copies to the last shard listed.
--e2e-batches 50 --e2e-distinct 10 runs 50 passes cycling through 10 distinct batches (warmed
once; their first-sight figure is printed), and finished shards are deleted as they land
(ShardJanitor) so ~75 GB of shards fit a 64 GB disk:

    python bench/bench_capture.py --variants 32768:keep:fusedconv,32768:keep:fused2 --pool 256 --batches 2 \
        --e2e 32768:keep:fused2 --sinks job --writers 4 --e2e-batches 50 --e2e-distinct 10 --disk-gib 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from data_pipeline.provenance import CAPTURE_KERNEL_PATHS, SHARD_SCHEMA_VERSION, Provenance, installed_versions
from dflash_dist.capture.fused_layers import set_copy_cuts
from dflash_dist.capture.fused_target import fuse_target, unfuse_target
from dflash_dist.config import Config
from dflash_dist.model.capture import (
    CaptureOutput,
    LayerTap,
    capture_features,
    check_kernel_path,
    chunked_argmax,
)
from dflash_dist.target.loading import layer_ids_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_parts import disk_write_bandwidth, failure_report, profile_forward, sync, time_parts  # noqa: E402
from capture_sink import HostSink, ShardJanitor  # noqa: E402

PEAK_TFLOPS = 790.0  # bf16 matmul rate measured on an H200 (SPEC 6's convention)

QWEN35_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def target_config(tiny: bool = False) -> Qwen3_5TextConfig:
    """The Qwen3.5-27B text shape (3 Gated DeltaNet layers then 1 gated attention layer, x16)."""
    shape = TINY if tiny else QWEN35_27B
    return Qwen3_5TextConfig(
        **shape,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        * (shape["num_hidden_layers"] // 4),
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_random_target(config: Qwen3_5TextConfig, device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Built on the meta device, materialised on `device`, then HF's own random init run there (a
    CPU init of 27B weights takes minutes; on the GPU it is a fraction of a second)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    model.to_empty(device=device)
    model.initialize_weights()  # normal(0.02) weights, 1-centred norms, GDN A_log/dt_bias, rotary buffers
    return model.eval().requires_grad_(False)


def param_counts(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": embed, "without_embedding": total - embed}


@dataclass
class Batch:
    keys: list[str]
    ids: list[torch.Tensor]  # int32 [T_i] on the host, per sequence
    input_ids: torch.Tensor  # [b, T_max] on the device, right-padded
    attention_mask: torch.Tensor  # [b, T_max]

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


def plan_batches(lengths: list[int], budget: int, sort: bool = True) -> list[list[int]]:
    """Groups of sequence indices with len(group) * max length <= budget (one longer sequence
    makes a batch of its own); sorted by length first, so neighbours pad little."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else list(range(len(lengths)))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + ([cur] if cur else [])


def padding_share(lengths: list[int], groups: list[list[int]]) -> float:
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths[i] for g in groups for i in g) / padded


def make_batches(
    n: int, budget: int, lo: int, hi: int, vocab: int, device: str, seed: int, pool: int = 0
) -> tuple[list[Batch], dict]:
    """n batches of random sequences (lengths uniform in [lo, hi]) planned by length, in random
    order, from a pool of max(pool, what n batches need) sequences sorted together (capture_job
    sorts capture.sort_window = 256 sequences at a time: --pool 256 gives its padding)."""
    rng = random.Random(seed)
    per_batch = max(1, budget // ((lo + hi) // 2))
    lengths = [rng.randint(lo, hi) for _ in range(max(pool, n * per_batch + per_batch))]
    groups = plan_batches(lengths, budget)
    rng.shuffle(groups)
    if len(groups) < n:
        raise ValueError(f"planned only {len(groups)} batches, need {n}: lower --budget or --max-len")
    stats = {
        "padding_sorted": padding_share(lengths, groups),
        "padding_unsorted": padding_share(lengths, plan_batches(lengths, budget, sort=False)),
    }
    g = torch.Generator().manual_seed(seed)
    out = []
    for bi, group in enumerate(groups[:n]):
        ids = [torch.randint(0, vocab, (lengths[i],), generator=g, dtype=torch.int32) for i in group]
        t_max = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), t_max, dtype=torch.long)
        mask = torch.zeros(len(ids), t_max, dtype=torch.long)
        for r, x in enumerate(ids):
            input_ids[r, : len(x)], mask[r, : len(x)] = x, 1
        keys = [f"b{bi:04d}-s{r:02d}" for r in range(len(ids))]
        out.append(Batch(keys, ids, input_ids.to(device), mask.to(device)))
    return out, stats


def capture(model: nn.Module, batch: Batch, layer_ids: list[int], mask: str):
    """Our capture path. mask "keep": the padding mask passed as capture_job passes it; "drop":
    None (right padding is invisible to real positions of a causal LM); "masked": the mask forced
    into the model (what capture_features did before it dropped right-padding masks itself)."""
    if mask != "masked":
        return capture_features(model, batch.input_ids, layer_ids, batch.attention_mask if mask == "keep" else None)
    with LayerTap(model, layer_ids) as tap:
        out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        features = tap.concat()
    return CaptureOutput(features, chunked_argmax(out.last_hidden_state, model.get_output_embeddings()), "", ())


def run_compute(model: nn.Module, batches: list[Batch], layer_ids: list[int], mask: str, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        cap = capture(model, b, layer_ids, mask)
        del cap
    sync(device)
    return time.perf_counter() - t0


def run_job(model, batches: list[Batch], layer_ids: list[int], a, provenance, mode: str, passes_n: int,
            writeback: str | None = None) -> tuple:
    """capture_job's own path (CaptureJob.capture_passes: host ids -> device, capture, side-stream
    copies into pinned buffers, --writers writer processes; fuse_target for the fused modes) over
    `passes_n` passes cycling through `batches` (keys made unique per round); finished shards are
    deleted as they land unless --keep-shards (ShardJanitor). (seconds to the last pass submitted
    and its copies done, seconds to the last shard listed, SinkCounts)."""
    from dflash_dist.capture.capture_job import CaptureJob

    shard_dir = Path(a.shard_dir)
    shutil.rmtree(shard_dir, ignore_errors=True)
    cfg = Config()
    cfg.capture.writers, cfg.capture.shard_bytes = a.writers, a.shard_bytes
    cfg.capture.token_budget = max(b.padded_tokens for b in batches)
    if writeback is not None:  # sink "job:idle" / "job:kernel": capture.writeback_idle true / false
        cfg.capture.writeback_idle = {"idle": True, "kernel": False}[writeback]
    unfuse_target(model, _TORCH_CONV)
    set_copy_cuts(True)
    if mode != "eager":
        fuse_target(model, layers=mode == "fused2")
        path = CAPTURE_KERNEL_PATHS["fused" if mode == "fusedconv" else mode]
        provenance = dataclasses.replace(provenance, kernel_path=path)
    assert tuple(layer_ids) == provenance.layer_ids
    job = CaptureJob(cfg, model, provenance, shard_dir)
    passes = [
        [(f"{k}-r{i // len(batches)}", ids.tolist(), [1] * len(ids), {}) for k, ids in zip(b.keys, b.ids)]
        for i, b in ((i, batches[i % len(batches)]) for i in range(passes_n))
    ]
    gpu_done: list[float] = []

    def on_pass(_items) -> None:
        if len(gpu_done) == len(passes) - 1:  # the last pass: wait for its compute and copies
            torch.cuda.synchronize() if a.device.startswith("cuda") else None
        gpu_done.append(time.perf_counter())

    pool = job.writer_pool()  # started before the clock: process start-up is not per pass
    janitor = None if a.keep_shards else ShardJanitor(shard_dir)
    sync(a.device)
    t0 = time.perf_counter()
    try:
        counts = job.capture_passes(passes, on_pass, pool)
        # the last shard listed: capture's end. The janitor's last deletions (the bench's own disk room, which a
        # capture does not do) come after and are not timed
        total = time.perf_counter() - t0
    finally:
        unfuse_target(model, _TORCH_CONV)
        if janitor is not None:
            janitor.close()
            print(f"shard janitor: {janitor.deleted} finished shards ({janitor.bytes / 1e9:.1f} GB) deleted on arrival")
    if not a.keep_shards:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return gpu_done[-1] - t0, total, counts


def run_end_to_end(model, batches: list[Batch], layer_ids: list[int], mask: str, args, provenance, mode: str):
    """(seconds from the first forward to the last shard renamed, SinkStats)."""
    shard_dir = Path(args.shard_dir)
    shutil.rmtree(shard_dir, ignore_errors=True)
    width = len(layer_ids) * model.config.hidden_size
    tokens = max(b.real_tokens for b in batches)
    n = args.writers
    sink = HostSink(shard_dir, provenance, n, n + args.spare_buffers, tokens, width, args.keep_shards,
                    args.shard_bytes, args.device, mode)  # fmt: skip
    sync(args.device)
    t0 = time.perf_counter()
    for b in batches:
        sink.submit(capture(model, b, layer_ids, mask), b)
    stats = sink.close()
    secs = stats.closed_at - t0
    stats.samples = sum(len(b.ids) for b in batches)
    if not args.keep_shards:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return secs, stats


_TORCH_CONV = modeling_qwen3_5.causal_conv1d_fn


@dataclass(frozen=True)
class Variant:
    budget: int
    mask: str  # keep | drop | masked, see capture()
    mode: str  # eager | fused (fuse_elementwise) | fusedconv (+ fla conv) | fused2 (+ fused_layers.py) | fused2copies

    @classmethod
    def parse(cls, text: str) -> Variant:
        try:
            budget, mask, mode = text.split(":")
            if mask not in ("keep", "drop", "masked") or mode not in MODES:
                raise ValueError
            return cls(int(budget), mask, mode)
        except ValueError:
            msg = f"variant {text!r}: expected BUDGET:keep|drop|masked:{'|'.join(MODES)}, e.g. 32768:keep:eager"
            raise SystemExit(msg) from None

    @property
    def fused(self) -> bool:
        return self.mode != "eager"

    def __str__(self) -> str:
        return f"{self.budget}:{self.mask}:{self.mode}"


MODES = ("eager", "fused", "fusedconv", "fused2", "fused2copies")  # fused2copies: fused2, set_copy_cuts(False)


def use_variant(model: nn.Module, v: Variant) -> None:
    """fused: capture_job's fuse_target without fla's conv; fusedconv: capture.kernels=fused;
    fused2: capture.kernels=fused2 (capture/fused_layers.py); fused2copies: fused2 without its copy cuts."""
    unfuse_target(model, _TORCH_CONV)
    set_copy_cuts(v.mode != "fused2copies")
    if v.fused:
        fuse_target(model, conv=v.mode != "fused", layers=v.mode.startswith("fused2"))


def figures(secs: float, batches: list[Batch], params: dict[str, int]) -> dict:
    tokens = sum(b.real_tokens for b in batches)
    tps = tokens / secs
    return {
        "seconds": round(secs, 3),
        "tokens": tokens,
        "tokens_per_s": round(tps, 1),
        "padded_tokens_per_s": round(sum(b.padded_tokens for b in batches) / secs, 1),
        "bound_share": round(2 * params["total"] * tps / (PEAK_TFLOPS * 1e12), 4),
        "bound_share_without_embedding": round(2 * params["without_embedding"] * tps / (PEAK_TFLOPS * 1e12), 4),
    }


def scaled(f: dict, reps: float) -> dict:
    """figures() of `reps` rounds over the same batches (the job sink cycles them)."""
    keys = ("tokens_per_s", "padded_tokens_per_s", "bound_share", "bound_share_without_embedding")
    return {**f, "tokens": round(f["tokens"] * reps), **{k: round(f[k] * reps, 4) for k in keys}}


def line(label: str, f: dict) -> str:
    return (
        f"{label:<38} {f['tokens_per_s']:>9.0f} tok/s  {100 * f['bound_share']:5.1f}% of bound "
        f"({100 * f['bound_share_without_embedding']:5.1f}% w/o embedding)  {f['seconds']:.2f} s"
    )


def measure_compute(model, v: Variant, a, layer_ids, params) -> dict:
    """Tokens/s over --batches batches, timed twice: "cold" (first sight of each batch shape: fla
    autotunes per batch size, cuDNN plans per shape) and warm (the figure reported)."""
    batches, stats = make_batches(
        a.batches, v.budget, a.min_len, a.max_len, model.config.vocab_size, a.device, seed=v.budget, pool=a.pool
    )
    check = {}
    if v.fused:  # the fused elementwise ops against eager on the first batch (also compiles them)
        unfuse_target(model, _TORCH_CONV)
        eager = capture(model, batches[0], layer_ids, v.mask)
        use_variant(model, v)
        fused = capture(model, batches[0], layer_ids, v.mask)
        diff = (fused.features.float() - eager.features.float()).norm() / eager.features.float().norm()
        agree = (fused.target_argmax == eager.target_argmax).double().mean()
        check = {"fused_vs_eager_rel_l2": float(diff), "fused_vs_eager_argmax_agreement": float(agree)}
        del eager, fused
    use_variant(model, v)
    cold = figures(run_compute(model, batches, layer_ids, v.mask, a.device), batches, params)
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    f = figures(run_compute(model, batches, layer_ids, v.mask, a.device), batches, params)
    f.update(stats, cold=cold, sequences=sum(len(b.ids) for b in batches), **check)
    if a.device.startswith("cuda"):
        f["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(
        line(f"compute {v}", f) + f"  cold {cold['tokens_per_s']:.0f} tok/s, padding "
        f"{100 * stats['padding_sorted']:.1f}% (unsorted {100 * stats['padding_unsorted']:.1f}%), "
        f"peak {f.get('peak_gib', 0)} GiB" + "".join(f", {k} {val:.2e}" for k, val in check.items()),
        flush=True,
    )
    return f


def measure_profile(model, v: Variant, a, layer_ids) -> dict:
    batches, _ = make_batches(1, v.budget, a.min_len, a.max_len, model.config.vocab_size, a.device, seed=7)
    use_variant(model, v)
    run_compute(model, batches, layer_ids, v.mask, a.device)  # warm (compiles, autotunes)
    prof = profile_forward(model, batches[0], layer_ids, v.mask, capture)
    prof["parts"] = time_parts(model, batches[0].real_tokens, len(layer_ids) * model.config.hidden_size, a.device)
    prof["tokens"] = batches[0].real_tokens
    total = sum(prof["by_class_ms"].values())
    print(f"profile {v}, one forward of {prof['tokens']} tokens: {total:.0f} ms of kernels")
    for k, ms in prof["by_class_ms"].items():
        print(f"  {k:<26} {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    for name, ms, count in prof["top"][:12]:
        print(f"  {ms:8.1f} ms  x{count:<5} {name}")
    print(prof["gaps"])
    p = prof["parts"]
    print(
        f"  argmax alone {1e3 * p['argmax_s']:.1f} ms; features D2H {p['d2h_gb']:.2f} GB in "
        f"{1e3 * p['d2h_s']:.1f} ms ({p['d2h_gb'] / p['d2h_s']:.1f} GB/s)",
        flush=True,
    )
    return prof


def measure_end_to_end(model, v: Variant, a, layer_ids, params, kernel_path: str) -> dict:
    """Compute only, then each sink of --sinks, over the same (warmed) batches."""
    distinct = min(a.e2e_batches, a.e2e_distinct or a.e2e_batches)
    batches, stats = make_batches(
        distinct, v.budget, a.min_len, a.max_len, model.config.vocab_size, a.device, seed=v.budget + 1, pool=a.pool
    )
    print(f"end to end: {a.e2e_batches} passes over {distinct} distinct batches, padding {stats['padding_sorted']:.1%}")
    use_variant(model, v)
    prov = Provenance(
        schema_version=SHARD_SCHEMA_VERSION,
        target_id="bench:qwen3.5-27b-shape-random",
        target_hash="random-init-seed-0",
        layer_ids=tuple(layer_ids),
        hidden_size=model.config.hidden_size,
        dtype="bfloat16",
        kernel_path=kernel_path,
        template_hash="none",
        **installed_versions(),
    )
    cold = figures(run_compute(model, batches, layer_ids, v.mask, a.device), batches, params)  # first sight
    out = {"compute_only": figures(run_compute(model, batches, layer_ids, v.mask, a.device), batches, params),
           "compute_cold": cold, "passes": a.e2e_batches, "distinct_batches": distinct, **stats}
    print(line(f"compute only {v}", out["compute_only"]) + f"  (first sight of these shapes: "
          f"{cold['tokens_per_s']:.0f} tok/s, {100 * cold['bound_share']:.1f}%)", flush=True)
    if a.disk_gib > 0:
        bw = disk_write_bandwidth(Path(a.shard_dir).parent, a.disk_gib)
        out["disk_write_gb_s"] = round(bw / 1e9, 3)
        print(f"disk write bandwidth (fsync, {a.disk_gib} GiB in 16 MiB blocks) under {Path(a.shard_dir).parent}: "
              f"{bw / 1e9:.2f} GB/s", flush=True)
    for sink in a.sinks.split(","):
        if sink.split(":")[0] == "job":
            try:
                if v.mode in ("fused", "fused2copies"):
                    raise ValueError("the job sink runs capture_job's modes: eager, fusedconv or fused2 (fuse_target)")
                wb = sink.split(":")[1] if ":" in sink else None
                loop_s, secs, c = run_job(model, batches, layer_ids, a, prov, v.mode, a.e2e_batches, wb)
                reps = a.e2e_batches / len(batches)
            except Exception as e:
                out[sink] = {"error": f"{type(e).__name__}: {e}", "where": failure_report()}
                print(f"FAILED end to end, capture_job: {out[sink]['error']}\n{out[sink]['where']}", flush=True)
                continue
            f = scaled(figures(secs, batches, params), reps)
            loop = scaled(figures(loop_s, batches, params), reps)
            per_token = c.bytes / max(1, c.tokens)
            f.update(gpu_loop=loop, shards=c.shards, shard_gb=round(c.bytes / 1e9, 2), samples=c.samples,
                     writer_busy_s=round(c.busy_s, 2), gpu_waited_s=round(c.gpu_waited_s, 2), writers=a.writers,
                     writer_jobs=c.jobs, bytes_per_token=round(per_token), drain_s=round(secs - loop_s, 2),
                     writebacks=c.writebacks, writeback_s=round(c.writeback_s, 2),
                     writeback_max_s=round(c.writeback_max_s, 3))
            if "disk_write_gb_s" in out:
                f["disk_bound_tokens_per_s"] = round(out["disk_write_gb_s"] * 1e9 / per_token)
            out[sink] = f
            print(line(f"end to end, capture_job {v.mode} ({sink})", f) + f"  {c.shards} shards, {f['shard_gb']} GB, "
                  f"{c.jobs} writer jobs (row groups) from {a.e2e_batches} passes, "
                  f"writers busy {f['writer_busy_s']} s, GPU thread waited {f['gpu_waited_s']} s for a buffer; "
                  f"GPU loop alone {loop['tokens_per_s']:.0f} tok/s ({100 * loop['bound_share']:.1f}%), then "
                  f"{f['drain_s']} s to the last shard listed, {c.writebacks} idle write-back ranges "
                  f"({f['writeback_s']} s, the longest {f['writeback_max_s']} s); the disk "
                  f"allows {f.get('disk_bound_tokens_per_s', 0)} tok/s at {per_token / 1e3:.1f} kB/token", flush=True)
            continue
        try:
            secs, s = run_end_to_end(model, batches, layer_ids, v.mask, a, prov, sink)
        except Exception as e:  # the other sinks still run
            out[sink] = {"error": f"{type(e).__name__}: {e}"}
            print(f"FAILED end to end, {sink}: {out[sink]['error']}", flush=True)
            continue
        f = figures(secs, batches, params)
        f.update(
            shards=s.shards,
            shard_gb=round(s.bytes / 1e9, 2),
            samples=s.samples,
            writer_busy_s=round(s.write_s, 2),
            gpu_waited_s=round(s.gpu_waited_s, 2),
            writers=a.writers,
        )
        out[sink] = f
        print(
            line(f"end to end, {sink}", f) + f"  {s.shards} shards, {f['shard_gb']} GB, writers busy "
            f"{f['writer_busy_s']} s, GPU thread waited {f['gpu_waited_s']} s for a buffer",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3.5 shape (smoke run, any device)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--variants",
        default="32768:keep:eager,32768:drop:eager",
        help="compute runs, comma-separated BUDGET:keep|drop|masked:eager|fused|fusedconv (padded tokens per "
        "forward; padding mask: see capture(); elementwise ops eager or torch.compile'd, + fla's causal conv)",
    )
    ap.add_argument("--profile", default="", help="variants to profile one forward of (kernel time by class)")
    ap.add_argument("--e2e", default="32768:drop:eager", help="variant of the end-to-end run ('' = none)")
    ap.add_argument("--min-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=3, help="forwards per compute run")
    ap.add_argument("--e2e-batches", type=int, default=4, help="timed passes of the end-to-end run")
    ap.add_argument("--e2e-distinct", type=int, default=0, help="distinct batches the passes cycle through (0: all)")
    ap.add_argument("--pool", type=int, default=0, help="sequences sorted together per plan (256: capture_job's)")
    ap.add_argument(
        "--sinks",
        default="threads,processes,d2h",
        help="end-to-end runs: job (capture_job's own path: CaptureJob.capture_passes, capture.writers writer "
        "processes; job:idle / job:kernel with capture.writeback_idle true / false), the bench's writer threads "
        "or processes, or device-to-host copies only",
    )
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--disk-gib", type=float, default=4.0, help="GiB written to measure the disk (0: skip)")
    ap.add_argument("--spare-buffers", type=int, default=1, help="host buffers beyond one per writer")
    ap.add_argument("--shard-dir", default="/tmp/bench_capture_shards")
    ap.add_argument("--shard-bytes", type=int, default=1 << 30)
    ap.add_argument("--keep-shards", action="store_true")
    ap.add_argument("--json", default=None, help="write all figures here")
    a = ap.parse_args(argv)
    variants = [Variant.parse(x) for x in a.variants.split(",") if x]
    profiles = [Variant.parse(x) for x in a.profile.split(",") if x]
    e2e = Variant.parse(a.e2e) if a.e2e else None

    t0 = time.perf_counter()
    model = build_random_target(target_config(a.tiny), a.device, torch.bfloat16)
    sync(a.device)
    params = param_counts(model)
    layer_ids = layer_ids_for(Config(), model.config.num_hidden_layers)
    kernel_path = check_kernel_path(model)
    print(
        f"target built in {time.perf_counter() - t0:.1f} s: {params['total'] / 1e9:.3f}B params "
        f"({params['without_embedding'] / 1e9:.3f}B without the input embedding), layers {layer_ids}, "
        f"kernel path {kernel_path}; torch {torch.__version__}, {installed_versions()}"
    )
    if a.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name()}, weights {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    report: dict = {
        "params": params,
        "layer_ids": layer_ids,
        "kernel_path": kernel_path,
        "torch": torch.__version__,
        **installed_versions(),
        "compute": {},
        "profile": {},
        "errors": {},
    }

    def attempt(section: str, v: Variant, fn) -> None:
        try:
            report[section][str(v)] = fn()
        except Exception as e:  # one failed variant must not lose the others' figures
            report["errors"][f"{section} {v}"] = f"{type(e).__name__}: {e}"
            print(f"FAILED {section} {v}: {type(e).__name__}: {e}\n{failure_report()}", flush=True)
            unfuse_target(model, _TORCH_CONV)
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()

    for v in variants:
        attempt("compute", v, lambda v=v: measure_compute(model, v, a, layer_ids, params))
    if a.device.startswith("cuda"):
        for v in profiles:
            attempt("profile", v, lambda v=v: measure_profile(model, v, a, layer_ids))
    if e2e is not None:
        if f"compute {e2e}" in report["errors"]:  # e.g. fla's conv failed: measure the writers all the same
            e2e = Variant(e2e.budget, e2e.mask, "fused" if e2e.mode == "fusedconv" else "eager")
        report["end_to_end"] = {}
        attempt("end_to_end", e2e, lambda: measure_end_to_end(model, e2e, a, layer_ids, params, kernel_path))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{a.json}.tmp-{os.getpid()}"
        Path(tmp).write_text(json.dumps(report, indent=1))
        os.replace(tmp, a.json)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
