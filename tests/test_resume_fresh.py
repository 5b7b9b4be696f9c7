"""A run that stops before its first checkpoint starts again from step 0 (`--resume auto` finds
nothing to resume, the driver's restart of a group that died early, a Slurm requeue): its step logs
are cut to step 0, and TensorBoard must drop the stopped attempt's points as a resume drops those
after its checkpoint. A real one-rank Trainer (DeepSpeed on CPU over gloo) on the tiny target."""

from __future__ import annotations

import pytest

from tests.helpers.runs import read_jsonl
from tests.helpers.tb import scalars
from tests.helpers.tiny import NUM_SAMPLES, make_cfg, write_shards


def test_a_start_over_after_a_stop_before_the_first_checkpoint_shows_each_step_once(tiny, tmp_path, single_rank_gloo):
    """The first attempt logs steps 1 and 2 and dies in step 3, before any checkpoint; the second
    starts at step 0 and trains to step 4. TensorBoard showed steps 1 and 2 twice (purge_step was
    given only on a resume): [1, 2, 1, 2, 3, 4]."""
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.trainer.checkpoint import plan_resume
    from dflash_dist.trainer.loop import TRAIN_LOG, Trainer

    shards, out = tmp_path / "shards", tmp_path / "run"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    cfg = make_cfg(out, tiny["target_dir"], world_size=1, max_steps=4, log_every=1, checkpoint_every=100)
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    first = Trainer(cfg, job)
    step = first.train_step

    def dies_in_step_3() -> bool:
        if first.state.step == 2:
            raise RuntimeError("killed in step 3")
        return step()

    first.train_step = dies_in_step_3
    with pytest.raises(RuntimeError, match="killed in step 3"):
        first.run()
    assert plan_resume("auto", out / "checkpoints") is None  # nothing to resume: the next attempt starts over
    assert [st for st, _ in scalars(out / "tb" / "train")["train/loss"]] == [1, 2]

    result = Trainer(cfg, job).run()
    assert result.resumed_from is None and result.steps == 4
    assert [r["step"] for r in read_jsonl(out / TRAIN_LOG)] == [1, 2, 3, 4]
    assert [st for st, _ in scalars(out / "tb" / "train")["train/loss"]] == [1, 2, 3, 4]
