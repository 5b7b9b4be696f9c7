"""The trainer's step-level data source (trainer/step_source.py) over real shards and a real gloo
group of 2 processes: whole steps agreed by both ranks, an epoch ending inside a step, the final
partial step, a preemption notice while a step is gathered, and a resume at another world size.

Samples are small synthetic tensors (the source never looks inside them); each rank process
writes what it got as JSON, and the test checks that every sample is trained exactly once per
epoch however the epochs, steps, notices and world sizes fall."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance
from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter, mark_done
from tests.helpers.zygote import Zygote

H, K = 8, 2
PROV = Provenance(SHARD_SCHEMA_VERSION, "synthetic", "0" * 64, (1, 2), H, "float32", "torch", "t")


def write_samples(shard_dir: Path, per_shard: list[int]) -> list[str]:
    """Shards of the given sizes (one sample each by default), DONE; returns every key."""
    keys = []
    g = torch.Generator().manual_seed(0)
    with ShardWriter(shard_dir, PROV, prefix="cap") as w:
        for s, n in enumerate(per_shard):
            for i in range(n):
                key = f"k{s:02d}-{i}"
                t = 12
                w.write(Sample(key, torch.randint(0, 50, (t,), generator=g, dtype=torch.int32),
                               torch.ones(t, dtype=torch.uint8), torch.randn(t, K * H, generator=g),
                               torch.zeros(t, dtype=torch.int32)))  # fmt: skip
                keys.append(key)
            w.flush()
    mark_done(shard_dir)
    return keys


def source_cfg(out: Path, epochs: int, grad_accum: int):
    from tests.helpers.config import config_from

    train = {"epochs": epochs, "grad_accum": grad_accum, "micro_batch_size": 1, "num_anchors": 4, "packing": False}
    return config_from({"run": {"out_dir": str(out), "seed": 0}, "target": {"kind": "tiny_stdlib"}, "train": train})


def rank_main(spec_path: str) -> None:
    """One rank: init gloo from the file store, drive a StepSource as the spec says, dump its steps."""
    import time

    import torch.distributed as dist

    from dflash_dist.config import load_config_dict
    from dflash_dist.trainer.step_source import DataLost, Halt, StepSource

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    try:
        cfg = load_config_dict(spec["cfg"])
        if rank == spec.get("manifest_fails_on"):  # this node's reading of the manifest fails (as an NFS ESTALE)
            from dflash_dist.trainer import step_source

            def unreadable(shard_dir):
                raise OSError(116, "Stale file handle", str(Path(shard_dir) / "manifest.jsonl"))

            step_source.read_manifest = unreadable
        if spec.get("reader_ends_between_reads"):  # the reader thread finishes while a slot is being read
            from dflash_dist.trainer.batching import MicroBatchFeeder

            status = MicroBatchFeeder.status

            def status_once_the_reader_ended(self):
                self._thread.join()  # (its queue holds every batch of these shards)
                return status(self)

            MicroBatchFeeder.status = status_once_the_reader_ended
            from data_pipeline.shard_reader import ShardStream

            skip_rest = ShardStream._skip_rest

            def slow_skip_rest(self, *args):  # the reader is still at its shard when the slot begins
                time.sleep(0.5)
                return skip_rest(self, *args)

            ShardStream._skip_rest = slow_skip_rest
        source = StepSource(cfg, spec["shards"], PROV, rank, world, torch.float32, planned_samples=spec["planned"],
                            recapture=spec.get("recapture", False))
        if spec.get("state") is not None:
            source.load_state_dict(spec["state"][rank])
        steps, halt, states, lost, error = [], None, [], None, None
        while halt is None:
            notice = signal.SIGTERM if rank == spec.get("notice_rank") and len(steps) == spec.get("notice_at") else 0
            try:
                got = source.next_step(notice)
            except DataLost as e:  # every rank at the same slot
                lost = {"error": str(e), "at_step": len(steps)}
                break
            except Exception as e:  # a reading error: every rank must get one, none may wait in a collective
                error = {"type": type(e).__name__, "error": str(e), "at_step": len(steps)}
                break
            ends = [e.__dict__ for e in got.epoch_ends]
            if isinstance(got, Halt):
                halt = {"notice": got.notice, "ends": ends}
                break
            steps.append({"epoch": got.epoch, "keys": [list(b.keys) for b in got.batches], "pads": got.pads,
                          "real_all": got.real_all, "samples_all": got.samples_all, "ends": ends})  # fmt: skip
            states.append(source.state_dict())
        source.close()
        out = {"steps": steps, "halt": halt, "states": states, "final": source.state_dict(), "data_lost": lost,
               "error": error}  # fmt: skip
        Path(spec["dump"] + f".{rank}.json").write_text(json.dumps(out))
        while error is not None and spec.get("linger") and not Path(spec["dump"] + ".release").exists():
            time.sleep(0.1)  # as a Ray actor whose task failed: the process and its gloo group stay up
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The rank processes' zygote (tests/helpers/zygote.py): torch, torch.distributed, the step source and
    this module imported once; each rank is a fresh fork of it. A rank started as `python -m
    tests.test_step_source` imported them again (~3 s of a core each)."""
    z = Zygote(["torch", "torch.distributed", "dflash_dist.config", "dflash_dist.trainer.step_source",
                "tests.test_step_source"], tmp_path_factory.mktemp("zygote") / "zygote.log")  # fmt: skip
    yield z
    z.close()


def run_ranks(zygote: Zygote, tmp: Path, name: str, world: int, cfg, shards: Path, planned: int,
              timeout_s: float = 240, linger: bool = False, **extra) -> list[dict]:  # fmt: skip
    """Each rank's dump. `linger`: a rank that failed keeps its process (and gloo group) up until every
    rank has dumped, so a peer left waiting in a collective is found by the timeout, not by gloo
    noticing a closed connection."""
    import time

    store = tmp / f"{name}.store"
    spec = {"cfg": cfg.to_dict(), "shards": str(shards), "planned": planned, "store": str(store),
            "dump": str(tmp / name), "linger": linger, **extra}  # fmt: skip
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    logs = [tmp / f"{name}.{r}.log" for r in range(world)]
    env = {"WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [zygote.start("tests.test_step_source:rank_main", [str(spec_path)], env | {"RANK": str(r)}, logs[r])
             for r in range(world)]  # fmt: skip
    dumps = [tmp / f"{name}.{r}.json" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while linger and not all(d.exists() for d in dumps) and time.monotonic() < deadline:
        time.sleep(0.2)
    (tmp / f"{name}.release").touch()
    try:
        if not linger or all(d.exists() for d in dumps):
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(deadline - time.monotonic(), 1))
        if any(p.poll() is None for p in procs):
            hung = [r for r, d in enumerate(dumps) if not d.exists()]
            raise AssertionError(f"rank(s) {hung} had no result after {timeout_s} s (waiting in a collective?)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the zygote's children, by pid
                p.wait(timeout=30)
    outs = [log.read_text() if log.exists() else "" for log in logs]
    assert [p.poll() for p in procs] == [0] * world, "\n".join(o[-3000:] for o in outs)
    return [json.loads(d.read_text()) for d in dumps]


def per_epoch(dumps: list[dict]) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for d in dumps:
        for step in d["steps"]:
            for keys in step["keys"]:
                seen.setdefault(step["epoch"], Counter()).update(keys)
    return seen


def test_epochs_end_inside_steps_and_the_remainder_is_trained(zygote, tmp_path):
    """5 one-sample shards over 2 ranks (3 and 2) with 2 micro-batches a step: step 1 is whole;
    in step 2 rank 1 fills its first slot with an empty batch while rank 0 trains its third sample,
    then the epoch ends inside the step, which is handed out short (the final partial step of the
    epoch, trained); the next step begins the next epoch; the last halt reports the last epoch."""
    shards = tmp_path / "shards"
    keys = write_samples(shards, [1] * 5)
    dumps = run_ranks(zygote, tmp_path, "a", 2, source_cfg(tmp_path / "out", epochs=2, grad_accum=2), shards, planned=5)
    for d in dumps:
        assert [s["epoch"] for s in d["steps"]] == [0, 0, 1, 1]
        assert [s["real_all"] for s in d["steps"]] == [4, 1, 4, 1]
        assert [s["samples_all"] for s in d["steps"]] == [4, 1, 4, 1]
        assert [len(s["ends"]) for s in d["steps"]] == [0, 0, 1, 0]  # epoch 0 is closed as step 3 begins
        assert d["halt"] == {"notice": None, "ends": [{"epoch": 1, "trained": 5, "lost": 0, "total": 5}]}
        assert d["steps"][2]["ends"] == [{"epoch": 0, "trained": 5, "lost": 0, "total": 5}]
    r0, r1 = dumps
    assert [len(s["keys"]) + s["pads"] for s in r0["steps"] + r1["steps"]] == [2] * 8  # every slot filled
    assert [s["pads"] for s in r0["steps"]] == [0, 1, 0, 1] and [s["pads"] for s in r1["steps"]] == [0, 2, 0, 2]
    seen = per_epoch(dumps)
    assert seen == {0: Counter(keys), 1: Counter(keys)}  # every sample exactly once per epoch, none dropped
    assert r0["final"]["epoch"] == 2


def test_a_notice_while_gathering_halts_every_rank_at_the_last_whole_step(zygote, tmp_path):
    """Rank 1 gets SIGTERM while the second step is gathered: both ranks halt without handing it
    out, their position is the first step's, and a source loaded from it trains exactly the rest."""
    shards = tmp_path / "shards"
    keys = write_samples(shards, [2] * 4)
    cfg = source_cfg(tmp_path / "out", epochs=1, grad_accum=2)
    first = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=8, notice_rank=1, notice_at=1)
    for d in first:
        assert len(d["steps"]) == 1 and d["halt"] == {"notice": "SIGTERM", "ends": []}
        assert d["final"] == d["states"][0]  # committed with the last whole step only
    rest = run_ranks(zygote, tmp_path, "b", 2, cfg, shards, planned=8, state=[d["final"] for d in first])
    assert per_epoch(first)[0] + per_epoch(rest)[0] == Counter(keys)


def test_a_resume_at_another_world_size_goes_through_the_source(zygote, tmp_path):
    """2 ranks stop after a step; 1 rank continues from StepSource.for_world of both states, and
    then 3 ranks from a 1-rank state: every sample once per epoch, the counts carried."""
    from dflash_dist.trainer.step_source import StepSource

    shards = tmp_path / "shards"
    keys = write_samples(shards, [3, 1, 2, 2, 1])
    cfg = source_cfg(tmp_path / "out", epochs=2, grad_accum=1)
    first = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=9, notice_rank=0, notice_at=2)
    saved = [d["final"] for d in first]
    one = StepSource.for_world(saved, 0, 1)
    assert one["carried"] == 4 and one["trained"] == 0 and one["epoch"] == 0
    second = run_ranks(zygote, tmp_path, "b", 1, cfg, shards, planned=9, state=[one], notice_rank=0, notice_at=4)
    three = [StepSource.for_world([second[0]["final"]], r, 3) for r in range(3)]
    third = run_ranks(zygote, tmp_path, "c", 3, cfg, shards, planned=9, state=three)
    seen = per_epoch(first + second + third)
    assert seen == {0: Counter(keys), 1: Counter(keys)}
    assert third[0]["halt"]["ends"][-1] == {"epoch": 1, "trained": 9, "lost": 0, "total": 9}
    ends = [e for d in second + third[:1] for s in d["steps"] for e in s["ends"]]
    assert {"epoch": 0, "trained": 9, "lost": 0, "total": 9} in ends  # the carried count closes epoch 0 right


def test_recaptured_epochs_are_read_from_their_own_growing_directories(zygote, tmp_path):
    """capture.later_epochs: recapture: epoch e >= 1 is read from shards/epoch_<e>/ in its manifest
    order as it grows (the rank assignment of epoch 0), not as a permutation of the root's shards;
    the trainers wait for a directory that does not exist yet. Every sample once per epoch."""
    import threading
    import time

    from data_pipeline.epoch_dirs import epoch_dir

    shards = tmp_path / "shards"
    keys = write_samples(shards, [1] * 6)
    g = torch.Generator().manual_seed(1)

    def write_epoch(e: int, order: list[str]) -> None:
        with ShardWriter(epoch_dir(shards, e, True), PROV, prefix="cap") as w:
            for key in order:
                w.write(Sample(key, torch.randint(0, 50, (12,), generator=g, dtype=torch.int32),
                               torch.ones(12, dtype=torch.uint8), torch.randn(12, K * H, generator=g),
                               torch.zeros(12, dtype=torch.int32)))  # fmt: skip
                w.flush()
        mark_done(epoch_dir(shards, e, True))

    orders = {1: keys[::-1], 2: keys[3:] + keys[:3]}
    write_epoch(1, orders[1])
    def after_ranks_started() -> None:  # the ranks read epochs 0 and 1, then wait for epoch 2's directory
        while not (tmp_path / "a.store").exists():
            time.sleep(0.1)
        time.sleep(5)
        write_epoch(2, orders[2])

    later = threading.Thread(target=after_ranks_started)
    later.start()
    cfg = source_cfg(tmp_path / "out", epochs=3, grad_accum=1)
    cfg.train.shuffle = False
    dumps = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=6, recapture=True)
    later.join()
    assert per_epoch(dumps) == {e: Counter(keys) for e in range(3)}
    for e in (1, 2):  # manifest order, shard i to rank i % 2: not the root's permutation
        for rank, d in enumerate(dumps):
            got = [k for s in d["steps"] if s["epoch"] == e for ks in s["keys"] for k in ks]
            assert got == orders[e][rank::2], (e, rank, got)
    assert dumps[0]["halt"]["ends"][-1] == {"epoch": 2, "trained": 6, "lost": 0, "total": 6}


def test_samples_the_capture_skipped_and_unreadable_ones_count_against_one_budget(zygote, tmp_path):
    """8 one-sample shards of the 9 samples the capture was given (one skipped as non-finite), one
    shard truncated, 2 epochs re-reading them (keep): 2 samples lost per epoch, 4 of the 18 the
    run trains on. data.max_lost_fraction=0.2 allows 3: each part alone (2 of 18 unreadable, 1 of
    9 skipped at capture) is within it, as the old separate checks found, but the run is not:
    every rank raises DataLost at the same slot naming both parts and the setting. 0.25 allows 4:
    the run trains, every readable sample once per epoch."""
    from data_pipeline.ledger import capture_loss_problem, record_skipped
    from data_pipeline.shard_reader import read_manifest

    shards = tmp_path / "shards"
    keys = write_samples(shards, [1] * 8)
    record_skipped(shards, "k-nonfinite", "non-finite features", 0)
    bad = shards / read_manifest(shards)[3].name
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    cfg = source_cfg(tmp_path / "out", epochs=2, grad_accum=1)
    cfg.data.max_lost_fraction = 0.2
    assert capture_loss_problem(shards, 0.2) is None  # the capture's own share is within the setting
    failed = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=9)
    assert all(d["data_lost"] is not None and d["halt"] is None for d in failed), failed
    assert len({d["data_lost"]["at_step"] for d in failed}) == 1  # the same slot on both ranks
    msg = failed[0]["data_lost"]["error"]
    assert ("2 sample(s) could not be read and 2 were skipped by the capture (non-finite features or an empty "
            "regenerated response, by reason in skipped.jsonl") in msg, msg  # fmt: skip
    assert "4 lost, more than data.max_lost_fraction=0.2 of the 18 the run trains on allows (3)" in msg, msg
    assert any(bad.name in d["data_lost"]["error"] for d in failed)  # the rank that read it names it

    cfg.data.max_lost_fraction = 0.25
    dumps = run_ranks(zygote, tmp_path, "b", 2, cfg, shards, planned=9)
    assert all(d["data_lost"] is None for d in dumps)
    readable = Counter(k for k in keys if k != read_manifest(shards)[3].keys[0])
    assert per_epoch(dumps) == {0: readable, 1: readable}
    assert dumps[0]["halt"]["ends"][-1] == {"epoch": 1, "trained": 7, "lost": 1, "total": 8}


def test_a_malformed_skipped_line_stops_every_rank_with_its_file_and_line(zygote, tmp_path):
    """Rank 0 alone reads the capture's skipped.jsonl, at every slot; a malformed line there used to
    raise on rank 0 before the slot's all-reduce, and rank 1 waited in it for as long as rank 0's
    process lived (a Ray actor's outlives its failed task). Now the failure rides in the all-reduce: rank 0 raises its
    own error naming the file, the line and the fix, rank 1 a PeerDataError carrying that text."""
    from data_pipeline.ledger import record_skipped
    from data_pipeline.records import SKIPPED_NAME

    shards = tmp_path / "shards"
    write_samples(shards, [1] * 4)
    record_skipped(shards, "k-nonfinite", "non-finite features", 0)
    with open(shards / SKIPPED_NAME, "ab") as f:
        f.write(b'{"key": "k-torn", "reas\n')  # a damaged line (the capture appends whole lines only)
    cfg = source_cfg(tmp_path / "out", epochs=1, grad_accum=1)
    cfg.data.max_lost_fraction = 0.5
    dumps = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=5, timeout_s=60, linger=True)
    r0, r1 = (d["error"] for d in dumps)
    assert r0 is not None and r1 is not None, dumps
    assert r0["type"] == "ValueError" and r1["type"] == "PeerDataError", (r0, r1)
    assert r0["at_step"] == r1["at_step"] == 0
    where = f"{shards / SKIPPED_NAME}:2: not a JSON line"
    for e in (r0, r1):
        assert where in e["error"] and "restore the file from a copy, or repair that line" in e["error"], e
    assert "rank 1 stops at epoch 0 because another rank could not read its data (rank 0: ValueError: " in r1["error"]


def test_a_position_one_rank_cannot_load_stops_its_peers_at_the_same_slot(zygote, tmp_path):
    """The same for an error of one rank alone while its stream opens (a resumed position it cannot
    load; its reader thread's errors take the same path): rank 1 is handed rank 0's position of a
    2-rank run and raises naming it, rank 0 a PeerDataError carrying that text, at one slot."""
    shards = tmp_path / "shards"
    write_samples(shards, [1] * 6)
    cfg = source_cfg(tmp_path / "out", epochs=1, grad_accum=1)
    first = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=6, notice_rank=0, notice_at=1)
    swapped = [first[0]["final"], first[0]["final"]]  # rank 1 gets rank 0's share
    r0, r1 = (d["error"] for d in run_ranks(zygote, tmp_path, "b", 2, cfg, shards, planned=6, state=swapped,
                                            timeout_s=60, linger=True))  # fmt: skip
    assert r1 is not None and r1["type"] == "ValueError" and "was saved by rank 0 of 2" in r1["error"], r1
    assert r0 is not None and r0["type"] == "PeerDataError", r0
    assert "(rank 1: ValueError: ShardStream state was saved by rank 0 of 2" in r0["error"], r0
    assert r0["at_step"] == r1["at_step"] == 0


def test_a_manifest_one_rank_cannot_read_at_an_epoch_end_stops_every_rank(zygote, tmp_path):
    """At an epoch's end each rank reads the finished manifest for the epoch's total, after the
    counts' all-reduce: an error there (one node's I/O error) raised on that rank alone, and its
    peers went on into the next epoch's first slot and waited in its all-reduce for as long as the
    failed rank's process lived. Now the read rides in the epoch end's all-reduce: rank 1 raises its
    own OSError, rank 0 a PeerDataError carrying its text, both at the same step."""
    shards = tmp_path / "shards"
    write_samples(shards, [1] * 4)
    cfg = source_cfg(tmp_path / "out", epochs=2, grad_accum=1)
    dumps = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=4, timeout_s=60, linger=True, manifest_fails_on=1)
    r0, r1 = (d["error"] for d in dumps)
    assert r1 is not None and r1["type"] == "OSError" and "Stale file handle" in r1["error"], dumps
    assert r0 is not None and r0["type"] == "PeerDataError", r0
    assert "(rank 1: OSError: [Errno 116] Stale file handle: " in r0["error"] and "manifest.jsonl" in r0["error"], r0
    assert r0["at_step"] == r1["at_step"] == 2  # epoch 0's two steps, then its end


def test_unreadable_samples_found_as_a_rank_runs_dry_count_in_that_slot(zygote, tmp_path):
    """A rank's reader thread may skip its last (corrupt, missing) shard and end while the slot is
    read. A slot that read the unreadable count before the status took the stale count with DRY,
    and the last epoch's last slot (every rank dry) is the budget's last check: the run ended
    without DataLost though it lost more than data.max_lost_fraction allows. Here every shard is
    truncated (4 of 4 samples lost, 0.5 allows 2) and the reader ends just before the status is
    read: every rank raises DataLost at step 0."""
    from data_pipeline.shard_reader import read_manifest

    shards = tmp_path / "shards"
    write_samples(shards, [2, 2])
    for record in read_manifest(shards):
        bad = shards / record.name
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    cfg = source_cfg(tmp_path / "out", epochs=1, grad_accum=1)
    cfg.data.max_lost_fraction = 0.5
    dumps = run_ranks(zygote, tmp_path, "a", 2, cfg, shards, planned=4, reader_ends_between_reads=True)
    for d in dumps:
        assert d["data_lost"] is not None and d["halt"] is None, d
        assert d["data_lost"]["at_step"] == 0 and "4 sample(s) could not be read" in d["data_lost"]["error"], d

