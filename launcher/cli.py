"""The `dflash-dist` command line.

  dflash-dist run CONFIG [--out DIR] [key.path=value ...]      the whole pipeline on Ray
  dflash-dist extract|train|eval CONFIG --out DIR [overrides]  one stage (train/eval consume DIR)
      run/train --resume auto|never|PATH   auto: continue DIR/checkpoints/latest if there (reusing
      complete shards); never (default): refuse a DIR holding a run; PATH: from that checkpoint tag
  dflash-dist demo                                             the tiny core demo (no Ray)
  dflash-dist parity DIR [--device cuda]                       numerics against golden data
"""

from __future__ import annotations

import argparse
import sys

STAGES = {"run": ("extract", "train", "eval"), "extract": ("extract",), "train": ("train",), "eval": ("eval",)}


def _pipeline_parser(cmd: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"dflash-dist {cmd}")
    ap.add_argument("config", help="YAML config (e.g. configs/tiny.yaml)")
    ap.add_argument("--out", default=None, required=cmd != "run", help="output directory (run.out_dir)")
    if cmd in ("run", "train"):
        ap.add_argument(
            "--resume",
            default="never",
            metavar="auto|never|PATH",
            help="auto: continue from DIR/checkpoints/latest if present (complete shards are reused), else start "
            "fresh; never (default): refuse a DIR that already holds a run; PATH: start from that checkpoint tag "
            "directory",
        )
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=1e-3")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from dflash_dist.demo import main as demo_main

        return demo_main(rest)
    if cmd == "parity":
        from dflash_dist.parity import main as parity_main

        return parity_main(rest)
    if cmd not in STAGES:
        print(f"dflash-dist: unknown command {cmd!r}\n{__doc__.strip()}", file=sys.stderr)
        return 2
    args = _pipeline_parser(cmd).parse_intermixed_args(rest)
    from dflash_dist.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, out_dir=args.out)
    except ConfigError as e:
        print(f"dflash-dist: config error: {e}", file=sys.stderr)
        return 2
    from dflash_dist.pipeline import PipelineError, run_pipeline

    try:
        run_pipeline(cfg, STAGES[cmd], resume=getattr(args, "resume", "never"))
    except (PipelineError, ConfigError) as e:
        print(f"dflash-dist {cmd}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
