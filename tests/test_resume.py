"""Checkpoint and resume: `latest` names only complete checkpoints, the resume decision and its
refusals, and exact resume: a 2-rank run whose rank is SIGKILLed at a random step and resumed
with `auto` logs the same per-step losses, bit for bit, as an uninterrupted run, and trains
every sample exactly once per epoch; a crash inside a checkpoint save leaves the previous
checkpoint as `latest`, and the run resumes from it.

Real DeepSpeed over gloo (2 Ray-actor ranks, and 1 rank in this process for the save crash) and
a local Ray cluster started and stopped here, on the tiny target of tests/helpers/tiny.py.
Set DFLASH_TEST_KILL_STEP / DFLASH_TEST_KILL_RANK to replay a particular kill.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash_dist.config import Config
from dflash_dist.orchestration.run_plan import PipelineError, decide_training, plan_stages, planned_samples
from dflash_dist.trainer import checkpoint, resume
from dflash_dist.trainer.checkpoint import ResumeError
from dflash_dist.trainer.ds_config import planned_schedule
from dflash_dist.trainer.loop import TRAIN_LOG
from dflash_dist.trainer.resume import check_resumable, decide, training_config_hash
from dflash_dist.trainer.state import STATE_VERSION
from tests.conftest import REPO
from tests.helpers.runs import consumed_per_epoch, read_jsonl
from tests.helpers.tiny import make_cfg, write_shards

NUM = 16  # 8 shards of 2: 4 per rank, 4 steps of 2x2 samples per epoch, nothing dropped
STEPS = 12  # 3 epochs: a kill or notice after the first checkpoint still has an epoch end before or after it
EVERY = 4  # checkpoint_every


def fake_tag(ckpt_dir: Path, step: int, cfg: Config, world: int = 2, complete: bool = True,
             samples: int = NUM) -> Path:  # fmt: skip
    """A tag directory as the trainer leaves it (a DeepSpeed file, and the marker if complete; its LR
    schedule planned over `samples` per epoch)."""
    tag = ckpt_dir / checkpoint.tag_name(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if complete:
        data = checkpoint.data_fingerprint(cfg.out / "shards")
        meta = {"step": step, "world_size": world, "config": cfg.to_dict(), "data": data,
                "schedule": list(planned_schedule(cfg, samples)), "state_version": STATE_VERSION}  # fmt: skip
        checkpoint.write_marker(tag, meta)
    return tag


# ---------------------------------------------------------------------------- pure pieces
def test_latest_names_only_complete_tags_and_pruning_keeps_n(tmp_path):
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_tag(ckpt, step, cfg)
        checkpoint.publish_latest(ckpt, checkpoint.tag_name(step))
    torn = fake_tag(ckpt, 8, cfg, complete=False)  # a save that crashed
    assert checkpoint.read_latest(ckpt) == "step_6"
    assert [p.name for p in checkpoint.complete_tags(ckpt)] == ["step_2", "step_4", "step_6"]
    assert checkpoint.plan_resume("auto", ckpt).name == "step_6"
    # a file shorter than the marker says (e.g. rewritten after the marker) makes the tag incomplete
    (ckpt / "step_4" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert checkpoint.read_marker(ckpt / "step_4") is None
    with pytest.raises(ResumeError, match="not a complete checkpoint"):
        checkpoint.plan_resume(str(ckpt / "step_4"), ckpt)
    with pytest.raises(ResumeError, match="not a complete checkpoint"):
        checkpoint.plan_resume(str(torn), ckpt)
    # a crash between marker and `latest`: `latest` still names the previous tag
    fake_tag(ckpt, 10, cfg, complete=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "publish_latest", lambda *a: (_ for _ in ()).throw(OSError("killed")))
        with pytest.raises(OSError):
            checkpoint.commit(ckpt, "step_10", {"step": 10}, keep=2)
    assert checkpoint.read_latest(ckpt) == "step_6" and (ckpt / "step_8").is_dir()
    checkpoint.commit(ckpt, "step_10", {"step": 10}, keep=2)
    assert checkpoint.read_latest(ckpt) == "step_10"
    assert [p.name for p in checkpoint.tag_dirs(ckpt)] == ["step_6", "step_10"]  # old, torn and broken ones gone
    assert not list(ckpt.glob(".latest.tmp*"))


def test_truncated_checkpoint_file_is_named_in_the_refusal(tmp_path):
    """A file shorter than the marker records: `--resume auto` and `--resume PATH` name that file
    and both sizes (a missing file too), not only the tag."""
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    ckpt = tmp_path / "checkpoints"
    tag = fake_tag(ckpt, 2, cfg)
    checkpoint.publish_latest(ckpt, tag.name)
    states = tag / "mp_rank_00_model_states.pt"
    states.write_bytes(b"x" * 40)
    for mode in ("auto", str(tag)):
        with pytest.raises(ResumeError, match=re.escape(f"{states} has 40 bytes, {checkpoint.MARKER} records 100")):
            checkpoint.plan_resume(mode, ckpt)
    states.unlink()
    with pytest.raises(ResumeError, match=re.escape(f"{states} is listed in {checkpoint.MARKER} but cannot be read")):
        checkpoint.plan_resume("auto", ckpt)
    (tag / checkpoint.MARKER).write_text("{torn")
    with pytest.raises(ResumeError, match=re.escape(f"{tag / checkpoint.MARKER} cannot be read")):
        checkpoint.plan_resume("auto", ckpt)


def test_resume_modes(tmp_path):
    cfg = Config()
    cfg.run.out_dir = str(tmp_path / "a")
    ckpt = cfg.out / "checkpoints"
    assert checkpoint.plan_resume("never", ckpt) is None and checkpoint.plan_resume("auto", ckpt) is None
    fake_tag(ckpt, 3, cfg, complete=False)  # only a torn first save: nothing to resume, nothing to protect
    assert checkpoint.plan_resume("never", ckpt) is None and checkpoint.plan_resume("auto", ckpt) is None
    fake_tag(ckpt, 4, cfg)  # complete, but the run died before `latest` was written
    assert checkpoint.plan_resume("auto", ckpt).name == "step_4"
    with pytest.raises(ResumeError, match="--resume auto"):
        checkpoint.plan_resume("never", ckpt)
    with pytest.raises(ResumeError, match="no such checkpoint directory"):
        checkpoint.plan_resume(str(tmp_path / "nope"), ckpt)
    # PATH: its own tag, or another run's into an empty directory; not into another run
    assert checkpoint.plan_resume(str(ckpt / "step_4"), ckpt).name == "step_4"
    assert checkpoint.plan_resume(str(ckpt / "step_4"), tmp_path / "b" / "checkpoints") == ckpt / "step_4"
    other = tmp_path / "c" / "checkpoints"
    fake_tag(other, 2, cfg)
    with pytest.raises(ResumeError, match="another run's checkpoints"):
        checkpoint.plan_resume(str(ckpt / "step_4"), other)
    # `latest` naming something that is not complete (another tool wrote it) is an error, not a guess
    (ckpt / "latest").write_text("step_3")
    with pytest.raises(ResumeError, match="not a complete checkpoint"):
        checkpoint.plan_resume("auto", ckpt)
    # branching from an older tag of the same run: later tags (a discarded future) go, `latest` moves
    fake_tag(ckpt, 6, cfg)
    checkpoint.publish_latest(ckpt, "step_6")
    assert [p.name for p in checkpoint.rewind(ckpt, ckpt / "step_4")] == ["step_6"]
    assert checkpoint.read_latest(ckpt) == "step_4"
    assert [p.name for p in checkpoint.tag_dirs(ckpt)] == ["step_3", "step_4"]
    assert checkpoint.rewind(other, ckpt / "step_4") == []  # a tag of another directory changes nothing there


def test_config_changes_refused_by_field_harmless_ones_reported(tmp_path):
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    shard_dir = cfg.out / "shards"
    shard_dir.mkdir(parents=True)
    saved = {"world_size": 2, "config": cfg.to_dict(), "data": checkpoint.data_fingerprint(shard_dir)}
    new = Config()
    new.run.out_dir = str(tmp_path)
    new.train.log_every, new.train.max_steps, new.eval.num_prompts = 1, 99, 3
    harmless = check_resumable(saved, new.to_dict(), 2, shard_dir, "ckpt")
    assert harmless == ["eval.num_prompts: 16 -> 3", "train.log_every: 10 -> 1", "train.max_steps: None -> 99"]
    assert training_config_hash(new.to_dict()) == training_config_hash(cfg.to_dict())
    new.train.lr, new.drafter.block_size = 1e-3, 8
    with pytest.raises(ResumeError, match=r"drafter.block_size: 16 -> 8; train.lr: 0.0006 -> 0.001"):
        check_resumable(saved, new.to_dict(), 2, shard_dir, "ckpt")
    # the captured layers change fc's input: never resume-safe (a late size mismatch otherwise)
    new = Config()
    new.run.out_dir = str(tmp_path)
    new.capture.num_layers, new.capture.layer_ids = 3, [1, 2, 3]
    with pytest.raises(ResumeError, match=r"capture.layer_ids: None -> \[1, 2, 3\]; capture.num_layers: 5 -> 3"):
        check_resumable(saved, new.to_dict(), 2, shard_dir, "ckpt")
    # another world size is an elastic resume under ZeRO-1/2/3 (tests/test_elastic.py has its refusals)
    assert check_resumable(saved, cfg.to_dict(), 4, shard_dir, "ckpt") == []
    saved["data"] = {"shards": 1, "hash": "x"}
    with pytest.raises(ResumeError, match="trained on 1 shard"):
        check_resumable(saved, cfg.to_dict(), 2, shard_dir, "ckpt")


def test_every_field_that_may_change_across_a_resume_exists_and_says_why():
    """MAY_CHANGE names real config fields only (a renamed field must not stay resume-safe by its
    old name), each with a reason; the rest of the config must match."""
    from dflash_dist.trainer.resume import MAY_CHANGE, _flatten

    fields = set(_flatten(Config().to_dict()))
    assert set(MAY_CHANGE) <= fields, sorted(set(MAY_CHANGE) - fields)
    assert all(isinstance(why, str) and len(why) > 8 for why in MAY_CHANGE.values())
    must_match = fields - set(MAY_CHANGE)
    for key in ("run.seed", "capture.num_layers", "capture.layer_ids", "train.lr", "train.gpus_per_rank",
                "train.kernels", "drafter.block_size", "train.anchor_rule"):
        assert key in must_match, key


def test_marker_checksums_name_a_damaged_file(tmp_path):
    """Every file of a tag gets an XXH3 checksum in its marker; a flipped byte (same size, so the
    tag still looks complete) is named by verify_checksums; a marker without checksums is refused."""
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    tag = fake_tag(tmp_path / "checkpoints", 2, cfg)
    meta = checkpoint.read_marker(tag)
    assert meta["checksums"]["algorithm"] == "xxh3_128" and set(meta["checksums"]["files"]) == set(meta["files"])
    checkpoint.verify_checksums(tag, meta)  # intact: nothing raised
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 50 + b"y" + b"x" * 49)
    assert checkpoint.read_marker(tag) is not None  # sizes alone cannot see it
    with pytest.raises(ResumeError, match=r"step_2: mp_rank_00_model_states.pt differ\(s\) from the xxh3_128"):
        checkpoint.verify_checksums(tag, meta)
    with pytest.raises(ResumeError, match="records no checksum"):
        checkpoint.verify_checksums(tag, {k: v for k, v in meta.items() if k != "checksums"})


def test_latest_and_marker_names_stay_inside_the_checkpoint_directory(tmp_path):
    """`latest` and a marker's file list are read from disk and joined to paths: `latest` naming
    another directory (../other_run/step_9, or an absolute path) had `--resume auto` load a
    checkpoint from outside this run's checkpoints, and a marker listing `../x` or `/etc/hostname`
    had the resume stat and hash files outside the tag. Both are refused, naming the file."""
    cfg = Config()
    cfg.run.out_dir = str(tmp_path / "run")
    ckpt = cfg.out / "checkpoints"
    fake_tag(ckpt, 2, cfg)
    elsewhere = fake_tag(tmp_path / "other_run" / "checkpoints", 9, cfg)
    for name in ("../../other_run/checkpoints/step_9", str(elsewhere)):
        (ckpt / checkpoint.LATEST).write_text(name)
        with pytest.raises(ResumeError, match=re.escape(f"{ckpt / checkpoint.LATEST} names ") + ".*not a tag"):
            checkpoint.plan_resume("auto", ckpt)
    checkpoint.publish_latest(ckpt, "step_2")
    assert checkpoint.plan_resume("auto", ckpt) == ckpt / "step_2"
    tag = ckpt / "step_2"
    marker = json.loads((tag / checkpoint.MARKER).read_text())
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 7)
    for name in ("../../../secret", str(outside), "./mp_rank_00_model_states.pt"):
        forged = {**marker, "files": {**marker["files"], name: 7},
                  "checksums": {**marker["checksums"], "files": {**marker["checksums"]["files"], name: "0" * 32}}}
        (tag / checkpoint.MARKER).write_text(json.dumps(forged))
        problem = checkpoint.marker_problem(tag)
        assert problem is not None and f"file name {name!r} is not a relative path inside {tag}" in problem, problem
        with pytest.raises(ResumeError, match="not a relative path inside"):
            checkpoint.plan_resume("auto", ckpt)
        with pytest.raises(ValueError, match="not a relative path inside"):
            checkpoint.verify_checksums(tag, forged)


def test_step_log_truncation_drops_later_and_torn_lines(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert checkpoint.truncate_step_log(log, 4) == 4
    assert [r["step"] for r in read_jsonl(log)] == [1, 2, 3, 4]
    assert checkpoint.truncate_step_log(tmp_path / "absent.jsonl", 4) == 0


def test_rng_state_round_trips():
    import numpy as np

    state = checkpoint.rng_state(on_gpu=False)
    a = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.load_rng_state(state)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (a[0].tolist(), a[1], a[2])


def test_plan_stages_reuses_done_shards_and_checks_the_checkpoint(tmp_path, tiny):
    """(An unfinished capture resumes through its ledger: tests/test_capture_faults.py.)"""
    cfg = make_cfg(tmp_path / "run", tiny["target_dir"])
    shards = cfg.out / "shards"
    run = ("extract", "train", "eval")
    assert plan_stages(cfg, run, "never") == run  # a fresh directory
    write_shards(shards, tiny["prov"], tiny["samples"][:4], done=False)
    assert plan_stages(cfg, run, "auto") == run  # the capture continues
    with pytest.raises(PipelineError, match="--resume auto"):
        plan_stages(cfg, run, "never")
    (shards / "DONE").write_text("")
    assert plan_stages(cfg, run, "auto") == ("train", "eval")
    fake_tag(cfg.out / "checkpoints", 4, cfg)
    assert plan_stages(cfg, ("train",), "auto") == ("train",)
    with pytest.raises(PipelineError, match="already has checkpoints"):
        plan_stages(cfg, ("train",), "never")
    decision = decide_training(cfg, ("train",), "auto", NUM)  # the one decision, which the ranks verify
    assert (decision.step, decision.saved_world, decision.world, decision.elastic) == (4, 2, 2, False)
    assert decision.tag == str(cfg.out / "checkpoints" / "step_4")
    assert resume.verify(decision)["step"] == 4
    cfg.train.epochs += 1  # another LR schedule length: refused before anything starts
    with pytest.raises(PipelineError, match=r"LR schedule spans 48 samples, this run's 64 samples"):
        decide_training(cfg, ("train",), "auto", NUM)
    cfg.train.epochs -= 1
    cfg.train.lr = 1.0
    with pytest.raises(PipelineError, match="train.lr: 0.005 -> 1.0"):
        decide_training(cfg, ("train",), "auto", NUM)
    marker = cfg.out / "checkpoints" / "step_4" / checkpoint.MARKER
    marker.write_text(marker.read_text().replace('"step": 4', '"step": 4 '))  # changed after the decision
    with pytest.raises(ResumeError, match="changed after the resume was decided"):
        resume.verify(decision)


def test_a_run_planned_over_the_written_samples_alone_resumes_on_that_base(tmp_path, tiny):
    """A training over a finished capture that skipped a sample (non-finite) planned, before the
    capture's skipped samples counted, over the written ones alone; its checkpoint records that LR
    schedule. Resumed now, the plan keeps that base (schedule, step count, loss budget as they were)
    instead of refusing "another LR schedule length" over the same shards. A run without a
    checkpoint, or one planned over written + skipped, plans over written + skipped."""
    from data_pipeline.ledger import record_skipped
    from data_pipeline.shard_reader import read_manifest

    cfg = make_cfg(tmp_path / "run", tiny["target_dir"])
    shards = cfg.out / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][:4], done=True)
    record_skipped(shards, "k-nonfinite", "non-finite features", 0)
    written = sum(r.n_samples for r in read_manifest(shards))
    assert planned_schedule(cfg, written) != planned_schedule(cfg, written + 1)
    assert planned_samples(cfg, None, ("train",), "auto") == written + 1  # a fresh run: what the capture was given
    ckpts = cfg.out / "checkpoints"
    fake_tag(ckpts, 4, cfg, samples=written)  # planned over the written samples alone
    assert planned_samples(cfg, None, ("extract", "train"), "auto") == written
    samples = planned_samples(cfg, None, ("train",), "auto")
    assert samples == written
    assert decide_training(cfg, ("train",), "auto", samples).step == 4  # resumed, not refused
    assert planned_samples(cfg, None, ("train",), str(ckpts / "step_4")) == written  # a tag named alike
    fake_tag(ckpts, 8, cfg, samples=written + 1)  # a run planned over written + skipped keeps that
    checkpoint.publish_latest(ckpts, "step_8")
    assert planned_samples(cfg, None, ("train",), "auto") == written + 1
    cfg.train.epochs += 1  # another schedule length than either base: refused as before
    samples = planned_samples(cfg, None, ("train",), "auto")
    with pytest.raises(PipelineError, match="LR schedule spans"):
        decide_training(cfg, ("train",), "auto", samples)


def test_cli_never_refuses_a_directory_holding_a_run(tmp_path, capsys):
    """`dflash-dist train` (the CLI's main, in this process) with the default --resume never."""
    from dflash_dist.config import load_config
    from launcher import cli

    out = tmp_path / "run"
    cfg = load_config(REPO / "configs" / "tiny.yaml", out_dir=str(out))
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "manifest.jsonl").write_text("")
    fake_tag(out / "checkpoints", 50, cfg)
    (out / "config.yaml").write_text("kept")
    code = cli.main(["train", str(REPO / "configs" / "tiny.yaml"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "already has checkpoints" in err and "--resume auto" in err
    assert (out / "config.yaml").read_text() == "kept"  # refused before anything was written


def test_ctrl_c_ends_a_run_with_one_line_saying_how_to_continue(tmp_path):
    """Ctrl-C (SIGINT) in `dflash-dist extract`, mid-capture on a real local Ray cluster: exit 130 with one
    line naming the directory and `--resume auto`, not the driver's KeyboardInterrupt traceback."""
    out, log = tmp_path / "run", tmp_path / "cli.log"
    # what a terminal gives a command: SIGINT at its default and unblocked (a child inherits both from this
    # process, and Python installs its KeyboardInterrupt handler only over the default). Once, in a full
    # suite run, the signal went unanswered (the run finished, exit 0); the test process's own SIGINT state
    # is kept for the message in case that was it
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    harness = f"test process: SIGINT handler {signal.getsignal(signal.SIGINT)!r}, blocked signals {blocked}"

    def terminal_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    with log.open("w") as f:
        cmd = [sys.executable, "-m", "launcher.cli", "extract", "configs/tiny.yaml", "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=terminal_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 600  # a fresh machine builds the tiny target first (~3 minutes)
        while "target actor(s) capturing" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 130, f"{harness}\n{text[-2000:]}"
    assert "KeyboardInterrupt" not in text, text[-2000:]  # (Ray may log its stopped actors' own exits)
    last = text.strip().splitlines()[-1]
    assert last.startswith("dflash-dist extract: interrupted;") and str(out) in last and "--resume auto" in last


# ---------------------------------------------------------------------------- exact resume after SIGKILL


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "shards"
    write_shards(path, tiny["prov"], tiny["samples"][:NUM], done=True)
    return path


def resume_cfg(out: Path, tiny) -> Config:
    return make_cfg(out, tiny["target_dir"], epochs=STEPS // 4, checkpoint_every=EVERY, log_sample_keys=True)


def start(cfg, tiny, shards, resume):
    from dflash_dist.actors.trainer_group import start_trainer_group

    return start_trainer_group(
        cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM, resume=resume
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny, shards, ray_cluster, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    results = start(resume_cfg(out, tiny), tiny, shards, "never").wait(timeout_s=300)
    assert [r.steps for r in results] == [STEPS, STEPS] and [r.samples_lost for r in results] == [0, 0]
    return out


def test_sigkilled_run_resumed_with_auto_matches_uninterrupted_run(tiny, shards, uninterrupted, tmp_path):
    rng = random.Random()
    kill_step = int(os.environ.get("DFLASH_TEST_KILL_STEP", rng.randint(EVERY + 1, STEPS - 3)))
    victim = int(os.environ.get("DFLASH_TEST_KILL_RANK", rng.randint(0, 1)))
    print(f"SIGKILL rank {victim} once step {kill_step} is logged")
    out = tmp_path / "run"
    cfg = resume_cfg(out, tiny)
    group = start(cfg, tiny, shards, "never")
    log = out / TRAIN_LOG
    deadline = time.time() + 240
    while not (log.exists() and len(log.read_text().splitlines()) >= kill_step):
        assert time.time() < deadline, "the run did not reach the kill step"
        time.sleep(0.02)
    os.kill(group.infos[victim].pid, signal.SIGKILL)
    with pytest.raises(Exception):  # noqa: B017 (Ray's ActorDiedError or the peer's gloo error)
        group.wait(timeout_s=120)
    latest = checkpoint.read_latest(out / "checkpoints")
    assert latest is not None and checkpoint.read_marker(out / "checkpoints" / latest) is not None
    killed_at = len(read_jsonl(out / TRAIN_LOG)) if (out / TRAIN_LOG).exists() else 0
    assert killed_at < STEPS, "the kill came after the run finished"

    results = start(cfg, tiny, shards, "auto").wait(timeout_s=300)
    assert results[0].resumed_from == str(out / "checkpoints" / latest)
    assert [r.steps for r in results] == [STEPS, STEPS]
    # per-step losses (and lr, epoch, sample counts), bit for bit
    expected, got = read_jsonl(uninterrupted / TRAIN_LOG), read_jsonl(out / TRAIN_LOG)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got == expected, f"killed rank {victim} after step {kill_step}, resumed from {latest}"
    # TensorBoard shows each step once: the killed attempt's points past the checkpoint are purged
    acc = EventAccumulator(str(out / "tb" / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_steps = [e.step for e in acc.Scalars("train/loss")]
    assert tb_steps == sorted(set(tb_steps)) and tb_steps[-1] == STEPS
    # every sample exactly once per epoch (the SIGKILLed attempt's later lines were cut)
    keys = Counter(s.key for s in tiny["samples"][:NUM])
    for run in (uninterrupted, out):
        per = consumed_per_epoch(run)
        assert sorted(per) == list(range(STEPS // 4)) and all(per[e] == keys for e in per), run
    # the same weights at the end; `latest` complete, the last keep_checkpoints kept
    a, b = (load_file(str(r / "export" / f"step_{STEPS}" / "model.safetensors")) for r in (uninterrupted, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = out / "checkpoints"
    assert checkpoint.read_latest(ckpt) == f"step_{STEPS}"
    assert [p.name for p in checkpoint.tag_dirs(ckpt)] == [f"step_{STEPS - EVERY}", f"step_{STEPS}"]


# ---------------------------------------------------------------------------- preemption notice
def test_preemption_signal_saves_a_checkpoint_and_resume_matches(tiny, shards, uninterrupted, tmp_path):
    """A scheduler's SIGTERM (or SIGUSR1) to one rank: every rank stops at the same step, that
    step is saved as `latest` (not a checkpoint_every multiple), the ranks return normally, and
    `--resume auto` continues to the same losses and weights as the uninterrupted run. One run
    takes both: SIGTERM to the first attempt, SIGUSR1 to the resumed one (each notice at a random
    step and rank, each with every check), and the third attempt finishes it."""
    out = tmp_path / "run"
    cfg = resume_cfg(out, tiny)
    ckpt, log = out / "checkpoints", out / TRAIN_LOG
    stopped = None  # the step the last attempt stopped at
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        if stopped is None:  # after the first checkpoint, early enough to leave room for the second notice
            notice_at = random.Random().randint(EVERY + 1, EVERY + 2)
        else:  # the resumed attempt: after the step it resumed from
            assert stopped < STEPS - 3, f"the SIGTERM attempt stopped at step {stopped}: no room for another"
            notice_at = random.Random().randint(stopped + 1, STEPS - 3)
        victim = random.Random().randint(0, 1)
        resumed_from = None if stopped is None else str(ckpt / f"step_{stopped}")
        group = start(cfg, tiny, shards, "never" if stopped is None else "auto")
        deadline = time.time() + 240
        while not (log.exists() and len(log.read_text().splitlines()) >= notice_at):
            assert time.time() < deadline, "the run did not reach the notice step"
            time.sleep(0.02)
        os.kill(group.infos[victim].pid, signum)
        results = group.wait(timeout_s=120)  # returns: no rank died
        assert results[0].resumed_from == resumed_from
        stopped = results[0].steps
        where = f"{signum.name} to rank {victim} once step {notice_at} was logged"
        assert [r.preempted for r in results] == [signum.name, signum.name], where
        assert [r.steps for r in results] == [stopped, stopped] and notice_at <= stopped < STEPS, where
        assert checkpoint.read_latest(ckpt) == f"step_{stopped}"
        assert checkpoint.read_marker(ckpt / f"step_{stopped}")["step"] == stopped
        assert len(read_jsonl(log)) == stopped  # the log is durable up to the saved step

    results = start(cfg, tiny, shards, "auto").wait(timeout_s=300)
    assert results[0].resumed_from == str(ckpt / f"step_{stopped}") and results[0].preempted is None
    assert read_jsonl(out / TRAIN_LOG) == read_jsonl(uninterrupted / TRAIN_LOG)
    keys = Counter(s.key for s in tiny["samples"][:NUM])
    per = consumed_per_epoch(out)
    assert sorted(per) == list(range(STEPS // 4)) and all(per[e] == keys for e in per)


# ---------------------------------------------------------------------------- a crash inside a save
def test_crash_during_save_keeps_previous_latest_and_it_loads(tiny, shards, tmp_path, single_rank_gloo):
    from dflash_dist.trainer.loop import Trainer, TrainJob

    def cfg_for(out: Path) -> Config:
        return make_cfg(out, tiny["target_dir"], world_size=1, max_steps=4, checkpoint_every=2)

    def job(resume_from=None):
        decision = None if resume_from is None else decide(resume_from, cfg_for(out), shards, (4, "step"),
                                                           STATE_VERSION)  # fmt: skip
        return TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=4,
                        resume=decision)  # fmt: skip

    reference = tmp_path / "reference"
    Trainer(cfg_for(reference), job()).run()

    out = tmp_path / "run"
    trainer = Trainer(cfg_for(out), job())
    real_save = trainer.engine.save_checkpoint

    def save_then_die(save_dir, tag, **kw):  # step_4's files partly written, then the process "dies"
        real_save(save_dir, tag=tag, **kw)
        if tag == "step_4":
            (optim,) = Path(save_dir, tag).glob("*optim_states.pt")
            optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
            raise RuntimeError("simulated crash during checkpoint save")

    trainer.engine.save_checkpoint = save_then_die
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    ckpt = out / "checkpoints"
    assert checkpoint.read_latest(ckpt) == "step_2"
    assert (ckpt / "step_4").is_dir() and checkpoint.read_marker(ckpt / "step_4") is None
    resume_from = checkpoint.plan_resume("auto", ckpt)
    assert resume_from == ckpt / "step_2"

    result = Trainer(cfg_for(out), job(str(resume_from))).run()
    assert result.resumed_from == str(ckpt / "step_2") and result.steps == 4
    assert checkpoint.read_latest(ckpt) == "step_4" and checkpoint.read_marker(ckpt / "step_4") is not None
    assert read_jsonl(out / TRAIN_LOG) == read_jsonl(reference / TRAIN_LOG)
    assert [r["step"] for r in read_jsonl(out / TRAIN_LOG)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- damaged checkpoint files
def test_flipped_byte_in_a_checkpoint_is_named_before_loading(tiny, shards, tmp_path, single_rank_gloo, monkeypatch):
    """A real DeepSpeed checkpoint with one bit flipped in the middle of a file: the resume names
    the file before DeepSpeed reads anything. Its universal copy (elastic resumes) is verified when
    reused: a damaged copy is converted again from the tag."""
    import dataclasses

    from dflash_dist.trainer import engine, universal
    from dflash_dist.trainer.loop import Trainer, TrainJob

    cfg = make_cfg(tmp_path / "run", tiny["target_dir"], world_size=1, max_steps=2, checkpoint_every=2)
    job = TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=2)
    Trainer(cfg, job).run()
    tag = tmp_path / "run" / "checkpoints" / "step_2"
    (optim,) = tag.glob("*optim_states.pt")
    original = optim.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    optim.write_bytes(bytes(damaged))
    loads = []
    real_load = engine.load_checkpoint
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    with pytest.raises(ResumeError, match=rf"{tag}: {optim.name} differ\(s\) from the xxh3_128 checksum"):
        Trainer(cfg, dataclasses.replace(job, resume=decide(str(tag), cfg, shards, (2, "step"), STATE_VERSION)))
    assert loads == []  # refused before DeepSpeed opened a file

    optim.write_bytes(original)
    copy = universal.convert(tag)
    biggest = max((p for p in copy.rglob("*.pt")), key=lambda p: p.stat().st_size)
    good = biggest.read_bytes()
    biggest.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))
    assert universal.convert(tag) == copy and biggest.read_bytes() == good  # converted again, not reused
