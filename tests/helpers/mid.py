"""configs/mid_gpu.yaml at CPU size: the overrides that shrink it to the test-size code_lm target on
2 CPU cores (tests/test_mid_config.py runs the product path with them; the quality bench's test a
one-rank packed variant)."""

from __future__ import annotations

from tests.conftest import REPO

MID_CONFIG = REPO / "configs" / "mid_gpu.yaml"

CPU_SIZE = [
    "target.preset=test", "target.device=cpu", "target.dtype=float32",
    "data.max_train_samples=8",  # 2 steps an epoch: the 4 steps below read the shards twice
    "capture.layer_ids=[1,2]", "capture.max_new_tokens=16", "capture.batch_size=8", "capture.sort_window=64",
    "capture.token_budget=4096", "capture.shard_bytes=2000000", "capture.writers=0", "capture.cpus_per_actor=0.5",
    "capture.gpus_per_actor=0",
    "drafter.num_layers=2", "drafter.num_heads=2", "drafter.num_kv_heads=1", "drafter.head_dim=16",
    "drafter.block_size=4",
    # the config's layout at this depth: sliding layers but the last, a window that cuts these ~60-token rows
    "drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=8",
    "train.gpus_per_rank=0", "train.cpus_per_rank=0.5", "train.micro_batch_size=4", "train.micro_batch_tokens=null",
    "train.max_steps=4", "train.checkpoint_every=2", "train.num_anchors=8", "train.log_every=2",
    "eval.num_prompts=3", "eval.max_new_tokens=12", "eval.num_gpus=0", "eval.num_cpus=0.5",
    "eval.live_workers=2",  # the config's live worker processes, two of them on 2 cores
    "ray.num_cpus=2",
]  # fmt: skip
