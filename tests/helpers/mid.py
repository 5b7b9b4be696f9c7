"""configs/mid_gpu.yaml at CPU size: the overrides that shrink it to the test-size code_lm target on
2 CPU cores, and the one product run with them (`run_mid_cpu`, the session's `mid_cpu_run` in
tests/conftest.py) that tests/test_mid_config.py checks end to end and the quality bench's test
retrains step for step with the bench's default variant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

MID_CONFIG = REPO / "configs" / "mid_gpu.yaml"

CPU_SIZE = [
    "target.preset=test", "target.device=cpu", "target.dtype=float32",
    "data.max_train_samples=24", "data.max_length=1024",
    "capture.layer_ids=[1,2]", "capture.max_new_tokens=24", "capture.batch_size=8", "capture.sort_window=64",
    "capture.token_budget=4096", "capture.shard_bytes=2000000", "capture.writers=0", "capture.cpus_per_actor=0.5",
    "capture.gpus_per_actor=0",
    "drafter.num_layers=2", "drafter.num_heads=2", "drafter.num_kv_heads=1", "drafter.head_dim=16",
    "drafter.block_size=4",
    # the config's layout at this depth: sliding layers but the last, a window that cuts these ~60-token rows
    "drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=8",
    # the config's one rank on packed rows (its GPU rank packs), rows of 2048 tokens: more than one sample a step
    "train.gpus_per_rank=0", "train.cpus_per_rank=0.5", "train.micro_batch_size=4", "train.packing=true",
    "train.micro_batch_tokens=2048",
    "train.max_steps=6", "train.checkpoint_every=2", "train.num_anchors=8", "train.log_every=2",
    "eval.num_prompts=4", "eval.max_new_tokens=12", "eval.num_gpus=0", "eval.num_cpus=0.5",
    "eval.live_workers=2",  # the config's live worker processes, two of them on 2 cores
    "ray.num_cpus=2",
    "ray.address=local",  # a cluster of its own even when another test's Ray cluster runs on this machine
]  # fmt: skip


def run_mid_cpu(root: Path) -> tuple[Path, Path]:
    """`dflash-dist run configs/mid_gpu.yaml` with CPU_SIZE alone (the eval schedule is the config's) on
    the test-size code_lm target built under `root`: (run directory, target). Fails with the run's output."""
    from dflash_dist.target.code_target import build_code_target

    target = build_code_target(root / "target", "test", log=lambda _: None)
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "launcher.cli", "run", str(MID_CONFIG), "--out", str(root / "run"),
           f"target.path={target}", *CPU_SIZE]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return root / "run", target
