"""`dflash-dist train --launcher slurm`: DeepSpeed trainers without Ray, one rank per Slurm task
(srun), over shards an earlier capture left under --out.

Rank, world size and local rank come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the
master is 127.0.0.1 when the step has one node, else its first host (`scontrol show
hostnames`); the port derives from the job id (MASTER_PORT overrides). A preemption notice
(SIGTERM, SIGUSR1) makes every rank save at the next step boundary and return: rank 0 exits 75
(not finished; the others 0, see _train) so slurm/train.sbatch requeues the job, whose `--resume
auto` continues from that checkpoint. Rank 0 holds the output directory's run lock (orchestration/run_lock.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping

from dflash_dist.config import Config, ConfigError
from dflash_dist.logging_setup import setup_logging
from dflash_dist.node_address import is_loopback

log = logging.getLogger(__name__)

PORT_BASE, PORT_SPAN = 20000, 10000  # below Linux's ephemeral range, above Ray's worker ports


def step_hostnames(env: Mapping[str, str]) -> list[str]:
    """The hosts of this job step, in Slurm's order (the first one hosts rank 0)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError("--launcher slurm: not inside a Slurm job (no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST): "
                          "submit slurm/pipeline.sbatch (run) or slurm/train.sbatch (train: one srun task per rank)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def slurm_rank_environment(env: Mapping[str, str], hostnames: list[str], on_gpu: bool) -> dict[str, str]:
    """torch.distributed's environment for this Slurm task (pure: from Slurm's variables).

    LOCAL_RANK is SLURM_LOCALID when the task sees every GPU of its node (`--gpus-per-node`),
    0 when Slurm bound one GPU to it (`--gpus-per-task=1` sets a single CUDA_VISIBLE_DEVICES)."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID") if k not in env]
    if missing:
        raise ConfigError(f"--launcher slurm: {', '.join(missing)} not set; start one task per rank with srun")
    local = int(env["SLURM_LOCALID"])
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if on_gpu and len(visible) == 1:
        local = 0
    elif on_gpu and visible and local >= len(visible):
        raise ConfigError(
            f"Slurm task {env['SLURM_PROCID']} is local rank {local} but sees GPUs {visible}: allocate one GPU per "
            "task (--gpus-per-task=1, or --gpus-per-node equal to --ntasks-per-node)"
        )
    port = env.get("MASTER_PORT") or str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN)
    return {
        "MASTER_ADDR": "127.0.0.1" if len(hostnames) == 1 else given_master_addr(env, hostnames) or hostnames[0],
        "MASTER_PORT": port,
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(tasks_per_node(env)[int(env.get("SLURM_NODEID", "0"))]),
        "DS_ACCELERATOR": "cuda" if on_gpu else "cpu",
    }


def given_master_addr(env: Mapping[str, str], hostnames: list[str]) -> str | None:
    """MASTER_ADDR from a multi-node job's environment, if set: where the other nodes reach the first
    one (the address of the network to use, e.g. an InfiniBand interface's, which the first host's name
    may not resolve to on every node). A loopback address is refused, naming the hosts."""
    given = env.get("MASTER_ADDR", "").strip()
    if given and is_loopback(given):
        raise ConfigError(f"MASTER_ADDR={given} is a loopback address, but this job spans {len(hostnames)} nodes "
                          f"({', '.join(hostnames)}): the others cannot reach it; unset MASTER_ADDR, or set it to "
                          f"the first node's ({hostnames[0]}) address on the network the nodes share")
    return given or None


def tasks_per_node(env: Mapping[str, str]) -> list[int]:
    """Tasks on each node of the step, from Slurm's compressed form ("2(x3),1" -> [2, 2, 2, 1])."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env["SLURM_NTASKS"]
    counts: list[int] = []
    for part in spec.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts


def run_slurm_trainer(cfg: Config, resume: str) -> int:
    """This task's rank of the DeepSpeed group; 0 when it finished, 75 (rank 0) when it saved after a notice. Rank 0
    computes the run plan (the resume decision, the target's weight hash, provenance, drafter
    shape) for this job attempt and writes it; the other ranks read it (run_plan.share_plan)."""
    from dflash_dist.orchestration.run_lock import RunLock, RunLocked
    from dflash_dist.orchestration.run_plan import PipelineError, fail_plan

    env = slurm_rank_environment(os.environ, step_hostnames(os.environ), on_gpu=cfg.train.gpus_per_rank > 0)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    setup_logging("trainer", rank)
    if world != cfg.train.world_size:
        raise ConfigError(
            f"train.world_size={cfg.train.world_size} but Slurm started {world} tasks: pass train.world_size={world} "
            f"or allocate {cfg.train.world_size} tasks (slurm/train.sbatch passes train.world_size=$SLURM_NTASKS)"
        )
    job_id, restart = os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_RESTART_COUNT", "0")
    step_id = os.environ.get("SLURM_STEP_ID", "0")  # another srun in the allocation: its own plan (and refused)
    key = f"train-{job_id}-step-{step_id}-restart-{restart}"
    lock = None
    if rank == 0:  # rank 0 holds --out for the job step (run_lock.py): a second run there is refused
        lock = RunLock(cfg.out, "train")
        try:
            lock.acquire()
        except RunLocked as e:
            fail_plan(cfg.out, key, str(e))
            raise PipelineError(str(e)) from None
    try:
        return _train(cfg, resume, env, rank, world, key, job_id, restart)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: Config, resume: str, env: dict[str, str], rank: int, world: int, key: str, job_id: str,
           restart: str) -> int:  # fmt: skip
    from dflash_dist.actors.trainer_group import default_extensions_dir, run_rank, train_job
    from dflash_dist.orchestration.pipeline import EXIT_PREEMPTED, lost_text
    from dflash_dist.orchestration.run_plan import share_plan

    plan = share_plan(cfg, ("train",), resume, key=key, leader=rank == 0)
    for sub in ("tb", "checkpoints", "export"):
        (cfg.out / sub).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        import yaml

        from data_pipeline.durable_files import write_text_atomic

        write_text_atomic(cfg.out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    job = train_job(cfg, plan.target_dir, cfg.out / "shards", plan.expected, plan.drafter, resume=plan.resume_from,
                    num_samples=plan.num_samples, later_epochs=plan.later_epochs)  # the plan's, made once per attempt
    if rank == 0:
        if plan.resume_from is not None:
            changes = f" (changed since: {'; '.join(plan.resume_from.changes)})" if plan.resume_from.changes else ""
            log.info("resuming from %s%s", plan.resume_from.tag, changes)
        log.info("Slurm job %s (restart %s): %d rank(s), master %s:%s, ZeRO-%d, LR schedule over %d %ss", job_id,
                 restart, world, env["MASTER_ADDR"], env["MASTER_PORT"], cfg.train.zero_stage, job.total_steps,
                 job.schedule_unit)
    result = run_rank(cfg.to_dict(), job, env, default_extensions_dir(), rank=rank)
    if rank == 0:
        how = f"stopped by {result.preempted} after saving" if result.preempted else "finished"
        log.info("training %s at step %d; %s", how, result.steps, lost_text(cfg, result))
    # 75 (not finished, a requeue continues it) from rank 0 only: srun --kill-on-bad-exit=1 ends the
    # other tasks when one exits nonzero, and a task it ends makes srun's status 143, not 75; a rank
    # exiting 0 never ends rank 0 while it completes the checkpoint's marker.
    return EXIT_PREEMPTED if result.preempted and rank == 0 else 0
