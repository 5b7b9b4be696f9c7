"""Orchestration on Ray: target actors feed DeepSpeed trainers through webdataset shards while
an evaluator measures tau of each export. Actors receive small records (config dicts, paths,
token-id lists); tensors travel only inside shards."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from data_pipeline.durable_files import write_text_atomic
from dflash_dist.config import Config


class PipelineError(RuntimeError):
    """A stage failed or cannot start; the message says which and what to do."""


@contextmanager
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
    if address:
        kwargs["address"] = address
    else:
        kwargs.update(num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.dashboard,
                      dashboard_host=cfg.ray.dashboard_host, _node_ip_address="127.0.0.1")
    ray.init(**kwargs)
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


def plan_stages(cfg: Config, stages: tuple[str, ...], resume: str) -> tuple[str, ...]:
    """The stages to run given what an earlier run left under cfg.out, checked before anything is
    written or started. `resume` (auto, never or a checkpoint tag directory) applies to training;
    complete (DONE) shards are reused instead of re-extracted unless it is never; an unfinished
    capture is refused (resuming a capture is not supported: it would duplicate samples)."""
    from data_pipeline.records import DONE_NAME, MANIFEST_NAME
    from dflash_dist.trainer.checkpoint import ResumeError, check_resumable, plan_resume, read_marker

    shards = cfg.out / "shards"
    try:
        resume_from = plan_resume(resume, cfg.out / "checkpoints") if "train" in stages else None
    except ResumeError as e:
        raise PipelineError(str(e)) from None
    if "extract" in stages and (shards / MANIFEST_NAME).exists():
        if resume == "never":
            raise PipelineError(
                f"{shards} already holds shards: pass --resume auto to reuse complete shards (and continue the "
                "training run there, if any), or use another --out"
            )
        if not (shards / DONE_NAME).exists():
            raise PipelineError(
                f"{shards} holds shards of a capture that did not finish (no {DONE_NAME} marker): resuming a capture "
                "is not supported yet (it would duplicate samples); start over with another --out"
            )
        print(f"[extract] skipped: {shards} is complete ({DONE_NAME}), reusing its shards", flush=True)
        stages = tuple(s for s in stages if s != "extract")
    if "train" in stages and "extract" not in stages and not (shards / MANIFEST_NAME).exists():
        raise PipelineError(f"no shards under {shards}: run `dflash-dist extract` with the same --out first")
    if resume_from is not None:
        try:
            check_resumable(read_marker(resume_from), cfg.to_dict(), cfg.train.world_size, shards, str(resume_from))
        except ResumeError as e:
            raise PipelineError(str(e)) from None
    return stages


def run_pipeline(cfg: Config, stages: tuple[str, ...], resume: str = "never") -> dict:
    """Run the given stages ("extract", "train", "eval") under cfg.out; returns a summary dict.
    `resume`: see plan_stages."""
    from transformers import AutoTokenizer

    from dflash_dist.data_prep import eval_prompt_ids, prepare_data
    from dflash_dist.target import (
        drafter_config_for,
        expected_provenance,
        resolve_target_dir,
        target_identity,
        tokenizer_mask_id,
    )

    t0 = time.time()
    stages = plan_stages(cfg, stages, resume)
    cfg.out.mkdir(parents=True, exist_ok=True)
    paths = _layout(cfg)
    _save_config(cfg)
    target_dir = resolve_target_dir(cfg)
    train_jsonl, eval_jsonl = prepare_data(cfg)
    ident = target_identity(cfg, target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    expected = expected_provenance(cfg, target_dir, ident, tokenizer)
    drafter_cfg = drafter_config_for(cfg, target_dir, tokenizer_mask_id(tokenizer))
    summary: dict = {"out": str(cfg.out)}
    with ray_session(cfg) as ray:
        capture_refs = _start_capture(ray, cfg, target_dir, ident, train_jsonl, paths) if "extract" in stages else []
        group = _start_trainers(cfg, target_dir, expected, drafter_cfg, paths, resume) if "train" in stages else None
        evaluator = None
        if "eval" in stages and cfg.eval.enabled:
            prompts = eval_prompt_ids(eval_jsonl, tokenizer, cfg.eval.num_prompts)
            evaluator = _start_evaluator(cfg, target_dir, prompts, expected, paths["shards"])
        if capture_refs:
            summary["capture"] = _finish_capture(ray, capture_refs, paths["shards"])
        final_step = None
        if group is not None:
            results = group.wait()
            summary["train"] = [dataclasses.asdict(r) for r in results]
            final_step = max(r.steps for r in results)
            print(f"[train] finished at step {final_step}", flush=True)
        if evaluator is not None:
            if final_step is None:  # eval alone: everything exported so far (None: nothing to wait for)
                final_step = max(_export_steps(paths["export"]), default=None)
            evaluator.trainer_finished.remote(final_step)
            summary["eval"] = ray.get(evaluator.wait.remote())
    summary["seconds"] = time.time() - t0
    _print_summary(cfg, paths, summary)
    return summary


def _start_capture(ray, cfg, target_dir, ident, train_jsonl, paths):
    from dflash_dist.actors.target_worker import TargetWorker

    n = cfg.capture.num_actors
    workers = [TargetWorker.options(num_cpus=cfg.capture.cpus_per_actor, num_gpus=cfg.capture.gpus_per_actor,
                                    name=None).remote() for _ in range(n)]
    refs = [w.capture.remote(cfg.to_dict(), str(target_dir), dataclasses.asdict(ident), str(train_jsonl),
                             str(paths["shards"]), i, n) for i, w in enumerate(workers)]
    print(f"[extract] {n} target actor(s) capturing layers {list(ident.layer_ids)} into {paths['shards']}", flush=True)
    return refs


def _finish_capture(ray, refs, shard_dir: Path) -> list[dict]:
    from data_pipeline.shard_writer import mark_done

    try:
        results = ray.get(refs)
    except Exception as e:  # the actor's own error names the file/line/field
        raise PipelineError(f"target capture failed: {e}") from e
    mark_done(shard_dir)
    samples = sum(r["samples"] for r in results)
    print(f"[extract] {samples} samples, {sum(r['tokens'] for r in results)} tokens in "
          f"{sum(r['shards'] for r in results)} shards (kernel path {results[0]['kernel_path']})", flush=True)
    return results


def _start_trainers(cfg, target_dir, expected, drafter_cfg, paths, resume: str):
    from dflash_dist.actors.trainer_group import start_trainer_group
    from dflash_dist.trainer.checkpoint import ResumeError

    try:
        return start_trainer_group(cfg, target_dir=target_dir, shard_dir=paths["shards"], expected=expected,
                                   drafter_cfg=drafter_cfg, resume=resume)
    except ResumeError as e:
        raise PipelineError(str(e)) from None


def _start_evaluator(cfg, target_dir, prompts, expected, shard_dir: Path):
    from dflash_dist.actors.evaluator_actor import EvaluatorActor, evaluator_actor_options

    actor = EvaluatorActor.options(**evaluator_actor_options(cfg)).remote(
        cfg.to_dict(), str(cfg.out), str(target_dir), prompts, expected.to_json(), str(shard_dir),
        cfg.eval.poll_s, cfg.eval.max_backlog, cfg.eval.backlog_stride)
    actor.start.remote()
    return actor


def _export_steps(export_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in export_dir.glob("step_*") if p.name.split("_")[1].isdigit())


def _print_summary(cfg: Config, paths: dict[str, Path], summary: dict) -> None:
    rows = []
    for f in sorted(paths["eval"].glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1])):
        r = json.loads(f.read_text())
        trees = "  ".join(f"DDTree-{b} {v:.2f}" for b, v in sorted(r["tau_ddtree"].items(), key=lambda x: int(x[0])))
        rows.append(f"  step {r['step']:>6}: tau chain {r['tau_chain']:.2f}  {trees}")
    if rows:
        print("[eval] greedy-replay tau per checkpoint (held-out prompts):")
        print("\n".join(rows))
    print(f"done in {summary['seconds']:.0f}s; outputs under {cfg.out}")
    print(f"TensorBoard: tensorboard --logdir {paths['tb']} --host 127.0.0.1")
