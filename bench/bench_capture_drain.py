"""The capture's writers alone: how long the end of a capture waits for its shards after the last pass
(the "drain" between bench_capture.py's GPU loop and its end-to-end figure), with and without
capture.writeback_idle, side by side on one machine and disk. No model and no GPU: synthetic
bf16 passes go through capture_job's own WriterPool (host buffers, writer processes, ShardWriter,
manifest) exactly as capture hands them over.

    python bench/bench_capture_drain.py --pass-interval 3      # 12 passes of 8192 x 25600 bf16 (~5 GB)
    python bench/bench_capture_drain.py --writers 4 --pass-tokens 32768 --passes 50 --pass-interval 3

--pass-interval S waits S seconds after each pass, as the GPU computing the next one would (the
27B shape's 32768-token pass takes ~3 s on an H200); 0 submits as fast as the writers take passes.
Per setting (idle: writers start write-back whenever they wait for a pass; kernel: the kernel's own
write-back) and repeat: seconds to the last pass submitted ("loop": on CPU the copies into the host
buffers are part of it), then seconds until every shard is fsynced, renamed and listed ("drain"),
the writers' busy seconds (jobs) and the write-back ranges they started while idle, with their
seconds. Shards are deleted between settings.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance  # noqa: E402
from dflash_dist.capture.host_sink import WriterPool  # noqa: E402
from dflash_dist.config import Config  # noqa: E402


def run(a, writeback: str, features: torch.Tensor, argmax: torch.Tensor, tag: str) -> dict:
    shard_dir = Path(a.dir) / tag
    shutil.rmtree(shard_dir, ignore_errors=True)
    cfg = Config()
    cfg.capture.shard_bytes, cfg.capture.writeback_idle = a.shard_bytes, {"idle": True, "kernel": False}[writeback]
    prov = Provenance(
        schema_version=SHARD_SCHEMA_VERSION,
        target_id="bench:drain",
        target_hash="synthetic",
        layer_ids=tuple(range(a.layers)),
        hidden_size=a.hidden,
        dtype="bfloat16",
        kernel_path="torch",
        template_hash="none",
    )
    rows, t = features.shape[:2]
    attention = torch.ones(rows, t, dtype=torch.long)
    pool = WriterPool(cfg, shard_dir, prov, "drain", 0, a.writers, gate=False, tokens_hint=rows * t)
    t0 = time.perf_counter()
    try:
        for p in range(a.passes):
            items = [(f"{tag}-p{p}-r{r}", [r] * t, [1] * t, {}) for r in range(rows)]
            pool.submit(features, argmax, attention, items)
            time.sleep(a.pass_interval)
        t1 = time.perf_counter()
        c = pool.close()
    except BaseException:
        pool.abort()
        raise
    t2 = time.perf_counter()
    shutil.rmtree(shard_dir, ignore_errors=True)
    return {
        "writeback": writeback,
        "loop_s": t1 - t0,
        "drain_s": t2 - t1,
        "gb": c.bytes / 1e9,
        "shards": c.shards,
        "busy_s": c.busy_s,
        "writebacks": c.writebacks,
        "writeback_s": c.writeback_s,
        "writeback_max_s": c.writeback_max_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="kernel,idle", help="capture.writeback_idle false (kernel) / true (idle)")
    ap.add_argument("--pass-interval", type=float, default=0.0, help="seconds the GPU would compute each pass")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over the settings (alternating order)")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--pass-tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=4, help="sequences per pass (pass-tokens / rows each)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--shard-bytes", type=int, default=1 << 30)
    ap.add_argument("--dir", default="/tmp/bench_capture_drain")
    a = ap.parse_args(argv)
    settings = a.settings.split(",")
    g = torch.Generator().manual_seed(0)
    t = a.pass_tokens // a.rows
    features = torch.randn(a.rows, t, a.layers * a.hidden, generator=g).to(torch.bfloat16)
    argmax = torch.randint(0, 248320, (a.rows, t), generator=g)
    print(
        f"{a.passes} passes of {a.rows} x {t} tokens x {a.layers * a.hidden} bf16 "
        f"({features.numel() * 2 / 1e9:.2f} GB each), {a.writers} writer processes, shards of "
        f"{a.shard_bytes / 1e9:.2f} GB under {a.dir}",
        flush=True,
    )
    for r in range(a.repeat):
        for wb in settings if r % 2 == 0 else settings[::-1]:
            f = run(a, wb, features, argmax, f"r{r}-wb{wb}")
            print(
                f"write-back {wb:>6}: loop {f['loop_s']:6.2f} s, drain {f['drain_s']:5.2f} s after the last "
                f"pass, {f['gb']:.2f} GB in {f['shards']} shards, writers busy {f['busy_s']:.1f} s, "
                f"{f['writebacks']} write-back ranges started while idle ({f['writeback_s']:.1f} s, not in busy; "
                f"the longest {f['writeback_max_s']:.3f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
