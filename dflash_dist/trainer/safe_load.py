"""Checkpoint files are loaded as data, never as code.

DeepSpeed 0.19.8 reads its checkpoint files with `torch.load(..., weights_only=False)`, a full
unpickle: a file planted in a run directory on shared storage would run code on every trainer
that resumes. Its calls are spread over the engine, the ZeRO optimizers, the universal loader and
the `ds_to_universal` converter, all as `torch.load(...)`, so `weights_only_loads()` replaces
`torch.load` for the duration of one load (engine.load_checkpoint, universal.convert): every call
inside becomes `weights_only=True`, with torch's allow-list taught only the DeepSpeed types a
ZeRO-0/1/2/3 checkpoint of ours holds (found by saving them and asking
`torch.serialization.get_unsafe_globals_in_checkpoint`; `tests/test_safe_load.py` keeps the list
true). Our own client state is plain (dicts, lists, numbers, strings, tensors). A file the
restricted unpickler refuses, or cannot read at all (truncated), is an error naming the file.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dflash_dist.trainer.checkpoint import ResumeError


class UnsafeCheckpointError(ResumeError):
    """A checkpoint file holds something other than data (or is not a checkpoint file at all)."""


class DamagedCheckpointError(ResumeError):
    """A checkpoint file cannot be read (truncated or corrupt)."""


def deepspeed_safe_globals() -> list[Any]:
    """The non-torch types DeepSpeed writes into ZeRO checkpoints (optimizer states): the ZeRO
    stage enum, the loss scalers and the parameter-fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


_lock = threading.Lock()  # one patch at a time in a process


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Inside: every `torch.load` (whoever calls it) is a weights-only load with DeepSpeed's types
    allowed, and a refused or unreadable file raises an error naming it."""
    allowed = deepspeed_safe_globals()
    original = torch.load

    def load(f, map_location=None, *args, weights_only=None, **kwargs):  # noqa: ARG001 - always True below
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, map_location, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            # torch's message: a generic paragraph, then the one naming what was refused
            found = [p.strip() for p in str(e).split("\n\n") if re.search(r"GLOBAL|WeightsUnpickler error", p)]
            detail = found[0].removeprefix("WeightsUnpickler error: ") if found else f"{type(e).__name__}: {e}"
            raise UnsafeCheckpointError(
                f"{f}: refused to load: it holds something other than tensors and plain data ({detail}); "
                "checkpoints are loaded weights-only, so no code in them runs. The file was modified or is not "
                "from this project: resume from another checkpoint (--resume PATH) or start afresh"
            ) from e
        except (RuntimeError, EOFError, OSError, ValueError) as e:
            raise DamagedCheckpointError(
                f"{f}: cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}); the "
                "file is damaged (truncated?): resume from another checkpoint (--resume PATH) or start afresh"
            ) from e

    with _lock:
        torch.load = load
        torch.serialization.load = load
        try:
            yield
        finally:
            torch.load = original
            torch.serialization.load = original
