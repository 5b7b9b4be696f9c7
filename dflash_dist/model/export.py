"""Export/import of the drafter in the z-lab/HF format (config.json + model.safetensors) that
z-lab's DFlashDraftModel, SGLang and vLLM load. Written to a temporary directory and renamed,
so a reader never sees half an export. Beside the two files, `dflash_export.json` records their
XXH3 checksums (data_pipeline/checksums.py; the loaders above ignore it), verified when an export
is loaded: the evaluator requires it of the run's own exports, so a damaged one is named instead
of measured; a drafter from elsewhere (z-lab's, eval.reference_drafter) has none and loads as is."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from data_pipeline.checksums import ChecksumMismatch, file_checksums, mismatched_files
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter

EXPORTED = ("config.json", "model.safetensors")  # what the z-lab/HF format is
EXPORT_RECORD = "dflash_export.json"  # their checksums, written with them
_RECORD_VERSION = 1


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` atomically (replaces out_dir). The
    config is the drafter's own (`to_hf_dict`, plus the weights' dtype), nothing else: whatever could
    override a field would make SGLang/vLLM load another drafter than the one trained."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_hf_dict()
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.drafter_state_dict().items()}
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    _remove_leftovers(out_dir)
    tmp = _new_dir(out_dir.parent, f".tmp-{out_dir.name}-")
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes 0600: give the weights config.json's mode (the umask's), so that a serving
        # engine running as another user reads the export as it reads the run's other outputs
        os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
        record = {"version": _RECORD_VERSION, "checksums": file_checksums(tmp, EXPORTED)}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        if out_dir.exists() or out_dir.is_symlink():
            old = out_dir.with_name(f".old-{out_dir.name}-{secrets.token_hex(4)}")
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except BaseException:  # the previous export back at its name, not left under `old`
                os.rename(old, out_dir)
                raise
            _remove(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _remove(path: Path) -> None:
    if path.is_symlink():  # planted in the run directory: removed, never followed (rmtree refuses it)
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers(out_dir: Path) -> None:
    """What an export of this name killed midway left beside it: its temporary directory (a whole
    drafter's weights) or the previous export moved aside for the rename. One writer per name."""
    ours = re.compile(rf"\.(tmp|old)-{re.escape(out_dir.name)}-[0-9a-f]+")  # not another name's ("a" vs "a-b")
    if out_dir.parent.is_dir():
        for stale in out_dir.parent.iterdir():
            if ours.fullmatch(stale.name):
                _remove(stale)


def _new_dir(parent: Path, prefix: str) -> Path:
    """A new directory `parent/prefix<random>` with the umask's mode (tempfile.mkdtemp's is 0700,
    which would keep the export from a serving engine that runs as another user)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def recorded_checksums(export_dir: str | Path) -> dict[str, str] | None:
    """The file checksums export_dir's record holds ({name: digest}), or None without a readable one
    (what identifies the export's weights, as verify_export compares them)."""
    try:
        files = json.loads((Path(export_dir) / EXPORT_RECORD).read_text())["checksums"]["files"]
        return {str(k): str(v) for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify_export(export_dir: str | Path, required: bool = False) -> bool:
    """Check the export's files against the checksums its record holds (ChecksumMismatch naming
    them); True if it had a record. Without one: False, or with `required` a ValueError naming it."""
    export_dir = Path(export_dir)
    path = export_dir / EXPORT_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ValueError(f"{path}: missing: this export was not written whole by this version's trainer (its "
                             "files' checksums are written with them); export it again from its checkpoint: "
                             f"{_export_command(export_dir)}") from None
        return False
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not an export record ({e}); export it again from its checkpoint: "
                         f"{_export_command(export_dir)}") from None
    record = record if isinstance(record, dict) else {}
    checksums = record.get("checksums")
    files = checksums.get("files") if isinstance(checksums, dict) else None
    if record.get("version") != _RECORD_VERSION or not isinstance(files, dict) or set(files) != set(EXPORTED):
        raise ValueError(f"{path}: not a version-{_RECORD_VERSION} record of {list(EXPORTED)}; export it again "
                         f"from its checkpoint: {_export_command(export_dir)}")
    bad = mismatched_files(export_dir, checksums, EXPORTED, links_ok=not required)  # a run's own: no links
    if bad:
        raise ChecksumMismatch(f"{export_dir}: {', '.join(bad)} differ(s) from the {checksums['algorithm']} checksum "
                               f"{EXPORT_RECORD} recorded when it was exported: the export was damaged since; export "
                               f"it again from its checkpoint: {_export_command(export_dir)}")
    return True


def _export_command(export_dir: Path) -> str:
    """The command that writes `export_dir` again: a run's exports (<run>/export/<tag>) come from the
    checkpoint of the same tag (<run>/checkpoints/<tag>)."""
    if export_dir.parent.name == "export":
        return f"dflash-dist export {export_dir.parent.parent / 'checkpoints' / export_dir.name}"
    return "dflash-dist export <checkpoint> --out " + str(export_dir)


def empty_drafter(cfg: DrafterConfig, device: str | torch.device = "cpu") -> DFlashDrafter:
    """A drafter of shape `cfg` on `device` with nothing initialised (every weight is about to be
    loaded): built on the meta device, its storage then allocated, its RoPE buffers computed."""
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter.to_empty(device=device)
    drafter.rotary.reset_buffers()
    return drafter


def load_drafter(
    export_dir: str | Path,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    require_record: bool = False,
) -> DFlashDrafter:
    """Build a drafter from an export; the target's embedding and lm_head are passed in (frozen).
    Its files are verified against its checksum record when it has one (`require_record`: it must)."""
    export_dir = Path(export_dir)
    cfg_path = export_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no drafter config.json here (expected an export directory)")
    verify_export(export_dir, require_record)
    cfg = DrafterConfig.from_hf_dict(json.loads(cfg_path.read_text()), where=str(cfg_path))
    state = load_file(str(export_dir / "model.safetensors"), device=str(device))
    drafter = empty_drafter(cfg, device)
    expected = set(drafter.drafter_state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"{export_dir}/model.safetensors does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    drafter.load_state_dict(state, strict=False)
    drafter.to(next(iter(state.values())).dtype)
    if embed_weight is not None and lm_head_weight is not None:
        drafter.set_target_weights(embed_weight.to(device), lm_head_weight.to(device))
    else:  # never leave uninitialised memory behind: the caller must share the target's later
        drafter.embed_tokens.weight.data.zero_()
        drafter.lm_head.weight.data.zero_()
    return drafter.eval()
