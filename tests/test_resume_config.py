"""Which config changes a resume accepts (trainer/resume.py): a field MAY_CHANGE names is harmless only
when it cannot change what is trained, including through a value derived from it; and a section that
never reaches the trainer (eval, ray, regen) never refuses a resume. Pure: marker dicts, no DeepSpeed."""

from __future__ import annotations

import pytest

from dflash_dist.config import Config
from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.checkpoint import ResumeError
from dflash_dist.trainer.resume import MAY_CHANGE, _flatten, check_resumable


def saved_marker(cfg: Config) -> dict:
    shard_dir = cfg.out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    return {"world_size": cfg.train.world_size, "config": cfg.to_dict(), "data": checkpoint.data_fingerprint(shard_dir)}


def base(tmp_path) -> Config:
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    return cfg


def test_max_length_is_refused_where_it_sets_the_packed_row_and_harmless_elsewhere(tmp_path):
    """With train.packing on and no train.micro_batch_tokens, a packed row holds micro_batch_size x
    data.max_length tokens (Config.pack_tokens): another data.max_length regroups every later
    micro-batch (another trajectory; the LR schedule, in samples, does not notice). It was accepted as
    'acts only through the shards'. Without packing, or with micro_batch_tokens, it stays harmless."""
    cfg = base(tmp_path)
    cfg.train.packing, cfg.train.micro_batch_size = True, 2
    saved = saved_marker(cfg)
    new = base(tmp_path)
    new.train.packing, new.train.micro_batch_size, new.data.max_length = True, 2, 4096
    assert cfg.pack_tokens() == 4096 and new.pack_tokens() == 8192
    with pytest.raises(ResumeError, match=r"data.max_length: 2048 -> 4096 \(the packed row's length: 4096 -> 8192"):
        check_resumable(saved, new.to_dict(), cfg.train.world_size, cfg.out / "shards", "ckpt")

    for packing, tokens in ((False, None), (True, 8192)):  # the row does not depend on data.max_length here
        cfg.train.packing, cfg.train.micro_batch_tokens = packing, tokens
        new.train.packing, new.train.micro_batch_tokens = packing, tokens
        saved = saved_marker(cfg)
        assert check_resumable(saved, new.to_dict(), 1, cfg.out / "shards", "ckpt") == ["data.max_length: 2048 -> 4096"]


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
