"""Capture writer pools (dflash_dist/capture/host_sink.py) as test_capture drives them: a pass as capture
hands it over, a small pool, and the functions its spawned processes run. Nothing heavy is imported at the
top: a spawned process imports this module to find its function (test_capture's own imports reach
transformers), and each import inside a function is what that function needs."""

from __future__ import annotations

import time
from pathlib import Path


def pool_pass(rng, keys: list[str], lengths: list[int], width: int):
    """One pass as capture hands it to WriterPool.submit: padded features/argmax, attention, items."""
    import torch

    b, t = len(lengths), max(lengths)
    features = torch.randn(b, t, width, generator=rng).to(torch.bfloat16)
    argmax = torch.randint(0, 500, (b, t), generator=rng)  # int64, as the capture returns it
    attention = torch.zeros(b, t, dtype=torch.long)
    items = []
    for r, (key, n) in enumerate(zip(keys, lengths)):
        attention[r, :n] = 1
        ids = torch.randint(0, 500, (n,), generator=rng).tolist()
        mask = torch.randint(0, 2, (n,), generator=rng).tolist()
        items.append((key, ids, mask, {"row": r}))
    return features, argmax, attention, items


def pool_config(shard_bytes: int, **capture):
    """(config, provenance) of the writer pools below: 2 layers of H 16 in bf16."""
    from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance
    from tests.helpers.config import config_from

    cfg = config_from({"target": {"kind": "tiny_stdlib"}, "capture": {"shard_bytes": shard_bytes, **capture}})
    prov = Provenance(schema_version=SHARD_SCHEMA_VERSION, target_id="test:pool", target_hash="h", layer_ids=(1, 2),
                      hidden_size=16, dtype="bfloat16", kernel_path="torch", template_hash="none")
    return cfg, prov


def writer_pool(shard_dir, writers: int, min_group_tokens: int | None, shard_bytes: int, writeback_idle: bool = True,
                prefix: str = "t000", tokens_hint: int = 0, device: str = "cpu", **capture):
    from dflash_dist.capture.host_sink import WriterPool

    cfg, prov = pool_config(shard_bytes, writeback_idle=writeback_idle, **capture)
    return WriterPool(cfg, shard_dir, prov, prefix, 0, writers, min_group_tokens=min_group_tokens,
                      tokens_hint=tokens_hint, device=device)


def claim_and_wait(parent: str, ready) -> None:  # a capture process holding its buffer directory, until killed
    from dflash_dist.capture.host_sink import claim_buffer_dir

    path, _ = claim_buffer_dir(Path(parent), "t001", sweep=True)
    (path / "buf0-1").write_bytes(b"x" * 4096)
    ready.set()
    time.sleep(600)


def pool_at_a_full_gate(shard_dir: str, pids) -> None:  # a capture process whose writer waits at the disk gate
    import torch

    pool = writer_pool(Path(shard_dir), writers=1, min_group_tokens=8, shard_bytes=1024, writeback_idle=False,
                       max_buffer_bytes=4096, buffer_stall_s=600)
    pool.submit(*pool_pass(torch.Generator().manual_seed(0), ["a", "b"], [12, 9], 2 * 16))
    pids.put(pool.procs[0].pid)
    time.sleep(600)


def fail_unasked(conn) -> None:  # a writer whose idle write-back failed: its error, unasked, then exit 0
    conn.send_bytes(b'{"error": "OSError: [Errno 122] Disk quota exceeded"}')
