"""`dflash-dist status DIR` and the role heartbeats it reads: a run directory laid out by the
real writers (shards, heartbeats, train log, TensorBoard, eval results), read back from files."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from data_pipeline.disk_budget import BufferStatus, write_buffer_json
from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.actors.heartbeat import STALE_INTERVALS, Heartbeat, liveness, read_heartbeats
from dflash_dist.trainer.metrics import Metrics
from launcher import cli
from launcher.status import collect
from tests.helpers.shards import make_prov


def _sample(i: int, t: int = 24) -> Sample:
    return Sample(
        key=f"train-{i:08d}",
        input_ids=torch.arange(t, dtype=torch.int32),
        loss_mask=torch.ones(t, dtype=torch.uint8),
        features=torch.randn(t, 32).to(torch.bfloat16),
        target_argmax=torch.arange(t, dtype=torch.int32),
    )


def _beat(out: Path, role: str, index: int, state: str, age_s: float, info: dict, error: str | None = None) -> None:
    d = out / "heartbeat"
    d.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (d / f"{role}-{index}.json").write_text(
        json.dumps(
            {
                "role": role,
                "index": index,
                "pid": 100 + index,
                "host": "node1",
                "started": now - 100,
                "interval_s": 5.0,
                "state": state,
                "updated": now - age_s,
                "info": info,
                "error": error,
            }
        )
    )


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run in progress: 3 shards captured (capture done), the first consumed and deleted, one
    being written; trainer rank 0 alive at step 7, rank 1 lost; evaluator failed; 2 evals."""
    out = tmp_path / "run"
    cfg = {
        "run": {"name": "tiny"},
        "capture": {"num_actors": 1, "max_buffer_bytes": 1 << 20},
        "train": {"world_size": 2, "max_steps": None},
        "eval": {"enabled": True},
    }
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    shards = out / "shards"
    with ShardWriter(shards, make_prov(), max_shard_bytes=1, prefix="t000") as w:  # one sample per shard
        for i in range(3):
            w.write(_sample(i))
    mark_done(shards)
    names = sorted(p.name for p in shards.glob("*.tar"))
    (shards / names[0]).unlink()  # consumed by every rank, deleted
    (shards / ".tmp-t000-000009.tar").write_bytes(b"x" * 1000)  # a shard being written
    write_buffer_json(shards, BufferStatus(1 << 20, 777, 555, 3, 1, 1, True))  # the trainer's account
    _beat(out, "driver", 0, "running", 1.0, {"stages": ["extract", "train", "eval"]})
    _beat(out, "target", 0, "finished", 60.0, {"samples": 3})
    _beat(out, "trainer", 0, "running", 2.0, {"step": 7, "epoch": 0, "samples": 2, "shards_consumed": 2,
                                                    "samples_lost": 4})
    _beat(out, "trainer", 1, "running", 5.0 * STALE_INTERVALS + 30, {"step": 6, "epoch": 0, "shards_consumed": 1})
    _beat(out, "evaluator", 0, "failed", 10.0, {"evaluated": 2}, "ProvenanceMismatch: kernel_path torch != fla")
    (out / "train_log.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "epoch": 0, "loss": 5.0 - s / 10, "lr": 1e-3, "samples": 8 * s}) + "\n"
            for s in range(1, 7)
        )
        + '{"step": 7, "epo'
    )  # the last line is being appended
    m = Metrics(out / "tb" / "train")
    m.log(5, {"train/tokens_per_s": 1234.5})
    m.log(6, {"train/tokens_per_s": 2345.5, "train/loss": 4.4})
    m.close()
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step_4\n")
    (out / "eval").mkdir()
    for step, tau in ((2, 1.5), (4, 2.25)):
        (out / "eval" / f"step_{step}.json").write_text(
            json.dumps({"step": step, "tau_chain": tau, "tau_ddtree": {"4": tau + 0.5, "8": tau + 1.0}})
        )
    return out


def test_status_reads_every_part_of_a_run_from_its_files(run_dir):
    s = collect(run_dir)
    sh = s["shards"]
    assert (sh["produced"], sh["samples"], sh["tokens"], sh["capture_done"]) == (3, 3, 72, True)
    assert sh["deleted"] == 1 and sh["consumed_this_epoch"] == 3 and sh["epoch"] == 0
    on_disk = sum(p.stat().st_size for p in (run_dir / "shards").glob("*.tar"))
    assert s["disk"]["used_bytes"] == on_disk + 1000 and s["disk"]["in_flight_bytes"] == 1000
    assert s["disk"]["cap_bytes"] == 1 << 20 and s["disk"]["used_frac"] == pytest.approx((on_disk + 1000) / (1 << 20))
    assert s["disk"]["unconsumed_bytes"] == 777 and sh["released"] == 1  # from shards/buffer.json
    tr = s["trainer"]
    assert tr["step"] == 7  # rank 0's heartbeat is ahead of the last complete train_log line (6)
    assert tr["loss"] == pytest.approx(4.4) and tr["samples"] == 48 and tr["latest_checkpoint"] == "step_4"
    assert tr["tokens_per_s"] == {"value": pytest.approx(2345.5), "step": 6}
    assert tr["samples_lost"] == 4  # from the trainer heartbeats (rank 1's older one has none)
    assert s["eval"] == {"evaluated": 2, "step": 4, "tau_chain": 2.25, "tau_ddtree": {"4": 2.75, "8": 3.25},
                         "failed": "ProvenanceMismatch: kernel_path torch != fla"}  # the evaluator's heartbeat
    states = {(r["role"], r["index"]): r["state"] for r in s["roles"]}
    assert states == {
        ("driver", 0): "alive",
        ("target", 0): "finished",
        ("trainer", 0): "alive",
        ("trainer", 1): "lost",
        ("evaluator", 0): "failed",
    }
    errors = [r["error"] for r in s["roles"] if r["role"] == "evaluator"]
    assert errors == ["ProvenanceMismatch: kernel_path torch != fla"]


def test_a_failed_evaluator_is_a_line_of_the_summary_with_its_log(run_dir):
    """Its failure, not only a role's state in the table: as the driver said it when it happened
    (pipeline's evaluator watch, in the driver's heartbeat), else from the evaluator's own last
    heartbeat with the log file it named; none while it works."""
    from launcher.status import render

    _beat(run_dir, "evaluator", 0, "failed", 10.0, {"evaluated": 2, "log": "/tmp/r/logs/worker-1.err"}, "OSError: x")
    s = collect(run_dir)
    assert s["eval"]["failed"] == "OSError: x; its log: /tmp/r/logs/worker-1.err on node1"
    assert ("evaluator", f"FAILED: {s['eval']['failed']}") in render(s)[0]
    said = "the evaluator FAILED after measuring steps [2, 4]: OSError: x. Training continues ..."
    _beat(run_dir, "driver", 0, "running", 1.0, {"stages": ["extract", "train", "eval"], "evaluator_failed": said})
    assert collect(run_dir)["eval"]["failed"] == said
    _beat(run_dir, "driver", 0, "running", 1.0, {"stages": ["extract", "train", "eval"]})
    _beat(run_dir, "evaluator", 0, "running", 1.0, {"evaluated": 2})
    s = collect(run_dir)
    assert s["eval"]["failed"] is None and not [row for row in render(s)[0] if row[0] == "evaluator"]


def test_roles_the_run_should_have_but_never_started_are_listed(run_dir):
    for f in ("trainer-1.json", "evaluator-0.json"):
        (run_dir / "heartbeat" / f).unlink()
    states = {(r["role"], r["index"]): r["state"] for r in collect(run_dir)["roles"]}
    assert states[("trainer", 1)] == "not started" and states[("evaluator", 0)] == "not started"


def test_status_command_prints_a_table_and_json(run_dir, capsys):
    assert cli.main(["status", str(run_dir)]) == 0
    text = capsys.readouterr().out
    for needle in (
        "shards produced",
        "3 (3 samples",
        "disk buffer",
        "of 1.0 MiB",
        "step 7",
        "2346",
        "DDTree-4 2.75",
        "DDTree-8 3.25",
        "trainer[1]",
        "lost",
        "failed",
    ):
        assert needle in text, (needle, text)
    assert re.search(r"samples lost\W+4\b", text), text
    assert "3 (epoch 1 of 1)" in text and "epoch 1 of 1 loss" in text, text  # counted from 1
    assert cli.main(["status", str(run_dir), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["trainer"]["step"] == 7 and s["eval"]["tau_ddtree"]["8"] == 3.25


def test_status_of_a_directory_without_a_run_says_so(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "holds no dflash-dist run" in capsys.readouterr().err


def test_status_without_a_buffer_cap_or_anything_trained_yet(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump({"train": {"world_size": 1}}))
    s = collect(out)
    assert s["disk"] == {"used_bytes": 0, "in_flight_bytes": 0, "cap_bytes": None, "used_frac": None}
    assert s["trainer"]["step"] is None and s["trainer"]["tokens_per_s"] is None and s["eval"]["step"] is None
    assert s["shards"]["produced"] == 0 and s["shards"]["consumed_this_epoch"] is None


def test_heartbeat_beats_while_running_and_records_how_it_ended(tmp_path):
    progress = {"step": 0}
    with Heartbeat(tmp_path, "trainer", 1, info=lambda: dict(progress), interval_s=0.05) as beat:
        first = json.loads(beat.path.read_text())
        progress["step"] = 3
        time.sleep(0.3)
        running = json.loads(beat.path.read_text())
    assert first["state"] == running["state"] == "running" and first["info"] == {"step": 0}
    assert running["updated"] > first["updated"] and running["info"] == {"step": 3}
    assert liveness(running, now=running["updated"] + 0.05) == "alive"
    assert liveness(running, now=running["updated"] + 0.05 * STALE_INTERVALS + 1) == "lost"  # killed silently
    done = json.loads(beat.path.read_text())
    assert done["state"] == "finished" and done["error"] is None and liveness(done, now=1e12) == "finished"

    with pytest.raises(RuntimeError), Heartbeat(tmp_path, "evaluator", 0, interval_s=60):
        raise RuntimeError("target load failed")
    records = {(r["role"], r["index"]): r for r in read_heartbeats(tmp_path)}
    assert records[("evaluator", 0)]["state"] == "failed"
    assert records[("evaluator", 0)]["error"] == "RuntimeError: target load failed"


def test_a_failing_progress_callback_does_not_take_the_role_down(tmp_path):
    with Heartbeat(tmp_path, "target", 0, info=lambda: 1 / 0, interval_s=60) as beat:
        pass
    record = json.loads(beat.path.read_text())
    assert record["state"] == "finished" and "ZeroDivisionError" in record["info"]["info_error"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"role": "trainer", "index": 0}', "heartbeat field 'pid' is None"),
        ('["a", "list"]', "not a heartbeat record (a JSON list"),
        ("\x00\x01 not json", "not a readable heartbeat record"),
        (None, "heartbeat field 'updated' is 'yesterday'"),
    ],
)
def test_status_names_a_malformed_heartbeat_and_exits_nonzero(run_dir, capsys, content, message):
    path = run_dir / "heartbeat" / "trainer-0.json"
    if content is None:  # every field there, one of the wrong type
        content = json.dumps(json.loads(path.read_text()) | {"updated": "yesterday"})
    path.write_text(content)
    assert cli.main(["status", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dflash-dist status: {path}: ") and message in err, err


def test_status_shows_the_epoch_captured_and_the_epoch_trained_under_recapture(run_dir):
    """capture.later_epochs: recapture, train.epochs 3: epoch 0 DONE in shards/, epoch 1 being
    captured into shards/epoch_1/ (one shard listed, one in flight), the trainer in epoch 0."""
    from data_pipeline.epoch_dirs import RECAPTURE, epoch_dir, write_mode
    from launcher.status import render

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["train"]["epochs"] = 3
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    shards = run_dir / "shards"
    write_mode(shards, RECAPTURE)
    with ShardWriter(epoch_dir(shards, 1, True), make_prov(), max_shard_bytes=1, prefix="t000") as w:
        w.write(_sample(0))
    (epoch_dir(shards, 1, True) / ".tmp-t000-000001.tar").write_bytes(b"x" * 500)
    s = collect(run_dir)
    sh = s["shards"]
    assert (sh["later_epochs"], sh["epochs"], sh["capture_epoch"], sh["capture_done"]) == (RECAPTURE, 3, 1, False)
    assert (sh["produced"], sh["samples"]) == (4, 4)  # over both epochs' directories
    assert s["disk"]["in_flight_bytes"] == 1500
    summary = dict(render(s)[0])
    assert summary["epochs"] == "capturing 2, training 1 (of 3; later epochs: recapture)"  # counted from 1
    for e in (1, 2):
        epoch_dir(shards, e, True).mkdir(exist_ok=True)
        mark_done(epoch_dir(shards, e, True))
    assert collect(run_dir)["shards"]["capture_epoch"] is None
    assert dict(render(collect(run_dir))[0])["epochs"].startswith("all captured, training 1")


def test_a_finished_run_shows_its_last_epoch_and_every_epoch_read(run_dir):
    """After the last epoch the trainer's log says epoch 3 (0-based) of 4 and the shard stream's
    heartbeat epoch 4 with nothing consumed: shown as "training 4 (of 4" and "all 4 epochs read", not
    the "training 3 (of 4)" and "0 (epoch 4)" they were shown as (two counts, neither the user's)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["train"]["epochs"] = 4
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "train_log.jsonl").write_text(
        json.dumps({"step": 40, "epoch": 3, "loss": 1.5, "lr": 1e-4, "samples": 320}) + "\n")
    for i in (0, 1):
        _beat(run_dir, "trainer", i, "finished", 1.0, {"step": 40, "epoch": 4, "shards_consumed": 0})
    from launcher.status import render

    summary = dict(render(collect(run_dir))[0])
    assert summary["epochs"].startswith("captured once, training 4 (of 4;"), summary
    assert summary["shards consumed"].startswith("0 (all 4 epochs read)"), summary
    assert summary["trainer"].startswith("step 40 epoch 4 of 4 loss 1.5000"), summary
