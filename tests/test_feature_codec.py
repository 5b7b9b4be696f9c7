"""fp8 features (capture.feature_dtype=fp8, data_pipeline/feature_codec.py): the error bound of
the scheme, exact decoding, the provenance refusal between encodings, and a real shard written
and streamed in fp8. (A real capture through both write paths: tests/test_capture.py; a trainer
run on fp8 shards: tests/test_trainer.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_pipeline.feature_codec import E4M3_MAX, FP8, RAW, decode_fp8, encode_fp8, fp8_error_bound
from data_pipeline.provenance import ProvenanceMismatch
from data_pipeline.shard_reader import ShardStream, iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done, round_trip_features
from tests.helpers.shards import make_prov, make_sample, stream_keys


def spread_features(t: int, k: int, h: int, seed: int = 0) -> torch.Tensor:
    """bf16 [t, k*h] whose (token, layer) magnitudes span ~1e-8..1e8, with zero rows and a spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, h, generator=g) * torch.exp(torch.randn(t, k, 1, generator=g) * 6)
    x[1] = 0.0  # a whole token
    x[2, 1] = 0.0  # one layer of a token
    x[3, 0, 5] = 3e4  # a massive activation beside small values
    return x.reshape(t, k * h).to(torch.bfloat16)


def test_round_trip_error_within_the_bound_and_exact_in_bf16() -> None:
    x = spread_features(64, 3, 48)
    stored = encode_fp8(x, 3)
    assert stored.shape == (64, 3 * 49) and stored.dtype.name == "uint8"  # one exponent byte per (token, layer)
    as32, as16 = decode_fp8(stored, [64, 144], torch.float32, 3), decode_fp8(stored, [64, 144], torch.bfloat16, 3)
    assert torch.equal(as16.float(), as32)  # exact in bf16: nothing is lost in the trainer's dtype
    err, bound = (x.float() - as32).abs(), fp8_error_bound(x, 3)
    assert (err <= bound).all()
    assert (err[bound > 0] / bound[bound > 0]).max() > 0.5  # the bound is tight, not loose by orders
    assert torch.equal(as32[1], torch.zeros(144)) and torch.equal(as32[2, 48:96], torch.zeros(48))
    # each (token, layer)'s largest magnitude lands in e4m3's top binade (224, 448]
    scaled = x.float().reshape(64, 3, 48).abs().amax(-1)
    exps = torch.from_numpy(stored).reshape(64, 3, 49)[..., 0].contiguous().view(torch.int8).float()
    top = (scaled / torch.exp2(exps))[scaled > 0]
    assert bool(((top > E4M3_MAX / 2) & (top <= E4M3_MAX)).all())
    rel = (err.sum() / x.float().abs().sum()).item()
    print(f"\nfp8 mean relative error {rel:.4f}")
    assert rel < 1 / 32


def test_fp8_refuses_non_finite_features_and_bad_stored_shapes() -> None:
    x = spread_features(4, 2, 8)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        encode_fp8(x, 2)
    with pytest.raises(ValueError, match="multiple of the 3"):
        encode_fp8(spread_features(4, 2, 8), 3)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_fp8(encode_fp8(spread_features(4, 2, 8), 2), [4, 14], torch.float32, 2)


def test_fp8_shards_stream_decoded_and_other_encodings_are_refused(tmp_path: Path) -> None:
    prov = make_prov(feature_encoding=FP8)
    samples = [make_sample(f"k{i}", prov, T=6 + i, seed=i, finite=True) for i in range(4)]
    with ShardWriter(tmp_path, prov, prefix="f") as w:
        for s in samples:
            w.write(s)
    mark_done(tmp_path)
    (record,) = read_manifest(tmp_path)
    assert record.provenance.feature_encoding == FP8
    read = list(iter_shard_samples(tmp_path / record.name))
    for s, got in zip(samples, read, strict=True):
        assert got.features.dtype == torch.bfloat16  # the provenance dtype, decoded on read
        assert torch.equal(got.features, round_trip_features(s.features, "fp8", 2))
        assert ((got.features.float() - s.features.float()).abs() <= fp8_error_bound(s.features, 2)).all()
    assert stream_keys(ShardStream(tmp_path, prov, poll_s=0.01)) == ["k0", "k1", "k2", "k3"]
    with pytest.raises(ProvenanceMismatch, match="feature_encoding: expected 'raw', found 'fp8_e4m3_pow2'"):
        stream_keys(ShardStream(tmp_path, make_prov(), poll_s=0.01))  # a trainer whose config says bf16
    raw_dir = tmp_path / "raw"
    with ShardWriter(raw_dir, make_prov(), prefix="r") as w:
        w.write(samples[0])
    mark_done(raw_dir)
    with pytest.raises(ProvenanceMismatch, match="feature_encoding: expected 'fp8_e4m3_pow2', found 'raw'"):
        stream_keys(ShardStream(raw_dir, prov, poll_s=0.01))  # and the other way round
    assert make_prov().feature_encoding == RAW


def test_the_config_names_the_encoding_trainers_expect(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from dflash_dist.config import load_config_dict
    from dflash_dist.target.loading import expected_provenance, target_identity
    from tests.helpers.capture import make_capture_target
    from tests.helpers.config import UNREAD_TRAIN_PATH, config_from

    target = make_capture_target(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    for feature_dtype, encoding in (("bf16", RAW), ("fp8", FP8)):
        cfg = config_from({"target": {"path": str(target), "dtype": "float32", "device": "cpu"},
                           "data": {"train_path": UNREAD_TRAIN_PATH},
                           "capture": {"layer_ids": [1, 2], "feature_dtype": feature_dtype}})  # fmt: skip
        ident = target_identity(cfg, target)
        assert expected_provenance(cfg, target, ident, tokenizer).feature_encoding == encoding
    with pytest.raises(ValueError, match="feature_dtype"):
        load_config_dict({"capture": {"feature_dtype": "fp4"}})
