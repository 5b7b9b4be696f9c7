"""`dflash-dist extract CONFIG --out DIR --slice I/N`: capture slice I of N in this process, no
Ray (one Slurm array task each, slurm/capture_array.sbatch), into the shared DIR/shards.

Slice I takes the same records as target actor I of N would (capture_job.my_slice) and writes
`t<I>-*` shards. Requeue-safe: a rerun captures only what its earlier attempt did not settle
(data_pipeline/ledger.py). When a slice ends it leaves `DIR/capture_slices/I-of-N.json`; the
slice that finds all N there checks no key was captured twice and marks the shards DONE (each
writes its own file before looking, so the last one to finish always sees all of them). The
first slice to start computes the run plan (ingested data, target weight hash) for all of them;
every slice checks the weight files it loads against the plan's hash, hashing them unless it made
the plan itself (a plan read from JSON carries no check of the files: run_plan.RunPlan.weights).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from dflash_dist.config import Config, ConfigError

SLICES_DIR = "capture_slices"
log = logging.getLogger(__name__)


def parse_slice(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N) with 0 <= I < N."""
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise ConfigError(f"--slice {text!r}: expected I/N with 0 <= I < N, e.g. --slice 0/4")
    return int(index), int(count)


def slice_marker(out: Path, index: int, count: int) -> Path:
    return out / SLICES_DIR / f"{index:04d}-of-{count:04d}.json"


def finished_slices(out: Path, count: int) -> list[int]:
    return [i for i in range(count) if slice_marker(out, i, count).exists()]


def capture_slice(cfg: Config, index: int, count: int) -> dict:
    """Capture slice `index` of `count`; mark the shards DONE if it completes the set. The run plan
    (target, weight hash, ingested data) is computed by the first slice of the array and read by
    the others (run_plan.share_plan)."""
    from dflash_dist.orchestration.run_plan import PipelineError

    if cfg.capture.num_actors != 1:
        raise ConfigError(f"capture.num_actors={cfg.capture.num_actors} with --slice: the slices are the actors "
                          "(--slice I/N runs one); leave capture.num_actors at 1")
    from dflash_dist.orchestration.run_lock import SHARED, RunLock, RunLocked

    try:  # slices of an array share --out through the ledger; a run or train there is refused
        with RunLock(cfg.out, f"extract slice {index}/{count}", SHARED):
            return _capture_slice(cfg, index, count)
    except RunLocked as e:
        raise PipelineError(str(e)) from None


def _capture_slice(cfg: Config, index: int, count: int) -> dict:
    from data_pipeline.durable_files import write_text_atomic
    from data_pipeline.ledger import duplicate_keys
    from data_pipeline.records import DONE_NAME
    from data_pipeline.shard_writer import mark_done
    from dflash_dist.actors.heartbeat import Heartbeat
    from dflash_dist.capture.capture_job import CaptureJob
    from dflash_dist.orchestration.run_plan import PipelineError, share_plan

    shards = cfg.out / "shards"
    if (shards / DONE_NAME).exists():  # the whole capture is complete
        log.info("%s is complete (%s): nothing to capture", shards, DONE_NAME)
        _check_loss(cfg, shards)
        return {"slice": index, "skipped": "complete"}
    marker = slice_marker(cfg.out, index, count)
    if marker.exists():
        log.info("slice %d/%d already finished (%s)", index, count, marker)
        result = json.loads(marker.read_text())
    else:
        plan = share_plan(cfg, ("extract",), "auto", key=plan_key(os.environ, count))
        if not os.environ.get("CUDA_VISIBLE_DEVICES"):
            import torch

            torch.set_num_threads(max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", "1"))))
        with Heartbeat(cfg.out, "target", index) as beat:
            # plan.weights: the check of the slice that made the plan (this process); None in a slice
            # that read it from JSON (a stamp from a file is never trusted): that slice hashes its files
            job = CaptureJob.load(cfg, plan.target_dir, plan.identity, shards, index, count, verified=plan.weights)
            beat.info = job.progress
            result = dataclasses.asdict(job.run(plan.data.train_jsonl, plan.data.capture))
        log.info("slice %d/%d: %d samples, %d tokens in %d shards (kernel path %s)", index, count, result["samples"],
                 result["tokens"], result["shards"], result["kernel_path"])
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, json.dumps(result, sort_keys=True) + "\n")
    done = finished_slices(cfg.out, count)
    if len(done) == count:
        twice = duplicate_keys(shards)
        if twice:
            raise PipelineError(f"{shards}: samples captured twice ({twice[:5]}...): the shards are not usable; "
                                "re-extract into another --out")
        mark_done(shards)
        log.info("all %d slices finished: %s marked DONE", count, shards)
        _check_loss(cfg, shards)
    else:
        log.info("%d of %d slices finished; the last one marks %s DONE", len(done), count, shards)
    return result


def _check_loss(cfg: Config, shards: Path) -> None:
    """The slice that finds the capture complete fails (exit 1) when it lost more samples than
    data.max_lost_fraction allows, as the pipeline's capture does (ledger.capture_loss_problem)."""
    from data_pipeline.ledger import capture_loss_problem
    from dflash_dist.orchestration.run_plan import PipelineError

    problem = capture_loss_problem(shards, cfg.data.max_lost_fraction)
    if problem is not None:
        raise PipelineError(problem)


def plan_key(env, count: int) -> str:
    """The run plan the slices of one job array share: the array's job id (a requeued task keeps it)."""
    job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID") or "local"
    return f"capture-{job}-of-{count}"
