"""Checkpoint bookkeeping around DeepSpeed's own save/load: which tags are complete, `latest`
published only after every rank's files exist, pruning, the resume decision, what may change
across a resume, RNG state, and the run's step logs (truncated to the resumed step).

Why not DeepSpeed's `latest`: in 0.19.8, save_checkpoint(save_latest=True) has rank 0 open and
write `latest` (in place, not atomic) right after its *own* files and before the closing
barrier, so `latest` can name a tag another rank is still writing, or died writing. The
trainer saves with save_latest=False and then calls `commit`: every rank has fsynced the tag
directory and passed a barrier; rank 0 writes the completion marker `dflash_checkpoint.json`
(with the step, world size, config and data fingerprint, every file and its size), then
replaces `latest` (temp file + rename), and only then prunes old tags. A crash anywhere before
the rename leaves the previous tag as `latest`, and a tag without a valid marker is never
resumed from.

What may change across a resume (`RESUME_SAFE`): fields that do not change the training
trajectory (logging, checkpoint cadence, resources, how far to train) and fields that act only
through the shards (target, data, capture), which are checked through the shards instead:
their provenance against the target (the reader refuses others) and the data fingerprint (the
manifest the checkpoint saw must be a prefix of today's). Every other field (run.seed,
drafter.*, the optimizer, batch and loss settings) is training-relevant: a change is refused
naming the field. A new config field is training-relevant unless added here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline.durable_files import fsync_dir, write_text_atomic
from data_pipeline.shard_reader import read_manifest

MARKER = "dflash_checkpoint.json"
LATEST = "latest"
MARKER_VERSION = 1
TAG_RE = re.compile(r"step_(\d+)")
RESUME_MODES = ("auto", "never")  # or a checkpoint tag directory
ELASTIC_STAGES = (1, 2, 3)  # ZeRO stages resumable at another world size (universal.py)

RESUME_SAFE = (
    "run.name",
    "run.out_dir",
    "target.",
    "data.",
    "capture.",
    "eval.",
    "ray.",
    "train.epochs",
    "train.max_steps",  # the LR schedule's length is checked on its own (Trainer._resume)
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.log_sample_keys",
    "train.histogram_every",
    "train.cpus_per_rank",
    "train.max_restarts",  # how often a lost group is replaced (faults.py), not what it trains
)


class ResumeError(ValueError):
    """A run cannot start or resume as asked; the message says why and what to do."""


# ---------------------------------------------------------------------------- tags and markers
def tag_name(step: int) -> str:
    return f"step_{step}"


def tag_step(path: str | Path) -> int | None:
    m = TAG_RE.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def tag_dirs(ckpt_dir: Path) -> list[Path]:
    """Every `step_N` directory (complete or not), by step."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and tag_step(p) is not None]
    return sorted(found, key=tag_step)


def read_marker(tag_dir: Path) -> dict[str, Any] | None:
    """The tag's completion marker if the tag is complete (marker valid, every listed file
    present with its recorded size), else None (`marker_problem` says why)."""
    meta, _ = _check_marker(tag_dir)
    return meta


def marker_problem(tag_dir: Path) -> str | None:
    """Why `tag_dir` is not a complete checkpoint, naming the file at fault; None if it is."""
    return _check_marker(tag_dir)[1]


def _check_marker(tag_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        meta = json.loads((tag_dir / MARKER).read_text())
    except (OSError, ValueError) as e:
        return None, f"{tag_dir / MARKER} cannot be read ({e.strerror if isinstance(e, OSError) else e})"
    if not isinstance(meta, dict) or meta.get("version") != MARKER_VERSION:
        return None, f"{tag_dir / MARKER} is not a version-{MARKER_VERSION} completion marker"
    for name, size in meta.get("files", {}).items():
        try:
            actual = (tag_dir / name).stat().st_size
        except OSError as e:
            return None, f"{tag_dir / name} is listed in {MARKER} but cannot be read ({e.strerror})"
        if actual != size:
            return None, f"{tag_dir / name} has {actual} bytes, {MARKER} records {size} (truncated or replaced)"
    return meta, None


def complete_tags(ckpt_dir: Path) -> list[Path]:
    return [p for p in tag_dirs(ckpt_dir) if read_marker(p) is not None]


def read_latest(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def has_checkpoints(ckpt_dir: Path) -> bool:
    """A run lives here: `latest` or a complete tag (incomplete tags are crash leftovers)."""
    return read_latest(ckpt_dir) is not None or bool(complete_tags(ckpt_dir))


def fsync_tree(path: Path) -> None:
    """Flush every file under `path` (and the directories) to disk. Each rank calls it after
    DeepSpeed's save, so its own files are durable before rank 0 marks the tag complete."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def write_marker(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Mark `tag_dir` complete, listing its files and sizes as they are now."""
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*")) if p.is_file()}
    files.pop(MARKER, None)
    record = {"version": MARKER_VERSION, "tag": tag_dir.name, **meta, "files": files, "unix_time": time.time()}
    write_text_atomic(tag_dir / MARKER, json.dumps(record, sort_keys=True, indent=1) + "\n")


def publish_latest(ckpt_dir: Path, tag: str) -> None:
    """Point `latest` at `tag` by rename: a reader sees the old or the new name, never half."""
    write_text_atomic(ckpt_dir / LATEST, tag)


def prune(ckpt_dir: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` (>= 1) complete tags and whatever `latest` names; remove older
    complete tags and incomplete ones (crash leftovers). Call only after `latest` moved."""
    latest = read_latest(ckpt_dir)
    complete = complete_tags(ckpt_dir)
    kept = {p.name for p in complete[-max(1, keep) :]} | {latest}
    removed = [p for p in tag_dirs(ckpt_dir) if p.name not in kept]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def commit(ckpt_dir: Path, tag: str, meta: dict[str, Any], keep: int) -> None:
    """Rank 0, after every rank saved and fsynced `tag`: marker, then `latest`, then prune."""
    write_marker(ckpt_dir / tag, meta)
    publish_latest(ckpt_dir, tag)
    prune(ckpt_dir, keep)


def rewind(ckpt_dir: Path, resumed: Path) -> list[Path]:
    """Resuming from `resumed` inside `ckpt_dir`: tags after it belong to a discarded future (or
    are crash leftovers) and go; `latest` names the resumed tag (it already does for auto)."""
    if resumed.parent.resolve() != ckpt_dir.resolve():
        return []
    if read_latest(ckpt_dir) != resumed.name:
        publish_latest(ckpt_dir, resumed.name)
    step = tag_step(resumed)
    later = [p for p in tag_dirs(ckpt_dir) if tag_step(p) > step]
    for p in later:
        shutil.rmtree(p, ignore_errors=True)
    return later


# ---------------------------------------------------------------------------- the resume decision
def plan_resume(mode: str, ckpt_dir: Path) -> Path | None:
    """The tag directory to resume from, or None to start fresh (a pure decision over the disk).

    auto: the tag `latest` names; without `latest`, the newest complete tag (a crash between
    marker and `latest`); none: start fresh. never: start fresh, refusing a directory that
    already holds a run. PATH: that tag directory; into a directory holding another run only
    if PATH is one of its own tags (it branches from there).
    """
    if mode == "never":
        if has_checkpoints(ckpt_dir):
            raise ResumeError(
                f"{ckpt_dir} already has checkpoints (latest: {read_latest(ckpt_dir)}): pass --resume auto to "
                "continue that run, --resume PATH to start from one of its checkpoints, or use another --out"
            )
        return None
    if mode == "auto":
        latest = read_latest(ckpt_dir)
        if latest is None:
            complete = complete_tags(ckpt_dir)
            return complete[-1] if complete else None
        path = ckpt_dir / latest
        problem = marker_problem(path)
        if problem is not None:
            raise ResumeError(
                f"{ckpt_dir}/{LATEST} names {latest!r}, which is not a complete checkpoint: {problem}. Pass "
                "--resume PATH of a complete tag, or use another --out"
            )
        return path
    path = Path(mode)
    if not path.is_dir():
        raise ResumeError(
            f"--resume {mode}: no such checkpoint directory (expected auto, never or a tag directory "
            f"such as {ckpt_dir}/step_500)"
        )
    problem = marker_problem(path)
    if problem is not None:
        raise ResumeError(
            f"--resume {mode}: not a complete checkpoint ({problem}: a save that did not finish, or not a tag "
            f"directory); complete tags under {path.parent}: {[p.name for p in complete_tags(path.parent)]}"
        )
    if path.parent.resolve() != ckpt_dir.resolve() and has_checkpoints(ckpt_dir):
        raise ResumeError(
            f"--resume {mode}: {ckpt_dir} already holds another run's checkpoints: use another --out "
            "(or --resume auto to continue the run there)"
        )
    return path


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in RESUME_SAFE)


def config_hash(cfg_dict: dict) -> str:
    """Hash of the whole config (the marker's config_hash)."""
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest()[:16]


def training_config_hash(cfg_dict: dict) -> str:
    """Hash of the training-relevant fields (everything outside RESUME_SAFE)."""
    relevant = {k: v for k, v in _flatten(cfg_dict).items() if not _safe(k)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(training-relevant changes, harmless changes), each as 'path: old -> new'."""
    old, new = _flatten(saved), _flatten(current)
    strict, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<unset>") != new.get(key, "<unset>"):
            line = f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
            (harmless if _safe(key) else strict).append(line)
    return strict, harmless


def data_fingerprint(shard_dir: str | Path) -> dict[str, Any]:
    """The shards listed so far: how many and a hash of their names and sample keys."""
    records = read_manifest(shard_dir)
    return {"shards": len(records), "hash": _records_hash(records)}


def _records_hash(records) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.name, list(r.keys)]).encode())
    return h.hexdigest()[:16]


def check_resumable(
    saved: dict[str, Any], cfg_dict: dict, world_size: int, shard_dir: str | Path, where: str
) -> list[str]:
    """Refuse resuming a checkpoint (its marker or client state: config, world_size, data) under
    a changed training config or other shards, or at another world size unless its ZeRO stage
    is in ELASTIC_STAGES (an elastic resume through a universal checkpoint: universal.py);
    returns the harmless changes (a world-size change among them) for the caller to print."""
    strict, harmless = config_changes(saved["config"], cfg_dict)
    saved_world = saved.get("world_size")
    if saved_world != world_size:
        stage = saved["config"]["train"]["zero_stage"]
        if stage not in ELASTIC_STAGES:
            stages = ", ".join(str(s) for s in ELASTIC_STAGES)
            raise ResumeError(
                f"{where} was saved by {saved_world} ranks, this group has {world_size}: resuming at another world "
                f"size works for ZeRO stages {stages} (through DeepSpeed's universal checkpoint), this run uses "
                f"ZeRO-{stage}: resume with train.world_size={saved_world} or use another --out"
            )
        moved = [line for line in strict if line.startswith("train.world_size:")]
        strict = [line for line in strict if line not in moved]
        harmless = sorted(harmless + moved)
    if strict:
        raise ResumeError(
            f"{where}: training-relevant config changed since that checkpoint: {'; '.join(strict)}. Resume with "
            "the checkpoint's values (see its dflash_checkpoint.json) or start a fresh run in another --out"
        )
    data = saved["data"]
    records = read_manifest(shard_dir)
    if len(records) < data["shards"] or _records_hash(records[: data["shards"]]) != data["hash"]:
        raise ResumeError(
            f"{where} trained on {data['shards']} shard(s) that {shard_dir}/manifest.jsonl does not start with "
            f"(it lists {len(records)}): resume on the same shards or start a fresh run"
        )
    return harmless


# ---------------------------------------------------------------------------- RNG
def rng_state(on_gpu: bool) -> dict[str, Any]:
    """This process's RNG states (torch CPU and current CUDA device, Python, NumPy), as plain
    data (tensors, tuples, lists, numbers): a checkpoint loads weights-only (safe_load.py)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if on_gpu else None,
        "python": random.getstate(),
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }


def rank_seed(base_seed: int, rank: int, step: int) -> int:
    """A 32-bit seed derived from (base_seed, rank, step), for a rank with no saved RNG state."""
    return int.from_bytes(hashlib.sha256(f"{base_seed}:{rank}:{step}".encode()).digest()[:4], "little")


def seeded_rng_state(seed: int, on_gpu: bool) -> dict[str, Any]:
    """The RNG states (as rng_state) every generator has right after seeding it with `seed`."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed)
    return rng_state(on_gpu)


def load_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------- step logs
def truncate_step_log(path: Path, last_step: int) -> int:
    """Keep the lines of a `{"step": ...}` JSONL log up to `last_step` (a torn last line from a
    kill is dropped), so after a resume the file is the run's true history. Returns lines kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a torn line written when the process was killed
        if step <= last_step and line.endswith("\n"):
            kept.append(line)
    write_text_atomic(path, "".join(kept))
    return len(kept)
