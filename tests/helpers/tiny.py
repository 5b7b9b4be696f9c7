"""The trainer tests' tiny setting: a saved tiny random Qwen3.5 target, its captured samples
(variable lengths), provenance and drafter shape (the `tiny` fixture, tests/conftest.py), the
trainer config over it, and shards of its samples."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.actors.trainer_group import default_extensions_dir
from dflash_dist.config import Config
from dflash_dist.model.capture import capture_features
from dflash_dist.model.config import build_target_layer_ids
from dflash_dist.target.loading import drafter_config_for, provenance_for, target_identity
from dflash_dist.tools.demo import DemoConfig, tiny_qwen35_target
from tests.helpers.config import UNREAD_TRAIN_PATH, config_from

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # the shm op compiles once

NUM_SAMPLES = 18  # 9 shards of 2: rank 0 gets 5 shards, rank 1 gets 4 -> rank 0 trains its last 2 alone
PER_SHARD = 2
DEMO = DemoConfig(num_prompts=NUM_SAMPLES, prompt_len=12, new_tokens=20, k=3)


def make_cfg(out: Path, target_dir: Path, *overrides: str, **train) -> Config:
    """The tiny trainer config (2 ranks of ZeRO-2, a 1-layer drafter); `train` sets train.* fields
    by name, `overrides` (`a.b=value`) any other. Validated like a user's config."""
    tree = {
        "run": {"out_dir": str(out), "seed": 0},
        "target": {"kind": "hf", "path": str(target_dir), "dtype": "float32"},
        "data": {"train_path": UNREAD_TRAIN_PATH},
        "capture": {"num_layers": DEMO.k},
        "drafter": {"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": 4},
        "train": {
            "world_size": 2,
            "zero_stage": 2,
            "micro_batch_size": 2,
            "lr": 5e-3,
            "warmup_frac": 0.1,
            "epochs": 3,
            "num_anchors": 16,
            "checkpoint_every": 4,
            "keep_checkpoints": 2,
            "log_every": 1,
            "cpus_per_rank": 0.5,
            **train,
        },
    }
    return config_from(tree, *overrides)


def make_tiny(root: Path) -> dict:
    """A saved tiny target, its captured samples (variable lengths), provenance and drafter shape."""
    target = tiny_qwen35_target(DEMO)
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    mask_id = DEMO.vocab_size - 1
    # equal-length prompts and one batched greedy generate (demo.make_data goes prompt by prompt)
    g = torch.Generator().manual_seed(DEMO.seed + 2)
    prompts = torch.randint(0, mask_id, (NUM_SAMPLES, DEMO.prompt_len), generator=g)
    with torch.no_grad():
        ids = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=DEMO.new_tokens,
            min_new_tokens=DEMO.new_tokens,
            do_sample=False,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, DEMO.prompt_len :] = 1
    cap = capture_features(target, ids, build_target_layer_ids(DEMO.target_layers, DEMO.k))
    samples = []
    for i in range(NUM_SAMPLES):
        t = ids.shape[1] - 3 * (i % 3)  # unequal lengths exercise padding
        samples.append(
            Sample(
                key=f"s{i:03d}",
                input_ids=ids[i, :t].int(),
                loss_mask=loss_mask[i, :t].to(torch.uint8),
                features=cap.features[i, :t].contiguous(),
                target_argmax=cap.target_argmax[i, :t].int(),
            )
        )
    cfg = make_cfg(root / "unused", target_dir)
    prov = provenance_for(target_identity(cfg, target_dir), target, template_hash="test-template")
    dc = drafter_config_for(cfg, target_dir, mask_token_id=mask_id)
    return {"root": root, "target_dir": target_dir, "samples": samples, "prov": prov, "drafter": dc}


def write_shards(shard_dir: Path, prov, samples, done: bool) -> None:
    """`samples` as shards of PER_SHARD; DONE marked when `done` (else the capture is still running)."""
    with ShardWriter(shard_dir, prov, prefix="cap") as w:
        for i, s in enumerate(samples):
            w.write(s)
            if i % PER_SHARD == PER_SHARD - 1:
                w.flush()
    if done:
        mark_done(shard_dir)
