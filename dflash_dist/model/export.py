"""Export/import of the drafter in the z-lab/HF format (config.json + model.safetensors) that
z-lab's DFlashDraftModel, SGLang and vLLM load. Written to a temporary directory and renamed,
so a reader never sees half an export."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None,
                   extra_config: dict | None = None) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` atomically (replaces out_dir)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_hf_dict()
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.drafter_state_dict().items()}
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    cfg.update(extra_config or {})
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out_dir.exists():
            old = out_dir.with_name(f".old-{out_dir.name}-{os.getpid()}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_drafter(
    export_dir: str | Path,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
) -> DFlashDrafter:
    """Build a drafter from an export; the target's embedding and lm_head are passed in (frozen)."""
    export_dir = Path(export_dir)
    cfg_path = export_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no drafter config.json here (expected an export directory)")
    cfg = DrafterConfig.from_hf_dict(json.loads(cfg_path.read_text()), where=str(cfg_path))
    state = load_file(str(export_dir / "model.safetensors"), device=str(device))
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter.to_empty(device=device)
    drafter.rotary.reset_buffers()
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
