"""The `dflash-dist` command line.

  dflash-dist run CONFIG [--out DIR] [key.path=value ...]      the whole pipeline on Ray
  dflash-dist extract|train|eval CONFIG --out DIR [overrides]  one stage (train/eval consume DIR)
      run/train --resume auto|never|PATH   auto: continue DIR/checkpoints/latest if there (reusing
      complete shards); never (default): refuse a DIR holding a run; PATH: from that checkpoint tag
      extract --resume auto|never   auto: continue an unfinished capture in DIR
      run/train --launcher slurm   inside a Slurm job (slurm/*.sbatch); extract --slice I/N   one slice, no Ray
  dflash-dist regenerate CONFIG [--out DIR] [--limit N] [overrides]
      the target's own responses to the input's prompts (regen.*), a new JSONL; a rerun resumes
  dflash-dist build-target CONFIG [overrides]                  build (or find cached) the config's own target
      (target.kind tiny_stdlib or code_lm) and print its build record
  dflash-dist export CHECKPOINT_DIR [--out DIR] [--dtype bf16|fp32|fp16] [--force]
      a checkpoint tag's drafter exported again (default DIR: RUN/export/<tag>; a valid one kept unless --force)
  dflash-dist status DIR [--json]                              shards, disk, trainer, tau, roles alive
  dflash-dist demo                                             the tiny core demo (no Ray)
  dflash-dist parity DIR [--device cuda]                       numerics against golden data
  dflash-dist cluster-token CLUSTER_YAML [--new]               before `ray up`: the cluster's auth token file
  dflash-dist ray-start ARGS                                   `ray start ARGS` with token auth (cluster YAMLs)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
STAGES = {"run": ("extract", "train", "eval"), "extract": ("extract",), "train": ("train",), "eval": ("eval",)}
NO_TORCH = ("status", "cluster-token")  # commands that compile nothing (and start nothing that does)


def _pipeline_parser(cmd: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"dflash-dist {cmd}")
    ap.add_argument("config", help="YAML config (e.g. configs/tiny.yaml)")
    ap.add_argument("--out", default=None, required=cmd != "run", help="output directory (run.out_dir)")
    if cmd in ("run", "train", "extract"):  # extract: auto resumes an unfinished capture (ledger)
        ap.add_argument(
            "--resume",
            default=None,  # never, except for extract --slice, which always continues from the ledger
            metavar="auto|never" if cmd == "extract" else "auto|never|PATH",
            help="auto: continue from DIR/checkpoints/latest if present (complete shards are reused), else start "
            "fresh; never (default): refuse a DIR that already holds a run"
            + ("" if cmd == "extract" else "; PATH: start from that checkpoint tag directory"),
        )
    if cmd in ("run", "train"):
        ap.add_argument("--launcher", choices=("ray", "slurm"), default="ray",
                        help="slurm: inside a Slurm job (slurm/*.sbatch): run starts a Ray cluster over the job's "
                        "nodes first; train runs one DeepSpeed rank per srun task, without Ray")
    if cmd == "extract":
        ap.add_argument("--slice", default=None, metavar="I/N",
                        help="capture only slice I of N in this process, without Ray (a Slurm array task); the "
                        "slice that completes the set marks the shards DONE")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=1e-3")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in NO_TORCH:
        problem = compile_cache_problem()
        if problem:
            print(f"dflash-dist {cmd}: error: {problem}", file=sys.stderr)
            return 1
    if cmd == "demo":
        from dflash_dist.tools.demo import main as demo_main

        return demo_main(rest)
    if cmd == "status":
        from launcher.status import main as status_main

        return status_main(rest)
    if cmd == "parity":
        from dflash_dist.tools.parity import main as parity_main

        return parity_main(rest)
    if cmd == "regenerate":
        return _regenerate(rest)
    if cmd == "export":
        from dflash_dist.trainer.export_checkpoint import main as export_main

        return export_main(rest)
    if cmd in ("cluster-token", "ray-start"):
        from launcher.ray_auth import cluster_token_main, ray_start_main

        return (cluster_token_main if cmd == "cluster-token" else ray_start_main)(rest)
    if cmd == "build-target":
        return _build_target(rest)
    if cmd not in STAGES:
        print(f"dflash-dist: unknown command {cmd!r}\n{__doc__.strip()}", file=sys.stderr)
        return 2
    args = _pipeline_parser(cmd).parse_intermixed_args(rest)
    if getattr(args, "slice", None) and args.resume not in (None, "auto"):
        print(f"dflash-dist extract: error: --slice always continues from the ledger (an array's tasks share --out "
              f"and a requeued task resumes): --resume {args.resume} does not apply; drop it", file=sys.stderr)
        return 2
    if cmd == "extract" and args.resume not in (None, "auto", "never"):
        print(f"dflash-dist extract: error: --resume takes auto or never here (auto continues an unfinished "
              f"capture); a checkpoint PATH ({args.resume}) is for run and train: extract trains nothing",
              file=sys.stderr)
        return 2
    if cmd in ("run", "train", "extract"):
        args.resume = cli_resume(args.resume or "never")
    from dflash_dist.config import ConfigError
    from dflash_dist.logging_setup import setup_logging

    setup_logging(_role(cmd, args))

    try:
        cfg = load_cli_config(args.config, args.overrides, args.out)
    except ConfigError as e:
        print(f"dflash-dist: config error: {e}", file=sys.stderr)
        return 2
    problem = out_dir_problem(cfg.out)
    if problem:
        print(f"dflash-dist {cmd}: error: {problem}", file=sys.stderr)
        return 1
    from dflash_dist.orchestration.pipeline import PipelineError, failure_text, run_pipeline

    if getattr(args, "launcher", "ray") == "slurm" or getattr(args, "slice", None):
        return _slurm(cmd, args, cfg)
    from dflash_dist.orchestration.pipeline import Preempted

    try:
        run_pipeline(cfg, STAGES[cmd], resume=getattr(args, "resume", "never"))
    except Preempted as e:  # saved and stopped at a notice: a requeue continues it (slurm/*.sbatch)
        print(f"dflash-dist {cmd}: {e}", file=sys.stderr)
        return Preempted.exit_code
    except KeyboardInterrupt:  # Ctrl-C: the run's Ray processes were stopped on the way out (ray_session)
        again = "rerun the same command" if cmd == "eval" else "rerun with --resume auto"
        print(f"\ndflash-dist {cmd}: interrupted; {cfg.out} keeps its complete shards, checkpoints and results: "
              f"{again} to continue", file=sys.stderr)
        return 130
    except (PipelineError, ConfigError) as e:
        print(f"dflash-dist {cmd}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # any other failure of a role: one clear line, not a traceback
        log.debug("dflash-dist %s failed", cmd, exc_info=True)
        print(f"dflash-dist {cmd}: error: {failure_text(e)} (DFLASH_LOG_LEVEL=DEBUG shows the traceback)",
              file=sys.stderr)
        return 1
    return 0


def load_cli_config(config: str, overrides: list[str], out: str | None):
    """The stages' config: the file, the overrides and --out, with the paths that roles on other
    nodes open made absolute here (config.with_absolute_paths)."""
    from dflash_dist.config import load_config, with_absolute_paths

    return with_absolute_paths(load_config(config, overrides, out_dir=out))


def cli_resume(resume: str) -> str:
    """--resume as the stages get it: auto and never as given, a checkpoint PATH made absolute here
    (the trainer ranks open the tag the driver decided on from their node's working directory, where
    its Ray was started: config.with_absolute_paths' reason)."""
    return resume if resume in ("auto", "never") else os.path.abspath(resume)


def compile_cache_problem() -> str | None:
    """Put torch.compile's and Triton's caches in a directory only this user can write (this
    process and every one it starts: Ray's raylets and actors, srun tasks, spawned workers), or why
    not (dflash_dist/compile_cache.py). Before anything imports torch's compiler."""
    from dflash_dist.compile_cache import CacheDirError, use_private_cache_dirs

    try:
        use_private_cache_dirs()
    except CacheDirError as e:
        return str(e)
    return None


def out_dir_problem(out: Path) -> str | None:
    """Why the run cannot write into `out` (created if missing), or None: checked by writing (and
    removing) a file there, so a read-only directory or file system is one clear line up front
    instead of a traceback from whichever role writes first."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".dflash-write-check-"):
            pass
    except OSError as e:
        return f"--out {out} is not writable ({e.strerror or e}): pass a directory this user can write"
    return None


def _role(cmd: str, args: argparse.Namespace) -> str:
    """How this process names itself in log lines (a Slurm rank renames itself once it knows its rank)."""
    if getattr(args, "slice", None):
        return f"target {args.slice}"
    if getattr(args, "launcher", "ray") == "slurm":
        return "slurm" if cmd == "run" else "trainer"
    return "driver"


def _slurm(cmd: str, args: argparse.Namespace, cfg) -> int:
    """The Slurm entry points (launcher/slurm_*.py; slurm/*.sbatch call them)."""
    from dflash_dist.config import ConfigError
    from dflash_dist.orchestration.pipeline import PipelineError
    from dflash_dist.trainer.checkpoint import ResumeError

    try:
        if cmd == "extract":
            from launcher.slurm_capture import capture_slice, parse_slice

            capture_slice(cfg, *parse_slice(args.slice))
            return 0
        if cmd == "train":
            from launcher.slurm_train import run_slurm_trainer

            return run_slurm_trainer(cfg, args.resume)
        if cmd == "run":
            from launcher.slurm_ray import run_on_slurm_ray

            argv = ["run", args.config, "--out", str(cfg.out), "--resume", args.resume, *args.overrides]
            return run_on_slurm_ray(cfg, argv)
    except (PipelineError, ConfigError, ResumeError) as e:
        print(f"dflash-dist {cmd}: error: {e}", file=sys.stderr)
        return 1
    print(f"dflash-dist {cmd}: --launcher slurm is for run, train and extract --slice", file=sys.stderr)
    return 2


def _regenerate(rest: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dflash-dist regenerate")
    ap.add_argument("config", help="YAML config; the regen: section says how (target or server)")
    ap.add_argument("--out", default=None, help="run directory (run.out_dir); the output defaults to DIR/data/")
    ap.add_argument("--limit", type=int, default=None, help="stop after this many records (rerun to continue)")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. regen.temperature=0.7")
    args = ap.parse_intermixed_args(rest)
    from data_pipeline.ingest import DataError
    from dflash_dist.capture.regenerate import RegenError, regen_loss_problem, run_regenerate
    from dflash_dist.config import ConfigError, load_config
    from dflash_dist.logging_setup import setup_logging

    setup_logging("regenerate")

    try:
        cfg = load_config(args.config, args.overrides, out_dir=args.out)
        report = run_regenerate(cfg, limit=args.limit)
    except ConfigError as e:
        print(f"dflash-dist regenerate: config error: {e}", file=sys.stderr)
        return 2
    except (RegenError, DataError) as e:
        print(f"dflash-dist regenerate: error: {e}", file=sys.stderr)
        return 1
    print(
        f"[regenerate] {report.output}: {report.written} written, {report.rejected} rejected (empty responses), "
        f"{report.remaining} remaining of {report.total}; data.max_lost_fraction={cfg.data.max_lost_fraction}"
    )
    problem = regen_loss_problem(report, cfg.data.max_lost_fraction)
    if problem is not None:
        print(f"dflash-dist regenerate: error: {problem}", file=sys.stderr)
        return 1
    return 0


def _build_target(rest: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dflash-dist build-target")
    ap.add_argument("config", help="YAML config whose target.kind is tiny_stdlib or code_lm")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. target.preset=qwen3_5")
    args = ap.parse_intermixed_args(rest)
    import json

    from dflash_dist.config import ConfigError, load_config
    from dflash_dist.logging_setup import setup_logging

    setup_logging("build-target")
    try:  # builds from the project's own corpus: the config's data files need not exist here
        cfg = load_config(args.config, args.overrides, check_files=False)
    except ConfigError as e:
        print(f"dflash-dist build-target: config error: {e}", file=sys.stderr)
        return 2
    if cfg.target.kind == "hf":
        print(f"dflash-dist build-target: {args.config}: target.kind is hf (a model directory); only the project's "
              "own targets (tiny_stdlib, code_lm) are built", file=sys.stderr)
        return 2
    from dflash_dist.target.build_cache import read_stamp
    from dflash_dist.target.loading import resolve_target_dir

    target_dir = resolve_target_dir(cfg)
    print(json.dumps({"target_dir": str(target_dir), **read_stamp(target_dir)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
