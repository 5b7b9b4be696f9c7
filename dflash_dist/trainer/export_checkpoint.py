"""`dflash-dist export CHECKPOINT_DIR`: a checkpoint tag's drafter exported again, outside training.

The trainer exports every checkpoint it saves (loop.py `_export`); a damaged export
(export.verify_export names it) or one wanted again comes from its checkpoint here, without a
process group or an engine. The tag is checked as a resume checks it before DeepSpeed reads a
byte: its completion marker (every listed file present at its recorded size) and every file's
XXH3 checksum (checkpoint.verify_checksums). The drafter is built with the shape the run
trained, as it recorded it: the marker's `drafter` (the trainer writes the config.json of its own
export there), or for an older tag the run plan in its run directory (CHECKPOINT_DIR/../..);
neither the run's config.yaml nor its target is read, so no target is ever built here (the
project's own are, on first use), and the shape cannot drift from what was trained. Its weights
come from the checkpoint files loaded weights-only (safe_load.py: nothing is unpickled):
ZeRO-0/1/2 keep the whole module in `mp_rank_00_model_states.pt`; ZeRO-3 partitions it, and
DeepSpeed's own consolidation (zero_to_fp32, from every rank's fp32 partition in
`zero_pp_rank_*_optim_states.pt`) rebuilds it under the same weights-only loads, cast to the
parameters' saved dtype. The export is written by
export_drafter (a temporary directory renamed into place): on any error nothing is left.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.export import EXPORT_RECORD, EXPORTED, empty_drafter, export_drafter, verify_export
from dflash_dist.trainer.checkpoint import (
    MARKER,
    ResumeError,
    complete_tags,
    marker_problem,
    read_marker,
    verify_checksums,
)
from dflash_dist.trainer.safe_load import weights_only_loads

log = logging.getLogger(__name__)
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-0/1/2: the whole module
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3: rank 0's (placeholders, shapes)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
PREFIX = "drafter."  # the trainer's DeepSpeed module is TrainForward, holding the drafter (engine.py)
# where a run keeps its plans (orchestration/run_plan.py's PLAN_NAME and PLANS_DIR, a layer above this one)
RUN_PLAN, SLURM_PLANS = "run_plan.json", "plans"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the file and what to do."""


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    zero_stage: int
    tensors: int


def export_checkpoint(tag_dir: str | Path, out: str | Path | None = None, dtype: torch.dtype | None = None,
                      force: bool = False) -> Exported:  # fmt: skip
    """Export the drafter of checkpoint tag `tag_dir` to `out` (default <run>/export/<tag>);
    `dtype` None keeps the saved parameters' dtype (as the trainer's own export does)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise ExportError(f"{tag_dir}: no such checkpoint directory (expected a tag such as <run>/checkpoints/step_N)")
    run_dir = tag_dir.resolve().parent.parent
    out = Path(out) if out is not None else run_dir / "export" / tag_dir.name
    if out.is_dir() and not out.is_symlink():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (*EXPORTED, EXPORT_RECORD))
        if foreign:  # export_drafter replaces the whole directory
            raise ExportError(f"{out}: not an export directory (it holds {foreign[:5]}), and an export replaces "
                              "its directory whole: pass a new or empty --out")
    elif out.exists() and not out.is_symlink():
        raise ExportError(f"{out}: exists and is not a directory: pass another --out")
    if not force and _valid_export(out):
        raise ExportError(f"{out}: already holds a valid export (its checksums match): pass --force to replace it, "
                          "or --out another directory")
    meta = _verified_marker(tag_dir)
    stage = int(meta["config"]["train"]["zero_stage"])
    drafter = _empty_drafter(_drafter_config(run_dir, meta, tag_dir))
    state = _module_state(tag_dir, stage)
    _load(drafter, state, tag_dir, stage)
    path = export_drafter(drafter, out, dtype)
    return Exported(path, int(meta["step"]), stage, len(drafter.drafter_state_dict()))


def _empty_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter without initialising anything (its weights all come from the checkpoint; the
    target's embedding and lm_head, not exported, are zeros)."""
    drafter = empty_drafter(cfg)
    drafter.embed_tokens.weight.data.zero_()
    drafter.lm_head.weight.data.zero_()
    return drafter


def _valid_export(out: Path) -> bool:
    if not out.is_dir():
        return False
    try:
        return verify_export(out, required=True)
    except ValueError:  # damaged or no record (ChecksumMismatch is one): replacing it is the point
        return False


def _verified_marker(tag_dir: Path) -> dict:
    """The tag's completion marker, after the resume path's checks (size and checksum of every file)."""
    problem = marker_problem(tag_dir)
    if problem is not None:
        raise ExportError(f"{tag_dir} is not a complete checkpoint: {problem} (a save that did not finish, or not "
                          "a tag directory): export another tag of its run")
    meta = read_marker(tag_dir)
    if meta is None or not isinstance(meta.get("step"), int):
        raise ExportError(f"{tag_dir / MARKER}: not a completion marker of a checkpoint (no step)")
    try:
        verify_checksums(tag_dir, meta)
    except ResumeError as e:
        raise ExportError(_for_export(e, tag_dir)) from None
    if not isinstance(meta.get("config"), dict) or "zero_stage" not in meta["config"].get("train", {}):
        raise ExportError(f"{tag_dir / MARKER}: records no run config (train.zero_stage): not a checkpoint this "
                          "version's trainer saved")
    return meta


def _for_export(e: Exception, tag_dir: Path) -> str:
    """A resume-path error with its advice (resume elsewhere) turned into an export's."""
    tags = [p.name for p in complete_tags(tag_dir.parent) if p.name != tag_dir.name]
    text = re.sub(r"[:;] resume from another .*$", "", str(e), flags=re.S)
    return f"{text}; export another tag of its run (complete tags beside it: {tags}) or restore the file"


def _drafter_config(run_dir: Path, meta: dict, tag_dir: Path) -> DrafterConfig:
    """The drafter shape the run trained, as the run recorded it: the tag's marker (`drafter`, the
    config.json of the trainer's own export), or for a tag saved before markers held it, the run
    plan(s) of its run directory. Never derived again from a config and a target (which could
    build the project's target, or differ from what was trained)."""
    where = tag_dir / MARKER
    if "drafter" in meta:
        try:
            return DrafterConfig.from_hf_dict(meta["drafter"], f"{where}: drafter")
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"{where}: its drafter record cannot be read ({e}): export another tag of its run"
                              ) from None  # fmt: skip
    plans = [p for p in (run_dir / RUN_PLAN, *sorted((run_dir / SLURM_PLANS).glob("*.json"))) if p.is_file()]
    found: dict[DrafterConfig, list[str]] = {}
    for path in plans:
        try:
            found.setdefault(DrafterConfig.from_dict(json.loads(path.read_text())["drafter"]), []).append(path.name)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ExportError(f"{path}: its drafter record cannot be read ({type(e).__name__}: {e}); it is the "
                              f"record {tag_dir} (saved before checkpoints recorded their drafter) is exported "
                              "from") from None  # fmt: skip
    if not found:
        raise ExportError(f"{where} records no drafter shape (a checkpoint saved before markers held it) and its "
                          f"run directory holds no run plan ({run_dir / RUN_PLAN} or {run_dir / SLURM_PLANS}/*.json) "
                          "that does: restore the run's run_plan.json, or export a tag saved by this version")
    if len(found) > 1:
        raise ExportError(f"{where} records no drafter shape and the run plans of {run_dir} record "
                          f"{len(found)} different ones ({' vs '.join(str(v) for v in found.values())}): "
                          "keep only the plan of the run that trained this tag")  # fmt: skip
    drafter, names = next(iter(found.items()))
    log.info("%s: the drafter shape of %s (its marker records none)", tag_dir, ", ".join(names))
    return drafter


def _module_state(tag_dir: Path, stage: int) -> dict[str, torch.Tensor]:
    """The TrainForward module's trainable weights as saved (weights-only loads throughout)."""
    path = tag_dir / (ZERO3_MODEL_STATES if stage == 3 else MODEL_STATES)
    if not path.is_file():
        raise ExportError(f"{path}: missing (the marker records ZeRO-{stage}): not a DeepSpeed checkpoint this "
                          "trainer saved; export another tag of its run")
    try:
        with weights_only_loads():
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except ResumeError as e:  # refused (not plain data) or unreadable: named by safe_load
        raise ExportError(_for_export(e, tag_dir)) from None
    module = saved.get("module") if isinstance(saved, dict) else None
    if not isinstance(module, dict):
        raise ExportError(f"{path}: holds no `module` state dict: not a DeepSpeed model-states file")
    dtypes = {k: v.dtype for k, v in module.items() if torch.is_tensor(v)}
    if stage != 3:
        return {k: v for k, v in module.items() if torch.is_tensor(v)}
    # ZeRO-3: the module's tensors are empty placeholders; the fp32 partitions hold the weights
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with weights_only_loads(), contextlib.redirect_stdout(io.StringIO()):
            full = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                            exclude_frozen_parameters=True)  # fmt: skip
    except ResumeError as e:
        raise ExportError(_for_export(e, tag_dir)) from None
    except (ValueError, KeyError, AssertionError, OSError) as e:
        raise ExportError(f"{tag_dir}: DeepSpeed's ZeRO-3 consolidation failed ({type(e).__name__}: {e}); export "
                          "another tag of its run") from None
    return {k: v.to(dtypes.get(k, v.dtype)) for k, v in full.items()}


def _load(drafter: DFlashDrafter, state: dict[str, torch.Tensor], tag_dir: Path, stage: int) -> None:
    """Put the saved weights into the drafter's own (non-target) parameters, every one of them."""
    own = {PREFIX + k: v for k, v in drafter.drafter_state_dict().items()}
    got = {k: v for k, v in state.items() if k.startswith(PREFIX) and k.removeprefix(PREFIX) not in
           DFlashDrafter.TARGET_KEYS}  # fmt: skip
    where = tag_dir / MODEL_STATES if stage != 3 else tag_dir
    missing, unexpected = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    if missing or unexpected:
        raise ExportError(f"{where}: its weights do not match the drafter its run recorded (missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}): export another tag of its run")
    for name, tensor in own.items():
        saved = got[name]
        if saved.shape != tensor.shape:
            raise ExportError(f"{where}: {name} has shape {tuple(saved.shape)}, the drafter its run recorded "
                              f"{tuple(tensor.shape)}: export another tag of its run")
    drafter.load_state_dict({k.removeprefix(PREFIX): v for k, v in got.items()}, strict=False)
    dtypes = {v.dtype for v in got.values()}
    if len(dtypes) == 1:  # the trainer's export keeps the parameters' dtype (bf16 on GPU)
        drafter.to(dtypes.pop())


def main(argv: list[str]) -> int:
    """`dflash-dist export CHECKPOINT_DIR [--out DIR] [--dtype bf16|fp32|fp16] [--force]`: 0 when
    written, 1 when the checkpoint cannot be exported (the message says why), 2 for a usage error."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="dflash-dist export", description="export a checkpoint tag's drafter (z-lab/"
                                 "HF format, with dflash_export.json) again, e.g. to replace a damaged export")
    ap.add_argument("checkpoint", help="a checkpoint tag directory, e.g. RUN/checkpoints/step_500")
    ap.add_argument("--out", default=None, help="export directory (default: RUN/export/<tag>)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weights' dtype (default: the saved parameters', as the trainer's own export)")
    ap.add_argument("--force", action="store_true", help="replace a valid export already at the output")
    args = ap.parse_args(argv)
    from dflash_dist.logging_setup import setup_logging

    setup_logging("export")
    try:
        done = export_checkpoint(args.checkpoint, args.out, DTYPES.get(args.dtype), args.force)
    except ExportError as e:
        print(f"dflash-dist export: error: {e}", file=sys.stderr)
        return 1
    print(f"[export] {done.out}: step {done.step} (ZeRO-{done.zero_stage}), {done.tensors} tensors; "
          "verified against its dflash_export.json")
    return 0
