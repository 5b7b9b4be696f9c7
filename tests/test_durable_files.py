"""The one line-log appender (durable_files.append_lines) and its rule for a torn last line: a
line is a record only once its newline is written; a torn last line (a crash mid-append) is cut
off when the file is next opened for append, so a new line never joins it. Every line log of the
project (shard manifest, skipped.jsonl, train/sample logs, regenerated JSONL) goes through it."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import stat
from pathlib import Path

import pytest

from data_pipeline.durable_files import append_lines
from tests.conftest import REPO


def test_append_cuts_a_torn_last_line_then_appends(tmp_path: Path, caplog) -> None:
    log = tmp_path / "a.jsonl"
    append_lines(log, b'{"n": 1}\n{"n": 2}\n')
    with open(log, "ab") as f:
        f.write(b'{"n": 3, "tor')  # a crash in the middle of an append
    caplog.set_level(logging.WARNING, logger="data_pipeline.durable_files")
    append_lines(log, b'{"n": 4}\n')
    assert [json.loads(x)["n"] for x in log.read_text().splitlines()] == [1, 2, 4]
    assert any("cut a torn last line of 13 bytes" in r.getMessage() for r in caplog.records)


def test_a_file_holding_only_a_torn_line_and_long_tails(tmp_path: Path) -> None:
    only = tmp_path / "only.jsonl"
    only.write_bytes(b'{"half')
    append_lines(only, b"")  # opened for append with nothing to add: the torn line still goes
    assert only.read_bytes() == b""
    long = tmp_path / "long.jsonl"
    long.write_bytes(b"x" * 10 + b"\n" + b"y" * 200_000)  # the last newline far back (chunked search)
    append_lines(long, b"z\n")
    assert long.read_bytes() == b"x" * 10 + b"\nz\n"
    fresh = tmp_path / "fresh.jsonl"
    append_lines(fresh, b"", durable=True)  # created (and its directory synced) even with no lines
    assert fresh.exists() and fresh.read_bytes() == b""
    with pytest.raises(AssertionError, match="whole lines"):
        append_lines(fresh, b"no newline")


def test_every_former_appender_site_uses_it(tmp_path: Path) -> None:
    """The skipped-sample ledger and the step logs cut a torn line the same way (the manifest:
    test_shards.test_partial_manifest_line_is_ignored_then_repaired; regenerated JSONL:
    test_regenerate's torn-write resume)."""
    from data_pipeline.ledger import read_skipped, record_skipped
    from data_pipeline.records import SKIPPED_NAME
    from dflash_dist.trainer.step_log import StepLogs

    record_skipped(tmp_path, "k1", "nonfinite_features", 0)
    with open(tmp_path / SKIPPED_NAME, "ab") as f:
        f.write(b'{"key": "k2", "rea')
    record_skipped(tmp_path, "k3", "nonfinite_features", 0)
    assert [r["key"] for r in read_skipped(tmp_path)] == ["k1", "k3"]

    logs = StepLogs(tmp_path / "out", rank=0, log_sample_keys=True, start_step=0)
    for name in ("train_log.jsonl", "sample_log/rank_0.jsonl"):
        with open(tmp_path / "out" / name, "ab") as f:
            f.write(b'{"step": 1, "lo')
    rows, seen = logs.reduce(samples_seen=0)
    logs.write(rows, durable=True)
    assert seen == 0 and rows.train == rows.keys == ()  # nothing queued: only the cut and the fsync
    for name in ("train_log.jsonl", "sample_log/rank_0.jsonl"):
        assert (tmp_path / "out" / name).read_bytes() == b""


def test_no_other_module_opens_a_file_for_append() -> None:
    """One appender: no module but durable_files opens a file in append mode (open(..., "a"/"ab"),
    os.O_APPEND), so no caller can treat a torn line its own way again."""
    found = []
    for top in ("dflash_dist", "data_pipeline", "launcher", "bench"):
        for path in sorted((REPO / top).rglob("*.py")):
            if path == REPO / "data_pipeline" / "durable_files.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "O_APPEND":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: os.O_APPEND")
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "open":
                    modes = node.args[:2] + [k.value for k in node.keywords if k.arg == "mode"]  # open() / Path.open()
                    for m in modes:
                        text = m.value if isinstance(m, ast.Constant) and isinstance(m.value, str) else ""
                        if re.fullmatch("[rwxbt+]*a[rwxbt+]*", text):
                            found.append(f"{path.relative_to(REPO)}:{node.lineno}: open(..., {m.value!r})")
    assert not found, "append through data_pipeline.durable_files.append_lines:\n" + "\n".join(found)


def test_atomic_path_replaces_the_file_only_on_a_clean_exit(tmp_path: Path) -> None:
    """For writers that take a path (safetensors, torch.save): an error in the middle leaves the old
    file and no temporary bytes; a clean exit renames the new file over it."""
    from data_pipeline.durable_files import atomic_path

    path = tmp_path / "data.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_path(path) as tmp:
        tmp.write_bytes(b"half of the n")
        raise RuntimeError("mid-write")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]
    with atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp.name.startswith(".data.bin.tmp-")
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_a_file_written_in_place_takes_the_umasks_mode(tmp_path):
    """open_own_file creates as open() does, the umask deciding: under umask 002 (a group sharing
    DFLASH_CACHE) the build cache's lock file is group-writable, so another member of the group can
    build a target there; it was 0644 whatever the umask (helper-49 saw it)."""
    from data_pipeline.durable_files import open_own_file

    old = os.umask(0o002)
    try:
        os.close(open_own_file(tmp_path / ".lock", os.O_RDWR | os.O_CREAT))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o664
