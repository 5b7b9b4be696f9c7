"""Ray actors forming the DeepSpeed process group: one `TrainerWorker` per rank.

The driver asks every worker where it runs (node, IP, GPU ids), derives each rank's process
group environment with the pure `rank_environment` (testable without Ray, STYLE 8), then starts
`Trainer.run()` on all ranks. Calls carry only small records and paths; tensors stay inside
the workers and the shards.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import ray

from data_pipeline.provenance import Provenance
from dflash_dist.actors.faults import DIED, ERROR
from dflash_dist.actors.ports import free_ports
from dflash_dist.actors.rendezvous import interpreter_bin_first, join_group
from dflash_dist.compile_cache import actor_runtime_env, use_private_cache_dirs
from dflash_dist.config import Config, load_config_dict
from dflash_dist.model.config import DrafterConfig
from dflash_dist.trainer.ds_config import planned_schedule
from dflash_dist.trainer.loop import TrainJob, TrainResult
from dflash_dist.trainer.resume import ResumeDecision, decide
from dflash_dist.trainer.state import STATE_VERSION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """Where one trainer actor runs."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]  # Ray's GPU ids assigned to this actor (empty on CPU)
    pid: int = 0  # the actor's process (for operators and fault-injection tests)


def rank_environment(infos: list[WorkerInfo], master_port: int) -> list[dict[str, str]]:
    """The torch.distributed environment of each rank (index = rank).

    MASTER_ADDR is 127.0.0.1 when every rank shares one node (nothing leaves the machine), else
    rank 0's node IP. LOCAL_RANK counts ranks per node. On GPU, every rank of a node sees all of
    that node's trainer GPUs (as Ray Train does) and LOCAL_RANK is the index of its own, so
    DeepSpeed's set_device(LOCAL_RANK) picks the GPU Ray assigned and NCCL sees its peers.
    """
    if not infos:
        raise ValueError("rank_environment: no workers")
    single_node = len({i.node_id for i in infos}) == 1
    master = "127.0.0.1" if single_node else infos[0].ip
    by_node: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        by_node.setdefault(info.node_id, []).append(rank)
    envs = []
    for rank, info in enumerate(infos):
        peers = by_node[info.node_id]
        env = {
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(infos)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "LOCAL_RANK": str(peers.index(rank)),
            "DS_ACCELERATOR": "cuda" if info.gpu_ids else "cpu",
        }
        if info.gpu_ids:
            if len(info.gpu_ids) != 1:
                raise ValueError(f"rank {rank} holds GPUs {info.gpu_ids}: use train.gpus_per_rank <= 1")
            node_gpus = sorted({g for r in peers for g in infos[r].gpu_ids}, key=_gpu_order)
            if len(node_gpus) != len(peers):
                raise ValueError(
                    f"ranks {peers} share GPUs {node_gpus}: NCCL needs one GPU per rank (train.gpus_per_rank = 1)"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env["LOCAL_RANK"] = str(node_gpus.index(info.gpu_ids[0]))
        envs.append(env)
    return envs


def _gpu_order(gpu_id: str):
    return (0, int(gpu_id)) if gpu_id.isdigit() else (1, gpu_id)


def default_extensions_dir() -> str:
    """DeepSpeed JIT-compiles its CPU shm comm op (~45 s) into TORCH_EXTENSIONS_DIR: keep one
    per environment (the interpreter's prefix), not per user, so a rebuilt venv recompiles."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions")


@ray.remote
class TrainerWorker:
    """One rank. Ray schedules it with train.cpus_per_rank / train.gpus_per_rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def info(self) -> WorkerInfo:
        ctx = ray.get_runtime_context()
        gpu_ids = tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))
        return WorkerInfo(
            node_id=ctx.get_node_id(), ip=ray.util.get_node_ip_address(), gpu_ids=gpu_ids, pid=os.getpid()
        )

    def free_port(self) -> int:
        return free_ports(1)[0]

    def run(self, cfg_dict: dict, job: TrainJob, env: dict[str, str], extensions_dir: str) -> TrainResult:
        return run_rank(cfg_dict, job, env, extensions_dir, rank=self.rank)


def run_rank(cfg_dict: dict, job: TrainJob, env: dict[str, str], extensions_dir: str, rank: int) -> TrainResult:
    """One rank in this process: set its process-group environment, join the group (gloo on
    CPU, NCCL on GPU), run the Trainer under a heartbeat, leave the group. No Ray: a Ray actor
    and an srun task (launcher/slurm_train.py) both call it."""
    os.environ.update(env)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir)
    use_private_cache_dirs()  # on this node, before anything compiles
    interpreter_bin_first()
    import torch
    import torch.distributed as dist

    from dflash_dist.actors.heartbeat import Heartbeat
    from dflash_dist.trainer.loop import Trainer

    on_gpu = env["DS_ACCELERATOR"] == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)
    join_group(env, on_gpu)
    from dflash_dist.logging_setup import setup_logging

    setup_logging("trainer", rank)  # the trainer's INFO lines (steps, epochs, resume, preemption) reach the driver
    cfg = load_config_dict(cfg_dict)
    try:
        with Heartbeat(cfg.out, "trainer", rank) as beat:
            trainer = Trainer(cfg, job)
            beat.info = lambda: {"step": trainer.state.step, "epoch": trainer.source.epoch,
                                 "samples": trainer.samples_consumed,
                                 "samples_lost": trainer.source.lost,
                                 "shards_consumed": len((trainer.source.reader or {}).get("consumed", ()))}
            return trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroupError(RuntimeError):
    """The group ended because a rank failed: `kind` is faults.DIED (its process or node was
    lost) or faults.ERROR (the trainer code raised), `rank` the rank that did."""

    def __init__(self, kind: str, rank: int, message: str, error_types: tuple[str, ...] = ()) -> None:
        super().__init__(f"trainer rank {rank} {'was lost' if kind == DIED else 'failed'}: {message}")
        self.kind, self.rank, self.message, self.error_types = kind, rank, message, error_types


# Ray's errors for a process, worker or node that is gone (not an exception of our code)
_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)
FAILURE_GRACE_S = 5.0  # after a rank's error, how long its peers get to report a lost process


class TrainerGroup:
    """The running trainer ranks; `wait()` returns their results (rank order). `resumed_from`:
    the checkpoint the ranks started from (None: step 0)."""

    def __init__(self, workers: list, refs: list, infos: list[WorkerInfo], resumed_from: str | None = None) -> None:
        self.workers, self.refs, self.infos, self.resumed_from = workers, refs, infos, resumed_from

    def wait(self, timeout_s: float | None = None) -> list[TrainResult]:
        """Block until every rank returns. A failing rank stops the whole group at once (its
        peers would otherwise wait in a collective until the backend times out) and raises
        TrainerGroupError; a lost process is named over the errors it caused in its peers."""
        pending = list(self.refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not done:
                self.shutdown()
                raise TimeoutError(f"trainer group did not finish within {timeout_s} s")
            try:
                ray.get(done[0])
            except Exception as e:
                failure = self._classify(done[0], e, pending)
                self.shutdown()
                raise failure from e
        results = ray.get(self.refs)
        self.shutdown()
        return results

    def _classify(self, ref, error: Exception, pending: list) -> TrainerGroupError:
        """The failure to report: the first lost rank among those done within FAILURE_GRACE_S
        (a peer's gloo error is a consequence), else the first error."""
        failures = [(ref, error)]
        if not isinstance(error, _LOST) and pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
            for r in done:
                try:
                    ray.get(r)
                except Exception as e:
                    failures.append((r, e))
        def cause_of(e: Exception) -> Exception:
            return e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e

        # a lost process first; else the first error, unless it names nothing its peers' do (DataLost:
        # every rank raises at the same slot, only those that hit the unreadable samples name them)
        ref, error = next(((r, e) for r, e in failures if isinstance(e, _LOST)), None) or min(
            failures, key=lambda f: bool(getattr(cause_of(f[1]), "names_nothing", False))
        )
        kind = DIED if isinstance(error, _LOST) else ERROR
        cause = cause_of(error)
        message = f"{type(cause).__name__}: {cause}".strip()
        if kind == DIED:  # Ray's text runs over many lines of context; its first names what died
            message = message.splitlines()[0]
        types = tuple(c.__name__ for c in type(cause).__mro__) if kind == ERROR else ()
        return TrainerGroupError(kind, self.refs.index(ref), message, types)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def trainer_actor_options(cfg: Config) -> dict:
    """Ray options of a trainer rank, every key written out (STYLE 4). No restarts: a restarted
    rank cannot rejoin a live process group; the run resumes from its last checkpoint instead."""
    return {
        "num_cpus": cfg.train.cpus_per_rank,
        "num_gpus": cfg.train.gpus_per_rank,
        "max_restarts": 0,
        "max_task_retries": 0,
        "runtime_env": actor_runtime_env(),  # the driver's private compile cache directories
    }


def train_job(
    cfg: Config,
    target_dir: str | Path,
    shard_dir: str | Path,
    expected: Provenance,
    drafter_cfg: DrafterConfig,
    *,
    num_samples: int | None = None,
    total_steps: int | None = None,
    resume: ResumeDecision | None = None,
    later_epochs: str = "keep",
) -> TrainJob:
    """The TrainJob every rank gets: the LR schedule spans `total_steps` optimizer steps, or else
    what train.max_steps / `num_samples` per epoch (default data.max_train_samples) give
    (ds_config.planned_schedule); `resume` is the decision made before (resume.decide)."""
    samples = num_samples if num_samples is not None else cfg.data.max_train_samples
    total, unit = planned_schedule(cfg, samples, total_steps)
    return TrainJob(str(target_dir), str(shard_dir), expected, drafter_cfg, total, resume=resume, schedule_unit=unit,
                    num_samples=samples, later_epochs=later_epochs)  # fmt: skip


def start_trainer_group(
    cfg: Config,
    target_dir: str | Path,
    shard_dir: str | Path,
    expected: Provenance,
    drafter_cfg: DrafterConfig,
    *,
    num_samples: int | None = None,
    total_steps: int | None = None,
    resume: str | ResumeDecision | None = "auto",
    placement: list[dict] | None = None,
    later_epochs: str = "keep",
) -> TrainerGroup:
    """Start cfg.train.world_size TrainerWorker actors forming one DeepSpeed group and run the
    trainer on each (Ray must be initialised by the caller).

    The LR schedule spans `total_steps`, or else what train.max_steps / `num_samples` give
    (train_job). `resume` is a decision made before (the run plan's), or a mode (auto, never or a
    checkpoint tag directory) decided here, once, before any actor starts (resume.decide: world
    size, training config, shards, schedule), raising checkpoint.ResumeError.
    `placement`: each rank's extra Ray options (placement.actor_placement). `later_epochs`: the run
    plan's resolved capture.later_epochs (recapture: epochs >= 1 are read from epoch_<e>/).
    """
    world = cfg.train.world_size
    job = train_job(cfg, target_dir, shard_dir, expected, drafter_cfg, num_samples=num_samples,
                    total_steps=total_steps, later_epochs=later_epochs)
    if isinstance(resume, str):
        resume = decide(resume, cfg, shard_dir, (job.total_steps, job.schedule_unit), STATE_VERSION)
    job = dataclasses.replace(job, resume=resume)
    if resume is not None:
        note = f" (changed since: {'; '.join(resume.changes)})" if resume.changes else ""
        log.info("resuming from %s%s", resume.tag, note)
    placement = placement or [{}] * world
    workers = [TrainerWorker.options(**trainer_actor_options(cfg), **placement[rank]).remote(rank, world)
               for rank in range(world)]
    try:
        infos = ray.get([w.info.remote() for w in workers])
        if bool(infos[0].gpu_ids) != (cfg.train.gpus_per_rank > 0):
            raise ValueError(f"train.gpus_per_rank={cfg.train.gpus_per_rank} but rank 0 got GPUs {infos[0].gpu_ids}")
        port = ray.get(workers[0].free_port.remote())
        envs = rank_environment(infos, port)
        cfg_dict = cfg.to_dict()
        refs = [w.run.remote(cfg_dict, job, env, default_extensions_dir()) for w, env in zip(workers, envs)]
    except BaseException:
        for w in workers:
            ray.kill(w, no_restart=True)
        raise
    log.info("%d DeepSpeed rank(s), ZeRO-%d, LR schedule over %d %ss", world, cfg.train.zero_stage, job.total_steps,
             job.schedule_unit)
    return TrainerGroup(workers, refs, infos, job.resume.tag if job.resume is not None else None)
