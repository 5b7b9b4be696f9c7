"""configs/mid_gpu.yaml: it loads and validates, its drafter is z-lab's shape scaled to the code_lm
target, its layout fills one GPU and its schedule measures live at the first and last checkpoint;
and (slow tier) the same config at CPU size runs the whole product path on the test-size code_lm
target: regenerate, capture, DeepSpeed training, replay + live evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.records import DONE_NAME
from data_pipeline.shard_reader import read_manifest
from dflash_dist.config import load_config
from dflash_dist.model.config import build_target_layer_ids
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.target.code_target import PRESETS
from dflash_dist.target.lm_config import text_config
from dflash_dist.target.loading import drafter_config_for
from dflash_dist.target.stdlib_corpus import split_of
from tests.conftest import REPO

CONFIG = REPO / "configs" / "mid_gpu.yaml"


def test_mid_gpu_loads_and_its_drafter_is_the_scaled_z_lab_shape(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert cfg.target.kind == "code_lm" and cfg.target.preset == "qwen3" and cfg.target.device == "cuda"
    assert cfg.target.dtype == "bfloat16" and cfg.capture.regenerate and cfg.data.max_train_samples == 6000
    settings = PRESETS[cfg.target.preset]
    text_config("qwen3", settings, 0).save_pretrained(tmp_path)  # the built target's config.json, without building
    dc = drafter_config_for(cfg, tmp_path, mask_token_id=settings.vocab_size - 1)
    assert (dc.hidden_size, dc.head_dim, dc.num_key_value_heads) == (768, settings.head_dim, settings.num_kv_heads)
    assert 3 <= dc.num_hidden_layers <= 5 and dc.intermediate_size == 2048
    # the quality bench's choice (ninth lease): block 8 on this target, where tau stays near 3
    assert dc.block_size == 8
    assert dc.target_layer_ids == (1, 3, 5, 7, 9) == tuple(build_target_layer_ids(12, 5))
    # the quality bench's choice (seventh lease): sliding layers but the last, with a window that cuts real context
    assert dc.layer_types == ("sliding_attention", "sliding_attention", "full_attention") and dc.sliding_window == 128
    with torch.device("meta"):
        DFlashDrafter(dc)
    # every role on the one GPU; shards kept for the later epochs
    used = cfg.capture.gpus_per_actor + cfg.train.world_size * cfg.train.gpus_per_rank + cfg.eval.num_gpus
    assert used == 1.0 and cfg.train.epochs > 1 and cfg.capture.consumed_shards == "auto"
    assert cfg.pack_tokens() == 8192 and cfg.data.max_length >= 672 + cfg.capture.max_new_tokens
    # replay at every checkpoint, live (chain + DDTree-8) at the last only (the ~10-minute budget), on 64+ prompts
    from dflash_dist.evaluator.policy import live_checkpoint

    e, t = cfg.eval, cfg.train
    assert e.mode == "live" and e.num_prompts >= 64 and 8 in e.budgets
    exports = list(range(t.checkpoint_every, t.max_steps + 1, t.checkpoint_every))
    live = [s for i, s in enumerate(exports)
            if live_checkpoint(i, s, e.live_every, e.live_first, e.live_last, t.max_steps)]  # fmt: skip
    assert exports == [300, 600, 900, 1200] and live == [1200]
    assert e.live_workers > 1 and e.reference_batch >= e.num_prompts  # live side by side, references in one batch


# ---- the whole product path at CPU size (tests/helpers/mid.py's CPU_SIZE) -----------------------------


@pytest.mark.slow
def test_mid_gpu_at_cpu_size_runs_the_product_path(mid_cpu_run) -> None:
    """mid_gpu.yaml with only sizes and devices overridden (the eval schedule is the config's): the
    session's run (tests/conftest.py `mid_cpu_run`, also the quality bench test's)."""
    out, target = mid_cpu_run
    plan = json.loads((out / "run_plan.json").read_text())
    assert plan["target_dir"] == str(target) and plan["identity"]["target_id"] == "code_lm:target"
    records = read_manifest(out / "shards")
    assert (out / "shards" / DONE_NAME).exists() and records
    assert {(r.provenance.kernel_path, r.provenance.layer_ids, r.provenance.target_id) for r in records} == {
        ("torch", (1, 2), "code_lm:target")}
    train = read_chat_jsonl(out / "data" / "train.ingested.jsonl")
    held = read_chat_jsonl(out / "data" / "eval.ingested.jsonl")
    assert len(train) == 24 and len(held) == 4
    assert all(split_of(json.loads(line)["source"]) == "heldout"
               for line in (out / "data" / "eval.jsonl").read_text().splitlines())  # fmt: skip
    evals = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (out / "eval").glob("step_*.json")}
    assert sorted(evals) == [2, 4, 6]
    assert [s for s, r in sorted(evals.items()) if r["live"]] == [6]  # the config's: live at the last export only
    assert all(r["mode"] == "live" and r["prompts"] == 4 and "8" in r["tau_ddtree"] for r in evals.values())
    assert "8" in evals[6]["live"]["tau_ddtree"] and evals[6]["live"]["prompts"] == 4
    # live decoded in the config's worker processes (two here), with replay over live's own continuations
    assert evals[6]["live"]["replay_own"]["prompts"] >= 1
