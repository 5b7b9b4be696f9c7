"""Multi-node logic on one machine: a `ray.cluster_utils.Cluster` of three fake nodes bound to
127.0.0.1, each declaring the custom resource of one role (ray.node_resources). Every role's
actor runs on its node (node id asked from inside the actor), and the run survives a trainer
rank's worker process on the trainer node being killed: the group restarts there from the latest
checkpoint and trains every sample exactly once per epoch. Real Ray, DeepSpeed over gloo, on the
tiny target of tests/helpers/tiny.py.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")  # three raylets on a busy 2-core machine

import pytest
import ray

from dflash_dist.actors.trainer_group import default_extensions_dir
from dflash_dist.config import Config
from dflash_dist.orchestration.pipeline import supervise_training
from dflash_dist.orchestration.placement import actor_placement, plan_placement, release, reserve
from dflash_dist.trainer.loop import TRAIN_LOG
from tests.helpers.procs import kill_when
from tests.helpers.runs import consumed_per_epoch, read_jsonl
from tests.helpers.tiny import make_cfg, write_shards

NUM = 16  # 8 shards of 2: 4 steps of 2 ranks x 2 samples per epoch
EPOCHS = 2
STEPS = 4 * EPOCHS
NODE_OF = {"target": "target_node", "trainer": "trainer_node", "evaluator": "eval_node"}


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver's node, the evaluator's resource) + a target node + a trainer node."""
    from ray.cluster_utils import Cluster

    local = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024 * 1024}
    c = Cluster()
    try:
        c.add_node(**local, num_cpus=1, resources={NODE_OF["evaluator"]: 1}, include_dashboard=False)
        nodes = {"evaluator": c.head_node.node_id}
        for role in ("target", "trainer"):
            nodes[role] = c.add_node(**local, num_cpus=1, resources={NODE_OF[role]: 1}).node_id
        c.wait_for_nodes(timeout=180)
        env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()}
        ray.init(address=c.address, runtime_env={"env_vars": env}, log_to_driver=True)
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


def multinode_cfg(out: Path, target_dir: Path) -> Config:
    nodes = [f"ray.node_resources.{role}={resource}" for role, resource in NODE_OF.items()]
    return make_cfg(out, target_dir, "capture.cpus_per_actor=0.5", "eval.num_cpus=0.5", *nodes, epochs=EPOCHS,
                    checkpoint_every=2, log_sample_keys=True, max_restarts=1)  # fmt: skip


def node_of():
    """An actor that says its node. Defined inside a function, so Ray ships the class itself: its
    process imports Ray alone, not this module (torch, transformers, the tiny target's helpers)."""

    @ray.remote(num_cpus=0.5)
    class NodeOf:
        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return NodeOf


@pytest.fixture
def placed(cluster, tiny, tmp_path):
    """The run's placement group reserved on the fake cluster, and each role's Ray options."""
    cfg = multinode_cfg(tmp_path / "run", tiny["target_dir"])
    plan = plan_placement(cfg, ("extract", "train", "eval"))
    pg = reserve(ray, plan, timeout_s=120)
    try:
        yield cfg, lambda role, i: actor_placement(cfg, role, i, plan, pg)
    finally:
        release(pg)


def test_target_and_evaluator_actors_run_on_their_nodes(cluster, placed):
    from dflash_dist.actors.evaluator_actor import EvaluatorActor, EvaluatorTask, evaluator_actor_options

    cfg, where = placed
    assert len(set(cluster.values())) == 3
    target = node_of().options(**where("target", 0)).remote()
    evaluator = EvaluatorActor.options(**evaluator_actor_options(cfg), **where("evaluator", 0)).remote(
        EvaluatorTask(cfg.to_dict(), cfg.target.path, ((1, 2, 3),)))  # not started: only asked where it runs
    assert ray.get(target.node_id.remote(), timeout=120) == cluster["target"]
    assert ray.get(evaluator.status.remote(), timeout=120)["node_id"] == cluster["evaluator"]
    for actor in (target, evaluator):
        ray.kill(actor)


def test_trainer_ranks_on_the_trainer_node_survive_a_killed_worker(cluster, placed, tiny, tmp_path):
    from dflash_dist.actors.trainer_group import start_trainer_group

    cfg, where = placed
    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][:NUM], done=True)
    groups = []

    def start(resume: str):
        groups.append(start_trainer_group(
            cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM, resume=resume,
            placement=[where("trainer", r) for r in range(cfg.train.world_size)]))
        return groups[-1]

    group = start("never")
    killer = kill_when(cfg.out / TRAIN_LOG, 3, lambda: group.infos[0].pid)  # after the step-2 checkpoint
    results = supervise_training(cfg, group, start, "never")
    killer.join()

    assert len(groups) == 2 and results[0].resumed_from is not None  # one restart, from a checkpoint
    assert {info.node_id for g in groups for info in g.infos} == {cluster["trainer"]}  # both groups, both ranks
    assert [r.steps for r in results] == [STEPS, STEPS]
    assert [r["step"] for r in read_jsonl(cfg.out / TRAIN_LOG)] == list(range(1, STEPS + 1))
    keys = Counter(s.key for s in tiny["samples"][:NUM])
    per = consumed_per_epoch(cfg.out)
    assert sorted(per) == list(range(EPOCHS)) and all(per[e] == keys for e in per), per
