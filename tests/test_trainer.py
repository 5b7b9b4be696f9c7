"""The DeepSpeed trainer: our settings reach the engine; 2-rank Ray-actor groups (ZeRO-2 while the
shards are still being written, ZeRO-3) train, checkpoint, export and log to TensorBoard.

Real DeepSpeed over gloo and a real local Ray cluster started (and stopped) by this module, on a
tiny random Qwen3.5 target's captured features.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.actors.trainer_group import WorkerInfo, rank_environment
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.export import load_drafter
from dflash_dist.target.loading import load_embeddings
from dflash_dist.trainer.batching import batch_anchors, collate
from dflash_dist.trainer.ds_config import WarmupCosine, deepspeed_config, total_train_steps
from tests.conftest import reset_deepspeed_groups
from tests.helpers.procs import free_port
from tests.helpers.tb import histograms, scalars
from tests.helpers.tiny import NUM_SAMPLES, PER_SHARD, make_cfg, write_shards
from tests.helpers.zygote import TRAINER_MODULES, Zygote


def trainable_count(drafter_cfg) -> int:
    return sum(1 for n, _ in DFlashDrafter(drafter_cfg).named_parameters() if n not in DFlashDrafter.TARGET_KEYS)


# ---------------------------------------------------------------------------- pure pieces
def test_length_bucket_accuracy():
    from dflash_dist.trainer.step_log import length_bucket_accuracy

    correct = torch.tensor([3.0, 1.0, 5.0, 0.0])
    count = torch.tensor([4.0, 4.0, 10.0, 0.0])
    length = torch.tensor([100.0, 255.0, 256.0, 9000.0])
    got = length_bucket_accuracy(correct, count, length)
    assert got == {"train/acc_len_0_256": 0.5, "train/acc_len_256_512": 0.5}  # nothing supervised >= 4096


def test_rank_environment_single_and_multi_node():
    cpu = [WorkerInfo("n0", "10.0.0.5", ()), WorkerInfo("n0", "10.0.0.5", ())]
    envs = rank_environment(cpu, 1234)
    assert [e["MASTER_ADDR"] for e in envs] == ["127.0.0.1"] * 2
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert all(e["DS_ACCELERATOR"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in e for e in envs)
    gpu = [
        WorkerInfo("a", "10.0.0.1", ("1",)),
        WorkerInfo("a", "10.0.0.1", ("0",)),
        WorkerInfo("b", "10.0.0.2", ("3",)),
    ]
    envs = rank_environment(gpu, 99)
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "3"]
    with pytest.raises(ValueError, match="share GPUs"):
        rank_environment([WorkerInfo("a", "x", ("0",)), WorkerInfo("a", "x", ("0",))], 1)


def test_collate_pads_and_anchors_are_per_sample(tiny):
    a, b = tiny["samples"][0], tiny["samples"][1]
    t = collate([a, b], torch.float32)
    assert t["input_ids"].dtype == torch.int64 and t["features"].dtype == torch.float32
    assert t["loss_mask"][1, b.num_tokens :].sum() == 0 and b.num_tokens < a.num_tokens
    # anchors depend on (seed, epoch, key) only: not on the batch a sample lands in
    alone = batch_anchors([b], 4, seed=0, epoch=1)  # 4 of b's ~15 candidates
    paired = batch_anchors([a, b], 4, seed=0, epoch=1)
    n = int(alone.keep.sum())
    assert torch.equal(paired.positions[1, :n], alone.positions[0, :n])
    assert not torch.equal(batch_anchors([b], 4, seed=0, epoch=2).positions, alone.positions)
    assert bool((paired.positions[1][paired.keep[1]] < b.num_tokens - 1).all())


# ---------------------------------------------------------------------------- (a) settings reach DeepSpeed
def test_deepspeed_config_reaches_engine(tiny, tmp_path, monkeypatch):
    import torch.distributed as dist

    from dflash_dist.actors.trainer_group import join_group
    from dflash_dist.trainer.engine import build_engine

    cfg = make_cfg(
        tmp_path,
        tiny["target_dir"],
        zero_stage=1,
        zero_grad_reduce="reduce",
        grad_clip=0.25,
        micro_batch_size=3,
        grad_accum=2,
        warmup_frac=0.25,
        lr=1e-3,
    )
    ds = deepspeed_config(cfg, world_size=1, on_gpu=False)
    assert ds["train_batch_size"] == 6 and ds["bf16"] == {"enabled": False, "check_grad_overflow": True}
    assert deepspeed_config(cfg, world_size=4, on_gpu=True)["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert deepspeed_config(cfg, 4, True)["train_batch_size"] == 24

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)  # undone after the test: later subprocesses must not inherit a stale port
    monkeypatch.setenv("LOCAL_RANK", "0")
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    try:
        total = 8
        engine = build_engine(cfg, tiny["drafter"], tiny["target_dir"], total, world_size=1, on_gpu=False)
        assert engine.zero_optimization_stage() == 1
        assert engine.optimizer.use_multi_rank_bucket_allreduce is False  # train.zero_grad_reduce=reduce
        assert engine.gradient_clipping() == 0.25
        assert engine.train_micro_batch_size_per_gpu() == 3
        assert engine.gradient_accumulation_steps() == 2
        assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
        # DeepSpeed's throughput timer synchronized the device in every forward and step() (ds_config.py)
        assert not engine.tput_timer.config.enabled and not engine.tput_timer.config.synchronized
        assert next(engine.module.parameters()).dtype == torch.float32
        # the frozen target weights stay out of the optimizer
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        drafter = engine.module.drafter
        assert not drafter.lm_head.weight.requires_grad and not drafter.embed_tokens.weight.requires_grad
        assert trainable == sum(p.numel() for n, p in drafter.named_parameters() if n not in DFlashDrafter.TARGET_KEYS)
        # the LR schedule: warmup 25% of 8 steps = 2, then cosine; stepped once per optimizer step
        sched = WarmupCosine(total, 2)
        batch = collate(tiny["samples"][:3], torch.float32)
        anchors = batch_anchors(tiny["samples"][:3], 8, seed=0, epoch=0)
        lrs = []
        for _ in range(2 * 4):  # 4 optimizer steps of 2 micro-batches
            if engine.is_gradient_accumulation_boundary():
                lrs.append(engine.get_lr()[0])
            loss, _ = engine(
                batch["input_ids"],
                batch["features"],
                batch["loss_mask"],
                batch["target_argmax"],
                anchors.positions,
                anchors.keep,
            )
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 4
        assert lrs == pytest.approx([1e-3 * sched(s) for s in range(4)])
        assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
        assert engine.get_global_grad_norm() is not None and math.isfinite(float(engine.get_global_grad_norm()))
    finally:
        dist.destroy_process_group()
        reset_deepspeed_groups()


def test_the_gpu_engine_takes_the_in_place_one_kernel_step(tiny, tmp_path, single_rank_gloo):
    """build_engine on a GPU with train.optimizer_step=fused (here its bf16 config on the CPU, the torch kernels):
    the one-kernel AdamW reads each gradient in place, with the end-of-backward synchronize as a device-side wait
    (zero_step.trainer_options); on the CPU the gathered step with DeepSpeed's synchronize."""
    from dflash_dist.trainer.engine import build_engine  # imported late, as the trainer actor does

    cfg = make_cfg(tmp_path, tiny["target_dir"], optimizer_step="fused", kernels="torch")
    gpu = build_engine(cfg, tiny["drafter"], tiny["target_dir"], 8, world_size=1, on_gpu=True).optimizer
    assert gpu.dflash_one_kernel and not gpu.dflash_gather and "independent_gradient_partition_epilogue" in vars(gpu)
    cpu = build_engine(cfg, tiny["drafter"], tiny["target_dir"], 8, world_size=1, on_gpu=False).optimizer
    assert cpu.dflash_one_kernel and cpu.dflash_gather and "independent_gradient_partition_epilogue" not in vars(cpu)


def test_total_train_steps_needs_a_length(tiny, tmp_path):
    cfg = make_cfg(tmp_path, tiny["target_dir"])
    assert total_train_steps(cfg, 2, 18) == 3 * (18 // 4)
    cfg.train.max_steps = 5
    assert total_train_steps(cfg, 2, 18) == 5 and total_train_steps(cfg, 2, None) == 5
    cfg.train.max_steps = None
    with pytest.raises(ValueError, match="max_steps"):
        total_train_steps(cfg, 2, None)


def test_packed_run_follows_an_lr_schedule_over_samples_and_resumes_it(tiny, tmp_path, single_rank_gloo):
    """train.packing: a step holds a varying number of samples, so the schedule counts samples:
    every step's LR is the warmup-cosine value at the samples trained before it (on all ranks),
    the LR is near 0 at the end of the data (a schedule over the 54 steps of unpacked micro-batches
    would still be at ~0.5 after the ~27 packed steps), and a resume continues it bit for bit."""
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.trainer import checkpoint
    from dflash_dist.trainer.loop import TRAIN_LOG, Trainer
    from dflash_dist.trainer.resume import decide
    from dflash_dist.trainer.state import STATE_VERSION

    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    out = tmp_path / "run"
    cfg = make_cfg(out, tiny["target_dir"], "data.max_length=32", world_size=1, micro_batch_size=1, packing=True,
                   micro_batch_tokens=64, epochs=3, checkpoint_every=8, keep_checkpoints=10, lr=5e-3,
                   warmup_frac=0.1)  # fmt: skip
    assert cfg.pack_tokens() == 64 and cfg.schedule_unit() == "sample"
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    assert (job.total_steps, job.schedule_unit) == (3 * NUM_SAMPLES, "sample")

    result = Trainer(cfg, job).run()
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    assert result.steps == len(rows) and len(rows) < 2 * NUM_SAMPLES  # ~2 samples per packed row
    assert rows[-1]["samples"] == 3 * NUM_SAMPLES  # one rank: nothing dropped
    sched = WarmupCosine(3 * NUM_SAMPLES, math.ceil(0.1 * 3 * NUM_SAMPLES), unit="sample")
    before = [0] + [r["samples"] for r in rows[:-1]]
    expected = []
    for done in before:
        sched.done = done
        expected.append(5e-3 * sched(0))
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-9)
    assert rows[-1]["lr"] < 0.05 * 5e-3
    assert WarmupCosine(3 * NUM_SAMPLES, 6)(len(rows)) > 0.3  # a schedule over the 54 unpacked steps

    reference = (out / TRAIN_LOG).read_text()
    resume_from = out / "checkpoints" / "step_8"
    assert checkpoint.read_marker(resume_from) is not None
    decision = decide(str(resume_from), cfg, shards, (job.total_steps, job.schedule_unit), STATE_VERSION)
    again = Trainer(cfg, dataclasses.replace(job, resume=decision)).run()
    assert again.resumed_from == str(resume_from) and again.steps == result.steps
    assert (out / TRAIN_LOG).read_text() == reference



def test_a_trainer_on_fp8_shards_trains_on_the_decoded_features(tiny, tmp_path, single_rank_gloo):
    """capture.feature_dtype=fp8: the same samples written as fp8 shards train one rank for real;
    the per-step losses follow the raw-feature run closely (fp8 rounding, not garbage)."""
    from data_pipeline.feature_codec import FP8
    from dflash_dist.trainer.loop import TRAIN_LOG, Trainer, TrainJob

    losses = {}
    for name, prov in (("raw", tiny["prov"]), ("fp8", dataclasses.replace(tiny["prov"], feature_encoding=FP8))):
        shards, out = tmp_path / name / "shards", tmp_path / name / "run"
        write_shards(shards, prov, tiny["samples"][:8], done=True)
        cfg = make_cfg(out, tiny["target_dir"], world_size=1, max_steps=4, checkpoint_every=100)
        cfg.capture.feature_dtype = "fp8" if name == "fp8" else "bf16"
        result = Trainer(cfg, TrainJob(str(tiny["target_dir"]), str(shards), prov, tiny["drafter"], 4)).run()
        assert result.steps == 4 and result.samples_consumed > 0
        losses[name] = [json.loads(line)["loss"] for line in (out / TRAIN_LOG).read_text().splitlines()]
    assert len(losses["fp8"]) == 4 and all(math.isfinite(x) for x in losses["fp8"])
    assert losses["fp8"] != losses["raw"]  # the features did go through fp8
    assert losses["fp8"] == pytest.approx(losses["raw"], rel=0.05)

# ---------------------------------------------------------------------------- (b) ZeRO-2 while streaming
def test_zero2_group_streams_trains_checkpoints_exports(tiny, ray_cluster, tmp_path):
    from dflash_dist.actors.trainer_group import start_trainer_group

    out, shards = tmp_path / "run", tmp_path / "shards"
    samples = tiny["samples"]
    first = 4 * PER_SHARD
    write_shards(shards, tiny["prov"], samples[:first], done=False)  # capture still running
    cfg = make_cfg(out, tiny["target_dir"], zero_stage=2, histogram_every=4)
    t0 = time.time()
    group = start_trainer_group(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    # the trainers start on 4 shards; the rest arrive while rank 0 logs its first steps
    tb = out / "tb" / "train"
    while not (tb.is_dir() and any(tb.iterdir())) and time.time() - t0 < 120:
        time.sleep(0.5)
    time.sleep(2.0)
    with ShardWriter(shards, tiny["prov"], prefix="late") as w:
        for i, s in enumerate(samples[first:]):
            w.write(s)
            if i % PER_SHARD == PER_SHARD - 1:
                w.flush()
    mark_done(shards)
    results = group.wait(timeout_s=300)

    # 5 steps an epoch: the 5th trains rank 0's odd shard while rank 1 fills its slot with an empty batch
    assert [r.rank for r in results] == [0, 1]
    assert all(r.steps == 15 and r.epochs_completed == 3 for r in results)
    assert [r.samples_consumed for r in results] == [30, 24]  # every sample once per epoch: nothing dropped
    assert [r.samples_lost for r in results] == [0, 0]
    assert results[0].checkpoints == ("step_4", "step_8", "step_12", "step_15")
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_15"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_12", "step_15"]  # keep_checkpoints=2
    # exports: one loadable directory per checkpoint, nothing else
    tags = ("step_4", "step_8", "step_12", "step_15")
    assert results[0].exports == tuple(str(out / "export" / t) for t in tags)
    assert sorted(p.name for p in (out / "export").iterdir()) == sorted(tags)
    embed, head = load_embeddings(tiny["target_dir"])
    for path in results[0].exports:
        drafter = load_drafter(path, embed, head)
        assert drafter.config == tiny["drafter"]
    # metrics
    s = scalars(out / "tb" / "train")
    for tag in (
        "train/loss",
        "train/acc_slot_1",
        "train/acc_slot_3",
        "train/grad_norm",
        "train/lr",
        "train/tokens_per_s",
        "data/wait_frac",
        "data/lost_samples",
        "data/epoch",
    ):
        assert tag in s, f"{tag} missing from {sorted(s)}"
    loss = [v for _, v in s["train/loss"]]
    assert [st for st, _ in s["train/loss"]] == list(range(1, 16))
    assert sum(loss[-3:]) / 3 < loss[0] - 0.3, loss
    assert all(0 <= v <= 1 for _, v in s["data/wait_frac"]) and max(v for _, v in s["data/wait_frac"]) > 0
    assert all(v > 0 for _, v in s["train/tokens_per_s"])
    assert [(st, v) for st, v in s["data/epoch"]] == [(5, 1), (10, 2), (15, 3)]
    # diagnostics: accuracy by length bucket (samples here are 32 tokens), histograms of the
    # per-sample loss (every log: 2 ranks x 2 samples) and of per-parameter gradient norms
    assert [st for st, _ in s["train/acc_len_0_256"]] == list(range(1, 16))
    assert not any(t.startswith("train/acc_len_256") for t in s)
    h = histograms(out / "tb" / "train")
    per_log = [(st, 2 if st % 5 == 0 else 4) for st in range(1, 16)]  # 2 ranks x 2 samples; rank 0 alone at 5
    assert [(st, n) for st, n, *_ in h["train/loss_per_sample"]] == per_log
    grads = h["train/grad_norm_per_param"]
    assert [(st, n) for st, n, *_ in grads] == [(st, trainable_count(tiny["drafter"])) for st in (4, 8, 12)]
    assert all(lo > 0 and math.isfinite(hi) for _, _, lo, hi in grads)  # every parameter got a gradient
    assert results[0].final_loss == pytest.approx(loss[-1], rel=1e-5)


# ---------------------------------------------------------------------------- (c) ZeRO-3 export, resume
def test_zero3_group_exports_the_gathered_drafter_and_resumes(tiny, ray_cluster, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dflash_dist.actors.trainer_group import start_trainer_group

    out, shards = tmp_path / "run", tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    cfg = make_cfg(
        out, tiny["target_dir"], zero_stage=3, max_steps=3, epochs=1, checkpoint_every=100, histogram_every=2
    )
    total = 6  # the LR schedule of the whole run, interrupted at step 3 and resumed below
    args = (tiny["target_dir"], shards, tiny["prov"], tiny["drafter"])
    results = start_trainer_group(cfg, *args, total_steps=total).wait(timeout_s=300)
    assert all(r.steps == 3 for r in results) and results[0].checkpoints == ("step_3",)

    embed, head = load_embeddings(tiny["target_dir"])
    exported = load_drafter(out / "export" / "step_3", embed, head)
    # the engine's module at step 3, rebuilt from the ranks' ZeRO-3 partitions in the checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_3")
    engine_drafter = DFlashDrafter(tiny["drafter"])
    own = {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}
    assert set(own) == set(engine_drafter.drafter_state_dict())
    engine_drafter.load_state_dict(own, strict=False)
    engine_drafter.set_target_weights(embed, head)
    engine_drafter.eval()
    torch.manual_seed(0)  # build_engine's initialisation (run.seed = 0)
    fresh = DFlashDrafter(tiny["drafter"])
    assert not torch.equal(fresh.fc.weight, exported.fc.weight)  # it trained
    s = tiny["samples"][0]
    with torch.no_grad():
        for start in (10, 20):
            a = exported.draft_block(s.features.float(), int(s.input_ids[start]), start)
            b = engine_drafter.draft_block(s.features.float(), int(s.input_ids[start]), start)
            assert torch.equal(a, b)

    # resume: steps 4 and 5 finish epoch 0 from the saved reader positions (step 5: rank 0's odd
    # shard, rank 1 an empty slot; the epoch is closed when the next step is asked for); the LR continues
    cfg2 = make_cfg(
        out, tiny["target_dir"], zero_stage=3, max_steps=5, epochs=2, checkpoint_every=100, histogram_every=2
    )
    results = start_trainer_group(cfg2, *args, total_steps=total).wait(timeout_s=300)
    assert results[0].resumed_from.endswith("step_3")
    assert [(r.steps, r.epochs_completed, r.samples_consumed) for r in results] == [(5, 0, 4), (5, 0, 2)]
    assert [r.samples_lost for r in results] == [0, 0]
    tb = scalars(out / "tb" / "train")
    assert [st for st, _ in tb["train/loss"]] == [1, 2, 3, 4, 5]
    lr = dict(tb["train/lr"])
    sched = WarmupCosine(total, 1)
    assert [lr[st] for st in (1, 2, 3, 4, 5)] == pytest.approx([cfg.train.lr * sched(i) for i in range(5)])
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_5"
    # ZeRO-3 gathers each partitioned gradient for the histogram (steps 2 and 4)
    grads = histograms(out / "tb" / "train")["train/grad_norm_per_param"]
    assert [(st, n) for st, n, *_ in grads] == [(st, trainable_count(tiny["drafter"])) for st in (2, 4)]
    assert all(lo > 0 for _, _, lo, _ in grads)


def test_the_group_reports_the_rank_that_names_the_lost_samples(ray_cluster, tmp_path):
    """Every rank raises DataLost at the same slot, and only the ranks that hit the unreadable
    samples can name them: when a rank that names nothing finishes first, the group still reports
    a rank that names them (before, whichever finished first was reported: 'none here')."""
    import ray

    from dflash_dist.actors.trainer_group import TrainerGroup, TrainerGroupError
    from tests.helpers.lost_rank import rank_raises_data_lost

    task = ray.remote(num_cpus=0)(rank_raises_data_lost)
    flag = str(tmp_path / "rank1_raising")
    refs = [task.remote("cap-000000.tar: truncated", flag), task.remote("", flag)]  # rank 1 first
    with pytest.raises(TrainerGroupError, match=r"DataLost: .*cap-000000.tar: truncated") as err:
        TrainerGroup([], refs, []).wait(timeout_s=60)
    assert err.value.rank == 0


# ---------------------------------------------------------------------------- (d) a corrupt shard
def test_unreadable_shard_fails_the_run_or_is_accounted_within_the_allowed_fraction(tiny, ray_cluster, tmp_path):
    """A truncated shard: by default (data.max_lost_fraction 0) every rank stops at the same slot
    with DataLost naming the shard; allowed a fraction, its samples are counted as lost (every
    epoch it is read), the ranks stay in lock-step and trained + lost is every sample of every epoch."""
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.actors.trainer_group import TrainerGroupError, start_trainer_group

    out, shards = tmp_path / "run", tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    bad = shards / read_manifest(shards)[0].name  # epoch 0: rank 0's first shard
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    cfg = make_cfg(out, tiny["target_dir"], zero_stage=2, epochs=2, checkpoint_every=100, log_every=2)
    group = start_trainer_group(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    with pytest.raises(TrainerGroupError, match=rf"DataLost: 2 sample\(s\) could not be read.*{bad.name}.*truncated"):
        group.wait(timeout_s=300)
    assert not (out / "checkpoints" / "latest").exists()  # failed before its first checkpoint

    out = tmp_path / "run2"
    cfg = make_cfg(out, tiny["target_dir"], "data.max_lost_fraction=0.25", zero_stage=2, epochs=2,
                   checkpoint_every=100, log_every=2)  # 4 of 36 planned samples are lost
    group = start_trainer_group(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM_SAMPLES)
    results = group.wait(timeout_s=300)
    assert all(r.epochs_completed == 2 for r in results)
    assert len({r.steps for r in results}) == 1  # lock-step: the rank that lost a shard pads its slots
    assert all(r.samples_lost == 2 * PER_SHARD for r in results)  # one shard of 2 samples, in each of 2 epochs
    # nothing dropped: every sample of every epoch is trained once or counted as lost
    assert sum(r.samples_consumed for r in results) + 2 * PER_SHARD == 2 * NUM_SAMPLES
    s = scalars(out / "tb" / "train")
    assert s["data/lost_samples"][-1][1] == 2 * PER_SHARD
    assert all(math.isfinite(v) for _, v in s["train/loss"])


# ---------------------------------------------------------------------------- (e) loss normalisation
def _truncated(s: Sample, t: int) -> Sample:
    return Sample(s.key, s.input_ids[:t], s.loss_mask[:t], s.features[:t], s.target_argmax[:t])


def _capture_step_grads(spec_path: str) -> None:
    """One rank of test_step_slots_gradient_is_the_slot_weighted_mean_over_step_and_ranks (a fork of
    a zygote, tests/helpers/zygote.py, its rank environment set): for each loss_norm, one real
    Trainer step, with the full gradient of every trainable parameter taken at the accumulation
    boundary, before the step clips and applies it (rank 0 saves it)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from safetensors.torch import save_file

    from data_pipeline.provenance import Provenance
    from dflash_dist.actors.trainer_group import join_group
    from dflash_dist.config import load_config_dict
    from dflash_dist.model.config import DrafterConfig
    from dflash_dist.trainer.loop import Trainer, TrainJob

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    j = spec["job"]
    drafter = DrafterConfig(**(j["drafter"] | {"target_layer_ids": tuple(j["drafter"]["target_layer_ids"])}))
    job = TrainJob(**(j | {"provenance": Provenance.from_dict(j["provenance"]), "drafter": drafter}))
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    try:
        for mode, cfg_dict in spec["cfgs"].items():
            trainer = Trainer(load_config_dict(cfg_dict), job)
            grads: dict[str, torch.Tensor] = {}
            real_step = trainer.engine.step

            def step(*args, _trainer=trainer, _grads=grads, _real=real_step, **kw):
                if _trainer.engine.is_gradient_accumulation_boundary() and not _grads:
                    for name, p in _trainer.engine.module.named_parameters():
                        if p.requires_grad:
                            _grads[name] = safe_get_full_grad(p).detach().clone()
                return _real(*args, **kw)

            trainer.engine.step = step
            result = trainer.run()
            assert result.steps == 1 and grads, (mode, result)
            if dist.get_rank() == 0:
                save_file(grads, str(Path(spec["out"]) / f"{mode}.grads.safetensors"))
            print(json.dumps(dataclasses.asdict(result)))
    finally:
        dist.destroy_process_group()


def test_step_slots_gradient_is_the_slot_weighted_mean_over_step_and_ranks(tiny, tmp_path):
    """train.loss_norm: 2 ranks x 2 accumulated micro-batches of one sample each, long and short
    samples mixed. "step_slots" yields the gradient of sum(w*CE) / sum(w) over all 4 samples
    (every supervised slot counts the same), "micro_batch" that of the mean of the 4 per-sample
    means; both checked against a single-process reference over the same samples and anchors
    (from the sample log), and they differ."""
    from safetensors.torch import load_file

    from dflash_dist.model.loss import dflash_loss
    from dflash_dist.trainer.batching import make_micro_batch
    from dflash_dist.trainer.loop import SAMPLE_LOG, TRAIN_LOG, TrainJob

    samples = [_truncated(s, 32 if i % 2 else 15) for i, s in enumerate(tiny["samples"][:8])]  # 3 or 14-20 supervised
    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], samples, done=True)
    # fixed slot weights (decay): the reference below weights with dflash_loss's own decay weights
    cfgs = {
        mode: make_cfg(tmp_path / mode, tiny["target_dir"], micro_batch_size=1, grad_accum=2, max_steps=1, epochs=1,
                       loss_norm=mode, log_sample_keys=True, checkpoint_every=100,
                       position_weighting="decay")  # fmt: skip
        for mode in ("step_slots", "micro_batch")
    }
    job = TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=4)
    spec = tmp_path / "spec.json"
    job_dict = dataclasses.asdict(job) | {"provenance": job.provenance.to_dict()}
    spec.write_text(json.dumps({"cfgs": {m: c.to_dict() for m, c in cfgs.items()}, "job": job_dict,
                                "out": str(tmp_path)}))  # fmt: skip
    port = str(free_port())
    # both ranks forked from one process that imported torch, DeepSpeed and the trainer once
    zygote = Zygote([*TRAINER_MODULES, "tests.test_trainer"], tmp_path / "zygote.log")
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    try:
        procs = [zygote.start("tests.test_trainer:_capture_step_grads", [str(spec)],
                              {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, logs[rank])
                 for rank in range(2)]  # fmt: skip
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        zygote.close()  # kills a rank still running
    assert codes == [0, 0], "\n".join(log.read_text()[-4000:] for log in logs)

    # the reference: the drafter as build_engine initialises it, the step's 4 micro-batches
    # rebuilt from the sample logs (anchors are seeded by (seed, epoch, key))
    by_key = {s.key: s for s in samples}
    cfg = cfgs["step_slots"]
    logs = [(cfg.out / SAMPLE_LOG / f"rank_{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    keys = [json.loads(line)["keys"] for lines in logs for line in lines]
    assert len(keys) == 4 and all(len(k) == 1 for k in keys)
    assert min(by_key[k[0]].num_tokens for k in keys) == 15 < max(by_key[k[0]].num_tokens for k in keys)
    torch.manual_seed(cfg.run.seed)
    drafter = DFlashDrafter(tiny["drafter"])
    drafter.set_target_weights(*load_embeddings(tiny["target_dir"]))
    batches = [make_micro_batch([by_key[k[0]]], {}, dtype=torch.float32, num_anchors=cfg.train.num_anchors,
                                seed=cfg.run.seed, epoch=0) for k in keys]  # fmt: skip

    def grad_of(objective: str) -> tuple[torch.Tensor, float]:
        drafter.zero_grad()
        wce, weight = [], []
        for b in batches:
            one = torch.tensor(1.0)
            out = dflash_loss(drafter, b.input_ids, b.features, b.loss_mask, b.anchors, loss_denominator=one)
            wce.append(out.loss)  # sum(w*CE) of the micro-batch
            weight.append(out.weight_sum)
        if objective == "step_slots":
            loss = sum(wce) / sum(weight)
        else:
            loss = sum(x / (w + 1e-6) for x, w in zip(wce, weight)) / len(batches)
        loss.backward()
        grads = {f"drafter.{n}": p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
        return torch.cat([grads[n].flatten() for n in sorted(grads)]), float(loss.detach())

    def flat(mode: str) -> torch.Tensor:
        got = load_file(str(tmp_path / f"{mode}.grads.safetensors"))
        return torch.cat([got[n].flatten() for n in sorted(got)])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    ref = {mode: grad_of(mode) for mode in cfgs}
    for mode in cfgs:
        assert rel(flat(mode), ref[mode][0]) < 1e-4, mode
        logged = json.loads((cfgs[mode].out / TRAIN_LOG).read_text().splitlines()[0])["loss"]
        assert logged == pytest.approx(ref[mode][1], rel=1e-5), mode  # the step's loss as each mode defines it
    assert rel(ref["micro_batch"][0], ref["step_slots"][0]) > 0.05  # the two objectives differ here
