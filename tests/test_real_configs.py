"""Every config under configs/ loads; a real target's drafter shape derives from its shipped
config.json alone (no weights); Qwen3.6-27B's equals z-lab's Qwen3.6-27B-DFlash drafter."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_dist.config import ConfigError, load_config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.target.loading import drafter_config_from_files, target_config_dict
from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
REAL = {  # config -> (cluster GPUs of its layout, drafter layers)
    "qwen3.6-27b.yaml": (16, 5),
    "qwen3.5-35b-a3b.yaml": (8, 8),
    "qwen3-8b.yaml": (8, 5),
}


def _shape(path):
    cfg = load_config(path, check_files=False)
    return cfg, drafter_config_from_files(path, target_dir=REPO / cfg.target.path)


def test_every_config_loads_and_the_real_ones_are_all_here():
    names = {p.name for p in CONFIGS}
    assert set(REAL) <= names and "tiny.yaml" in names
    for path in CONFIGS:
        load_config(path, check_files=False)
    load_config(REPO / "configs" / "tiny.yaml")  # the tiny one needs no files at all


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_derives_its_drafter_from_the_shipped_target_config(name):
    cfg, dc = _shape(REPO / "configs" / name)
    gpus, layers = REAL[name]
    assert cfg.target.kind == "hf" and cfg.target.path.startswith("configs/targets/")
    t = target_config_dict(REPO / cfg.target.path)
    assert (dc.hidden_size, dc.vocab_size, dc.num_target_layers) == (t["hidden_size"], t["vocab_size"],
                                                                    t["num_hidden_layers"])
    assert dc.num_hidden_layers == layers and dc.num_context_layers == 5 and dc.block_size == 16
    # the paper's recipe (SPEC 3)
    tr = cfg.train
    assert (tr.lr, tr.warmup_frac, tr.grad_clip, tr.epochs, tr.num_anchors) == (6e-4, 0.04, 1.0, 6, 512)
    assert cfg.data.max_length == 3072 and cfg.target.dtype == "bfloat16"
    # the layout adds up to the cluster it names, one GPU per role process
    used = (cfg.capture.num_actors * cfg.capture.gpus_per_actor + tr.world_size * tr.gpus_per_rank
            + cfg.eval.num_gpus)
    assert used == gpus and cfg.capture.max_buffer_bytes >= tr.world_size * cfg.capture.shard_bytes
    # the derived shape survives the export format and builds (meta device: no memory)
    assert DrafterConfig.from_hf_dict(json.loads(json.dumps(dc.to_hf_dict()))) == dc
    with torch.device("meta"):
        DFlashDrafter(dc)


def test_qwen36_27b_is_zlab_drafter_shape():
    _, dc = _shape(REPO / "configs" / "qwen3.6-27b.yaml")
    hf = dc.to_hf_dict()
    zlab = {  # z-lab/Qwen3.6-27B-DFlash (SpecForge configs/qwen3.6-27b-dflash.json)
        "architectures": ["DFlashDraftModel"], "block_size": 16, "hidden_size": 5120, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
        "vocab_size": 248320, "num_target_layers": 64, "rope_theta": 1e7, "use_sliding_window": True,
        "sliding_window": 2048, "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    }
    assert {k: hf[k] for k in zlab} == zlab


def test_qwen3_8b_is_dense_with_its_own_mask():
    cfg, dc = _shape(REPO / "configs" / "qwen3-8b.yaml")
    t = target_config_dict(REPO / cfg.target.path)
    assert "linear_attention" not in (t.get("layer_types") or []) and t["model_type"] == "qwen3"
    assert dc.mask_token_id == 151669 and dc.target_layer_ids == (1, 9, 17, 25, 33)
    assert not dc.has_sliding_layers


def test_shape_derivation_needs_no_weights_but_a_run_needs_files(tmp_path):
    path = REPO / "configs" / "qwen3-8b.yaml"
    with pytest.raises(ConfigError, match="data.train_path"):  # a run checks its files; the shape does not
        load_config(path, [f"target.path={REPO / 'configs/targets/qwen3-8b'}"])
    with pytest.raises(ConfigError, match="config.json not found"):
        drafter_config_from_files(path, target_dir=tmp_path)
    with pytest.raises(ConfigError, match="drafter.layer_types has 2 entries for drafter.num_layers=5"):
        load_config(path, ["drafter.layer_types=[full_attention, sliding_attention]"], check_files=False)
    with pytest.raises(ConfigError, match="set drafter.sliding_window"):
        load_config(path, ["drafter.layer_types=[sliding_attention, full_attention, full_attention, "
                           "full_attention, full_attention]"], check_files=False)
    with pytest.raises(ConfigError, match="drafter.layer_types"):
        load_config(path, ["drafter.layer_types=[local, full_attention, full_attention, full_attention, "
                           "full_attention]"], check_files=False)
