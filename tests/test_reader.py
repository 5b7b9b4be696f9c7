"""The streaming shard reader: disjoint complete shares over ranks x workers, seeded orders per
epoch, exact resume (the same stream, and merged states at another world size), skipped
corrupt/truncated/missing shards and non-finite samples, and micro-batches by token budget.

Small shards written by the real ShardWriter into tmp dirs (helpers in tests/helpers/shards.py).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_pipeline.provenance import ProvenanceMismatch
from data_pipeline.records import MANIFEST_NAME
from data_pipeline.shard_reader import (
    CORRUPT_SHARD,
    MISSING_SHARD,
    NONFINITE,
    ShardStream,
    assigned_shards,
    merge_reader_states,
    read_manifest,
    sample_order,
)
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.trainer.batching import (
    DRY,
    READY,
    BatchLimit,
    MicroBatchFeeder,
    group_micro_batches,
    make_micro_batch,
    with_positions,
)
from tests.helpers.shards import flip_member_byte, make_prov, make_sample, stream_keys

PROV = make_prov()


def write_dir(path: Path, sizes: list[int], nonfinite: dict[str, float] | None = None) -> list[list[str]]:
    """One shard per entry of `sizes` (samples each, lengths 4..15); keys per shard. Samples
    named in `nonfinite` get that value (nan, inf) in one feature."""
    shards = []
    with ShardWriter(path, PROV, prefix="s") as w:
        for s, n in enumerate(sizes):
            keys = [f"s{s}/{i}" for i in range(n)]
            for i, key in enumerate(keys):
                sample = make_sample(key, PROV, T=4 + (3 * s + 5 * i) % 12, seed=100 * s + i, finite=True)
                if nonfinite and key in nonfinite:
                    sample.features[1, 3] = nonfinite[key]
                w.write(sample)
            w.flush()
            shards.append(keys)
    mark_done(path)
    return shards


def stream(path: Path, **kw) -> ShardStream:
    return ShardStream(path, PROV, poll_s=0.01, **kw)


def read_all(path: Path, world: int, workers: int, **kw) -> dict[tuple[int, int], list[str]]:
    return {
        (r, w): stream_keys(stream(path, rank=r, world_size=world, worker_id=w, num_workers=workers, **kw))
        for r in range(world)
        for w in range(workers)
    }


# ---------------------------------------------------------------------------- shares and orders
@pytest.mark.parametrize("epoch", [0, 1])
def test_ranks_and_workers_read_disjoint_complete_shares(tmp_path: Path, epoch: int) -> None:
    shards = write_dir(tmp_path, [3, 2, 3, 1, 3, 2, 3, 3, 2, 1, 3])
    every = Counter(k for keys in shards for k in keys)
    records = read_manifest(tmp_path)
    for world, workers in [(1, 1), (2, 1), (2, 2), (3, 2)]:
        got = read_all(tmp_path, world, workers, epoch=epoch, seed=7, shuffle=True)
        assert Counter(k for keys in got.values() for k in keys) == every, (world, workers)  # each key once
        for (r, w), keys in got.items():
            mine = assigned_shards(records, epoch, 7, r, world, w, workers)
            assert Counter(keys) == Counter(k for rec in mine for k in rec.keys)  # whole shards, as assigned
        if world * workers > 1:
            assert all(got.values()), "every stream gets a share of 11 shards"
    with pytest.raises(ValueError, match="worker_id < num_workers"):
        stream(tmp_path, worker_id=2, num_workers=2)


def test_order_is_seeded_per_epoch_and_reproducible(tmp_path: Path) -> None:
    shards = write_dir(tmp_path, [4] * 8)
    shard_of = {k: i for i, keys in enumerate(shards) for k in keys}

    def order(epoch: int, seed: int = 3, shuffle: bool = True) -> list[str]:
        return stream_keys(stream(tmp_path, epoch=epoch, seed=seed, shuffle=shuffle))

    flat = [k for keys in shards for k in keys]
    assert order(0, shuffle=False) == flat  # manifest order, storage order
    e0, e1, e2 = order(0), order(1), order(2)
    assert sorted(e0) == sorted(e1) == sorted(e2) == sorted(flat)
    # epoch 0 follows the manifest shard by shard (it may still be growing), samples shuffled inside
    assert [shard_of[k] for k in e0] == sorted(shard_of[k] for k in e0) and e0 != flat
    # later epochs permute the shards too; every epoch and seed its own order, each reproducible
    shard_runs = [shard_of[k] for k in e1[::4]]
    assert shard_runs != sorted(shard_runs) and [shard_of[k] for k in e1] == [s for s in shard_runs for _ in range(4)]
    assert len({tuple(e0), tuple(e1), tuple(e2), tuple(order(1, seed=4))}) == 4
    assert order(1) == e1 and order(2) == e2
    # without shuffle a later epoch still permutes shards but keeps storage order inside each
    plain = order(1, shuffle=False)
    assert [shard_of[k] for k in plain[::4]] == shard_runs
    assert all(plain[i : i + 4] == shards[shard_of[plain[i]]] for i in range(0, 32, 4))


def test_later_epoch_waits_for_done(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, PROV, prefix="w") as w:
        w.write(make_sample("a", PROV, finite=True))
    end = time.monotonic() + 0.3
    assert stream_keys(stream(tmp_path, epoch=1, stop_when=lambda: time.monotonic() > end)) == []
    mark_done(tmp_path)
    assert stream_keys(stream(tmp_path, epoch=1)) == ["a"]


# ---------------------------------------------------------------------------- resume
@pytest.mark.parametrize("first", [1, 4, 6])
def test_resume_same_rank_mid_shard_is_exact(tmp_path: Path, first: int) -> None:
    write_dir(tmp_path, [3, 4, 2, 5, 3, 4])
    kw = dict(rank=1, world_size=2, epoch=2, seed=1, shuffle=True)
    whole = stream_keys(stream(tmp_path, **kw))
    a = stream(tmp_path, **kw)
    head = stream_keys(a, limit=first)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON (or torch.save) checkpoint
    assert bool(state["partial"]) == (first != 4)  # its first shard holds 4 samples: else mid-shard
    b = stream(tmp_path, **kw)
    b.load_state_dict(state)
    assert head + stream_keys(b) == whole
    with pytest.raises(ValueError, match="epoch=2, this stream has epoch=3"):
        stream(tmp_path, **{**kw, "epoch": 3}).load_state_dict(state)
    with pytest.raises(ValueError, match="merge_reader_states"):  # one rank's state: only its share
        stream(tmp_path, rank=1, world_size=3, epoch=2, seed=1, shuffle=True).load_state_dict(state)


@pytest.mark.parametrize(("old", "new"), [((2, 1), (3, 1)), ((2, 1), (1, 1)), ((1, 2), (2, 2)), ((3, 1), (2, 1))])
@pytest.mark.parametrize("epoch", [0, 1])
def test_merged_state_resumes_at_another_world_size(tmp_path: Path, old, new, epoch: int) -> None:
    shards = write_dir(tmp_path, [3, 4, 2, 5, 3, 4, 1, 3], nonfinite={"s3/1": float("nan")})
    every = Counter(k for keys in shards for k in keys if k != "s3/1")
    kw = dict(epoch=epoch, seed=5, shuffle=True)
    states, heads = [], []
    for i, (r, w) in enumerate((r, w) for r in range(old[0]) for w in range(old[1])):
        s = stream(tmp_path, rank=r, world_size=old[0], worker_id=w, num_workers=old[1], **kw)
        heads += stream_keys(s, limit=2 + 3 * i)  # each stream stopped somewhere else, some mid-shard
        states.append(json.loads(json.dumps(s.state_dict())))
    merged = merge_reader_states(states)
    assert merged["complete"] and merged["partial"]
    rests, skipped = [], Counter()
    for r in range(new[0]):
        for w in range(new[1]):
            s = stream(tmp_path, rank=r, world_size=new[0], worker_id=w, num_workers=new[1], **kw)
            s.load_state_dict(merged)
            rests += stream_keys(s)
            skipped.update(s.skipped)
    assert Counter(heads) + Counter(rests) == every  # exactly the remaining samples, once
    assert skipped == {NONFINITE: 1}  # counted once overall, also when seen before the merge
    assert merge_reader_states([merged]) == merged


def test_merge_refuses_incomplete_or_mixed_states(tmp_path: Path) -> None:
    write_dir(tmp_path, [2, 2, 2])
    s = [stream(tmp_path, rank=r, world_size=3, epoch=1) for r in range(3)]
    states = [x.state_dict() for x in s]
    with pytest.raises(ValueError, match=r"missing \[\(2, 0\)\], given twice \[\(0, 0\)\]"):
        merge_reader_states([states[0], states[0], states[1]])
    with pytest.raises(ValueError, match="disagree on epoch"):
        merge_reader_states([*states[:2], stream(tmp_path, rank=2, world_size=3, epoch=2).state_dict()])
    with pytest.raises(ValueError, match="version 1"):
        merge_reader_states([{**states[0], "version": 1}, *states[1:]])
    with pytest.raises(ValueError, match="no states"):
        merge_reader_states([])


# ---------------------------------------------------------------------------- skips
def rewrite_manifest_n_bytes(path: Path, name: str, n_bytes: int) -> None:
    lines = (path / MANIFEST_NAME).read_text().splitlines()
    out = []
    for line in lines:
        d = json.loads(line)
        if d["name"] == name:
            d["n_bytes"] = n_bytes
        out.append(json.dumps(d, sort_keys=True))
    (path / MANIFEST_NAME).write_text("".join(line + "\n" for line in out))


@pytest.mark.parametrize("shuffle", [False, True])
def test_corrupt_truncated_and_missing_shards_are_skipped_and_counted(tmp_path: Path, caplog, shuffle: bool) -> None:
    shards = write_dir(tmp_path, [3, 3, 3, 4, 3, 3])
    names = [r.name for r in read_manifest(tmp_path)]
    p1, p2, p3, p4 = (tmp_path / names[i] for i in (1, 2, 3, 4))
    p1.write_bytes(p1.read_bytes()[: p1.stat().st_size // 2])  # truncated: size differs from the manifest
    p2.write_bytes(torch.randint(0, 256, (p2.stat().st_size,), dtype=torch.uint8).numpy().tobytes())  # garbage
    cut = p3.read_bytes()[: int(p3.stat().st_size * 0.6)]  # truncated inside sample 2 or 3 ...
    p3.write_bytes(cut)
    rewrite_manifest_n_bytes(tmp_path, names[3], len(cut))  # ... and the manifest agrees on the size
    p4.unlink()
    caplog.set_level(logging.WARNING, logger="data_pipeline.shard_reader")
    s = stream(tmp_path, shuffle=shuffle)
    got = stream_keys(s)  # no exception mid-run
    assert got[:3] == shards[0] or sorted(got[:3]) == shards[0]
    assert got[-3:] == shards[5] or sorted(got[-3:]) == shards[5]
    from_p3 = [k for k in got if k.startswith("s3/")]
    if shuffle:
        assert from_p3 == []  # the whole shard is read before any sample is handed out
    else:
        assert 1 <= len(from_p3) < 4 and from_p3 == shards[3][: len(from_p3)]  # handed out before the cut
    assert len(got) == 6 + len(from_p3)
    assert s.skipped == {CORRUPT_SHARD: 3 + 3 + 4 - len(from_p3), MISSING_SHARD: 3}
    assert s.state_dict()["consumed"] == tuple(names)  # skipped shards count as processed
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4  # once per skipped shard
    for path, why in ((p1, "bytes on disk"), (p2, CORRUPT_SHARD), (p3, CORRUPT_SHARD), (p4, "missing")):
        assert any(str(path) in m and why in m for m in warned), (path, warned)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("member", ["features.npy", "input_ids.npy"])
def test_flipped_byte_in_a_member_is_named_and_its_shard_skipped(tmp_path: Path, caplog, shuffle: bool, member: str):
    """A flipped bit (same size, finite values) in one member of sample 1 of shard 0: the samples
    handed out before it in the epoch's order stay, the rest of that shard is skipped as corrupt
    with a warning naming the shard file and the member; the other shard is read whole."""
    shards = write_dir(tmp_path, [3, 3])
    record = read_manifest(tmp_path)[0]
    path = tmp_path / record.name
    flip_member_byte(path, f"00000001.{member}")
    caplog.set_level(logging.WARNING, logger="data_pipeline.shard_reader")
    s = stream(tmp_path, shuffle=shuffle)
    got = stream_keys(s)
    order = [shards[0][i] for i in sample_order(record.name, 3, 0, 0, shuffle)]
    before = order[: order.index(shards[0][1])]  # handed out before the damaged sample
    assert got[: len(before)] == before and sorted(got[len(before) :]) == shards[1]
    assert s.skipped == {CORRUPT_SHARD: 3 - len(before)}
    (warned,) = [r.getMessage() for r in caplog.records]
    assert str(path) in warned and f"member 00000001.{member}" in warned and "ChecksumMismatch" in warned


def test_nonfinite_samples_skipped_counted_and_resumed_exactly(tmp_path: Path) -> None:
    write_dir(tmp_path, [4, 4], nonfinite={"s0/1": float("nan"), "s0/3": float("inf"), "s1/0": -float("inf")})
    whole = stream(tmp_path)
    keys = stream_keys(whole)
    assert keys == ["s0/0", "s0/2", "s1/1", "s1/2", "s1/3"]
    assert whole.skipped == {NONFINITE: 3}
    a = stream(tmp_path)
    assert stream_keys(a, limit=2) == ["s0/0", "s0/2"]
    state = a.state_dict()
    assert state["skipped"] == {NONFINITE: 1} and state["partial"] == {"s-000000.tar": 3}
    b = stream(tmp_path)
    b.load_state_dict(state)
    assert stream_keys(b) == keys[2:] and b.skipped == whole.skipped  # the NaN after the position counted once


def test_provenance_mismatch_stops_every_epoch(tmp_path: Path) -> None:
    write_dir(tmp_path, [2])
    for epoch in (0, 1):
        with pytest.raises(ProvenanceMismatch, match="layer_ids: expected"):
            stream_keys(ShardStream(tmp_path, make_prov(layer_ids=(1, 3)), poll_s=0.01, epoch=epoch))


# ---------------------------------------------------------------------------- micro-batches
class _Fake:
    def __init__(self, key: str, n: int) -> None:
        self.key, self.num_tokens = key, n


def test_token_budget_groups_are_maximal_within_budget() -> None:
    lengths = [5, 3, 9, 2, 2, 2, 20, 4, 4]
    pairs = [(_Fake(str(i), n), {"after": i}) for i, n in enumerate(lengths)]

    def groups(limit: BatchLimit):
        return [([s.num_tokens for s in g], st["after"], done) for g, st, done in group_micro_batches(pairs, limit)]

    by_tokens = groups(BatchLimit(size=2, tokens=12))
    assert by_tokens == [([5, 3], 1, True), ([9], 2, True), ([2, 2, 2], 5, True), ([20], 6, True), ([4, 4], 8, True)]
    for (g, _, _), nxt in zip(by_tokens, by_tokens[1:]):
        assert len(g) == 1 or max(g) * len(g) <= 12  # within the budget (or one sample)
        assert max(g + nxt[0][:1]) * (len(g) + 1) > 12  # the next sample would not have fit
    assert groups(BatchLimit(size=2)) == [([5, 3], 1, True), ([9, 2], 3, True), ([2, 2], 5, True),
                                          ([20, 4], 7, True), ([4], 8, False)]  # fmt: skip
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        BatchLimit(size=1, tokens=0)


def drain(feeder: MicroBatchFeeder) -> list:
    batches, end = [], time.monotonic() + 30
    while (status := feeder.status()) != DRY:
        assert time.monotonic() < end
        if status == READY:
            batches.append(feeder.take())
        else:
            time.sleep(0.005)
    return batches


def test_feeder_token_budget_batches_skips_and_resume(tmp_path: Path) -> None:
    write_dir(tmp_path, [3, 4, 5, 3], nonfinite={"s2/2": float("nan")})
    build = functools.partial(make_micro_batch, dtype=torch.float32, num_anchors=4, seed=0, epoch=1)
    budget = 30

    def batches(state=None) -> tuple[list, MicroBatchFeeder]:
        s = stream(tmp_path, epoch=1, seed=2, shuffle=True)
        if state is not None:
            s.load_state_dict(state)
        feeder = MicroBatchFeeder(with_positions(s), 1, build, micro_batch_tokens=budget)
        try:
            return drain(feeder), feeder
        finally:
            feeder.close()

    got, feeder = batches()
    assert feeder.leftover == 0 and len(got) > 3
    keys = [k for b in got for k in b.keys]
    assert len(keys) == len(set(keys)) == 14  # every finite sample once, the last partial batch kept
    for b in got:
        b_size, s_len = b.input_ids.shape
        assert b_size == 1 or b_size * s_len <= budget
    assert got[-1].reader_state["skipped"] == {NONFINITE: 1} == feeder.skipped
    # resuming from a batch's recorded position rebuilds exactly the later batches
    k = len(got) // 2
    again, _ = batches(got[k].reader_state)
    assert [b.keys for b in again] == [b.keys for b in got[k + 1 :]]
