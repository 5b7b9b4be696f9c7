"""Conversation sources (JSONL, Parquet, an HF `datasets` directory from `save_to_disk`) read
into validated records under one bad-input policy, normalized to a ``messages`` JSONL.

Every bad record either stops ingestion with an error naming the file and line (or row), the
field and the fix (``on_bad_record="error"``), or is skipped and counted under its reason
(``"skip"``); over-long sequences are truncated, skipped or refused (``on_overlong``) and
counted too. Nothing is dropped silently, and the normalized file and its counts are written
atomically only after the whole source has been read, so an error leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.chat_data import FORMATS, INGESTED_FROM, BadRecord, ChatRecord, parse_record
from data_pipeline.durable_files import atomic_writer, write_text_atomic
from dflash_dist.logging_setup import progress

ON_BAD_RECORD = ("error", "skip")
ON_OVERLONG = ("truncate", "skip", "error")
SOURCE_KINDS = ("jsonl", "parquet", "hf_disk")
PARQUET_BATCH_ROWS = 1024
KEY_SCHEME = "s-<sha256 of the messages (JSON), 16 hex>; -N for the N-th repeat"

# (sequence length, tokens before the first trained token) of a record, as capture will see it.
Measure = Callable[[ChatRecord], tuple[int, int]]


class DataError(ValueError):
    """Bad input data under on_bad_record="error" (or an unreadable source): the message names the
    file, line or row, field, and what to do."""


@dataclass(frozen=True)
class IngestPolicy:
    fmt: str = "auto"  # auto (per record) | messages | sharegpt
    on_bad_record: str = "error"
    on_overlong: str = "truncate"
    max_length: int | None = None  # tokens; None: no length check
    max_records: int | None = None  # stop after this many kept records

    def __post_init__(self) -> None:
        assert self.fmt in FORMATS and self.on_bad_record in ON_BAD_RECORD and self.on_overlong in ON_OVERLONG


@dataclass
class IngestReport:
    """What happened to every record read: kept, truncated, or skipped (per reason, first example)."""

    source: str
    kind: str
    read: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0  # of the kept records as capture will see them, truncated (0: not measured)
    skipped: Counter = field(default_factory=Counter)
    first_skip: dict[str, str] = field(default_factory=dict)

    def skip(self, bad: BadRecord) -> None:
        self.skipped[bad.reason] += 1
        self.first_skip.setdefault(bad.reason, str(bad))

    def counts(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
        skipped = f"skipped {sum(self.skipped.values())}" + (f" ({reasons})" if reasons else "")
        return f"read {self.read}, kept {self.kept}, {skipped}, truncated {self.truncated}"

    def summary_line(self) -> str:
        return f"{self.source} ({self.kind}): {self.counts()}"

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "source": self.source,
                    "kind": self.kind,
                    "read": self.read,
                    "kept": self.kept,
                    "truncated": self.truncated,
                    "tokens": self.tokens,
                    "skipped": dict(sorted(self.skipped.items())),
                    "first_skip": self.first_skip,
                },
                indent=1,
            )
            + "\n"
        )


def source_kind(path: str | os.PathLike) -> str:
    """jsonl, parquet, or hf_disk (a directory written by `Dataset.save_to_disk`), by the path."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(
                f"{path} is a DatasetDict; point the data path at one split directory "
                f"(one of {', '.join(str(path / s) for s in splits)})"
            )
        if not (path / "state.json").is_file():
            raise DataError(
                f"{path} is a directory but not a dataset saved with datasets' save_to_disk "
                "(no state.json); give a .jsonl or .parquet file or such a directory"
            )
        return "hf_disk"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """(where, decoded record) per record; a record the source itself cannot decode comes as a
    BadRecord instead (the policy decides), so one bad line never ends the stream."""
    kind = source_kind(path)
    return {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "hf_disk": _hf_disk_rows}[kind](Path(path))


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    offset = 0
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            where, start = f"{path}:{lineno}", offset
            offset += len(raw)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield (
                    where,
                    BadRecord(
                        "non_utf8",
                        f"{where}: bytes that are not UTF-8 at byte {err.start} of the line "
                        f"(file offset {start + err.start}): {raw[err.start : err.start + 8]!r}; "
                        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                yield (
                    where,
                    BadRecord(
                        "unparsable",
                        f"{where}: unparsable JSON ({err.msg} at column {err.colno}); "
                        "each line must be one JSON object",
                    ),
                )


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def _hf_disk_rows(path: Path) -> Iterator[tuple[str, object]]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # a corrupt or foreign directory; say which and why
        raise DataError(f"{path}: cannot load the saved dataset ({err})") from None
    for row, record in enumerate(dataset):
        yield f"{path} row {row}", record


def ingest(
    path: str | os.PathLike,
    policy: IngestPolicy,
    measure: Measure | None = None,
) -> tuple[list[ChatRecord], IngestReport]:
    """All usable records of a source under the policy, and the report of what was done.
    ``measure`` (needs the tokenizer) enables the length checks against ``policy.max_length``."""
    report = IngestReport(source=str(path), kind=source_kind(path))
    records: list[ChatRecord] = []
    for where, obj in progress(iter_rows(path), desc=f"ingest {Path(path).name}", unit="record"):
        if policy.max_records is not None and len(records) >= policy.max_records:
            break
        report.read += 1
        try:
            if isinstance(obj, BadRecord):
                raise obj
            record = parse_record(obj, where, policy.fmt)
            truncated, length = _check_length(record, policy, measure)
        except BadRecord as bad:
            if policy.on_bad_record == "error" and bad.reason != "overlong":
                raise DataError(f"{bad} (or set data.on_bad_record=skip to skip and count such records)") from None
            report.skip(bad)
            continue
        records.append(record)
        report.kept += 1
        report.truncated += truncated
        report.tokens += length
    if not records:
        raise DataError(
            f"{path}: no usable conversation ({report.counts()}); "
            + (
                f"first problem: {next(iter(report.first_skip.values()))}"
                if report.first_skip
                else "the source is empty"
            )
        )
    return records, report


def _check_length(record: ChatRecord, policy: IngestPolicy, measure: Measure | None) -> tuple[bool, int]:
    """(whether the record will be truncated, its tokens after truncation, 0 when not measured);
    BadRecord when it cannot or may not be truncated."""
    if measure is None or policy.max_length is None:
        return False, 0
    length, untrained = measure(record)
    if length <= policy.max_length:
        return False, length
    what = f"{record.where}: {length} tokens is over data.max_length={policy.max_length}"
    if policy.on_overlong == "error":
        raise DataError(f"{what}; raise data.max_length, or set data.on_overlong to truncate or skip")
    if policy.on_overlong == "skip":
        raise BadRecord("overlong", f"{what} (data.on_overlong=skip)")
    if untrained >= policy.max_length:
        raise BadRecord(
            "overlong_prompt",
            f"{what} and its prompt alone takes {untrained}, so truncation would "
            "leave no assistant token; shorten the prompt or raise data.max_length",
        )
    return True, policy.max_length


def write_ingested(records: list[ChatRecord], report: IngestReport, jsonl_path: Path, report_path: Path) -> None:
    """The normalized ``messages`` JSONL (each line keeps its original file:line / row) and the
    counts file, each written atomically (streamed to a temporary name, fsynced, renamed)."""
    jsonl_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(jsonl_path) as out:
        for r in records:
            out.write(json.dumps({"messages": r.as_dicts(), INGESTED_FROM: r.where}, ensure_ascii=False) + "\n")
    write_text_atomic(report_path, report.to_json())


def sample_keys(records: list[ChatRecord]) -> list[str]:
    """One key per record from its content (KEY_SCHEME), not its position: a sample keeps its key
    when records before it are added, dropped or reordered, and a repeated conversation gets
    -2, -3, ... (it is captured once per occurrence)."""
    keys, seen = [], Counter()
    for r in records:
        digest = hashlib.sha256(json.dumps(r.as_dicts(), ensure_ascii=False, sort_keys=True).encode()).hexdigest()
        seen[digest] += 1
        n = seen[digest]
        keys.append(f"s-{digest[:16]}" if n == 1 else f"s-{digest[:16]}-{n}")
    return keys


def content_hash(keys: list[str]) -> str:
    """sha256 of the records' keys in order: equal exactly when the same conversations come in the
    same order."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()
