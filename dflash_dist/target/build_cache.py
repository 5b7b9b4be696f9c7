"""The cache the project's built targets (tiny, code LM) live in, and the one way into it.

A target directory appears only complete: the build writes a temp directory beside it and
renames it, and an fcntl lock makes concurrent builders wait for the first one instead of
racing it. The directory's stamp (``dflash_target.json``, written last) is the build record;
its settings digest guards the cache, so a directory built with other settings is an error
rather than silently reused. `save_target` and `stamp_basics` are what every built target
directory holds beside its own record.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from data_pipeline.chat_data import template_hash
from data_pipeline.durable_files import open_own_file
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, IM_END

CACHE_ENV = "DFLASH_CACHE"
STAMP_NAME = "dflash_target.json"


def cache_root() -> Path:
    """``$DFLASH_CACHE``, else ``~/.cache/dflash-dist``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "dflash-dist"


def read_stamp(target_dir: str | os.PathLike) -> dict:
    """The build record of a cached target (settings, corpus hash, losses, timings)."""
    path = Path(target_dir) / STAMP_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable target stamp ({err})") from None


def write_stamp(out_dir: Path, stamp: dict) -> None:
    """The stamp, last and atomically: its presence marks the directory's contents complete."""
    tmp = out_dir / f".{STAMP_NAME}.tmp"
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    os.replace(tmp, out_dir / STAMP_NAME)


def is_cached(target_dir: Path, schema: int, digest: str, what: str) -> bool:
    """True if a finished build with this schema and settings digest is there; another is an error."""
    if not target_dir.exists():
        return False
    stamp = read_stamp(target_dir)
    if stamp.get("schema") != schema or stamp.get("settings_digest") != digest:
        raise ValueError(
            f"{target_dir} holds a {what} built with other settings (schema {stamp.get('schema')}); "
            "delete the directory or pass another cache_dir"
        )
    return True


def build_cached(
    target_dir: Path,
    schema: int,
    digest: str,
    what: str,
    build: Callable[[Path], None],
    log: Callable[[str], None],
    announce: str,
) -> Path:
    """`target_dir`, after running `build(tmp_dir)` under the lock unless a finished build is there."""
    if is_cached(target_dir, schema, digest, what):
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target_dir.parent / f".{target_dir.name}.lock"
    with os.fdopen(open_own_file(lock_path, os.O_RDWR | os.O_CREAT), "r+b") as lock:  # never through a link
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_cached(target_dir, schema, digest, what):  # another process built it while we waited
            return target_dir
        for stale in target_dir.parent.glob(f".{target_dir.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)  # a crashed build; we hold the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp", dir=target_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            log(f"building {what} in {target_dir} ({announce})")
            build(tmp)
            os.rename(tmp, target_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target_dir


def save_target(out_dir: Path, model, tokenizer: PreTrainedTokenizerFast) -> None:
    """Weights (safetensors), tokenizer, and a greedy generation config that stops at the turn end."""
    stop_ids = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=stop_ids[1], do_sample=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def stamp_basics(tokenizer: PreTrainedTokenizerFast) -> dict:
    """The stamp fields every built target has: its mask token, template hash and the versions that built it."""
    return {
        "mask_token_id": tokenizer.mask_token_id,
        "template_hash": template_hash(tokenizer),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
