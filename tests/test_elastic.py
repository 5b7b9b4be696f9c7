"""Elastic resume: a checkpoint saved by 1 rank resumed on 2, and the 2-rank checkpoint that run
saves resumed on 1 again, through DeepSpeed's universal checkpoint (ZeRO-1, 2 and 3; ZeRO-0
is refused).

After each resume, before training on: the same step and epoch; every trainable parameter's
fp32 weight and AdamW exp_avg / exp_avg_sq (gathered from the ZeRO partitions, per parameter
name) equal to the saving run's at that step; the same AdamW step count, LR and per-group
weight decay. Then training continues, every sample is trained exactly once per epoch across
the world-size changes, and the epoch remainder is counted once (globally).

Real DeepSpeed over gloo: 1 rank in this process, 2 ranks as subprocesses of this module
(`python -m tests.test_elastic SPEC`), on the tiny target of tests/helpers/tiny.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from dflash_dist.config import Config, load_config_dict
from dflash_dist.trainer import checkpoint, universal
from dflash_dist.trainer.checkpoint import ResumeError
from dflash_dist.trainer.ds_config import WarmupCosine
from dflash_dist.trainer.loop import SAMPLE_LOG, TRAIN_LOG, TrainJob
from dflash_dist.trainer.resume import check_resumable, decide
from dflash_dist.trainer.state import STATE_VERSION
from dflash_dist.trainer.step_source import StepSource
from tests.conftest import REPO, reset_deepspeed_groups
from tests.helpers.jobs import job_from_json
from tests.helpers.procs import free_port
from tests.helpers.runs import read_jsonl
from tests.helpers.tiny import make_cfg, write_shards

NUM = 16  # 8 shards of 2 samples; a step trains 2 samples per rank
TOTAL = 13  # the LR schedule's length, the same in every attempt (the run's 13 steps)
FIRST, SECOND = 3, 7  # 1 rank saves at step 3 (epoch 0), 2 ranks at step 7 (epoch 1)


# ---------------------------------------------------------------------------- pure pieces
def test_world_size_change_allowed_for_zero_1_2_3_refused_for_zero_0(tmp_path):
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    cfg.train.world_size = 2
    shard_dir = cfg.out / "shards"
    shard_dir.mkdir(parents=True)
    new = load_config_dict(cfg.to_dict())
    new.train.world_size = 1
    for stage in (1, 2, 3):
        cfg.train.zero_stage = new.train.zero_stage = stage
        saved = {"world_size": 2, "config": cfg.to_dict(), "data": checkpoint.data_fingerprint(shard_dir)}
        assert check_resumable(saved, new.to_dict(), 1, shard_dir, "ckpt") == ["train.world_size: 2 -> 1"]
    cfg.train.zero_stage = new.train.zero_stage = 0
    saved = {"world_size": 2, "config": cfg.to_dict(), "data": checkpoint.data_fingerprint(shard_dir)}
    with pytest.raises(ResumeError, match=r"saved by 2 ranks, this group has 1: .*ZeRO stages 1, 2, 3 .*ZeRO-0"):
        check_resumable(saved, new.to_dict(), 1, shard_dir, "ckpt")
    assert check_resumable(saved, cfg.to_dict(), 2, shard_dir, "ckpt") == []  # same size: fine
    # a world-size change does not excuse a training-relevant one
    new.train.zero_stage, new.train.lr = 2, 1.0
    cfg.train.zero_stage = 2
    saved["config"] = cfg.to_dict()
    with pytest.raises(ResumeError, match=r"train.lr: 0.0006 -> 1.0"):
        check_resumable(saved, new.to_dict(), 1, shard_dir, "ckpt")


def test_source_state_for_another_world_size(tiny, shards):
    """2 ranks stop mid-epoch (rank 0 inside a shard); 1 rank, or 3, take over from the merged
    position: every sample of the epoch exactly once, over the old and the new ranks, and the
    samples trained so far in the epoch are carried as one count."""
    from data_pipeline.shard_reader import ShardStream

    def stream(rank, world):
        return ShardStream(shards, tiny["prov"], rank, world, epoch=1, seed=0, shuffle=True)

    def source_state(reader, trained):
        return {"version": 1, "epoch": 1, "reader": reader, "trained": trained, "carried": 0, "lost_before": 0}

    saved, before = [], []
    for rank, n in ((0, 3), (1, 2)):  # rank 0 stops inside its second shard (2 samples each)
        s = stream(rank, 2)
        it = iter(s)
        before += [next(it).key for _ in range(n)]
        saved.append(source_state(s.state_dict(), n))
    assert StepSource.for_world(saved, 1, 2) == saved[1]  # the same world size: the rank's own
    fresh = [source_state(None, 0), source_state(None, 0)]
    assert StepSource.for_world(fresh, 0, 1)["reader"] is None  # the epoch had not begun
    for world in (1, 3):
        after = []
        for rank in range(world):
            state = StepSource.for_world(saved, rank, world)
            assert (state["epoch"], state["trained"], state["carried"]) == (1, 0, 5)
            s = stream(rank, world)
            s.load_state_dict(state["reader"])
            after += [x.key for x in s]
        assert Counter(before + after) == Counter(x.key for x in tiny["samples"][:NUM]), world


def test_universal_conversion_is_atomic_and_cached(tmp_path):
    """A tag without a complete copy converts; a crashed conversion's leftovers look incomplete."""
    tag = tmp_path / "step_2"
    tag.mkdir()
    (tag / universal.UNIVERSAL).mkdir()  # a rename target left half-written by hand, no marker
    (tag / f".{universal.UNIVERSAL}.tmp-1").mkdir()  # a crashed conversion's temp directory
    assert not universal.is_converted(tag)
    with pytest.raises(FileNotFoundError):  # nothing to convert: DeepSpeed's own error
        universal.convert(tag)
    assert not universal.is_converted(tag) and not (tag / universal.UNIVERSAL).exists()


# ---------------------------------------------------------------------------- 1 -> 2 -> 1 ranks
def engine_state(engine) -> tuple[dict[str, torch.Tensor], dict]:
    """Every trainable parameter's full fp32 weight and AdamW moments (a collective under ZeRO),
    and the optimizer's scalars."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
    )

    opt = engine.optimizer
    if engine.zero_optimization_stage() in (1, 2):
        # DeepSpeed 0.19.8 links the parameters' views of the AdamW state once, right after the
        # first step of group 0, when group 1 has none yet: link again to read group 1's
        for i, params in enumerate(opt.bit16_groups):
            lazy_init_hp_params_optimizer_state(params, opt.single_partition_of_fp32_groups[i], opt.optimizer.state)
    tensors = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            tensors[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    base = engine.optimizer.optimizer  # torch AdamW under the ZeRO optimizer
    scalars = {
        "adam_steps": sorted({float(s["step"]) for s in base.state.values()}),
        "lr": engine.get_lr(),
        "weight_decay": [g["weight_decay"] for g in engine.optimizer.param_groups],
        "global_steps": engine.global_steps,
        "schedule_last_epoch": engine.lr_scheduler.last_epoch,
    }
    return tensors, scalars


def dump_state(engine, path: Path) -> None:
    from safetensors.torch import save_file

    tensors, scalars = engine_state(engine)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        save_file(tensors, str(path.with_suffix(".safetensors")))
        path.with_suffix(".json").write_text(json.dumps(scalars))


def load_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(str(path.with_suffix(".safetensors"))), json.loads(path.with_suffix(".json").read_text())


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert a[0].keys() == b[0].keys() and len(a[0]) > 0
    for key in a[0]:
        assert torch.equal(a[0][key], b[0][key]), key
    assert a[1] == b[1]


def job_for(tiny, shards: Path, cfg: Config, resume_from: Path | None) -> TrainJob:
    decision = None if resume_from is None else decide(str(resume_from), cfg, shards, (TOTAL, "step"), STATE_VERSION)
    return TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=TOTAL,
                    resume=decision)  # fmt: skip


def run_in_process(cfg: Config, job: TrainJob, dump: Path):
    """One rank here: the trainer's state right after it resumed (`<dump>_resumed`) and after its
    run (`<dump>_final`)."""
    import torch.distributed as dist

    from dflash_dist.actors.trainer_group import join_group
    from dflash_dist.trainer.loop import Trainer

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    os.environ.update(env, LOCAL_RANK="0")  # put back after the module by conftest's _rank_env_module
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    try:
        trainer = Trainer(cfg, job)
        if job.resume is not None:
            assert trainer.engine.load_universal_checkpoint()
            dump_state(trainer.engine, dump.with_name(dump.name + "_resumed"))
        result = trainer.run()
        dump_state(trainer.engine, dump.with_name(dump.name + "_final"))
        return result
    finally:
        dist.destroy_process_group()
        reset_deepspeed_groups()


def run_two_ranks(runs: list[tuple[Config, TrainJob, Path]], name: Path) -> list[list[dict]]:
    """Two ranks as subprocesses running `main` below, one trainer after the other for each (cfg, job,
    dump) of `runs` in their one process group; returns each run's TrainResults (as dicts)."""
    spec = name.with_name(name.name + ".spec.json")
    spec.write_text(json.dumps({"runs": [{"cfg": cfg.to_dict(), "dump": str(dump),
                                          "job": dataclasses.asdict(job) | {"provenance": job.provenance.to_dict()}}
                                         for cfg, job, dump in runs]}))  # fmt: skip
    port = str(free_port())
    procs = []
    with contextlib.ExitStack() as stack:
        for rank in range(2):
            env = os.environ | {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "OMP_NUM_THREADS": "1",
            }
            log = stack.enter_context(open(name.with_name(f"{name.name}.rank{rank}.log"), "w"))
            cmd = [sys.executable, "-m", "tests.test_elastic", str(spec)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=300 * len(runs)) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    logs = [name.with_name(f"{name.name}.rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(f"--- rank {r}\n{text[-4000:]}" for r, text in enumerate(logs))
    return [[json.loads(dump.with_name(f"{dump.name}.result{r}.json").read_text()) for r in range(2)]
            for _, _, dump in runs]  # fmt: skip


def main(spec_path: str) -> None:
    """A rank of run_two_ranks: its process group from the environment, then for each run of the spec
    the trainer and its dumps."""
    import torch.distributed as dist

    from dflash_dist.actors.trainer_group import join_group
    from dflash_dist.trainer.loop import Trainer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    try:
        for run in spec["runs"]:
            job = job_from_json(run["job"])
            dump = Path(run["dump"])
            trainer = Trainer(load_config_dict(run["cfg"]), job)
            assert trainer.engine.load_universal_checkpoint() == (job.resume is not None)
            dump_state(trainer.engine, dump.with_name(dump.name + "_resumed"))
            result = trainer.run()
            dump_state(trainer.engine, dump.with_name(dump.name + "_final"))
            dump.with_name(f"{dump.name}.result{dist.get_rank()}.json").write_text(
                json.dumps(dataclasses.asdict(result)))
            del trainer
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("elastic") / "shards"
    write_shards(path, tiny["prov"], tiny["samples"][:NUM], done=True)
    return path


STAGES = (1, 2, 3)


def stage_cfg(tiny, out: Path, stage: int, world: int, max_steps: int | None) -> Config:
    return make_cfg(out, tiny["target_dir"], world_size=world, zero_stage=stage, epochs=2, max_steps=max_steps,
                    checkpoint_every=100, log_sample_keys=True, weight_decay=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def one_then_two(tiny, shards, tmp_path_factory) -> dict[int, dict]:
    """The first two attempts of every stage's run: 1 rank here trains FIRST steps and saves step_3,
    then one group of 2 rank processes resumes each stage's step_3 in turn (one process start and
    gloo group for the three stages) to step SECOND. Per stage: its out dir, dumps dir, the 1-rank
    result and the 2-rank results; the tests check them and run the third attempt."""
    got = {}
    for stage in STAGES:
        root = tmp_path_factory.mktemp(f"zero{stage}")
        out, dumps = root / "run", root / "dumps"
        dumps.mkdir()
        cfg = stage_cfg(tiny, out, stage, 1, FIRST)
        first = run_in_process(cfg, job_for(tiny, shards, cfg, None), dumps / "a")
        got[stage] = {"out": out, "dumps": dumps, "first": first, "ckpt_after_first": checkpoint.read_latest(
            out / "checkpoints")}  # fmt: skip
    runs = []
    for stage in STAGES:
        cfg = stage_cfg(tiny, got[stage]["out"], stage, 2, SECOND)
        ckpt = got[stage]["out"] / "checkpoints"
        runs.append((cfg, job_for(tiny, shards, cfg, ckpt / f"step_{FIRST}"), got[stage]["dumps"] / "b"))
    for stage, results in zip(STAGES, run_two_ranks(runs, tmp_path_factory.mktemp("two_ranks") / "group")):
        got[stage]["second"] = results
    return got


@pytest.mark.parametrize("stage", STAGES)
def test_elastic_resume_one_to_two_to_one_rank(tiny, shards, one_then_two, stage):
    run = one_then_two[stage]
    out, dumps = run["out"], run["dumps"]
    ckpt = out / "checkpoints"

    def cfg_for(world: int, max_steps: int | None) -> Config:
        return stage_cfg(tiny, out, stage, world, max_steps)

    # 1 rank trained 3 steps (6 of epoch 0's 16 samples: shards 0-2) and saved step_3
    first = run["first"]
    assert first.steps == FIRST and run["ckpt_after_first"] == f"step_{FIRST}"

    # 2 ranks resumed it: shards 3-7 are left (rank 0 owns 4 and 6, rank 1 owns 3, 5 and 7), so
    # epoch 0 ends after 3 steps (the third: rank 1's last shard, rank 0 an empty slot); step 7 is
    # epoch 1's first
    results = run["second"]
    assert universal.is_converted(ckpt / f"step_{FIRST}")
    assert_same_state(load_state(dumps / "a_final"), load_state(dumps / "b_resumed"))
    assert [r["steps"] for r in results] == [SECOND, SECOND] and [r["epochs_completed"] for r in results] == [1, 1]
    assert [r["samples_lost"] for r in results] == [0, 0]
    assert [r["samples_consumed"] for r in results] == [6, 8]
    assert checkpoint.read_latest(ckpt) == f"step_{SECOND}"

    # 1 rank resumes the 2-rank step_7 (epoch 1: 2 shards trained) and finishes epoch 1
    last = run_in_process(cfg_for(1, None), job_for(tiny, shards, cfg_for(1, None), ckpt / f"step_{SECOND}"),
                          dumps / "c")  # fmt: skip
    assert_same_state(load_state(dumps / "b_final"), load_state(dumps / "c_resumed"))
    assert (last.steps, last.epochs_completed, last.samples_consumed, last.samples_lost) == (TOTAL, 2, 12, 0)
    assert load_state(dumps / "c_final")[1]["adam_steps"] == [float(TOTAL)]  # one AdamW step per step
    # the converted copy sits inside the still-complete tag and is reused, not redone
    tag = ckpt / f"step_{SECOND}"
    marker = universal.universal_dir(tag) / universal.UNIVERSAL_MARKER
    written = marker.stat().st_mtime_ns
    assert checkpoint.read_marker(tag) is not None and universal.convert(tag) == universal.universal_dir(tag)
    assert marker.stat().st_mtime_ns == written

    # the step log: every step once, the LR schedule continued across both world sizes
    log = read_jsonl(out / TRAIN_LOG)
    assert [r["step"] for r in log] == list(range(1, TOTAL + 1)) and all(r["loss"] == r["loss"] for r in log)
    sched = WarmupCosine(TOTAL, 2)  # warmup_frac 0.1 of 13 steps
    assert [r["lr"] for r in log] == pytest.approx([5e-3 * sched(s) for s in range(TOTAL)])
    assert log[-1]["samples"] == 2 * NUM  # every sample of both epochs
    # every sample exactly once per epoch, across 1, 2 and 1 ranks
    per: dict[int, Counter] = {}
    for rank_log in sorted((out / SAMPLE_LOG).glob("rank_*.jsonl")):
        for row in read_jsonl(rank_log):
            per.setdefault(row["epoch"], Counter()).update(row["keys"])
    keys = Counter(s.key for s in tiny["samples"][:NUM])
    assert per[0] == keys and per[1] == keys


if __name__ == "__main__":
    main(sys.argv[1])
