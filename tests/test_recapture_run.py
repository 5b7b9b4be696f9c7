"""Issue 23's acceptance, on the tiny config run by `dflash-dist run`: 3 epochs with later epochs
captured again under a disk cap of about 3 shards. The shard tree (every epoch's shards, shards in
flight, the token store) sampled every 50 ms never holds more than the cap plus one shard (one
producer); the sample logs show every sample exactly once per epoch; and a run whose target actor
and trainer rank 1 are SIGKILLed during epoch 2 (Ray restarts the actor, which resumes epoch 2 from
its ledger; the trainer group restarts from the latest checkpoint, --resume auto) logs the same
per-step losses as the uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from data_pipeline.epoch_dirs import epoch_dir, sequences_dir
from data_pipeline.records import DONE_NAME, MANIFEST_NAME
from data_pipeline.shard_reader import read_manifest
from dflash_dist.trainer.loop import TRAIN_LOG
from tests.conftest import REPO
from tests.helpers.runs import cli_run_thread, consumed_per_epoch, read_jsonl

CAP = 650_000  # about 3 shards: one sample each, ~210 kB on average (~130 tokens x 3 layers x H=128 x 4 B)
RUN = [
    "data.max_train_samples=8",  # 4 steps of 2 ranks x 1 sample per epoch
    "capture.max_new_tokens=24",
    "capture.shard_bytes=1",  # one sample per shard: the manifest order (the trainers' order) is the capture's
    "capture.token_budget=768",
    "capture.later_epochs=recapture",
    f"capture.max_buffer_bytes={CAP}",
    "capture.buffer_stall_s=600",
    "train.epochs=3",
    "train.micro_batch_size=1",
    "train.checkpoint_every=1",  # every step releases what it trained: the cap lets 2 steps through
    "train.log_every=1",
    "train.log_sample_keys=true",
    "eval.enabled=false",
]


def shard_tree_bytes(shards: Path) -> int:
    size = 0
    for p in shards.rglob("*.tar"):  # complete shards, .tmp-* in flight, token-store tars, all epochs
        with contextlib.suppress(FileNotFoundError):  # deleted or renamed since the listing
            size += p.stat().st_size
    return size


def complete_lines(path: Path) -> list[dict]:
    """The JSON lines written so far (not one being appended)."""
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def run(out: Path, kill: bool = False) -> dict:
    """`dflash-dist run configs/tiny.yaml` with RUN (the CLI's main, in this process, on the module's Ray
    cluster: the product joins a cluster its process has already joined); the shard tree sampled
    throughout; with `kill`, the target actor SIGKILLed once it has listed a shard of epoch 2 and
    trainer rank 1 once two steps of epoch 2 are logged."""

    shards, beats = out / "shards", out / "heartbeat"
    peak, samples, stop = [0], [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0], samples[0] = max(peak[0], shard_tree_bytes(shards)), samples[0] + 1
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    log = out.parent / f"{out.name}.log"
    killed: dict[str, int] = {}
    code: list = []
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        driver = cli_run_thread(["run", str(REPO / "configs" / "tiny.yaml"), "--out", str(out), *RUN], code)
        try:
            deadline = time.time() + 1500
            epoch2 = epoch_dir(shards, 2, recapture=True)
            while driver.is_alive():
                assert time.time() < deadline, "the run did not finish in time"
                if kill and "target" not in killed and (epoch2 / MANIFEST_NAME).exists():
                    assert not (epoch2 / DONE_NAME).exists(), "epoch 2 was captured before the actor could be killed"
                    killed["target"] = json.loads((beats / "target-0.json").read_text())["pid"]
                    os.kill(killed["target"], signal.SIGKILL)
                logged = complete_lines(out / TRAIN_LOG) if kill and (out / TRAIN_LOG).exists() else []
                if "trainer" not in killed and sum(r["epoch"] == 2 for r in logged) >= 2:
                    killed["trainer"] = json.loads((beats / "trainer-1.json").read_text())["pid"]
                    os.kill(killed["trainer"], signal.SIGKILL)
                time.sleep(0.05)
        finally:
            stop.set()
            watcher.join()
    printed = log.read_text()
    if isinstance(code[0], BaseException):
        raise AssertionError(printed[-6000:]) from code[0]
    assert code == [0], printed[-6000:]
    import ray

    # the run joined this module's cluster: it must leave no actor of its own alive there (the GCS's table;
    # Ray's state API needs the dashboard, which this cluster does not start)
    alive = [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    assert not alive, alive
    return {"peak": peak[0], "samples": samples[0], "killed": killed, "printed": printed}


def check_run(out: Path, result: dict) -> list[float]:
    """The bound, each sample once per epoch, what is left on disk; returns the per-step losses."""
    shards = out / "shards"
    records = [r for e in range(3) for r in read_manifest(epoch_dir(shards, e, recapture=True))]
    largest = max(r.n_bytes for r in records)
    produced = sum(r.n_bytes for r in records)
    print(f"\n{out.name}: shard tree peak {result['peak']} bytes (cap {CAP} + largest shard {largest}) of {produced} "
          f"produced over 3 epochs, {result['samples']} samples")  # fmt: skip
    assert produced > 4 * CAP and result["peak"] > CAP - largest  # the cap bound the run
    assert result["peak"] <= CAP + largest
    keys = Counter(k for r in read_manifest(shards) for k in r.keys)
    assert len(keys) == 8 and set(keys.values()) == {1}
    per = consumed_per_epoch(out)
    assert sorted(per) == [0, 1, 2] and all(per[e] == keys for e in per), per  # every sample 3 times
    for e in range(3):  # every epoch captured once, DONE, and deleted once trained
        d = epoch_dir(shards, e, recapture=True)
        assert sorted(k for r in read_manifest(d) for k in r.keys) == sorted(keys) and (d / DONE_NAME).exists()
        assert not list(d.glob("*.tar"))
    assert list(sequences_dir(shards).glob("*.tar"))  # the token store stays for the whole run
    assert "capture.later_epochs=recapture: recapture (as configured)" in result["printed"]
    assert "keep:      disk" in result["printed"] and "SPEC.md section 6" in result["printed"]
    steps = read_jsonl(out / TRAIN_LOG)
    assert [r["step"] for r in steps] == list(range(1, 13))  # 8 samples / 2 ranks x 3 epochs
    return [r["loss"] for r in steps]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("recapture") / "whole"
    return check_run(out, run(out))


def test_three_recaptured_epochs_stay_under_the_cap_and_train_each_sample_three_times(uninterrupted):
    assert len(uninterrupted) == 12


def test_target_actor_and_trainer_rank_killed_in_epoch_2_resume_to_the_same_losses(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    result = run(out, kill=True)
    assert set(result["killed"]) == {"target", "trainer"}, result["killed"]
    assert "train: rank 1 was lost" in result["printed"]
    beat = json.loads((out / "heartbeat" / "target-0.json").read_text())
    assert beat["pid"] != result["killed"]["target"] and beat["state"] == "finished"  # Ray restarted it
    assert check_run(out, result) == uninterrupted  # the same per-step losses, bit for bit


def test_target_actors_are_stopped_when_training_ends_before_the_later_epochs_are_captured(ray_cluster, tmp_path):
    """train.max_steps (or a notice, or an error) can end training while the actors still capture
    later epochs that nobody would consume: the driver stops them (a real Ray actor here), unless
    every epoch is DONE (their results are then on the way and are waited for)."""
    from dflash_dist.orchestration.pipeline import _InThread, _stop_capture_after

    @ray_cluster.remote(num_cpus=0)
    class Capturing:
        def capture(self, seconds: float) -> str:
            time.sleep(seconds)
            return "done"

    dirs = [tmp_path / "shards", tmp_path / "shards" / "epoch_1"]
    for d in dirs:
        d.mkdir(parents=True)
    worker = Capturing.remote()
    ref = worker.capture.remote(3600)
    t0 = time.monotonic()
    assert _stop_capture_after(ray_cluster, [worker], [ref], _InThread(lambda: None), dirs)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(ref, timeout=30)  # killed, not restarted
    worker = Capturing.remote()
    ref = worker.capture.remote(3)
    for d in dirs:
        (d / DONE_NAME).write_text("{}")  # every epoch captured: its result is waited for
    assert not _stop_capture_after(ray_cluster, [worker], [ref], _InThread(lambda: None), dirs)
    assert ray_cluster.get(ref) == "done"
