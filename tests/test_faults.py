"""Fault tolerance of the trainer group and the evaluator.

The restart policy as a pure function; then real runs on a local Ray cluster (started and
stopped here): an error the trainer code would raise again from the same checkpoint stops the
run without a restart; an evaluator SIGKILLed mid-run is restarted by Ray and measures every
export exactly once; and a whole `dflash-dist run` whose target actor, trainer rank and
evaluator are SIGKILLed: the lost rank's group is replaced by a new one that resumes from the
latest complete checkpoint, the run ends with every sample captured once and trained exactly
once per epoch, and a checkpoint of another LR schedule length is refused before any rank starts.
Real DeepSpeed over gloo on the tiny targets of tests/helpers/tiny.py and tests/helpers/eval_target.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data_pipeline.records import DONE_NAME, MANIFEST_NAME
from dflash_dist.actors.faults import DIED, ERROR, Decision, Failure, RestartPolicy, decide_restart, restart_resume
from dflash_dist.config import ConfigError, load_config
from dflash_dist.orchestration.pipeline import PipelineError, supervise_training, wait_evaluator
from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.checkpoint import ResumeError
from dflash_dist.trainer.loop import TRAIN_LOG
from tests.conftest import REPO
from tests.helpers.config import config_from
from tests.helpers.eval_target import publish
from tests.helpers.runs import cli_run_thread, consumed_per_epoch, read_jsonl
from tests.helpers.tiny import make_cfg, write_shards

NUM = 16  # 8 shards of 2: 4 steps of 2 ranks x 2 samples per epoch, nothing dropped
EPOCHS = 2
EVERY = 2  # checkpoint_every


# ---------------------------------------------------------------------------- the policy (pure)
def test_restarts_with_backoff_until_the_budget_is_spent():
    policy = RestartPolicy(max_restarts=3, backoff_s=2.0, max_backoff_s=5.0)
    lost = [Failure(DIED, 1, "ActorDiedError: the actor died", f"ckpt/step_{2 * i}") for i in range(4)]
    decisions = [decide_restart(policy, lost[: n + 1]) for n in range(4)]
    assert [(d.restart, d.delay_s) for d in decisions] == [(True, 2.0), (True, 4.0), (True, 5.0), (False, 0.0)]
    assert "rank 1 was lost: ActorDiedError" in decisions[0].message and "restart 1 of 3" in decisions[0].message
    assert "train.max_restarts=3" in decisions[3].message and "--resume auto" in decisions[3].message
    # no restarts allowed: the first failure stops the run
    assert not decide_restart(RestartPolicy(0), lost[:1]).restart
    # a lost process is retried even from the same checkpoint: it may not be lost again
    same_ckpt = [Failure(DIED, 0, "node died", None)] * 2
    assert decide_restart(policy, same_ckpt) == Decision(True, 4.0, decide_restart(policy, same_ckpt).message)


def test_the_restart_backoff_comes_from_the_config(tmp_path):
    """train.restart_backoff_s / max_restart_backoff_s set the waits of supervise_training's policy (a lost
    node on a Slurm or autoscaled cluster may need minutes to be replaced); negative values are refused."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.restart_backoff_s=30", "train.max_restart_backoff_s=90"])
    policy = RestartPolicy.of_train(cfg.train)
    assert policy == RestartPolicy(cfg.train.max_restarts, 30.0, 90.0)
    lost = [Failure(DIED, 1, "node died", f"ckpt/step_{i}") for i in range(3)]
    assert [decide_restart(policy, lost[: n + 1]).delay_s for n in range(3)] == [30.0, 60.0, 90.0]
    assert "in 30s" in decide_restart(policy, lost[:1]).message
    assert RestartPolicy.of_train(load_config(REPO / "configs" / "tiny.yaml").train) == RestartPolicy(3)
    with pytest.raises(ConfigError, match=r"train.restart_backoff_s"):
        load_config(REPO / "configs" / "tiny.yaml", ["train.restart_backoff_s=-1"])
    with pytest.raises(ConfigError, match=r"train.max_restart_backoff_s=10.0 is below train.restart_backoff_s=120.0"):
        load_config(REPO / "configs" / "tiny.yaml", ["train.restart_backoff_s=120", "train.max_restart_backoff_s=10"])
    # a sub-second wait is said as it is; a run allowed thousands of restarts waits the cap, not an overflow
    assert "in 0.4s" in decide_restart(RestartPolicy(3, 0.4, 60.0), lost[:1]).message
    many = [Failure(DIED, 1, "node died", f"ckpt/step_{i}") for i in range(1100)]
    assert decide_restart(RestartPolicy(2000, 2.0, 60.0), many).delay_s == 60.0


def test_the_same_error_twice_from_the_same_checkpoint_stops():
    policy = RestartPolicy(max_restarts=5)
    boom = Failure(ERROR, 0, "OSError: disk full", "ckpt/step_4", ("OSError", "Exception"))
    assert decide_restart(policy, [boom]).restart  # could be transient (a full disk, say)
    stop = decide_restart(policy, [boom, boom])
    assert not stop.restart and "twice from ckpt/step_4 with the same error" in stop.message
    assert "OSError: disk full" in stop.message
    # progress between them (another checkpoint), another error, or a lost process in between: retried
    assert decide_restart(policy, [boom, Failure(ERROR, 0, "OSError: disk full", "ckpt/step_6")]).restart
    assert decide_restart(policy, [boom, Failure(ERROR, 1, "RuntimeError: gloo timeout", "ckpt/step_4")]).restart
    assert decide_restart(policy, [boom, Failure(DIED, 1, "lost", "ckpt/step_4"), boom]).restart
    assert "step 0" in decide_restart(policy, [Failure(ERROR, 0, "x", None)] * 2).message


def test_an_error_replaying_cannot_change_stops_at_once():
    """A refused resume, a bad sample, a non-finite loss or unreadable data fail again from the same
    checkpoint: no restart is spent on them (subclasses by their MRO names)."""
    policy = RestartPolicy(max_restarts=5)
    for types in (("ValueError", "Exception"), ("ResumeError", "ValueError", "Exception"),
                  ("DataLost", "RuntimeError", "Exception"), ("FloatingPointError", "ArithmeticError")):
        stop = decide_restart(policy, [Failure(ERROR, 1, f"{types[0]}: x", "ckpt/step_4", types)])
        assert not stop.restart and "would fail the same way" in stop.message and "rank 1 failed" in stop.message
    assert decide_restart(policy, [Failure(ERROR, 0, "RuntimeError: NCCL", None, ("RuntimeError",))]).restart
    assert decide_restart(policy, [Failure(DIED, 0, "ValueError in a dead process", None, ("ValueError",))]).restart


def test_restart_resume_and_config_fields():
    assert restart_resume("never", has_checkpoint=True) == "auto"
    assert restart_resume("never", has_checkpoint=False) == "never"  # from step 0 again
    assert restart_resume("/other/run/checkpoints/step_8", has_checkpoint=False) == "/other/run/checkpoints/step_8"
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.max_restarts=0", "eval.max_restarts=5"])
    assert (cfg.train.max_restarts, cfg.eval.max_restarts) == (0, 5)
    with pytest.raises(ConfigError, match=r"train.max_restarts must be >= 0"):
        load_config(REPO / "configs" / "tiny.yaml", ["train.max_restarts=-1"])
    with pytest.raises(ConfigError, match=r"eval.max_restarts: expected int"):
        load_config(REPO / "configs" / "tiny.yaml", ["eval.max_restarts=x"])


# ---------------------------------------------------------------------------- trainer: a rank killed
@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "shards"
    write_shards(path, tiny["prov"], tiny["samples"][:NUM], done=True)
    return path


def test_an_error_the_trainer_code_raises_again_from_the_same_checkpoint_spends_no_restart(tiny, shards, ray_cluster,
                                                                                          tmp_path):
    """An error the trainer code raises is reported as such; one that replaying the same checkpoint
    and data raises again (here the rank refuses shards of another target) spends no restart. One
    rank shows it: the decision reads the error's type, not how many ranks raised it. (A rank lost
    and its group restarted from the checkpoint, each sample once per epoch, is the whole-run test's
    trainer kill below, on the same supervise_training.)"""
    from dflash_dist.actors.trainer_group import start_trainer_group

    out = tmp_path / "run"
    resumes: list[str] = []

    def start(resume: str, total_steps: int | None = None):
        resumes.append(resume)
        return start_trainer_group(one, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM,
                                   total_steps=total_steps, resume=resume)

    other = dataclasses.replace(tiny["prov"], target_hash="0" * 64)
    one = make_cfg(out, tiny["target_dir"], epochs=EPOCHS, checkpoint_every=EVERY, max_restarts=2, world_size=1)
    group = start_trainer_group(one, tiny["target_dir"], shards, other, tiny["drafter"], num_samples=NUM,
                                resume="never")  # fmt: skip
    with pytest.raises(PipelineError, match=r"(?s)failed: ProvenanceMismatch: .*target_hash.*fail the same way"):
        supervise_training(one, group, start, "never")
    assert resumes == []  # max_restarts=2 left, none spent


# ---------------------------------------------------------------------------- evaluator: killed
def test_killed_evaluator_is_restarted_and_measures_every_export_once(tiny_eval, ray_cluster, tmp_path):
    from transformers import AutoTokenizer

    from dflash_dist.actors.evaluator_actor import EvaluatorActor, EvaluatorTask, evaluator_actor_options
    from dflash_dist.evaluator import EvalResult
    from dflash_dist.target.loading import expected_provenance, target_identity

    ray = ray_cluster
    out = tmp_path / "run"
    cfg = config_from(tiny_eval["cfg"].to_dict(), "eval.num_cpus=0.5", "eval.max_restarts=1", "eval.poll_s=0.1",
                      f"run.out_dir={json.dumps(str(out))}")  # fmt: skip
    target_dir = tiny_eval["target_dir"]
    expected = expected_provenance(cfg, target_dir, target_identity(cfg, target_dir),
                                   AutoTokenizer.from_pretrained(target_dir))
    (out / "export").mkdir(parents=True)
    task = EvaluatorTask(cfg.to_dict(), str(target_dir), tuple(tuple(p) for p in tiny_eval["prompts"]),
                         expected=expected)
    actor = EvaluatorActor.options(**evaluator_actor_options(cfg)).remote(task)
    actor.start.remote()
    publish(tiny_eval, out, "random", 10)
    deadline = time.time() + 120
    while 10 not in (status := ray.get(actor.status.remote()))["evaluated"]:
        assert status["error"] is None and time.time() < deadline, status
        time.sleep(0.2)
    first = (out / "eval" / "step_10.json").stat()
    os.kill(status["pid"], signal.SIGKILL)
    publish(tiny_eval, out, "trained", 20)  # while it is down: both are measured after the restart
    publish(tiny_eval, out, "random", 30)

    results = wait_evaluator(ray, actor, 30, cfg.eval.max_restarts)
    assert all(type(r) is EvalResult for r in results)
    assert [r.step for r in results] == [10, 20, 30]
    after = ray.get(actor.status.remote())
    assert after["restarted"] and after["pid"] != status["pid"] and after["evaluated"] == [10, 20, 30]
    again = (out / "eval" / "step_10.json").stat()  # measured once: the restarted actor did not redo it
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    acc = EventAccumulator(str(out / "tb" / "eval"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/tau_chain")] == [10, 20, 30]  # each point once, none missing
    assert results[1].tau_chain > results[0].tau_chain + 0.5 and results[2].tau_chain == results[0].tau_chain

    # its one restart is spent: lost again, the run stops naming eval.max_restarts
    os.kill(after["pid"], signal.SIGKILL)
    with pytest.raises(PipelineError, match=r"evaluator was lost 2 time\(s\), more than eval.max_restarts=1"):
        wait_evaluator(ray, actor, 30, cfg.eval.max_restarts)


# ---------------------------------------------------------------------------- the whole run
# the tiny config, shortened: 32 one-sample shards (16 per rank: no sample dropped for lock-step),
# 2 epochs of 4 steps, a checkpoint and export every 2 steps, every export measured
E2E = [
    "data.max_train_samples=32",
    "capture.regenerate=false",
    "capture.shard_bytes=1",
    "capture.token_budget=768",  # ~3 samples per forward: a capture long enough to be killed mid-way
    "train.epochs=2",
    "train.checkpoint_every=2",
    "train.log_sample_keys=true",
    "train.restart_backoff_s=1",  # the run's config reaches supervise_training's wait (the log says "in 1s")
    "eval.num_prompts=2",
    "eval.max_new_tokens=16",
    "eval.poll_s=0.5",
    "eval.max_backlog=100",
]


@pytest.mark.slow
def test_tiny_run_survives_a_killed_target_actor_trainer_rank_and_evaluator(ray_cluster, tmp_path):
    """`dflash-dist run` of the tiny config: the target actor is SIGKILLed once it has published a
    shard, trainer rank 1 after the step-2 checkpoint and the evaluator once it has measured an
    export; the run still completes, every sample is captured once and trained exactly once per
    epoch, and every export's tau is reported. The lost rank is said (ActorDiedError, restart 1 of
    train.max_restarts=3) and its group replaced by one resuming (auto) from the run's latest checkpoint
    (this test also holds what a killed 2-rank group of start_trainer_group proved here before: the
    same supervise_training, the same kill of rank 1 after a checkpoint); afterwards the run's
    checkpoint is refused by a group planned over another LR schedule length, before any rank starts.
    The run is the CLI's main in this process, on this
    module's cluster (the product joins a cluster its process has already joined; its 2 CPUs hold
    the run's 4 actors, nothing else runs there now) rather than a CLI process starting one: what
    is proven is Ray's restarts and the run's recovery, not a cluster's start. After the run no
    actor it started is alive there."""
    import contextlib

    from data_pipeline.shard_reader import read_manifest

    out = tmp_path / "run"
    log = tmp_path / "run.log"
    code: list = []
    beats, killed = out / "heartbeat", set()
    shards, target_pid = out / "shards", None
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        driver = cli_run_thread(["run", str(REPO / "configs" / "tiny.yaml"), "--out", str(out), *E2E], code)
        deadline = time.time() + 900
        while len(killed) < 3 and driver.is_alive():
            assert time.time() < deadline, "the run never reached the points to kill at"
            if "target" not in killed and (beats / "target-0.json").exists() and (shards / MANIFEST_NAME).exists():
                assert not (shards / DONE_NAME).exists(), "the capture finished before it could be killed"
                target_pid = json.loads((beats / "target-0.json").read_text())["pid"]
                os.kill(target_pid, signal.SIGKILL)
                killed.add("target")
            if "trainer" not in killed and (out / TRAIN_LOG).exists() and len(read_jsonl(out / TRAIN_LOG)) >= 3:
                os.kill(json.loads((beats / "trainer-1.json").read_text())["pid"], signal.SIGKILL)
                killed.add("trainer")
            if "evaluator" not in killed and list((out / "eval").glob("step_*.json")):
                os.kill(json.loads((beats / "evaluator-0.json").read_text())["pid"], signal.SIGKILL)
                killed.add("evaluator")
            time.sleep(0.05)
        driver.join(timeout=900)
        assert not driver.is_alive(), "the run did not finish in time"
    printed = log.read_text()
    if isinstance(code[0], BaseException):
        raise AssertionError(printed[-6000:]) from code[0]
    assert code == [0], printed[-6000:]
    # the run joined this module's cluster: it must leave no actor of its own there, alive or RESTARTING (the GCS's
    # table; a kill is asynchronous: a few seconds' grace). The evaluator was left RESTARTING into the removed
    # placement group until the run ended it itself
    deadline = time.monotonic() + 10
    while (alive := [(a["ActorClassName"], a["State"]) for a in ray_cluster._private.state.actors().values()
                     if a["State"] != "DEAD"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, alive
    assert killed == {"target", "trainer", "evaluator"}, f"the run ended before every kill: {killed}"
    assert json.loads((beats / "target-0.json").read_text())["pid"] != target_pid  # Ray restarted it
    assert "train: rank 1 was lost: ActorDiedError" in printed and "restart 1 of 3 in 1s" in printed, printed[-6000:]
    assert "evaluator restarted" in printed, printed[-6000:]
    # the new group resumed (auto) from this run's latest checkpoint before the kill: one resume, from a tag
    # of this run's checkpoints after the first and before the end
    resumed = re.findall(rf"resuming from {re.escape(str(out / 'checkpoints'))}/(step_\d+)", printed)
    assert len(resumed) == 1 and 2 <= checkpoint.tag_step(resumed[0]) < 8, resumed
    assert "training finished at step 8" in printed and "[train] 8 steps, 2 epoch(s) completed" in printed
    steps = [r["step"] for r in read_jsonl(out / TRAIN_LOG)]
    assert steps == list(range(1, 9))
    assert checkpoint.read_latest(out / "checkpoints") == "step_8"
    keys = Counter(k for r in read_manifest(out / "shards") for k in r.keys)
    per = consumed_per_epoch(out)
    assert len(keys) == 32 and set(keys.values()) == {1}  # the restarted actor redid only the rest
    assert sorted(per) == [0, 1] and all(per[e] == keys for e in per), per
    evals = {int(p.stem.split("_")[1]) for p in (out / "eval").glob("step_*.json")}
    assert evals == {2, 4, 6, 8} and "tau chain" in printed  # every export measured and reported

    # a checkpoint this run cannot continue (another LR schedule length) is refused once, by the driver's
    # decision, before any rank starts
    from transformers import AutoTokenizer

    from dflash_dist.actors.trainer_group import start_trainer_group
    from dflash_dist.config import load_config_dict
    from dflash_dist.target.loading import drafter_config_for, resolve_target_dir, tokenizer_mask_id

    cfg = load_config_dict(yaml.safe_load((out / "config.yaml").read_text()))  # the run's own config
    target_dir = resolve_target_dir(cfg)
    drafter = drafter_config_for(cfg, target_dir, tokenizer_mask_id(AutoTokenizer.from_pretrained(target_dir)))
    prov = read_manifest(out / "shards")[0].provenance
    with pytest.raises(ResumeError, match=r"spans 64 samples, this run.s 9 steps"):
        start_trainer_group(cfg, target_dir, out / "shards", prov, drafter, num_samples=32, total_steps=9,
                            resume="auto")
    assert checkpoint.read_latest(out / "checkpoints") == "step_8"
