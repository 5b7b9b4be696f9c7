"""Capture at scale under faults, on real components: a target actor killed mid-shard (Ray
restarts it and retries its call, which resumes from the ledger), a real tiny run whose shard
directory stays under `capture.max_buffer_bytes` while the trainer consumes and deletes, and an
unfinished capture resumed without a sample lost or duplicated."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.disk_budget import (
    STALLED,
    WAIT,
    WRITE,
    BufferGate,
    BufferPolicy,
    BufferStalled,
    consumed_shards,
    read_released,
    release_consumed,
    room_decision,
)
from data_pipeline.ingest import sample_keys
from data_pipeline.ledger import DataChanged, captured_keys, duplicate_keys
from data_pipeline.records import BUFFER_NAME, DONE_NAME, TMP_PREFIX
from data_pipeline.shard_reader import ShardStream, iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done
from tests.helpers.capture import capture_config, make_capture_target, run_capture, write_conversations

N = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    write_conversations(root / "train.jsonl", N, seed=1)
    keys = sample_keys(read_chat_jsonl(root / "train.jsonl"))  # content keys, in record order
    return {"dir": make_capture_target(root / "target"), "jsonl": root / "train.jsonl", "keys": keys}


def listed_keys(shards: Path) -> list[str]:
    return [k for r in read_manifest(shards) for k in r.keys]


def assert_each_sample_once_and_complete(shards: Path, all_keys: list[str]) -> None:
    keys = listed_keys(shards)
    assert sorted(keys) == sorted(all_keys) and not duplicate_keys(shards)
    assert not list(shards.glob(f"{TMP_PREFIX}*.tar"))
    for r in read_manifest(shards):
        if (shards / r.name).exists():
            assert [s.key for s in iter_shard_samples(shards / r.name)] == list(r.keys)


# ---------------------------------------------------------------------------- ledger resume (no Ray)
class Killed(Exception):
    """The fault injected into a capture loop."""


def test_resume_after_a_dead_writer_redoes_exactly_the_rest(saved, tmp_path, monkeypatch):
    from dflash_dist.capture.capture_job import CaptureJob

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], token_budget=600, shard_bytes=100_000)
    shards = cfg.out / "shards"
    real = CaptureJob._capture_padded

    def dies_after_15(self, seqs):  # the capture thread dies before its next pass once 15 are written
        if self.counts["samples"] >= 15:
            raise Killed
        return real(self, seqs)

    monkeypatch.setattr(CaptureJob, "_capture_padded", dies_after_15)
    with pytest.raises(Killed):
        run_capture(cfg)
    monkeypatch.undo()
    settled = captured_keys(shards)
    assert 0 < len(settled) <= 15 and settled <= set(saved["keys"])
    # the same actor's writer died mid-shard: its unfinished shard stays behind as .tmp-t000-*,
    # holding a sample of the part still to capture
    (record,) = read_manifest(shards)[:1]
    sample = next(iter_shard_samples(shards / record.name))
    dead = ShardWriter(shards, record.provenance, prefix="t000")
    dead.write(dataclasses.replace(sample, key=next(k for k in saved["keys"] if k not in settled)))
    assert len(list(shards.glob(f"{TMP_PREFIX}t000-*.tar"))) == 1
    # and another died between renaming its finished shard and listing it (the fresh-clone suite caught
    # this one: the file stayed on disk for the whole run, outside the cap's count)
    orphan = shards / "t000-000999.tar"  # a name the resumed writer will not reach
    orphan.write_bytes((shards / record.name).read_bytes())
    second = run_capture(cfg)  # the same data: resumed through the ledger
    assert (second.resumed, second.samples, second.skipped) == (len(settled), N - len(settled), 0)
    assert_each_sample_once_and_complete(shards, saved["keys"])
    listed = {r.name for r in read_manifest(shards)}
    assert not orphan.exists() and {p.name for p in shards.glob("*.tar")} <= listed  # nothing unlisted left


def test_a_resume_over_other_data_is_refused_naming_the_change(saved, tmp_path):
    data = tmp_path / "train.jsonl"
    shutil.copy(saved["jsonl"], data)
    cfg = capture_config(tmp_path / "run", saved["dir"], data)
    cfg.data.max_train_samples = 10
    first = run_capture(cfg)
    assert first.samples == 10 and captured_keys(cfg.out / "shards") == set(saved["keys"][:10])
    cfg.data.max_train_samples = 12
    with pytest.raises(DataChanged, match="data.max_train_samples was 10, now 12"):
        run_capture(cfg)
    cfg.data.max_train_samples = 10
    other = tmp_path / "other.jsonl"
    write_conversations(other, N, seed=2)
    cfg.data.train_path = str(other)
    with pytest.raises(DataChanged, match=f"data.train_path was '{data}', now '{other}'.*content hash"):
        run_capture(cfg)
    cfg.data.train_path = str(data)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text(lines[1] + lines[0] + "".join(lines[2:]))  # the same file, edited: two records swapped
    with pytest.raises(DataChanged, match="content hash was .* \\(the data file changed\\)"):
        run_capture(cfg)
    data.write_text("".join(lines))
    again = run_capture(cfg)  # the same data again: resumed exactly, nothing redone
    assert (again.resumed, again.samples) == (10, 0)
    assert captured_keys(cfg.out / "shards") == set(saved["keys"][:10])


def test_plan_stages_resumes_an_unfinished_capture_and_refuses_a_cap_without_trainer(saved, tmp_path):
    from dflash_dist.orchestration.run_plan import PipelineError, plan_stages

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"])
    cfg.data.max_train_samples = 4
    run_capture(cfg)
    with pytest.raises(PipelineError, match="already holds shards"):
        plan_stages(cfg, ("extract",), "never")
    assert plan_stages(cfg, ("extract",), "auto") == ("extract",)  # resumed through the ledger, not refused
    cfg.capture.max_buffer_bytes = 10 * cfg.capture.shard_bytes
    with pytest.raises(PipelineError, match="capture.max_buffer_bytes=.*no trainer"):
        plan_stages(cfg, ("extract",), "auto")
    mark_done(cfg.out / "shards")
    assert plan_stages(cfg, ("extract", "train"), "auto") == ("train",)


def test_a_capture_that_lost_too_many_samples_fails_every_way_it_can_finish(tmp_path):
    """A poisoned target (one token's embedding is NaN): its sequences are skipped as non-finite. The
    Slurm array slice that completes the capture (`extract --slice`) used to mark it DONE and exit 0
    whatever data.max_lost_fraction said, and train.sbatch then trained without those samples; now
    that slice fails naming skipped.jsonl and the setting, so does a rerun of it, and the run plan
    refuses to train over the capture. Within the setting all three go on."""
    from data_pipeline.ledger import read_skipped
    from dflash_dist.orchestration.run_plan import PipelineError, make_plan
    from launcher.slurm_capture import capture_slice

    write_conversations(tmp_path / "train.jsonl", 12, seed=1)
    target = make_capture_target(tmp_path / "poisoned", poison_token=7)
    cfg = capture_config(tmp_path / "run", target, tmp_path / "train.jsonl", "eval.enabled=false")
    shards = cfg.out / "shards"
    lost = r"(?s)capture: (\d+) of 12 sample\(s\) had non-finite features.*skipped.jsonl.*data.max_lost_fraction=0.0"
    with pytest.raises(PipelineError, match=lost) as err:
        capture_slice(cfg, 0, 1)
    skipped = len(read_skipped(shards))
    assert 0 < skipped < 12 and err.match(rf"capture: {skipped} of 12") and (shards / DONE_NAME).exists()
    with pytest.raises(PipelineError, match=lost):  # the array task requeued: the capture is complete, still lost
        capture_slice(cfg, 0, 1)
    with pytest.raises(PipelineError, match=lost + ".*training over this capture is refused"):
        make_plan(cfg, ("train",), "auto")
    cfg.data.max_lost_fraction = skipped / 12
    assert capture_slice(cfg, 0, 1) == {"slice": 0, "skipped": "complete"}
    # training plans over the 12 samples the capture was given, as the run that ingested them did
    # (the LR schedule's and data.max_lost_fraction's base; the skipped ones count as lost)
    assert make_plan(cfg, ("train",), "auto").num_samples == 12


@pytest.mark.parametrize("damage", ["torn_last_line", "deleted_line", "garbled_line"])
def test_samples_in_no_manifest_line_refuse_training_and_a_resumed_capture_restores_them(saved, tmp_path, damage):
    """A finished capture whose manifest lost a line between capture and training (its last line
    torn: readers stop at the last newline; or a line deleted): that shard's samples were neither
    trained nor counted lost, and `dflash-dist train` ended 'done, 0 sample(s) lost' with exit 0
    (seen on configs/tiny.yaml: '398 of 398 samples trained'). Now the run plan refuses it naming
    the manifest, the count and the fix; the fix it names (remove DONE, resume the capture)
    captures exactly the missing samples again."""
    from dflash_dist.orchestration.run_plan import PipelineError, make_plan

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], "eval.enabled=false",
                         "capture.shard_bytes=20000")  # fmt: skip
    cfg.data.max_train_samples = 12
    cfg.data.max_lost_fraction = 0.5  # a damaged ledger is refused whatever loss the setting allows
    run_capture(cfg)
    shards = cfg.out / "shards"
    mark_done(shards)
    manifest = shards / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 3
    if damage == "torn_last_line":
        gone = json.loads(lines[-1])["n_samples"]
        manifest.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
        why = r"manifest.jsonl's last line is torn \(\d+ bytes without a newline\)"
    else:
        gone = json.loads(lines[1])["n_samples"]
        manifest.write_bytes(b"".join(lines[:1] + lines[2:]))
        why = "a line was deleted, or a shard's line never written"
    if damage == "garbled_line":  # its error names the line and the same fix, which the user follows
        manifest.write_bytes(b"".join(lines[:1] + [b'{"name": "t000-0000' + b"\n"] + lines[2:]))
        with pytest.raises(PipelineError, match=r"(?s)manifest.jsonl:2: not a valid manifest line.*restore the file "
                           r"from a copy, or delete that line and the directory's DONE and continue the capture "
                           r"with --resume auto"):  # fmt: skip
            make_plan(cfg, ("train",), "auto")
        manifest.write_bytes(b"".join(lines[:1] + lines[2:]))  # the line deleted, as the message says
    assert sum(r.n_samples for r in read_manifest(shards)) == 12 - gone  # what every reader sees
    with pytest.raises(PipelineError, match=rf"(?s)manifest.jsonl: the finished capture was given 12 conversations.*"
                       rf"lists {12 - gone} samples.*{gone} sample\(s\) are in neither file \({why}\).*"
                       rf"Remove .*DONE and continue the capture with --resume auto"):  # fmt: skip
        make_plan(cfg, ("train",), "auto")
    (shards / DONE_NAME).unlink()  # what the message says to do
    result = run_capture(cfg)
    assert (result.resumed, result.samples) == (12 - gone, gone)
    mark_done(shards)
    assert_each_sample_once_and_complete(shards, saved["keys"][:12])
    assert make_plan(cfg, ("train",), "auto").num_samples == 12


def test_the_run_plan_refuses_a_shard_tree_of_another_target_in_any_epoch_directory(saved, tmp_path):
    """Under later_epochs: recapture, epoch e >= 1 is captured from epoch 0's token store into its own
    directory, which holds no shard when the epoch starts, while epoch 0's shards may already be
    deleted (released): a run resumed there with another target (or template, layers, dtype, kernel
    path) would have had every reader and writer see only directories it wrote itself, and mixed
    two targets' features in one training. The run plan compares every listed shard of every epoch
    directory (epoch 0's manifest keeps its lines after its shards are deleted) with what this run
    demands, before anything is written."""
    from data_pipeline.epoch_dirs import RECAPTURE, epoch_dir, write_mode
    from dflash_dist.orchestration.run_plan import PipelineError, make_plan

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], "eval.enabled=false",
                         "capture.later_epochs=recapture", "train.epochs=2")  # fmt: skip
    cfg.data.max_train_samples = 4
    run_capture(cfg)  # epoch 0 of the first target
    shards = cfg.out / "shards"
    write_mode(shards, RECAPTURE)
    mark_done(shards)
    for p in shards.glob("*.tar"):
        p.unlink()  # released after training: only the manifest lines remain
    epoch_dir(shards, 1, recapture=True).mkdir()  # epoch 1 not started
    assert make_plan(cfg, ("extract", "train"), "auto").stages == ("extract", "train")  # the same target: fine
    files = sorted((cfg.out / "data").glob("*"))
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}
    cfg.target.path = str(make_capture_target(tmp_path / "other", poison_token=7))  # other weights
    with pytest.raises(PipelineError, match=r"(?s)provenance mismatch in .*/shards/t000-000000.tar.*target_hash"):
        make_plan(cfg, ("extract", "train"), "auto")
    assert files and {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files} == before  # nothing rewritten


# ---------------------------------------------------------------------------- disk budget: policy and release
def test_room_decision_and_policy_from_config():
    assert room_decision(10, None, 1e9, 1.0) == WRITE
    assert room_decision(99, 100, 50.0, 60.0) == WRITE
    assert room_decision(100, 100, 59.0, 60.0) == WAIT
    assert room_decision(150, 100, 60.0, 60.0) == STALLED
    from dflash_dist.config import Config, ConfigError, load_config

    cfg = Config()
    assert BufferPolicy.from_config(cfg) == BufferPolicy(None, False, 3600.0)  # unbounded, kept
    cfg.capture.max_buffer_bytes, cfg.train.epochs = 4 << 30, 1
    assert BufferPolicy.from_config(cfg).delete_consumed  # auto: one epoch under a cap deletes
    cfg.train.epochs = 3
    assert not BufferPolicy.from_config(cfg).delete_consumed  # several epochs from one capture: kept
    base = ["target.kind=tiny_stdlib", "capture.shard_bytes=1000", "train.world_size=2"]
    with pytest.raises(ConfigError, match="capture.max_buffer_bytes=1999 < train.world_size x capture.shard_bytes"):
        load_config(None, [*base, "capture.max_buffer_bytes=1999"])
    with pytest.raises(ConfigError, match="consumed_shards=delete with train.epochs=3"):
        load_config(None, [*base, "capture.consumed_shards=delete", "train.epochs=3"])
    with pytest.raises(ConfigError, match="capture.consumed_shards: 'sometimes' is not one of"):
        load_config(None, [*base, "capture.consumed_shards=sometimes"])
    with pytest.raises(ConfigError, match="capture.token_budget must be >= 1"):
        load_config(None, [*base, "capture.token_budget=0"])
    assert load_config(None, [*base, "capture.max_buffer_bytes=2000"]).capture.max_buffer_bytes == 2000


def test_release_follows_every_ranks_reader_and_the_gate_waits_then_stalls(saved, tmp_path):
    """Real reader states of two ranks decide which shards a checkpoint releases; released ones
    are deleted (or kept and uncounted); a full buffer makes the gate wait, then raise."""
    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], shard_bytes=120_000)
    cfg.data.max_train_samples = 16
    run_capture(cfg)
    shards = cfg.out / "shards"
    records = read_manifest(shards)
    assert len(records) >= 4
    prov = records[0].provenance
    states = []
    for rank in range(2):  # each rank reads its first shard fully and one sample of its second
        stream = ShardStream(shards, prov, rank, 2, stop_when=lambda: True)
        it = iter(stream)
        for _ in range(records[rank].n_samples + 1):
            next(it)
        states.append(stream.state_dict())
    done = {records[r].name for r in range(2)} | {records[r].name for r in (2, 3) if records[r].n_samples == 1}
    assert consumed_shards(states, 0, records) == done  # a shard begun, not finished, is not released
    assert consumed_shards([None, None], 1, records) == {r.name for r in records}  # past epoch 0: all

    total = sum(r.n_bytes for r in records)
    keep = BufferPolicy(cap_bytes=total, delete_consumed=False, stall_s=0.3, poll_s=0.05)
    assert release_consumed(shards, keep, states, 0) == []
    assert read_released(shards) == done
    assert all((shards / r.name).exists() for r in records)
    buffer = json.loads((shards / BUFFER_NAME).read_text())
    unconsumed = total - sum(r.n_bytes for r in records if r.name in done)
    assert buffer["unconsumed_bytes"] == unconsumed
    assert buffer["cap_bytes"] == total and buffer["shards_released"] == len(done) and buffer["shards_deleted"] == 0

    delete = dataclasses.replace(keep, delete_consumed=True)
    assert release_consumed(shards, delete, [None, None], 0) == sorted(done)  # kept ones go once deleting is on
    assert all((shards / r.name).exists() == (r.name not in done) for r in records)
    # a resumed reader never opens the deleted shards it had consumed
    stream = ShardStream(shards, prov, 0, 2, stop_when=lambda: True)
    stream.load_state_dict(states[0])
    list(stream)
    assert not stream.skipped

    # the gate: room while unconsumed < cap; full: waits, and raises after stall_s with no release
    BufferGate(shards, dataclasses.replace(delete, cap_bytes=unconsumed + 1))()
    gate = BufferGate(shards, dataclasses.replace(delete, cap_bytes=unconsumed))
    t0 = time.monotonic()
    with pytest.raises(BufferStalled, match="raise capture.max_buffer_bytes or lower train.checkpoint_every"):
        gate()
    assert time.monotonic() - t0 >= 0.3 and gate.waited_s > 0
    # a release while it waits lets it go on
    gate = BufferGate(shards, dataclasses.replace(delete, cap_bytes=unconsumed, stall_s=30))
    releaser = threading.Timer(0.3, release_consumed, (shards, delete, [None], 1))
    releaser.start()
    gate()
    releaser.join()
    assert 0.2 < gate.waited_s < 10 and not any((shards / r.name).exists() for r in records)


# ---------------------------------------------------------------------------- Ray: kill a target actor
def test_target_actor_killed_mid_shard_is_restarted_and_resumes(saved, ray_cluster, tmp_path):
    from dflash_dist.actors.target_worker import CaptureTask, TargetWorker
    from dflash_dist.capture.data_prep import capture_data
    from dflash_dist.target.loading import target_identity

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], shard_bytes=200_000, regenerate=True,
                         max_new_tokens=12, batch_size=2)
    cfg.data.max_train_samples = n = 16  # ~8 shards of 1-2 samples: the kill lands in the second or third
    shards = cfg.out / "shards"
    ident = target_identity(cfg, saved["dir"])
    worker = TargetWorker.options(num_cpus=0.5, max_restarts=2, max_task_retries=2).remote()
    t0 = time.monotonic()
    ref = worker.capture.remote(CaptureTask(cfg.to_dict(), str(saved["dir"]), ident, str(saved["jsonl"]),
                                            capture_data(cfg, saved["jsonl"]), str(shards), 0, 1))
    killed, complete_before = None, []
    while killed is None and time.monotonic() - t0 < 90:
        listed = read_manifest(shards) if shards.is_dir() else []
        for tmp in shards.glob(f"{TMP_PREFIX}t000-*.tar") if listed else []:
            try:
                if tmp.stat().st_size > 0:  # a complete shard is listed and the next one holds samples
                    killed = int(tmp.name.split("-")[2])
                    complete_before = listed
                    os.kill(killed, signal.SIGKILL)
                    break
            except FileNotFoundError:  # renamed (published) meanwhile
                continue
        time.sleep(0.01)
    assert killed is not None, "never saw a shard in progress"
    result = ray_cluster.get(ref, timeout=240)  # a frozen CaptureResult
    assert result.resumed >= sum(r.n_samples for r in complete_before) > 0  # the retry read the ledger
    assert result.resumed + result.samples == n and result.skipped == 0
    assert_each_sample_once_and_complete(shards, saved["keys"][:n])
    assert sorted(p.name for p in shards.glob("*.tar")) == sorted(r.name for r in read_manifest(shards))
    beat = json.loads((cfg.out / "heartbeat" / "target-0.json").read_text())
    assert beat["state"] == "finished" and beat["pid"] != killed  # a restarted process finished the work
    print(f"\nkill test: killed pid {killed} after {len(complete_before)} shard(s); {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="module")
def failing_worker(ray_cluster):
    """One target actor for the captures that fail in it (an error its code raises, not a lost
    process: it stays up, and holds nothing of one call for the next). One process start, not two."""
    from dflash_dist.actors.target_worker import TargetWorker

    worker = TargetWorker.options(num_cpus=0.5, max_restarts=2, max_task_retries=2).remote()
    yield worker
    ray_cluster.kill(worker)


def test_a_target_actor_with_other_weights_fails_the_capture_naming_both_hashes(saved, failing_worker, ray_cluster,
                                                                                tmp_path):
    """A node whose target.path holds other weights than the plan hashed (here: the task's
    target_dir, on this one machine): its actor's TargetWeightsMismatch reaches the driver with
    its message, through Ray (not retried: max_task_retries is for dead processes) and the
    pipeline's PipelineError (the CLI's nonzero exit), and nothing is written in the shard tree."""
    from dflash_dist.target.loading import target_identity
    from dflash_dist.target.weights_check import TargetWeightsMismatch
    from tests.helpers.weights import other_target

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"])
    ident = target_identity(cfg, saved["dir"])  # the run plan's
    other = other_target(saved["dir"], tmp_path / "node2_target")
    shards = cfg.out / "shards"
    info = _capture_failing_on(cfg, other, ident, saved, failing_worker, ray_cluster)
    cause = info.value.__cause__
    assert isinstance(cause, TargetWeightsMismatch) and cause.recorded == ident.target_hash
    text = str(info.value)
    assert ident.target_hash in text and cause.found in text and str(other) in text and "target actor 0 on " in text
    # the actor's own error, as the CLI's one line shows it: not Ray's wrapper with the remote traceback
    assert text.startswith("target capture failed: TargetWeightsMismatch: ")
    assert "Traceback" not in text and "ray::" not in text
    assert not shards.exists()
    beat = json.loads((cfg.out / "heartbeat" / "target-0.json").read_text())
    assert beat["state"] == "failed" and "TargetWeightsMismatch" in beat["error"] and ident.target_hash in beat["error"]


def _capture_failing_on(cfg, target_dir, ident, saved, worker, ray_cluster):
    """The target actor `worker` capturing from `target_dir` with the run plan's identity `ident`: the
    pipeline's PipelineError it ends in (pytest's ExceptionInfo)."""
    from dflash_dist.actors.target_worker import CaptureTask
    from dflash_dist.capture.data_prep import capture_data
    from dflash_dist.orchestration.pipeline import _finish_capture
    from dflash_dist.orchestration.run_plan import PipelineError

    shards = cfg.out / "shards"
    ref = worker.capture.remote(CaptureTask(cfg.to_dict(), str(target_dir), ident, str(saved["jsonl"]),
                                            capture_data(cfg, saved["jsonl"]), str(shards), 0, 1))
    with pytest.raises(PipelineError, match="target capture failed") as info:
        _finish_capture(ray_cluster, [ref], [shards])
    return info


def test_a_target_actor_on_a_node_without_the_target_fails_naming_the_node(saved, failing_worker, ray_cluster,
                                                                           tmp_path):
    """A node of a multi-node run lacks the target directory the driver resolved (not on shared
    storage, not copied there): its target actor's error reaches the driver through Ray and the
    pipeline's PipelineError naming the node (host name and address), the path and the fix, and nothing
    is written in the shard tree. It said "hash_weight_files: ... is not a directory", naming no node."""
    import socket

    from dflash_dist.node_address import network_address
    from dflash_dist.target.loading import TargetNotOnNode, target_identity

    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"])
    ident = target_identity(cfg, saved["dir"])  # the run plan's, on the driver's node
    absent = tmp_path / "not_on_this_node" / "target"
    shards = cfg.out / "shards"
    info = _capture_failing_on(cfg, absent, ident, saved, failing_worker, ray_cluster)
    assert isinstance(info.value.__cause__, TargetNotOnNode)
    host, text = socket.gethostname(), str(info.value)
    assert f"the target directory {absent} does not exist on node {host} ({network_address(host)})" in text, text
    assert f"storage every node mounts at the same path, or copy it to {absent} on {host}" in text, text
    assert "Traceback" not in text and not shards.exists()


# ---------------------------------------------------------------------------- a real tiny run under a disk cap
def test_shard_directory_stays_under_the_cap_while_the_trainer_consumes(saved, ray_cluster, tmp_path):
    from dflash_dist.orchestration.pipeline import run_pipeline

    shard_bytes, n = 150_000, 24  # 1-2 samples per shard; a checkpoint every 4 samples
    cap = 5 * shard_bytes
    cfg = capture_config(tmp_path / "run", saved["dir"], saved["jsonl"], token_budget=600, shard_bytes=shard_bytes,
                         max_buffer_bytes=cap, buffer_stall_s=600.0, cpus_per_actor=0.5)
    cfg.data.max_train_samples = n
    cfg.eval.enabled = False
    d = cfg.drafter
    d.num_layers, d.num_heads, d.num_kv_heads, d.head_dim, d.block_size = 1, 4, 2, 16, 4
    t = cfg.train
    t.world_size, t.zero_stage, t.micro_batch_size, t.epochs, t.num_anchors = 1, 2, 2, 1, 8
    t.checkpoint_every, t.keep_checkpoints, t.log_every, t.cpus_per_rank = 2, 1, 1, 0.5
    shards = cfg.out / "shards"
    peak, samples, stop = [0], [0], threading.Event()

    def watch():  # every shard file, complete or in flight
        while not stop.is_set():
            size = 0
            for p in shards.glob("*.tar") if shards.is_dir() else []:  # dot files (.tmp-*) included
                with contextlib.suppress(FileNotFoundError):  # deleted or renamed since the listing
                    size += p.stat().st_size
            peak[0], samples[0] = max(peak[0], size), samples[0] + 1
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        summary = run_pipeline(cfg, ("extract", "train"))
    finally:
        stop.set()
        watcher.join()
    records = read_manifest(shards)
    produced = sum(r.n_bytes for r in records)
    waited = summary.capture[0].waited_s
    print(f"\ndisk cap: peak {peak[0]} bytes (cap {cap} + shard {shard_bytes}) of {produced} produced, "
          f"{samples[0]} samples, capture waited {waited:.1f}s, {time.monotonic() - t0:.0f}s")
    assert produced > 2 * cap  # the cap was far below the data: it had to bind
    assert summary.capture[0].waited_s > 0  # the capture paused for the trainer
    assert summary.capture[0].weights_hashed == 0  # the run plan's check of the weights, handed to the actor
    assert 0 < peak[0] <= cap + shard_bytes
    assert sorted(listed_keys(shards)) == sorted(saved["keys"][:n]) and (shards / DONE_NAME).exists()
    assert summary.train[0].samples_consumed == n and summary.samples_lost == 0
    # one epoch under a cap: every shard was released and deleted once a checkpoint covered it
    assert not list(shards.glob("*.tar"))
    buffer = json.loads((shards / BUFFER_NAME).read_text())
    assert buffer["unconsumed_bytes"] == 0 and buffer["shards_deleted"] == len(records) and buffer["cap_bytes"] == cap
