"""What a resume from an earlier checkpoint leaves behind besides its later tags: the discarded
future's exports and the evaluator's results of them, moved aside (never deleted) so nothing
measured is lost and nothing later trusts them.

Resuming from `step_N` while exports or results of steps M > N exist (`--resume <out>/checkpoints/
step_N`, or `--resume auto` after such a resume was killed midway) branches the run: the trainer
writes `export/step_M` again, with other weights after an elastic resume or a permitted config
change. Left in place, `eval/step_M.json` would mark the new export as measured (the evaluator
skips it), the run summary and `dflash-dist status` would report the old tau, and `dflash-dist
export` could pick the old weights. So `checkpoint.rewind` (rank 0, after `latest` names the
resumed tag and before the later tags are removed) moves

  eval/step_M.json, eval/rounds/step_M.json, export/step_M     (M > N)

into `<out>/discarded/<UTC time>-after-step_N/` under the same relative names, with `discarded.json`
saying what was moved, from which resume and why, and logs a warning naming them. Moving, not
deleting: the old future's exports and tau are real measurements a user may want to compare
(STYLE: data that cannot be used is reported, never silently dropped); a rename within `<out>`
costs nothing. The evaluator's results go first (the claims that a step was measured), then the
exports, then the results again (one of an old export may have been written meanwhile: the evaluator
checks its export after writing a result, so one written later it moves aside itself). A kill
midway leaves `latest` naming step_N already, so the next `--resume auto` resumes from N and moves
the rest (into a directory of its own). TensorBoard's eval points at steps > N
stay in tb/eval until the evaluator next opens its writer, which purges the points after its
newest remaining result (evaluator.py).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from data_pipeline.durable_files import fsync_dir, write_text_atomic

log = logging.getLogger(__name__)

DISCARDED = "discarded"  # under <out>
RECORD = "discarded.json"
_EXPORT_RE = re.compile(r"step_(\d+)")
_RESULT_RE = re.compile(r"step_(\d+)\.json")


def future_of(out: Path, step: int) -> list[Path]:
    """Paths under `out` that belong to steps after `step`: the evaluator's results (eval/step_M.json,
    then eval/rounds/step_M.json) and the exports (export/step_M), in the order they are moved."""
    found: list[Path] = []
    for sub, pattern in (("eval", _RESULT_RE), ("eval/rounds", _RESULT_RE), ("export", _EXPORT_RE)):
        d = out / sub
        if not d.is_dir():
            continue
        later = []
        for p in d.iterdir():
            m = pattern.fullmatch(p.name)
            if m and int(m.group(1)) > step:
                later.append((int(m.group(1)), p))
        found += [p for _, p in sorted(later)]
    return found


def move_aside(out: Path, paths: list[Path], why: str, label: str) -> Path | None:
    """Move `paths` (all under `out`) into a fresh `<out>/discarded/<UTC time>-<label>/` under their
    relative names, write its `discarded.json` (what, why) and log a warning; None if `paths` is empty."""
    if not paths:
        return None
    root = out / DISCARDED
    if root.is_symlink():  # planted: what is moved would leave the run directory through it
        raise ValueError(
            f"{root} is a symbolic link to {root.resolve()}: the run's exports and results are moved only within "
            f"{out}; remove the link (and move back what it points to, if yours)"
        )
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):  # two discards in one second get their own directories
        dest = root / f"{stamp}-{label}{f'-{n}' if n else ''}"
        try:
            dest.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{root}: no free name for {stamp}-{label}: remove old discarded directories")
    moved = []
    for p in paths:
        rel = p.relative_to(out)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.move(str(p), str(dest / rel))  # a rename within <out>; a link moves as the link
        except FileNotFoundError:
            continue  # gone meanwhile (an evaluator moving a result it found stale): nothing to keep
        fsync_dir(p.parent)
        moved.append(str(rel))
    record = {"why": why, "moved": moved, "unix_time": time.time()}
    write_text_atomic(dest / RECORD, json.dumps(record, indent=1) + "\n")
    log.warning("%s: moved %s into %s (kept, not used by this run)", why, ", ".join(moved) or "nothing", dest)
    return dest


def discard_after(out: Path, step: int, resumed: str) -> Path | None:
    """Rank 0 on a resume from the tag `resumed` (step `step`): move the discarded future's results
    and exports aside (see the module docstring). The directory they went to, or None if none existed."""
    why = (f"resumed from {resumed} (step {step}): the exports and evaluation results of steps after it belong to "
           "the discarded future this run trains again; their tau is not this run's")  # fmt: skip
    dest = move_aside(out, future_of(out, step), why, f"after-step_{step}")
    # A result the evaluator wrote after the listing above, of an export moved since: listed again now
    # that those exports are gone (the evaluator moves one it writes later itself: evaluator.py).
    again = [p for p in future_of(out, step) if p.parts[-2] != "export"]
    return move_aside(out, again, why + " (written while they were moved)", f"after-step_{step}") or dest
