"""Shard writer / reader / provenance: bit-exact round trips, atomicity, concurrency, resume."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch

from data_pipeline.provenance import (
    Provenance,
    ProvenanceMismatch,
    check_compatible,
    hash_weight_files,
)
from data_pipeline.records import MANIFEST_NAME, TMP_PREFIX, Sample
from data_pipeline.shard_reader import ShardStream, iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.config import Config
from tests.helpers.shards import flip_member_byte, make_prov, make_sample, stream_keys


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a: Sample, b: Sample) -> None:
    assert a.key == b.key and dict(a.meta) == dict(b.meta)
    assert a.features.dtype == b.features.dtype and a.features.shape == b.features.shape
    assert torch.equal(bits(a.features), bits(b.features))
    for name in ("input_ids", "loss_mask", "target_argmax"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def write_shards(out: Path, prov: Provenance, prefix: str, n_shards: int, per_shard: int) -> list[str]:
    keys = []
    with ShardWriter(out, prov, prefix=prefix) as w:
        for s in range(n_shards):
            for i in range(per_shard):
                key = f"{prefix}/{s}/{i}"
                w.write(make_sample(key, prov, T=5 + i, seed=len(keys), finite=True))
                keys.append(key)
            w.flush()
    return keys


def deadline(seconds: float):
    end = time.monotonic() + seconds
    return lambda: time.monotonic() > end


# --- processes started with spawn (module level so the child can import them) ---------------


def _produce(out: str, prefix: str, n: int, max_bytes: int, start) -> None:
    prov = make_prov()
    start.wait()  # both producers write at the same time
    with ShardWriter(out, prov, max_shard_bytes=max_bytes, prefix=prefix) as w:
        for i in range(n):
            w.write(make_sample(f"{prefix}-{i}", prov, T=20, seed=i))


def _produce_then_die(out: str) -> None:
    prov = make_prov()
    w = ShardWriter(out, prov, prefix="dies")
    for i in range(3):
        w.write(make_sample(f"ok-{i}", prov, seed=i, finite=True))
    w.flush()  # one complete shard
    for i in range(3):
        w.write(make_sample(f"lost-{i}", prov, seed=10 + i))
    os._exit(3)  # killed mid-shard: no close, no cleanup


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_round_trip_bit_exact(tmp_path: Path, dtype: str) -> None:
    prov = make_prov(dtype=dtype)
    samples = [make_sample(f"src/q.{i} é", prov, T=3 + i, seed=i, idx=i, src="gsm8k") for i in range(4)]
    with ShardWriter(tmp_path, prov, prefix="rt") as w:
        for s in samples:
            w.write(s)
    (record,) = read_manifest(tmp_path)
    assert record.name == "rt-000000.tar" and record.provenance == prov
    assert record.keys == tuple(s.key for s in samples)
    assert record.n_tokens == sum(s.num_tokens for s in samples)
    assert record.n_bytes == (tmp_path / record.name).stat().st_size
    for a, b in zip(samples, iter_shard_samples(tmp_path / record.name), strict=True):
        assert_same(a, b)
    with tarfile.open(tmp_path / record.name) as tf:  # npy + json only: nothing pickled
        assert {n.split(".", 1)[1] for n in tf.getnames()} == {
            "features.npy",
            "input_ids.npy",
            "loss_mask.npy",
            "target_argmax.npy",
            "meta.json",
        }


def test_start_writeback_hands_the_open_shard_to_the_disk_and_changes_no_byte(tmp_path, monkeypatch) -> None:
    """start_writeback (what a capture writer calls while idle, capture.writeback_idle) starts the
    real sync_file_range on contiguous ranges of the open shard: from byte 0 of each new shard to
    all that reached the file so far, nothing with no shard open or nothing new; in `chunk` ranges,
    stopping once `stop()` says so. The shards are those of a writer that never calls it: the same
    names, sizes, keys, member checksums and samples."""
    import data_pipeline.shard_writer as sw

    calls = []  # (fd, offset, nbytes, file size then)

    def recorded(fd, offset, nbytes):
        calls.append((fd, offset, nbytes, os.fstat(fd).st_size))
        real(fd, offset, nbytes)

    real = sw.start_write_back
    monkeypatch.setattr(sw, "start_write_back", recorded)
    prov = make_prov()
    samples = [make_sample(f"k{i}", prov, T=20 + i % 7, seed=i) for i in range(30)]
    records = {}
    for handing in (False, True):
        with ShardWriter(tmp_path / str(handing), prov, max_shard_bytes=40_000, prefix="p") as w:
            assert w.start_writeback() == 0  # no shard open
            for s in samples:
                w.write(s)
                if handing:
                    w.start_writeback()
                    assert w.start_writeback() == 0  # nothing new since
        records[handing] = read_manifest(tmp_path / str(handing))
    assert len(records[True]) >= 3
    assert [(r.name, r.n_bytes, r.keys, r.checksums) for r in records[False]] == [
        (r.name, r.n_bytes, r.keys, r.checksums) for r in records[True]
    ]
    starts = [i for i, c in enumerate(calls) if c[1] == 0]
    assert len(starts) == len(records[True])  # each shard's ranges begin at its byte 0
    for i, (_, offset, nbytes, size) in enumerate(calls):
        assert offset + nbytes == size  # up to everything in the file
        if i not in starts:
            assert offset == calls[i - 1][1] + calls[i - 1][2]  # and contiguous
    read = {s.key: s for r in records[True] for s in iter_shard_samples(tmp_path / "True" / r.name)}
    for s in samples:
        assert_same(read[s.key], s)

    calls.clear()  # chunks, and a caller that has work again after the first
    with ShardWriter(tmp_path / "chunks", prov, prefix="p") as w:
        for i in range(3):
            w.write(make_sample(f"c{i}", prov, T=200, seed=i))
        assert w.start_writeback(stop=lambda: True, chunk=4096) == 4096
        rest = w.start_writeback(chunk=4096)
    assert [c[1] for c in calls] == [i * 4096 for i in range(len(calls))] and len(calls) > 3
    assert all(c[2] == 4096 for c in calls[:-1])
    assert 4096 + rest == calls[-1][1] + calls[-1][2] == calls[-1][3]


def test_refused_writeback_leaves_the_shard_to_its_closing_fsync(tmp_path, monkeypatch, caplog) -> None:
    """A filesystem that refuses sync_file_range (fault injected): start_writeback warns once,
    stops asking, and the shard is written and listed whole."""
    import errno

    import data_pipeline.shard_writer as sw

    def refuse(*_):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(sw, "start_write_back", refuse)
    prov = make_prov()
    with caplog.at_level("WARNING", logger="data_pipeline.shard_writer"), ShardWriter(tmp_path, prov, prefix="p") as w:
        for i in range(3):
            w.write(make_sample(f"k{i}", prov, T=200, seed=i))
            assert w.start_writeback() == 0
    assert w.writeback_calls == 0
    assert sum("sync_file_range refused" in r.getMessage() for r in caplog.records) == 1
    (record,) = read_manifest(tmp_path)
    assert [s.key for s in iter_shard_samples(tmp_path / record.name)] == ["k0", "k1", "k2"]


def test_writer_rejects_bad_samples(tmp_path: Path) -> None:
    prov = make_prov()
    with ShardWriter(tmp_path, prov) as w:
        with pytest.raises(ValueError, match="features width"):
            w.write(make_sample("a", make_prov(hidden_size=8)))
        with pytest.raises(ValueError, match="float32"):
            w.write(make_sample("a", make_prov(dtype="float32")))
        w.write(make_sample("a", prov))
        with pytest.raises(ValueError, match="already written"):
            w.write(make_sample("a", prov))
    with pytest.raises(ValueError, match="input_ids must be a 1-D torch.int32"):
        Sample("k", torch.zeros(3), torch.zeros(3, dtype=torch.uint8), torch.zeros(3, 4), torch.zeros(3))


def test_exception_in_context_leaves_no_partial_shard(tmp_path: Path) -> None:
    prov = make_prov()
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, prov, prefix="p") as w:
        for i in range(3):
            w.write(make_sample(f"k{i}", prov, seed=i))
        w.flush()
        w.write(make_sample("partial", prov))
        raise RuntimeError("producer crashed")
    assert sorted(os.listdir(tmp_path)) == [".manifest.lock", MANIFEST_NAME, "p-000000.tar"]
    (record,) = read_manifest(tmp_path)
    assert record.keys == ("k0", "k1", "k2")


def test_killed_writer_leaves_only_tmp_and_no_manifest_line(tmp_path: Path) -> None:
    proc = mp.get_context("spawn").Process(target=_produce_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    records = read_manifest(tmp_path)
    assert [r.name for r in records] == ["dies-000000.tar"]
    assert [k for r in records for k in r.keys] == ["ok-0", "ok-1", "ok-2"]
    tmps = [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)]
    assert len(tmps) == 1 and not any(TMP_PREFIX in line for line in (tmp_path / MANIFEST_NAME).open())
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tar") and n not in tmps) == ["dies-000000.tar"]
    # A restarted producer continues the numbering; readers see only complete shards.
    prov = make_prov()
    with ShardWriter(tmp_path, prov, prefix="dies") as w:
        w.write(make_sample("again", prov, finite=True))
    mark_done(tmp_path)
    assert [r.name for r in read_manifest(tmp_path)] == ["dies-000000.tar", "dies-000001.tar"]
    assert stream_keys(ShardStream(tmp_path, prov, poll_s=0.01)) == ["ok-0", "ok-1", "ok-2", "again"]
    with pytest.raises(ValueError, match="still being written"):
        next(iter_shard_samples(tmp_path / tmps[0]))


def test_stale_cleanup_takes_what_a_prefixs_dead_writers_left_and_nothing_listed_or_others(tmp_path: Path) -> None:
    """ledger.remove_stale_tmp(dir, "t000"): a target actor's cleanup before it writes. Its writer
    processes write under `t000-w<N>` (capture/host_sink.py) and are SIGKILLed on abort, so a shard
    renamed but never listed can be theirs too: it is taken like the actor's own; listed shards
    (released and kept ones included) and other actors' files stay."""
    from data_pipeline.ledger import remove_stale_tmp

    prov = make_prov()
    write_shards(tmp_path, prov, "t000", n_shards=1, per_shard=2)
    write_shards(tmp_path, prov, "t000-w1", n_shards=2, per_shard=2)
    write_shards(tmp_path, prov, "t001-w0", n_shards=1, per_shard=2)
    listed = sorted(r.name for r in read_manifest(tmp_path))
    body = (tmp_path / "t000-w1-000000.tar").read_bytes()
    dead = ["t000-000004.tar", "t000-w1-000005.tar", ".tmp-t000-w0-123-abc.tar", ".tmp-t000-9-def.tar"]
    others = ["t001-w0-000003.tar", ".tmp-t001-w0-7-ghi.tar", "t0001-000002.tar", "t000.tar", "notes-t000-000001.tar"]
    for name in dead + others:
        (tmp_path / name).write_bytes(body)
    assert remove_stale_tmp(tmp_path, "t000") == sorted(dead)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == sorted(listed + others)
    assert remove_stale_tmp(tmp_path, "t000") == []


def test_shard_size_limit(tmp_path: Path) -> None:
    prov = make_prov(layer_ids=(1, 2, 3, 4), hidden_size=32)  # 256 bf16 = 512 B per token
    limit = 48 * 1024
    with ShardWriter(tmp_path, prov, max_shard_bytes=limit, prefix="lim") as w:
        keys = [f"s{i}" for i in range(30)]
        for i, key in enumerate(keys):
            w.write(make_sample(key, prov, T=12 + i % 7, seed=i))
    records = read_manifest(tmp_path)
    assert len(records) >= 3
    assert [r.name for r in records] == [f"lim-{i:06d}.tar" for i in range(len(records))]
    for r in records:
        assert r.n_bytes == (tmp_path / r.name).stat().st_size <= limit
    assert all(r.n_bytes > limit - 12 * 1024 for r in records[:-1])  # filled, not split early
    assert [k for r in records for k in r.keys] == keys


def test_concurrent_writer_processes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_produce, args=(str(tmp_path), p, 24, 16 * 1024, start)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = (tmp_path / MANIFEST_NAME).read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])
    records = read_manifest(tmp_path)
    names = [r.name for r in records]
    assert len(set(names)) == len(names) > 2
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tar")) == sorted(names)
    keys = [k for r in records for k in r.keys]
    assert sorted(keys) == sorted(f"{p}-{i}" for p in ("a", "b") for i in range(24))
    for r in records:
        assert [s.key for s in iter_shard_samples(tmp_path / r.name)] == list(r.keys)


def test_concurrent_threads_same_prefix(tmp_path: Path) -> None:
    prov = make_prov()

    def produce(tag: str) -> None:
        with ShardWriter(tmp_path, prov, prefix="same") as w:
            for i in range(12):
                w.write(make_sample(f"{tag}{i}", prov, seed=i))
                if i % 3 == 2:
                    w.flush()

    threads = [threading.Thread(target=produce, args=(t,)) for t in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = read_manifest(tmp_path)
    assert sorted(r.name for r in records) == [f"same-{i:06d}.tar" for i in range(12)]
    assert sorted(k for r in records for k in r.keys) == sorted(f"{t}{i}" for t in "xyz" for i in range(12))


def test_stream_two_ranks_disjoint_complete(tmp_path: Path) -> None:
    prov = make_prov()
    keys = write_shards(tmp_path, prov, "r", n_shards=7, per_shard=3)
    mark_done(tmp_path)
    got = [stream_keys(ShardStream(tmp_path, prov, rank=r, world_size=2, poll_s=0.01)) for r in (0, 1)]
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == sorted(keys)
    assert got[0] == [k for k in keys if int(k.split("/")[1]) % 2 == 0]  # manifest index % 2


def test_stream_follows_growing_manifest(tmp_path: Path) -> None:
    prov = make_prov()
    out = tmp_path / "growing"  # does not exist yet when the stream starts
    written: list[str] = []

    def produce() -> None:
        time.sleep(0.1)
        with ShardWriter(out, prov, prefix="g") as w:
            for i in range(15):
                w.write(make_sample(f"g{i}", prov, seed=i, finite=True))
                written.append(f"g{i}")
                if i % 3 == 2:
                    w.flush()
                    time.sleep(0.05)
        time.sleep(0.1)
        mark_done(out)

    writer = threading.Thread(target=produce)
    writer.start()
    got, seen_before_done = [], 0
    for sample in ShardStream(out, prov, poll_s=0.01, stop_when=deadline(20)):
        got.append(sample.key)
        seen_before_done += not (out / "DONE").exists()
    writer.join()
    assert got == written == [f"g{i}" for i in range(15)]
    assert seen_before_done > 0  # it read shards while the producer was still writing
    assert (out / "DONE").exists()


def test_stream_stop_when_without_done(tmp_path: Path) -> None:
    prov = make_prov()
    write_shards(tmp_path, prov, "s", n_shards=1, per_shard=2)
    assert len(stream_keys(ShardStream(tmp_path, prov, poll_s=0.01, stop_when=deadline(0.2)))) == 2


def test_provenance_mismatch_names_field_and_shard(tmp_path: Path) -> None:
    found = make_prov(kernel_path="fla")
    write_shards(tmp_path, found, "fla", n_shards=1, per_shard=2)
    expected = make_prov(kernel_path="torch")
    # A writer of another provenance is refused before it writes anything into the directory.
    with pytest.raises(ProvenanceMismatch, match="kernel_path"):
        ShardWriter(tmp_path, expected, prefix="other")
    mark_done(tmp_path)
    with pytest.raises(ProvenanceMismatch) as err:
        stream_keys(ShardStream(tmp_path, expected, poll_s=0.01))
    msg = str(err.value)
    assert "kernel_path: expected 'torch', found 'fla'" in msg
    assert "fla-000000.tar" in msg and "re-extract" in msg and "change the config" in msg
    assert err.value.fields == ("kernel_path",)
    assert isinstance(err.value, ValueError)
    with pytest.raises(ProvenanceMismatch) as err2:
        check_compatible(expected, make_prov(layer_ids=(1, 3), dtype="float32"), "x.tar")
    assert err2.value.fields == ("layer_ids", "dtype")
    check_compatible(expected, make_prov(torch_version="9.9", fla_version="0.6.0"), "x.tar")


def test_provenance_json_and_validation() -> None:
    prov = make_prov()
    assert Provenance.from_json(prov.to_json()) == prov
    assert Provenance.from_json(prov.to_json()).layer_ids == (1, 2)
    with pytest.raises(ValueError, match="unknown fields \\['kernel'\\]"):
        Provenance.from_dict({**prov.to_dict(), "kernel": "fla"})
    with pytest.raises(ValueError, match="kernel_path must be one of"):
        make_prov(kernel_path="cuda")


def test_hash_weight_files(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"w1" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"w2")
    (tmp_path / "config.json").write_text("{}")
    h = hash_weight_files(tmp_path)
    assert len(h) == 64 and h == hash_weight_files(tmp_path, chunk_bytes=7)
    (tmp_path / "config.json").write_text('{"x": 1}')
    assert hash_weight_files(tmp_path) == h  # only weight files count
    (tmp_path / "pytorch_model.bin").write_bytes(b"w3")
    assert hash_weight_files(tmp_path) != h
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        hash_weight_files(tmp_path / "empty")


@pytest.mark.parametrize("first", [0, 5, 7, 20])
def test_state_dict_resume_is_exact(tmp_path: Path, first: int) -> None:
    prov = make_prov()
    keys = write_shards(tmp_path, prov, "st", n_shards=4, per_shard=5)
    mark_done(tmp_path)
    a = ShardStream(tmp_path, prov, poll_s=0.01)
    head = stream_keys(a, limit=first) if first else []
    state = json.loads(json.dumps(a.state_dict()))  # must survive a JSON checkpoint
    b = ShardStream(tmp_path, prov, poll_s=0.01)
    b.load_state_dict(state)
    assert head + stream_keys(b) == keys
    assert state["complete"]  # one rank of one: loadable at any world size (test_reader.py)
    part = ShardStream(tmp_path, prov, rank=0, world_size=2, poll_s=0.01)
    head2 = stream_keys(part, limit=1)
    with pytest.raises(ValueError, match="merge_reader_states"):  # one rank's state knows only its share
        ShardStream(tmp_path, prov, rank=1, world_size=2).load_state_dict(part.state_dict())
    assert head2 == keys[:1]


def test_partial_manifest_line_is_ignored_then_repaired(tmp_path: Path) -> None:
    prov = make_prov()
    write_shards(tmp_path, prov, "m", n_shards=1, per_shard=2)
    with open(tmp_path / MANIFEST_NAME, "ab") as f:
        f.write(b'{"name": "m-000001.tar", "n_sam')  # a writer died mid-append
    assert [r.name for r in read_manifest(tmp_path)] == ["m-000000.tar"]
    write_shards(tmp_path, prov, "m", n_shards=1, per_shard=2)
    assert [r.name for r in read_manifest(tmp_path)] == ["m-000000.tar", "m-000001.tar"]


def test_writer_refuses_done_directory(tmp_path: Path) -> None:
    mark_done(tmp_path)
    with pytest.raises(ValueError, match="marked DONE"):
        ShardWriter(tmp_path, make_prov())


def test_bytes_per_token_overhead(tmp_path: Path) -> None:
    k, H, T, n = 5, 1024, 200, 8
    prov = make_prov(layer_ids=(1, 9, 17, 25, 33), hidden_size=H)
    with ShardWriter(tmp_path, prov, prefix="big") as w:
        for i in range(n):
            w.write(make_sample(f"b{i}", prov, T=T, seed=i))
    (record,) = read_manifest(tmp_path)
    ideal = record.n_tokens * k * H * 2
    overhead = record.n_bytes / ideal - 1
    print(f"\nbytes/token {record.n_bytes / record.n_tokens:.1f} vs k*H*2={k * H * 2}: +{overhead:.3%}")
    assert record.n_tokens == n * T and 0 < overhead < 0.02


def test_bytes_per_token_at_the_bench_shape(tmp_path: Path) -> None:
    """The 27B target shape (H 5120, k 5, bf16) written for real, a few hundred tokens per sample:
    bytes on disk per token within 2% of k x H x 2 (per-sample ids, mask, argmax, meta and tar
    headers are ~10 KB against ~50 KB of features per token)."""
    k, H, lengths = 5, 5120, [180, 320, 450]
    prov = make_prov(layer_ids=(1, 16, 31, 46, 61), hidden_size=H)
    with ShardWriter(tmp_path, prov, prefix="wide") as w:
        for i, T in enumerate(lengths):
            w.write(make_sample(f"w{i}", prov, T=T, seed=i))
    (record,) = read_manifest(tmp_path)
    on_disk = (tmp_path / record.name).stat().st_size
    per_token = on_disk / sum(lengths)
    print(f"\nH=5120 k=5 bf16: {per_token:.1f} bytes/token vs k*H*2={k * H * 2} (+{per_token / (k * H * 2) - 1:.3%})")
    assert on_disk == record.n_bytes and record.n_tokens == sum(lengths)
    assert k * H * 2 < per_token < 1.02 * k * H * 2


# --- checksums ------------------------------------------------------------------------------


def test_manifest_lists_every_members_checksum(tmp_path: Path) -> None:
    from data_pipeline.checksums import digest_bytes

    prov = make_prov()
    write_shards(tmp_path, prov, "c", n_shards=1, per_shard=3)
    (record,) = read_manifest(tmp_path)
    sums = record.checksums
    assert sums.algorithm == "xxh3_64" and len(sums.digests) == 3
    assert sums.members == ("features.npy", "input_ids.npy", "loss_mask.npy", "meta.json", "target_argmax.npy")
    with tarfile.open(tmp_path / record.name) as tar:  # each digest is that of the member's bytes
        for i, row in enumerate(sums.digests):
            for member, digest in zip(sums.members, row):
                assert digest_bytes(tar.extractfile(f"{i:08d}.{member}").read()) == digest
    line = json.loads((tmp_path / MANIFEST_NAME).read_text())
    from data_pipeline.records import ShardRecord

    del line["checksums"]  # a manifest written before checksums: refused, saying what to do
    with pytest.raises(ValueError, match="no checksums.*re-extract"):
        ShardRecord.from_json(json.dumps(line), "m:1")


@pytest.mark.parametrize("member", ["features.npy", "input_ids.npy"])
def test_flipped_byte_is_named_by_iter_shard_samples(tmp_path: Path, member: str) -> None:
    from data_pipeline.checksums import ChecksumMismatch

    prov = make_prov()
    write_shards(tmp_path, prov, "f", n_shards=1, per_shard=3)
    (record,) = read_manifest(tmp_path)
    path = tmp_path / record.name
    flip_member_byte(path, f"00000001.{member}")
    assert path.stat().st_size == record.n_bytes  # the size check cannot see it
    samples = iter_shard_samples(path)
    assert next(samples).key == "f/0/0"  # sample 0 is intact
    with pytest.raises(ChecksumMismatch, match=rf"{path}: member 00000001\.{member} \(sample 1, key 'f/0/1'\)"):
        next(samples)
    with pytest.raises(ChecksumMismatch, match=f"00000001.{member}"):
        list(iter_shard_samples(path, skip=1, record=record))


@pytest.mark.parametrize("bad", ["../victim.txt", "/etc/passwd", "sub/m-000001.tar", "..", "m-000001.tar\x00x",
                                 "m-000001.txt", "-000001.tar"])  # fmt: skip
def test_manifest_name_outside_the_shard_pattern_is_refused_before_any_delete(tmp_path: Path, bad: str) -> None:
    """A forged manifest line (the attacker also fixed its byte count) naming a file outside
    shards/: with consumed_shards=delete after one epoch, the release refuses it naming
    manifest.jsonl:line, and the file it names survives."""
    from data_pipeline.disk_budget import BufferPolicy, release_consumed

    shards = tmp_path / "shards"
    write_shards(shards, make_prov(), "m", n_shards=2, per_shard=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("not a shard")
    line = json.loads((shards / MANIFEST_NAME).read_text().splitlines()[0])
    line.update(name=bad, n_bytes=victim.stat().st_size)
    with open(shards / MANIFEST_NAME, "a") as f:
        f.write(json.dumps(line) + "\n")
    cfg = Config()
    cfg.capture.consumed_shards, cfg.train.epochs = "delete", 1
    policy = BufferPolicy.from_config(cfg)
    assert policy.delete_consumed
    where = re.escape(f"{shards / MANIFEST_NAME}:3")
    with pytest.raises(ValueError, match=rf"{where}: shard name .* is not a plain shard file name"):
        release_consumed(shards, policy, [None], epoch=1)  # after the epoch: every listed shard is consumed
    assert victim.read_text() == "not a shard"
    assert sorted(p.name for p in shards.glob("*.tar")) == ["m-000000.tar", "m-000001.tar"]  # nothing deleted
    with pytest.raises(ValueError, match=r":3: shard name"):
        read_manifest(shards)  # and no reader opens it


def test_released_record_names_are_validated_before_deleting(tmp_path: Path) -> None:
    """released.json (what the trainer released) is read back before deleting: a forged name in it
    is refused too, naming the file."""
    from data_pipeline.disk_budget import BufferPolicy, release_consumed
    from data_pipeline.records import RELEASED_NAME

    shards = tmp_path / "shards"
    write_shards(shards, make_prov(), "m", n_shards=1, per_shard=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("not a shard")
    (shards / RELEASED_NAME).write_text(json.dumps({"released": ["../victim.txt"]}) + "\n")
    policy = BufferPolicy(cap_bytes=1 << 30, delete_consumed=True, stall_s=60.0)
    with pytest.raises(ValueError, match=re.escape(f"{shards / RELEASED_NAME}: shard name '../victim.txt'")):
        release_consumed(shards, policy, [None], epoch=1)
    assert victim.exists() and (shards / "m-000000.tar").exists()
