"""The capture ledger: which sample keys a shard directory already holds, so a restarted capture
redoes exactly the rest (no sample lost, none twice).

It is derived, not kept beside the data: the keys of every complete shard come from
manifest.jsonl, whose line is appended under the same lock as the shard's rename (a shard is
listed if and only if it is complete), plus skipped.jsonl, the keys settled without a shard,
each with its reason: captured but not written because their features held NaN/Inf
(`nonfinite_features`), or never captured because the target's regenerated response was empty
(`empty_response`: its only supervised token would be the stop token); redoing either would give
the same verdict. Both are lost samples: data.max_lost_fraction holds them (capture_loss_problem).
`capture_data.json` (CaptureData) says which conversations the keys belong to: a capture that
resumes must read the same ones (the same source, data.max_train_samples and content hash), or
it is refused naming what changed.
Leftovers of a killed writer (`.tmp-*.tar`, or a renamed shard whose manifest line never came)
are never listed, so their samples are redone; `remove_stale_tmp` deletes both, so they neither
stay on disk for the run nor count against the shard tree's cap (disk_budget.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from data_pipeline.durable_files import append_lines, fsync_dir, write_text_atomic
from data_pipeline.records import DONE_NAME, EMPTY_RESPONSE, MANIFEST_NAME, SHARD_NAME_RE, SKIPPED_NAME, TMP_PREFIX
from data_pipeline.shard_reader import NONFINITE, read_manifest
from data_pipeline.shard_writer import manifest_lock

DATA_NAME = "capture_data.json"


class DataChanged(ValueError):
    """A capture would resume over keys captured from other conversations; the message says what changed."""


@dataclass(frozen=True)
class CaptureData:
    """The conversations a shard directory's keys come from."""

    source: str | None  # data.train_path (None: the tiny target's generated conversations)
    max_train_samples: int | None
    records: int
    content_sha256: str  # ingest.content_hash of the records' keys

    def changes_from(self, before: CaptureData) -> list[str]:
        what = {"source": "data.train_path", "max_train_samples": "data.max_train_samples", "records": "records"}
        out = [f"{what[k]} was {getattr(before, k)!r}, now {getattr(self, k)!r}" for k in what
               if getattr(before, k) != getattr(self, k)]
        if self.content_sha256 != before.content_sha256:
            was, now = before.content_sha256[:12], self.content_sha256[:12]
            out.append(f"the conversations' content hash was {was}, now {now} (the data file changed)")
        return out


def check_capture_data(shard_dir: str | os.PathLike[str], now: CaptureData) -> None:
    """Record `now` as the directory's data, or check that an earlier capture there read the same
    (DataChanged otherwise). Call before writing any shard."""
    path = Path(shard_dir) / DATA_NAME
    if not path.exists():
        if captured_keys(shard_dir):
            raise DataChanged(f"{shard_dir} holds captured samples but no {DATA_NAME} (an older capture): its keys "
                              "cannot be matched to the data; capture into another --out")
        Path(shard_dir).mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(asdict(now), sort_keys=True, indent=1) + "\n")
        return
    try:
        before = CaptureData(**json.loads(path.read_text()))
    except (TypeError, json.JSONDecodeError) as e:
        raise DataChanged(f"{path}: not a capture data record ({e}); capture into another --out") from None
    changes = now.changes_from(before)
    if changes:
        raise DataChanged(
            f"{shard_dir} was captured from other data: {'; '.join(changes)}. A resumed capture must read the same "
            "conversations: restore those settings (and the file), or capture into another --out"
        )


def read_skipped(shard_dir: str | os.PathLike[str]) -> list[dict]:
    """skipped.jsonl's records, up to its last newline (a line being appended is not read)."""
    path = Path(shard_dir) / SKIPPED_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records = []
    fix = (
        "the capture appends whole lines only, so this one was damaged or edited: restore the file from a copy, "
        'or repair that line to {"actor": <int>, "key": "<sample key>", "reason": "<why>"} (deleting it drops '
        "its sample from the lost-sample count data.max_lost_fraction holds), then run again"
    )
    for i, raw in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), 1):
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e}); {fix}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
            raise ValueError(f"{path}:{i}: expected an object with a string 'key', got {raw[:80]!r}; {fix}")
        records.append(rec)
    return records


def record_skipped(shard_dir: str | os.PathLike[str], key: str, reason: str, actor: int) -> None:
    """Durably note that `key` was captured and deliberately not written."""
    line = json.dumps({"key": key, "reason": reason, "actor": actor}, sort_keys=True) + "\n"
    with manifest_lock(shard_dir):
        append_lines(Path(shard_dir) / SKIPPED_NAME, line.encode())


def captured_keys(shard_dir: str | os.PathLike[str]) -> set[str]:
    """Every key already settled in `shard_dir`: written to a complete shard, or skipped."""
    keys = {k for record in read_manifest(shard_dir) for k in record.keys}
    keys.update(rec["key"] for rec in read_skipped(shard_dir))
    return keys


# skipped.jsonl's reasons: what happened to such a sample, and where to look
_WHY = {
    NONFINITE: ("had non-finite features", "check the target's dtype and kernels"),
    EMPTY_RESPONSE: ("got an empty regenerated response", "check the target's chat template and stop tokens "
                     "(the generation prompt) and capture.max_new_tokens"),
}  # fmt: skip


def skipped_text(skipped: list[dict], note: str = "") -> str:
    """`N skipped`, and when any, the count per reason and `note` in parentheses: the capture's
    summary and log lines (`2 skipped (empty_response 1, nonfinite_features 1; see ...)`)."""
    if not skipped:
        return "0 skipped"
    reasons = Counter(str(r.get("reason")) for r in skipped)
    counts = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items()))
    return f"{len(skipped)} skipped ({counts}{f'; {note}' if note else ''})"


def capture_loss_problem(shard_dir: str | os.PathLike[str], max_lost_fraction: float) -> str | None:
    """Why the capture of `shard_dir` lost more samples than `max_lost_fraction` allows (the keys
    skipped.jsonl records as not written, non-finite or with an empty regenerated response,
    against every settled sample), naming the file, the reasons and the setting; None when within
    it. Every path that finishes a capture (the pipeline's, each Slurm array slice that marks DONE)
    and the run plan of every training over a finished capture ask it: a run that lost data beyond
    the setting must not end with exit 0. A ledger that does not account for every conversation
    the capture was given (`unlisted_problem`) is refused first."""
    shard_dir = Path(shard_dir)
    given = _records_given(shard_dir)
    listed = None if given is None else _listed(shard_dir)  # read in this order as before: the same first error
    skipped = read_skipped(shard_dir)  # once, for both checks
    if given is not None:  # then listed was read too
        unlisted = _unlisted(shard_dir, given, listed, len(skipped))
        if unlisted is not None:
            return unlisted
    if not skipped:
        return None
    captured = _listed(shard_dir) if listed is None else listed
    allowed = math.floor(max_lost_fraction * (captured + len(skipped)))
    if len(skipped) <= allowed:
        return None
    keys = ", ".join(str(r.get("key")) for r in skipped[:5])
    reasons = sorted(Counter(str(r.get("reason")) for r in skipped).items())
    whys = [(n, *_WHY.get(reason, (f"had reason {reason!r}", "restore or re-extract the capture")))
            for reason, n in reasons]  # fmt: skip
    what = (f"{whys[0][1]} and were not written" if len(whys) == 1 else
            "were not written: " + ", ".join(f"{n} {why}" for n, why, _ in whys))  # fmt: skip
    fixes = "; ".join(fix for _, _, fix in whys)
    return (f"capture: {len(skipped)} of {captured + len(skipped)} sample(s) {what} (first: {keys}; see "
            f"{shard_dir / SKIPPED_NAME}), more than data.max_lost_fraction={max_lost_fraction} allows "
            f"({allowed}): {fixes}, or raise data.max_lost_fraction")


def unlisted_problem(shard_dir: str | os.PathLike[str]) -> str | None:
    """Why a finished capture's ledger does not account for every conversation it was given
    (capture_data.json's `records`): samples in no manifest line and not in skipped.jsonl, i.e. a
    line of either torn (no newline: readers stop before it) or deleted after the capture. Such
    samples are neither trained nor counted lost, so a run over them ended 'done' with exit 0;
    this is an error, whatever data.max_lost_fraction says (the ledger itself is damaged). None when
    complete, or when no capture_data.json says how many there were."""
    shard_dir = Path(shard_dir)
    given = _records_given(shard_dir)
    if given is None:
        return None
    return _unlisted(shard_dir, given, _listed(shard_dir), len(read_skipped(shard_dir)))


def _records_given(shard_dir: Path) -> int | None:
    """The conversations capture_data.json says the capture was given; None without one (an older
    capture, which check_capture_data refuses to resume, or no capture yet)."""
    try:
        return int(json.loads((shard_dir / DATA_NAME).read_text())["records"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def _listed(shard_dir: Path) -> int:
    """Samples in the manifest's complete shards."""
    return sum(r.n_samples for r in read_manifest(shard_dir))


def _unlisted(shard_dir: Path, given: int, listed: int, skipped: int) -> str | None:
    """unlisted_problem over what its caller read: `given` conversations, `listed` samples in the
    manifest, `skipped` lines in skipped.jsonl."""
    settled = listed + skipped
    if settled >= given:
        return None
    manifest = shard_dir / MANIFEST_NAME
    torn = [f"{name}'s last line is torn ({tail} bytes without a newline)"
            for name in (MANIFEST_NAME, SKIPPED_NAME) if (tail := _torn_tail(shard_dir / name))]  # fmt: skip
    why = "; ".join(torn) or "a line was deleted, or a shard's line never written"
    return (
        f"{manifest}: the finished capture was given {given} conversations ({shard_dir / DATA_NAME}) but lists "
        f"{listed} samples, plus {settled - listed} in {SKIPPED_NAME}: {given - settled} sample(s) are in neither "
        f"file ({why}), so no run would train them or count them lost. Remove {shard_dir / DONE_NAME} and continue "
        "the capture with --resume auto (dflash-dist run or extract): a torn last line is cut, an unlisted shard "
        "removed, and exactly the missing samples captured again"
    )


def _torn_tail(path: Path) -> int:
    """Bytes after the last newline of a line log (0: none, or no file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return len(data) - (data.rfind(b"\n") + 1)


def duplicate_keys(shard_dir: str | os.PathLike[str]) -> list[str]:
    """Keys listed more than once across complete shards and skipped.jsonl (should be none)."""
    counts = Counter(k for record in read_manifest(shard_dir) for k in record.keys)
    counts.update(rec["key"] for rec in read_skipped(shard_dir))
    return sorted(k for k, n in counts.items() if n > 1)


def remove_stale_tmp(shard_dir: str | os.PathLike[str], prefix: str | None = None) -> list[str]:
    """Delete what writers that died left of their shards (this prefix's; every prefix when None):
    unfinished `.tmp-<prefix>-*.tar` files, and `<prefix>-NNNNNN.tar` files the manifest does not
    list (a writer killed between its rename and its manifest line: its samples are redone under
    another name, so the file would stay on disk for the whole run, never released). "This
    prefix's" takes in its sub-prefixes `<prefix>-<sub>` alike: a target actor's writer processes
    write as `<prefix>-w<N>` (capture/host_sink.py) and are killed on abort. Call only when
    no live writer uses that prefix (an actor for its own prefix at start: Ray restarts an actor
    only after the old one died); the unlisted ones are safe to delete even then, since rename and
    listing happen under the lock held here."""
    return remove_unlisted_tars(shard_dir, lambda: {r.name for r in read_manifest(shard_dir)}, prefix)


def remove_unlisted_tars(directory: str | os.PathLike[str], listed: Callable[[], set[str]],
                         prefix: str | None) -> list[str]:
    """Delete the `.tmp-<prefix>-*.tar` files and the `<prefix>-NNNNNN.tar` files that `listed()`
    (the directory's manifest, read under the manifest lock) does not name: see remove_stale_tmp;
    the token store's tars follow the same rule. Returns their names."""
    start = f"{TMP_PREFIX}{prefix}-" if prefix is not None else TMP_PREFIX
    # the prefix's own shards and its sub-prefixes' (`<prefix>-<sub>-NNNNNN.tar`), as `start` takes their .tmp- files
    named = SHARD_NAME_RE if prefix is None else re.compile(re.escape(prefix) + r"-(?:[A-Za-z0-9_.-]*-)?[0-9]{6,}\.tar")
    removed = []
    with manifest_lock(directory):
        names = listed()
        for path in Path(directory).glob("*.tar"):
            stale = path.name.startswith(start) if path.name.startswith(TMP_PREFIX) else (
                path.name not in names and named.fullmatch(path.name) is not None)
            if stale:
                path.unlink(missing_ok=True)
                removed.append(path.name)
    if removed:
        fsync_dir(directory)
    return sorted(removed)
