"""What the run reports as lost samples is what data.max_lost_fraction holds against it (trainer/
step_source.py): samples no rank could read plus those the capture skipped as non-finite, the latter
counted once per epoch that reads their directory (under keep every epoch re-reads epoch 0's shards
and misses its skipped samples again). TensorBoard's data/lost_samples, the TrainResult, and the
pipeline's final summary all say that total; the first two also say its parts.

A real one-rank Trainer (DeepSpeed on CPU over gloo) on the tiny target's captured samples."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.tb import scalars
from tests.helpers.tiny import NUM_SAMPLES, PER_SHARD, make_cfg, write_shards


def test_logged_and_printed_lost_samples_are_what_the_budget_holds(tiny, tmp_path, single_rank_gloo, capsys):
    """9 shards of 2, the first truncated (2 unreadable samples per epoch), and 1 sample the capture
    skipped, over 2 epochs (keep): the budget holds 2 x 2 + 2 x 1 = 6. TensorBoard logged only the
    unreadable 4 as data/lost_samples, and the pipeline summary added the skipped sample once (5)."""
    from data_pipeline.ledger import record_skipped
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.orchestration.pipeline import PipelineResult, _print_summary, samples_lost
    from dflash_dist.trainer.loop import Trainer

    shards, out = tmp_path / "shards", tmp_path / "run"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    record_skipped(shards, "k-nonfinite", "nonfinite_features", 0)  # the capture was given 19
    bad = shards / read_manifest(shards)[0].name
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    # 6 of the 2 x 19 planned samples are lost: 0.2 allows 7
    cfg = make_cfg(out, tiny["target_dir"], "data.max_lost_fraction=0.2", world_size=1, epochs=2, log_every=3,
                   checkpoint_every=100)  # fmt: skip
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES + 1)
    result = Trainer(cfg, job).run()
    unreadable, skipped = 2 * PER_SHARD, 2 * 1
    assert result.epochs_completed == 2
    assert (result.samples_lost, result.capture_skipped) == (unreadable + skipped, skipped)

    s = scalars(out / "tb" / "train")
    lost, unread, capture = (dict(s[f"data/{t}_samples"]) for t in ("lost", "unreadable", "capture_skipped"))
    assert lost.keys() == unread.keys() == capture.keys() and len(lost) >= 3, s.keys()
    assert all(lost[st] == unread[st] + capture[st] for st in lost)  # the total is its two parts at every point
    assert s["data/lost_samples"][-1][1] == unreadable + skipped
    assert (s["data/unreadable_samples"][-1][1], s["data/capture_skipped_samples"][-1][1]) == (unreadable, skipped)
    first = min(lost)  # step 3, in epoch 0 (its truncated shard is read first): epoch 0's directory once
    assert (lost[first], unread[first], capture[first]) == (PER_SHARD + 1, PER_SHARD, 1)

    # the pipeline's summary says the trainers' total (a capture alone: each directory's skipped once)
    assert samples_lost((result,), [shards]) == unreadable + skipped
    assert samples_lost((), [shards]) == 1
    paths = {"eval": tmp_path / "eval", "tb": out / "tb"}
    _print_summary(cfg, paths, PipelineResult(str(out), ("train",), (), (result,), (),
                                              samples_lost((result,), [shards]), None, 1.0))  # fmt: skip
    printed = capsys.readouterr().out
    assert (f"{unreadable + skipped} sample(s) lost ({unreadable} unreadable, {skipped} skipped by the capture, "
            "counted per epoch read; data.max_lost_fraction=0.2)") in printed, printed  # fmt: skip


@pytest.mark.parametrize("stop", ["epochs", "max_steps"])
def test_a_resume_that_trains_nothing_still_reports_what_the_budget_holds(tiny, tmp_path, single_rank_gloo, stop):
    """`--resume auto` over a run whose training is finished (the evaluator failed, say): the
    trainer resumes from the final checkpoint (every epoch done, or train.max_steps reached in
    epoch 0, its truncated shard already read) and has no step left to agree on. Its result still
    says what the budget held, unreadable plus capture-skipped per epoch read; it said the
    unreadable samples of finished epochs alone (both counts came from the slots, and no slot
    was run), so the pipeline summary printed "0 skipped by the capture"."""
    from data_pipeline.ledger import record_skipped
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.trainer.loop import STATE_VERSION, Trainer
    from dflash_dist.trainer.resume import decide

    shards, out = tmp_path / "shards", tmp_path / "run"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    record_skipped(shards, "k-nonfinite", "nonfinite_features", 0)
    bad = shards / read_manifest(shards)[0].name
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    train = {"max_steps": 3} if stop == "max_steps" else {}
    cfg = make_cfg(out, tiny["target_dir"], "data.max_lost_fraction=0.2", world_size=1, epochs=2, log_every=3,
                   checkpoint_every=100, **train)  # fmt: skip
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES + 1)
    first = Trainer(cfg, job).run()
    epochs = 1 if stop == "max_steps" else 2  # epochs read: each misses the truncated shard and the skipped sample
    held = (epochs * (PER_SHARD + 1), epochs * 1)
    assert (first.samples_lost, first.capture_skipped) == held

    decision = decide("auto", cfg, shards, (job.total_steps, job.schedule_unit), STATE_VERSION)
    again = Trainer(cfg, dataclasses.replace(job, resume=decision)).run()
    assert again.resumed_from is not None and again.steps == first.steps
    assert (again.samples_lost, again.capture_skipped) == held


@pytest.mark.parametrize("step", ["deepspeed", "lean"])
def test_optimizer_steps_skipped_for_a_non_finite_gradient_are_counted_and_printed(
    step, tiny, tmp_path, single_rank_gloo, capsys
):
    """A step whose gradient is not finite (one parameter's gradient made NaN in the backward of step
    2, a real hook; the loss stays finite) is skipped by the optimizer, as train.grad_overflow_check
    asks: its samples were read and counted trained, and nothing learned from them. Nobody read
    DeepSpeed's count (nor the lean step's device counter): the run ended 'done' saying nothing.
    TensorBoard (train/skipped_steps), the TrainResult, the run's summary and the Slurm trainer's
    last line (lost_text) now say it. Under the lean step too (on CPU its foreach-AdamW path, where
    the fp32 engine's check_grad_overflow is off: it had applied the NaN, and step 3's loss failed)."""
    import math

    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.orchestration.pipeline import PipelineResult, _print_summary
    from dflash_dist.trainer.loop import Trainer

    shards, out = tmp_path / "shards", tmp_path / "run"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    cfg = make_cfg(out, tiny["target_dir"], f"train.optimizer_step={step}", world_size=1, epochs=1, log_every=1,
                   checkpoint_every=100)  # fmt: skip
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    trainer = Trainer(cfg, job)
    param = next(p for p in trainer.engine.module.parameters() if p.requires_grad)
    backwards = []

    def poison(grad):
        backwards.append(1)
        return grad * float("nan") if len(backwards) == 2 else grad  # the 2nd backward: step 2 (grad_accum 1)

    param.register_hook(poison)
    result = trainer.run()
    assert cfg.train.grad_accum == 1 and len(backwards) == result.steps > 2
    assert result.skipped_steps == 1 and math.isfinite(result.final_loss)
    skipped = scalars(out / "tb" / "train")["train/skipped_steps"]
    assert skipped[0] == (1, 0) and all(n == 1 for _, n in skipped[1:]), skipped  # from step 2 on
    paths = {"eval": tmp_path / "eval", "tb": out / "tb"}
    _print_summary(cfg, paths, PipelineResult(str(out), ("train",), (), (result,), (), 0, None, 1.0))
    assert ("1 optimizer step(s) skipped for a non-finite gradient (their samples read, not learned from; "
            "train.grad_overflow_check)") in capsys.readouterr().out  # fmt: skip
