"""Target actors: thin Ray wrappers around CaptureJob (one GPU each on a GPU cluster).

Started with max_restarts and max_task_retries (pipeline._start_capture): a worker process that
dies is restarted by Ray and its `capture` call retried; the retry resumes from the ledger."""

from __future__ import annotations

import dataclasses
import os

import ray
import torch


@ray.remote
class TargetWorker:
    def capture(self, cfg_dict: dict, target_dir: str, ident_dict: dict, train_jsonl: str, shard_dir: str,
                actor_index: int, num_actors: int) -> dict:
        """Runs one actor's slice; arguments and result are small records (no tensors)."""
        from dflash_dist.actors.heartbeat import Heartbeat
        from dflash_dist.capture.capture_job import CaptureJob
        from dflash_dist.config import load_config_dict
        from dflash_dist.target.loading import TargetIdentity

        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(os.environ.get("DFLASH_THREADS_PER_ACTOR", "1"))))
        cfg = load_config_dict(cfg_dict)
        ident = TargetIdentity(**ident_dict)
        with Heartbeat(cfg.out, "target", actor_index) as beat:
            job = CaptureJob(cfg, target_dir, ident, train_jsonl, shard_dir, actor_index, num_actors)
            beat.info = job.progress
            result = dataclasses.asdict(job.run())
            beat.info = lambda: result
        return result
