"""Target actors: thin Ray wrappers around CaptureJob (one GPU each on a GPU cluster).

Started with max_restarts and max_task_retries (pipeline._start_capture): a worker process that
dies is restarted by Ray and its `capture` call retried; the retry resumes from the ledger.
A call carries one frozen CaptureTask and returns the frozen CaptureResult (no tensors)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
import torch

from data_pipeline.ledger import CaptureData
from dflash_dist.capture.capture_job import CaptureResult
from dflash_dist.compile_cache import actor_runtime_env, use_private_cache_dirs
from dflash_dist.config import Config
from dflash_dist.target.loading import TargetIdentity
from dflash_dist.target.weights_check import VerifiedWeights


def target_actor_options(cfg: Config) -> dict:
    """Ray options of a target actor, every key written out (STYLE 4): Ray restarts a dead one and
    retries its call (capture.max_restarts), which resumes from the ledger."""
    retries = cfg.capture.max_restarts
    return {"num_cpus": cfg.capture.cpus_per_actor, "num_gpus": cfg.capture.gpus_per_actor, "name": None,
            "max_restarts": retries, "max_task_retries": retries,
            "runtime_env": actor_runtime_env()}  # the driver's private compile cache directories


@dataclass(frozen=True)
class CaptureTask:
    """What one target actor captures: its slice of the run plan's data into the shard directory."""

    cfg: dict  # Config.to_dict()
    target_dir: str
    identity: TargetIdentity  # from the run plan: the weight hash is not computed again here
    train_jsonl: str
    data: CaptureData  # the plan's identity of those conversations (the ledger records it)
    shard_dir: str
    actor_index: int
    num_actors: int
    later_epochs: str = "keep"  # the run plan's resolved capture.later_epochs: recapture captures every epoch
    weights: VerifiedWeights | None = None  # the run plan's check: files carrying its stamp are not hashed here


@ray.remote
class TargetWorker:
    def capture(self, task: CaptureTask) -> CaptureResult:
        """Runs one actor's slice (of every epoch under recapture) under a heartbeat."""
        from dflash_dist.actors.heartbeat import Heartbeat
        from dflash_dist.capture.capture_job import CaptureJob
        from dflash_dist.capture.recapture import capture_epochs
        from dflash_dist.config import load_config_dict
        from dflash_dist.logging_setup import setup_logging

        cfg = load_config_dict(task.cfg)
        setup_logging("target", task.actor_index)
        use_private_cache_dirs()  # on this node, before anything compiles (capture.kernels fused)
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(os.environ.get("DFLASH_THREADS_PER_ACTOR", "1"))))
        with Heartbeat(cfg.out, "target", task.actor_index) as beat:
            recapture = task.later_epochs == "recapture"
            job = CaptureJob.load(cfg, task.target_dir, task.identity, task.shard_dir, task.actor_index,
                                  task.num_actors, recapture, verified=task.weights)
            beat.info = job.progress
            run = capture_epochs if recapture else CaptureJob.run
            result = run(job, task.train_jsonl, task.data)
            beat.info = lambda: dict(result.__dict__)
        return result
