"""Which config changes a resume accepts (trainer/resume.py): a section that never reaches the trainer
(eval, ray, regen) never refuses a resume. Pure: marker dicts, no DeepSpeed."""

from __future__ import annotations

from dflash_dist.config import Config
from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.resume import MAY_CHANGE, _flatten, check_resumable


def saved_marker(cfg: Config) -> dict:
    shard_dir = cfg.out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    return {"world_size": cfg.train.world_size, "config": cfg.to_dict(), "data": checkpoint.data_fingerprint(shard_dir)}


def base(tmp_path) -> Config:
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    return cfg


def test_evaluation_ray_and_regenerate_settings_never_refuse_a_resume(tmp_path):
    """eval.live_workers and eval.reference_batch (the evaluator's processes and reference batch) were
    missing from MAY_CHANGE: raising eval.live_workers on --resume auto was refused as a
    training-relevant change. Every field of these sections is harmless, each one changed here."""
    cfg = base(tmp_path)
    saved = saved_marker(cfg)
    fields = _flatten(cfg.to_dict())
    outside = sorted(k for k in fields if k.split(".")[0] in ("eval", "ray", "regen"))
    assert not [k for k in outside if k not in MAY_CHANGE]
    new = base(tmp_path)
    new.eval.live_workers, new.eval.reference_batch = 8, 64
    assert check_resumable(saved, new.to_dict(), 1, cfg.out / "shards", "ckpt") == [
        "eval.live_workers: 1 -> 8",
        "eval.reference_batch: 32 -> 64",
    ]
