"""Elastic resume: a checkpoint saved by N ranks resumed by M, through DeepSpeed's universal
checkpoint.

Why a conversion: ZeRO-1/2/3 checkpoints hold each rank's flat partition of the fp32 weights
and AdamW moments, cut for the saving world size; DeepSpeed 0.19.8 refuses to load them at
another one. `deepspeed.checkpoint.ds_to_universal` rewrites a tag as one file per parameter
and state (`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), which an engine built with
`checkpoint.load_universal` (ds_config.deepspeed_config(load_universal=True)) re-partitions
for its own world size; the LR schedule, DeepSpeed's step counters and our client state come
from the copied model-states files. ZeRO-1/2 checkpoints lack the universal-checkpoint info
record (only AutoTP writes it): the converter's `inject_missing_state` adds it. ZeRO-3's
universal load has two defects in 0.19.8, undone by Trainer._resume: every param group gets
group 0's hyperparameters, and one AdamW `step` tensor is shared by all flat partitions.

The converted copy lives inside the tag (`<tag>/universal/`), so a second resume reuses it
and pruning the tag removes it. It is written into a temporary directory and renamed into
place only after its completion marker (with every file's XXH3 checksum) is on disk: a crash
leaves nothing that looks complete, and the next resume converts again. A reused copy is
verified against those checksums first, and must hold no file they do not list (DeepSpeed's
universal load globs it, as its ZeRO loaders glob the tag); a damaged one is converted again from
the tag (whose own files `checkpoint.verify_checksums` verified before). Rank 0 converts; the
other ranks wait (`ensure_universal`).

Stage 0 is not elastic here: without ZeRO the optimizer state is not DeepSpeed-partitioned
on CPU, but on GPU bf16 the BF16_Optimizer partitions it in yet another layout; refusing is
simpler than supporting a path no test covers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from data_pipeline.checksums import file_checksums, mismatched_files
from data_pipeline.durable_files import fsync_dir, write_text_atomic
from dflash_dist.trainer.checkpoint import fsync_tree, unlisted_files
from dflash_dist.trainer.collectives import PeerError, run_or_stop
from dflash_dist.trainer.safe_load import weights_only_loads

UNIVERSAL = "universal"  # the converted copy, inside the tag directory
UNIVERSAL_MARKER = "dflash_universal.json"
UNIVERSAL_VERSION = 2  # 2: the marker records every file's checksum

log = logging.getLogger(__name__)


def universal_dir(tag_dir: Path) -> Path:
    return Path(tag_dir) / UNIVERSAL


def is_converted(tag_dir: Path) -> bool:
    """The tag has a complete universal copy (marker written last, then the rename)."""
    try:
        meta = json.loads((universal_dir(tag_dir) / UNIVERSAL_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("version") == UNIVERSAL_VERSION and meta.get("tag") == tag_dir.name


def convert(tag_dir: Path) -> Path:
    """Write `<tag>/universal/` from the tag's ZeRO files (one process; see ensure_universal)
    and return it; an existing complete copy is reused. DeepSpeed's converter runs in this
    process, serially (its worker pools would fork a process that holds a process group);
    its console output goes to `conversion.log` inside the copy."""
    from deepspeed.checkpoint import ds_to_universal

    tag_dir = Path(tag_dir)
    out = universal_dir(tag_dir)
    if is_converted(tag_dir):
        meta = json.loads((out / UNIVERSAL_MARKER).read_text())
        damaged = mismatched_files(out, meta["checksums"])
        # DeepSpeed's universal load globs the copy (the first mp_rank_*_model_states.pt, every zero/<param>/*.pt)
        unlisted = unlisted_files(out, [*meta["checksums"]["files"], UNIVERSAL_MARKER], tag=False)
        if not damaged and not unlisted:
            return out
        log.warning("%s: %s differ(s) from the checksums recorded at conversion, %s not listed there: converting "
                    "%s again", out, ", ".join(damaged) or "nothing", ", ".join(unlisted[:5]) or "nothing",
                    tag_dir)  # fmt: skip
    for stale in [out, *tag_dir.glob(f".{UNIVERSAL}.tmp-*")]:  # a conversion that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tag_dir / f".{UNIVERSAL}.tmp-{os.getpid()}"
    tmp.mkdir()
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(tmp),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # ZeRO-1/2 checkpoints carry no universal-checkpoint info
    )
    t0 = time.perf_counter()
    try:
        with (
            open(tmp / "conversion.log", "w") as console,
            contextlib.redirect_stdout(console),
            contextlib.redirect_stderr(console),
            weights_only_loads(),  # the converter's torch.load calls unpickle nothing (safe_load.py)
        ):
            ds_to_universal.main(args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tag_dir / "latest_universal").unlink(missing_ok=True)  # the converter names tmp there; we load by path
    files = [str(p.relative_to(tmp)) for p in sorted(tmp.rglob("*")) if p.is_file()]
    record = {"version": UNIVERSAL_VERSION, "tag": tag_dir.name, "seconds": round(time.perf_counter() - t0, 3),
              "checksums": file_checksums(tmp, files)}  # fmt: skip
    write_text_atomic(tmp / UNIVERSAL_MARKER, json.dumps(record, sort_keys=True) + "\n")
    fsync_tree(tmp)
    os.rename(tmp, out)
    fsync_dir(tag_dir)
    return out


def ensure_universal(tag_dir: Path, group: Any = None) -> Path:
    """Every rank calls it: rank 0 converts (or finds the cached copy) while the others wait;
    a failure on rank 0 is raised on every rank (collectives.run_or_stop: no rank is left in a
    collective), on the others as a PeerError carrying rank 0's message."""
    rank = dist.get_rank()

    def on_rank_0() -> None:
        try:
            convert(tag_dir)
        except Exception as e:
            raise RuntimeError(
                f"converting {tag_dir} to a universal checkpoint failed on rank 0: {type(e).__name__}: {e}"
            ) from e

    def stop(failed: str) -> PeerError:
        return PeerError(f"rank {rank} stops resuming from {tag_dir} because another rank failed there ({failed})")

    run_or_stop(on_rank_0 if rank == 0 else lambda: None, group, stop)
    return universal_dir(tag_dir)
