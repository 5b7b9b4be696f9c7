"""A saved target whose weights are another model's: one tensor nudged, same names and shapes, so
only the weight hash tells them apart (the weight-check tests of the evaluator and capture)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def perturb(target_dir: Path) -> None:
    """Rewrite the target's weights with one tensor changed slightly (another model, same shapes)."""
    path = target_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight"))[0]
    tensors[name] = tensors[name] + 1e-3
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def other_target(target_dir: Path, where: Path) -> Path:
    """A copy of the target at `where` whose weights differ from the original's."""
    shutil.copytree(target_dir, where)
    perturb(where)
    return where
