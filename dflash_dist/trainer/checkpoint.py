"""Checkpoint bookkeeping around DeepSpeed's own save/load: which tags are complete, `latest`
published only after every rank's files exist, pruning, the choice of tag to resume from
(`plan_resume`; the checks around it are resume.py's), the data fingerprint, RNG state, and the
run's step logs (truncated to the resumed step).

Why not DeepSpeed's `latest`: in 0.19.8, save_checkpoint(save_latest=True) has rank 0 open and
write `latest` (in place, not atomic) right after its *own* files and before the closing
barrier, so `latest` can name a tag another rank is still writing, or died writing. The
trainer saves with save_latest=False and then calls `commit`: every rank has fsynced the tag
directory and passed a barrier; rank 0 writes the completion marker `dflash_checkpoint.json`
(with the step, world size, config, LR schedule, state version and data fingerprint, every file
with its size and XXH3 checksum, verified before a resume loads it: `verify_checksums`), then
replaces `latest` (temp file + rename), and only then prunes old tags. A crash anywhere before
the rename leaves the previous tag as `latest`, and a tag without a valid marker is never
resumed from.
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

from data_pipeline.checksums import file_checksums, mismatched_files, regular_file
from data_pipeline.durable_files import fsync_dir, write_text_atomic
from data_pipeline.shard_reader import read_manifest
from dflash_dist.trainer import discard

MARKER = "dflash_checkpoint.json"
LATEST = "latest"
MARKER_VERSION = 1
TAG_RE = re.compile(r"step_(\d+)")
RESUME_MODES = ("auto", "never")  # or a checkpoint tag directory
ELASTIC_STAGES = (1, 2, 3)  # ZeRO stages resumable at another world size (universal.py)


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
    files = meta.get("files", {})
    if not isinstance(files, dict):
        return None, f"{tag_dir / MARKER}: `files` is not a mapping of file names to sizes"
    for name, size in files.items():
        try:
            actual = regular_file(tag_dir, name, str(tag_dir / MARKER)).st_size
        except ValueError as e:
            return None, str(e)
        except OSError as e:
            return None, f"{tag_dir / name} is listed in {MARKER} but cannot be read ({e.strerror})"
        if actual != size:
            return None, f"{tag_dir / name} has {actual} bytes, {MARKER} records {size} (truncated or replaced)"
    return meta, None


def verify_checksums(
    tag_dir: Path, meta: dict[str, Any], rank: int = 0, world_size: int = 1, group: Any = None
) -> None:
    """Before a resume loads `tag_dir`: every file its marker (`meta`) lists is hashed again and
    compared with the checksum recorded at save time. Each rank hashes every world_size-th file,
    so the tag is read once in all; every rank then raises the same ResumeError naming each
    damaged file (call it on every rank of the group, or with world_size 1 alone)."""
    checksums = meta.get("checksums")
    if not isinstance(checksums, dict) or set(checksums.get("files", {})) != set(meta.get("files", {})):
        raise ResumeError(
            f"{tag_dir}/{MARKER} records no checksum for some of its files (saved by an older version?): the files "
            "cannot be verified before loading; resume from a checkpoint this version saved, or start a fresh run"
        )
    names = sorted(checksums["files"])
    bad = set(mismatched_files(tag_dir, checksums, names[rank::world_size]))
    extra = unlisted_files(tag_dir, names)
    if world_size > 1:
        import torch.distributed as dist

        flags = torch.tensor([int(name in bad) for name in names] + [int(bool(extra))], dtype=torch.int32)
        dist.all_reduce(flags, group=group)
        bad = {name for name, flag in zip(names, flags.tolist()) if flag}
        extra = extra or (["(seen by another rank)"] if flags[-1] else [])
    if extra:
        raise ResumeError(
            f"{tag_dir} holds {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}, which {MARKER} does not list: "
            "DeepSpeed's loaders glob the tag directory (ZeRO-3 consolidation, the universal conversion), so an "
            "unlisted file would be read with no checksum compared; the save wrote no such file: remove it (or move "
            "it out of the tag), or resume from another tag"
        )
    if bad:
        raise ResumeError(
            f"{tag_dir}: {', '.join(sorted(bad))} differ(s) from the {checksums['algorithm']} checksum recorded in "
            f"{MARKER} at save time: the checkpoint was damaged since; resume from another tag (--resume PATH, e.g. "
            f"an earlier one of {[p.name for p in complete_tags(tag_dir.parent)]}) or start a fresh run"
        )


# kept in a tag beside its listed files: the marker; universal.py's converted copy (a directory with its
# own checksummed record), a crashed conversion's temporary directory and the converter's `latest_universal`
_UNLISTED_FILES = (MARKER, "latest_universal")


def _universal_dir(name: str) -> bool:
    return name == "universal" or name.startswith(".universal.tmp-")


def unlisted_files(tag_dir: Path, listed: list[str], tag: bool = True) -> list[str]:
    """Entries of `tag_dir` (any depth; links and devices too, no link followed) that its marker does
    not list and universal.py did not make, sorted: DeepSpeed's globbing loaders would read them unverified.
    `tag` False: a directory whose record lists everything in it (universal.py's converted copy)."""
    found = []
    for root, dirs, files in os.walk(tag_dir):
        rel = Path(root).relative_to(tag_dir)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # os.walk lists them, never enters
        if rel == Path("."):
            dirs[:] = [d for d in dirs if d not in links and not (tag and _universal_dir(d))]
        found += [str(rel / name) for name in (*files, *links)]
    own = set(listed) | (set(_UNLISTED_FILES) if tag else set())
    return sorted(n for n in found if n not in own)


def complete_tags(ckpt_dir: Path) -> list[Path]:
    return [p for p in tag_dirs(ckpt_dir) if read_marker(p) is not None]


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag `latest` names: a `step_N` directory name (ResumeError for anything else, which
    would have a resume load a directory outside ckpt_dir)."""
    try:
        name = (ckpt_dir / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None
    if name is not None and not TAG_RE.fullmatch(name):
        raise ResumeError(
            f"{ckpt_dir / LATEST} names {name[:80]!r}, not a tag of this directory (step_N): it is "
            "written only by the trainer; delete it to resume from the newest complete tag"
        )
    return name


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
    """Mark `tag_dir` complete, listing its files with their sizes and checksums as they are now
    (rank 0 reads the tag once for the checksums: XXH3 runs at memory speed, so this costs the read)."""
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*")) if p.is_file()}
    files.pop(MARKER, None)
    record = {"version": MARKER_VERSION, "tag": tag_dir.name, **meta, "files": files,
              "checksums": file_checksums(tag_dir, files), "unix_time": time.time()}  # fmt: skip
    write_text_atomic(tag_dir / MARKER, json.dumps(record, sort_keys=True, indent=1) + "\n")


def clear_tag(ckpt_dir: Path, tag: str) -> None:
    """Before `tag` is saved: whatever holds its name goes, a crashed save's directory or a symbolic
    link, which is removed, never followed (DeepSpeed would write the tag's files into the directory
    it points to, outside ckpt_dir, and rmtree refuses a link without a word under ignore_errors)."""
    path = ckpt_dir / tag
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


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


def rewind(ckpt_dir: Path, resumed: Path, out: Path | None = None) -> list[Path]:
    """Resuming from `resumed` inside `ckpt_dir`: tags after it belong to a discarded future (or
    are crash leftovers) and go; `latest` names the resumed tag (it already does for auto). `out`
    (the run directory): that future's exports and evaluation results are moved aside first
    (discard.py), after `latest` moved, so a kill anywhere leaves a state the next `--resume auto`
    finishes from the same tag."""
    if resumed.parent.resolve() != ckpt_dir.resolve():
        return []
    if read_latest(ckpt_dir) != resumed.name:
        publish_latest(ckpt_dir, resumed.name)
    step = tag_step(resumed)
    if out is not None:
        discard.discard_after(out, step, resumed.name)
    later = [p for p in tag_dirs(ckpt_dir) if tag_step(p) > step]
    for p in later:
        shutil.rmtree(p, ignore_errors=True)
    return later


# ---------------------------------------------------------------------------- the resume decision
def plan_resume(mode: str, ckpt_dir: Path) -> Path | None:
    """The tag directory to resume from, or None to start fresh (a pure decision over the disk).

    auto: the tag `latest` names; without `latest`, the newest complete tag (a crash between
    marker and `latest`); with no complete tag either: start fresh. never: start fresh, refusing a directory that
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


def config_hash(cfg_dict: dict) -> str:
    """Hash of the whole config (the marker's config_hash)."""
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest()[:16]


def data_fingerprint(shard_dir: str | Path) -> dict[str, Any]:
    """The shards listed so far: how many and a hash of their names and sample keys."""
    records = read_manifest(shard_dir)
    return {"shards": len(records), "hash": _records_hash(records)}


def _records_hash(records) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.name, list(r.keys)]).encode())
    return h.hexdigest()[:16]


def data_fingerprint_matches(saved: dict[str, Any], shard_dir: str | Path) -> bool:
    """Whether the manifest under `shard_dir` starts with the shards a checkpoint trained on."""
    records = read_manifest(shard_dir)
    return len(records) >= saved["shards"] and _records_hash(records[: saved["shards"]]) == saved["hash"]


# ---------------------------------------------------------------------------- RNG
def rng_state(on_gpu: bool) -> dict[str, Any]:
    """This process's RNG states (torch CPU and current CUDA device, Python, NumPy) as JSON data
    (lists of ints, numbers, str, None): they travel between ranks as JSON (collectives.py) and a
    checkpoint loads weights-only (safe_load.py). The torch states are their bytes."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": torch.cuda.get_rng_state().tolist() if on_gpu else None,
        "python": [version, list(internal), gauss_next],
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
    """Set the states `rng_state` returned (or, saved by earlier versions, the torch states as
    uint8 tensors and Python's as tuples)."""
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state(torch.as_tensor(state["cuda"], dtype=torch.uint8))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
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
