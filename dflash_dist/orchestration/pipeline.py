"""Orchestration on Ray: target actors feed DeepSpeed trainers through webdataset shards while
an evaluator measures tau of each export. What the roles share (target, its weight hash,
provenance, drafter shape, data, the resume decision) is one RunPlan computed first
(run_plan.py). Actors receive small frozen records (the plan's parts, paths, token-id lists);
tensors travel only inside shards."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from data_pipeline.durable_files import write_text_atomic
from dflash_dist.actors.heartbeat import Heartbeat, clear_heartbeats
from dflash_dist.config import Config
from dflash_dist.evaluator.policy import EvalResult
from dflash_dist.orchestration import placement
from dflash_dist.orchestration.eval_watch import EvaluatorWatch
from dflash_dist.orchestration.ray_system import NO_PRESTART
from dflash_dist.orchestration.ray_temp import private_ray_temp
from dflash_dist.orchestration.ray_token import local_cluster_auth, reach_hint
from dflash_dist.orchestration.run_lock import RunLock, RunLocked
from dflash_dist.orchestration.run_plan import PLAN_NAME, PipelineError, RunPlan, make_plan, write_plan

log = logging.getLogger(__name__)

EVALUATOR_RESTART_TIMEOUT_S = 600.0  # a restarting evaluator unavailable for longer: the run fails
LOCAL_SYSTEM_CONFIG = NO_PRESTART  # a local cluster starts no idle Python workers ahead of use (ray_system.py)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the trainers saved after a preemption notice; continue with --resume auto


class Preempted(PipelineError):
    """The trainers stopped at a notice (SIGTERM/SIGUSR1) after saving: the run is not done."""

    exit_code = EXIT_PREEMPTED


def failure_text(error: BaseException) -> str:
    """`Type: message` of the error a role raised; a Ray task error is unwrapped to its cause
    (its own text is the remote traceback)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    return f"{type(error).__name__}: {str(error).strip() or '(no message)'}"


@dataclass(frozen=True)
class PipelineResult:
    """What a run did (run_pipeline's result)."""

    out: str
    stages: tuple[str, ...]
    capture: tuple[Any, ...]  # CaptureResult per target actor (its last attempt)
    train: tuple[Any, ...]  # TrainResult per rank
    eval: tuple[Any, ...]  # the evaluator's results, one per evaluated checkpoint
    samples_lost: int  # as data.max_lost_fraction holds them (samples_lost says how)
    preempted: str | None  # the notice that stopped the trainers, None when the run finished
    seconds: float


@contextlib.contextmanager
def ray_session(cfg: Config):
    """Join cfg.ray.address (or RAY_ADDRESS, as under `ray job submit`) or start a local cluster
    bound to 127.0.0.1; shut down only what we started."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        yield ray
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    kwargs: dict = {"log_to_driver": True}
    auth = contextlib.nullcontext()  # joining: the cluster's own token settings (launcher/ray_auth.py)
    temp = contextlib.nullcontext()
    if address:
        kwargs["address"] = address
    else:  # "local": a new cluster, never one that happens to run on this host (ray.init's default joins
        # the last one `ray start` or another process started, named in /tmp/ray/ray_current_cluster)
        kwargs.update(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.dashboard,
                      dashboard_host=cfg.ray.dashboard_host, _node_ip_address="127.0.0.1",
                      _system_config=LOCAL_SYSTEM_CONFIG)
        auth = local_cluster_auth()  # its token in this process's environment, not in ~/.ray/auth_token
        temp = private_ray_temp()  # its sockets and logs where no other user reaches (ray_temp.py)
    with auth as token, temp as temp_dir:
        if temp_dir is not None:
            kwargs["_temp_dir"] = temp_dir
        ctx = ray.init(**kwargs)
        if token is not None:  # Ray's CLI and dashboard need it too; it is in no file (ray_token.reach_hint)
            dashboard = f" (dashboard http://{ctx.dashboard_url})" if cfg.ray.dashboard and ctx.dashboard_url else ""
            log.info("%s", reach_hint(token, f"this run's Ray cluster at {ctx.address_info['gcs_address']}{dashboard}"))
        try:
            yield ray
        finally:
            ray.shutdown()


def _layout(cfg: Config) -> dict[str, Path]:
    out = cfg.out
    paths = {k: out / k for k in ("tb", "shards", "checkpoints", "export", "eval")}
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    return paths


def _save_config(cfg: Config) -> None:
    write_text_atomic(cfg.out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def run_pipeline(cfg: Config, stages: tuple[str, ...], resume: str = "never") -> PipelineResult:
    """Run the given stages ("extract", "train", "eval") under cfg.out, holding the directory's
    run lock throughout (run_lock.py: one run per --out). `resume`: see run_plan.plan_stages.
    Everything the roles share comes from one RunPlan. Raises Preempted when the trainers stopped
    at a notice, PipelineError when more samples were lost than data.max_lost_fraction allows."""
    try:
        lock = RunLock(cfg.out, "+".join(stages))
        lock.acquire()
    except RunLocked as e:
        raise PipelineError(str(e)) from None
    try:
        return _run(cfg, stages, resume)
    finally:
        lock.release()


def _run(cfg: Config, stages: tuple[str, ...], resume: str) -> PipelineResult:
    from dflash_dist.capture.data_prep import eval_prompt_ids
    from dflash_dist.target.loading import load_tokenizer

    t0 = time.time()
    plan = make_plan(cfg, stages, resume)
    stages = plan.stages
    pg_plan = placement.plan_placement(cfg, stages)
    paths = _layout(cfg)
    _save_config(cfg)
    write_plan(cfg.out / PLAN_NAME, plan)
    clear_heartbeats(cfg.out)
    capture, results, evals, eval_error, watch = (), (), (), None, None

    def driver_info() -> dict:  # the driver's heartbeat; `dflash-dist status` shows a failed evaluator's line
        failed = watch.line if watch is not None else None
        return {"stages": list(stages), **({"evaluator_failed": failed} if failed else {})}

    try:
        with (
            Heartbeat(cfg.out, "driver", info=driver_info),
            ray_session(cfg) as ray,
            _placement_group(ray, cfg, pg_plan) as pg,
            # the evaluator's watch stops first, however the body ends: after the placement group's release
            # (which kills the evaluator) it would say the evaluator FAILED, and past ray.shutdown its next
            # call would start another Ray cluster (Ray's auto-init) from its thread
            contextlib.ExitStack() as watching,
        ):
            def where(role: str, i: int) -> dict:  # the Ray options placing process i of a role
                return placement.actor_placement(cfg, role, i, pg_plan, pg)

            capture_refs, group = [], None
            if "extract" in stages:
                capture_workers, capture_refs = _start_capture(cfg, plan, paths, where)
            if "train" in stages:
                group = _start_trainers(cfg, plan, paths, plan.resume_from, where)
                # supervised in a thread of its own: a lost rank is replaced while capture still runs
                restart = functools.partial(_start_trainers, cfg, plan, paths, where=where)
                training = _InThread(supervise_training, cfg, group, restart, plan.resume)
            evaluator = None
            if "eval" in stages and cfg.eval.enabled:
                tokenizer = load_tokenizer(plan.target_dir)
                prompts = eval_prompt_ids(Path(plan.data.eval_jsonl), tokenizer, cfg.eval.num_prompts,
                                          cfg.data.enable_thinking)
                evaluator = _start_evaluator(cfg, plan, prompts, paths["shards"], where("evaluator", 0))
                # ended before the placement group's release: a restartable actor (eval.max_restarts) killed by
                # that release was restarted by Ray into the removed group, RESTARTING for as long as the driver
                # lived (a run joined to a cluster from a longer-lived process left it there)
                watching.callback(ray.kill, evaluator, no_restart=True)
                # its failure said when it happens (eval_watch.py); the trainers go on
                watch = EvaluatorWatch(ray, evaluator, cfg.eval.max_restarts, str(cfg.out))
                watching.callback(watch.stop)
            outlived = group is not None and plan.later_epochs == "recapture"  # capture may outlive training
            dirs = _capture_dirs(cfg, plan, paths["shards"])
            stopped = bool(capture_refs) and outlived and _stop_capture_after(ray, capture_workers, capture_refs,
                                                                              training, dirs)
            if capture_refs and not stopped:
                capture = tuple(_finish_capture(ray, capture_refs, dirs, cfg.data.max_lost_fraction))
            final_step = None
            if group is not None:
                results = tuple(training.result())
                if stopped:  # the epochs the stopped capture finished count as a finished capture's
                    _check_capture_loss(dirs, cfg.data.max_lost_fraction)
                final_step = max(r.steps for r in results)
                log.info("training %s at step %d", f"stopped by {results[0].preempted}" if results[0].preempted
                         else "finished", final_step)  # fmt: skip
            if evaluator is not None:
                watch.stop()  # from here wait_evaluator reports the evaluator's end
                if final_step is None:  # eval alone: everything exported so far (None: nothing to wait for)
                    final_step = max(_export_steps(paths["export"]), default=None)
                try:
                    evals = tuple(wait_evaluator(ray, evaluator, final_step, cfg.eval.max_restarts))
                except Exception as e:  # raised inside the session (a failed run keeps its Ray logs, the
                    eval_error = e  # evaluator's among them, and its driver heartbeat says failed), then
                    raise  # again after the summary of what the run did
    except Exception as e:
        if e is not eval_error:
            raise
    lost = samples_lost(results, dirs)
    result = PipelineResult(str(cfg.out), tuple(stages), capture, results, evals, lost,
                            results[0].preempted if results else None, time.time() - t0)  # fmt: skip
    captured = dirs if "extract" in stages else []
    _print_summary(cfg, paths, result, failed=eval_error is not None, captured=captured)
    if eval_error is not None:  # the training's summary (its lost samples, checkpoints) is printed first
        raise eval_error
    check_finished(result)
    return result


def check_finished(result: PipelineResult) -> None:
    """Raise Preempted when the trainers stopped at a notice: such a run saved, but is not done,
    and must not end like a finished one (exit 0, "done"); the CLI exits EXIT_PREEMPTED."""
    if result.preempted is None:
        return
    last = result.train[0]
    saved = last.checkpoints[-1] if last.checkpoints else "no new checkpoint"
    raise Preempted(f"the trainers stopped at {result.preempted} after saving {saved} (step {last.steps}): the run "
                    "is not finished; continue it with --resume auto")  # fmt: skip


def _stop_capture_after(ray, workers: list, refs: list, training: _InThread, dirs: list[Path]) -> bool:
    """Under recapture the actors capture every epoch; training can end first (train.max_steps, a
    notice, an error), and nothing would consume what they still write: stop them then (True).
    Their ledgers let --resume auto continue every epoch exactly. False: the capture finished."""
    from data_pipeline.records import DONE_NAME

    while len(ray.wait(refs, num_returns=len(refs), timeout=1.0)[0]) < len(refs):
        if training.done() and not all((d / DONE_NAME).exists() for d in dirs):
            for w in workers:
                ray.kill(w, no_restart=True)
            log.warning("training ended before the capture of later epochs did: the target actors were stopped "
                        "(their ledgers let --resume auto continue)")
            return True
    return False


def _capture_dirs(cfg: Config, plan: RunPlan, shard_dir: Path) -> list[Path]:
    """The shard directories a capture fills: the root, and under recapture one per later epoch."""
    from data_pipeline.epoch_dirs import epoch_dir

    recapture = plan.later_epochs == "recapture"
    return [epoch_dir(shard_dir, e, recapture) for e in range(cfg.train.epochs if recapture else 1)]


def samples_lost(train: tuple | list, capture_dirs: list[Path]) -> int:
    """The run's lost samples as data.max_lost_fraction held them: with training, the trainers' own
    count (unreadable plus capture-skipped once per epoch read: under keep every epoch re-reads
    epoch 0's directory and misses its skipped samples again); a capture alone, each directory's."""
    from data_pipeline.ledger import read_skipped

    if train:
        return train[0].samples_lost
    return sum(len(read_skipped(d)) for d in capture_dirs if d.is_dir())


def supervise_training(cfg: Config, group, start_group: Callable[[str], Any], resume: str) -> list:
    """Wait for the trainer group and return its results. When a rank fails, the whole group is
    gone (TrainerGroup.wait stops it); faults.decide_restart says whether `start_group(resume)`
    starts a new one, which resumes from the run's latest complete checkpoint (its train_log and
    sample_log are cut back to that step, so they stay the run's true history), or the run
    stops with a PipelineError saying why."""
    from dflash_dist.actors.faults import Failure, RestartPolicy, decide_restart, restart_resume
    from dflash_dist.actors.trainer_group import TrainerGroupError
    from dflash_dist.trainer.checkpoint import plan_resume

    policy = RestartPolicy.of_train(cfg.train)
    failures: list[Failure] = []
    while True:
        try:
            return group.wait()
        except TrainerGroupError as e:
            failures.append(Failure(e.kind, e.rank, e.message, group.resumed_from, e.error_types))
            decision = decide_restart(policy, failures)
            if not decision.restart:
                raise PipelineError(decision.message) from e
            log.warning("train: %s", decision.message)
            time.sleep(decision.delay_s)
            has_checkpoint = plan_resume("auto", cfg.out / "checkpoints") is not None
            group = start_group(restart_resume(resume, has_checkpoint))


class _InThread:
    """fn(*args) in a daemon thread (a driver that fails elsewhere must not be held open by it);
    result() waits and returns its value or raises its error."""

    def __init__(self, fn: Callable, *args) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name=fn.__name__, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, *args) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def wait_evaluator(ray, evaluator, final_step: int | None, max_restarts: int) -> list[EvalResult]:
    """Tell the evaluator the trainer's final step and wait for its EvalResults. Ray restarts a lost
    evaluator (eval.max_restarts) and it continues after the last result under <out>/eval; a
    restarted actor has forgotten `trainer_finished`, so it is told again."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    lost, unavailable_since = 0, None
    while True:
        try:
            ray.get(evaluator.trainer_finished.remote(final_step))
            return ray.get(evaluator.wait.remote())
        except ActorUnavailableError as e:  # Ray is restarting it: ask again shortly
            unavailable_since = unavailable_since or time.monotonic()
            if time.monotonic() - unavailable_since > EVALUATOR_RESTART_TIMEOUT_S:
                raise PipelineError(f"the evaluator did not come back within {EVALUATOR_RESTART_TIMEOUT_S:.0f}s of "
                                    f"being restarted: {str(e).splitlines()[0]}") from e
            time.sleep(1.0)
        except RayActorError as e:
            lost, unavailable_since = lost + 1, None
            if lost > max_restarts:
                raise PipelineError(f"the evaluator was lost {lost} time(s), more than eval.max_restarts="
                                    f"{max_restarts}: {str(e).splitlines()[0]}") from e
            log.warning("the evaluator was lost (%s); Ray restarts it and it continues after its last finished "
                        "checkpoint", type(e).__name__)


@contextlib.contextmanager
def _placement_group(ray, cfg: Config, plan):
    """Reserve every role's bundle before any actor starts (placement.py); released at the end."""
    try:
        pg = placement.reserve(ray, plan, cfg.ray.placement_timeout_s)
    except TimeoutError as e:
        raise PipelineError(str(e)) from None
    try:
        yield pg
    finally:
        placement.release(pg)


def _start_capture(cfg: Config, plan: RunPlan, paths: dict[str, Path], where) -> tuple[list, list]:
    """One TargetWorker per slice; Ray restarts a dead one (capture.max_restarts) and retries its
    call, which resumes from the ledger. No writer is alive yet, so unfinished shards left by an
    earlier attempt are removed first."""
    from data_pipeline.ledger import remove_stale_tmp
    from dflash_dist.actors.target_worker import CaptureTask, TargetWorker, target_actor_options

    n = cfg.capture.num_actors
    remove_stale_tmp(paths["shards"])
    workers = [TargetWorker.options(**target_actor_options(cfg), **where("target", i)).remote() for i in range(n)]
    cfg_dict = cfg.to_dict()
    refs = [w.capture.remote(CaptureTask(cfg_dict, plan.target_dir, plan.identity, plan.data.train_jsonl,
                                         plan.data.capture, str(paths["shards"]), i, n, plan.later_epochs,
                                         plan.weights))  # the plan's check: not hashed again on this node
            for i, w in enumerate(workers)]
    log.info("%d target actor(s) capturing layers %s into %s%s", n, list(plan.identity.layer_ids), paths["shards"],
             f" (every epoch: {cfg.train.epochs})" if plan.later_epochs == "recapture" else "")
    return workers, refs


def _finish_capture(ray, refs, shard_dirs: list[Path], max_lost_fraction: float = 0.0) -> list:
    """Wait for every actor, check each directory's ledger (no key twice) and mark it DONE (under
    recapture the actors mark each epoch's as they finish it; this final check stays). Totals
    come from the manifest: a restarted actor's result covers only its last attempt."""
    from data_pipeline.ledger import duplicate_keys, read_skipped, skipped_text
    from data_pipeline.shard_reader import read_manifest
    from data_pipeline.shard_writer import mark_done

    try:
        results = ray.get(refs)
    except Exception as e:  # the actor's own error names the file/line/field
        raise PipelineError(f"target capture failed: {failure_text(e)}") from e
    for shard_dir in shard_dirs:
        twice = duplicate_keys(shard_dir)
        if twice:
            raise PipelineError(f"{shard_dir}: samples captured twice ({twice[:5]}...): the shards are not usable; "
                                "re-extract into another --out")
        mark_done(shard_dir)
        records, skipped = read_manifest(shard_dir), read_skipped(shard_dir)
        captured = sum(r.n_samples for r in records)
        log.info("capture %s: %d samples, %d tokens in %d shards, %s (kernel path %s)", shard_dir.name, captured,
                 sum(r.n_tokens for r in records), len(records), skipped_text(skipped), results[0].kernel_path)
    _check_capture_loss(shard_dirs, max_lost_fraction)
    return list(results)


def _check_capture_loss(shard_dirs: list[Path], max_lost_fraction: float) -> None:
    """PipelineError when a finished (DONE) capture directory lost more than data.max_lost_fraction
    (ledger.capture_loss_problem); one still being captured is judged once it is finished."""
    from data_pipeline.ledger import capture_loss_problem
    from data_pipeline.records import DONE_NAME

    for shard_dir in shard_dirs:
        done = (shard_dir / DONE_NAME).exists()
        problem = capture_loss_problem(shard_dir, max_lost_fraction) if done else None
        if problem is not None:
            raise PipelineError(problem)


def _start_trainers(cfg: Config, plan: RunPlan, paths: dict[str, Path], resume, where):
    """The trainer group, from the plan's resume decision, or (a restart) from a mode decided there."""
    from dflash_dist.actors.trainer_group import start_trainer_group
    from dflash_dist.trainer.checkpoint import ResumeError

    try:
        return start_trainer_group(cfg, target_dir=plan.target_dir, shard_dir=paths["shards"], expected=plan.expected,
                                   drafter_cfg=plan.drafter, resume=resume, num_samples=plan.num_samples,
                                   placement=[where("trainer", r) for r in range(cfg.train.world_size)],
                                   later_epochs=plan.later_epochs)
    except ResumeError as e:
        raise PipelineError(str(e)) from None


def _start_evaluator(cfg: Config, plan: RunPlan, prompts: list[list[int]], shard_dir: Path, where: dict):
    from dflash_dist.actors.evaluator_actor import EvaluatorActor, EvaluatorTask, evaluator_actor_options

    task = EvaluatorTask(cfg.to_dict(), plan.target_dir, tuple(tuple(p) for p in prompts), plan.identity,
                         plan.expected, str(shard_dir), plan.weights)  # the plan's check: not hashed again here
    actor = EvaluatorActor.options(**evaluator_actor_options(cfg), **where).remote(task)
    actor.start.remote()
    return actor


def _export_steps(export_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in export_dir.glob("step_*") if p.name.split("_")[1].isdigit())


def _print_summary(cfg: Config, paths: dict[str, Path], result: PipelineResult, failed: bool = False,
                   captured: list[Path] = ()) -> None:  # fmt: skip
    """The run's end: tau per checkpoint, what was not evaluated or ingested, what the capture of
    the directories `captured` wrote and skipped, the lost samples, and how it ended (`failed`:
    the evaluator failed; its error follows)."""
    results = [EvalResult.from_json(json.loads(f.read_text()), str(f))
               for f in sorted(paths["eval"].glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))]  # fmt: skip
    if results:
        fewest, asked = min(r.prompts for r in results), cfg.eval.num_prompts
        short = (f" of the eval.num_prompts={asked} asked: the others are not in data.eval_path or have no greedy "
                 "continuation of 2+ tokens" if fewest < asked else "")  # fmt: skip
        print(f"[eval] tau per checkpoint ({fewest} held-out prompts{short}; greedy replay, then live/server where "
              "measured):")  # fmt: skip
        print("\n".join("  " + r.table_row() for r in results))
    for line in _discarded_lines(cfg, result.seconds):
        print(line)
    unevaluated = _unevaluated(cfg, paths, result)
    if unevaluated:
        why = ("the evaluator failed before them" if failed else f"passed over while the evaluator was behind the "
               f"trainer: eval.max_backlog={cfg.eval.max_backlog}, eval.backlog_stride={cfg.eval.backlog_stride}; or "
               "removed before it got to them")  # fmt: skip
        print(f"[eval] {len(unevaluated)} export(s) not evaluated: steps {unevaluated} ({why})")
    for line in _ingest_lines(cfg):
        print(line)
    for line in _capture_lines(cfg, captured):
        print(line)
    if result.train:
        t = result.train[0]
        print(f"[train] {t.steps} steps, {t.epochs_completed} epoch(s) completed, {lost_text(cfg, t)}")
    state = f"stopped by {result.preempted} (not finished: --resume auto continues)" if result.preempted else "done"
    state = "the evaluator FAILED (its error follows; the training's outputs are kept)" if failed else state
    print(f"{state} in {result.seconds:.0f}s; outputs under {cfg.out}")
    if "train" in result.stages or ("eval" in result.stages and cfg.eval.enabled):  # tb/train, tb/eval
        print(f"TensorBoard: tensorboard --logdir {paths['tb']} --host 127.0.0.1")
    elif "extract" in result.stages:  # a capture alone writes shards, nothing for TensorBoard
        print(f"Shards: {paths['shards']} (manifest.jsonl, DONE) from the conversations ingested under "
              f"{cfg.out / 'data'}; train on them: dflash-dist train CONFIG --out {cfg.out}")  # fmt: skip


def lost_text(cfg: Config, train) -> str:
    """The trainers' lost samples (a TrainResult's) as data.max_lost_fraction held them, with their
    parts, and the optimizer steps skipped: the run's summary and a Slurm trainer's last line."""
    lost = train.samples_lost
    text = (f"{lost} sample(s) lost ({lost - train.capture_skipped} unreadable, {train.capture_skipped} skipped by the "
            f"capture, counted per epoch read; data.max_lost_fraction={cfg.data.max_lost_fraction})")  # fmt: skip
    if train.skipped_steps:
        text += (f"; {train.skipped_steps} optimizer step(s) skipped for a non-finite gradient (their samples read, "
                 "not learned from; train.grad_overflow_check)")  # fmt: skip
    return text


def _discarded_lines(cfg: Config, seconds: float) -> list[str]:
    """What a resume from an earlier checkpoint moved aside in the last `seconds` (this run; trainer/discard.py)."""
    from dflash_dist.trainer.discard import DISCARDED, RECORD

    lines, since = [], time.time() - seconds - 1.0
    for path in sorted((cfg.out / DISCARDED).glob(f"*/{RECORD}")):
        try:
            record = json.loads(path.read_text())
            if record["unix_time"] >= since:
                lines.append(f"[discarded] {path.parent}: {', '.join(record['moved'])} ({record['why']})")
        except (OSError, ValueError, KeyError, TypeError):
            lines.append(f"[discarded] {path.parent}: {path.name} cannot be read")
    return lines


def _unevaluated(cfg: Config, paths: dict[str, Path], result: PipelineResult) -> list[int]:
    """Export steps of a run that evaluated, with no result under eval/ (policy.pending_steps thins
    a backlog; the tau curve has no point there, which nothing else says)."""
    if "eval" not in result.stages or not cfg.eval.enabled or "export" not in paths:
        return []
    done = {int(f.stem.split("_")[1]) for f in paths["eval"].glob("step_*.json") if f.stem.split("_")[1].isdigit()}
    return [s for s in _export_steps(paths["export"]) if s not in done]


def _ingest_lines(cfg: Config) -> list[str]:
    """The ingested splits' records that were skipped (data.on_bad_record=skip, data.on_overlong=skip)
    or truncated: counted in <out>/data/<split>.ingest.json and logged once at the start, where a
    long run's log buries them; never in the lost-sample count (they never reached a shard)."""
    from dflash_dist.capture.data_prep import ingested_paths

    lines = []
    for split in ("train", "eval"):
        path = ingested_paths(cfg, split)[1]
        try:
            counts = json.loads(path.read_text())
            skipped, truncated = sum(int(n) for n in counts["skipped"].values()), int(counts["truncated"])
        except (FileNotFoundError, KeyError, TypeError, ValueError, AttributeError):
            continue  # no ingest in this directory (or not this format): nothing to report
        if skipped or truncated:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts["skipped"].items()))
            first = "; ".join(str(v) for v in counts.get("first_skip", {}).values())
            lines.append(f"[data] {split}: {skipped} of {counts.get('read')} record(s) of {counts.get('source')} "
                         f"skipped{f' ({reasons}; first: {first})' if reasons else ''}, {truncated} truncated, under "
                         f"data.on_bad_record={cfg.data.on_bad_record}, data.on_overlong={cfg.data.on_overlong}: "
                         f"see {path}")  # fmt: skip
    return lines


def _capture_lines(cfg: Config, shard_dirs: list[Path]) -> list[str]:
    """Per captured directory: samples written (its manifest, every attempt's) and those skipped, by
    reason (its skipped.jsonl: non-finite features, empty regenerated responses), which a capture
    without training printed nowhere at its end."""
    from data_pipeline.ledger import read_skipped, skipped_text
    from data_pipeline.records import SKIPPED_NAME
    from data_pipeline.shard_reader import read_manifest

    lines = []
    for d in shard_dirs:
        if d.is_dir():
            records = read_manifest(d)
            skipped = skipped_text(read_skipped(d), f"see {d / SKIPPED_NAME}; data.max_lost_fraction="
                                                    f"{cfg.data.max_lost_fraction}")  # fmt: skip
            lines.append(f"[capture] {d}: {sum(r.n_samples for r in records)} samples in {len(records)} shards, "
                         f"{skipped}")
    return lines
