"""Target feature capture: which layer outputs, the argmax, the kernel path."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from dflash_dist.model.capture import capture_features, check_kernel_path, decoder_layers, gdn_kernel_path
from dflash_dist.model.config import build_target_layer_ids
from dflash_dist.tools.demo import DemoConfig, tiny_qwen35_target
from tests.helpers.capture import capture_config, make_capture_target, run_capture, write_conversations
from tests.helpers.writer_pool import (
    claim_and_wait,
    fail_unasked,
    pool_at_a_full_gate,
    pool_config,
    pool_pass,
    writer_pool,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen35():
    return tiny_qwen35_target(DemoConfig(target_layers=8))


def test_capture_picks_hidden_states_l_plus_1(qwen35):
    ids = torch.randint(0, 200, (2, 21))
    layer_ids = [1, 3, 5]
    cap = capture_features(qwen35, ids, layer_ids)
    with torch.no_grad():
        out = qwen35(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert cap.features.shape == (2, 21, 3 * qwen35.config.hidden_size)
    assert torch.equal(cap.features, want)
    off_by_one = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    assert not torch.allclose(cap.features, off_by_one)
    assert torch.equal(cap.target_argmax, out.logits.argmax(-1))
    assert cap.kernel_path == "torch" and gdn_kernel_path(qwen35) == "torch"


def test_last_layer_is_refused_and_every_other_hook_equals_hidden_states(qwen35):
    """Layer N-1 is where the hook (before the final norm) and hidden_states[N] (after it) part:
    refused with a message; on every other layer the two definitions agree exactly."""
    ids = torch.randint(0, 200, (1, 9))
    n = qwen35.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"layer id {n - 1} is the target's last decoder layer.*<= {n - 2}"):
        capture_features(qwen35, ids, [1, n - 1])
    raw = {}
    handle = decoder_layers(qwen35)[n - 1].register_forward_hook(
        lambda m, a, o: raw.update(h=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        out = qwen35(input_ids=ids, output_hidden_states=True)
    handle.remove()
    # the reason: HF's last entry is the final-normed output of layer N-1, the hook sees it raw
    assert not torch.allclose(raw["h"], out.hidden_states[n], atol=1e-3)
    assert torch.allclose(qwen35.model.norm(raw["h"]), out.hidden_states[n], atol=1e-5)
    layers = list(range(n - 1))
    cap = capture_features(qwen35, ids, layers)
    assert torch.equal(cap.features, torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1))
    assert max(build_target_layer_ids(n, 5)) == n - 3  # the default rule stays clear of it


def test_capture_any_hf_causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    layer_ids = build_target_layer_ids(6, 3)
    cap = capture_features(model, ids, layer_ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(cap.features, torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1))
    assert len(decoder_layers(model)) == 6
    assert cap.kernel_path == "torch"


def test_capture_rejects_bad_layer_ids(qwen35):
    with pytest.raises(ValueError, match="outside the target's 8 decoder layers"):
        capture_features(qwen35, torch.zeros(1, 4, dtype=torch.long), [1, 8])


def test_chunked_argmax_equals_full(qwen35):
    from dflash_dist.model.capture import chunked_argmax

    h = torch.randn(2, 37, qwen35.config.hidden_size)
    full = qwen35.lm_head(h).argmax(-1)
    assert torch.equal(chunked_argmax(h, qwen35.lm_head, chunk_tokens=5), full)


@pytest.mark.gpu
def test_cuda_capture_uses_fla_and_refuses_torch_path():
    assert torch.cuda.is_available()
    model = tiny_qwen35_target(DemoConfig(target_layers=8)).cuda()
    assert check_kernel_path(model) == "fla"
    cap = capture_features(model, torch.randint(0, 200, (1, 64), device="cuda"), [1, 3, 5])
    assert cap.kernel_path == "fla"


@pytest.mark.gpu
def test_cuda_writer_pool_starts_and_pins_when_torch_has_cached_the_whole_card(tmp_path, caplog):
    """After forwards of varied shapes a capture process's allocator can hold the whole card, reserved and unused
    (the 27B capture bench on an H100: 78.5 of 79.2 GiB, 50.1 in use), and the writer pool's side stream failed
    with "CUDA error: out of memory": the driver allocates a stream, and a pinned buffer's mappings, outside torch's
    cache. Here the cache is made to hold every byte torch can get; the pool starts, pins its buffer and writes
    the pass all the same (the cache given back to the driver first)."""
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest
    from dflash_dist.capture.driver_room import DRIVER_ROOM_BYTES

    assert torch.cuda.is_available()

    def fill_the_cache() -> None:  # every block torch can get, then all freed: reserved by its cache, unused
        blocks, size = [], 1 << 30
        while size >= 2 << 20:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                size //= 2
        del blocks
        free = torch.cuda.mem_get_info()[0]
        assert free < DRIVER_ROOM_BYTES, free

    caplog.set_level(logging.INFO, logger="dflash_dist.capture.driver_room")
    shards = tmp_path / "shards"
    features, argmax, attention, items = pool_pass(torch.Generator().manual_seed(0), ["a", "b"], [40, 30], 32)
    fill_the_cache()
    pool = writer_pool(shards, writers=1, min_group_tokens=8, shard_bytes=1 << 20, device="cuda")  # its stream
    try:
        fill_the_cache()  # again: the pass's buffer is made and pinned at its first submit
        pool.submit(features.cuda(), argmax.cuda(), attention.cuda(), items)
        counts = pool.close()
    except BaseException:
        pool.abort()
        raise
    given_back = [r for r in caplog.records if "given back to the driver" in r.getMessage()]
    assert len(given_back) == 2, [r.getMessage() for r in caplog.records]  # before the stream, before the pin
    assert counts.samples == 2
    written = {s.key: s for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)}
    assert sorted(written) == ["a", "b"] and torch.equal(written["b"].features, features[1, :30])
    assert torch.cuda.mem_get_info()[0] >= DRIVER_ROOM_BYTES  # the cache went back to the driver


def test_kernel_path_policy_refuses_torch_gdn_on_cuda_unless_allowed():
    from dflash_dist.model.capture import kernel_path_refusal

    reason = kernel_path_refusal("torch", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=False)
    assert reason and "allow_torch_gdn_on_cuda" in reason and "flash-linear-attention" in reason
    assert kernel_path_refusal("torch", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=True) is None
    assert kernel_path_refusal("fla", on_cuda=True, has_gdn=True, allow_torch_gdn_on_cuda=False) is None
    assert kernel_path_refusal("torch", on_cuda=False, has_gdn=True, allow_torch_gdn_on_cuda=False) is None
    assert kernel_path_refusal("torch", on_cuda=True, has_gdn=False, allow_torch_gdn_on_cuda=False) is None


# ---------------------------------------------------------------------------- CaptureJob on a saved target
@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    write_conversations(root / "train.jsonl", 24)
    return {"dir": make_capture_target(root / "target"), "jsonl": root / "train.jsonl", "root": root}


def test_pack_by_tokens_sorts_and_respects_the_budget():
    from dflash_dist.capture.capture_job import pack_by_tokens

    lengths = [5, 40, 12, 33, 7, 100, 12, 3]
    passes = pack_by_tokens(lengths, 80, batch_size=99)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))  # each exactly once
    assert passes[0] == [5]  # 100 > 80: alone
    for p in passes:
        assert len(p) == 1 or max(lengths[i] for i in p) * len(p) <= 80
        assert [lengths[i] for i in p] == sorted((lengths[i] for i in p), reverse=True)
    flat = [lengths[i] for p in passes for i in p]
    assert flat == sorted(lengths, reverse=True)  # longest first across passes
    assert pack_by_tokens(lengths, None, batch_size=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_token_budget_capture_equals_one_sequence_per_pass(saved_target, tmp_path):
    """Length-sorted passes under a token budget: the same keys and (to float rounding) the same
    features as capturing every sequence alone; the payload share of bytes on disk is measured."""
    from data_pipeline.chat_data import read_chat_jsonl
    from data_pipeline.ingest import sample_keys
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest

    one = capture_config(tmp_path / "one", saved_target["dir"], saved_target["jsonl"], batch_size=1)
    packed = capture_config(tmp_path / "packed", saved_target["dir"], saved_target["jsonl"], token_budget=600)
    r1, r2 = run_capture(one), run_capture(packed)
    assert r1.samples == r2.samples == 24 and r2.skipped == 0 and r2.shards >= 2

    def samples(cfg):
        shards = cfg.out / "shards"
        return {s.key: s for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)}

    a, b = samples(one), samples(packed)
    assert sorted(a) == sorted(b) == sorted(sample_keys(read_chat_jsonl(saved_target["jsonl"])))
    for key in a:
        assert torch.equal(a[key].input_ids, b[key].input_ids) and torch.equal(a[key].loss_mask, b[key].loss_mask)
        assert torch.allclose(a[key].features, b[key].features, atol=1e-4, rtol=1e-4)
        assert (a[key].target_argmax == b[key].target_argmax).float().mean() > 0.95
    lengths = [s.num_tokens for s in b.values()]
    assert max(lengths) > 2 * min(lengths)  # varied lengths: the packing had something to sort
    # bytes on disk: k*H*4 bytes of features per token plus, per sample, 5 tar members (header +
    # padding <= 1023 bytes each), npy headers, 9 bytes/token of ids/mask/argmax and meta.json
    records = read_manifest(packed.out / "shards")
    tokens, on_disk = sum(r.n_tokens for r in records), sum(r.n_bytes for r in records)
    payload = tokens * 2 * 64 * 4
    bound = payload + 9 * tokens + 24 * (5 * 1024 + 4 * 128 + 512) + len(records) * 10240
    print(f"\nH=64 fp32: feature payload {payload / on_disk:.1%} of {on_disk} bytes on disk")
    assert payload < on_disk <= bound


def test_nonfinite_samples_are_skipped_and_recorded_in_the_ledger(saved_target, tmp_path):
    from transformers import AutoTokenizer

    from data_pipeline.chat_data import ChatEncoder, read_chat_jsonl
    from data_pipeline.ingest import sample_keys
    from data_pipeline.ledger import captured_keys, read_skipped
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest

    tok = AutoTokenizer.from_pretrained(saved_target["dir"])
    enc = ChatEncoder(tok)
    seqs = [enc.encode(r).input_ids.tolist()[:256] for r in read_chat_jsonl(saved_target["jsonl"])]
    # a token some sequences hold and others do not
    counts = {t: sum(t in s for s in seqs) for t in range(300)}
    poison = min(counts, key=lambda t: abs(counts[t] - 6))
    keys = sample_keys(read_chat_jsonl(saved_target["jsonl"]))
    bad = {keys[i] for i, s in enumerate(seqs) if poison in s}
    assert 0 < len(bad) < 24
    target = make_capture_target(tmp_path / "poisoned", poison_token=poison)
    cfg = capture_config(tmp_path / "run", target, saved_target["jsonl"], token_budget=600)
    result = run_capture(cfg)
    shards = cfg.out / "shards"
    written = [k for r in read_manifest(shards) for k in r.keys]
    assert result.skipped == len(bad) and result.samples == 24 - len(bad)
    assert {r["key"] for r in read_skipped(shards)} == bad and not bad & set(written)
    assert all(r["reason"] == "nonfinite_features" for r in read_skipped(shards))
    for r in read_manifest(shards):
        assert all(torch.isfinite(s.features).all() for s in iter_shard_samples(shards / r.name))
    assert captured_keys(shards) == set(keys)
    again = run_capture(cfg)  # settled, skipped ones included: nothing is redone
    assert (again.samples, again.skipped, again.resumed) == (0, 0, 24)


def test_writer_processes_write_what_the_gpu_thread_writes(saved_target, tmp_path):
    """capture.writers=2: passes go through shared host buffers to two writer processes (their
    own shard prefixes, the ledger for non-finite samples); the shards hold exactly the samples,
    bytes for bytes, that the writing-on-the-capture-thread path writes, and a rerun resumes."""
    from data_pipeline.ledger import captured_keys, read_skipped
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest

    target = make_capture_target(tmp_path / "poisoned", poison_token=7)
    inline = capture_config(tmp_path / "inline", target, saved_target["jsonl"], token_budget=600)
    pooled = capture_config(tmp_path / "pooled", target, saved_target["jsonl"], token_budget=600, writers=2)
    r1, r2 = run_capture(inline), run_capture(pooled)
    assert (r2.samples, r2.skipped, r2.tokens) == (r1.samples, r1.skipped, r1.tokens) and r2.samples > 0

    def samples(cfg):
        shards = cfg.out / "shards"
        return {s.key: s for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)}

    a, b = samples(inline), samples(pooled)
    assert sorted(a) == sorted(b)
    for key in a:
        for name in ("input_ids", "loss_mask", "features", "target_argmax"):
            assert torch.equal(getattr(a[key], name), getattr(b[key], name)), (key, name)
        assert a[key].meta == b[key].meta
    names = [r.name for r in read_manifest(pooled.out / "shards")]
    assert {n.rsplit("-", 1)[0] for n in names} <= {"t000-w0", "t000-w1"} and len(names) == r2.shards
    skipped = [{r["key"] for r in read_skipped(c.out / "shards")} for c in (pooled, inline)]
    assert skipped[0] == skipped[1]
    assert captured_keys(pooled.out / "shards") == captured_keys(inline.out / "shards")
    again = run_capture(pooled)
    assert (again.samples, again.resumed) == (0, r1.samples + r1.skipped)
    assert not list(Path("/dev/shm").glob("dflash-capture-t000-*"))  # host buffers released


def test_fp8_features_halve_the_bytes_per_token_on_both_write_paths(saved_target, tmp_path):
    """capture.feature_dtype=fp8 on a bf16 target (H=768, k=3), captured for real: shard bytes per
    token at most 0.51x of bf16's; every decoded value within the scheme's bound of the bf16
    capture's (feature_codec.py); the writer processes' shards decode to the same values as the
    capture thread's; round_trip_features (for benches) gives exactly what a shard gives; the
    provenance names the encoding. The target's MLPs are 64 wide, not 2H: their width is in
    neither the features' bytes nor their bounds, and CPU bf16 matmuls of 2H took a minute."""
    from data_pipeline.feature_codec import FP8, RAW, fp8_error_bound
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest
    from data_pipeline.shard_writer import round_trip_features

    target = make_capture_target(tmp_path / "wide", hidden=768, intermediate=64)
    jsonl = tmp_path / "train.jsonl"  # 8 of the 24 conversations: the bytes per token and bounds are per token
    jsonl.write_text("".join(saved_target["jsonl"].read_text().splitlines(keepends=True)[:8]))
    dirs = {}
    for name, feature_dtype, writers in (("bf16", "bf16", 0), ("fp8", "fp8", 0), ("fp8_pool", "fp8", 2)):
        cfg = capture_config(tmp_path / name, target, jsonl, token_budget=600, shard_bytes=64 << 20,
                             layer_ids=[0, 1, 2], feature_dtype=feature_dtype, writers=writers)  # fmt: skip
        cfg.target.dtype = "bfloat16"
        assert run_capture(cfg).samples == 8
        dirs[name] = cfg.out / "shards"

    def per_token(shards):
        records = read_manifest(shards)
        return sum(r.n_bytes for r in records) / sum(r.n_tokens for r in records)

    def samples(shards):
        return {s.key: s for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)}

    ratio = per_token(dirs["fp8"]) / per_token(dirs["bf16"])
    print(f"\nfp8 / bf16 shard bytes per token: {ratio:.4f}")
    assert ratio <= 0.51
    assert {r.provenance.feature_encoding for r in read_manifest(dirs["fp8_pool"])} == {FP8}
    assert {r.provenance.feature_encoding for r in read_manifest(dirs["bf16"])} == {RAW}
    raw, fp8, pooled = samples(dirs["bf16"]), samples(dirs["fp8"]), samples(dirs["fp8_pool"])
    assert sorted(raw) == sorted(fp8) == sorted(pooled)
    for key, sample in raw.items():
        got = fp8[key].features
        assert got.dtype == torch.bfloat16 and got.shape == sample.features.shape
        assert ((got.float() - sample.features.float()).abs() <= fp8_error_bound(sample.features, 3)).all(), key
        assert torch.equal(pooled[key].features, got) and torch.equal(fp8[key].input_ids, sample.input_ids)
        assert torch.equal(round_trip_features(sample.features, "fp8", 3), got)
        assert torch.equal(round_trip_features(sample.features, "bf16", 3), sample.features)


# ---------------------------------------------------------------------------- WriterPool: a pass split over writers
def test_split_rows_cuts_contiguous_groups_with_the_least_largest_group():
    from dflash_dist.capture.host_sink import split_rows

    lengths = [3000, 4000, 2500, 3500, 4096, 2048, 3000, 2900, 4000, 3100]
    groups = split_rows(lengths, 4, 656)
    assert groups == [(0, 3), (3, 5), (5, 8), (8, 10)]  # 9500, 7596, 7948, 7100 tokens
    assert max(sum(lengths[a:b]) for a, b in groups) == 9500  # no 4 contiguous groups do better
    assert split_rows([300, 300, 300], 4, 656) == [(0, 3)]  # a small pass stays one job
    assert split_rows([700, 700, 700], 4, 656) == [(0, 1), (1, 2), (2, 3)]  # no more groups than rows
    assert split_rows([], 4, 1) == [(0, 0)]


def test_writer_pool_splits_each_pass_over_the_writers_and_writes_every_sample_once(tmp_path):
    """Three writers: a pass of 9 rows goes out as row groups to several writers (a small pass
    as one job); the shards hold every written key once with its ids, mask, features and argmax
    bytes; a row non-finite on a real token is skipped and in the ledger, one non-finite only in
    its padding is written; the counts add up; no tmp shard or host buffer is left."""
    from collections import Counter

    from data_pipeline.ledger import read_skipped
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest
    from dflash_dist.capture.host_sink import split_rows

    rng = torch.Generator().manual_seed(0)
    shard_dir = tmp_path / "shards"
    shapes = [[23, 41, 17, 35, 29, 50, 12, 44, 31], [5, 6, 4], [30, 28, 33, 26, 39, 21]]  # the 2nd: 15 tokens
    passes, want = [], {}
    for p, lengths in enumerate(shapes):
        keys = [f"p{p}r{r}" for r in range(len(lengths))]
        features, argmax, attention, items = pool_pass(rng, keys, lengths, 32)
        passes.append((features, argmax, attention, items))
        for r, (key, ids, mask, meta) in enumerate(items):
            n = lengths[r]
            want[key] = (torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8),
                         features[r, :n].clone(), argmax[r, :n].to(torch.int32), meta)
    passes[0][0][4, 3, 7] = float("nan")  # p0r4: a real token -> skipped
    passes[0][0][6, 20, 0] = float("inf")  # p0r6 is 12 tokens long: padding only -> written
    del want["p0r4"]
    pool = writer_pool(shard_dir, writers=3, min_group_tokens=16, shard_bytes=40_000)
    try:
        for features, argmax, attention, items in passes:
            pool.submit(features, argmax, attention, items)
        counts = pool.close()
    except BaseException:
        pool.abort()
        raise
    records = read_manifest(shard_dir)
    owner = {k: r.name.rsplit("-", 1)[0] for r in records for k in r.keys}
    assert Counter(k for r in records for k in r.keys) == dict.fromkeys(want, 1)  # each written key once, in one shard
    for p, lengths in enumerate(shapes):
        groups = split_rows(lengths, 3, 16)
        assert len(groups) == (1 if p == 1 else 3)
        by_group = [{owner[f"p{p}r{r}"] for r in range(a, b) if f"p{p}r{r}" in owner} for a, b in groups]
        assert all(len(w) == 1 for w in by_group), by_group  # a group is one writer's job
    assert len(set().union(*[{owner[f"p0r{r}"]} for r in range(9) if r != 4])) >= 2  # one pass, several writers
    seen = set()
    for r in records:
        for s in iter_shard_samples(shard_dir / r.name):
            ids, mask, features, argmax, meta = want[s.key]
            assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask), s.key
            assert torch.equal(s.features, features) and torch.equal(s.target_argmax, argmax), s.key
            assert s.meta == meta
            seen.add(s.key)
    assert seen == set(want)
    assert read_skipped(shard_dir) == [{"key": "p0r4", "reason": "nonfinite_features", "actor": 0}]
    assert (counts.samples, counts.skipped, counts.tokens) == (len(want), 1, sum(len(w[0]) for w in want.values()))
    assert (counts.shards, counts.bytes) == (len(records), sum(r.n_bytes for r in records)) and counts.shards > 3
    assert counts.jobs == 3 + 1 + 3
    assert not list(shard_dir.glob(".tmp*")) and not pool.buf_dir.exists()


@pytest.mark.parametrize("idle", [True, False])
def test_a_writer_without_work_hands_its_open_shard_to_the_disk(tmp_path, idle):
    """capture.writeback_idle: a writer process that has no job starts the disk write of its open
    shard (counted with its seconds, apart from its busy time); with false it leaves it to the
    kernel. The shard is the same either way."""
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest

    pool = writer_pool(tmp_path / "shards", writers=1, min_group_tokens=8, shard_bytes=1 << 20, writeback_idle=idle)
    try:
        keys = [f"r{r}" for r in range(6)]
        pool.submit(*pool_pass(torch.Generator().manual_seed(0), keys, [150] * 6, 32))  # ~70 kB: the shard stays open
        time.sleep(0.5)  # the writer finishes the pass and waits for the next
        counts = pool.close()
    except BaseException:
        pool.abort()
        raise
    (record,) = read_manifest(tmp_path / "shards")
    assert [s.key for s in iter_shard_samples(tmp_path / "shards" / record.name)] == keys
    if idle:
        assert counts.writebacks >= 1 and counts.writeback_s >= counts.writeback_max_s > 0
    else:
        assert counts.writebacks == 0 and counts.writeback_s == counts.writeback_max_s == 0


def test_close_releases_the_buffers_of_written_passes_while_the_writers_finish(tmp_path):
    """close() releases each host buffer once its pass is written, while it waits for the writers (unpinning a
    pass-sized buffer takes time on a GPU machine, which then no longer follows the last shard). The one writer is
    held at the full disk gate: a waits nowhere; b waits until a's shard is released; c, queued behind b, waits
    until b's is. Once close() has begun and b is written, b's buffer is gone while c's (a's, reused) is kept."""
    import threading

    from data_pipeline.disk_budget import BufferPolicy, release_consumed
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest

    shards = tmp_path / "shards"
    gate = {"max_buffer_bytes": 4096, "buffer_stall_s": 600}
    policy = BufferPolicy.from_config(pool_config(1024, writeback_idle=False, **gate)[0])
    pool = writer_pool(shards, writers=1, min_group_tokens=8, shard_bytes=1024, writeback_idle=False, **gate)
    closed: list = []

    def close() -> None:
        try:
            closed.append(pool.close())
        except BaseException as e:  # handed to the test thread
            closed.append(e)

    def wait(cond, what: str) -> None:
        deadline = time.time() + 60
        while not cond() and time.time() < deadline:
            time.sleep(0.02)
        assert cond(), what

    def release(name: str) -> None:  # as a trainer's checkpoint releases a shard it has read
        release_consumed(shards, policy, [{"epoch": 0, "consumed": [name]}], 0)

    closer = threading.Thread(target=close)
    try:
        pool.submit(*pool_pass(torch.Generator().manual_seed(0), ["a"], [40], 32))  # buffer 0
        wait(lambda: pool.counts.samples == 1, "a was not written")
        pool.submit(*pool_pass(torch.Generator().manual_seed(1), ["b"], [40], 32))  # buffer 1: closes a's shard
        pool.submit(*pool_pass(torch.Generator().manual_seed(2), ["c"], [30], 32))  # buffer 0 again, behind b
        wait(lambda: len(read_manifest(shards)) == 1, "a's shard was not listed")
        (first,) = read_manifest(shards)
        assert first.n_bytes > 4096  # the gate is full: b waits
        b_buf, c_buf = pool.bufs[1].path, pool.bufs[0].path
        closer.start()
        time.sleep(0.2)
        assert closer.is_alive() and b_buf.exists() and c_buf.exists()  # no pass written since close() began
        release(first.name)  # b is written, then c closes b's shard and waits at the gate
        wait(lambda: len(read_manifest(shards)) == 2, "b's shard was not listed")
        wait(lambda: not b_buf.exists(), "b's buffer was kept while close() waited")
        assert closer.is_alive() and c_buf.exists()
        release(read_manifest(shards)[1].name)
        closer.join(120)
        assert not closer.is_alive()
    except BaseException:
        for p in pool.procs:
            p.kill()
        if closer.is_alive() or closer.ident is not None:
            closer.join(60)  # its close() releases what is left
        else:
            pool.abort()
        raise
    (counts,) = closed
    assert not isinstance(counts, BaseException), counts
    assert counts.samples == 3 and not pool.buf_dir.exists()
    keys = [s.key for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)]
    assert sorted(keys) == ["a", "b", "c"]


def test_writer_pool_raises_on_close_when_one_group_of_a_pass_fails(tmp_path):
    """A pass split over two writers, its last row unwritable (an empty key): close() raises the
    writer's error; the other group's samples are in a listed shard, the failed writer's
    unfinished shard is deleted, the host buffers are released."""
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.capture.host_sink import split_rows

    lengths = [20, 22, 18, 25, 21, 19]
    keys = [f"k{r}" for r in range(5)] + [""]
    groups = split_rows(lengths, 2, 8)
    assert groups == [(0, 3), (3, 6)]
    shard_dir = tmp_path / "shards"
    pool = writer_pool(shard_dir, writers=2, min_group_tokens=8, shard_bytes=1 << 20)
    try:
        pool.submit(*pool_pass(torch.Generator().manual_seed(1), keys, lengths, 32))
        with pytest.raises(RuntimeError, match=r"capture writer failed: .*Sample\.key must be a non-empty string"):
            pool.close()
    except BaseException:
        pool.abort()
        raise
    assert [k for r in read_manifest(shard_dir) for k in r.keys] == ["k0", "k1", "k2"]
    assert not list(shard_dir.glob(".tmp*")) and not pool.buf_dir.exists()


def test_host_buffers_that_do_not_fit_their_shared_memory_are_refused_with_the_fix(tmp_path):
    """Host buffers larger than the shared memory they live in (a container's small /dev/shm): a
    pool whose buffers cannot all fit is refused before it starts a process, and a buffer made
    past the room is refused when made, naming the sizes and what to change, leaving no file (a
    sparse file would kill the first process to touch a page past the room: SIGBUS)."""
    from dflash_dist.capture.host_sink import HostBuffer, buffer_parent

    where = buffer_parent()
    tokens = (1 << 50) // 73  # 1 PiB at 64 + 9 bytes a token: past any /dev/shm, past ext4's file size
    fix = r"do not fit in .* GB free.*capture.writers \+ 1 buffers.*--shm-size"
    before = set(where.glob("dflash-capture-t009-*"))
    with pytest.raises(RuntimeError, match=fix):
        writer_pool(tmp_path / "shards", 2, None, 1 << 20, prefix="t009", tokens_hint=tokens)
    assert set(where.glob("dflash-capture-t009-*")) == before  # nothing claimed
    path = where / f"dflash-test-buffer-{os.getpid()}"
    with pytest.raises(RuntimeError, match=fix):
        HostBuffer(path, tokens, 4, 32, "bfloat16", create=True)
    assert not path.exists()


def test_host_buffers_of_a_killed_capture_are_removed_by_the_next_one_and_no_others(tmp_path):
    """A capture process killed with its host buffers in /dev/shm (SIGKILL, OOM) leaves them
    behind; the next pool on the machine removes them (their owner lock is free), and leaves those
    of a live pool, of this very process, and directories without a lock alone."""
    import multiprocessing as mp
    import signal

    from dflash_dist.capture.host_sink import claim_buffer_dir, release_buffer_dir

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    dead = ctx.Process(target=claim_and_wait, args=(str(tmp_path), ready))
    dead.start()
    assert ready.wait(60)
    (orphan,) = tmp_path.glob("dflash-capture-t001-*")
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(30)
    live, live_fd = claim_buffer_dir(tmp_path, "t002", sweep=True)
    unlocked = tmp_path / "dflash-capture-t003-old"
    unlocked.mkdir()
    mine, fd = claim_buffer_dir(tmp_path, "t004", sweep=True)
    assert not orphan.exists()
    assert live.is_dir() and unlocked.is_dir() and mine.is_dir()
    release_buffer_dir(mine, fd)
    release_buffer_dir(live, live_fd)
    assert not mine.exists() and not live.exists()
    # a directory released with a buffer still in it keeps its lock file: the next sweep takes it
    kept, kept_fd = claim_buffer_dir(tmp_path, "t005", sweep=True)
    (kept / "buf0-1").write_bytes(b"x")
    release_buffer_dir(kept, kept_fd)
    assert (kept / ".owner.lock").exists()
    _, fd = claim_buffer_dir(tmp_path, "t006", sweep=True)
    assert not kept.exists()
    os.close(fd)


def _exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_a_writer_waiting_at_the_disk_gate_stops_when_its_capture_process_is_killed(tmp_path):
    """A capture process SIGKILLed (OOM, a node agent) while its writer process waits at the full
    disk gate: the writer stops at its next poll instead of waiting for room (buffer_stall_s, an
    hour by default) and then writing a shard after the restarted capture read its ledger (those
    samples would be captured twice and the run refused)."""
    import contextlib
    import multiprocessing as mp
    import signal

    from data_pipeline.records import BUFFER_NAME, Sample
    from data_pipeline.shard_reader import read_manifest
    from data_pipeline.shard_writer import ShardWriter

    shards = tmp_path / "shards"
    with ShardWriter(shards, pool_config(1 << 20)[1], prefix="t009") as w:  # a listed shard: the 4 kB cap is full
        w.write(Sample("full", torch.arange(200, dtype=torch.int32), torch.ones(200, dtype=torch.uint8),
                       torch.zeros(200, 32, dtype=torch.bfloat16), torch.zeros(200, dtype=torch.int32)))
    assert read_manifest(shards)[0].n_bytes > 4096
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    capture = ctx.Process(target=pool_at_a_full_gate, args=(str(shards), pids))
    capture.start()
    writer = pids.get(timeout=120)
    try:
        # the writer took the job and waits at the gate: the gate writes buffer.json as it is entered, then polls
        deadline = time.time() + 120
        while not (shards / BUFFER_NAME).exists() and not _exited(writer) and time.time() < deadline:
            time.sleep(0.05)
        assert (shards / BUFFER_NAME).exists() and not _exited(writer)
        os.kill(capture.pid, signal.SIGKILL)
        capture.join(30)
        deadline = time.time() + 20
        while not _exited(writer) and time.time() < deadline:
            time.sleep(0.2)
        assert _exited(writer), "the writer kept waiting at the gate after its capture process died"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(writer, signal.SIGKILL)  # no orphan left behind if it did not stop
    assert [r.name for r in read_manifest(shards)] == ["t009-000000.tar"]  # it wrote nothing


def test_a_writer_that_failed_while_idle_is_reported_with_its_own_error():
    """A writer process that sent an error nobody asked for (it failed between jobs) and exited:
    the parent's next send finds the pipe closed and reports that error, not a killed process."""
    import multiprocessing as mp

    from dflash_dist.capture.host_sink import _send

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=fail_unasked, args=(child,))
    proc.start()
    proc.join(timeout=60)
    child.close()
    with pytest.raises(RuntimeError, match=r"^OSError: \[Errno 122\] Disk quota exceeded$"):
        for _ in range(100):  # a closed pipe can take a write or two into its buffer first
            _send(parent, proc, b"x" * 100_000)


def test_writer_pool_names_a_writer_process_that_died(tmp_path):
    """A writer process killed (as the OOM killer would) while the capture runs: the next submit or
    close() raises an error naming the process, its exit code and the likely causes, not a bare
    BrokenPipeError or EOFError; abort() (what capture_passes calls then) releases the buffers."""
    import signal

    pool = writer_pool(tmp_path / "shards", writers=2, min_group_tokens=8, shard_bytes=1 << 20)
    victim = pool.procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=30)
    gone = rf"capture writer failed: .*{victim.name} \(pid {victim.pid}\) ended without a reply, exit code -9"
    with pytest.raises(RuntimeError, match=gone):
        try:
            for p in range(8):  # each pass split over both writers: the dead one's group finds no reader
                rows = [f"p{p}r{r}" for r in range(4)]
                pool.submit(*pool_pass(torch.Generator().manual_seed(p), rows, [20] * 4, 32))
            pool.close()
        except BaseException:
            pool.abort()
            raise
    assert not pool.buf_dir.exists()
