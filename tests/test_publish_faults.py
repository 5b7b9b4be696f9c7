"""A rank whose file work fails before a collective stops every rank there, instead of leaving its
peers waiting in the next collective (30 minutes under gloo's default timeout, or for as long as
the failed rank's process lives: a Ray actor's outlives its failed task).

Rank 0 alone publishes a checkpoint (marker, `latest`, pruning, the shards' release), writes the
export, rewinds `latest` on a resume and opens the logs; each failure here is a real one on disk
(a directory where `latest` or train_log.jsonl is expected, a file where the export directory is,
a released.json that is not one). Rank 0 must raise its own error and rank 1, within seconds, a
PeerError naming rank 0 and carrying its message; a checkpoint whose publication failed is never
named by `latest` unless it is complete.

Real DeepSpeed (ZeRO-2) over gloo: 2 ranks as processes running this module's `main`, each a fresh
fork of a zygote that has imported torch, DeepSpeed and the trainer once (tests/helpers/zygote.py),
on the tiny target of tests/helpers/tiny.py. A failed rank stays up until the test has every rank's
outcome, so a peer left in a collective is found by the timeout, not by gloo noticing a closed
connection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from data_pipeline.records import RELEASED_NAME
from dflash_dist.config import Config, load_config_dict
from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.loop import TRAIN_LOG, TrainJob
from dflash_dist.trainer.resume import decide
from dflash_dist.trainer.state import STATE_VERSION
from tests.helpers.jobs import job_from_json
from tests.helpers.procs import free_port
from tests.helpers.tiny import make_cfg, write_shards
from tests.helpers.zygote import TRAINER_MODULES, Zygote

NUM = 8  # 4 shards of 2 samples: 2 steps of 2x2 samples per epoch
STEPS = 2  # one checkpoint, at step 2
PEER_S = 15  # how long after the first rank's outcome its peer may take to report its own


def cfg_for(out: Path, tiny, *overrides: str) -> Config:
    return make_cfg(out, tiny["target_dir"], *overrides, epochs=1, max_steps=STEPS, checkpoint_every=STEPS)


def job_for(tiny, shards: Path, cfg: Config, resume_from: Path | None = None) -> TrainJob:
    decision = None if resume_from is None else decide(str(resume_from), cfg, shards, (STEPS, "step"), STATE_VERSION)
    return TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=STEPS,
                    resume=decision, num_samples=NUM)  # fmt: skip


def run_two_ranks(zygote: Zygote, cfg: Config, job: TrainJob, dump: Path) -> list[dict]:
    """Both ranks' outcomes ({"error": {type, text, at}} or {"result": ...}). Once one rank has
    reported, the other must within PEER_S; otherwise both are killed and the test fails naming
    the rank that was still waiting."""
    spec = dump.with_name(dump.name + ".spec.json")
    job_dict = dataclasses.asdict(job) | {"provenance": job.provenance.to_dict()}
    release = dump.with_name(dump.name + ".release")
    spec.write_text(json.dumps({"cfg": cfg.to_dict(), "job": job_dict, "dump": str(dump), "release": str(release)}))
    outcomes = [dump.with_name(f"{dump.name}.rank{r}.json") for r in range(2)]
    logs = [dump.with_name(f"{dump.name}.rank{r}.log") for r in range(2)]
    port = str(free_port())
    procs = []
    try:
        for rank in range(2):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
            procs.append(zygote.start("tests.test_publish_faults:main", [str(spec)], env, logs[rank]))
        first = None
        deadline = time.monotonic() + 240
        while not all(o.exists() for o in outcomes) and time.monotonic() < deadline:
            if first is None and any(o.exists() for o in outcomes):
                first = time.monotonic()
                deadline = min(deadline, first + PEER_S)
            if any(p.poll() not in (None, 0) for p in procs):
                break  # a rank died without an outcome
            time.sleep(0.1)
        missing = [r for r, o in enumerate(outcomes) if not o.exists()]  # before a lingering rank leaves
        release.touch()
        codes = [p.wait(timeout=30) for p in procs] if not missing else None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the zygote's children, by pid
                p.wait(timeout=30)
    texts = "\n".join(f"--- rank {r}\n{log.read_text()[-3000:] if log.exists() else ''}" for r, log in enumerate(logs))
    assert not missing, f"rank(s) {missing}: no outcome {PEER_S} s after the peer's (waiting in a collective?)\n{texts}"
    assert codes == [0, 0], f"exit codes {codes}\n{texts}"
    return [json.loads(o.read_text()) for o in outcomes]


def main(spec_path: str) -> None:
    """A rank of run_two_ranks (forked from the zygote, its environment set): its process group, the
    trainer, its outcome; a failed rank lingers
    (as a Ray actor's process outlives its failed task) until the test has every outcome."""
    import torch
    import torch.distributed as dist

    from data_pipeline.durable_files import write_text_atomic
    from dflash_dist.actors.trainer_group import join_group
    from dflash_dist.trainer.loop import Trainer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    job = job_from_json(spec["job"])
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    rank = dist.get_rank()
    try:
        result = dataclasses.asdict(Trainer(load_config_dict(spec["cfg"]), job).run())
        outcome = {"result": result}
    except Exception as e:  # noqa: BLE001 - the outcome under test
        outcome = {"error": {"type": type(e).__name__, "text": str(e), "at": time.time()}}
    dump = Path(spec["dump"])
    write_text_atomic(dump.with_name(f"{dump.name}.rank{rank}.json"), json.dumps(outcome))
    release = Path(spec["release"])
    deadline = time.monotonic() + 300
    while "error" in outcome and not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.destroy_process_group()


def errors(outcomes: list[dict]) -> tuple[dict, dict]:
    """Rank 0's and rank 1's errors, checked to have come within seconds of each other."""
    assert all("error" in o for o in outcomes), outcomes
    e0, e1 = (o["error"] for o in outcomes)
    assert abs(e0["at"] - e1["at"]) < 5, (e0, e1)
    return e0, e1


def assert_peer_error(e1: dict, where: str, e0: dict) -> None:
    assert e1["type"] == "PeerError", e1
    assert f"rank 1 stops {where} because another rank failed there (rank 0: {e0['type']}: {e0['text']})" in (
        e1["text"]), (e1, e0)  # fmt: skip


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The rank processes' zygote: torch, DeepSpeed, the trainer and this module imported once."""
    z = Zygote([*TRAINER_MODULES, "data_pipeline.durable_files", "tests.test_publish_faults"],
               tmp_path_factory.mktemp("zygote") / "zygote.log")  # fmt: skip
    yield z
    z.close()


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("publish_faults") / "shards"
    write_shards(path, tiny["prov"], tiny["samples"][:NUM], done=True)
    return path


def test_a_commit_and_a_rewind_that_fail_on_rank_0_stop_both_ranks(zygote, tiny, shards, tmp_path):
    """`latest` is a directory: rank 0's commit writes the step's marker (every rank's files are
    durable by then), then cannot rename `latest` over it; rank 1 used to wait in the export's
    barrier. The tag is complete, so resuming from it works, until rank 0's rewind reads
    `latest`; rank 1 used to wait in the broadcast after it."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    (ckpt / checkpoint.LATEST).mkdir(parents=True)
    (ckpt / checkpoint.LATEST / "kept").write_text("a directory where the file `latest` belongs\n")
    cfg = cfg_for(out, tiny)
    e0, e1 = errors(run_two_ranks(zygote, cfg, job_for(tiny, shards, cfg), tmp_path / "a"))
    assert e0["type"] == "IsADirectoryError" and str(ckpt / checkpoint.LATEST) in e0["text"], e0
    assert_peer_error(e1, "publishing step_2", e0)
    tag = ckpt / checkpoint.tag_name(STEPS)
    assert checkpoint.read_marker(tag) is not None  # the marker only after every rank's files
    assert not (out / "export" / tag.name).exists()

    e0, e1 = errors(run_two_ranks(zygote, cfg, job_for(tiny, shards, cfg, tag), tmp_path / "b"))
    assert e0["type"] == "IsADirectoryError" and str(ckpt / checkpoint.LATEST) in e0["text"], e0
    assert_peer_error(e1, f"resuming from {tag}", e0)


def test_a_release_that_fails_on_rank_0_stops_both_ranks_after_the_commit(zygote, tiny, shards, tmp_path):
    """After the commit rank 0 releases the shards the checkpoint covers; a released.json that is
    not a record stops it with its own error naming the file, and rank 1 at the same point (it
    used to wait in the export's barrier). The checkpoint was complete and is `latest`."""
    shard_dir = tmp_path / "shards"
    write_shards(shard_dir, tiny["prov"], tiny["samples"][:NUM], done=True)
    (shard_dir / RELEASED_NAME).write_text("{not json\n")
    out = tmp_path / "run"
    cfg = cfg_for(out, tiny, "capture.max_buffer_bytes=8000000000", "capture.consumed_shards=keep")
    e0, e1 = errors(run_two_ranks(zygote, cfg, job_for(tiny, shard_dir, cfg), tmp_path / "a"))
    assert e0["type"] == "ValueError" and f"{shard_dir / RELEASED_NAME}: not a released-shards record" in e0["text"]
    assert_peer_error(e1, "publishing step_2", e0)
    assert checkpoint.read_latest(out / "checkpoints") == "step_2"
    assert checkpoint.read_marker(out / "checkpoints" / "step_2") is not None


def test_an_export_that_fails_on_rank_0_stops_both_ranks(zygote, tiny, shards, tmp_path):
    """A file where the export directory belongs: rank 0's export raises, rank 1 used to wait in the
    barrier after it. The checkpoint was published before."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "export").write_text("a file where the export directory belongs\n")
    cfg = cfg_for(out, tiny)
    e0, e1 = errors(run_two_ranks(zygote, cfg, job_for(tiny, shards, cfg), tmp_path / "a"))
    assert e0["type"] == "FileExistsError" and str(out / "export") in e0["text"], e0
    assert_peer_error(e1, "exporting step_2", e0)
    assert checkpoint.read_latest(out / "checkpoints") == "step_2"


def test_logs_rank_0_cannot_open_stop_both_ranks_before_training(zygote, tiny, shards, tmp_path):
    """A directory where train_log.jsonl belongs: rank 0 cannot open the step logs, and rank 1
    used to wait in the first step's data agreement."""
    out = tmp_path / "run"
    (out / TRAIN_LOG).mkdir(parents=True)
    cfg = cfg_for(out, tiny)
    e0, e1 = errors(run_two_ranks(zygote, cfg, job_for(tiny, shards, cfg), tmp_path / "a"))
    assert e0["type"] == "IsADirectoryError" and str(out / TRAIN_LOG) in e0["text"], e0
    assert_peer_error(e1, "opening the logs", e0)
    assert not (out / "checkpoints").exists()


