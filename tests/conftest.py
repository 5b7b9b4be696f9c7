"""Shared fixtures. The golden fixtures live in ../shared/golden beside the checkout (CI lays
it there too); DFLASH_GOLDEN_DIR overrides. A missing golden directory is an error, not a skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def golden_path() -> Path:
    return Path(os.environ.get("DFLASH_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = golden_path()
    if not (path / "drafter_config.json").is_file():
        pytest.fail(f"golden fixtures not found at {path}; set DFLASH_GOLDEN_DIR")
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def reset_deepspeed_groups() -> None:
    """After destroy_process_group in a test process: forget DeepSpeed's cached process groups,
    so the next in-process engine builds fresh ones (a stale one is 'not registered')."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and ("GROUP" in name or "MPU" in name):
            setattr(groups, name, {} if isinstance(value, dict) else None)
