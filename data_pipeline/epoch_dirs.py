"""Where each epoch's shards live, and when an epoch's capture is complete.

Under `capture.later_epochs: keep` (and for epoch 0 always) the shards are in `<out>/shards/`, as
they always were. Under recapture, epoch e >= 1 lives in `<out>/shards/epoch_<e>/`: a shard
directory like the first (manifest, DONE, skipped.jsonl, capture_data.json, released.json), so
the same ledger, reader and disk-budget code serve every epoch. `<out>/shards/sequences/` holds
the token store (token_store.py): the conversations epoch 0 fixed, as tokens.

An epoch directory is complete (DONE) when every capture actor finished its slice of that epoch:
each actor leaves `slices/<I>-of-<N>.json` in the epoch's directory, then looks at the others;
whoever completes the set checks no key was captured twice and marks the directory DONE (each
writes its own marker before looking, so the last one to finish always sees all of them).

`later_epochs.json` records which way the run's later epochs go, written by the run plan before
any actor starts: the layout is a property of the shard tree, so a resumed run keeps it.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from data_pipeline.durable_files import write_text_atomic
from data_pipeline.ledger import duplicate_keys
from data_pipeline.records import DONE_NAME, MANIFEST_NAME
from data_pipeline.shard_writer import mark_done

KEEP, RECAPTURE = "keep", "recapture"
EPOCH_PREFIX = "epoch_"
SEQUENCES_DIR = "sequences"
SLICES_DIR = "slices"
MODE_NAME = "later_epochs.json"
_EPOCH_RE = re.compile(r"epoch_([1-9][0-9]{0,5})")


def epoch_dir(root: str | os.PathLike[str], epoch: int, recapture: bool) -> Path:
    """The directory holding `epoch`'s shards: the root for epoch 0 and under keep."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return Path(root) if epoch == 0 or not recapture else Path(root) / f"{EPOCH_PREFIX}{epoch}"


def sequences_dir(root: str | os.PathLike[str]) -> Path:
    return Path(root) / SEQUENCES_DIR


def epoch_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(epoch, directory) of every epoch directory present under `root`, epoch 0 (the root) first."""
    root = Path(root)
    found = [(0, root)]
    if root.is_dir():
        for p in root.iterdir():
            m = _EPOCH_RE.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def slice_marker(shard_dir: str | os.PathLike[str], index: int, count: int) -> Path:
    return Path(shard_dir) / SLICES_DIR / f"{index:04d}-of-{count:04d}.json"


def slice_finished(shard_dir: str | os.PathLike[str], index: int, count: int) -> bool:
    return slice_marker(shard_dir, index, count).is_file()


def finish_slice(shard_dir: str | os.PathLike[str], index: int, count: int, result: dict) -> bool:
    """Record that slice `index` of `count` finished this directory's capture; mark the directory
    DONE if that completes the set (True then, or when it already was). Raises ValueError if a key
    was captured twice (the directory is then not usable)."""
    shard_dir = Path(shard_dir)
    marker = slice_marker(shard_dir, index, count)
    marker.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(marker, json.dumps(result, sort_keys=True) + "\n")
    if (shard_dir / DONE_NAME).exists():
        return True
    if not all(slice_finished(shard_dir, i, count) for i in range(count)):
        return False
    twice = duplicate_keys(shard_dir)
    if twice:
        raise ValueError(
            f"{shard_dir}: samples captured twice ({twice[:5]}...): the shards are not usable; "
            "re-extract into another --out"
        )
    mark_done(shard_dir)
    return True


def wait_done(shard_dir: str | os.PathLike[str], poll_s: float = 0.5) -> float:
    """Wait until the directory is DONE (every actor finished its slice); returns the seconds waited."""
    t0 = time.monotonic()
    while not (Path(shard_dir) / DONE_NAME).exists():
        time.sleep(poll_s)
    return time.monotonic() - t0


def read_mode(root: str | os.PathLike[str]) -> str | None:
    """The recorded way of this shard tree's later epochs; keep for a capture made before the record
    existed (shards, no record); None when nothing was captured there yet."""
    root = Path(root)
    path = root / MODE_NAME
    if not path.is_file():
        return KEEP if (root / MANIFEST_NAME).exists() else None
    try:
        mode = json.loads(path.read_text())["later_epochs"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a later-epochs record ({e}); it is written by the run plan") from None
    if mode not in (KEEP, RECAPTURE):
        raise ValueError(f"{path}: later_epochs {mode!r} is not one of {KEEP}, {RECAPTURE}")
    return mode


def write_mode(root: str | os.PathLike[str], mode: str) -> None:
    assert mode in (KEEP, RECAPTURE), mode
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(root / MODE_NAME, json.dumps({"later_epochs": mode}) + "\n")
